package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
)

// RelayOptions controls Relay.
type RelayOptions struct {
	// IdleTimeout aborts the relay when no upstream bytes arrive for this
	// long (0 = none). The body must be an io.Closer for the timeout to
	// interrupt a blocked read (an upstream response body always is).
	IdleTimeout time.Duration
	// OnFirstByte is called once, when the first body byte has been written
	// to the client.
	OnFirstByte func()
	// Observe, when set, sees every chunk before it is written (e.g. a usage
	// parser). It must not retain or modify the slice.
	Observe func([]byte)
	// Stream marks an event stream: it is read in streamBufSize pieces (an
	// open stream holds its buffer for its whole life; one read returns
	// the event or few events the upstream has sent).
	Stream bool
}

// ErrIdleTimeout is returned when the upstream stays silent past IdleTimeout.
var ErrIdleTimeout = errors.New("upstream stream idle timeout")

// RelayResult says how a relay ended.
type RelayResult struct {
	Bytes    int64
	WroteAny bool
	// UpstreamErr is nil on a clean EOF. Otherwise it is ErrIdleTimeout,
	// the context's error (context.Canceled when the client went away,
	// context.DeadlineExceeded when the request deadline passed), or the
	// error reading the upstream body.
	UpstreamErr error
	// DownstreamOK is false when a write or flush to the client failed or
	// the request context was canceled (the client is gone): nothing more
	// can be written.
	DownstreamOK bool
	// AtEventBoundary is true when nothing was written or the bytes written
	// end with a blank line, so an SSE event can be appended as is.
	AtEventBoundary bool
}

// Relay copies body to w chunk by chunk, writing and flushing every read
// before issuing the next, so SSE events reach the client as soon as the
// worker produced them, in order and without loss. It returns when the body
// ends, the upstream fails, the client goes away (ctx) or the idle timeout
// fires. Bytes read together with an error are still written first. The
// caller has already written the status line and closes the body.
func Relay(ctx context.Context, w http.ResponseWriter, body io.Reader, o RelayOptions) RelayResult {
	pool := &bufPool
	if o.Stream {
		pool = &streamBufPool
		openStreams.Add(1)
		defer openStreams.Add(-1)
	}
	bp := pool.get()
	defer func() { pool.put(bp) }()
	buf := *bp
	fl, _ := w.(interface{ FlushError() error }) // FlushNext, without its frame
	res := RelayResult{DownstreamOK: true, AtEventBoundary: true}
	var tail uint32 // the last four bytes written, oldest in the high byte

	var idle *idleWatch
	if o.IdleTimeout > 0 && !BodyBuffered(body) { // no read of a buffered body can wait
		if c, ok := body.(io.Closer); ok {
			idle = startIdleWatch(o.IdleTimeout, c)
			defer idle.stop()
		}
	}
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if idle != nil {
				idle.touch()
			}
			p := buf[:n]
			if o.Observe != nil {
				o.Observe(p)
			}
			if _, werr := w.Write(p); werr != nil {
				res.DownstreamOK = false
				return res
			}
			var ferr error
			if fl != nil {
				ferr = fl.FlushError()
			} else {
				ferr = flushController(w)
			}
			if ferr != nil && !errors.Is(ferr, http.ErrNotSupported) {
				res.DownstreamOK = false
				return res
			}
			res.Bytes += int64(n)
			for _, b := range p[max(0, n-4):] {
				tail = tail<<8 | uint32(b)
			}
			res.AtEventBoundary = tail&0xffff == 0x0a0a || tail == 0x0d0a0d0a // "\n\n" or "\r\n\r\n"
			if !res.WroteAny {
				res.WroteAny = true
				if o.OnFirstByte != nil {
					o.OnFirstByte()
				}
			}
			if next := streamPool(pool, n); next != pool { // nothing points into buf now
				pool.put(bp)
				pool, bp = next, next.get()
				buf = *bp
			}
		}
		if err == nil {
			continue
		}
		switch {
		case errors.Is(err, io.EOF):
			// clean end (an idle timeout that fires after the last byte is
			// irrelevant)
		case idle != nil && idle.fired.Load():
			res.UpstreamErr = ErrIdleTimeout
		case ctx.Err() != nil:
			res.UpstreamErr = ctx.Err()
			if !errors.Is(res.UpstreamErr, context.DeadlineExceeded) {
				res.DownstreamOK = false
			}
		default:
			res.UpstreamErr = err
		}
		return res
	}
}

