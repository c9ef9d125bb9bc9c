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
//
// A model whose workers are prefill/decode workers is a PD model: it is
// served by its own PD engine (built by Options.NewPD) whose policies only
// see that model's workers. A PD model missing one role, or whose workers
// of one role are all down, is a 503 saying which role.
//
// A model of Options.Upstreams is served by an OpenAI-compatible provider
// (its dispatcher is an upstream.Backend); it is listed in /v1/models and
// /workers beside the vLLM models, and no registry worker can join it.
package igw

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Kind is how a model is served: by regular workers, or by a
// prefill/decode fleet through the PD engine.
type Kind string

const (
	KindRegular Kind = "regular"
	KindPD      Kind = "pd"
)

// PDFleet is one PD model's dispatcher (a pd.Engine): Close stops its
// background work.
type PDFleet interface {
	proxy.Dispatcher
	Close()
}

// Options configures a Router.
type Options struct {
	Registry *worker.Registry
	// DefaultPolicy is the policy of a regular model that names none
	// (--policy).
	DefaultPolicy string
	// PrefillPolicy and DecodePolicy are the policies of a PD model's roles
	// when it names none (--prefill-policy, --decode-policy; a model's
	// labels.policy sets both). Empty = DefaultPolicy.
	PrefillPolicy, DecodePolicy string
	// NewPolicy builds a policy instance (its owner closes it).
	NewPolicy func(name string) (policy.Policy, error)
	// NewPD builds the PD dispatcher of one model from policies that only
	// see that model's workers. Nil = PD models are answered 503.
	NewPD func(model string, prefill, decode policy.Policy) (PDFleet, error)
	// Regular is the template of every regular fleet's dispatcher;
	// Registry, Role and Policy are set per fleet. Its Panic is ignored:
	// panic routing would pick among every model's workers.
	Regular proxy.RegularOptions
	// Models are the configured per-model settings (the config file's
	// models section).
	Models map[string]ModelSettings
	Logger *slog.Logger
	// Registerer receives the per-model metrics (nil = not exported).
	Registerer prometheus.Registerer
	// Upstreams are the models served by OpenAI-compatible providers.
	Upstreams map[string]Upstream
	// LearnAdapters, if set, re-reads the LoRA adapters the workers list
	// (SetWorkerAdapters) before a request naming no known model is
	// refused: an adapter loaded on an engine directly, not through the
	// router, is then served from its first request. It must return
	// within a few seconds (the request waits for it) and when ctx ends.
	LearnAdapters func(ctx context.Context)
}

// ModelSettings are one model's configured settings. A configured policy
// wins over labels.policy; MaxConcurrent > 0 bounds the model's requests
// in flight (more are a 429).
type ModelSettings struct {
	Policy, PrefillPolicy, DecodePolicy string
	MaxConcurrent                       int
}

// limiter bounds one model's requests in flight.
type limiter struct {
	max int64
	n   atomic.Int64
}

func (l *limiter) acquire() bool {
	if l.n.Add(1) > l.max {
		l.n.Add(-1)
		return false
	}
	return true
}

func (l *limiter) release() { l.n.Add(-1) }

// Router implements proxy.Dispatcher over per-model fleets.
type Router struct {
	o     Options
	log   *slog.Logger
	unsub func()
	bg    sync.WaitGroup // closes of dropped PD fleets

	mu       sync.Mutex
	fleets   map[string]*fleet
	policies map[string]string // model → policy asked for (labels.policy)
	closed   bool

	limits  map[string]*limiter // configured models with MaxConcurrent > 0; read-only
	started time.Time           // the upstream models' "created"

	amu      sync.RWMutex
	adapters map[string]*adapter // by LoRA adapter name
	narrowed atomic.Int32        // adapters only some workers hold: onAdapter has work

	requests  *prometheus.CounterVec   // model (a registered one), outcome: routed|no_live_workers|limited
	rejected  *prometheus.CounterVec   // reason: unknown_model|bad_model|model_required
	duration  *prometheus.HistogramVec // model: routed requests, arrival to the end of the response
	responses *prometheus.CounterVec   // model, code: status class of routed requests' responses
}

type fleet struct {
	model string
	kind  Kind
	// policy is a regular fleet's policy; prefill and decode a PD fleet's.
	policy, prefill, decode string
	disp                    proxy.Dispatcher
	pd                      PDFleet // nil for a regular fleet
	// pass serves the non-generation routes: the regular dispatcher, or
	// for a PD fleet one over its prefill workers (which serve plain
	// requests like any vLLM).
	pass passer
}

