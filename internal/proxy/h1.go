package proxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/switchyard-llm/switchyard/internal/fdpoll"
)

// H1Transport is the router's upstream client: plain HTTP/1.1 over pooled
// keep-alive connections, with no goroutine per connection or request. The
// calling goroutine writes the request (headers and a body of up to
// h1InlineBody bytes in one write) and reads the response itself; a
// request's context closes its connection when it is cancelled
// (context.AfterFunc), which unblocks any read or write in progress. A
// response body returns its connection to the pool when read to its end,
// and closes it when closed before.
//
// net/http's Transport runs a read and a write goroutine per connection,
// idle ones included (docs/BENCHMARKS.md, concurrency ceiling: they were
// two of the ≈7 goroutines per open PD stream). Requests it does not serve
// (another scheme than http, a body of unknown length, CONNECT or an
// upgrade) go to the wrapped net/http Transport.
type H1Transport struct {
	std         *http.Transport
	dial        func(ctx context.Context, network, addr string) (net.Conn, error)
	idleTimeout time.Duration
	maxIdle     int

	mu    sync.Mutex
	idle  map[string][]*h1Conn // by host:port, most recently used last
	sweep *time.Timer          // armed while idle connections exist

	pollOnce sync.Once
	poll     *fdpoll.Poller // RoundTripAsync's epoll set, started on first use
	closed   bool           // Close ran (under mu)

	resends atomic.Uint64
}

// h1ReadBuffer is a connection's read buffer while it reads: it holds a
// response head and SSE framing (a worker's events are a few hundred bytes;
// reads larger than the buffer bypass it). A connection takes one from
// h1ReadBufs only once its worker has sent something (waitReadable), and
// gives it back when it goes idle, so a connection that waits for a
// response (a prefill queued behind others, a decode waiting for its KV)
// or sits in the pool holds none: at thousands of open streams these
// buffers were much of the router's memory (docs/BENCHMARKS.md, section 3).
const h1ReadBuffer = 4 << 10

// h1BurstBuffer is a connection's read buffer while its worker sends
// faster than the connection is read: a read that fills the free space of
// the h1ReadBuffer (a decode bursting its token events, or a router behind
// on a busy machine) moves the connection's buffer to this size for the
// reads that follow, and a read smaller than h1ReadBuffer moves it back
// (h1Conn.resize). One read then takes a hundred-token burst that took
// eight; a paced stream (an event or a few per read) never leaves the
// small buffer. Only event streams move, and only while burstAllowed.
const h1BurstBuffer = 32 << 10

// h1ReadBufs and h1BurstBufs hold the read buffers, each in a
// bufio.Reader that serves as its carrier (see h1Conn.attach).
var (
	h1ReadBufs  = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, h1ReadBuffer) }}
	h1BurstBufs = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, h1BurstBuffer) }}
)

// h1InlineBody: bodies up to this size are written with the headers in one
// write.
const h1InlineBody = 64 << 10

// NewH1Transport returns the upstream client with the settings of
// NewTransport (which it wraps for the requests it does not serve).
func NewH1Transport(o TransportOptions) *H1Transport {
	std := NewTransport(o)
	return &H1Transport{std: std, dial: std.DialContext, idleTimeout: std.IdleConnTimeout,
		maxIdle: std.MaxIdleConnsPerHost, idle: map[string][]*h1Conn{}}
}

// CloseIdleConnections closes every pooled connection.
func (t *H1Transport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = map[string][]*h1Conn{}
	if t.sweep != nil {
		t.sweep.Stop()
		t.sweep = nil
	}
	t.mu.Unlock()
	for _, l := range idle {
		for _, c := range l {
			c.nc.Close()
		}
	}
	t.std.CloseIdleConnections()
}

