package app

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/switchyard-llm/switchyard/internal/igw"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/server"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// --enable-igw: several models behind one router. Every worker carries its
// model id (given in POST /workers, else read from the worker's
// /v1/models); the igw.Router sends each request to its model's fleet.

// buildIGW sets the server up for --enable-igw.
func (a *app) buildIGW(sopts *server.Options, ropts proxy.RegularOptions) error {
	rt, err := igw.New(igw.Options{
		Registry:      a.reg,
		DefaultPolicy: a.cfg.Policy,
		NewPolicy:     a.newPolicy,
		Regular:       ropts,
		Logger:        a.log,
		Registerer:    a.m.Registry,
	})
	if err != nil {
		return err
	}
	a.igw = rt
	sopts.Mode = server.ModeRegular
	sopts.Generate = rt
	sopts.AddWorkerSpec = a.adminAddIGW
	sopts.ModelsStatus = func() any { return rt.Status() }
	sopts.Policies = map[string]string{"policy": a.cfg.Policy, "mode": "igw"}
	return nil
}

// adminAddIGW is POST /workers (and /add_worker) under --enable-igw.
func (a *app) adminAddIGW(ctx context.Context, req server.AddWorkerRequest) ([]*worker.Worker, error) {
	if req.Role != worker.RoleRegular {
		return nil, fmt.Errorf("worker_type %q: --enable-igw serves regular workers only; PD fleets per model are not implemented yet", req.Role)
	}
	base, rank, err := worker.NormalizeURL(req.URL)
	if err != nil {
		return nil, err
	}
	model := req.ModelID
	if model == "" {
		if model, err = a.discoverModel(ctx, base); err != nil {
			return nil, fmt.Errorf("model_id not given and the worker cannot tell its model: %w", err)
		}
	}
	if p := req.Labels["policy"]; p != "" {
		if err := a.igw.SetPolicy(model, p); err != nil {
			return nil, err
		}
	}
	dp := max(a.cfg.IntraNodeDataParallelSize, 1)
	if req.DPSize > 0 {
		dp = req.DPSize
	}
	ws, err := a.addModelWorker(base, rank, model, worker.SourceAdmin, dp)
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

// addModelWorker registers base (rank, or dp ranks) as a worker of model.
// One URL serves one model: a URL already registered for another model is
// refused.
func (a *app) addModelWorker(base string, rank int, model string, src worker.Source, dp int) ([]*worker.Worker, error) {
	for _, w := range a.reg.Snapshot().All {
		if w.URL == base && w.ModelID != model {
			return nil, fmt.Errorf("worker %s already serves model %q; one URL cannot serve model %q too", base, w.ModelID, model)
		}
	}
	spec := worker.Spec{URL: base, Role: worker.RoleRegular, DPRank: -1, Source: src, ModelID: model}
	specs := worker.ExpandDP(spec, dp)
	if rank >= 0 {
		spec.DPRank, spec.DPSize = rank, max(dp, rank+1)
		specs = []worker.Spec{spec}
	}
	return a.reg.Add(specs...)
}

// maxModelsBody bounds a worker's /v1/models answer.
const maxModelsBody = 1 << 20

// discoverModel asks a worker which model it serves: the first id of its
// /v1/models (vLLM lists the served model first, then LoRA adapters).
func (a *app) discoverModel(ctx context.Context, base string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/models", nil)
	if err != nil {
		return "", err
	}
	if a.cfg.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+a.cfg.APIKey)
	}
	resp, err := a.client.Do(req)
	if err != nil {
		return "", fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxModelsBody))
	if err != nil {
		return "", fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("GET %s/v1/models: status %d", base, resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &list); err != nil {
		return "", fmt.Errorf("GET %s/v1/models: %w", base, err)
	}
	if len(list.Data) == 0 || list.Data[0].ID == "" {
		return "", fmt.Errorf("GET %s/v1/models: no model listed", base)
	}
	return list.Data[0].ID, nil
}

// resolveStaticIGW registers the --worker-urls of --enable-igw as their
// models become known: each URL's /v1/models is asked every second until
// it answers (the worker may still be loading its model), then the worker
// joins its model's fleet. It returns when every URL is registered or ctx
// ends.
func (a *app) resolveStaticIGW(ctx context.Context, urls []string) {
	pending := append([]string(nil), urls...)
	warned := map[string]bool{}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		left := pending[:0]
		for _, raw := range pending {
			base, rank, err := worker.NormalizeURL(raw)
			if err != nil { // Validate checked it
				continue
			}
			model, err := a.discoverModel(ctx, base)
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				if !warned[raw] {
					a.log.Warn("--enable-igw: waiting for the worker to list its model", "url", raw, "err", err)
					warned[raw] = true
				}
				left = append(left, raw)
				continue
			}
			if _, err := a.addModelWorker(base, rank, model, worker.SourceStatic, max(a.cfg.IntraNodeDataParallelSize, 1)); err != nil && !worker.IsExists(err) {
				a.log.Error("--enable-igw: cannot register worker", "url", raw, "model", model, "err", err)
				continue
			}
			a.log.Info("--enable-igw: worker joined its model's fleet", "url", raw, "model", model)
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
