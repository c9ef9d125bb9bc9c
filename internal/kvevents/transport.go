package kvevents

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
)

// go-zeromq allocates a frame's declared size before reading it, so a
// publisher sending a header that claims a terabyte would take the router
// down. The replay exchange (a go-zeromq DEALER) therefore dials through a
// transport that reads the ZMTP 3 stream as it passes and closes the
// connection at the first frame over maxFrame bytes. (The live stream is
// read by zmtpSub, which checks each frame's size itself.)

const boundedTransport = "switchyard-kvev-tcp"

var registerBounded = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(boundedTransport, boundedDialer{})
})

type boundedDialer struct{}

type maxFrameKey struct{}

func (boundedDialer) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	limit, _ := ctx.Value(maxFrameKey{}).(int)
	if limit <= 0 {
		limit = 64 << 20
	}
	return &frameLimitConn{Conn: c, limit: uint64(limit), skip: 64}, nil
}

func (boundedDialer) Listen(context.Context, string) (net.Listener, error) {
	return nil, fmt.Errorf("kvevents: %s only dials", boundedTransport)
}

func (boundedDialer) Addr(ep string) (string, error) { return ep, nil }

// frameLimitConn tracks ZMTP framing on the bytes read: skip bytes of the
// current greeting or frame body remain, then a header (flags, then one
// size byte, or eight with the LONG flag).
type frameLimitConn struct {
	net.Conn
	limit uint64
	skip  uint64 // body bytes (or greeting bytes) still to pass
	hdr   [9]byte
	hlen  int // header bytes seen so far
}

func (c *frameLimitConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		if verr := c.scan(p[:n]); verr != nil {
			_ = c.Conn.Close()
			return 0, verr
		}
	}
	return n, err
}

func (c *frameLimitConn) scan(b []byte) error {
	for len(b) > 0 {
		if c.skip > 0 {
			k := min(c.skip, uint64(len(b)))
			c.skip -= k
			b = b[k:]
			continue
		}
		c.hdr[c.hlen] = b[0]
		c.hlen++
		b = b[1:]
		long := c.hdr[0]&0x02 != 0
		need := 2
		if long {
			need = 9
		}
		if c.hlen < need {
			continue
		}
		size := uint64(c.hdr[1])
		if long {
			size = binary.BigEndian.Uint64(c.hdr[1:9])
		}
		if size > c.limit {
			return fmt.Errorf("kvevents: ZMTP frame of %d bytes (limit %d)", size, c.limit)
		}
		c.skip, c.hlen = size, 0
	}
	return nil
}
