package kvevents

import (
	"context"
	"fmt"
	"net"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"

	"github.com/switchyard-llm/switchyard/internal/zmtp"
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
	fc := &frameLimitConn{Conn: c, limit: uint64(limit)}
	fc.frames.Skip(64) // the greeting
	return fc, nil
}

func (boundedDialer) Listen(context.Context, string) (net.Listener, error) {
	return nil, fmt.Errorf("kvevents: %s only dials", boundedTransport)
}

func (boundedDialer) Addr(ep string) (string, error) { return ep, nil }

// frameLimitConn follows the ZMTP framing of the bytes read and refuses
// a frame over limit as soon as its header is read.
type frameLimitConn struct {
	net.Conn
	limit  uint64
	frames zmtp.Scanner
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
	return c.frames.Feed(b, c.check)
}

func (c *frameLimitConn) check(_ byte, size uint64) error {
	if size > c.limit {
		return fmt.Errorf("kvevents: ZMTP frame of %d bytes (limit %d)", size, c.limit)
	}
	return nil
}
