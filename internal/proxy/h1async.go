package proxy

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"

	"github.com/switchyard-llm/switchyard/internal/fdpoll"
)

// AsyncRoundTripper is implemented by a transport that can wait for a
// response without a goroutine parked on it (H1Transport on Linux).
type AsyncRoundTripper interface {
	RoundTripAsync(req *http.Request, done func(*http.Response, error))
}

// RoundTripAsync is RoundTrip for a caller that would otherwise park a
// goroutine until the worker answers (a MoRI-IO WRITE prefill answers only
// once its decode took the KV cache, which at thousands of open streams is
// seconds away: one parked goroutine and its 8 KiB stack per stream). It
// writes req on the calling goroutine and returns; once the worker has sent
// the first byte of its answer, closed the connection or req's context
// ended, it calls done, on a goroutine of its own, with what RoundTrip
// would have returned. done is called exactly once. When the wait cannot
// be handed to the transport's epoll set (off Linux, a connection without
// a descriptor, a request RoundTrip gives to net/http's Transport, after
// Close), the calling goroutine waits and calls done itself.
func (t *H1Transport) RoundTripAsync(req *http.Request, done func(*http.Response, error)) {
	if !served(req) {
		done(t.std.RoundTrip(req))
		return
	}
	ctx := req.Context()
	x, err := t.send(ctx, req)
	if err != nil {
		done(nil, ctxErr(ctx, err))
		return
	}
	if p := t.poller(); p != nil && x.c.rc != nil && (!x.c.attached || x.c.br.Buffered() == 0) {
		w := &asyncWait{x: x, p: p, ctx: ctx, done: done}
		if w.register() {
			return
		}
	}
	resp, err := x.receive()
	done(resp, ctxErr(ctx, err))
}

// poller starts the epoll set on first use (nil when unavailable or
// closed).
func (t *H1Transport) poller() *fdpoll.Poller {
	t.pollOnce.Do(func() {
		t.mu.Lock()
		defer t.mu.Unlock()
		if !t.closed {
			t.poll = fdpoll.New()
		}
	})
	return t.poll
}

// Close closes the idle connections and stops RoundTripAsync's epoll set:
// the responses still awaited through it are then read by goroutines of
// their own, and later calls wait on the caller's goroutine.
func (t *H1Transport) Close() {
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.pollOnce.Do(func() {}) // none is started after this
	t.poll.Stop()
	t.CloseIdleConnections()
}

// asyncWait is one response awaited through the epoll set.
type asyncWait struct {
	x    *exchange
	p    *fdpoll.Poller
	ctx  context.Context
	done func(*http.Response, error)

	mu       sync.Mutex // held while registering: the receiver waits for it
	fd       int32
	onCancel abortOnDone // the context's end, as an event
	fired    atomic.Bool
}

// register puts the connection in the epoll set, and the context's end
// in as an event of its own (cancelling a request closes its connection,
// which leaves the set without an event).
func (w *asyncWait) register() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	fd, ok := w.p.Add(w.x.c.rc, w)
	if !ok {
		return false
	}
	w.fd = fd
	w.onCancel.set(w.ctx, w.PollEvent)
	return true
}

// PollEvent is the response's first byte, the connection's end, the
// context's end or the poller stopping: the first of them starts the
// goroutine that reads the response.
func (w *asyncWait) PollEvent() {
	if w.fired.CompareAndSwap(false, true) {
		go w.receive()
	}
}

func (w *asyncWait) receive() {
	w.mu.Lock() // registered
	w.mu.Unlock()
	w.onCancel.release()
	w.p.Remove(w.x.c.rc, w.fd, w)
	resp, err := w.x.receive()
	w.done(resp, ctxErr(w.ctx, err))
}
