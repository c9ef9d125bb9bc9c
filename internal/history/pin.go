package history

import (
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// responsesPath is the only route whose body may carry previous_response_id.
const responsesPath = "/v1/responses"

// Pin wraps a policy so that a /v1/responses request continuing a
// conversation (previous_response_id) goes to the worker that stored the
// previous response, when the store knows it and that worker is among the
// candidates and usable. Every other request, and a retry after the owner
// failed (it is then excluded), is the inner policy's. The wrapper forwards
// Close, RemoveWorker and, when the inner policy has it, PickPair.
func Pin(inner policy.Policy, s *Store) policy.Policy {
	p := &pinned{inner: inner, s: s}
	if pp, ok := inner.(policy.PairPolicy); ok {
		return &pinnedPair{pinned: p, pair: pp}
	}
	return p
}

type pinned struct {
	inner policy.Policy
	s     *Store
}

func (p *pinned) Name() string { return p.inner.Name() }

func (p *pinned) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	if url, ok := p.owner(req); ok {
		for _, w := range c.Workers {
			if w.URL == url && req.Usable(w) {
				return policy.Choice{Worker: w, Reason: "previous_response_id owner"}, nil
			}
		}
	}
	return p.inner.Pick(req, c)
}

// owner returns the worker URL that stored the request's previous
// response, counting the lookup.
func (p *pinned) owner(req *policy.Request) (string, bool) {
	id := PreviousResponseID(req.Path, req.Body)
	if id == "" {
		return "", false
	}
	return p.s.Owner(OpPrevious, id)
}

// PreviousResponseID returns the previous_response_id string of a
// /v1/responses body ("" when absent, null, not a string or not JSON).
func PreviousResponseID(path string, body []byte) string {
	if path != responsesPath || len(body) == 0 {
		return ""
	}
	obj, err := rawjson.Parse(body)
	if err != nil {
		return ""
	}
	id, _ := obj.String("previous_response_id")
	return id
}

// Close closes the inner policy.
func (p *pinned) Close() error { return policy.Close(p.inner) }

// RemoveWorker forwards to the inner policy.
func (p *pinned) RemoveWorker(key string) { policy.RemoveWorker(p.inner, key) }

type pinnedPair struct {
	*pinned
	pair policy.PairPolicy
}

// PickPair is the inner PickPair, except for a request whose previous
// response has a known owner: it then returns ErrNoWorker, and the caller
// picks each side with Pick, which pins the owner's side.
func (p *pinnedPair) PickPair(req *policy.Request, prefill, decode policy.Candidates) (policy.Choice, policy.Choice, error) {
	if id := PreviousResponseID(req.Path, req.Body); id != "" {
		if _, ok := p.s.Peek(id); ok {
			return policy.Choice{}, policy.Choice{}, policy.ErrNoWorker
		}
	}
	return p.pair.PickPair(req, prefill, decode)
}
