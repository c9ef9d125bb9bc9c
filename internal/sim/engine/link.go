package engine

import (
	"container/heap"
	"context"
	"sync"
	"time"
)

// Link is a serial transfer resource: one writer thread per engine (MoRI-IO
// "moriio-write-worker"), through which layer transfers run one at a time.
//
// A transfer is a list of per-layer tasks, each ready at its own time (when
// the layer's compute is done). A gated transfer's tasks are not eligible
// until Open (D's remote_blocks arrived); then task i is ready at
// max(layer_i_done, gate). Tasks run in order of readiness, each taking the
// per-layer duration; done fires (on the Run goroutine) at the simulated end
// of the transfer's last task.
//
// The Link works in virtual time: it commits every task that is ready by the
// time the writer becomes free, and sleeps only until the next readiness or
// completion, so a 61-layer transfer costs a handful of wake-ups.
type Link struct {
	mu     sync.Mutex
	freeAt time.Time
	xfers  map[string]*linkXfer
	ready  taskHeap
	dones  []*linkXfer // committed, ordered by end
	seq    uint64
	wake   chan struct{}
	closed bool
}

type linkXfer struct {
	id        string
	gated     bool
	gateAt    time.Time
	held      []linkTask // tasks waiting for the gate
	remaining int
	end       time.Time
	done      func(end time.Time)
	cancelled bool
}

type linkTask struct {
	x     *linkXfer
	ready time.Time
	dur   time.Duration
	seq   uint64
}

type taskHeap []linkTask

func (h taskHeap) Len() int { return len(h) }
func (h taskHeap) Less(i, j int) bool {
	if !h[i].ready.Equal(h[j].ready) {
		return h[i].ready.Before(h[j].ready)
	}
	return h[i].seq < h[j].seq
}
func (h taskHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *taskHeap) Push(x any)   { *h = append(*h, x.(linkTask)) }
func (h *taskHeap) Pop() any {
	old := *h
	n := len(old)
	x := old[n-1]
	old[n-1] = linkTask{}
	*h = old[:n-1]
	return x
}

// NewLink returns an idle link; call Run to drive it.
func NewLink() *Link {
	return &Link{xfers: make(map[string]*linkXfer), wake: make(chan struct{}, 1)}
}

// Add registers transfer id with one task per ready time, each taking dur.
// A gated transfer waits for Open. done runs at the transfer's end unless
// it is cancelled. Adding an id that exists replaces nothing and returns
// false.
func (l *Link) Add(id string, readyAt []time.Time, dur time.Duration, gated bool, done func(end time.Time)) bool {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return false
	}
	if _, dup := l.xfers[id]; dup {
		l.mu.Unlock()
		return false
	}
	x := &linkXfer{id: id, gated: gated, remaining: len(readyAt), done: done}
	l.xfers[id] = x
	for _, r := range readyAt {
		l.seq++
		t := linkTask{x: x, ready: r, dur: dur, seq: l.seq}
		if gated {
			x.held = append(x.held, t)
		} else {
			heap.Push(&l.ready, t)
		}
	}
	if len(readyAt) == 0 {
		x.end = time.Now()
		l.dones = append(l.dones, x)
	}
	l.mu.Unlock()
	l.kick()
	return true
}

// Open releases a gated transfer's tasks as of time at. It reports whether
// the transfer exists.
func (l *Link) Open(id string, at time.Time) bool {
	l.mu.Lock()
	x, ok := l.xfers[id]
	if !ok || x.cancelled {
		l.mu.Unlock()
		return false
	}
	if x.gated {
		x.gated = false
		x.gateAt = at
		for _, t := range x.held {
			if t.ready.Before(at) {
				t.ready = at
			}
			heap.Push(&l.ready, t)
		}
		x.held = nil
	}
	l.mu.Unlock()
	l.kick()
	return true
}

// Cancel drops a transfer; its done never runs. Tasks already committed
// keep the writer busy (they were in flight).
func (l *Link) Cancel(id string) {
	l.mu.Lock()
	if x, ok := l.xfers[id]; ok {
		x.cancelled = true
		x.held = nil
		delete(l.xfers, id)
	}
	l.mu.Unlock()
	l.kick()
}

// Pending returns the number of registered, unfinished transfers.
func (l *Link) Pending() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.xfers)
}

func (l *Link) kick() {
	select {
	case l.wake <- struct{}{}:
	default:
	}
}

// Run drives the link until ctx is done.
func (l *Link) Run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var fire []*linkXfer
	for {
		now := time.Now()
		l.mu.Lock()
		horizon := now
		if l.freeAt.After(horizon) {
			horizon = l.freeAt
		}
		for l.ready.Len() > 0 {
			t := l.ready[0]
			if t.x.cancelled {
				heap.Pop(&l.ready)
				continue
			}
			if t.ready.After(horizon) {
				break
			}
			heap.Pop(&l.ready)
			start := t.ready
			if l.freeAt.After(start) {
				start = l.freeAt
			}
			l.freeAt = start.Add(t.dur)
			if l.freeAt.After(horizon) {
				horizon = l.freeAt
			}
			t.x.remaining--
			if t.x.remaining == 0 {
				t.x.end = l.freeAt
				l.dones = append(l.dones, t.x)
			}
		}
		fire = fire[:0]
		for len(l.dones) > 0 && !l.dones[0].end.After(now) {
			x := l.dones[0]
			l.dones[0] = nil
			l.dones = l.dones[1:]
			if x.cancelled {
				continue
			}
			delete(l.xfers, x.id)
			fire = append(fire, x)
		}
		var next time.Time
		if len(l.dones) > 0 {
			next = l.dones[0].end
		}
		if l.ready.Len() > 0 {
			if r := l.ready[0].ready; next.IsZero() || r.Before(next) {
				next = r
			}
		}
		l.mu.Unlock()
		for _, x := range fire {
			if x.done != nil {
				x.done(x.end)
			}
		}
		if len(fire) > 0 {
			continue // time moved while callbacks ran
		}
		var tc <-chan time.Time
		if !next.IsZero() {
			timer.Reset(time.Until(next))
			tc = timer.C
		}
		select {
		case <-ctx.Done():
			l.mu.Lock()
			l.closed = true
			l.mu.Unlock()
			return
		case <-l.wake:
			timer.Stop()
		case <-tc:
		}
	}
}
