package igw

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// ModelState counts one model's workers by role: registered, and live
// (healthy and routable).
type ModelState struct {
	Regular, Prefill, Decode             int
	LiveRegular, LivePrefill, LiveDecode int
}

// Kind is PD when the model has prefill or decode workers.
func (s ModelState) Kind() Kind {
	if s.Prefill+s.Decode > 0 {
		return KindPD
	}
	return KindRegular
}

// Unavailable says why the model cannot be served now ("" = it can): a
// regular model needs a live worker, a PD model a live worker of each role.
func (s ModelState) Unavailable(model string) string {
	if s.Kind() == KindRegular {
		if s.LiveRegular == 0 {
			return fmt.Sprintf("Model %q has no live workers (all its workers are unhealthy or being drained)", model)
		}
		return ""
	}
	switch {
	case s.LivePrefill == 0 && s.LiveDecode == 0:
		return fmt.Sprintf("Model %q has no live workers (prefill: %d registered, decode: %d registered, none healthy)", model, s.Prefill, s.Decode)
	case s.Prefill == 0:
		return fmt.Sprintf("Model %q has no prefill workers (%d decode registered): a PD model needs both roles", model, s.Decode)
	case s.Decode == 0:
		return fmt.Sprintf("Model %q has no decode workers (%d prefill registered): a PD model needs both roles", model, s.Prefill)
	case s.LivePrefill == 0:
		return fmt.Sprintf("Model %q has no live prefill workers (%d registered, all unhealthy or being drained)", model, s.Prefill)
	case s.LiveDecode == 0:
		return fmt.Sprintf("Model %q has no live decode workers (%d registered, all unhealthy or being drained)", model, s.Decode)
	}
	return ""
}

// States counts every model's workers.
func States(snap *worker.Snapshot) map[string]ModelState {
	out := map[string]ModelState{}
	for _, w := range snap.All {
		st := out[w.ModelID]
		live := w.Healthy() && w.Routable()
		n, l := &st.Regular, &st.LiveRegular
		switch w.Role {
		case worker.RolePrefill:
			n, l = &st.Prefill, &st.LivePrefill
		case worker.RoleDecode:
			n, l = &st.Decode, &st.LiveDecode
		}
		*n++
		if live {
			*l++
		}
		out[w.ModelID] = st
	}
	return out
}

// Models returns the models with at least one registered worker, sorted,
// and whether each can be served now.
func Models(snap *worker.Snapshot) (all []string, live map[string]bool) {
	states := States(snap)
	live = make(map[string]bool, len(states))
	for m, st := range states {
		all = append(all, m)
		live[m] = st.Unavailable(m) == ""
	}
	slices.Sort(all)
	return all, live
}

// ModelStatus is one model's entry in /workers.
type ModelStatus struct {
	Kind Kind `json:"kind"`
	// Policy is a regular model's policy; PrefillPolicy and DecodePolicy a
	// PD model's.
	Policy        string `json:"policy,omitempty"`
	PrefillPolicy string `json:"prefill_policy,omitempty"`
	DecodePolicy  string `json:"decode_policy,omitempty"`
	Total         int    `json:"total"`
	Healthy       int    `json:"healthy"`
	Prefill       int    `json:"prefill,omitempty"`
	Decode        int    `json:"decode,omitempty"`
	// InFlight and MaxConcurrent are shown for a model with a configured
	// max_concurrent_requests.
	InFlight      int64    `json:"in_flight,omitempty"`
	MaxConcurrent int      `json:"max_concurrent_requests,omitempty"`
	Workers       []string `json:"workers"`
}

// Status groups the registry's workers by model.
func (rt *Router) Status() map[string]ModelStatus {
	snap := rt.o.Registry.Snapshot()
	states := States(snap)
	out := make(map[string]ModelStatus, len(states))
	for _, w := range snap.All {
		st := out[w.ModelID]
		st.Workers = append(st.Workers, w.Key())
		out[w.ModelID] = st
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for m, s := range states {
		st := out[m]
		st.Kind = s.Kind()
		st.Total = s.Regular + s.Prefill + s.Decode
		st.Healthy = s.LiveRegular + s.LivePrefill + s.LiveDecode
		st.Prefill, st.Decode = s.Prefill, s.Decode
		if l := rt.limits[m]; l != nil {
			st.InFlight, st.MaxConcurrent = l.n.Load(), int(l.max)
		}
		if st.Kind == KindPD {
			st.PrefillPolicy, st.DecodePolicy = rt.pdPoliciesLocked(m)
		} else {
			st.Policy = rt.policyLocked(m)
		}
		out[m] = st
	}
	for m, up := range rt.o.Upstreams {
		out[m] = rt.upstreamStatus(m, up)
	}
	return out
}

// Ready is the router's readiness (server.Options.Ready): ready while at
// least one model can be served now (a regular model with a live worker,
// a PD model with live workers of both roles, an upstream model whose
// breaker is not open); otherwise the reason names each model's problem.
func (rt *Router) Ready() (bool, string) {
	states := States(rt.o.Registry.Snapshot())
	var why []string
	for _, m := range slices.Sorted(maps.Keys(states)) {
		if _, up := rt.o.Upstreams[m]; up {
			continue
		}
		w := states[m].Unavailable(m)
		if w == "" {
			return true, ""
		}
		why = append(why, w)
	}
	for _, m := range rt.upstreamModels() {
		w := upstreamUnavailable(m, rt.o.Upstreams[m])
		if w == "" {
			return true, ""
		}
		why = append(why, w)
	}
	if len(why) == 0 {
		return false, "no model is being served yet (no worker has registered)"
	}
	const show = 4
	if len(why) > show {
		why = append(why[:show], fmt.Sprintf("and %d more models", len(why)-show))
	}
	return false, strings.Join(why, "; ")
}
