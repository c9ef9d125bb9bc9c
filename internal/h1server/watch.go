package h1server

import (
	"context"
	"sync"
	"syscall"
	"time"

	"github.com/switchyard-llm/switchyard/internal/fdpoll"
)

const (
	watchFirst = 10 * time.Millisecond
	watchMax   = 200 * time.Millisecond
)

// watch detects, without a goroutine, a client that goes away while its
// request is being handled: a timer peeks at the connection with backoff
// (10 ms doubling to 200 ms) and cancels the request's context when the
// peer has closed or reset it. Data from the client (a pipelined request)
// ends the watch, as net/http's background read does. stop waits out a
// running peek, so a stopped watch never cancels anything.
type watch struct {
	mu      sync.Mutex
	rc      syscall.RawConn
	ctx     *reqCtx        // the request's, nil when stopped
	poll    *fdpoll.Poller // the server's epoll set (Linux), nil: the timer peeks
	p       *fdpoll.Poller // poll once this request's connection is registered in it
	fd      int32          // the descriptor p knows it by
	t       *time.Timer
	delay   time.Duration
	stopped bool
}

// start begins watching for the request whose context is ctx (once
// its body has been read). A connection's requests reuse its watch (and its
// timer) one after another: stop ends one request's watch before the next
// starts.
//
// With a poller, the first timer tick registers the connection in its
// epoll set instead of peeking: a request answered within watchFirst (most
// non-streaming ones) costs a timer and no system call.
func (w *watch) start(p *fdpoll.Poller, rc syscall.RawConn, ctx *reqCtx) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.rc, w.ctx, w.stopped = rc, ctx, false
	w.poll = p
	w.delay = watchFirst
	if w.t == nil {
		w.t = time.AfterFunc(w.delay, w.fire)
		return
	}
	w.t.Reset(w.delay)
}

func (w *watch) fire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.ctx == nil {
		return
	}
	if w.poll != nil && w.p == nil {
		if fd, ok := w.poll.Add(w.rc, w); ok {
			w.p, w.fd = w.poll, fd
			return
		}
	}
	switch peek(w.rc) {
	case peekAlive:
		w.delay = min(2*w.delay, watchMax)
		w.t.Reset(w.delay)
	case peekData:
		w.stopped = true
	case peekGone:
		w.stopped = true
		w.ctx.cancel(context.Canceled) // the client is gone
	}
}

// stop ends the watch; after it returns the watch does nothing more for
// this request (a peek already running has finished: it holds mu).
func (w *watch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	w.ctx = nil
	if w.p != nil {
		w.p.Remove(w.rc, w.fd, w)
		w.p = nil
	}
	if w.t != nil {
		w.t.Stop()
	}
}

// PollEvent is the poller's news of the connection (readable, closed or
// reset): peek decides which, as fire does.
func (w *watch) PollEvent() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.ctx == nil || w.p == nil {
		return
	}
	switch peekNow(w.rc) {
	case peekAlive: // nothing after all
		if !w.p.Rearm(w.rc, w) {
			w.stopped = true
		}
	case peekData:
		w.stopped = true
	case peekGone:
		w.stopped = true
		w.ctx.cancel(context.Canceled) // the client is gone
	}
}
