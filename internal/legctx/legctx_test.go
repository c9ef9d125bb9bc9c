package legctx

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// parent is an in-place Follower over a context package's context.
type parent struct {
	context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	seq      uint64
	children map[uint64]Canceler
	follows  int // Follow calls that took a slot
	full     bool
}

func newParent(t *testing.T) *parent {
	ctx, cancel := context.WithCancel(context.Background())
	p := &parent{Context: ctx, cancel: cancel, children: map[uint64]Canceler{}}
	context.AfterFunc(ctx, p.end)
	t.Cleanup(cancel)
	return p
}

func (p *parent) Follow(c Canceler) (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.full {
		return 0, false
	}
	p.seq++
	p.children[p.seq] = c
	p.follows++
	return p.seq, true
}

func (p *parent) Unfollow(id uint64) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.children[id]
	delete(p.children, id)
	return ok
}

func (p *parent) end() {
	p.mu.Lock()
	cs := p.children
	p.children = map[uint64]Canceler{}
	p.mu.Unlock()
	for _, c := range cs {
		c.ParentDone(p.Err())
	}
}

func (p *parent) held() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.children)
}

func ended(t *testing.T, c *Ctx, err, cause error) {
	t.Helper()
	select {
	case <-c.Done():
	case <-time.After(5 * time.Second):
		t.Fatalf("Done not closed")
	}
	if c.Err() != err || !errors.Is(c.Cause(), cause) {
		t.Fatalf("Err %v, Cause %v; want %v, %v", c.Err(), c.Cause(), err, cause)
	}
}

// released waits (bounded) for the parent to let go of its ended children:
// an end that runs on another goroutine (a deadline's timer, the parent's
// own end) closes Done first and unlinks from the parent after.
func released(t *testing.T, p *parent) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); p.held() != 0; {
		if time.Now().After(deadline) {
			t.Fatalf("the parent still holds %d ended children after 5 s", p.held())
		}
		time.Sleep(time.Millisecond)
	}
}

func live(t *testing.T, c *Ctx) {
	t.Helper()
	select {
	case <-c.Done():
		t.Fatalf("ended early: %v", c.Err())
	default:
	}
	if c.Err() != nil || c.Cause() != nil {
		t.Fatalf("Err %v, Cause %v on a live context", c.Err(), c.Cause())
	}
}

var errMine = errors.New("mine")

func TestEnds(t *testing.T) {
	type parentKind int
	const (
		inPlace parentKind = iota
		fallback
	)
	cases := []struct {
		name   string
		kind   parentKind
		end    func(*parent, *Ctx)
		err    error
		cause  error
		detach bool // the parent no longer holds the child afterwards
	}{
		{"cancel, in place", inPlace, func(_ *parent, c *Ctx) { c.Cancel(errMine) }, context.Canceled, errMine, true},
		{"cancel nil cause", inPlace, func(_ *parent, c *Ctx) { c.Cancel(nil) }, context.Canceled, context.Canceled, true},
		{"parent ends, in place", inPlace, func(p *parent, _ *Ctx) { p.cancel() }, context.Canceled, context.Canceled, true},
		{"cancel, fallback", fallback, func(_ *parent, c *Ctx) { c.Cancel(errMine) }, context.Canceled, errMine, true},
		{"parent ends, fallback", fallback, func(p *parent, _ *Ctx) { p.cancel() }, context.Canceled, context.Canceled, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newParent(t)
			p.full = tc.kind == fallback
			var c Ctx
			c.Init(p, 0)
			live(t, &c)
			if want := 1 - int(tc.kind); p.held() != want {
				t.Fatalf("parent holds %d children, want %d", p.held(), want)
			}
			tc.end(p, &c)
			ended(t, &c, tc.err, tc.cause)
			released(t, p)
			c.Cancel(errors.New("later")) // the first end wins
			ended(t, &c, tc.err, tc.cause)
		})
	}
}

func TestContextPackageParent(t *testing.T) {
	cause := errors.New("parent's cause")
	ctx, cancel := context.WithCancelCause(context.Background())
	var c Ctx
	c.Init(ctx, 0)
	live(t, &c)
	cancel(cause)
	ended(t, &c, context.Canceled, cause)

	// A parent already ended ends the child at Init.
	var d Ctx
	d.Init(ctx, time.Hour)
	ended(t, &d, context.Canceled, cause)
	if _, ok := d.Deadline(); ok {
		t.Errorf("a child born ended armed its deadline")
	}
}

func TestDeadline(t *testing.T) {
	p := newParent(t)
	var c Ctx
	c.Init(p, 20*time.Millisecond)
	dl, ok := c.Deadline()
	if !ok || time.Until(dl) > 20*time.Millisecond {
		t.Fatalf("Deadline %v %v", dl, ok)
	}
	ended(t, &c, context.DeadlineExceeded, context.DeadlineExceeded)
	released(t, p)

	// The parent's earlier deadline counts while the child follows it.
	pctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	pdl, _ := pctx.Deadline()
	var d Ctx
	d.Init(pctx, 2*time.Hour)
	if dl, _ := d.Deadline(); !dl.Equal(pdl) {
		t.Errorf("following: Deadline %v, want the parent's %v", dl, pdl)
	}
	if !d.Unfollow() {
		t.Fatalf("Unfollow of a live child reported false")
	}
	if dl, _ := d.Deadline(); !dl.After(pdl) {
		t.Errorf("unfollowed: Deadline %v, want its own (after %v)", dl, pdl)
	}
	d.Cancel(nil)
}

