package h1server

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// outBufSize holds the head and two framed stages, so a relayed 4 KiB
	// read goes out in one write where 4 KiB took two (docs/BENCHMARKS.md
	// §27: PD and regular streams of bursts, 4-17 % less router CPU).
	outBufSize   = 8 << 10
	stageBufSize = 2 << 10 // what net/http buffers before it chooses Content-Length or chunking
)

// wbuf holds a response's pending bytes: stage is body not yet framed (at
// most stageBufSize, as net/http's response buffer, so the Content-Length /
// chunking choice and chunk sizes are net/http's), out is framed bytes not
// yet written to the connection.
type wbuf struct {
	out   []byte
	stage []byte
	// vec is writeFrame's list of pieces, kept here so that handing it to
	// net.Buffers.WriteTo allocates nothing.
	vec  net.Buffers
	arr  [4][]byte
	size [20]byte // a chunk's size line
}

var wbufs = sync.Pool{New: func() any {
	return &wbuf{out: make([]byte, 0, outBufSize), stage: make([]byte, 0, stageBufSize)}
}}

// response is the fast path's http.ResponseWriter.
type response struct {
	c    *conn
	req  *http.Request
	body *body  // nil: no request body
	ctx  reqCtx // the request's context

	handlerHeader http.Header
	snap          http.Header // the header as of WriteHeader; owned
	calledHeader  bool
	wroteHeader   bool // the handler's final status is known
	headSent      bool // the head is in out (or written)
	headOnly      bool // the head was framed at WriteHeader and nothing since
	chunking      bool
	handlerDone   bool
	fullDuplex    bool
	hijacked      bool
	closeAfter    bool
	bodyLimitHit  bool

	status                 int
	contentLength, written int64 // contentLength -1: unknown
	isHEAD                 bool
	wantsClose             bool
	keepAlive10            bool
	minor                  int

	trailerKeys []string // declared by the Trailer header

	wb  *wbuf
	err error // first write error
}

// newResponse makes the response to h and its request (w.req), whose
// context is w.ctx.
func newResponse(c *conn, h *head) *response {
	w := &response{
		c: c, contentLength: -1,
		isHEAD: h.method == "HEAD", wantsClose: h.wantsClose, keepAlive10: h.keepAlive10, minor: h.minor,
	}
	w.req = c.newRequest(h, &w.ctx)
	if b, ok := w.req.Body.(*body); ok {
		w.body = b
		b.setOnEOF(w)
	}
	return w
}

// startWatch starts the disconnect watch, unless the connection has no file
// descriptor, the client already sent more (a pipelined request) or the
// handler has returned.
func (w *response) startWatch() {
	if w.c.rc == nil || w.c.buffered() > 0 || w.hijacked || w.handlerDone {
		return
	}
	w.c.watch.start(w.c.s.poll, w.c.rc, &w.ctx)
}

// run calls the handler and finishes the response; it reports whether the
// connection may serve another request.
func (w *response) run(h http.Handler) (keep bool) {
	defer func() {
		if v := recover(); v != nil {
			keep = w.panicked(v)
		}
	}()
	h.ServeHTTP(w, w.req)
	if w.body != nil {
		w.body.setOnEOF(nil) // a body read from now on starts no watch
	}
	w.handlerDone = true
	w.c.watch.stop()
	if w.hijacked {
		return false
	}
	w.finish()
	keep = w.reusable()
	if !keep && (w.bodyLimitHit || (w.body != nil && w.body.closedEarly())) {
		w.c.closeWriteAndWait()
	}
	return keep
}

// panicked handles a handler panic: log (unless http.ErrAbortHandler), send
// what was already framed, and close the connection.
func (w *response) panicked(v any) bool {
	if w.body != nil {
		w.body.detach()
	}
	w.handlerDone = true
	w.c.watch.stop()
	if v != http.ErrAbortHandler {
		buf := make([]byte, 64<<10)
		buf = buf[:runtime.Stack(buf, false)]
		w.c.s.logf("http: panic serving %v: %v\n%s", w.req.RemoteAddr, v, buf)
	}
	if w.hijacked {
		return false
	}
	if w.wb != nil {
		if w.headOnly { // as if framed lazily: nothing was to be sent yet
			w.wb.out = w.wb.out[:0]
		}
		w.flushOut()
		w.wb.stage = w.wb.stage[:0]
		w.releaseW()
	}
	return false
}

