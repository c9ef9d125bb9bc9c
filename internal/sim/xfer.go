package sim

import (
	"sync"
	"time"
)

// pinned is the state every prefill-side pinned transfer shares: its id,
// request and DP rank, the defer timer that frees it when the decode never
// comes, and the done flag (set once, under the rank's lock).
type pinned struct {
	id    string
	j     *job
	rank  int
	timer *time.Timer
	done  bool
}

func (p *pinned) pin() *pinned { return p }

// disarm stops the defer timer (caller holds the rank's lock).
func (p *pinned) disarm() {
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
}

// pinnedXfer is a connector's transfer type (a pointer embedding pinned).
type pinnedXfer interface {
	comparable
	pin() *pinned
}

// xferTable is one DP rank's pinned transfers by id. mu also guards the
// connector's other per-rank state.
type xferTable[X pinnedXfer] struct {
	mu    sync.Mutex
	xfers map[string]X
}

func newXferTable[X pinnedXfer]() xferTable[X] {
	return xferTable[X]{xfers: make(map[string]X)}
}

// size is the number of pinned transfers.
func (t *xferTable[X]) size() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.xfers)
}

// lookup returns the transfer pinned under id (zero if none).
func (t *xferTable[X]) lookup(id string) X {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.xfers[id]
}

// add pins x under its id. A transfer already pinned under that id is first
// handed to drop with the lock released; then (if non-nil) runs with the
// lock held right after x is stored.
func (t *xferTable[X]) add(x X, drop func(old X), then func()) {
	var zero X
	id := x.pin().id
	t.mu.Lock()
	if old := t.xfers[id]; old != zero {
		t.mu.Unlock()
		drop(old)
		t.mu.Lock()
	}
	t.xfers[id] = x
	if then != nil {
		then()
	}
	t.mu.Unlock()
}

// finish ends x once: marks it done, unpins it (if it is still the
// transfer pinned under its id) and stops its defer timer. It returns false
// when x was already done.
func (t *xferTable[X]) finish(x X) bool {
	return t.end(x, false)
}

// complete is finish for a transfer whose handoff succeeded: its id is
// unpinned unconditionally.
func (t *xferTable[X]) complete(x X) bool {
	return t.end(x, true)
}

func (t *xferTable[X]) end(x X, always bool) bool {
	p := x.pin()
	t.mu.Lock()
	defer t.mu.Unlock()
	if p.done {
		return false
	}
	p.done = true
	if always || t.xfers[p.id] == x {
		delete(t.xfers, p.id)
	}
	p.disarm()
	return true
}

// earlyEntry is a message kept until its request arrives.
type earlyEntry[M any] struct {
	val   M
	timer *time.Timer
}

// earlyMap holds messages that arrived before their request, each for at
// most the defer timeout. Callers hold the lock passed to stash.
type earlyMap[M any] map[string]*earlyEntry[M]

// stash keeps v under key (replacing and disarming an older entry); the
// defer timer drops it again under mu.
func (e earlyMap[M]) stash(in *Instance, mu *sync.Mutex, key string, v M) {
	if old := e[key]; old != nil {
		old.timer.Stop()
	}
	ent := &earlyEntry[M]{val: v}
	ent.timer = in.deferTimer(func() {
		mu.Lock()
		if e[key] == ent {
			delete(e, key)
		}
		mu.Unlock()
	})
	e[key] = ent
}

// take removes the entry under key, stopping its timer.
func (e earlyMap[M]) take(key string) (M, bool) {
	ent := e[key]
	if ent == nil {
		var zero M
		return zero, false
	}
	ent.timer.Stop()
	delete(e, key)
	return ent.val, true
}

// await registers j as waiting under key unless a message for key already
// arrived: then j is not registered and the message is returned. Callers
// hold the lock that guards e and waiters.
func (e earlyMap[M]) await(waiters map[string]*job, key string, j *job) (M, bool) {
	waiters[key] = j
	v, ok := e.take(key)
	if ok {
		delete(waiters, key)
	}
	return v, ok
}

// forgetWaiter returns a func that removes j from waiters (under mu) if it
// is still the request waiting under key.
func forgetWaiter(mu *sync.Mutex, waiters map[string]*job, key string, j *job) func() {
	return func() {
		mu.Lock()
		if waiters[key] == j {
			delete(waiters, key)
		}
		mu.Unlock()
	}
}