// passer serves a non-generation route.
type passer interface {
	ServePassthrough(w http.ResponseWriter, r *http.Request)
}

var _ proxy.Dispatcher = (*Router)(nil)

// New builds a Router. Call Close to stop it.
func New(o Options) (*Router, error) {
	if o.Registry == nil || o.NewPolicy == nil {
		return nil, errors.New("igw: Registry and NewPolicy are required")
	}
	if o.DefaultPolicy == "" {
		return nil, errors.New("igw: DefaultPolicy is required")
	}
	o.PrefillPolicy = cmp.Or(o.PrefillPolicy, o.DefaultPolicy)
	o.DecodePolicy = cmp.Or(o.DecodePolicy, o.DefaultPolicy)
	o.Regular.Panic = nil
	rt := &Router{o: o, log: o.Logger, fleets: map[string]*fleet{}, policies: map[string]string{}, limits: map[string]*limiter{}, started: time.Now()}
	for m, up := range o.Upstreams {
		if up.Dispatcher == nil || up.Worker == nil {
			return nil, fmt.Errorf("igw: upstream model %q needs a Dispatcher and a Worker", m)
		}
		rt.fleets[m] = upstreamFleet(m, up)
	}
	for m, st := range o.Models {
		if st.MaxConcurrent > 0 {
			rt.limits[m] = &limiter{max: int64(st.MaxConcurrent)}
		}
	}
	if rt.log == nil {
		rt.log = slog.New(slog.DiscardHandler)
	}
	rt.requests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_model_requests_total",
		Help: "--enable-igw: generation requests per served model, by outcome (routed to the model's fleet; no_live_workers: 503; limited: 429, the model's max_concurrent_requests reached).",
	}, []string{"model", "outcome"})
	rt.duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "vllm_router_model_request_duration_seconds",
		Help:    "--enable-igw: routed generation requests per served model, from arrival to the end of the response (streams included).",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300},
	}, []string{"model"})
	rt.responses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_model_responses_total",
		Help: "--enable-igw: routed generation requests per served model, by the status class of their response (2xx, 4xx, 5xx).",
	}, []string{"model", "code"})
	rt.rejected = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_model_rejections_total",
		Help: "--enable-igw: requests refused before a fleet was chosen, by reason (unknown_model: 404, bad_model, model_required: 400).",
	}, []string{"reason"})
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{rt.requests, rt.rejected, rt.duration, rt.responses} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	rt.unsub = o.Registry.Subscribe(rt.onChange)
	return rt, nil
}

// Close stops the router: every PD fleet's engine is closed.
func (rt *Router) Close() {
	rt.unsub()
	rt.mu.Lock()
	rt.closed = true
	fs := make([]*fleet, 0, len(rt.fleets))
	for _, f := range rt.fleets {
		fs = append(fs, f)
	}
	clear(rt.fleets)
	rt.mu.Unlock()
	for _, f := range fs {
		if f.pd != nil {
			f.pd.Close()
		}
	}
	rt.bg.Wait()
}

// onChange forgets a model once its last worker left: its fleet (a PD
// fleet's engine is closed), its labels.policy and its metric series, so
// the next first worker of that model starts afresh. A PD model's engine
// is built as soon as its first prefill/decode worker joins, so its
// background work (Mooncake bootstrap queries) starts before the first
// request.
func (rt *Router) onChange(c worker.Change) {
	if len(c.Removed) > 0 {
		rt.forgetGone(c)
	}
	var pdModels []string
	for _, w := range c.Added {
		if w.Role != worker.RoleRegular && !slices.Contains(pdModels, w.ModelID) {
			pdModels = append(pdModels, w.ModelID)
		}
	}
	for _, m := range pdModels {
		if _, err := rt.fleetFor(m, KindPD); err != nil {
			rt.log.Error("cannot build the PD fleet of a model", "model", m, "err", err)
		}
	}
}

