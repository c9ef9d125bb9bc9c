package igw

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"

	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// KindUpstream is a model served by an OpenAI-compatible provider.
const KindUpstream Kind = "upstream"

// Upstream is a model served by an OpenAI-compatible provider (the config
// file's models.<id>.upstream) instead of registered vLLM workers.
type Upstream struct {
	// Dispatcher serves the model's generation requests (an
	// upstream.Backend: breaker, retries before the first byte, timeouts).
	Dispatcher proxy.Dispatcher
	// Worker is the provider's entry (its breaker and in-flight count); it
	// is not in the registry: vLLM's probes and fan-outs do not apply.
	Worker *worker.Worker
}

// upstreamFleet is the fleet of an upstream model. Its non-generation
// routes (/tokenize and the other vLLM endpoints) are not an OpenAI API.
func upstreamFleet(model string, up Upstream) *fleet {
	pass := passFunc(func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotImplemented, fmt.Sprintf("Model %q is served by an OpenAI-compatible upstream, which has no %s endpoint", model, r.URL.Path), "model")
	})
	return &fleet{model: model, kind: KindUpstream, disp: up.Dispatcher, pass: pass}
}

// passFunc adapts a function to the passer interface.
type passFunc func(http.ResponseWriter, *http.Request)

func (f passFunc) ServePassthrough(w http.ResponseWriter, r *http.Request) { f(w, r) }

// upstreamModels returns the upstream models, sorted.
func (rt *Router) upstreamModels() []string {
	return slices.Sorted(maps.Keys(rt.o.Upstreams))
}

// upstreamUnavailable says why an upstream model cannot be served now.
func upstreamUnavailable(model string, up Upstream) string {
	if up.Worker.Breaker().State() == worker.BreakerOpen {
		return fmt.Sprintf("Model %q: its upstream %s is failing (circuit breaker open)", model, up.Worker.URL)
	}
	return ""
}

// ModelEntries are the /v1/models entries of the upstream models whose
// provider is not failing, in OpenAI's shape (owned_by: the provider's
// host).
func (rt *Router) ModelEntries() []json.RawMessage {
	var out []json.RawMessage
	for _, m := range rt.upstreamModels() {
		up := rt.o.Upstreams[m]
		if upstreamUnavailable(m, up) != "" {
			continue
		}
		owner := up.Worker.URL
		if u, err := url.Parse(owner); err == nil && u.Host != "" {
			owner = u.Host
		}
		b, _ := json.Marshal(map[string]any{"id": m, "object": "model", "created": rt.started.Unix(), "owned_by": owner, "root": m})
		out = append(out, b)
	}
	return out
}

// upstreamStatus is an upstream model's /workers entry.
func (rt *Router) upstreamStatus(model string, up Upstream) ModelStatus {
	st := ModelStatus{Kind: KindUpstream, Total: 1, Workers: []string{up.Worker.URL}}
	if upstreamUnavailable(model, up) == "" {
		st.Healthy = 1
	}
	if l := rt.limits[model]; l != nil {
		st.InFlight, st.MaxConcurrent = l.n.Load(), int(l.max)
	}
	return st
}
