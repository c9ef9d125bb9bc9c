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

type modelPolicy struct {
	inner policy.Policy
	model string
	cache atomic.Pointer[subset]
}

type subset struct {
	gen uint64
	src []*worker.Worker // the slice it was computed from
	ws  []*worker.Worker
}

func (p *modelPolicy) Name() string { return p.inner.Name() }

func (p *modelPolicy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	return p.inner.Pick(req, policy.Candidates{Gen: c.Gen, Workers: p.filter(c)})
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
