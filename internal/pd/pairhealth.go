package pd

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// pairHealth tracks P/D pairs whose KV transfers keep failing (the decode
// never gets its KV within the KV-wait timeout) although each side looks
// healthy on its own — e.g. a notify port unreachable from one decode host,
// or a prefill whose writer thread died for one peer. After threshold
// consecutive transfer failures the pair is avoided for cooldown whenever
// another compatible decode exists; one success clears it. Once the cooldown
// is over the pair is half-open: one request at a time probes it (claim),
// the others keep avoiding it until the probe's KV arrives (the pair is
// cleared) or does not (another cooldown). A probe whose outcome is never
// reported (its client went away) is given up after probeTTL.
//
// A KV-wait timeout alone does not say which side failed. The evidence
// comes from the other pairs: a worker whose transfers failed recently
// (within cooldown) with at least two distinct partners is blamed (failed
// reports it), and the engine then records the timeout on that worker's
// circuit breaker; otherwise the timeout stays a pair failure only.
type pairHealth struct {
	threshold int
	cooldown  time.Duration
	probeTTL  time.Duration
	now       func() time.Time

	n  atomic.Int64 // len(m), for the lock-free fast paths
	mu sync.Mutex
	m  map[[2]string]*pairState
}

type pairState struct {
	fails int       // consecutive transfer failures
	last  time.Time // time of the last one
	until time.Time // avoided until then (set once fails >= threshold)
	probe time.Time // half-open: a probe is in flight until then
}

// halfOpenProbing reports whether st is past its cooldown with a probe in
// flight at now.
func (h *pairHealth) halfOpenProbing(st *pairState, now time.Time) bool {
	return st.fails >= h.threshold && !now.Before(st.until) && now.Before(st.probe)
}

const maxTrackedPairs = 4096

// probeTTL bounds how long a half-open probe is waited for; 0 means the
// cooldown.
func newPairHealth(threshold int, cooldown, probeTTL time.Duration, now func() time.Time) *pairHealth {
	if threshold <= 0 {
		threshold = 3
	}
	if cooldown <= 0 {
		cooldown = 30 * time.Second
	}
	if probeTTL <= 0 {
		probeTTL = cooldown
	}
	return &pairHealth{threshold: threshold, cooldown: cooldown, probeTTL: probeTTL, now: now, m: map[[2]string]*pairState{}}
}

// record notes the outcome of a transfer between p and d.
func (h *pairHealth) record(p, d string, ok bool) {
	if ok {
		h.succeeded(p, d)
		return
	}
	h.failed(p, d)
}

// succeeded clears the pair: its KV arrived.
func (h *pairHealth) succeeded(p, d string) {
	if h.n.Load() == 0 {
		return
	}
	h.mu.Lock()
	delete(h.m, [2]string{p, d})
	h.n.Store(int64(len(h.m)))
	h.mu.Unlock()
}

// failed records a failed transfer between p and d and reports whether p
// (blameP), resp. d (blameD), has now failed transfers with at least two
// distinct partners within the cooldown window: the fault then follows the
// worker across pairs rather than staying with one pair.
func (h *pairHealth) failed(p, d string) (blameP, blameD bool) {
	k := [2]string{p, d}
	h.mu.Lock()
	defer h.mu.Unlock()
	now := h.now()
	st := h.m[k]
	if st == nil {
		if len(h.m) >= maxTrackedPairs {
			h.pruneLocked()
		}
		st = &pairState{}
		h.m[k] = st
		h.n.Store(int64(len(h.m)))
	}
	st.fails++
	st.last = now
	st.probe = time.Time{}
	if st.fails >= h.threshold {
		st.until = now.Add(h.cooldown)
	}
	var ds, ps int // distinct recent failing partners of p, of d
	for pk, ps2 := range h.m {
		if now.Sub(ps2.last) >= h.cooldown {
			continue
		}
		if pk[0] == p {
			ds++
		}
		if pk[1] == d {
			ps++
		}
	}
	return ds >= 2, ps >= 2
}

// suspects returns the decodes among ds that are currently avoided with p.
func (h *pairHealth) suspects(p string, ds []*worker.Worker) map[string]bool {
	if h.n.Load() == 0 {
		return nil
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.m) == 0 {
		return nil
	}
	now := h.now()
	var out map[string]bool
	for _, d := range ds {
		if st := h.m[[2]string{p, d.Key()}]; st != nil && (now.Before(st.until) || h.halfOpenProbing(st, now)) {
			if out == nil {
				out = map[string]bool{}
			}
			out[d.Key()] = true
		}
	}
	return out
}

// claim is called when the pair p/d is picked. For a half-open pair it
// takes the probe slot (the pair is then suspect to everyone else until the
// outcome is recorded or probeTTL passes) and reports true.
func (h *pairHealth) claim(p, d string) bool {
	if h.n.Load() == 0 {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.m[[2]string{p, d}]
	if st == nil || st.fails < h.threshold {
		return false
	}
	now := h.now()
	if now.Before(st.until) || now.Before(st.probe) {
		return false // still cooling down (a fallback pick), or probed already
	}
	st.probe = now.Add(h.probeTTL)
	return true
}

// pruneLocked drops pairs that are neither in cooldown nor recently failed,
// and if that is not enough, every pair not in cooldown.
func (h *pairHealth) pruneLocked() {
	now := h.now()
	for k, st := range h.m {
		if !now.Before(st.until) && now.Sub(st.last) >= h.cooldown {
			delete(h.m, k)
		}
	}
	if len(h.m) < maxTrackedPairs {
		return
	}
	for k, st := range h.m {
		if !now.Before(st.until) {
			delete(h.m, k)
		}
	}
}
