//go:build !czmq

package zmq

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

// The guarded transport sits between go-zeromq and TCP. go-zeromq v0.17.0
// trusts its peers in ways a port open to a fleet cannot afford:
//
//   - it allocates a frame's declared size before reading it (a 9-byte
//     header claiming a terabyte kills the process: out of memory);
//   - a READY command without a known Socket-Type, or with a truncated
//     property, panics in the accept goroutine (crash);
//   - it runs each ZMTP handshake synchronously in its single accept
//     goroutine without a deadline (one silent TCP client stops every later
//     connection), and leaks the socket when a handshake fails;
//   - it never answers ZMTP heartbeat PINGs on ROUTER sockets, so a libzmq
//     peer with ZMQ_HEARTBEAT_IVL/TIMEOUT set reconnects every timeout;
//   - a reader goroutine blocked on the socket's internal queue at Close
//     is never woken (goroutine leak).
//
// The guard parses the ZMTP 3 byte stream as it passes (greeting, READY,
// frame headers) without copying message bodies. It hands go-zeromq a
// connection only once the peer has sent its signature, validates the
// greeting and READY and passes on canonical versions of both, bounds frame
// and message sizes, applies a handshake deadline, answers and swallows
// PINGs, caps connections, and tracks which connection has handed go-zeromq
// a complete message it may still be pushing, so shutdown can drain exactly
// those. Violations close the connection and are counted as dropped
// messages. FuzzGuardedZMTP runs go-zeromq's own handshake and frame reader
// behind the guard on arbitrary input.

const (
	transportName = "switchyard-guarded-tcp"

	zmtpGreetingLen = 64
	maxFramesPerMsg = 16
	pongWriteLimit  = time.Second
)

// registerTransport registers the guarded transport with go-zeromq, whose
// transport table is process-global. Per-listener settings travel in the
// socket's context (see guardKey), so one registration serves every listener.
var registerTransport = sync.OnceValue(func() error {
	return zmq4.RegisterTransport(transportName, guardTransport{})
})

type guardKey struct{}

type guardTransport struct{}

func (guardTransport) Dial(ctx context.Context, d transport.Dialer, addr string) (net.Conn, error) {
	return d.DialContext(ctx, "tcp", addr)
}

