package sim

import (
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
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
	mu      sync.Mutex
	greet   int    // greeting bytes still to pass through
	held    []byte // frames of the message being written
	skip    uint64 // body bytes of the current frame not yet written
	hdr     [9]byte
	hlen    int  // header bytes of the next frame seen so far
	more    bool // the current frame has the MORE flag
	inFrame bool // a frame's header was complete: skip counts its body
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
	for len(b) > 0 {
		if c.inFrame {
			k := min(c.skip, uint64(len(b)))
			c.skip -= k
			b = b[k:]
			if c.skip == 0 {
				c.inFrame = false
			}
			continue
		}
		c.hdr[c.hlen] = b[0]
		c.hlen++
		b = b[1:]
		need := 2
		if c.hdr[0]&0x02 != 0 { // LONG
			need = 9
		}
		if c.hlen < need {
			continue
		}
		c.skip = uint64(c.hdr[1])
		if need == 9 {
			c.skip = binary.BigEndian.Uint64(c.hdr[1:9])
		}
		c.more = c.hdr[0]&0x01 != 0 && c.hdr[0]&0x04 == 0 // a command has no MORE
		c.hlen = 0
		c.inFrame = c.skip > 0
	}
	return !c.inFrame && c.hlen == 0 && !c.more
}