func (rt *Router) forgetGone(c worker.Change) {
	left := map[string]bool{}
	for _, w := range c.Snap.All {
		left[w.ModelID] = true
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for _, w := range c.Removed {
		m := w.ModelID
		if _, up := rt.o.Upstreams[m]; left[m] || up {
			continue
		}
		delete(rt.policies, m)
		rt.requests.DeletePartialMatch(prometheus.Labels{"model": m})
		rt.duration.DeletePartialMatch(prometheus.Labels{"model": m})
		rt.responses.DeletePartialMatch(prometheus.Labels{"model": m})
		f := rt.fleets[m]
		if f == nil {
			continue
		}
		delete(rt.fleets, m)
		rt.log.Info("model fleet dropped: its last worker left", "model", m, "kind", string(f.kind))
		if f.pd != nil && !rt.closed {
			rt.bg.Go(f.pd.Close) // not on the registry's writer goroutine
		}
	}
}

// SetPolicy records the policy a model's fleet uses (a worker's
// labels.policy). The first policy named for a model wins: a different one
// later is an error naming both; the same one again is fine.
func (rt *Router) SetPolicy(model, name string) error {
	if !slices.Contains(policy.Names(), name) {
		return fmt.Errorf("labels.policy %q is not a policy (valid: %s)", name, strings.Join(policy.Names(), ", "))
	}
	if cf := rt.o.Models[model]; cf.Policy != name && (cf.Policy != "" || cf.PrefillPolicy != "" || cf.DecodePolicy != "") {
		return fmt.Errorf("model %q takes its policies from the config file (models section); labels.policy %q conflicts", model, name)
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	cur := rt.policies[model]
	if f := rt.fleets[model]; f != nil && f.kind == KindRegular {
		cur = f.policy
	}
	if cur != "" && cur != name {
		return fmt.Errorf("model %q already routes with policy %q; labels.policy %q conflicts", model, cur, name)
	}
	rt.policies[model] = name
	return nil
}

// Policy returns the policy a regular model routes with (a PD model's
// labels.policy, when one was named).
func (rt *Router) Policy(model string) string {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	return rt.policyLocked(model)
}

func (rt *Router) policyLocked(model string) string {
	if f := rt.fleets[model]; f != nil && f.kind == KindRegular {
		return f.policy
	}
	return cmp.Or(rt.o.Models[model].Policy, rt.policies[model], rt.o.DefaultPolicy)
}

// pdPolicies returns the prefill and decode policies of a PD model.
func (rt *Router) pdPoliciesLocked(model string) (string, string) {
	cf, lp := rt.o.Models[model], rt.policies[model]
	return cmp.Or(cf.PrefillPolicy, cf.Policy, lp, rt.o.PrefillPolicy), cmp.Or(cf.DecodePolicy, cf.Policy, lp, rt.o.DecodePolicy)
}

// fleetFor returns model's fleet of kind, creating it on first use (or
// when the model changed kind).
func (rt *Router) fleetFor(model string, kind Kind) (*fleet, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	if rt.closed {
		return nil, errors.New("router is shutting down")
	}
	if f := rt.fleets[model]; f != nil && f.kind == kind {
		return f, nil
	}
	var f *fleet
	var err error
	if kind == KindUpstream { // built in New; gone only at Close
		return nil, fmt.Errorf("model %q has no upstream fleet", model)
	}
	if kind == KindPD {
		f, err = rt.newPDFleet(model)
	} else {
		f, err = rt.newRegularFleet(model)
	}
	if err != nil {
		return nil, err
	}
	if old := rt.fleets[model]; old != nil && old.pd != nil {
		rt.bg.Go(old.pd.Close)
	}
	rt.fleets[model] = f
	rt.log.Info("model fleet created", "model", model, "kind", string(kind), "policy", f.policy, "prefill_policy", f.prefill, "decode_policy", f.decode)
	return f, nil
}

func (rt *Router) newRegularFleet(model string) (*fleet, error) {
	name := rt.policyLocked(model)
	p, err := rt.o.NewPolicy(name)
	if err != nil {
		return nil, fmt.Errorf("model %q: policy %q: %w", model, name, err)
	}
	ro := rt.o.Regular
	ro.Registry = rt.o.Registry
	ro.Role = worker.RoleRegular
	ro.Policy = rt.forModel(p, model)
	reg := proxy.NewRegular(ro)
	return &fleet{model: model, kind: KindRegular, policy: name, disp: reg, pass: reg}, nil
}

func (rt *Router) newPDFleet(model string) (*fleet, error) {
	if rt.o.NewPD == nil {
		return nil, fmt.Errorf("model %q has prefill/decode workers but this router serves no PD fleets", model)
	}
	pn, dn := rt.pdPoliciesLocked(model)
	pp, err := rt.o.NewPolicy(pn)
	if err != nil {
		return nil, fmt.Errorf("model %q: prefill policy %q: %w", model, pn, err)
	}
	dp, err := rt.o.NewPolicy(dn)
	if err != nil {
		return nil, fmt.Errorf("model %q: decode policy %q: %w", model, dn, err)
	}
	mpp := rt.forModel(pp, model)
	eng, err := rt.o.NewPD(model, mpp, rt.forModel(dp, model))
	if err != nil {
		return nil, fmt.Errorf("model %q: PD engine: %w", model, err)
	}
	ro := rt.o.Regular
	ro.Registry = rt.o.Registry
	ro.Role = worker.RolePrefill
	ro.Policy = mpp
	return &fleet{model: model, kind: KindPD, prefill: pn, decode: dn, disp: eng, pd: eng, pass: proxy.NewRegular(ro)}, nil
}

// Dispatch routes one generation request to its model's fleet.
func (rt *Router) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	model, kind, ok := rt.route(r.Context(), w, c.Obj.Get("model"), true)
	if !ok {
		return
	}
	if l := rt.limits[model]; l != nil {
		if !l.acquire() {
			rt.requests.WithLabelValues(model, "limited").Inc()
			writeError(w, http.StatusTooManyRequests, fmt.Sprintf("Model %q is at its limit of %d concurrent requests (max_concurrent_requests); retry later", model, l.max), "model")
			return
		}
		defer l.release()
	}
	f, err := rt.fleetFor(model, kind)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, err.Error(), "model")
		return
	}
	rt.requests.WithLabelValues(model, "routed").Inc()
	if c.Receipt != nil {
		defer func() { c.Receipt.Reason = "model " + model + "; " + c.Receipt.Reason }()
	}
	sw := &statusWriter{ResponseWriter: w}
	f.disp.Dispatch(sw, r, c)
	start := c.Start
	if start.IsZero() {
		start = time.Now()
	}
	rt.duration.WithLabelValues(model).Observe(time.Since(start).Seconds())
	rt.responses.WithLabelValues(model, statusClass(sw.status)).Inc()
}