// finish completes the response after the handler returned.
func (w *response) finish() {
	w.handlerDone = true
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	w.acquireW()
	w.flushStage()
	if !w.headSent {
		w.writeHead(nil)
	}
	if w.chunking {
		w.outString("0\r\n")
		if t := w.finalTrailers(); t != nil {
			_ = t.Write(outWriter{w})
		}
		w.outString("\r\n")
	}
	w.flushOut()
	w.releaseW()
	if w.body != nil {
		w.body.Close()
	}
}

// reusable reports whether the connection can serve another request.
func (w *response) reusable() bool {
	if w.closeAfter || w.err != nil {
		return false
	}
	declared := !w.isHEAD && w.contentLength != -1 && bodyAllowed(w.status)
	if declared && w.contentLength != w.written {
		return false
	}
	return w.body == nil || !w.body.closedEarly()
}

// Header returns the response header map.
func (w *response) Header() http.Header {
	if w.handlerHeader == nil {
		w.handlerHeader = make(http.Header)
	}
	w.calledHeader = true
	return w.handlerHeader
}

// WriteHeader sends (lazily, with the first body bytes or at the end) the
// status and header; 1xx other than 101 are sent at once.
func (w *response) WriteHeader(code int) {
	switch {
	case w.hijacked:
		w.c.s.logf("http: response.WriteHeader on hijacked connection from %s", caller())
		return
	case w.wroteHeader:
		w.c.s.logf("http: superfluous response.WriteHeader call from %s", caller())
		return
	case code < 100 || code > 999:
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	case code < 200 && code != http.StatusSwitchingProtocols:
		w.writeInformational(code)
		return
	}
	w.wroteHeader, w.status = true, code
	if w.calledHeader && w.headDecided() {
		// Nothing to come changes the head: it is framed now, from the
		// handler's header as it is, which so needs no snapshot.
		w.snap = w.handlerHeader
		w.acquireW()
		w.writeHead(nil)
		w.headOnly = true
		return
	}
	if w.calledHeader {
		w.snap = w.handlerHeader.Clone()
	}
	if cl := w.snap.Get("Content-Length"); cl != "" {
		v, err := strconv.ParseInt(cl, 10, 64)
		if err == nil && v >= 0 {
			w.contentLength = v
		} else {
			w.c.s.logf("http: invalid Content-Length of %q", cl)
			// As net/http: dropped from the handler's map, not from the
			// snapshot, so the head has no automatic Content-Length.
			w.handlerHeader.Del("Content-Length")
		}
	}
}

// headDecided reports whether the head can be framed at WriteHeader from
// the handler's header as it is, which must then be neither read later
// nor edited by the head's rules: a status with a body, not HEAD, a
// Content-Type (nothing to sniff) and one valid Content-Length (no
// automatic one at the handler's end, no chunking), no Transfer-Encoding,
// Connection or trailers, and the request body read to its end (framing
// the head settles it). It sets the response's Content-Length when so.
func (w *response) headDecided() bool {
	h := w.handlerHeader
	if w.isHEAD || !bodyAllowed(w.status) || (w.body != nil && !w.body.consumed()) {
		return false
	}
	cl := h["Content-Length"]
	if _, ok := h["Content-Type"]; !ok || len(cl) != 1 {
		return false
	}
	for k := range h {
		switch {
		case k == "Transfer-Encoding", k == "Connection", k == "Trailer", strings.HasPrefix(k, http.TrailerPrefix):
			return false
		}
	}
	v, err := strconv.ParseInt(cl[0], 10, 64)
	if err != nil || v < 0 {
		return false
	}
	w.contentLength = v
	return true
}

// caller names the handler code that called into the ResponseWriter.
func caller() string {
	_, file, line, ok := runtime.Caller(2)
	if !ok {
		return "unknown"
	}
	return file + ":" + strconv.Itoa(line)
}

var excludedNoBody = map[string]bool{"Content-Length": true, "Transfer-Encoding": true}

func (w *response) writeInformational(code int) {
	w.acquireW()
	w.outStatusLine(code)
	_ = w.handlerHeader.WriteSubset(outWriter{w}, excludedNoBody)
	w.outString("\r\n")
	w.flushOut()
	w.releaseW()
}

