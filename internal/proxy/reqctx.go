package proxy

import (
	"context"
	"time"
)

// A request context may do in place what context's functions do with a
// child (h1server's request contexts do): the router's per-request
// deadline, its request state and the upstream connection's abort hook
// then cost no allocation. Any other context goes through the context
// package as before.
type (
	valueSetter interface {
		SetValue(key, val any) bool
	}
	deadlineTightener interface {
		TightenDeadline(t time.Time) bool
	}
	abortHooker interface {
		HookAbort(f func()) (id uint64, ok bool)
		UnhookAbort(id uint64) bool
	}
)

func noCancel() {}

// WithRequestDeadline is context.WithDeadline(ctx, t) for a request's own
// deadline: a context that can take it in place takes it (its cancel
// does nothing; the request's end releases it).
func WithRequestDeadline(ctx context.Context, t time.Time) (context.Context, context.CancelFunc) {
	if d, ok := ctx.(deadlineTightener); ok && d.TightenDeadline(t) {
		return ctx, noCancel
	}
	return context.WithDeadline(ctx, t)
}

// withValue is context.WithValue, in place when ctx can take it.
func withValue(ctx context.Context, key, val any) context.Context {
	if s, ok := ctx.(valueSetter); ok && s.SetValue(key, val) {
		return ctx
	}
	return context.WithValue(ctx, key, val)
}

// abortOnDone runs f once ctx ends, as context.AfterFunc, until stop.
type abortOnDone struct {
	h    abortHooker // the in-place hook, or
	id   uint64
	stop func() bool // context.AfterFunc's
}

// set registers f (quick and non-blocking: it closes a connection).
func (a *abortOnDone) set(ctx context.Context, f func()) {
	if h, ok := ctx.(abortHooker); ok {
		if id, ok := h.HookAbort(f); ok {
			a.h, a.id = h, id
			return
		}
	}
	a.stop = context.AfterFunc(ctx, f)
}

// release stops f and reports whether that kept it from running.
func (a *abortOnDone) release() bool {
	if a.h != nil {
		return a.h.UnhookAbort(a.id)
	}
	return a.stop()
}
