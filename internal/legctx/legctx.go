// Package legctx is a cancellable child context that lives inside the
// struct that owns it: a PD attempt's prefill and decode legs each hold
// one. Where context.WithCancelCause costs a cancelCtx, its link to the
// parent (a closure and a stop function when the parent is not the
// context package's own) and, for each context.AfterFunc on it, a child,
// a closure and its stop function, a Ctx costs nothing per use: it follows
// a parent that can notify it in place (Follower: h1server's request
// context), and runs up to two abort hooks in place (HookAbort: the
// upstream connection's close).
//
// The rest is context.Context's contract: Done is closed and Err set once;
// children made by the context package and context.AfterFunc follow it
// through its AfterFunc method; values are the parent's, seen so that the
// context package never mistakes an ancestor's cancelCtx for this one
// (context.Cause of a Ctx is its Err; Cause gives its own cause).
package legctx

import (
	"context"
	"sync"
	"time"
)

// Canceler is a context that follows a parent in place: the parent calls
// ParentDone once, with its Err, when it ends (quick and non-blocking).
type Canceler interface {
	ParentDone(err error)
}

// Follower is a parent context that notifies a Canceler in place, without
// allocating. Follow reports false when it cannot take one more (the
// caller falls back to context.AfterFunc); a parent already ended calls
// ParentDone at once. Unfollow(id) stops the notification and reports
// whether that kept it from happening.
type Follower interface {
	context.Context
	Follow(c Canceler) (id uint64, ok bool)
	Unfollow(id uint64) bool
}

// Ctx is the child context. The zero value is not usable: call Init once,
// before sharing it. A Ctx must not be copied after Init.
type Ctx struct {
	parent context.Context
	vals   context.Context // Value's: the parent, or a WithoutCancel view of it

	mu       sync.Mutex
	done     chan struct{} // made on the first Done
	err      error
	cause    error
	deadline time.Time   // its own (Init's timeout), zero when none
	timer    *time.Timer // the own deadline's

	// The link to the parent: an in-place follow (fparent, fid) or the
	// context package's AfterFunc (fstop). following: not yet stopped.
	fparent   Follower
	fid       uint64
	fstop     func() bool
	following bool

	hooks  Slots[func()]
	afters AfterFuncs
}

var (
	_ context.Context = (*Ctx)(nil)
	_ Canceler        = (*Ctx)(nil)
)

// closedChan is Done for a context ended before anyone asked for Done.
var closedChan = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// Init makes c a child of parent that ends when parent ends (until
// Unfollow), when Cancel is called, or after timeout (> 0) with
// context.DeadlineExceeded.
func (c *Ctx) Init(parent context.Context, timeout time.Duration) {
	c.parent = parent
	f, inPlace := parent.(Follower)
	c.vals = parent
	if !inPlace {
		// A context package's cancelCtx among the ancestors must not
		// answer for this one (context.Cause, its parentCancelCtx).
		c.vals = context.WithoutCancel(parent)
	}
	if err := parent.Err(); err != nil {
		c.cancel(err, context.Cause(parent))
		return
	}
	c.mu.Lock()
	c.following = true
	c.mu.Unlock()
	if inPlace {
		if id, ok := f.Follow(c); ok {
			c.linked(f, id, nil)
			c.arm(timeout)
			return
		}
	}
	c.linked(nil, 0, context.AfterFunc(parent, func() { c.cancel(parent.Err(), context.Cause(parent)) }))
	c.arm(timeout)
}

// linked records the link to the parent, or undoes it when c ended while
// it was being made.
func (c *Ctx) linked(f Follower, id uint64, stop func() bool) {
	c.mu.Lock()
	ended := c.err != nil
	c.fparent, c.fid, c.fstop = f, id, stop
	c.mu.Unlock()
	if !ended {
		return
	}
	if f != nil {
		f.Unfollow(id)
	} else {
		stop()
	}
}