// Write buffers p as body bytes (at most stageBufSize before framing).
func (w *response) Write(p []byte) (int, error) {
	if err := w.admit(len(p)); err != nil || len(p) == 0 {
		return 0, err
	}
	return stageWrite(w, p, true)
}

// sniffLen is how much http.DetectContentType looks at.
const sniffLen = 512

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// ReadFrom copies src into the body as net/http's ResponseWriter does on a
// TCP connection: while the head is not sent, the first 512 bytes are
// written and, if src had that many, the head goes out at once (so the
// response is chunked, or close-delimited for HTTP/1.0); the rest is copied
// through Write.
func (w *response) ReadFrom(src io.Reader) (int64, error) {
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	if w.hijacked {
		return 0, http.ErrHijacked
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	rf, ok := w.c.nc.(io.ReaderFrom)
	if !ok || rf == nil {
		return io.CopyBuffer(writerOnly{w}, src, *bp)
	}
	var n int64
	if !w.headSent || w.headOnly { // as net/http (Go 1.26): whether or not the type is to be sniffed
		n0, err := io.CopyBuffer(writerOnly{w}, io.LimitReader(src, sniffLen), *bp)
		n += n0
		if err != nil || n0 < sniffLen {
			return n, err
		}
	}
	if err := w.FlushError(); err != nil {
		return n, err
	}
	n0, err := io.CopyBuffer(writerOnly{w}, src, *bp)
	return n + n0, err
}

// writerOnly hides ReadFrom from io.CopyBuffer.
type writerOnly struct{ io.Writer }

// WriteString is Write for a string; as net/http (bufio.Writer.WriteString
// over a writer without WriteString) it always fills the stage first.
func (w *response) WriteString(s string) (int, error) {
	if err := w.admit(len(s)); err != nil || len(s) == 0 {
		return 0, err
	}
	return stageWrite(w, s, false)
}

// admit applies net/http's checks to a body write of n bytes.
func (w *response) admit(n int) error {
	if w.hijacked {
		return http.ErrHijacked
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if n == 0 {
		return nil
	}
	if !bodyAllowed(w.status) {
		return http.ErrBodyNotAllowed
	}
	w.written += int64(n)
	if w.contentLength != -1 && w.written > w.contentLength {
		return http.ErrContentLength
	}
	return w.err
}

// stageWrite is bufio.Writer's policy on the stage buffer: a write larger
// than the free space fills the stage and frames it, or (direct, for Write)
// goes out as it is when the stage is empty.
func stageWrite[T string | []byte](w *response, p T, direct bool) (int, error) {
	w.acquireW()
	nn := 0
	for len(p) > cap(w.wb.stage)-len(w.wb.stage) && w.err == nil {
		n := len(p)
		if direct && len(w.wb.stage) == 0 {
			w.emit([]byte(p)) // p is a []byte here
		} else {
			st := w.wb.stage
			n = copy(st[len(st):cap(st)], p)
			w.wb.stage = st[:len(st)+n]
			w.flushStage()
		}
		nn += n
		p = p[n:]
	}
	if w.err != nil {
		return nn, w.err
	}
	w.wb.stage = append(w.wb.stage, p...)
	return nn + len(p), nil
}

func (w *response) flushStage() {
	if st := w.wb.stage; len(st) > 0 {
		w.emit(st)
		w.wb.stage = st[:0]
	}
}

// emit frames body bytes p (writing the head first if it is not sent).
func (w *response) emit(p []byte) {
	if !w.headSent {
		w.writeHead(p)
	}
	w.headOnly = false
	if w.isHEAD {
		return
	}
	var size []byte // the chunk's size line
	if w.chunking {
		size = append(strconv.AppendInt(w.wb.size[:0], int64(len(p)), 16), '\r', '\n')
	}
	if frame := len(size) + len(p) + 2; len(w.wb.out)+frame > cap(w.wb.out) {
		// The frame does not fit: what out holds and the whole frame go
		// in one system call, not one for each piece.
		w.writeFrame(size, p)
		return
	}
	w.wb.out = append(w.wb.out, size...)
	w.wb.out = append(w.wb.out, p...)
	if w.chunking {
		w.wb.out = append(w.wb.out, crlf...)
	}
}

var crlf = []byte("\r\n")

// writeFrame writes what out holds, then a body frame (a chunk's size line,
// its bytes and the CRLF after them, or the bytes alone) with one writev
// where the connection has it (net.Buffers; one write per piece where not).
func (w *response) writeFrame(size, p []byte) {
	if w.err != nil {
		return
	}
	wb := w.wb
	wb.vec = wb.arr[:0]
	if len(wb.out) > 0 {
		wb.vec = append(wb.vec, wb.out)
	}
	if len(size) > 0 {
		wb.vec = append(wb.vec, size)
	}
	wb.vec = append(wb.vec, p)
	if w.chunking {
		wb.vec = append(wb.vec, crlf)
	}
	_, w.err = wb.vec.WriteTo(w.c.nc)
	wb.arr, wb.vec = [4][]byte{}, nil // keep no caller's bytes in the pool
	wb.out = wb.out[:0]
}

// Flush sends everything buffered to the client.
func (w *response) Flush() { _ = w.FlushError() }

// FlushError is Flush that reports a write error (for http.ResponseController).
func (w *response) FlushError() error {
	if w.hijacked {
		return http.ErrHijacked
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	w.acquireW()
	w.flushStage()
	if !w.headSent {
		w.writeHead(nil)
	}
	w.headOnly = false
	w.flushOut()
	w.releaseW()
	return w.err
}

// SetReadDeadline sets the connection's read deadline (until the response
// ends: the server resets it for the next request).
func (w *response) SetReadDeadline(t time.Time) error {
	w.c.deadline = true
	return w.c.nc.SetReadDeadline(t)
}

// SetWriteDeadline sets the connection's write deadline.
func (w *response) SetWriteDeadline(t time.Time) error { return w.c.nc.SetWriteDeadline(t) }

// EnableFullDuplex lets the handler write before reading the whole body
// without the server discarding it first.
func (w *response) EnableFullDuplex() error {
	w.fullDuplex = true
	return nil
}

// Hijack hands the connection to the handler: what was written is flushed,
// the server forgets the connection and never touches it again.
func (w *response) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if w.hijacked {
		return nil, nil, http.ErrHijacked
	}
	if w.wroteHeader {
		_ = w.FlushError()
	}
	if w.body != nil {
		w.body.detach() // from now on the connection is the handler's alone
	}
	w.c.watch.stop()
	w.hijacked, w.c.hijacked = true, true
	c := w.c
	c.s.trackConn(c, false)
	var pending []byte
	if c.buf != nil && c.buffered() > 0 {
		pending = append(pending, (*c.buf)[c.r:c.w]...)
		c.r = c.w
	}
	c.release()
	if w.wb != nil {
		w.wb.stage, w.wb.out = w.wb.stage[:0], w.wb.out[:0]
		w.releaseW()
	}
	rc := &replayConn{Conn: c.nc, pending: pending}
	return c.nc, bufio.NewReadWriter(bufio.NewReader(rc), bufio.NewWriter(c.nc)), nil
}

func (w *response) acquireW() {
	if w.wb == nil {
		w.wb = wbufs.Get().(*wbuf)
		writeBufsHeld.Add(1)
	}
}

// releaseW gives the write buffers back when nothing is pending in them.
func (w *response) releaseW() {
	if w.wb != nil && len(w.wb.out) == 0 && len(w.wb.stage) == 0 {
		wbufs.Put(w.wb)
		writeBufsHeld.Add(-1)
		w.wb = nil
	}
}

// outWrite queues framed bytes, writing out to the connection when full.
func (w *response) outWrite(p []byte) {
	if w.err != nil {
		return
	}
	if len(w.wb.out)+len(p) > cap(w.wb.out) {
		w.flushOut()
		if len(p) >= cap(w.wb.out) {
			if w.err == nil {
				_, w.err = w.c.nc.Write(p)
			}
			return
		}
	}
	w.wb.out = append(w.wb.out, p...)
}

func (w *response) outString(s string) {
	if len(w.wb.out)+len(s) <= cap(w.wb.out) {
		w.wb.out = append(w.wb.out, s...)
		return
	}
	w.outWrite([]byte(s))
}

func (w *response) flushOut() {
	if len(w.wb.out) == 0 {
		return
	}
	if w.err == nil {
		_, w.err = w.c.nc.Write(w.wb.out)
	}
	w.wb.out = w.wb.out[:0]
}

// outWriter lets http.Header.WriteSubset write into out.
type outWriter struct{ w *response }

func (o outWriter) Write(p []byte) (int, error) { o.w.outWrite(p); return len(p), nil }

func (o outWriter) WriteString(s string) (int, error) { o.w.outString(s); return len(s), nil }

// outStatusLine writes "HTTP/1.x code text" (HTTP/1.0 for a 1.0 request,
// as net/http).
func (w *response) outStatusLine(code int) {
	w.room(64)
	if w.minor == 1 {
		w.wb.out = append(w.wb.out, "HTTP/1.1 "...)
	} else {
		w.wb.out = append(w.wb.out, "HTTP/1.0 "...)
	}
	text := http.StatusText(code)
	if text == "" {
		w.wb.out = fmt.Appendf(w.wb.out, "%03d status code %d\r\n", code, code)
		return
	}
	w.wb.out = strconv.AppendInt(w.wb.out, int64(code), 10)
	w.wb.out = append(w.wb.out, ' ')
	w.outString(text)
	w.outString("\r\n")
}

// room makes sure out has n free bytes (writing it out if needed).
func (w *response) room(n int) {
	if cap(w.wb.out)-len(w.wb.out) < n {
		w.flushOut()
	}
}

func bodyAllowed(code int) bool {
	return (code < 100 || code > 199) && code != http.StatusNoContent && code != http.StatusNotModified
}

var dateCache atomic.Pointer[dateEntry]

type dateEntry struct {
	sec int64
	b   []byte
}

// date returns the Date header value, formatted once per second.
func date() []byte {
	now := time.Now()
	e := dateCache.Load()
	if e == nil || e.sec != now.Unix() {
		e = &dateEntry{sec: now.Unix(), b: now.UTC().AppendFormat(nil, http.TimeFormat)}
		dateCache.Store(e)
	}
	return e.b
}

// extras are the header fields the server adds, written in net/http's order.
type extras struct {
	date          bool
	contentLength bool
	contentType   string
	connection    string
	te            string
}

// declareTrailers drops "Trailer:"-prefixed keys from the head, records the
// trailer names the Trailer header declares, and reports whether the
// response has trailers (which rules out an automatic Content-Length).
func (w *response) declareTrailers(h http.Header) bool {
	declared := false
	for k := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			delete(h, k)
			declared = true
		}
	}
	for _, v := range h["Trailer"] {
		declared = true
		for f := range strings.SplitSeq(v, ",") {
			if k := http.CanonicalHeaderKey(strings.Trim(f, " \t")); k != "" && validTrailer(k) {
				w.trailerKeys = append(w.trailerKeys, k)
			}
		}
	}
	return declared
}