// h1Conn is one upstream connection.
type h1Conn struct {
	nc net.Conn
	rc syscall.RawConn // nil: nc has no file descriptor (its buffer stays attached)
	// br is the connection's reader; http.ReadResponse's body readers keep
	// the pointer, so it never changes. Its buffer is attached (taken from
	// h1ReadBufs) while a response is read and detached (given back) when
	// nothing is buffered and the connection waits: a detached br is the
	// zero Reader and must not be read from. Only the goroutine reading the
	// connection attaches and detaches.
	br       *bufio.Reader
	spare    *bufio.Reader // while attached: the carrier the buffer came in
	attached bool
	// burst: the attached buffer is h1BurstBuffer's (else h1ReadBuffer's).
	// filled and lastN describe br's last read from the connection: it
	// filled the space it was given, and how much it read (resize).
	burst  bool
	filled bool
	lastN  int
	// readErr: a read from the connection failed, and br may hold the
	// error for its next read (resize leaves such a buffer alone). carry
	// is what resize moves from one buffer to the other, read back at once.
	readErr   bool
	carry     []byte
	addr      string
	idleSince time.Time

	// Made once per connection (a closure per call would be an allocation
	// per request): open's and waitReadable's RawConn.Read callbacks, the
	// former's result, and the request context's AfterFunc.
	peekIdleFn func(fd uintptr) bool
	readyFn    func(fd uintptr) bool
	alive      bool
	closeFn    func()

	// br reads from the connection itself (Read): through nc, except
	// inside waitReadable's callback, where it reads the descriptor
	// without blocking (rawFD, set while raw). rawErr is an error that
	// read met, for the next Read to return.
	raw    bool
	rawFD  int
	rawErr error
}

func newH1Conn(nc net.Conn, addr string) *h1Conn {
	c := &h1Conn{nc: nc, br: new(bufio.Reader), addr: addr}
	c.closeFn = func() { nc.Close() }
	if sc, ok := nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			c.rc = rc
			c.peekIdleFn = c.peekIdle
			c.readyFn = c.readAvailable
		}
	}
	if c.rc == nil {
		c.attach()
	}
	return c
}

// attach gives br a buffer from the pool (a no-op when it has one).
func (c *h1Conn) attach() {
	if c.attached {
		return
	}
	r := c.bufs().Get().(*bufio.Reader)
	*c.br = *r
	*r = bufio.Reader{}
	c.spare = r
	c.br.Reset(c)
	c.attached = true
}

// Read is br's source: nc, or the descriptor itself without blocking
// inside waitReadable's callback (where nc's own read lock is held).
func (c *h1Conn) Read(p []byte) (int, error) {
	if len(c.carry) > 0 { // resize's
		n := copy(p, c.carry)
		c.carry = c.carry[n:]
		return n, nil
	}
	if c.raw {
		for {
			n, err := syscall.Read(c.rawFD, p)
			switch {
			case err == syscall.EINTR:
				continue
			case err != nil:
				return 0, err
			case n == 0 && len(p) > 0:
				return 0, io.EOF
			}
			c.filled, c.lastN = n > 0 && n == len(p), n
			return n, nil
		}
	}
	if err := c.rawErr; err != nil {
		c.rawErr = nil
		return 0, err
	}
	n, err := c.nc.Read(p)
	c.filled, c.lastN = n > 0 && n == len(p), n
	c.readErr = c.readErr || err != nil
	return n, err
}

// detach gives br's buffer back to the pool when nothing is buffered in it
// (a no-op otherwise, and for a connection without a file descriptor).
func (c *h1Conn) detach() {
	if !c.attached || c.rc == nil || c.br.Buffered() > 0 {
		return
	}
	c.bufs().Put(c.takeBuffer())
	c.burst = false // the next response starts small
}

// takeBuffer detaches br's buffer, whatever it holds, and returns it in
// its carrier, for the caller to give back to its pool.
func (c *h1Conn) takeBuffer() *bufio.Reader {
	r := c.spare
	*r = *c.br
	r.Reset(nil)
	*c.br = bufio.Reader{}
	c.spare = nil
	c.attached = false
	return r
}

// bufs is the pool of the buffer size the connection reads with.
func (c *h1Conn) bufs() *sync.Pool {
	if c.burst {
		return &h1BurstBufs
	}
	return &h1ReadBufs
}

// resize moves an attached read buffer to h1BurstBuffer after a read that
// filled the space it was given, and back to h1ReadBuffer after a read
// smaller than that, with what it holds. A body's reader calls it between
// two reads, when nothing points into the buffer.
func (c *h1Conn) resize() {
	if !c.attached || c.rc == nil || c.readErr || c.burst == c.wantBurst() {
		return
	}
	k := c.br.Buffered()
	if c.burst && k > h1ReadBuffer {
		return // more than the small buffer holds
	}
	if k > 0 {
		c.carry, _ = c.br.Peek(k) // in the old buffer, kept out of its pool until read back
	}
	pool, old := c.bufs(), c.takeBuffer()
	c.burst = !c.burst
	c.attach()
	if k > 0 {
		_, _ = c.br.Peek(k) // Read gives back the carry, and only the carry
		c.carry = nil
	}
	pool.Put(old)
}