// route picks the model a request names (v: its body's "model", nil when
// absent) and answers the request itself (ok false) when that model
// cannot be served.
func (rt *Router) route(ctx context.Context, w http.ResponseWriter, v []byte, generation bool) (model string, kind Kind, ok bool) {
	states := States(rt.o.Registry.Snapshot())
	all := slices.Sorted(maps.Keys(states))
	for _, m := range rt.upstreamModels() {
		if _, dup := states[m]; !dup {
			all = append(all, m)
		}
	}
	slices.Sort(all)
	model, err := requestModel(v, all)
	if err != nil {
		reason := "bad_model"
		if errors.Is(err, errModelRequired) {
			reason = "model_required"
		}
		rt.rejected.WithLabelValues(reason).Inc()
		writeError(w, http.StatusBadRequest, err.Error(), "model")
		return "", "", false
	}
	if _, up := rt.o.Upstreams[model]; up {
		// The upstream's breaker answers a failing provider (503).
		return model, KindUpstream, true
	}
	st, known := states[model]
	if !known {
		st, model, known = rt.adapterFleet(ctx, states, model)
	}
	if !known {
		rt.rejected.WithLabelValues("unknown_model").Inc()
		writeError(w, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model), "model")
		return "", "", false
	}
	if why := st.Unavailable(model); why != "" {
		if generation {
			rt.requests.WithLabelValues(model, "no_live_workers").Inc()
		}
		writeError(w, http.StatusServiceUnavailable, why, "model")
		return "", "", false
	}
	return model, st.Kind(), true
}

// adapterFleet finds the fleet of name as a LoRA adapter: its requests
// name the adapter and go to its base model's fleet, the body unchanged
// (the engine serves it). An unknown name has the workers' adapters read
// again first (Options.LearnAdapters). It returns the base model.
func (rt *Router) adapterFleet(ctx context.Context, states map[string]ModelState, name string) (ModelState, string, bool) {
	base, ok := rt.AdapterModel(name)
	if !ok && rt.o.LearnAdapters != nil {
		rt.o.LearnAdapters(ctx)
		base, ok = rt.AdapterModel(name)
	}
	if st, known := states[base]; ok && known {
		return st, base, true
	}
	return ModelState{}, name, false
}

