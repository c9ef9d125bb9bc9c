package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"strings"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/igw"
	"github.com/switchyard-llm/switchyard/internal/pd"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/server"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// --enable-igw: several models behind one router. Every worker carries its
// model id (given in POST /workers, else read from the worker's
// /v1/models); the igw.Router sends each request to its model's fleet: a
// regular fleet, or a PD fleet (prefill/decode workers) served by its own
// PD engine.

// buildIGW sets the server up for --enable-igw.
func (a *app) buildIGW(sopts *server.Options, ropts proxy.RegularOptions) error {
	cfg := a.cfg
	ups, err := a.igwUpstreams(ropts, os.LookupEnv)
	if err != nil {
		return err
	}
	rt, err := igw.New(igw.Options{
		Upstreams:     ups,
		Registry:      a.reg,
		DefaultPolicy: cfg.Policy,
		PrefillPolicy: cfg.EffectivePrefillPolicy(),
		DecodePolicy:  cfg.EffectiveDecodePolicy(),
		NewPolicy:     a.newPolicy,
		NewPD:         a.newModelPD,
		Models:        modelSettings(cfg.Models),
		Regular:       ropts,
		Logger:        a.log,
		Registerer:    a.m.Registry,
		LearnAdapters: a.adapters.refresh,
	})
	if err != nil {
		return err
	}
	a.adapters.learn = a.learnAdapters
	a.adapters.workers = a.modelWorkers
	a.igw = rt
	a.closers = append(a.closers, rt.Close)
	if cfg.VLLMDiscoveryAddress != "" || cfg.ServiceDiscovery {
		// ZMQ registrations (and pods without the vllm.ai/model
		// annotation) name no model: each worker's /v1/models does.
		mc := newModelCache(a.discoverModel, a.log)
		a.closers = append(a.closers, mc.Close)
		a.reg.Subscribe(mc.onRegistryChange)
		a.igwModels = mc
	}
	if cfg.VLLMDiscoveryAddress != "" {
		if err := a.buildZMQ(sopts, a.igwModels.Model); err != nil {
			return err
		}
	}
	sopts.Mode = server.ModeRegular
	sopts.Generate = rt
	sopts.Passthrough = http.HandlerFunc(rt.ServePassthrough)
	sopts.AddWorkerSpec = a.adminAddIGW
	sopts.ModelsStatus = func() any { return rt.Status() }
	sopts.ExtraModels = rt.ModelEntries
	sopts.LoRAByModel = true
	sopts.LoRAChanged = func(name string, models []string) {
		base := "" // unloaded
		if len(models) > 0 {
			base = models[0] // an adapter loads on workers of one base model
		}
		rt.SetAdapter(name, base)
	}
	sopts.Ready = rt.Ready
	sopts.Policies = map[string]string{"policy": cfg.Policy, "prefill": cfg.EffectivePrefillPolicy(), "decode": cfg.EffectiveDecodePolicy(), "mode": "igw"}
	return nil
}

// modelSettings are the config file's models sections.
func modelSettings(in map[string]config.ModelConfig) map[string]igw.ModelSettings {
	out := make(map[string]igw.ModelSettings, len(in))
	for m, c := range in {
		out[m] = igw.ModelSettings{Policy: c.Policy, PrefillPolicy: c.PrefillPolicy, DecodePolicy: c.DecodePolicy, MaxConcurrent: c.MaxConcurrentRequests}
	}
	return out
}

// newModelPD is one PD model's engine. Panic routing and the pair warm-up
// are off: both look at every registered prefill/decode worker, whatever
// its model (config.Validate refuses asking for them).
func (a *app) newModelPD(model string, pp, dp policy.Policy) (igw.PDFleet, error) {
	o := a.pdOptions(pp, dp)
	o.Panic = nil
	o.Warmup = false
	o.Logger = a.log.With("model", model)
	return pd.New(o)
}

// igwWorker is one worker to register under --enable-igw.
type igwWorker struct {
	raw       string // as given (URL, maybe URL@rank)
	role      worker.Role
	bootstrap *int // prefill only
}