func TestUnfollow(t *testing.T) {
	for _, full := range []bool{false, true} {
		p := newParent(t)
		p.full = full
		var c Ctx
		c.Init(p, 0)
		if !c.Unfollow() {
			t.Fatalf("full=%v: Unfollow of a live child reported false", full)
		}
		if c.Unfollow() {
			t.Errorf("full=%v: a second Unfollow reported true", full)
		}
		p.cancel()
		time.Sleep(10 * time.Millisecond) // a fallback link would end it in a goroutine
		live(t, &c)
		c.Cancel(errMine)
		ended(t, &c, context.Canceled, errMine)
	}

	p := newParent(t)
	var c Ctx
	c.Init(p, 0)
	p.cancel()
	ended(t, &c, context.Canceled, context.Canceled)
	if c.Unfollow() {
		t.Errorf("Unfollow after the parent ended the child reported true")
	}
}

func TestHooks(t *testing.T) {
	p := newParent(t)
	var c Ctx
	c.Init(p, 0)
	var ran [3]int
	id0, ok0 := c.HookAbort(func() { ran[0]++ })
	_, ok1 := c.HookAbort(func() { ran[1]++ })
	if _, ok := c.HookAbort(func() { ran[2]++ }); !ok0 || !ok1 || ok {
		t.Fatalf("hook slots: %v %v %v, want two taken then a refusal", ok0, ok1, ok)
	}
	if !c.UnhookAbort(id0) {
		t.Fatalf("UnhookAbort of a live hook reported false")
	}
	id2, ok := c.HookAbort(func() { ran[2]++ }) // the freed slot
	if !ok {
		t.Fatalf("a freed slot was not reused")
	}
	c.Cancel(nil) // hooks run synchronously
	if ran != [3]int{0, 1, 1} {
		t.Errorf("hooks ran %v, want [0 1 1]", ran)
	}
	if c.UnhookAbort(id2) {
		t.Errorf("UnhookAbort after the end reported true")
	}
	late := false
	if _, ok := c.HookAbort(func() { late = true }); !ok || !late {
		t.Errorf("a hook on an ended context did not run at once")
	}
}

func TestContextPackageChildren(t *testing.T) {
	p := newParent(t)
	var c Ctx
	c.Init(p, 0)
	child, cancelChild := context.WithCancel(&c)
	defer cancelChild()
	ran := make(chan struct{})
	context.AfterFunc(&c, func() { close(ran) })
	stopped := false
	stop := context.AfterFunc(&c, func() { stopped = true })
	if !stop() {
		t.Fatalf("stop of a pending AfterFunc reported false")
	}
	c.Cancel(errMine)
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatalf("a context package child did not end with its parent")
	}
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatalf("AfterFunc did not run")
	}
	if stopped {
		t.Errorf("a stopped AfterFunc ran")
	}
	if child.Err() != context.Canceled {
		t.Errorf("child Err %v", child.Err())
	}
}

type key struct{}

func TestValues(t *testing.T) {
	// The ancestors hold a context package cancelCtx that is still live:
	// context.Cause of the ended child must be its own end, not the
	// ancestor's (nil).
	base, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "v"))
	defer cancel()
	var c Ctx
	c.Init(base, 0)
	if c.Value(key{}) != "v" {
		t.Errorf("Value %v, want the parent's", c.Value(key{}))
	}
	c.Cancel(errMine)
	if got := context.Cause(&c); got != context.Canceled {
		t.Errorf("context.Cause %v, want its Err", got)
	}
	grandchild, stop := context.WithCancel(&c)
	defer stop()
	<-grandchild.Done()
	if got := context.Cause(grandchild); got != context.Canceled {
		t.Errorf("a child's context.Cause %v", got)
	}
}

// TestNoAllocations holds the package to its point: under an in-place
// parent, a leg's life (Init, an abort hook, its release, Cancel) costs no
// allocation.
func TestNoAllocations(t *testing.T) {
	p := newParent(t)
	hook := func() {}
	var c Ctx
	allocs := testing.AllocsPerRun(100, func() {
		c = Ctx{}
		c.Init(p, 0)
		id, _ := c.HookAbort(hook)
		c.UnhookAbort(id)
		if c.Err() != nil || c.Cause() != nil {
			t.Fatal("ended early")
		}
		c.Cancel(nil)
	})
	if allocs != 0 {
		t.Errorf("%v allocations per leg, want none of the Ctx's own", allocs)
	}
}

func TestRace(t *testing.T) {
	for range 200 {
		p := newParent(t)
		var c Ctx
		c.Init(p, time.Millisecond)
		var wg sync.WaitGroup
		wg.Add(4)
		go func() { defer wg.Done(); p.cancel() }()
		go func() { defer wg.Done(); c.Cancel(errMine) }()
		go func() { defer wg.Done(); c.Unfollow() }()
		go func() {
			defer wg.Done()
			if id, ok := c.HookAbort(func() {}); ok {
				c.UnhookAbort(id)
			}
			_, _ = c.Deadline()
		}()
		wg.Wait()
		<-c.Done()
		released(t, p)
	}
}
