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
// request is being handled, and cancels the request's context when the
// peer has closed or reset the connection. Data from the client (a
// pipelined request) ends the watch, as net/http's background read does.
// stop waits out a running peek, so a stopped watch never cancels
// anything.
//
// With the server's poller (Linux) the connection is registered once, on
// its first request still running after watchFirst, for the peer's hangup
// (EPOLLRDHUP; a reset is reported too), and stays registered until it
// closes (release): later requests cost no system call and no timer. A
// hangup while no request is watched (the client half-closed after its
// request, or closed an idle connection) is remembered (hup) and, with the
// registration spent, the connection's later requests are watched by the
// timer's peeks instead. Without a poller a timer peeks at the connection
// with backoff (10 ms doubling to 200 ms).
type watch struct {
	mu      sync.Mutex
	rc      syscall.RawConn
	ctx     *reqCtx        // the request's, nil when stopped
	poll    *fdpoll.Poller // the server's epoll set (Linux), nil: the timer peeks
	p       *fdpoll.Poller // poll once the connection is registered in it
	fd      int32          // the descriptor p knows it by
	hup     bool           // a hangup was reported and the registration is spent
	t       *time.Timer
	delay   time.Duration
	stopped bool
}

// start begins watching for the request whose context is ctx (once
// its body has been read). A connection's requests reuse its watch (and its
// timer) one after another: stop ends one request's watch before the next
// starts.
//
// A connection registered in the poller is watched by its events alone.
// Otherwise the first timer tick registers it (a request answered within
// watchFirst, most non-streaming ones, costs a timer and no system call),
// or peeks when it cannot be (no poller, or a spent registration).
func (w *watch) start(p *fdpoll.Poller, rc syscall.RawConn, ctx *reqCtx) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.rc, w.ctx, w.stopped = rc, ctx, false
	w.poll = p
	if w.p != nil && !w.hup {
		return // registered: the poller tells of a hangup
	}
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
// this request (a peek already running has finished: it holds mu). The
// connection stays registered for its next request.
func (w *watch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	w.ctx = nil
	if w.t != nil {
		w.t.Stop()
	}
}

// release ends the connection's registration; call it before the
// connection is closed (or after: a closed one has left the set).
func (w *watch) release() {
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

// PollEvent is the poller's news of the connection (closed or reset, or
// readable when the poller asks for that): peek decides which, as fire
// does. News while no request is watched is kept for the next one (hup).
func (w *watch) PollEvent() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.p == nil {
		return
	}
	if w.stopped || w.ctx == nil {
		w.hup = true // spent: the next request is watched by the timer
		return
	}
	switch peekNow(w.rc) {
	case peekAlive: // nothing after all
		if !w.p.Rearm(w.rc, w) {
			w.stopped, w.hup = true, true
		}
	case peekData:
		w.stopped, w.hup = true, true
	case peekGone:
		w.stopped, w.hup = true, true
		w.ctx.cancel(context.Canceled) // the client is gone
	}
}
