// Package igw is the multi-model router of --enable-igw: one router in
// front of several models, each served by its own fleet of workers (the
// registry workers whose ModelID is that model) with its own policy.
//
// A generation request is routed by its body's "model": a model no worker
// serves is vLLM's 404 ("The model `x` does not exist."), a model whose
// workers are all down is a 503 naming it, a "model" that is not a string
// is a 400. Without "model" the request goes to the only model when there
// is one, and is a 400 listing the models otherwise. Within a fleet the
// regular dispatcher applies (retries on another worker of the same model
// before the first byte, breakers, timeouts).
package igw

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Options configures a Router.
type Options struct {
	Registry *worker.Registry
	// DefaultPolicy is the policy of a model that names none (--policy).
	DefaultPolicy string
	// NewPolicy builds a policy instance (its owner closes it).
	NewPolicy func(name string) (policy.Policy, error)
	// Regular is the template of every fleet's dispatcher; Registry, Role
	// and Policy are set per fleet.
	Regular proxy.RegularOptions
	Logger  *slog.Logger
	// Registerer receives the per-model metrics (nil = not exported).
	Registerer prometheus.Registerer
}

// Router implements proxy.Dispatcher over per-model fleets.
type Router struct {
	o   Options
	log *slog.Logger

	mu       sync.Mutex
	fleets   map[string]*fleet
	policies map[string]string // model → policy asked for (labels.policy)

	requests *prometheus.CounterVec // model (a registered one), outcome: routed|no_live_workers
	rejected *prometheus.CounterVec // reason: unknown_model|bad_model|model_required
}

type fleet struct {
	model  string
	policy string
	disp   *proxy.Regular
}

var _ proxy.Dispatcher = (*Router)(nil)

// New builds a Router.
func New(o Options) (*Router, error) {
	if o.Registry == nil || o.NewPolicy == nil {
		return nil, errors.New("igw: Registry and NewPolicy are required")
	}
	if o.DefaultPolicy == "" {
		return nil, errors.New("igw: DefaultPolicy is required")
	}
	rt := &Router{o: o, log: o.Logger, fleets: map[string]*fleet{}, policies: map[string]string{}}
	if rt.log == nil {
		rt.log = slog.New(slog.DiscardHandler)
	}
	rt.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_model_requests_total",
		Help: "--enable-igw: generation requests per served model, by outcome (routed to the model's fleet, or no_live_workers: 503).",
	}, []string{"model", "outcome"})
	rt.rejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_model_rejections_total",
		Help: "--enable-igw: requests refused before a fleet was chosen, by reason (unknown_model: 404, bad_model, model_required: 400).",
	}, []string{"reason"})
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{rt.requests, rt.rejected} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return rt, nil
}