// idleWatch closes the body once no chunk has arrived for timeout. Instead
// of stopping and resetting a timer per chunk, each chunk stores its arrival
// time; when the timer fires early it re-arms itself for the remainder.
type idleWatch struct {
	timeout time.Duration
	start   time.Time
	last    atomic.Int64 // nanoseconds since start of the last chunk
	fired   atomic.Bool
	body    io.Closer
	t       *time.Timer
}

func startIdleWatch(d time.Duration, body io.Closer) *idleWatch {
	iw := &idleWatch{timeout: d, start: time.Now(), body: body}
	iw.t = time.AfterFunc(time.Hour, iw.check)
	iw.t.Stop()
	iw.t.Reset(d)
	return iw
}

func (iw *idleWatch) touch() { iw.last.Store(int64(time.Since(iw.start))) }

func (iw *idleWatch) check() {
	quiet := time.Since(iw.start) - time.Duration(iw.last.Load())
	if quiet < iw.timeout {
		iw.t.Reset(iw.timeout - quiet)
		return
	}
	iw.fired.Store(true)
	_ = iw.body.Close() // unblocks the pending Read
}

func (iw *idleWatch) stop() { iw.t.Stop() }

// WriteSSEError appends an OpenAI error event and "data: [DONE]" to a
// stream that broke after its headers were sent, starting a new event if the
// stream stopped mid-event, and flushes. It never leaves a truncated stream
// looking like a complete one.
func WriteSSEError(w http.ResponseWriter, res RelayResult, status int, message string) error {
	if !res.AtEventBoundary {
		if _, err := io.WriteString(w, "\n\n"); err != nil {
			return err
		}
	}
	if _, err := w.Write(openai.SSEError(status, message)); err != nil {
		return err
	}
	if err := http.NewResponseController(w).Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return err
	}
	return nil
}

// bufSize is the read size of a non-streaming body; a bigger buffer only
// helps large bodies. streamBufSize is an event stream's: vLLM's token
// events are a few hundred bytes, and 4096 open streams hold 4096 buffers.
// burstBufSize is an event stream's while its worker sends faster than
// the stream is relayed (see streamPool).
const (
	bufSize       = 16 << 10
	streamBufSize = 4 << 10
	burstBufSize  = h1BurstBuffer
)

// openStreams counts the event streams being relayed. A stream moves to
// the burst buffers (relay's and connection's, 64 KiB together) only
// while at most burstStreams are open, which bounds what bursts add to the
// router's memory (about 16 MiB) however many streams are open: thousands
// of open streams keep the small buffers.
var openStreams atomic.Int64

const burstStreams = 256

// burstAllowed reports whether a stream may move to the burst buffers.
func burstAllowed() bool { return openStreams.Load() <= burstStreams }

// bufPool, streamBufPool and burstBufPool bound the retained relay
// buffers.
var (
	bufPool       = relayPool{c: make(chan *[]byte, 1024), size: bufSize}
	streamBufPool = relayPool{c: make(chan *[]byte, 1024), size: streamBufSize}
	burstBufPool  = relayPool{c: make(chan *[]byte, 256), size: burstBufSize}
)

// streamPool is the pool of an event stream's next read buffer after a
// read of n bytes from one of pool's: a read that filled the small buffer
// (a worker bursting its events, or a relay behind on a busy machine) moves
// the stream to the burst size, so that one read and one client write
// carry what took eight; a read smaller than the small buffer moves it
// back. A paced stream (an event or a few per read) never leaves the small
// buffer. Other bodies keep their pool.
func streamPool(pool *relayPool, n int) *relayPool {
	switch {
	case pool == &streamBufPool && n == streamBufSize && burstAllowed():
		return &burstBufPool
	case pool == &burstBufPool && n < streamBufSize:
		return &streamBufPool
	}
	return pool
}

type relayPool struct {
	c    chan *[]byte
	size int
}

func (p *relayPool) get() *[]byte {
	select {
	case b := <-p.c:
		return b
	default:
		b := make([]byte, p.size)
		return &b
	}
}

func (p *relayPool) put(b *[]byte) {
	select {
	case p.c <- b:
	default:
	}
}

// FlushNext flushes w through its own FlushError when it has one (as
// net/http's response and the router's writers do), else through
// http.ResponseController. A writer wrapping another flushes with it: one
// call per wrapper instead of a controller's, which keeps the first flush
// of a response (net/http writes the headers then, deep in its stack)
// shallower (docs/BENCHMARKS.md, section 3).
func FlushNext(w http.ResponseWriter) error {
	if f, ok := w.(interface{ FlushError() error }); ok {
		return f.FlushError()
	}
	return flushController(w) // out of line: FlushNext itself inlines
}

//go:noinline
func flushController(w http.ResponseWriter) error { return http.NewResponseController(w).Flush() }