// dpSize is the data-parallel size of a worker of role from the flags.
func (a *app) dpSize(role worker.Role) int {
	switch role {
	case worker.RolePrefill:
		return a.cfg.PrefillDPSize()
	case worker.RoleDecode:
		return a.cfg.DecodeDPSize()
	}
	return max(a.cfg.IntraNodeDataParallelSize, 1)
}

// checkIGWWorker refuses what a worker of role cannot be under the
// configured KV connector.
func (a *app) checkIGWWorker(w igwWorker) error {
	if w.bootstrap != nil {
		if w.role != worker.RolePrefill {
			return fmt.Errorf("bootstrap_port is only for prefill workers (worker_type %q)", w.role)
		}
		if p := *w.bootstrap; p < 1 || p > 65535 {
			return fmt.Errorf("bootstrap_port %d: must be between 1 and 65535", p)
		}
	}
	if w.role != worker.RoleRegular && a.cfg.KVConnector == config.KVConnectorMoRIIO {
		return fmt.Errorf("worker_type %q: MoRI-IO prefill/decode workers register over ZMQ discovery; they cannot be added by URL", w.role)
	}
	return nil
}

// adminAddIGW is POST /workers (and /add_worker) under --enable-igw.
func (a *app) adminAddIGW(ctx context.Context, req server.AddWorkerRequest) ([]*worker.Worker, error) {
	iw := igwWorker{raw: req.URL, role: req.Role, bootstrap: req.BootstrapPort}
	if err := a.checkIGWWorker(iw); err != nil {
		return nil, err
	}
	base, _, err := worker.NormalizeURL(req.URL)
	if err != nil {
		return nil, err
	}
	model := req.ModelID
	if model == "" {
		if model, err = a.discoverModel(ctx, base); err != nil {
			return nil, fmt.Errorf("model_id not given and the worker cannot tell its model: %w", err)
		}
	} else {
		a.learnAdapters(ctx, base, model)
	}
	if err := a.checkModelKind(base, model, req.Role); err != nil {
		return nil, err
	}
	if p := req.Labels["policy"]; p != "" {
		if err := a.igw.SetPolicy(model, p); err != nil {
			return nil, err
		}
	}
	dp := a.dpSize(req.Role)
	if req.DPSize > 0 {
		dp = req.DPSize
	}
	ws, err := a.addModelWorker(iw, model, worker.SourceAdmin, dp)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, min(a.cfg.WorkerStartupTimeout(), 30*time.Second))
	defer cancel()
	if err := a.health.ProbeNow(pctx, ws[0]); err != nil {
		for _, w := range ws {
			w.SetHealthy(false)
		}
		a.log.Warn("added worker is not healthy yet; it will be routed once a health probe passes", "url", req.URL, "model", model, "err", err)
	}
	return ws, nil
}

// checkModelKind refuses a worker that would make its URL serve two
// models, or mix regular and prefill/decode workers in one model's fleet.
func (a *app) checkModelKind(base, model string, role worker.Role) error {
	if err := a.upstreamModel(model); err != nil {
		return err
	}
	pd := role != worker.RoleRegular
	for _, w := range a.reg.Snapshot().All {
		if w.URL == base && w.ModelID != model {
			return fmt.Errorf("worker %s already serves model %q; one URL cannot serve model %q too", base, w.ModelID, model)
		}
		if w.ModelID == model && (w.Role != worker.RoleRegular) != pd {
			kind := "regular workers"
			if !pd {
				kind = "a prefill/decode fleet"
			}
			return fmt.Errorf("model %q is served by %s; a %s worker cannot join it (a model is either a regular or a PD fleet)", model, kind, role)
		}
	}
	return nil
}

