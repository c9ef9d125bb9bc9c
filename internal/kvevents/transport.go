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
// down. Subscriptions therefore dial through a transport that reads the
// ZMTP 3 stream as it passes and closes the connection at the first frame
// over maxFrame bytes: the subscriber sees a dropped connection, counts it,
// and reconnects.

const boundedTransport = "switchyard-kvev-tcp"

var registerBounded = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(boundedTransport, boundedDialer{})
})

type boundedDialer struct{}

type maxFrameKey struct{}

// connLostKey carries a func called once when the connection fails: a
// go-zeromq SUB socket does not report a lost connection to its reader,
// and the subscriber must know (the publisher may have restarted).
type connLostKey struct{}

func (boundedDialer) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	limit, _ := ctx.Value(maxFrameKey{}).(int)
	if limit <= 0 {
		limit = 64 << 20
	}
	lost, _ := ctx.Value(connLostKey{}).(func())
	return &frameLimitConn{Conn: c, limit: uint64(limit), skip: 64, lost: lost}, nil
}

func (boundedDialer) Listen(context.Context, string) (net.Listener, error) {
	return nil, fmt.Errorf("kvevents: %s only dials", boundedTransport)
}

func (boundedDialer) Addr(ep string) (string, error) { return ep, nil }

// frameLimitConn tracks ZMTP framing on the bytes read: skip bytes of the
// current greeting or frame body remain, then a header (flags, then one
// size byte, or eight with the LONG flag).
//
// It also buffers what it reads. go-zeromq reads a message frame by frame,
// each header and each body with its own io.ReadFull on the connection: a
// KV event batch (topic, sequence, payload) took six or seven read system
// calls, and a reader that found a frame not yet arrived parked and was
// woken again inside one message. One read of up to readBufSize now serves
// all the frames that have arrived. Reads at least that large go straight
// to the connection.
type frameLimitConn struct {
	net.Conn
	limit uint64
	skip  uint64 // body bytes (or greeting bytes) still to pass
	hdr   [9]byte
	hlen  int // header bytes seen so far
	lost  func()
	once  sync.Once

	buf  []byte // read ahead, scanned; buf[r:w] not yet returned
	r, w int
}

// readBufSize is the read-ahead of a subscription's connection: a batch
// of a few hundred blocks' events fits.
const readBufSize = 32 << 10

func (c *frameLimitConn) fail() {
	if c.lost != nil {
		c.once.Do(c.lost)
	}
}

func (c *frameLimitConn) Read(p []byte) (int, error) {
	if c.r < c.w {
		n := copy(p, c.buf[c.r:c.w])
		c.r += n
		return n, nil
	}
	if len(p) >= readBufSize {
		return c.readScanned(p)
	}
	if c.buf == nil {
		c.buf = make([]byte, readBufSize)
	}
	n, err := c.readScanned(c.buf)
	c.r, c.w = 0, n
	k := copy(p, c.buf[:n])
	c.r = k
	if k < n {
		// The rest is served by the next reads; an error waits until
		// then (the connection reports it again).
		return k, nil
	}
	return k, err
}

// readScanned reads from the connection into p and checks the framing of
// what arrived; a frame over the limit closes the connection.
func (c *frameLimitConn) readScanned(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		if verr := c.scan(p[:n]); verr != nil {
			_ = c.Conn.Close()
			c.fail()
			return 0, verr
		}
	}
	if err != nil {
		c.fail()
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