// wantBurst is the buffer size the last read asks for: the burst size
// after a full read, the small one after a read that fit it easily, and
// the current one otherwise.
func (c *h1Conn) wantBurst() bool {
	switch {
	case c.filled:
		return c.burst || burstAllowed()
	case c.lastN < h1ReadBuffer:
		return false
	}
	return c.burst
}

// waitReadable waits, without holding a read buffer, until the worker has
// sent something on the connection (or closed it, or the connection was
// closed: the read that follows reports that); what arrived is then in
// br. A read already buffered returns at once.
func (c *h1Conn) waitReadable() {
	c.detach()
	if c.attached {
		return
	}
	_ = c.rc.Read(c.readyFn)
	c.attach() // after an error the next read reports it
}

// readAvailable is waitReadable's RawConn.Read callback: it reads what the
// connection has into a buffer taken for it (one system call where a peek
// and the read after it were two); with nothing to read yet the buffer
// goes back and the goroutine parks. An error (the worker's close
// included) is kept for br's next read.
func (c *h1Conn) readAvailable(fd uintptr) bool {
	c.attach()
	c.raw, c.rawFD = true, int(fd)
	_, err := c.br.Peek(1)
	c.raw = false
	switch {
	case err == nil:
	case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK:
		c.detach()
		return false
	case err == io.EOF:
		c.rawErr = err
	default: // as nc's Read reports it
		c.rawErr = &net.OpError{Op: "read", Net: "tcp", Source: c.nc.LocalAddr(), Addr: c.nc.RemoteAddr(),
			Err: os.NewSyscallError("read", err)}
	}
	return true
}

// RoundTrip implements http.RoundTripper.
func (t *H1Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !served(req) {
		return t.std.RoundTrip(req)
	}
	ctx := req.Context()
	resp, err := t.roundTrip(ctx, req)
	return resp, ctxErr(ctx, err)
}

// RewindsBody reports whether rt may need req.GetBody: net/http's
// Transport rewinds a body to resend a request on a new connection;
// H1Transport never rewinds the requests it serves itself.
func RewindsBody(rt http.RoundTripper, req *http.Request) bool {
	_, h1 := rt.(*H1Transport)
	return !h1 || !served(req)
}

// served reports whether the transport serves req itself (not net/http's).
func served(req *http.Request) bool {
	return req.URL.Scheme == "http" && req.Method != http.MethodConnect && headerValue(req.Header, "Upgrade") == "" &&
		(req.Body == nil || req.Body == http.NoBody || req.ContentLength > 0)
}

// headerValue is h.Get(key) for a canonical key (without Get's
// canonicalization of it).
func headerValue(h http.Header, key string) string {
	if vs := h[key]; len(vs) > 0 {
		return vs[0]
	}
	return ""
}

