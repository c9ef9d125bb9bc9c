package h1server

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

const (
	readBufSize = 4 << 10
	// maxPostHandlerReadBytes is how much of an unread request body is
	// discarded to keep a connection, as net/http.
	maxPostHandlerReadBytes = 256 << 10
)

var readBufs = sync.Pool{New: func() any { b := make([]byte, readBufSize); return &b }}

// readBufsHeld and writeBufsHeld count the buffers connections hold now
// (for tests: an idle or waiting connection must hold none).
var readBufsHeld, writeBufsHeld atomic.Int64

// Connection states, as http.ConnState's new/active/idle; closing marks a
// connection Shutdown has closed while idle.
const (
	stateNew int32 = iota
	stateActive
	stateIdle
	stateClosing
)

// conn is one client connection. Only its serving goroutine reads it and
// touches its read buffer; state is shared with Shutdown.
type conn struct {
	s        *Server
	nc       net.Conn
	rc       syscall.RawConn // nil: no file descriptor (no idle parking, no watch)
	ctx      context.Context // the connection's context (base, server, local address)
	base     context.Context // BaseContext's result, for a hand-off
	state    atomic.Int32
	since    time.Time // when the connection was accepted
	buf      *[]byte   // read buffer; nil when released
	r, w     int       // buffered bytes are (*buf)[r:w]
	served   int       // requests served
	lastPOST bool
	hijacked bool
	remote   string                // RemoteAddr().String(), once
	deadline bool                  // the server set a read deadline
	watch    watch                 // the disconnect watch, reused by each request
	readFn   func(fd uintptr) bool // readAvailable, as waitReadable's callback

	// The requests' contexts (reqctx.go): the base seen without its
	// cancellation, the base's end followed once per connection, the
	// current request's context and its deadline timer.
	vctx     context.Context
	stopBase func() bool
	ctxMu    sync.Mutex
	cur      *reqCtx
	dlTimer  *time.Timer
	// handedOff: the fallback owns nc.
	handedOff bool
	// headDeadlineDue: a keep-alive request's ReadHeaderTimeout is set by
	// readHead when it has to wait for more of the head.
	headDeadlineDue bool
}

func newConn(s *Server, nc net.Conn, ctx, base context.Context) *conn {
	c := &conn{s: s, nc: nc, base: base, since: time.Now(), remote: nc.RemoteAddr().String()}
	c.ctx = context.WithValue(ctx, http.LocalAddrContextKey, nc.LocalAddr())
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
		}
	}
	return c
}

// closeIfIdle closes the connection if it is idle (or new and quiet for 5 s)
// and reports whether it did or it is already closing.
func (c *conn) closeIfIdle() bool {
	orig := c.state.Load()
	st := orig
	if st == stateNew && time.Since(c.since) > 5*time.Second {
		st = stateIdle
	}
	if st == stateClosing {
		return true
	}
	if st != stateIdle || !c.state.CompareAndSwap(orig, stateClosing) {
		return false
	}
	c.nc.Close()
	return true
}

// serve serves requests on the connection until it closes or is handed off.
func (c *conn) serve() {
	defer c.finish()
	for {
		if !c.awaitRequest() {
			return
		}
		n, ok := c.readHead()
		if !ok {
			return
		}
		h, fast := parseHead((*c.buf)[c.r : c.r+n])
		if !fast {
			c.handOff()
			return
		}
		c.r += n
		if !c.serveRequest(&h) {
			return
		}
		c.served++
	}
}

// finish closes the connection unless a handler hijacked it or the fallback
// owns it, and forgets it.
func (c *conn) finish() {
	c.s.trackConn(c, false)
	c.watch.release() // before the close: the descriptor's number may be reused
	c.stopCtx()
	if !c.hijacked && !c.handedOff {
		c.r = c.w // what is left unread goes with the connection
	}
	c.release()
	if !c.hijacked && !c.handedOff {
		c.nc.Close()
	}
}