// arm starts the own deadline's timer (timeout > 0).
func (c *Ctx) arm(timeout time.Duration) {
	if timeout <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return
	}
	c.deadline = time.Now().Add(timeout)
	c.timer = time.AfterFunc(timeout, c.expire)
}

// ParentDone is the parent's in-place notification (Follower).
func (c *Ctx) ParentDone(err error) { c.cancel(err, err) }

// Cancel ends the context with context.Canceled; cause (nil: Canceled) is
// what Cause reports. The first end wins.
func (c *Ctx) Cancel(cause error) {
	if cause == nil {
		cause = context.Canceled
	}
	c.cancel(context.Canceled, cause)
}

// Cause is the cause the context ended with (nil while it has not).
func (c *Ctx) Cause() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cause
}

// Unfollow stops the parent's end from ending c (c keeps its own
// deadline and Cancel). It reports whether c was still following a live
// parent: false when the parent's end already ended c, or c had ended.
func (c *Ctx) Unfollow() bool {
	c.mu.Lock()
	if !c.following || c.err != nil {
		c.mu.Unlock()
		return false
	}
	c.following = false
	f, id, stop := c.fparent, c.fid, c.fstop
	c.mu.Unlock()
	if f != nil {
		return f.Unfollow(id)
	}
	if stop != nil {
		return stop()
	}
	return true
}

func (c *Ctx) expire() { c.cancel(context.DeadlineExceeded, context.DeadlineExceeded) }

func (c *Ctx) cancel(err, cause error) {
	if cause == nil {
		cause = err
	}
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err, c.cause = err, cause
	if c.done != nil {
		close(c.done)
	}
	hooks, afters := c.hooks.Take(), c.afters.Take()
	following := c.following
	c.following = false
	f, id, stop := c.fparent, c.fid, c.fstop
	t := c.timer
	c.mu.Unlock()
	if t != nil {
		t.Stop()
	}
	if following { // release the parent's hold on c
		if f != nil {
			f.Unfollow(id)
		} else if stop != nil {
			stop()
		}
	}
	hooks.Each(run)
	afters.Run()
}

// Deadline is the earlier of its own and, while it follows the parent,
// the parent's.
func (c *Ctx) Deadline() (time.Time, bool) {
	c.mu.Lock()
	dl, following := c.deadline, c.following
	c.mu.Unlock()
	if following {
		if pd, ok := c.parent.Deadline(); ok && (dl.IsZero() || pd.Before(dl)) {
			dl = pd
		}
	}
	return dl, !dl.IsZero()
}

func (c *Ctx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		if c.err != nil {
			return closedChan
		}
		c.done = make(chan struct{})
	}
	return c.done
}

func (c *Ctx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// Value is the parent's value for key.
func (c *Ctx) Value(key any) any { return c.vals.Value(key) }

// HookAbort registers f to run when the context ends, synchronously in
// the goroutine that ends it (f must be quick and must not block: it
// closes a connection). It reports false when both hook slots are taken
// (the caller then uses context.AfterFunc); a context already ended runs f
// at once. UnhookAbort(id) undoes it.
func (c *Ctx) HookAbort(f func()) (id uint64, ok bool) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		f()
		return 0, true
	}
	id, ok = c.hooks.Put(f)
	c.mu.Unlock()
	return id, ok
}

// UnhookAbort removes the hook HookAbort registered as id and reports
// whether that stopped it from running (false: the context ended, and it
// ran or runs).
func (c *Ctx) UnhookAbort(id uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil || id == 0 {
		return false
	}
	c.hooks.Remove(id)
	return true
}

func run(f func()) { f() }

// AfterFunc is context.AfterFunc's contract for this context (the context
// package's children use it to follow it): f runs in its own goroutine
// once the context ends; stop reports whether it prevented that.
func (c *Ctx) AfterFunc(f func()) (stop func() bool) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		go f()
		return Stopped
	}
	stop = c.afters.Add(&c.mu, f)
	c.mu.Unlock()
	return stop
}