// ctxErr is err, or the context's error once it ended (a cancelled
// request's connection was closed under it).
func ctxErr(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

func (t *H1Transport) roundTrip(ctx context.Context, req *http.Request) (*http.Response, error) {
	x, err := t.send(ctx, req)
	if err != nil {
		return nil, err
	}
	return x.receive()
}

// exchange is a request written on its connection, whose response is to
// be read.
type exchange struct {
	t    *H1Transport
	req  *http.Request
	c    *h1Conn
	stop abortOnDone // closes c when the context ends
	// mayResend: c came from the pool and req can be written again, so a
	// connection the worker turns out to have closed before answering is
	// not a failure of the request (see resend).
	mayResend bool
	// kept: the ResendableBody while mayResend, until the answer's first
	// byte (resend writes it again).
	kept ResendableBody
	// The response's body and its framing, allocated with the exchange.
	body h1Body
	lb   lengthBody
}

// h1TrustIdle: a connection back in the pool for less than this is reused
// without the system call that checks it is still open (a peek), when its
// request can be written again: should the worker have closed it, the
// request is resent on another connection (resend). A worker closes an
// idle keep-alive connection after seconds (uvicorn, which serves vLLM:
// 5 s), so under load, where the pool's most recent connection is
// microseconds old, the peek finds it open every time.
const h1TrustIdle = time.Second

// errStaleConn: the pooled connection a request was written on had been
// closed by the worker; nothing of an answer arrived.
var errStaleConn = errors.New("proxy: the worker had closed the pooled connection")

// send writes req on a pooled or new connection, and once more on a new
// one when the worker had closed the pooled one under the write.
func (t *H1Transport) send(ctx context.Context, req *http.Request) (*exchange, error) {
	kept := resendable(req)
	x, err := t.sendOnce(ctx, req, canResend(req, kept), kept)
	if err == errStaleConn {
		return t.resend(ctx, req, kept)
	}
	return x, err
}

// resend writes req again, with its body anew, on a connection checked to
// be open or a new one, without a second resend. A worker that closes a
// pooled connection without answering is taken not to have processed what
// arrived on it (it closed the connection as idle), as net/http's Transport
// takes it for a reused connection; net/http resends only what it knows
// unwritten or idempotent, where this resends any request whose body it
// can produce again, as the router's own retries would, but at once, on
// the same worker, without counting it against the worker.
func (t *H1Transport) resend(ctx context.Context, req *http.Request, kept ResendableBody) (*exchange, error) {
	t.resends.Add(1)
	r, err := rewound(req, kept)
	if err != nil {
		return nil, err
	}
	return t.sendOnce(ctx, r, false, nil)
}

// Resends is how many requests were written again after the worker had
// closed their pooled connection (resend).
func (t *H1Transport) Resends() uint64 { return t.resends.Load() }

// ResendableBody is a request body that can give itself again once read
// and closed. H1Transport keeps it until the answer's first byte, so that
// it can write the request once more should the worker have closed the
// pooled connection under it (resend), and so can reuse a pooled
// connection without the peek. Unlike GetBody, which a request carries
// for as long as it lives, it is only asked while the transport waits.
type ResendableBody interface {
	io.ReadCloser
	// Resendable reports, before the body is read, whether Reopen will
	// give it again (false: the connection gets the peek).
	Resendable() bool
	// Reopen is the whole body again, unread, even after Close.
	Reopen() io.ReadCloser
}

// resendable is req's body, when it is a ResendableBody that can be
// resent.
func resendable(req *http.Request) ResendableBody {
	if rb, ok := req.Body.(ResendableBody); ok && rb.Resendable() {
		return rb
	}
	return nil
}

// canResend reports whether req's body can be produced again after it was
// written: none, a kept ResendableBody (resendable), or one with GetBody.
func canResend(req *http.Request, kept ResendableBody) bool {
	return req.Body == nil || req.Body == http.NoBody || req.GetBody != nil || kept != nil
}

// rewound is req with its body anew (canResend said it can be): the kept
// body's, or GetBody's.
func rewound(req *http.Request, kept ResendableBody) (*http.Request, error) {
	r := *req
	switch {
	case kept != nil:
		r.Body = kept.Reopen()
	case req.Body != nil && req.Body != http.NoBody:
		nb, err := req.GetBody()
		if err != nil {
			return nil, fmt.Errorf("resending the request: its body: %w", err)
		}
		r.Body = nb
	}
	return &r, nil
}

// closedUnder reports whether err is what a write to, or the first read
// from, a connection the worker had closed meets.
func closedUnder(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// sendOnce writes req on a pooled or new connection; a pooled one is
// trusted without a peek when the request can be resent (trust).
func (t *H1Transport) sendOnce(ctx context.Context, req *http.Request, trust bool, kept ResendableBody) (*exchange, error) {
	closeBody := func() {
		if req.Body != nil {
			req.Body.Close()
		}
	}
	if err := ctx.Err(); err != nil {
		closeBody()
		return nil, err
	}
	addr := req.URL.Host
	if req.URL.Port() == "" {
		addr = net.JoinHostPort(req.URL.Hostname(), "80")
	}
	c, reused, err := t.get(ctx, addr, trust)
	if err != nil {
		closeBody()
		return nil, err
	}
	bp := h1Bufs.Get().(*[]byte)
	head, err := appendRequestHead((*bp)[:0], req)
	*bp = head[:0]
	if err != nil {
		h1Bufs.Put(bp)
		closeBody()
		t.put(c) // unused
		return nil, err
	}
	x := &exchange{t: t, req: req, c: c, mayResend: reused && trust}
	if x.mayResend {
		x.kept = kept
	}
	x.stop.set(ctx, c.closeFn)
	err = c.writeRequest(bp, head, req)
	h1Bufs.Put(bp) // not held while the response is awaited
	closeBody()
	if err != nil {
		if x.mayResend && ctx.Err() == nil && closedUnder(err) {
			x.fail(err)
			return nil, errStaleConn
		}
		return nil, x.fail(err)
	}
	if w, ok := ctx.(WroteRequester); ok {
		w.WroteRequest()
	}
	if tr := httptrace.ContextClientTrace(ctx); tr != nil && tr.WroteRequest != nil {
		tr.WroteRequest(httptrace.WroteRequestInfo{})
	}
	return x, nil
}

// WroteRequester is a request context that H1Transport tells, as
// httptrace's WroteRequest, once the request is written without an error.
// A trace would wrap the context in a value context, which hides the
// caller's own (in-place abort hooks); this keeps it.
type WroteRequester interface {
	WroteRequest()
}

// TellsWroteRequest reports whether rt calls a request context's
// WroteRequest (it is an H1Transport).
func TellsWroteRequest(rt http.RoundTripper) bool {
	_, ok := rt.(*H1Transport)
	return ok
}

func (x *exchange) fail(err error) error {
	x.stop.release()
	x.c.nc.Close()
	return err
}

// receive waits for the response and reads its head; when the worker had
// closed the pooled connection before answering, it resends the request
// (send) and reads that answer.
func (x *exchange) receive() (*http.Response, error) {
	resp, err := x.receiveOnce()
	if err != errStaleConn {
		return resp, err
	}
	ctx := x.req.Context()
	y, err := x.t.resend(ctx, x.req, x.kept)
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	return y.receiveOnce()
}

func (x *exchange) receiveOnce() (*http.Response, error) {
	c, req := x.c, x.req
	c.waitReadable()
	if x.mayResend && c.rawErr != nil && c.br.Buffered() == 0 && closedUnder(c.rawErr) && req.Context().Err() == nil {
		x.fail(c.rawErr)
		return nil, errStaleConn
	}
	x.kept = nil // an answer is arriving: no resend
	resp, ok := readHeadFast(c.br, req)
	if ok {
		setBodyIn(resp, c.br, &x.lb)
	} else {
		var err error
		if resp, err = readResponse(c.br, req); err != nil {
			return nil, x.fail(err)
		}
	}
	keep := !resp.Close && !req.Close && !strings.EqualFold(headerValue(req.Header, "Connection"), "close")
	b := &x.body // one allocation with the exchange
	b.t, b.c, b.rc, b.stop, b.keep = x.t, c, resp.Body, &x.stop, keep
	b.stream = resp.TransferEncoding != nil // chunked: an event stream
	if resp.Body == http.NoBody || resp.ContentLength == 0 {
		b.finish(true)
		resp.Body = http.NoBody
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

// readResponse reads the final response (skipping 1xx informational ones).
func readResponse(br *bufio.Reader, req *http.Request) (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, fmt.Errorf("reading the response: %w", err)
		}
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			return resp, nil
		}
	}
}

// excludedHeaders are written by appendRequestHead itself (as net/http's
// request writer does).
var excludedHeaders = map[string]bool{"Host": true, "User-Agent": true, "Content-Length": true,
	"Transfer-Encoding": true, "Trailer": true}

// appendRequestHead appends req's request line and headers to b.
func appendRequestHead(b []byte, req *http.Request) ([]byte, error) {
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	b = append(b, req.Method...)
	b = append(b, ' ')
	b = append(b, req.URL.RequestURI()...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, host...)
	b = append(b, "\r\n"...)
	if v, ok := req.Header["User-Agent"]; !ok {
		b = append(b, "User-Agent: Go-http-client/1.1\r\n"...)
	} else if len(v) > 0 && v[0] != "" {
		b = append(append(append(b, "User-Agent: "...), v[0]...), "\r\n"...)
	}
	switch m := req.Method; {
	case req.ContentLength > 0:
		b = append(b, "Content-Length: "...)
		b = strconv.AppendInt(b, req.ContentLength, 10)
		b = append(b, "\r\n"...)
	case m == http.MethodPost || m == http.MethodPut || m == http.MethodPatch:
		b = append(b, "Content-Length: 0\r\n"...)
	}
	if _, ok := req.Header["Connection"]; req.Close && !ok {
		b = append(b, "Connection: close\r\n"...)
	}
	for k, vs := range req.Header {
		if excludedHeaders[k] {
			continue
		}
		for _, v := range vs {
			if strings.ContainsAny(k, "\r\n: ") || strings.ContainsAny(v, "\r\n") {
				return nil, fmt.Errorf("invalid header %q", k)
			}
			b = append(b, k...)
			b = append(b, ": "...)
			b = append(b, v...)
			b = append(b, "\r\n"...)
		}
	}
	return append(b, "\r\n"...), nil
}

// h1Bufs holds request write buffers (head and inline body), shared by
// all connections so that idle ones hold none.
var h1Bufs = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}

