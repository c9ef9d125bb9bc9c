package h1server

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/legctx"
)

type baseKey struct{}

// newTestCtx makes a connection on base and begins a request context on it.
func newTestCtx(t *testing.T, base context.Context) (*conn, *reqCtx) {
	t.Helper()
	c := &conn{ctx: base}
	r := &reqCtx{}
	c.beginCtx(r)
	t.Cleanup(c.stopCtx)
	return c, r
}

func isDone(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return true
	default:
		return false
	}
}

func waitDone(t *testing.T, ctx context.Context, within time.Duration) {
	t.Helper()
	select {
	case <-ctx.Done():
	case <-time.After(within):
		t.Fatalf("context not done within %v", within)
	}
}

// The ways a request context ends, each with the error context.Context's
// contract gives it and with its children and AfterFuncs following.
func TestReqCtxEnds(t *testing.T) {
	tests := []struct {
		name string
		end  func(c *conn, r *reqCtx, cancelBase context.CancelFunc)
		want error
	}{
		{"handler returned", func(c *conn, r *reqCtx, _ context.CancelFunc) { c.endCtx(r) }, context.Canceled},
		{"client gone", func(_ *conn, r *reqCtx, _ context.CancelFunc) { r.cancel(context.Canceled) }, context.Canceled},
		{"base ended", func(_ *conn, _ *reqCtx, cancelBase context.CancelFunc) { cancelBase() }, context.Canceled},
		{"deadline", func(_ *conn, r *reqCtx, _ context.CancelFunc) {
			r.TightenDeadline(time.Now().Add(20 * time.Millisecond))
		}, context.DeadlineExceeded},
		{"past deadline", func(_ *conn, r *reqCtx, _ context.CancelFunc) { r.TightenDeadline(time.Now().Add(-time.Second)) }, context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			base, cancelBase := context.WithCancel(context.WithValue(context.Background(), baseKey{}, "b"))
			defer cancelBase()
			c, r := newTestCtx(t, base)
			child, cancelChild := context.WithCancel(r)
			defer cancelChild()
			var after atomic.Bool
			ran := make(chan struct{})
			context.AfterFunc(r, func() { after.Store(true); close(ran) })
			var hooked atomic.Int32
			if _, ok := r.HookAbort(func() { hooked.Add(1) }); !ok {
				t.Fatal("HookAbort refused on a fresh context")
			}
			if isDone(r) || r.Err() != nil {
				t.Fatal("context done before it ended")
			}

			tt.end(c, r, cancelBase)

			waitDone(t, r, 2*time.Second)
			waitDone(t, child, 2*time.Second)
			if !errors.Is(r.Err(), tt.want) {
				t.Errorf("Err = %v, want %v", r.Err(), tt.want)
			}
			if got := context.Cause(r); !errors.Is(got, tt.want) {
				t.Errorf("Cause = %v, want %v", got, tt.want)
			}
			if got := context.Cause(child); !errors.Is(got, tt.want) {
				t.Errorf("child's Cause = %v, want %v", got, tt.want)
			}
			select {
			case <-ran:
			case <-time.After(2 * time.Second):
				t.Fatal("AfterFunc did not run")
			}
			if n := hooked.Load(); n != 1 {
				t.Errorf("abort hook ran %d times, want 1", n)
			}
			c.endCtx(r) // a second end changes nothing
			if !errors.Is(r.Err(), tt.want) || hooked.Load() != 1 {
				t.Errorf("after a second end: Err = %v, hook ran %d times", r.Err(), hooked.Load())
			}
		})
	}
}

func TestReqCtxDeadlineOnlyTightens(t *testing.T) {
	_, r := newTestCtx(t, context.Background())
	if _, ok := r.Deadline(); ok {
		t.Fatal("a new request context has a deadline")
	}
	early := time.Now().Add(time.Hour)
	r.TightenDeadline(early)
	r.TightenDeadline(early.Add(time.Hour)) // later: ignored
	if dl, ok := r.Deadline(); !ok || !dl.Equal(early) {
		t.Fatalf("Deadline = %v, %v; want %v", dl, ok, early)
	}
	// A child asking for a later deadline keeps the parent's.
	child, cancel := context.WithDeadline(r, early.Add(time.Minute))
	defer cancel()
	if dl, _ := child.Deadline(); !dl.Equal(early) {
		t.Errorf("child's deadline = %v, want the parent's %v", dl, early)
	}
	r.TightenDeadline(time.Now().Add(20 * time.Millisecond))
	waitDone(t, r, 2*time.Second)
	if !errors.Is(r.Err(), context.DeadlineExceeded) {
		t.Errorf("Err = %v, want DeadlineExceeded", r.Err())
	}
}

// The connection's deadline timer is shared by its requests one after
// another: an ended request's deadline must not end the next one.
func TestReqCtxStaleDeadlineSparesNextRequest(t *testing.T) {
	c, r1 := newTestCtx(t, context.Background())
	r1.TightenDeadline(time.Now().Add(30 * time.Millisecond))
	c.endCtx(r1)
	r2 := &reqCtx{}
	c.beginCtx(r2)
	time.Sleep(80 * time.Millisecond)
	if r2.Err() != nil {
		t.Fatalf("the next request ended with %v at the earlier request's deadline", r2.Err())
	}
	r2.TightenDeadline(time.Now().Add(20 * time.Millisecond))
	waitDone(t, r2, 2*time.Second)
	if !errors.Is(r2.Err(), context.DeadlineExceeded) {
		t.Errorf("Err = %v, want DeadlineExceeded", r2.Err())
	}
}