func (guardTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	g, _ := ctx.Value(guardKey{}).(*guard)
	if g == nil {
		return nil, errors.New("zmq discovery: guarded transport used without a guard")
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	l := &guardListener{Listener: ln, g: g, ready: make(chan *guardConn), closed: make(chan struct{})}
	go l.acceptLoop()
	return l, nil
}

func (guardTransport) Addr(ep string) (string, error) {
	host, port, err := net.SplitHostPort(ep)
	if err != nil {
		return "", err
	}
	if host == "*" {
		host = ""
	}
	if port == "*" || port == "" {
		port = "0"
	}
	return net.JoinHostPort(host, port), nil
}

// guard holds one listener's limits and its live connections.
type guard struct {
	maxMsg    int // bytes of one message (sum of its frames) and of one command
	maxConns  int
	handshake time.Duration
	onDrop    func(reason, detail string) // safe for concurrent use

	pending atomic.Int64 // connections that handed go-zeromq a message it may be pushing

	mu     sync.Mutex
	conns  map[*guardConn]struct{}
	closed bool
	last   *guardConn // the connection most recently returned by Accept
	done   chan struct{}
}

func newGuard(maxMsg, maxConns int, handshake time.Duration, onDrop func(reason, detail string)) *guard {
	return &guard{
		maxMsg: maxMsg, maxConns: maxConns, handshake: handshake, onDrop: onDrop,
		conns: map[*guardConn]struct{}{}, done: make(chan struct{}),
	}
}

// track wraps an accepted connection; it returns nil (and closes c) when the
// guard is closed or full.
func (g *guard) track(c net.Conn) *guardConn {
	gc := &guardConn{Conn: c, g: g, br: bufio.NewReaderSize(c, 4096), greetLeft: zmtpGreetingLen}
	g.mu.Lock()
	closed, full := g.closed, len(g.conns) >= g.maxConns
	if !closed && !full {
		g.conns[gc] = struct{}{}
	}
	g.mu.Unlock()
	if closed || full {
		_ = c.Close()
		if full {
			g.onDrop(ReasonConnections, fmt.Sprintf("more than %d connections from %s", g.maxConns, c.RemoteAddr()))
		}
		return nil
	}
	_ = c.SetDeadline(time.Now().Add(g.handshake))
	return gc
}

func (g *guard) setLast(c *guardConn) {
	g.mu.Lock()
	g.last = c
	g.mu.Unlock()
}

func (g *guard) untrack(c *guardConn) {
	g.mu.Lock()
	delete(g.conns, c)
	g.mu.Unlock()
}

// releaseOrphan closes the previously accepted connection if its handshake
// did not complete: go-zeromq's accept loop runs the handshake between two
// Accept calls and abandons (without closing) a connection that fails it.
func (g *guard) releaseOrphan() {
	g.mu.Lock()
	c := g.last
	g.last = nil
	g.mu.Unlock()
	if c != nil && !c.ready.Load() {
		c.release()
	}
}

// closeAll refuses new connections and closes every live one. It does not
// clear pending marks: a go-zeromq reader goroutine that already holds a
// complete message will still push it onto the socket's queue, then either
// come back to Read or, having seen the cancelled context, Close the
// connection; either clears the mark. Shutdown drains the queue until no
// mark is left, and only then closes the socket (whose Close would also
// Close every connection and clear the marks too early).
func (g *guard) closeAll() {
	g.mu.Lock()
	if !g.closed {
		g.closed = true
		close(g.done)
	}
	conns := make([]*guardConn, 0, len(g.conns))
	for c := range g.conns {
		conns = append(conns, c)
	}
	g.mu.Unlock()
	for _, c := range conns {
		c.kill()
	}
}

func (g *guard) isClosed() bool {
	select {
	case <-g.done:
		return true
	default:
		return false
	}
}

// guardListener accepts in its own goroutine and hands go-zeromq only
// connections whose peer has sent the 10-byte ZMTP signature: go-zeromq runs
// each handshake synchronously in its single accept goroutine, so a silent
// TCP client (a port scanner, a half-open connection) would otherwise hold
// up every later connection until the handshake deadline.
type guardListener struct {
	net.Listener
	g         *guard
	ready     chan *guardConn
	closed    chan struct{}
	closeOnce sync.Once
}

func (l *guardListener) acceptLoop() {
	var backoff time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || l.g.isClosed() {
				return
			}
			// Transient (EMFILE): back off instead of spinning.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-l.closed:
				t.Stop()
				return
			}
			continue
		}
		backoff = 0
		if gc := l.g.track(c); gc != nil {
			go l.awaitSignature(gc)
		}
	}
}

// awaitSignature waits (within the handshake deadline) for the peer's first
// greeting bytes, then queues the connection for Accept.
func (l *guardListener) awaitSignature(c *guardConn) {
	if _, err := c.br.Peek(10); err != nil {
		_ = c.fail(c.handshakeErr("greeting", err))
		return
	}
	select {
	case l.ready <- c:
	case <-l.closed:
		c.release()
	case <-l.g.done:
		c.release()
	}
}

// Accept is called by go-zeromq's accept loop.
func (l *guardListener) Accept() (net.Conn, error) {
	l.g.releaseOrphan()
	select {
	case c := <-l.ready:
		l.g.setLast(c)
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	case <-l.g.done:
		return nil, net.ErrClosed
	}
}