// writeRequest writes the request head and its body of ContentLength
// bytes: in one write when the body is small. bp is head's pooled buffer.
func (c *h1Conn) writeRequest(bp *[]byte, head []byte, req *http.Request) error {
	n := req.ContentLength
	if req.Body == nil || req.Body == http.NoBody || n <= 0 {
		_, err := c.nc.Write(head)
		return err
	}
	if n <= h1InlineBody {
		total := len(head) + int(n)
		buf := head
		if cap(buf) < total {
			buf = make([]byte, len(head), total)
			copy(buf, head)
		}
		buf = buf[:total]
		*bp = buf[:0]
		if _, err := io.ReadFull(req.Body, buf[len(head):]); err != nil {
			return fmt.Errorf("http: ContentLength=%d with a shorter body: %w", n, err)
		}
		_, err := c.nc.Write(buf)
		return err
	}
	if _, err := c.nc.Write(head); err != nil {
		return err
	}
	w, err := io.CopyN(c.nc, req.Body, n)
	if err != nil && w < n {
		return fmt.Errorf("http: ContentLength=%d with a body of %d bytes: %w", n, w, err)
	}
	return nil
}

// get returns a pooled connection to addr that is still open, or dials one
// (reused: it came from the pool). With trust, a connection idle for less
// than h1TrustIdle is taken without the peek (send resends on another when
// the worker had closed it).
func (t *H1Transport) get(ctx context.Context, addr string, trust bool) (c *h1Conn, reused bool, err error) {
	now := time.Now()
	for {
		t.mu.Lock()
		l := t.idle[addr]
		if len(l) == 0 {
			t.mu.Unlock()
			break
		}
		c := l[len(l)-1]
		l[len(l)-1] = nil
		t.idle[addr] = l[:len(l)-1]
		t.mu.Unlock()
		idle := now.Sub(c.idleSince)
		if trust && idle < min(h1TrustIdle, t.idleTimeout) && c.rc != nil && !c.attached {
			return c, true, nil
		}
		if idle < t.idleTimeout && c.open() {
			return c, true, nil
		}
		c.nc.Close()
	}
	nc, err := t.dial(ctx, "tcp", addr)
	if err != nil {
		return nil, false, err
	}
	return newH1Conn(nc, addr), false, nil
}