// adapter is a LoRA adapter the router knows of.
type adapter struct {
	model string // the base model whose fleet serves it
	// on: the workers (base URLs) known to hold it, when not every worker
	// of the model does (an engine started with --lora-modules); nil once
	// it was loaded through the router, which gives it to all of them.
	on map[string]struct{}
}

// SetAdapter records that every worker of base model serves the LoRA
// adapter name (it was loaded through the router, which loads it on all
// of them and keeps them so); model "" forgets it.
func (rt *Router) SetAdapter(name, model string) {
	rt.amu.Lock()
	defer rt.amu.Unlock()
	defer rt.recountLocked()
	if model == "" {
		delete(rt.adapters, name)
		return
	}
	if rt.adapters == nil {
		rt.adapters = map[string]*adapter{}
	}
	rt.adapters[name] = &adapter{model: model}
}

// recountLocked updates narrowed (amu held for writing).
func (rt *Router) recountLocked() {
	n := 0
	for _, a := range rt.adapters {
		if a.on != nil {
			n++
		}
	}
	rt.narrowed.Store(int32(n))
}

// SetWorkerAdapters records the LoRA adapters the worker at url (a worker
// of base model) lists in its /v1/models, replacing what it listed before
// (an engine restarted with other --lora-modules). Until an adapter is
// loaded through the router (SetAdapter), its requests go to the workers
// known to hold it while any of them is a candidate; one that no worker
// lists any more is forgotten.
func (rt *Router) SetWorkerAdapters(url, model string, names []string) {
	rt.amu.Lock()
	defer rt.amu.Unlock()
	defer rt.recountLocked()
	for name, a := range rt.adapters {
		if _, ok := a.on[url]; ok && a.model == model && !slices.Contains(names, name) {
			delete(a.on, url)
			if len(a.on) == 0 {
				delete(rt.adapters, name)
			}
		}
	}
	if rt.adapters == nil {
		rt.adapters = map[string]*adapter{}
	}
	for _, name := range names {
		a := rt.adapters[name]
		switch {
		case a == nil || a.model != model:
			rt.adapters[name] = &adapter{model: model, on: map[string]struct{}{url: {}}}
		case a.on != nil:
			a.on[url] = struct{}{}
		}
	}
}

// AdapterModel returns the base model whose fleet serves LoRA adapter name.
func (rt *Router) AdapterModel(name string) (string, bool) {
	rt.amu.RLock()
	defer rt.amu.RUnlock()
	if a := rt.adapters[name]; a != nil {
		return a.model, true
	}
	return "", false
}

// onAdapter narrows a model's candidates ws to the workers known to hold
// the LoRA adapter name, when only some do; ws itself when all do, when
// name is no adapter, or when none of its holders is available (the
// others' engines answer for it).
func (rt *Router) onAdapter(name string, ws []*worker.Worker) []*worker.Worker {
	rt.amu.RLock()
	defer rt.amu.RUnlock()
	a := rt.adapters[name]
	if a == nil || a.on == nil {
		return ws
	}
	var out []*worker.Worker
	up := false
	for _, w := range ws {
		if _, ok := a.on[w.URL]; ok {
			out = append(out, w)
			up = up || w.Available()
		}
	}
	if !up {
		return ws
	}
	return out
}

// ServePassthrough serves the non-generation routes (/tokenize,
// /detokenize and any other path) on the fleet of the model a JSON body
// names; a request naming none (no JSON body, no "model") goes to the
// only model, else it is a 400 listing the models. A PD model's requests
// go to its prefill workers.
func (rt *Router) ServePassthrough(w http.ResponseWriter, r *http.Request) {
	var v []byte
	if r.Body != nil && r.Body != http.NoBody {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			status := http.StatusBadRequest
			if _, tooBig := errors.AsType[*http.MaxBytesError](err); tooBig {
				status = http.StatusRequestEntityTooLarge
			}
			writeError(w, status, "cannot read the request body: "+err.Error(), "")
			return
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(b)), int64(len(b))
		if obj, err := rawjson.Parse(b); err == nil {
			v = obj.Get("model")
		}
	}
	model, kind, ok := rt.route(r.Context(), w, v, false)
	if !ok {
		return
	}
	f, err := rt.fleetFor(model, kind)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, err.Error(), "model")
		return
	}
	f.pass.ServePassthrough(w, r)
}