func (l *guardListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// guardError is a protocol violation. It is a net.Error so go-zeromq marks
// the connection closed and removes it from its tables.
type guardError struct{ reason, detail string }

func (e *guardError) Error() string   { return "zmq discovery: " + e.reason + ": " + e.detail }
func (e *guardError) Timeout() bool   { return false }
func (e *guardError) Temporary() bool { return false }

var _ net.Error = (*guardError)(nil)

type guardConn struct {
	net.Conn
	g  *guard
	br *bufio.Reader

	// Parse state. go-zeromq reads a connection from one goroutine at a time
	// (its accept goroutine during the handshake, then one reader goroutine),
	// so these need no lock.
	greetLeft int    // greeting bytes not yet validated and queued
	awaitOK   bool   // greeting passed; the next frame must be READY
	out       []byte // queued bytes for go-zeromq: a greeting, a frame header, or a whole command
	buf       []byte // backing store reused for out
	outKind   outKind
	bodyLeft  uint64 // data-frame body bytes still to pass through after out
	msgBytes  int
	msgFrames int
	hdr       [9]byte

	ready atomic.Bool // READY handed to go-zeromq: the handshake will succeed

	mu      sync.Mutex // orders killed against pending
	killed  bool
	pending bool

	wmu       sync.Mutex // go-zeromq's handshake writes vs our PONGs
	closeOnce sync.Once
}

// outKind says what completes when the queued bytes (and body) are handed out.
type outKind uint8

const (
	outGreeting outKind = iota
	outReady            // the peer's READY: the handshake is over
	outPart             // a frame that is not the last of its message
	outLast             // the last frame of a message (or a passed-on command)
)

// Read hands go-zeromq the validated stream.
func (c *guardConn) Read(p []byte) (int, error) {
	c.setPending(false) // go-zeromq is back for more: it pushed its message
	if len(p) == 0 {
		return 0, nil
	}
	for {
		if c.isKilled() {
			return 0, c.fail(net.ErrClosed)
		}
		switch {
		case len(c.out) > 0:
			n := copy(p, c.out)
			c.out = c.out[n:]
			if len(c.out) == 0 && c.bodyLeft == 0 {
				if err := c.handedOut(); err != nil {
					return 0, c.fail(err)
				}
			}
			return n, nil
		case c.bodyLeft > 0:
			n, err := c.br.Read(p[:min(uint64(len(p)), c.bodyLeft)])
			c.bodyLeft -= uint64(n)
			if err == nil && c.bodyLeft == 0 {
				err = c.handedOut()
			}
			if err != nil {
				return 0, c.fail(err)
			}
			return n, nil
		}
		err := c.next()
		if err != nil && !c.ready.Load() && !isGuardError(err) {
			err = c.handshakeErr("handshake", err)
		}
		if err != nil {
			return 0, c.fail(err)
		}
	}
}

// next reads the greeting or the next frame header and queues what go-zeromq
// should see of it (nothing, for a swallowed PING).
func (c *guardConn) next() error {
	if c.greetLeft > 0 {
		return c.greeting()
	}
	flags, size, hl, err := c.frameHeader()
	if err != nil {
		return err
	}
	if flags&zmtp.FlagCommand != 0 {
		return c.command(flags, size, hl)
	}
	return c.dataFrame(flags, size, hl)
}

// greeting checks the peer's ZMTP greeting and queues a canonical one.
func (c *guardConn) greeting() error {
	var greet [zmtpGreetingLen]byte
	if _, err := io.ReadFull(c.br, greet[:]); err != nil {
		return err
	}
	// Signature 0xFF ... 0x7F, version 3.x, mechanism NULL. go-zeromq
	// abandons (without closing) a connection whose greeting it rejects,
	// so reject here and hand it a canonical greeting.
	if greet[0] != 0xFF || greet[9] != 0x7F || greet[10] < 3 {
		return c.handshakeErr("greeting", errors.New("not a ZMTP 3 greeting"))
	}
	if mech := string(bytes.TrimRight(greet[12:32], "\x00")); mech != "NULL" {
		return c.handshakeErr("greeting", fmt.Errorf("security mechanism %q (only NULL is supported)", clip(mech)))
	}
	if greet[32] > 1 {
		return c.handshakeErr("greeting", errors.New("bad as-server flag"))
	}
	clear(greet[33:]) // filler
	c.greetLeft = 0
	c.awaitOK = true
	c.queue(outGreeting, greet[:])
	return nil
}

// frameHeader reads a frame's flags and size into c.hdr and returns them
// with the header's length.
func (c *guardConn) frameHeader() (flags byte, size uint64, hl int, err error) {
	if flags, err = c.br.ReadByte(); err != nil {
		return 0, 0, 0, err
	}
	if flags&^(zmtp.FlagMore|zmtp.FlagLong|zmtp.FlagCommand) != 0 {
		return 0, 0, 0, c.violation(ReasonDecode, fmt.Sprintf("ZMTP frame flags 0x%02x", flags))
	}
	c.hdr[0] = flags
	if flags&zmtp.FlagLong != 0 {
		if _, err := io.ReadFull(c.br, c.hdr[1:9]); err != nil {
			return 0, 0, 0, err
		}
		return flags, binary.BigEndian.Uint64(c.hdr[1:9]), 9, nil
	}
	if c.hdr[1], err = c.br.ReadByte(); err != nil {
		return 0, 0, 0, err
	}
	return flags, uint64(c.hdr[1]), 2, nil
}

// command reads a command frame whole: the peer's READY is answered with
// a canonical one, a PING with a PONG, and any other command passes on.
func (c *guardConn) command(flags byte, size uint64, hl int) error {
	if flags&zmtp.FlagMore != 0 {
		return c.violation(ReasonDecode, "multipart ZMTP command")
	}
	if size > uint64(c.g.maxMsg) {
		return c.violation(ReasonOversized, fmt.Sprintf("ZMTP command of %d bytes", size))
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(c.br, body); err != nil {
		return err
	}
	switch {
	case c.awaitOK:
		ready, err := canonicalReady(body)
		if err != nil {
			return c.handshakeErr("READY", err)
		}
		c.awaitOK = false
		c.queue(outReady, zmtp.AppendFrameHeader(c.hdr[:0:len(c.hdr)], zmtp.FlagCommand, len(ready)), ready)
	case zmtp.IsCommand(body, "PING"):
		return c.pong(body)
	default:
		c.queue(outLast, c.hdr[:hl], body) // go-zeromq delivers a CmdMsg; the listener drops it
	}
	return nil
}

// dataFrame checks a message frame against the size and frame limits and
// queues its header; its body follows (bodyLeft).
func (c *guardConn) dataFrame(flags byte, size uint64, hl int) error {
	if c.awaitOK {
		return c.handshakeErr("READY", errors.New("data frame before READY"))
	}
	c.msgFrames++
	if size > uint64(c.g.maxMsg) || c.msgBytes+int(size) > c.g.maxMsg {
		return c.violation(ReasonOversized, fmt.Sprintf("message over %d bytes", c.g.maxMsg))
	}
	c.msgBytes += int(size)
	if c.msgFrames > maxFramesPerMsg {
		return c.violation(ReasonFrames, fmt.Sprintf("message of more than %d frames", maxFramesPerMsg))
	}
	kind := outPart
	if flags&zmtp.FlagMore == 0 {
		kind = outLast
		c.msgBytes, c.msgFrames = 0, 0
	}
	c.queue(kind, c.hdr[:hl])
	c.bodyLeft = size
	return nil
}

func (c *guardConn) queue(kind outKind, parts ...[]byte) {
	c.buf = c.buf[:0]
	for _, p := range parts {
		c.buf = append(c.buf, p...)
	}
	c.out = c.buf
	c.outKind = kind
	c.bodyLeft = 0
}

// handedOut runs when go-zeromq has been given everything queued.
func (c *guardConn) handedOut() error {
	switch c.outKind {
	case outReady:
		c.ready.Store(true)
		return c.Conn.SetDeadline(time.Time{}) // lift the handshake deadline
	case outLast:
		// go-zeromq now pushes the message onto its queue; mark the
		// connection pending until it comes back to Read (or Close).
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.killed {
			return net.ErrClosed
		}
		if !c.pending {
			c.pending = true
			c.g.pending.Add(1)
		}
	}
	return nil
}

func (c *guardConn) setPending(p bool) {
	c.mu.Lock()
	if c.pending != p {
		c.pending = p
		if p {
			c.g.pending.Add(1)
		} else {
			c.g.pending.Add(-1)
		}
	}
	c.mu.Unlock()
}

// pong answers a ZMTP 3.1 PING (name, 2-byte TTL, up to 16 bytes context)
// with a PONG echoing the context; the PING is not passed on.
func (c *guardConn) pong(ping []byte) error {
	var ctx []byte
	if len(ping) > 7 {
		ctx = ping[7:min(len(ping), 7+16)]
	}
	frame := make([]byte, 0, 2+5+len(ctx))
	frame = append(frame, zmtp.FlagCommand, byte(5+len(ctx)), 4, 'P', 'O', 'N', 'G')
	frame = append(frame, ctx...)
	c.wmu.Lock()
	defer c.wmu.Unlock()
	_ = c.Conn.SetWriteDeadline(time.Now().Add(pongWriteLimit))
	_, err := c.Conn.Write(frame)
	_ = c.Conn.SetWriteDeadline(time.Time{})
	return err
}

// Write serialises go-zeromq's writes (only the handshake on a receive-only
// ROUTER) with our PONGs.
func (c *guardConn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.Conn.Write(p)
}

// Close is go-zeromq giving the connection up: its reader goroutine exiting,
// or (after shutdown's drain) the socket closing.
func (c *guardConn) Close() error {
	c.release()
	return nil
}

func (c *guardConn) release() {
	c.closeConn()
	c.setPending(false)
}

func (c *guardConn) closeConn() {
	c.closeOnce.Do(func() {
		_ = c.Conn.Close()
		c.g.untrack(c)
	})
}

// kill closes the socket for shutdown but leaves the pending mark: the
// go-zeromq goroutine holding a message clears it when it comes back.
func (c *guardConn) kill() {
	c.mu.Lock()
	c.killed = true
	c.mu.Unlock()
	_ = c.Conn.Close()
}

func (c *guardConn) isKilled() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.killed
}

// fail closes the connection after a read error and returns the error.
func (c *guardConn) fail(err error) error {
	c.closeConn()
	return err
}

func (c *guardConn) violation(reason, detail string) error {
	c.g.onDrop(reason, detail+" from "+c.RemoteAddr().String()+"; connection closed")
	return &guardError{reason: reason, detail: detail}
}

func (c *guardConn) handshakeErr(stage string, err error) error {
	detail := "ZMTP " + stage + " from " + c.RemoteAddr().String() + ": " + err.Error()
	if !c.g.isClosed() { // not news while shutting down
		c.g.onDrop(ReasonHandshake, detail)
	}
	return &guardError{reason: ReasonHandshake, detail: detail}
}

func isGuardError(err error) bool {
	_, ok := errors.AsType[*guardError](err)
	return ok
}

// canonicalReady validates a READY command body and returns the READY
// go-zeromq is given instead: only Socket-Type and Identity, spelled as
// go-zeromq looks them up. go-zeromq parses properties with unchecked
// slicing, title-cases names (so "SoCket-TYpe" would not be found) and
// panics on a missing or unknown Socket-Type; passing the original bytes
// would leave it to interpret what the guard had validated.
func canonicalReady(body []byte) ([]byte, error) {
	if !zmtp.IsCommand(body, "READY") {
		return nil, errors.New("first command is not READY")
	}
	p := body[6:]
	sockType, identity, hasID := "", "", false
	for len(p) > 0 {
		kl := int(p[0])
		if kl == 0 || len(p) < 1+kl+4 {
			return nil, errors.New("truncated property")
		}
		name := string(p[1 : 1+kl])
		vl := binary.BigEndian.Uint32(p[1+kl : 1+kl+4])
		if uint64(vl) > uint64(len(p)-(1+kl+4)) {
			return nil, errors.New("truncated property value")
		}
		val := string(p[1+kl+4 : 1+kl+4+int(vl)])
		switch strings.ToLower(name) {
		case "socket-type":
			switch val {
			case "DEALER", "REQ", "ROUTER":
				sockType = val
			default:
				return nil, fmt.Errorf("peer socket type %q cannot talk to a ROUTER", clip(val))
			}
		case "identity":
			if len(val) > 255 {
				return nil, errors.New("identity longer than 255 bytes")
			}
			identity, hasID = val, true
		}
		p = p[1+kl+4+int(vl):]
	}
	if sockType == "" {
		return nil, errors.New("READY without Socket-Type")
	}
	out := append([]byte{5}, "READY"...)
	out = zmtp.AppendProperty(out, "Socket-Type", sockType)
	if hasID {
		out = zmtp.AppendProperty(out, "Identity", identity)
	}
	return out, nil
}
