package pd

import (
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// pairHealth tracks P/D pairs whose KV transfers keep failing (the decode
// never gets its KV within the KV-wait timeout) although each side looks
// healthy on its own — e.g. a notify port unreachable from one decode host,
// or a prefill whose writer thread died for one peer. After threshold
// consecutive transfer failures the pair is avoided for cooldown whenever
// another compatible decode exists; one success clears it.
type pairHealth struct {
	threshold int
	cooldown  time.Duration
	now       func() time.Time

	mu sync.Mutex
	m  map[[2]string]*pairState
}

type pairState struct {
	fails int
	until time.Time
}

const maxTrackedPairs = 4096

func newPairHealth(threshold int, cooldown time.Duration, now func() time.Time) *pairHealth {
	if threshold <= 0 {
		threshold = 3
	}
	if cooldown <= 0 {
		cooldown = 30 * time.Second
	}
	return &pairHealth{threshold: threshold, cooldown: cooldown, now: now, m: map[[2]string]*pairState{}}
}

// record notes the outcome of a transfer between p and d.
func (h *pairHealth) record(p, d string, ok bool) {
	k := [2]string{p, d}
	h.mu.Lock()
	defer h.mu.Unlock()
	if ok {
		delete(h.m, k)
		return
	}
	st := h.m[k]
	if st == nil {
		if len(h.m) >= maxTrackedPairs {
			h.pruneLocked()
		}
		st = &pairState{}
		h.m[k] = st
	}
	st.fails++
	if st.fails >= h.threshold {
		st.until = h.now().Add(h.cooldown)
	}
}

// suspects returns the decodes among ds that are currently avoided with p.
func (h *pairHealth) suspects(p string, ds []*worker.Worker) map[string]bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.m) == 0 {
		return nil
	}
	now := h.now()
	var out map[string]bool
	for _, d := range ds {
		if st := h.m[[2]string{p, d.Key()}]; st != nil && now.Before(st.until) {
			if out == nil {
				out = map[string]bool{}
			}
			out[d.Key()] = true
		}
	}
	return out
}

// pruneLocked drops pairs that are not in cooldown.
func (h *pairHealth) pruneLocked() {
	now := h.now()
	for k, st := range h.m {
		if !now.Before(st.until) {
			delete(h.m, k)
		}
	}
}
