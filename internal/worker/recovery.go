package worker

import (
	"log/slog"
	"sync/atomic"
	"time"
)

// ConnectHintWindow is how long one failed connect to a worker stays a
// hint: a second failed connect within it confirms the worker down (marked
// unhealthy); a passing health probe clears it. While it lasts the worker
// is avoided when another one exists.
const ConnectHintWindow = 5 * time.Second

// Probed reports whether a health probe of the worker has passed since it
// was registered.
func (w *Worker) Probed() bool { return w.probed.Load() }

// MarkProbed records a passing health probe and clears a connect hint.
func (w *Worker) MarkProbed() {
	w.probed.Store(true)
	w.hintAt.Store(0)
}

// Suspect reports whether the worker had an unconfirmed connect failure in
// the last ConnectHintWindow (see Registry.ConnectFailed).
func (w *Worker) Suspect() bool {
	at := w.hintAt.Load()
	return at != 0 && time.Since(time.Unix(0, at)) < ConnectHintWindow
}

// ClearHint forgets an unconfirmed connect failure (a probe failed and
// decided instead, or the worker was marked down).
func (w *Worker) ClearHint() { w.hintAt.Store(0) }

// ConnectFailed is passive health after a failed TCP connect to w (all the
// ranks of its instance). The first failure is a hint: the worker is
// avoided while others exist (Suspect) and subscribers are asked to probe
// it at once (Change.Probe). A second failure within ConnectHintWindow
// confirms it: the ranks are marked unhealthy and returned (those whose
// health changed). A worker already unhealthy is left to the prober.
func (r *Registry) ConnectFailed(w *Worker, now time.Time) (down []*Worker) {
	ws := []*Worker{w}
	if w.DPSize > 1 {
		if inst := r.Instance(w.Instance); len(inst) > 0 {
			ws = inst
		}
	}
	if !w.Healthy() {
		return nil
	}
	prev := w.hintAt.Load()
	if prev != 0 && now.Sub(time.Unix(0, prev)) < ConnectHintWindow {
		for _, x := range ws {
			x.hintAt.Store(0)
			if x.SetHealthy(false) {
				down = append(down, x)
			}
		}
		return down
	}
	for _, x := range ws {
		x.hintAt.Store(now.UnixNano())
	}
	r.notify(Change{Probe: ws, Snap: r.snap.Load()})
	return nil
}

// WithSuspects returns a copy of exclude plus the suspect workers of ws,
// or nil when no worker of ws is suspect (and not already excluded).
func WithSuspects(ws []*Worker, exclude map[string]bool) map[string]bool {
	var out map[string]bool
	for _, w := range ws {
		if !w.Suspect() || exclude[w.key] {
			continue
		}
		if out == nil {
			out = make(map[string]bool, len(exclude)+2)
			for k, v := range exclude {
				out[k] = v
			}
		}
		out[w.key] = true
	}
	return out
}

// Panic routes to the registered workers of a role when none of them is
// available (all unhealthy or open-circuit), as Envoy's panic threshold
// does: a fleet the router believes down may be up again (a restart the
// prober has not seen yet), and a request to a dead worker fails at once
// with a refused connect, so routing to it costs little. A nil *Panic, or
// one with Disabled set, never picks.
type Panic struct {
	Disabled bool
	Logger   *slog.Logger
	// OnPick is called once per panic pick (a metric), with the role.
	OnPick func(Role)

	rr     atomic.Uint64
	active [3]atomic.Bool // per role: the last pick was a panic pick
}

// Pick returns a registered, routable worker of ws that skip does not
// reject, preferring the least loaded (ties rotate), or nil when panic
// routing is off, when some worker of ws is available (a request that
// failed on the available ones is not a panic) or when no worker fits.
// Call it only after a normal pick failed.
func (p *Panic) Pick(role Role, ws []*Worker, skip func(*Worker) bool) *Worker {
	if p == nil || p.Disabled || len(ws) == 0 {
		return nil
	}
	for _, w := range ws {
		if w.Available() {
			return nil
		}
	}
	start := int(p.rr.Add(1) % uint64(len(ws)))
	var best *Worker
	for i := range ws {
		w := ws[(start+i)%len(ws)]
		if !w.Routable() || (skip != nil && skip(w)) {
			continue
		}
		if best == nil || w.Load() < best.Load() {
			best = w
		}
	}
	if best == nil {
		return nil
	}
	if p.OnPick != nil {
		p.OnPick(role)
	}
	if int(role) < len(p.active) && !p.active[role].Swap(true) && p.Logger != nil {
		p.Logger.Warn("panic routing: no "+role.String()+" worker is healthy and closed-circuit; routing to the registered ones anyway",
			"role", role.String(), "registered", len(ws), "worker", best.Key())
	}
	return best
}

// Normal records a normal (non-panic) pick for role, ending a panic period.
func (p *Panic) Normal(role Role) {
	if p == nil || int(role) >= len(p.active) || !p.active[role].Load() {
		return
	}
	if p.active[role].Swap(false) && p.Logger != nil {
		p.Logger.Info("panic routing over: a "+role.String()+" worker is available again", "role", role.String())
	}
}

// PanicOutcome records the outcome of a panic-routed request whose breaker
// refused it (open, or half-open with its probes taken): outside the
// breaker's admission, as Breaker.Record does (an open breaker ignores it;
// a half-open one counts it). Only the first call counts.
func (w *Worker) PanicOutcome() func(Outcome) {
	var once atomic.Bool
	return func(o Outcome) {
		if o != OutcomeNeutral && once.CompareAndSwap(false, true) {
			w.breaker.Record(o == OutcomeSuccess)
		}
	}
}
