package h1server

import (
	"context"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/legctx"
)

// reqCtx is a request's context. It ends when the handler returns, when
// the client goes away (the watch), when the server's base context ends,
// or at a deadline the handler sets in place (TightenDeadline). It carries
// one value the handler may set in place (SetValue), runs one hook
// without allocating (HookAbort), and tells two children in place when it
// ends (Follow: a PD attempt's legctx contexts). It is allocated with the request's
// response: where net/http's request context costs a cancelCtx, a
// deadline a timerCtx and a timer, a value a valueCtx and each AfterFunc a
// child and a closure, this costs nothing more per request. The deadline's
// timer is the connection's, reused by each request (one at a time).
//
// The rest of it is context.Context's contract: Done is closed and Err is
// set once, children (context.WithCancel and the like) and
// context.AfterFunc follow it through its AfterFunc method, and values of
// the base context are found through it. context.Cause of it is its Err.
type reqCtx struct {
	c *conn

	// key and val are set once, before the context is shared with other
	// goroutines (SetValue); read without the lock.
	key, val any

	mu       sync.Mutex
	done     chan struct{} // made on the first Done
	err      error
	deadline time.Time
	hook     func() // HookAbort's function, nil when none
	hookID   uint64 // its id
	afters   legctx.AfterFuncs
	// Children following it in place (Follow: a PD attempt's legs).
	follows legctx.Slots[legctx.Canceler]
}

// vctxKey keys the (empty) value that wraps a connection's base context.
type vctxKey struct{}

var _ legctx.Follower = (*reqCtx)(nil)

// closedChan is Done for a context canceled before anyone asked for Done.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (r *reqCtx) Deadline() (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.deadline, !r.deadline.IsZero()
}

func (r *reqCtx) Done() <-chan struct{} {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done == nil {
		if r.err != nil {
			return closedChan
		}
		r.done = make(chan struct{})
	}
	return r.done
}

func (r *reqCtx) Err() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// Value returns the value set with SetValue or the base context's. The
// base is seen through context.WithoutCancel, so that context.Cause and
// context's own bookkeeping never mistake the base's cancelCtx for this
// context's.
func (r *reqCtx) Value(key any) any {
	if r.key != nil && key == r.key {
		return r.val
	}
	return r.c.vctx.Value(key)
}

// SetValue stores val under key in the context itself, as context.WithValue
// would in a child, and reports whether it did: once per request, and only
// before the context is shared with other goroutines. A false return
// leaves the caller to use context.WithValue.
func (r *reqCtx) SetValue(key, val any) bool {
	if r.key != nil || key == nil {
		return false
	}
	r.key, r.val = key, val
	return true
}

// TightenDeadline makes t the context's deadline unless it already has an
// earlier one; at t the context ends with context.DeadlineExceeded. It
// reports true (the deadline is in force); as context.WithDeadline, a past
// t ends the context at once.
func (r *reqCtx) TightenDeadline(t time.Time) bool {
	r.mu.Lock()
	if r.err != nil || (!r.deadline.IsZero() && !t.Before(r.deadline)) {
		r.mu.Unlock()
		return true
	}
	r.deadline = t
	d := time.Until(t)
	if d > 0 {
		// Armed under r.mu (lock order r.mu, then c.ctxMu): of two
		// tightenings at once, the earlier deadline's timer is the one left.
		r.c.armDeadline(d)
		r.mu.Unlock()
		return true
	}
	r.mu.Unlock()
	r.cancel(context.DeadlineExceeded)
	return true
}

// HookAbort registers f to run when the context ends, synchronously in
// the goroutine that ends it (f must be quick and must not block: it
// closes a connection). It reports false when the hook is taken (the
// caller then uses context.AfterFunc); a context already ended runs f at
// once. UnhookAbort(id) undoes it.
func (r *reqCtx) HookAbort(f func()) (id uint64, ok bool) {
	r.mu.Lock()
	if r.err != nil {
		r.mu.Unlock()
		f()
		return 0, true
	}
	if r.hook != nil {
		r.mu.Unlock()
		return 0, false
	}
	r.hookID++
	r.hook = f
	id = r.hookID
	r.mu.Unlock()
	return id, true
}

// UnhookAbort removes the hook HookAbort registered as id and reports
// whether that stopped it from running (false: the context ended, and it
// ran or runs).
func (r *reqCtx) UnhookAbort(id uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil || id == 0 {
		return false
	}
	if r.hookID == id {
		r.hook = nil
	}
	return true
}

