package worker

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Snapshot is an immutable view of the registry. Slices are sorted by key
// and must not be modified.
type Snapshot struct {
	Gen     uint64
	All     []*Worker
	Regular []*Worker
	Prefill []*Worker
	Decode  []*Worker
}

// ByRole returns the workers of one role.
func (s *Snapshot) ByRole(r Role) []*Worker {
	switch r {
	case RolePrefill:
		return s.Prefill
	case RoleDecode:
		return s.Decode
	default:
		return s.Regular
	}
}

// Change describes one registry mutation, delivered to subscribers after the
// new snapshot is published. A Change with only Probe set is no membership
// change: it asks the health checker to probe those workers at once (a
// connect failed, see ConnectFailed).
type Change struct {
	Added   []*Worker
	Removed []*Worker
	Probe   []*Worker
	Snap    *Snapshot
}

// Registry holds every worker. Reads are lock-free; writes are serialised.
type Registry struct {
	bc BreakerConfig

	mu    sync.Mutex
	byKey map[string]*Worker
	gen   uint64
	snap  atomic.Pointer[Snapshot]

	subMu  sync.Mutex
	subs   map[int]func(Change)
	nextID int
}

// NewRegistry returns an empty registry whose workers use breaker config
// bc. A breaker that opens asks subscribers to probe its worker at once
// (Change.Probe): if its process is gone, the health checker finds out now
// rather than when the breaker half-opens.
func NewRegistry(bc BreakerConfig) *Registry {
	r := &Registry{byKey: map[string]*Worker{}, subs: map[int]func(Change){}}
	forKey, plain := bc.OnTransitionFor, bc.OnTransition
	bc.OnTransitionFor = func(key string, from, to BreakerState) {
		switch {
		case forKey != nil:
			forKey(key, from, to)
		case plain != nil:
			plain(from, to)
		}
		if to == BreakerOpen {
			if w := r.Get(key); w != nil {
				r.notify(Change{Probe: []*Worker{w}, Snap: r.snap.Load()})
			}
		}
	}
	r.bc = bc
	r.snap.Store(&Snapshot{})
	return r
}

// BreakerConfig returns the config new workers get.
func (r *Registry) BreakerConfig() BreakerConfig { return r.bc }

// Snapshot returns the current immutable view.
func (r *Registry) Snapshot() *Snapshot { return r.snap.Load() }

// Get returns the worker with key, or nil.
func (r *Registry) Get(key string) *Worker {
	s := r.snap.Load()
	i, ok := slices.BinarySearchFunc(s.All, key, func(w *Worker, k string) int {
		switch {
		case w.key < k:
			return -1
		case w.key > k:
			return 1
		}
		return 0
	})
	if !ok {
		return nil
	}
	return s.All[i]
}

// Instance returns the workers that belong to one instance.
func (r *Registry) Instance(instance string) []*Worker {
	var out []*Worker
	for _, w := range r.snap.Load().All {
		if w.Instance == instance {
			out = append(out, w)
		}
	}
	return out
}

// Subscribe registers fn to be called after every change. fn runs on the
// writer's goroutine and must not block or call back into the registry's
// write methods. The returned func unsubscribes.
func (r *Registry) Subscribe(fn func(Change)) (cancel func()) {
	r.subMu.Lock()
	id := r.nextID
	r.nextID++
	r.subs[id] = fn
	r.subMu.Unlock()
	return func() {
		r.subMu.Lock()
		delete(r.subs, id)
		r.subMu.Unlock()
	}
}

// Add registers new workers. It fails (adding nothing) if any key exists.
func (r *Registry) Add(specs ...Spec) ([]*Worker, error) {
	r.mu.Lock()
	for _, s := range specs {
		if _, ok := r.byKey[s.Key()]; ok {
			r.mu.Unlock()
			return nil, errExists
		}
	}
	added := make([]*Worker, 0, len(specs))
	for _, s := range specs {
		w := New(s, r.bc)
		r.byKey[w.key] = w
		added = append(added, w)
	}
	c := r.publish(added, nil)
	r.mu.Unlock()
	r.notify(c)
	return added, nil
}

// Upsert makes the registry's workers for instance exactly specs. Workers
// whose spec is unchanged are kept (with their load, health and breaker
// state); changed ones are replaced; missing ones are removed. It returns
// the resulting workers of the instance and whether membership changed.
func (r *Registry) Upsert(instance string, specs []Spec, now time.Time) ([]*Worker, bool) {
	return r.UpsertWith(instance, specs, now, nil)
}

// Remove deletes the workers with the given keys and returns those removed.
func (r *Registry) Remove(keys ...string) []*Worker {
	r.mu.Lock()
	var removed []*Worker
	for _, k := range keys {
		if w, ok := r.byKey[k]; ok {
			delete(r.byKey, k)
			removed = append(removed, w)
		}
	}
	if len(removed) == 0 {
		r.mu.Unlock()
		return nil
	}
	c := r.publish(nil, removed)
	r.mu.Unlock()
	r.notify(c)
	return removed
}

// RemoveInstance deletes every worker of an instance.
func (r *Registry) RemoveInstance(instance string) []*Worker {
	var keys []string
	for _, w := range r.Instance(instance) {
		keys = append(keys, w.key)
	}
	return r.Remove(keys...)
}

// RemoveWhere deletes every worker for which pred is true.
func (r *Registry) RemoveWhere(pred func(*Worker) bool) []*Worker {
	var keys []string
	for _, w := range r.snap.Load().All {
		if pred(w) {
			keys = append(keys, w.key)
		}
	}
	return r.Remove(keys...)
}

// publish rebuilds the snapshot; the caller holds mu.
func (r *Registry) publish(added, removed []*Worker) Change {
	r.gen++
	s := &Snapshot{Gen: r.gen, All: make([]*Worker, 0, len(r.byKey))}
	for _, w := range r.byKey {
		s.All = append(s.All, w)
	}
	slices.SortFunc(s.All, func(a, b *Worker) int { return cmpKey(a.key, b.key) })
	for _, w := range s.All {
		switch w.Role {
		case RolePrefill:
			s.Prefill = append(s.Prefill, w)
		case RoleDecode:
			s.Decode = append(s.Decode, w)
		default:
			s.Regular = append(s.Regular, w)
		}
	}
	r.snap.Store(s)
	return Change{Added: added, Removed: removed, Snap: s}
}

func (r *Registry) notify(c Change) {
	r.subMu.Lock()
	fns := make([]func(Change), 0, len(r.subs))
	for _, fn := range r.subs {
		fns = append(fns, fn)
	}
	r.subMu.Unlock()
	for _, fn := range fns {
		fn(c)
	}
}

func cmpKey(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
