package h1server

import (
	"io"
	"net/http"
	"sync"
)

// newRequest builds the handler's request for h, with ctx as its context.
func (c *conn) newRequest(h *head, ctx *reqCtx) *http.Request {
	c.beginCtx(ctx)
	req := http.Request{
		Method:        h.method,
		URL:           h.url,
		Proto:         h.proto,
		ProtoMajor:    1,
		ProtoMinor:    h.minor,
		Header:        h.header,
		Host:          h.host,
		RequestURI:    h.target,
		RemoteAddr:    c.remote,
		ContentLength: h.contentLength,
		Close:         h.close,
		Body:          http.NoBody,
	}
	if h.contentLength > 0 {
		req.Body = &body{c: c, remaining: h.contentLength, closing: h.close}
	}
	return req.WithContext(ctx)
}

// body is a request body of known length read through the connection's
// buffer. onEOF runs once, when the last byte has been read.
type body struct {
	mu         sync.Mutex
	c          *conn
	remaining  int64
	sawEOF     bool
	closed     bool
	earlyClose bool // closed with data left unread
	closing    bool // the request's Close: the connection closes after it
	err        error
	onEOF      *response // its watch starts at the end of the body
}

// Read reads the body; io.EOF at its end, http.ErrBodyReadAfterClose after
// Close, io.ErrUnexpectedEOF if the client stops sending early.
func (b *body) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return 0, http.ErrBodyReadAfterClose
	}
	return b.readLocked(p)
}

func (b *body) readLocked(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	if b.remaining == 0 {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	if int64(len(p)) > b.remaining {
		p = p[:b.remaining]
	}
	n, err := b.c.readBody(p)
	b.remaining -= int64(n)
	if b.remaining == 0 {
		b.hitEOF()
		return n, io.EOF
	}
	if err == io.EOF {
		// As net/http: the short body reports io.ErrUnexpectedEOF once,
		// then counts as read to its end (io.EOF).
		b.err = io.EOF
		b.hitEOF()
		return n, io.ErrUnexpectedEOF
	}
	if err != nil {
		b.err = err
	}
	return n, err
}

func (b *body) hitEOF() {
	b.sawEOF = true
	b.c.release()
	if w := b.onEOF; w != nil {
		b.onEOF = nil
		w.startWatch()
	}
}

// Close discards what is left of the body, unless the connection closes
// after this request anyway, when that is at most
// maxPostHandlerReadBytes (keeping the connection usable) and reports a
// failure to discard it (io.ErrUnexpectedEOF for a short body), as net/http.
func (b *body) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.sawEOF || b.closing {
		return nil // the connection closes next: no point reading on
	}
	if b.remaining > maxPostHandlerReadBytes {
		b.earlyClose = true
		return nil
	}
	return b.discardLocked() // an error leaves the conn to fail its next read
}

// discardLocked skips the rest of the body; nil when it reached the end.
func (b *body) discardLocked() error {
	if b.sawEOF {
		return nil
	}
	for b.remaining > 0 {
		if b.err != nil {
			return b.err
		}
		c := b.c
		if c.buffered() == 0 {
			if err := c.fill(); err != nil {
				if err == io.EOF {
					// As a read: the short body reports
					// io.ErrUnexpectedEOF, then counts as read.
					b.err = io.EOF
					b.hitEOF()
					return io.ErrUnexpectedEOF
				}
				b.err = err
				return err
			}
		}
		n := min(int64(c.buffered()), b.remaining)
		c.r += int(n)
		b.remaining -= n
	}
	if !b.sawEOF {
		b.hitEOF()
	}
	return b.err
}

// detach makes the body unreadable (http.ErrBodyReadAfterClose) without
// reading the connection, and stops it starting a watch: after it returns,
// no other goroutine reaches the connection through the body.
func (b *body) detach() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	b.onEOF = nil
	if !b.sawEOF {
		b.earlyClose = true
	}
}

// Arrived reports whether the rest of the body is in the connection's
// buffer already, so that reading it cannot wait on the client (a server
// need not bound that read with a deadline).
func (b *body) Arrived() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed || b.err != nil || b.remaining <= int64(b.c.buffered())
}

// consumed reports whether the body has been read to its end.
func (b *body) consumed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sawEOF || b.remaining == 0
}

// closedEarly reports whether the body was closed with data left unread.
func (b *body) closedEarly() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.earlyClose
}

// state reports the body's state for the response's keep-alive decision.
func (b *body) state() (closed, sawEOF bool, remaining int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed, b.sawEOF, b.remaining
}

// setOnEOF arranges w's watch to start when the body is read to its end
// (nil: never). Done under mu, it orders the body's readers with the
// handler's goroutine.
func (b *body) setOnEOF(w *response) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.onEOF = w
}

// readBody reads body bytes: from the buffer when it holds some, directly
// into p when p is at least a buffer's size, else through the buffer.
func (c *conn) readBody(p []byte) (int, error) {
	if c.buffered() == 0 && len(p) >= readBufSize {
		c.release()
		return c.nc.Read(p)
	}
	if c.buffered() == 0 {
		if err := c.fill(); err != nil {
			return 0, err
		}
	}
	n := copy(p, (*c.buf)[c.r:c.w])
	c.r += n
	return n, nil
}

// discard reads the rest of the body and closes it; nil when the end was
// reached.
func (b *body) discard() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	err := b.discardLocked()
	b.closed = true
	if err != nil && err != io.ErrUnexpectedEOF {
		b.earlyClose = true
	}
	return err
}