// Follow registers c to be told in place (ParentDone, in the goroutine
// that ends the context, after its lock is released) when the context
// ends. It reports false when its slots are taken (the caller falls back
// to context.AfterFunc); a context already ended tells c at once.
func (r *reqCtx) Follow(c legctx.Canceler) (id uint64, ok bool) {
	r.mu.Lock()
	if err := r.err; err != nil {
		r.mu.Unlock()
		c.ParentDone(err)
		return 0, true
	}
	id, ok = r.follows.Put(c)
	r.mu.Unlock()
	return id, ok
}

// Unfollow removes the registration id and reports whether that kept it
// from being told (false: the context ended).
func (r *reqCtx) Unfollow(id uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return false
	}
	return r.follows.Remove(id)
}

// AfterFunc is context.AfterFunc's contract for this context (context's
// children use it to follow it): f runs in its own goroutine once the
// context ends; stop reports whether it prevented that.
func (r *reqCtx) AfterFunc(f func()) (stop func() bool) {
	r.mu.Lock()
	if r.err != nil {
		r.mu.Unlock()
		go f()
		return legctx.Stopped
	}
	stop = r.afters.Add(&r.mu, f)
	r.mu.Unlock()
	return stop
}

// cancel ends the context with err (the first call wins).
func (r *reqCtx) cancel(err error) {
	r.mu.Lock()
	if r.err != nil {
		r.mu.Unlock()
		return
	}
	r.err = err
	if r.done != nil {
		close(r.done)
	}
	hook, afters, follows := r.hook, r.afters.Take(), r.follows.Take()
	r.hook = nil
	r.mu.Unlock()
	if hook != nil {
		hook()
	}
	follows.Each(func(c legctx.Canceler) { c.ParentDone(err) })
	afters.Run()
}

// expired ends the context if its deadline has passed (the connection's
// deadline timer fired; it may be a stale firing for an earlier request).
func (r *reqCtx) expired() {
	r.mu.Lock()
	dl := r.deadline
	r.mu.Unlock()
	if !dl.IsZero() && !time.Now().Before(dl) {
		r.cancel(context.DeadlineExceeded)
	}
}

// The connection's side: its current request, the deadline timer, the
// base context's end.

// beginCtx makes r the connection's current request context.
func (c *conn) beginCtx(r *reqCtx) {
	r.c = c
	if c.vctx == nil {
		// A pointer-shaped wrapper: a withoutCancelCtx's own Value boxes
		// it on every call (an allocation per lookup); value() walking
		// from a valueCtx does not.
		c.vctx = context.WithValue(context.WithoutCancel(c.ctx), vctxKey{}, nil)
		c.stopBase = context.AfterFunc(c.ctx, c.baseEnded)
	}
	c.ctxMu.Lock()
	c.cur = r
	c.ctxMu.Unlock()
	if c.ctx.Err() != nil {
		r.cancel(context.Canceled)
	}
}

// endCtx ends r, the current request's context, when its handler returned.
func (c *conn) endCtx(r *reqCtx) {
	c.ctxMu.Lock()
	c.cur = nil
	if c.dlTimer != nil {
		c.dlTimer.Stop()
	}
	c.ctxMu.Unlock()
	r.cancel(context.Canceled)
}

func (c *conn) current() *reqCtx {
	c.ctxMu.Lock()
	defer c.ctxMu.Unlock()
	return c.cur
}

// armDeadline (re)starts the deadline timer for the current request.
func (c *conn) armDeadline(d time.Duration) {
	c.ctxMu.Lock()
	defer c.ctxMu.Unlock()
	if c.dlTimer == nil {
		c.dlTimer = time.AfterFunc(d, c.deadlineFired)
		return
	}
	c.dlTimer.Reset(d)
}

func (c *conn) deadlineFired() {
	if r := c.current(); r != nil {
		r.expired()
	}
}

func (c *conn) baseEnded() {
	if r := c.current(); r != nil {
		r.cancel(context.Canceled)
	}
}

// stopCtx releases the connection's hold on its base context.
func (c *conn) stopCtx() {
	if c.stopBase != nil {
		c.stopBase()
	}
	c.ctxMu.Lock()
	if c.dlTimer != nil {
		c.dlTimer.Stop()
	}
	c.ctxMu.Unlock()
}
