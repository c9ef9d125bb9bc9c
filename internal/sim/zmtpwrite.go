package sim

import (
	"context"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"

	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

// go-zeromq writes every frame of a message in two writes (its header,
// then its body): a KV event batch (topic, sequence, payload) left a
// publisher in six system calls and six TCP segments per subscriber, and
// woke the subscriber up to six times. vLLM's publisher (pyzmq over libzmq)
// writes a message's frames together. The publisher's sockets therefore
// use a transport whose connections hold a message's frames until its
// last one is complete and write them at once.

// coalescingTransport is the registered name of that transport: tcp.
const coalescingTransport = "simkv-tcp"

var registerCoalescing = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(coalescingTransport, coalescingTCP{transport.New("tcp")})
})

// coalescingEndpoint is a tcp:// endpoint through coalescingTransport
// (any other is returned as it is).
func coalescingEndpoint(ep string) string {
	if rest, ok := strings.CutPrefix(ep, "tcp://"); ok {
		return coalescingTransport + "://" + rest
	}
	return ep
}

type coalescingTCP struct{ tcp transport.Transport }

func (t coalescingTCP) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.tcp.Dial(ctx, d, addr)
	if err != nil {
		return nil, err
	}
	return newCoalescingConn(c), nil
}

func (t coalescingTCP) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.tcp.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return coalescingListener{l}, nil
}

func (t coalescingTCP) Addr(ep string) (string, error) { return t.tcp.Addr(ep) }

type coalescingListener struct{ net.Listener }

func (l coalescingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newCoalescingConn(c), nil
}

// maxHeld bounds what a connection holds: a larger message is written in
// parts.
const maxHeld = 256 << 10

// zmtpGreeting is the length of a ZMTP 3 greeting, which is not framed.
const zmtpGreeting = 64

// coalescingConn follows the ZMTP framing of what is written to it: the
// greeting passes through; a frame's bytes are held until a frame without
// the MORE flag (a message's last frame, or a command) is complete, and
// the held bytes are then written with one write.
type coalescingConn struct {
	net.Conn
	mu     sync.Mutex
	greet  int          // greeting bytes still to pass through
	held   []byte       // frames of the message being written
	frames zmtp.Scanner // the frames written after the greeting
}

func newCoalescingConn(c net.Conn) *coalescingConn {
	return &coalescingConn{Conn: c, greet: zmtpGreeting}
}

func (c *coalescingConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	if c.greet > 0 {
		k := min(c.greet, len(p))
		if _, err := c.Conn.Write(p[:k]); err != nil {
			return 0, err
		}
		c.greet -= k
		n, p = k, p[k:]
	}
	if len(p) == 0 {
		return n, nil
	}
	c.held = append(c.held, p...)
	if c.track(p) || len(c.held) >= maxHeld {
		_, err := c.Conn.Write(c.held)
		c.held = c.held[:0]
		if err != nil {
			return n, err
		}
	}
	return n + len(p), nil
}

// track advances the framing over b and reports whether b ended where a
// message (or command) does.
func (c *coalescingConn) track(b []byte) bool {
	_ = c.frames.Feed(b, nil) // no header callback, no error
	return c.frames.AtMessageEnd()
}
