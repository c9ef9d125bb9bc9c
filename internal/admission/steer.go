package admission

import (
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Prefill rules (--flow-avoid-prefill, --flow-isolate-prefill).
//
// A request handed to an engine mid-step waits for that step, and its own
// prefill step also carries every other prompt the engine admitted in the
// meantime. The router knows, per worker, how many of the requests it sent
// have not yet produced their first byte (worker.Slot: they are waiting for
// or in prefill), and which of them are in the highest band. Two rules use
// that, in regular mode:
//
//   - AvoidPrefill: a highest-band request is picked among the workers
//     with the fewest requests awaiting their first byte (and below
//     MaxInFlight when set), so it does not queue behind another prompt's
//     prefill step; the policy chooses among those.
//   - IsolatePrefill: no lower-band request is sent to a worker while a
//     highest-band request there awaits its first byte, so no low prompt
//     shares the high request's prefill step.
//   - PrefillReserve N: while at most N workers (below MaxInFlight) have
//     nothing awaiting its first byte, a lower-band request joins a worker
//     that is prefilling already, if one below its limit exists, rather
//     than start a prefill on a free one; so N workers stay free of low
//     prefills for a high request arriving (with two workers and N = 1,
//     lower-band prompts are prefilled on one worker at a time, batched
//     into its steps). It only steers: with nothing to join, a low request
//     takes a free worker, so it never waits for the rule.
//
// For IsolatePrefill, the Detector's gate holds the lower bands while
// every worker is so held (or saturated), and the pick avoids held
// workers; a worker whose requests of the highest band awaiting their
// first byte drop to none kicks the scheduler.
//
// Both are narrowing preferences: a pick they would leave without a worker
// is made without them.

// Steer implements the prefill rules' pick preference (proxy.Steerer).
type Steer struct {
	MaxInFlight    int // per-worker in-flight limit (0 = none)
	AvoidPrefill   bool
	IsolatePrefill bool
	PrefillReserve int
}

// NewSteer returns the pick rules of c, or nil when none is on.
func NewSteer(c *SaturationConfig) *Steer {
	if c == nil || (!c.AvoidPrefill && !c.IsolatePrefill && c.PrefillReserve <= 0) {
		return nil
	}
	return &Steer{MaxInFlight: c.MaxInFlight, AvoidPrefill: c.AvoidPrefill, IsolatePrefill: c.IsolatePrefill, PrefillReserve: max(c.PrefillReserve, 0)}
}

// Steer returns the workers req should avoid (req.Exclude included), or nil
// when no usable worker is to be avoided or every one would be.
func (s *Steer) Steer(ws []*worker.Worker, req *policy.Request) map[string]bool {
	switch {
	case req.Top && s.AvoidPrefill:
		best := int64(-1)
		for _, w := range ws {
			if s.eligible(w, req) {
				if n := w.Prefilling(); best < 0 || n < best {
					best = n
				}
			}
		}
		if best < 0 {
			return nil
		}
		return avoid(ws, req, func(w *worker.Worker) bool { return !s.eligible(w, req) || w.Prefilling() > best })
	case !req.Top && (s.IsolatePrefill || s.PrefillReserve > 0):
		isolated := func(w *worker.Worker) bool { return s.IsolatePrefill && w.PrefillingTop() > 0 }
		free, join := 0, false
		if s.PrefillReserve > 0 {
			for _, w := range ws {
				switch {
				case !s.eligible(w, req) || isolated(w):
				case w.Prefilling() == 0:
					free++
				default:
					join = true
				}
			}
		}
		reserve := join && free <= s.PrefillReserve
		return avoid(ws, req, func(w *worker.Worker) bool {
			return w.Suspect() || isolated(w) || (reserve && w.Prefilling() == 0)
		})
	}
	return nil
}

// eligible: usable, not suspect, and below the in-flight limit.
func (s *Steer) eligible(w *worker.Worker, req *policy.Request) bool {
	return req.Usable(w) && !w.Suspect() && (s.MaxInFlight <= 0 || w.Load() < int64(s.MaxInFlight))
}

// avoid returns req.Exclude plus the usable workers bad reports, or nil when
// it adds none or leaves no usable worker.
func avoid(ws []*worker.Worker, req *policy.Request, bad func(*worker.Worker) bool) map[string]bool {
	var out map[string]bool
	left := false
	for _, w := range ws {
		if !req.Usable(w) {
			continue
		}
		if !bad(w) {
			left = true
			continue
		}
		if out == nil {
			out = make(map[string]bool, len(req.Exclude)+2)
			for k, v := range req.Exclude {
				out[k] = v
			}
		}
		out[w.Key()] = true
	}
	if !left {
		return nil
	}
	return out
}