// addModelWorker registers w (its rank, or dp ranks) as a worker of model.
func (a *app) addModelWorker(w igwWorker, model string, src worker.Source, dp int) ([]*worker.Worker, error) {
	base, rank, err := worker.NormalizeURL(w.raw)
	if err != nil {
		return nil, err
	}
	if err := a.checkModelKind(base, model, w.role); err != nil {
		return nil, err
	}
	spec := worker.Spec{URL: base, Role: w.role, DPRank: -1, Source: src, ModelID: model}
	if w.bootstrap != nil {
		spec.BootstrapPort = *w.bootstrap
	}
	specs := worker.ExpandDP(spec, dp)
	if rank >= 0 {
		spec.DPRank, spec.DPSize = rank, max(dp, rank+1)
		specs = []worker.Spec{spec}
	}
	return a.reg.Add(specs...)
}

// maxModelsBody bounds a worker's /v1/models answer.
const maxModelsBody = 1 << 20

// modelList is a worker's /v1/models answer.
type modelList struct {
	Data []struct {
		ID     string `json:"id"`
		Parent string `json:"parent"`
	} `json:"data"`
}

// noteAdapters records the LoRA adapters the worker at base, of model,
// lists: vLLM lists them after the model, with it as their parent. Their
// requests go to the model's fleet, to the workers that list them, and
// kv_aware keys them with the adapter's name.
func (a *app) noteAdapters(base, model string, list modelList) {
	var names []string
	for _, m := range list.Data {
		if m.Parent != model || m.ID == "" || m.ID == model {
			continue
		}
		a.noteLoRA(m.ID)
		names = append(names, m.ID)
	}
	if a.igw != nil {
		a.igw.SetWorkerAdapters(base, model, names)
	}
}

// learnAdapters reads the adapters a worker of model lists (its engine may
// have been started with --lora-modules): one added with its model named,
// one coming back healthy. A worker that cannot list them is still routed.
func (a *app) learnAdapters(ctx context.Context, base, model string) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var list modelList
	if err := a.getWorkerJSON(ctx, base+"/v1/models", &list); err != nil {
		a.log.Debug("a worker's LoRA adapters are not known (its /v1/models)", "url", base, "model", model, "err", err)
		return
	}
	a.noteAdapters(base, model, list)
}

// discoverModel asks a worker which model it serves: the first id of its
// /v1/models (vLLM lists the served model first, then LoRA adapters), else
// (vllm-router's source for a POST /workers without model_id) the
// model_id of its /get_server_info, or the last path segment of its
// model_path.
func (a *app) discoverModel(ctx context.Context, base string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var list modelList
	err := a.getWorkerJSON(ctx, base+"/v1/models", &list)
	if err == nil && len(list.Data) > 0 && list.Data[0].ID != "" {
		model := list.Data[0].ID
		a.noteAdapters(base, model, list)
		return model, nil
	}
	if err == nil {
		err = fmt.Errorf("GET %s/v1/models: no model listed", base)
	}
	var info struct {
		ModelID   string `json:"model_id"`
		ModelPath string `json:"model_path"`
	}
	if ierr := a.getWorkerJSON(ctx, base+"/get_server_info", &info); ierr == nil {
		if m := strings.TrimSpace(info.ModelID); m != "" {
			return m, nil
		}
		if seg := path.Base(strings.TrimRight(strings.TrimSpace(info.ModelPath), "/")); seg != "" && seg != "." && seg != "/" {
			return seg, nil
		}
	}
	return "", err
}

// getWorkerJSON GETs url (with the upstream API key) into v.
func (a *app) getWorkerJSON(ctx context.Context, url string, v any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	if a.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+a.cfg.APIKey)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody))
	if err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}

// staticIGW lists the static workers of --enable-igw: --worker-urls
// (regular), --prefill and --decode.
func (a *app) staticIGW() []igwWorker {
	var out []igwWorker
	for _, u := range a.cfg.WorkerURLs {
		out = append(out, igwWorker{raw: u, role: worker.RoleRegular})
	}
	for _, p := range a.cfg.Prefill {
		out = append(out, igwWorker{raw: p.URL, role: worker.RolePrefill, bootstrap: p.BootstrapPort})
	}
	for _, u := range a.cfg.Decode {
		out = append(out, igwWorker{raw: u, role: worker.RoleDecode})
	}
	return out
}

