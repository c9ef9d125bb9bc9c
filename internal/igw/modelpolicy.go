package igw

import (
	"sync/atomic"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// ForModel wraps a policy so it only ever sees the candidates serving
// model. The subset is cached per registry generation, so a policy that
// caches per generation (hash rings) sees a stable set.
func ForModel(inner policy.Policy, model string) policy.Policy {
	return &modelPolicy{inner: inner, model: model}
}

// forModel is ForModel whose request for a LoRA adapter of the model sees
// only the candidates known to hold it (Router.onAdapter).
func (rt *Router) forModel(inner policy.Policy, model string) policy.Policy {
	return &modelPolicy{inner: inner, model: model, rt: rt}
}

type modelPolicy struct {
	inner policy.Policy
	model string
	rt    *Router // nil: no adapter narrowing
	cache atomic.Pointer[subset]
}

type subset struct {
	gen uint64
	src []*worker.Worker // the slice it was computed from
	ws  []*worker.Worker
}

func (p *modelPolicy) Name() string { return p.inner.Name() }

func (p *modelPolicy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	ws, gen := p.filter(c), c.Gen
	// Only while some adapter is held by some workers only: no read of the
	// body's model on the common request.
	if p.rt != nil && p.rt.narrowed.Load() > 0 && req != nil && req.Obj != nil {
		if m, _ := req.Obj.String("model"); m != "" && m != p.model {
			if on := p.rt.onAdapter(m, ws); len(on) != len(ws) {
				ws, gen = on, adapterGen(c.Gen, m)
			}
		}
	}
	return p.inner.Pick(req, policy.Candidates{Gen: gen, Workers: ws})
}

// adapterGen is the generation an adapter's narrowed candidates are
// offered under: policies cache what they derive from a membership by its
// generation, and each adapter's holders are a membership of their own.
// It mixes the registry's generation with the name (FNV-1a), top bit set,
// apart from the registry's small counters.
func adapterGen(gen uint64, name string) uint64 {
	h := uint64(14695981039346656037) ^ gen
	for i := range len(name) {
		h ^= uint64(name[i])
		h *= 1099511628211
	}
	return h | 1<<63
}

func (p *modelPolicy) filter(c policy.Candidates) []*worker.Worker {
	if s := p.cache.Load(); s != nil && s.gen == c.Gen && len(s.src) == len(c.Workers) &&
		(len(s.src) == 0 || &s.src[0] == &c.Workers[0]) {
		return s.ws
	}
	ws := make([]*worker.Worker, 0, len(c.Workers))
	for _, w := range c.Workers {
		if w.ModelID == p.model {
			ws = append(ws, w)
		}
	}
	p.cache.Store(&subset{gen: c.Gen, src: c.Workers, ws: ws})
	return ws
}

// Close closes the inner policy.
func (p *modelPolicy) Close() error { return policy.Close(p.inner) }

// RemoveWorker forwards to the inner policy.
func (p *modelPolicy) RemoveWorker(key string) { policy.RemoveWorker(p.inner, key) }