// SetPolicy records the policy a model's fleet uses (a worker's
// labels.policy). The first policy named for a model wins: a different one
// later is an error naming both; the same one again is fine.
func (rt *Router) SetPolicy(model, name string) error {
	if !slices.Contains(policy.Names(), name) {
		return fmt.Errorf("labels.policy %q is not a policy (valid: %s)", name, strings.Join(policy.Names(), ", "))
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	cur := rt.policies[model]
	if f := rt.fleets[model]; f != nil {
		cur = f.policy
	}
	if cur != "" && cur != name {
		return fmt.Errorf("model %q already routes with policy %q; labels.policy %q conflicts", model, cur, name)
	}
	rt.policies[model] = name
	return nil
}

// Policy returns the policy model routes with.
func (rt *Router) Policy(model string) string {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if f := rt.fleets[model]; f != nil {
		return f.policy
	}
	if p := rt.policies[model]; p != "" {
		return p
	}
	return rt.o.DefaultPolicy
}

// fleetFor returns model's fleet, creating it on first use.
func (rt *Router) fleetFor(model string) (*fleet, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if f := rt.fleets[model]; f != nil {
		return f, nil
	}
	name := rt.policies[model]
	if name == "" {
		name = rt.o.DefaultPolicy
	}
	p, err := rt.o.NewPolicy(name)
	if err != nil {
		return nil, fmt.Errorf("model %q: policy %q: %w", model, name, err)
	}
	ro := rt.o.Regular
	ro.Registry = rt.o.Registry
	ro.Role = worker.RoleRegular
	ro.Policy = ForModel(p, model)
	f := &fleet{model: model, policy: name, disp: proxy.NewRegular(ro)}
	rt.fleets[model] = f
	rt.log.Info("model fleet created", "model", model, "policy", name)
	return f, nil
}

// Models returns the models with at least one registered worker, sorted,
// and whether each has a live (healthy, routable) one.
func Models(snap *worker.Snapshot) (all []string, live map[string]bool) {
	live = map[string]bool{}
	for _, w := range snap.Regular {
		if _, ok := live[w.ModelID]; !ok {
			live[w.ModelID] = false
			all = append(all, w.ModelID)
		}
		if w.Healthy() && w.Routable() {
			live[w.ModelID] = true
		}
	}
	slices.Sort(all)
	return all, live
}

// ModelStatus is one model's entry in /workers.
type ModelStatus struct {
	Policy  string   `json:"policy"`
	Total   int      `json:"total"`
	Healthy int      `json:"healthy"`
	Workers []string `json:"workers"`
}

// Status groups the registry's workers by model.
func (rt *Router) Status() map[string]ModelStatus {
	out := map[string]ModelStatus{}
	for _, w := range rt.o.Registry.Snapshot().Regular {
		st := out[w.ModelID]
		st.Total++
		if w.Healthy() && w.Routable() {
			st.Healthy++
		}
		st.Workers = append(st.Workers, w.Key())
		out[w.ModelID] = st
	}
	for m, st := range out {
		st.Policy = rt.Policy(m)
		out[m] = st
	}
	return out
}

// Dispatch routes one generation request to its model's fleet.
func (rt *Router) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	all, live := Models(rt.o.Registry.Snapshot())
	model, err := requestModel(c, all)
	if err != nil {
		reason := "bad_model"
		if errors.Is(err, errModelRequired) {
			reason = "model_required"
		}
		rt.rejected.WithLabelValues(reason).Inc()
		writeError(w, http.StatusBadRequest, err.Error(), "model")
		return
	}
	isLive, known := live[model]
	switch {
	case !known:
		rt.rejected.WithLabelValues("unknown_model").Inc()
		writeError(w, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model), "model")
		return
	case !isLive:
		rt.requests.WithLabelValues(model, "no_live_workers").Inc()
		writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("Model %q has no live workers (all its workers are unhealthy or being drained)", model), "model")
		return
	}
	rt.requests.WithLabelValues(model, "routed").Inc()
	f, err := rt.fleetFor(model)
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error(), "")
		return
	}
	if c.Receipt != nil {
		defer func() { c.Receipt.Reason = "model " + model + "; " + c.Receipt.Reason }()
	}
	f.disp.Dispatch(w, r, c)
}

var errModelRequired = errors.New("model is required")

// requestModel reads the body's "model".
func requestModel(c *proxy.Call, models []string) (string, error) {
	v := c.Obj.Get("model")
	if v == nil || string(v) == "null" {
		if len(models) == 1 {
			return models[0], nil
		}
		if len(models) == 0 {
			return "", fmt.Errorf("%w (no model is being served yet)", errModelRequired)
		}
		return "", fmt.Errorf("%w: this router serves several models (%s)", errModelRequired, strings.Join(models, ", "))
	}
	var s string
	if v[0] != '"' || json.Unmarshal(v, &s) != nil {
		return "", fmt.Errorf("model must be a string, got %s", truncate(string(v), 64))
	}
	return s, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// writeError writes vLLM's error body with param set.
func writeError(w http.ResponseWriter, status int, msg, param string) {
	var p *string
	if param != "" {
		p = &param
	}
	b, _ := json.Marshal(openai.ErrorBody{Error: openai.ErrorDetail{Message: msg, Type: openai.TypeFor(status), Param: p, Code: status}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

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