// open reports whether an idle connection is still usable: the worker has
// neither closed it nor sent anything on it (a peek that would block).
func (c *h1Conn) open() bool {
	if c.attached && c.br.Buffered() > 0 {
		return false
	}
	if c.rc == nil {
		return true
	}
	c.alive = false
	err := c.rc.Read(c.peekIdleFn)
	return err == nil && c.alive
}

// peekIdle is open's RawConn.Read callback: alive when a peek would
// block. It never waits for readiness.
func (c *h1Conn) peekIdle(fd uintptr) bool {
	var one [1]byte
	n, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	c.alive = n < 0 && (err == syscall.EAGAIN || err == syscall.EWOULDBLOCK)
	return true
}

// put returns a connection to the pool (closing it when the pool is full).
func (t *H1Transport) put(c *h1Conn) {
	c.idleSince = time.Now()
	t.mu.Lock()
	l := t.idle[c.addr]
	if len(l) >= t.maxIdle || t.closed {
		t.mu.Unlock()
		c.nc.Close()
		return
	}
	t.idle[c.addr] = append(l, c)
	if t.sweep == nil {
		t.sweep = time.AfterFunc(t.idleTimeout, t.sweepIdle)
	}
	t.mu.Unlock()
}

// sweepIdle closes the connections idle for longer than idleTimeout (a
// worker closes its side soon after) and re-arms while any remain.
func (t *H1Transport) sweepIdle() {
	now := time.Now()
	var stale []*h1Conn
	t.mu.Lock()
	for addr, l := range t.idle {
		keep := l[:0]
		for _, c := range l {
			if now.Sub(c.idleSince) >= t.idleTimeout {
				stale = append(stale, c)
			} else {
				keep = append(keep, c)
			}
		}
		clear(l[len(keep):])
		if len(keep) == 0 {
			delete(t.idle, addr)
		} else {
			t.idle[addr] = keep
		}
	}
	t.sweep = nil
	if len(t.idle) > 0 {
		t.sweep = time.AfterFunc(t.idleTimeout/2, t.sweepIdle)
	}
	t.mu.Unlock()
	for _, c := range stale {
		c.nc.Close()
	}
}

