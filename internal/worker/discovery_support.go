package worker

import (
	"slices"
	"time"
)

// UpsertWith is Upsert with a hook: init runs on every newly created worker
// before the snapshot that contains it is published, so a discovery source
// can add a worker that is not routable (held aside) without a window in
// which a pick could already choose it. init must not call back into the
// registry. A nil init makes UpsertWith identical to Upsert. A kept
// worker that is unhealthy is probed at once (Change.Probe): its instance
// re-registering says it is up again.
func (r *Registry) UpsertWith(instance string, specs []Spec, now time.Time, init func(*Worker)) ([]*Worker, bool) {
	r.mu.Lock()
	want := make(map[string]Spec, len(specs))
	for _, s := range specs {
		s.Instance = instance
		if s.DPSize < 1 {
			s.DPSize = 1
		}
		if s.TPSize < 1 {
			s.TPSize = 1
		}
		want[s.Key()] = s
	}
	var added, removed []*Worker
	for k, w := range r.byKey {
		if w.Instance != instance {
			continue
		}
		if s, ok := want[k]; !ok || !sameSpec(s, w.Spec) {
			delete(r.byKey, k)
			removed = append(removed, w)
		}
	}
	out := make([]*Worker, 0, len(specs))
	var revive []*Worker
	for k, s := range want {
		w, ok := r.byKey[k]
		if ok && !w.Healthy() {
			revive = append(revive, w)
		}
		if !ok {
			w = New(s, r.bc)
			if init != nil {
				init(w)
			}
			r.byKey[k] = w
			added = append(added, w)
		}
		w.Touch(now)
		out = append(out, w)
	}
	changed := len(added) > 0 || len(removed) > 0
	var c Change
	if changed {
		c = r.publish(added, removed)
	}
	r.mu.Unlock()
	if changed {
		r.notify(c)
	}
	if len(revive) > 0 {
		r.notify(Change{Probe: revive, Snap: r.snap.Load()})
	}
	slices.SortFunc(out, func(a, b *Worker) int { return cmpKey(a.key, b.key) })
	return out, changed
}
