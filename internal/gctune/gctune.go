// Package gctune gives the Go garbage collector a heap floor: while the
// live heap is small, GOGC is raised so that the next collection starts no
// earlier than at Floor bytes of heap; once the live heap is large enough
// that GOGC=Base already puts the goal above the floor, Base applies as it
// is.
//
// Why a router wants it: a proxy's live heap is a few MiB (its connections'
// state), while it allocates a few KiB per request, so at the default
// GOGC=100 it collects tens of times a second under load, for almost no
// garbage each time. With a 16 MiB floor it collects several times less
// often for at most the floor in extra heap, and where memory matters (the
// live heap of thousands of open streams is above the floor) it paces as
// Go's default does. GOMEMLIMIT, when set, still bounds the heap.
//
// The tuner runs after every collection: a finalizer on a sentinel object,
// re-armed each time, reads the live heap that collection marked
// (runtime/metrics /gc/heap/live:bytes) and sets GOGC with
// debug.SetGCPercent. It has no goroutine of its own (finalizers run on
// the runtime's finalizer goroutine); Stop ends the chain and restores
// Base.
package gctune

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
)

// maxPercent bounds the GOGC the tuner sets (a live heap of a few hundred
// KiB under a large floor would ask for more).
const maxPercent = 10000

// Tuner keeps the heap floor until Stop.
type Tuner struct {
	floor uint64
	base  int

	mu      sync.Mutex
	stopped bool
	percent int // the GOGC in force
	runs    int // collections seen
	sample  []metrics.Sample
}

// Start installs a floor of floor bytes over the GOGC base (Go's default
// is 100) and returns its tuner; floor 0 returns nil (nothing installed).
// The first adjustment follows the next collection.
func Start(floor uint64, base int) *Tuner {
	if floor == 0 {
		return nil
	}
	t := &Tuner{floor: floor, base: base, percent: base,
		sample: []metrics.Sample{{Name: "/gc/heap/live:bytes"}}}
	debug.SetGCPercent(base)
	t.arm()
	return t
}

// sentinel is garbage as soon as it is armed: its finalizer runs after the
// first collection that finds it unreachable.
type sentinel struct{ t *Tuner }

func (t *Tuner) arm() {
	s := &sentinel{t}
	runtime.SetFinalizer(s, func(s *sentinel) { s.t.collected() })
}

// collected runs on the finalizer goroutine after a collection.
func (t *Tuner) collected() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	t.runs++
	metrics.Read(t.sample)
	if v := t.sample[0].Value; v.Kind() == metrics.KindUint64 {
		if p := PercentFor(v.Uint64(), t.floor, t.base); p != t.percent {
			debug.SetGCPercent(p)
			t.percent = p
		}
	}
	t.arm()
}

// Percent reports the GOGC the tuner last set.
func (t *Tuner) Percent() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.percent
}

// Stop ends the tuning and restores the base GOGC. A nil tuner does
// nothing.
func (t *Tuner) Stop() {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	t.stopped = true
	debug.SetGCPercent(t.base)
	t.percent = t.base
}

// PercentFor is the GOGC that puts the heap goal of a live heap of live
// bytes at floor or above: live × (1 + GOGC/100) ≥ floor. It is never below
// base, never above maxPercent, and rounded up to a multiple of 10 % of
// base (so that small changes of the live heap do not reset GOGC after
// every collection).
func PercentFor(live, floor uint64, base int) int {
	if base <= 0 || live >= floor {
		return base
	}
	if live == 0 {
		return maxPercent
	}
	need := (floor - live) * 100 / live // live × (1 + need/100) ≈ floor
	if need <= uint64(base) {
		return base
	}
	if need >= maxPercent {
		return maxPercent
	}
	step := uint64(max(base/10, 1))
	p := int((need + step - 1) / step * step)
	return min(p, maxPercent)
}