// awaitRequest waits for the first byte of the next request, holding no read
// buffer when none is buffered, and arranges the head's read deadline. It
// reports false when the connection should close instead. As net/http, the
// first request's ReadHeaderTimeout runs from the accept; a keep-alive
// connection waits under IdleTimeout, then ReadHeaderTimeout runs from the
// first read its next request's head waits for (net/http: from that
// request's first byte).
func (c *conn) awaitRequest() bool {
	keepAlive := c.served > 0
	if keepAlive && (c.s.inShutdown.Load() || !c.state.CompareAndSwap(stateActive, stateIdle)) {
		return false
	}
	if !keepAlive {
		if d := c.s.ReadHeaderTimeout; d > 0 {
			c.setReadDeadline(time.Now().Add(d))
		}
	}
	// A keep-alive connection's deadlines: each one set replaces the one
	// before (the last request's, the handler's own), so a deadline is
	// cleared only where none is set next (one runtime timer change
	// instead of two). The head's own deadline is set only if reading it
	// waits (readHead): a head that arrived whole is parsed under the idle
	// one, which serveRequest clears.
	if c.buffered() == 0 {
		c.release()
		if d := c.s.idleTimeout(); keepAlive && d > 0 {
			c.setReadDeadline(time.Now().Add(d))
		} else if keepAlive {
			c.clearReadDeadline()
		}
		if !c.waitReadable() {
			return false
		}
	}
	if keepAlive {
		if !c.state.CompareAndSwap(stateIdle, stateActive) {
			return false // Shutdown closed it meanwhile
		}
		c.headDeadlineDue = true
	}
	return true
}

// setReadDeadline sets a read deadline the server owns.
func (c *conn) setReadDeadline(t time.Time) {
	_ = c.nc.SetReadDeadline(t)
	c.deadline = true
}

// clearReadDeadline removes the server's read deadline, if it set one.
func (c *conn) clearReadDeadline() {
	if c.deadline {
		_ = c.nc.SetReadDeadline(time.Time{})
		c.deadline = false
	}
}

// waitReadable parks until the connection is readable (or has an error, or
// its deadline passes: the read that follows reports it). A connection
// without a file descriptor returns at once.
func (c *conn) waitReadable() bool {
	if c.rc == nil {
		return true
	}
	if c.readFn == nil {
		c.readFn = c.readAvailable // once per connection
	}
	err := c.rc.Read(c.readFn)
	return err == nil
}

// readAvailable is waitReadable's RawConn.Read callback, called with no
// read buffer held: what the connection has is read into a buffer taken
// for it (one system call where a peek and the read after it were two);
// with nothing to read yet the buffer goes back and the goroutine parks.
func (c *conn) readAvailable(fd uintptr) bool {
	c.acquire()
	n, again := readNow(fd, (*c.buf)[c.w:])
	if again {
		c.release()
		return false
	}
	c.w += n
	return true
}

// acquire gives the connection a read buffer if it has none.
func (c *conn) acquire() {
	if c.buf == nil {
		c.buf = readBufs.Get().(*[]byte)
		c.r, c.w = 0, 0
		readBufsHeld.Add(1)
	}
}

// release gives the read buffer back when nothing is buffered in it.
func (c *conn) release() {
	if c.buf != nil && c.r == c.w {
		readBufs.Put(c.buf)
		readBufsHeld.Add(-1)
		c.buf = nil
		c.r, c.w = 0, 0
	}
}

func (c *conn) buffered() int { return c.w - c.r }

// fill reads once more from the connection into the buffer's free tail
// (moving the buffered bytes to the front first).
func (c *conn) fill() error {
	c.acquire()
	b := *c.buf
	if c.r > 0 {
		c.w = copy(b, b[c.r:c.w])
		c.r = 0
	}
	if c.w == len(b) {
		return errors.New("h1server: read buffer full")
	}
	n, err := c.nc.Read(b[c.w:])
	c.w += n
	if n > 0 {
		return nil
	}
	if err == nil {
		err = io.ErrNoProgress
	}
	return err
}

