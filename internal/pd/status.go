package pd

import (
	"slices"
	"strings"
	"time"
)

// Status is the PD engine's view of its pairs, for /workers and
// /get_server_info: which prefill/decode pairs are avoided because their
// KV transfers keep timing out, and the pair warm-ups.
type Status struct {
	Connector string       `json:"connector"`
	Pairs     []PairStatus `json:"troubled_pairs"`
	Warmup    *WarmupStat  `json:"warmup,omitempty"`
}

// PairStatus is one pair whose recent transfers failed.
type PairStatus struct {
	Prefill             string    `json:"prefill"`
	Decode              string    `json:"decode"`
	ConsecutiveFailures int       `json:"consecutive_failures"`
	LastFailure         time.Time `json:"last_failure"`
	// State: "failing" (below the threshold, still used), "avoided" (in
	// its cooldown), "probing" (half-open, its one probe in flight) or
	// "half_open" (the next request that picks it is the probe).
	State        string    `json:"state"`
	AvoidedUntil time.Time `json:"avoided_until,omitzero"`
}

// WarmupStat summarises --pd-warmup.
type WarmupStat struct {
	Warm    int         `json:"warm_pairs"` // warmed up or already used by a request
	Running [][2]string `json:"running"`    // [prefill, decode] warming up now
	OK      int64       `json:"ok_total"`
	Failed  int64       `json:"failed_total"`
}

// Status returns the engine's pair state (sorted by prefill, then decode).
func (e *Engine) Status() Status {
	st := Status{Connector: e.conn.Name(), Pairs: e.pairs.status()}
	if w := e.warm; w != nil {
		ws := &WarmupStat{Running: [][2]string{}, OK: w.ok.Load(), Failed: w.failed.Load()}
		w.warm.Range(func(_, _ any) bool { ws.Warm++; return true })
		w.mu.Lock()
		for k := range w.running {
			ws.Running = append(ws.Running, k)
		}
		w.mu.Unlock()
		slices.SortFunc(ws.Running, func(a, b [2]string) int {
			if c := strings.Compare(a[0], b[0]); c != 0 {
				return c
			}
			return strings.Compare(a[1], b[1])
		})
		st.Warmup = ws
	}
	return st
}

func (h *pairHealth) status() []PairStatus {
	out := []PairStatus{}
	if h.n.Load() == 0 {
		return out
	}
	h.mu.Lock()
	now := h.now()
	for k, s := range h.m {
		if s.fails < h.threshold && now.Sub(s.last) >= h.cooldown {
			continue // an old failure the pair has not repeated
		}
		ps := PairStatus{Prefill: k[0], Decode: k[1], ConsecutiveFailures: s.fails, LastFailure: s.last, State: "failing"}
		switch {
		case s.fails < h.threshold:
		case now.Before(s.until):
			ps.State, ps.AvoidedUntil = "avoided", s.until
		case now.Before(s.probe):
			ps.State = "probing"
		default:
			ps.State = "half_open"
		}
		out = append(out, ps)
	}
	h.mu.Unlock()
	slices.SortFunc(out, func(a, b PairStatus) int {
		if c := strings.Compare(a.Prefill, b.Prefill); c != 0 {
			return c
		}
		return strings.Compare(a.Decode, b.Decode)
	})
	return out
}