// resolveStaticIGW registers the static workers of --enable-igw as their
// models become known: each URL's /v1/models is asked every second until
// it answers (the worker may still be loading its model), then the worker
// joins its model's fleet. It returns when every URL is registered or ctx
// ends.
func (a *app) resolveStaticIGW(ctx context.Context, ws []igwWorker) {
	pending := append([]igwWorker(nil), ws...)
	warned := map[string]bool{}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		left := pending[:0]
		for _, w := range pending {
			base, _, err := worker.NormalizeURL(w.raw)
			if err != nil { // Validate checked it
				continue
			}
			model, err := a.discoverModel(ctx, base)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if !warned[w.raw] {
					a.log.Warn("--enable-igw: waiting for the worker to list its model", "url", w.raw, "role", w.role.String(), "err", err)
					warned[w.raw] = true
				}
				left = append(left, w)
				continue
			}
			if _, err := a.addModelWorker(w, model, worker.SourceStatic, a.dpSize(w.role)); err != nil && !worker.IsExists(err) {
				a.log.Error("--enable-igw: cannot register worker", "url", w.raw, "role", w.role.String(), "model", model, "err", err)
				continue
			}
			a.log.Info("--enable-igw: worker joined its model's fleet", "url", w.raw, "role", w.role.String(), "model", model)
		}
		pending = left
		if len(pending) == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// modelWorkers lists the base URL and model of every worker that names
// its model, once per URL.
func (a *app) modelWorkers() [][2]string {
	var out [][2]string
	seen := map[string]bool{}
	for _, w := range a.reg.Snapshot().All {
		if w.ModelID != "" && !seen[w.URL] {
			seen[w.URL] = true
			out = append(out, [2]string{w.URL, w.ModelID})
		}
	}
	return out
}

// adapterRefresh re-reads every worker's LoRA adapters (/v1/models) when
// a request names a model the router does not know: an adapter loaded on
// an engine directly is served from its first request. A caller waits for
// a round that starts after it came (one running may have read an engine
// before the adapter was loaded there). Rounds start at least
// refreshEvery apart and waiters share them, so requests naming unknown
// models cost each worker a read per refreshEvery at most, and such a
// request's 404 waits that long at most, plus a round.
type adapterRefresh struct {
	learn   func(ctx context.Context, base, model string)
	workers func() [][2]string // (base URL, model)

	mu      sync.Mutex
	running chan struct{} // closed when the running round ends
	started uint64        // rounds started
	done    uint64        // the last round ended
	last    time.Time     // when it ended
}

const (
	refreshEvery   = 250 * time.Millisecond
	refreshTimeout = time.Second // a round, at most
	refreshReads   = 16          // reads in flight at most
)

// refresh returns once a round that started after the call has ended, or
// when ctx ends.
func (r *adapterRefresh) refresh(ctx context.Context) {
	if r.learn == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	want := r.started + 1
	for r.done < want {
		if c := r.running; c != nil {
			if !r.await(ctx, c, nil) {
				return
			}
			continue
		}
		if wait := refreshEvery - time.Since(r.last); wait > 0 {
			t := time.NewTimer(wait)
			ok := r.await(ctx, nil, t.C)
			t.Stop()
			if !ok {
				return
			}
			continue
		}
		r.started++
		gen, c := r.started, make(chan struct{})
		r.running = c
		r.mu.Unlock()
		r.round(ctx)
		r.mu.Lock()
		r.running, r.done, r.last = nil, gen, time.Now()
		close(c)
	}
}

// await waits, mu released, for c or t; false when ctx ended first.
func (r *adapterRefresh) await(ctx context.Context, c <-chan struct{}, t <-chan time.Time) bool {
	r.mu.Unlock()
	defer r.mu.Lock()
	select {
	case <-c:
	case <-t:
	case <-ctx.Done():
		return false
	}
	return true
}

// round reads every worker's adapters. It serves every waiter: the
// caller's going away does not end it.
func (r *adapterRefresh) round(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), refreshTimeout)
	defer cancel()
	sem := make(chan struct{}, refreshReads)
	var wg sync.WaitGroup
	for _, w := range r.workers() {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			r.learn(ctx, w[0], w[1])
		})
	}
	wg.Wait()
}