// badTrailers are the fields a trailer must not carry (as net/http).
var badTrailers = map[string]bool{
	"Authorization": true, "Cache-Control": true, "Connection": true, "Content-Encoding": true,
	"Content-Length": true, "Content-Range": true, "Content-Type": true, "Expect": true,
	"Host": true, "Keep-Alive": true, "Max-Forwards": true, "Pragma": true,
	"Proxy-Authenticate": true, "Proxy-Authorization": true, "Proxy-Connection": true,
	"Range": true, "Realm": true, "Te": true, "Trailer": true, "Transfer-Encoding": true,
	"Www-Authenticate": true,
}

func validTrailer(k string) bool { return !strings.HasPrefix(k, "If-") && !badTrailers[k] }

// finalTrailers collects the trailer values the handler set: declared names
// and "Trailer:"-prefixed keys (nil when there are none).
func (w *response) finalTrailers() http.Header {
	var t http.Header
	for k, vv := range w.handlerHeader {
		if kk, ok := strings.CutPrefix(k, http.TrailerPrefix); ok {
			if t == nil {
				t = make(http.Header)
			}
			t[kk] = vv
		}
	}
	for _, k := range w.trailerKeys {
		if t == nil {
			t = make(http.Header)
		}
		for _, v := range w.handlerHeader[k] {
			t.Add(k, v)
		}
	}
	return t
}