// readHead reads until the buffer holds a whole head and returns its length.
// ok false: the connection was closed or handed off (the head is malformed,
// too big, or ends in bare LFs: the fallback decides).
func (c *conn) readHead() (n int, ok bool) {
	c.acquire()
	c.skipPostCRLF()
	scanned := 0
	for {
		end, bad := scanHead((*c.buf)[c.r:c.w], scanned)
		switch {
		case bad:
			c.handOff()
			return 0, false
		case end > c.s.maxHeaderBytes():
			c.handOff()
			return 0, false
		case end > 0:
			return end, true
		case c.buffered() > c.s.maxHeaderBytes():
			c.handOff()
			return 0, false
		}
		scanned = c.buffered()
		if c.r == 0 && c.w == len(*c.buf) {
			c.handOff() // a head bigger than the buffer
			return 0, false
		}
		c.setHeadDeadline()
		if err := c.fill(); err != nil {
			c.readHeadFailed(err)
			return 0, false
		}
		c.skipPostCRLF()
	}
}

// setHeadDeadline starts a keep-alive request's ReadHeaderTimeout, once,
// before the first read its head waits for.
func (c *conn) setHeadDeadline() {
	if !c.headDeadlineDue {
		return
	}
	c.headDeadlineDue = false
	if d := c.s.ReadHeaderTimeout; d > 0 {
		c.setReadDeadline(time.Now().Add(d))
	} else {
		c.clearReadDeadline()
	}
}

// skipPostCRLF drops up to 4 CR/LF bytes sent after a POST body, a
// tolerance net/http has for old clients.
func (c *conn) skipPostCRLF() {
	if !c.lastPOST {
		return
	}
	for i := 0; i < 4 && c.r < c.w; i++ {
		if b := (*c.buf)[c.r]; b != '\r' && b != '\n' {
			c.lastPOST = false
			return
		}
		c.r++
	}
	if c.r == c.w {
		return // keep tolerating until a request byte arrives
	}
	c.lastPOST = false
}

// readHeadFailed decides what a read error while reading a head means: a
// clean close or timeout closes silently (as net/http); an EOF in the middle
// of a head is handed to net/http, which answers 400 as it would.
func (c *conn) readHeadFailed(err error) {
	if c.buffered() == 0 || errors.Is(err, os.ErrDeadlineExceeded) {
		return
	}
	if errors.Is(err, io.EOF) {
		c.handOff()
	}
}

// handOff gives the connection and its buffered bytes to the fallback.
func (c *conn) handOff() {
	var pending []byte
	if c.buffered() > 0 {
		pending = append([]byte(nil), (*c.buf)[c.r:c.w]...)
		c.r = c.w
	}
	c.release()
	c.clearReadDeadline()
	c.s.trackConn(c, false)
	c.handedOff = true
	c.s.handOff(&replayConn{Conn: c.nc, pending: pending, base: c.base})
}

// serveRequest builds the request for h, runs the handler and finishes the
// response. It reports whether the connection may serve another request.
func (c *conn) serveRequest(h *head) bool {
	c.headDeadlineDue = false
	c.clearReadDeadline()
	c.state.Store(stateActive)
	c.lastPOST = h.method == "POST"
	w := newResponse(c, h)
	req := w.req
	if req.Body == http.NoBody {
		c.release()
		w.startWatch()
	}
	ok := w.run(c.s.handler())
	c.endCtx(&w.ctx)
	return ok
}

// closeWriteAndWait half-closes the connection and gives the client a moment
// to read the response before the close (which may reset the connection
// when unread request bytes remain), as net/http does.
func (c *conn) closeWriteAndWait() {
	if cw, ok := c.nc.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	time.Sleep(500 * time.Millisecond)
}