// h1Body is a response body on a pooled connection.
type h1Body struct {
	t    *H1Transport
	c    *h1Conn
	rc   io.ReadCloser // http.ReadResponse's body: framing (length, chunks)
	stop *abortOnDone  // the exchange's
	keep bool          // the connection may be reused
	done atomic.Bool
	eof  atomic.Bool // done after a clean end
	// started: the first Read ran. It waits for the body's first byte
	// without a read buffer (a decode's first token can be seconds away,
	// behind the worker's queue and the KV transfer).
	started bool
	// stream: the body is chunked (an event stream): its reads may move
	// the connection's buffer between sizes (h1Conn.resize).
	stream bool
}

func (b *h1Body) Read(p []byte) (int, error) {
	if b.done.Load() {
		if b.eof.Load() {
			return 0, io.EOF
		}
		return 0, errBodyClosed
	}
	if !b.started {
		b.started = true
		b.c.waitReadable()
	} else if b.stream {
		b.c.resize()
	}
	n, err := b.rc.Read(p)
	switch {
	case err == nil:
	case errors.Is(err, io.EOF):
		b.finish(true)
	default:
		b.finish(false)
	}
	return n, err
}

var errBodyClosed = errors.New("http: read on closed response body")

// AwaitBody waits until the body's first byte has arrived, or its end or
// an error (the Read that follows returns it), when body is one of
// H1Transport's and was not read yet: the caller can then allocate its
// read buffer once there is something to read (a decode's first token may
// be seconds away). It returns how many bytes have arrived, its framing
// included (what the next Read can return at most without waiting), or -1
// for other bodies, which return at once.
func AwaitBody(body io.Reader) int {
	b, ok := body.(*h1Body)
	if !ok {
		return -1
	}
	if !b.started && !b.done.Load() {
		b.started = true
		b.c.waitReadable()
	}
	if b.done.Load() || !b.c.attached {
		return -1
	}
	return b.c.br.Buffered()
}

// BodyBuffered reports whether the rest of body has arrived in full, so
// that reading it cannot block and it needs no idle timeout: one of
// H1Transport's bodies not yet at its end, length-framed, whose remaining
// bytes are all in the read buffer (a short answer that came with its
// head), or a BufferedBody that says so. Only the goroutine reading body
// may call it.
func BodyBuffered(body io.Reader) bool {
	switch b := body.(type) {
	case *h1Body:
		if b.done.Load() {
			return false
		}
		lb, ok := b.rc.(*lengthBody)
		return ok && b.c.attached && int64(b.c.br.Buffered()) >= lb.left
	case BufferedBody:
		return b.Buffered()
	}
	return false
}

// BodyArrived reports, without waiting, whether some of body came with
// its head: one of H1Transport's bodies, not yet at its end, with bytes in
// the read buffer. A stream's first read then returns at once, so its
// flush can carry the head (Regular.respondHead). Only the goroutine
// reading body may call it.
func BodyArrived(body io.Reader) bool {
	b, ok := body.(*h1Body)
	return ok && !b.done.Load() && b.c.attached && b.c.br.Buffered() > 0
}

// BufferedBody is a body wrapping another that answers BodyBuffered for
// it (what it holds itself, and BodyBuffered of the wrapped body).
type BufferedBody interface {
	io.Reader
	Buffered() bool
}

// Close closes the connection unless the body was read to its end; it may
// run while a Read is blocked (the idle timeout) and unblocks it.
func (b *h1Body) Close() error {
	b.finish(false)
	return nil
}

// finish releases the connection once: back to the pool after a clean end
// (when the context did not close it meanwhile), closed otherwise.
func (b *h1Body) finish(clean bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	b.eof.Store(clean)
	if clean && b.stop.release() && b.keep && b.c.br.Buffered() == 0 {
		b.c.detach()
		b.t.put(b.c)
		return
	}
	b.stop.release()
	b.c.nc.Close()
}