func TestReqCtxBeginOnEndedBase(t *testing.T) {
	base, cancel := context.WithCancel(context.Background())
	cancel()
	_, r := newTestCtx(t, base)
	if !isDone(r) || !errors.Is(r.Err(), context.Canceled) {
		t.Fatalf("a request begun on an ended base: done=%v Err=%v", isDone(r), r.Err())
	}
}

func TestReqCtxValues(t *testing.T) {
	type k1 struct{}
	type k2 struct{}
	base := context.WithValue(context.Background(), baseKey{}, "b")
	_, r := newTestCtx(t, base)
	if got := r.Value(baseKey{}); got != "b" {
		t.Errorf("base value = %v, want b", got)
	}
	if !r.SetValue(k1{}, 1) {
		t.Fatal("first SetValue refused")
	}
	if r.SetValue(k2{}, 2) {
		t.Error("second SetValue taken: one value per request")
	}
	if r.SetValue(nil, 3) {
		t.Error("SetValue with a nil key taken")
	}
	if got := r.Value(k1{}); got != 1 {
		t.Errorf("Value(k1) = %v, want 1", got)
	}
	if got := r.Value(k2{}); got != nil {
		t.Errorf("Value(k2) = %v, want nil", got)
	}
	// A child sees the in-place value and the base's.
	child := context.WithValue(r, k2{}, 2)
	if child.Value(k1{}) != 1 || child.Value(k2{}) != 2 || child.Value(baseKey{}) != "b" {
		t.Errorf("child values: %v %v %v", child.Value(k1{}), child.Value(k2{}), child.Value(baseKey{}))
	}
}

func TestReqCtxHooks(t *testing.T) {
	c, r := newTestCtx(t, context.Background())
	var a, b atomic.Int32
	id, ok := r.HookAbort(func() { a.Add(1) })
	if !ok {
		t.Fatal("HookAbort refused")
	}
	if _, ok := r.HookAbort(func() { b.Add(1) }); ok {
		t.Fatal("a second hook taken while the first is registered")
	}
	if !r.UnhookAbort(id) {
		t.Fatal("UnhookAbort before the end reported the hook ran")
	}
	id2, ok := r.HookAbort(func() { b.Add(1) })
	if !ok {
		t.Fatal("HookAbort refused after the first was removed")
	}
	r.UnhookAbort(id) // a stale id leaves the new hook in place
	stopped := false
	stop := r.AfterFunc(func() { stopped = true })
	if !stop() {
		t.Error("stopping an AfterFunc before the end reported false")
	}
	c.endCtx(r)
	if a.Load() != 0 || b.Load() != 1 {
		t.Errorf("hooks ran a=%d b=%d, want a=0 b=1", a.Load(), b.Load())
	}
	if r.UnhookAbort(id2) {
		t.Error("UnhookAbort after the end reported it stopped the hook")
	}
	if stop() {
		t.Error("stopping an AfterFunc twice reported true")
	}
	// On an ended context a hook runs at once and AfterFunc soon.
	var late atomic.Int32
	r.HookAbort(func() { late.Add(1) })
	if late.Load() != 1 {
		t.Error("HookAbort on an ended context did not run its function")
	}
	done := make(chan struct{})
	if r.AfterFunc(func() { close(done) })() {
		t.Error("AfterFunc's stop on an ended context reported true")
	}
	<-done
	time.Sleep(10 * time.Millisecond)
	if stopped {
		t.Error("a stopped AfterFunc ran")
	}
}

// TestReqCtxFollow: a legctx.Ctx follows the request context in place
// (two slots, then the context package's AfterFunc), ends with the
// request's error, and frees its slot when it ends first.
func TestReqCtxFollow(t *testing.T) {
	tests := []struct {
		name string
		end  func(c *conn, r *reqCtx)
		want error
	}{
		{"handler returned", func(c *conn, r *reqCtx) { c.endCtx(r) }, context.Canceled},
		{"deadline", func(_ *conn, r *reqCtx) { r.TightenDeadline(time.Now().Add(-time.Second)) }, context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, r := newTestCtx(t, context.Background())
			var legs [3]legctx.Ctx
			for i := range legs {
				legs[i].Init(r, 0)
			}
			if !r.follows.Has(0) || !r.follows.Has(1) || r.afters.Len() != 1 {
				t.Fatalf("two legs should follow in place and the third through AfterFunc: follows %+v, afters %d", r.follows, r.afters.Len())
			}
			legs[0].Cancel(nil) // ends first: its slot is free again
			if r.follows.Has(0) {
				t.Fatalf("an ended leg still holds its slot")
			}
			var again legctx.Ctx
			again.Init(r, 0)
			if !r.follows.Has(0) || r.afters.Len() != 1 {
				t.Fatalf("the freed slot was not reused (an AfterFunc registration instead)")
			}
			tt.end(c, r)
			for i := 1; i < len(legs); i++ {
				waitDone(t, &legs[i], 5*time.Second)
				if legs[i].Err() != tt.want || legs[i].Cause() != tt.want {
					t.Errorf("leg %d: Err %v, Cause %v; want %v", i, legs[i].Err(), legs[i].Cause(), tt.want)
				}
			}
			if legs[0].Err() != context.Canceled {
				t.Errorf("the leg that ended first: %v", legs[0].Err())
			}
			var late legctx.Ctx
			late.Init(r, 0) // an ended request ends its new leg at once
			if late.Err() != tt.want {
				t.Errorf("a leg of an ended request: Err %v, want %v", late.Err(), tt.want)
			}
		})
	}
}
