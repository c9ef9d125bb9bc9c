package app

import (
	"fmt"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/igw"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/upstream"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// igwUpstreams builds the models served by OpenAI-compatible providers
// (the config file's models.<id>.upstream) under --enable-igw. Models on
// one base URL share its entry: one breaker and one in-flight count per
// provider. A named api_key_env that is unset or empty is a startup error.
func (a *app) igwUpstreams(ropts proxy.RegularOptions, lookup func(string) (string, bool)) (map[string]igw.Upstream, error) {
	models := a.cfg.UpstreamModels()
	if len(models) == 0 {
		return nil, nil
	}
	bc := breakerConfig(a.cfg, a.m)
	byURL := map[string]*worker.Worker{}
	out := make(map[string]igw.Upstream, len(models))
	for _, m := range models {
		mc := a.cfg.Models[m]
		key := ""
		if mc.APIKeyEnv != "" {
			v, _ := lookup(mc.APIKeyEnv)
			if key = strings.TrimSpace(v); key == "" {
				return nil, fmt.Errorf("models.%s.api_key_env: the environment variable %s is not set (it holds the key of the upstream %s)", m, mc.APIKeyEnv, mc.Upstream)
			}
		}
		base := upstream.BaseURL(mc.Upstream)
		w := byURL[base]
		if w == nil {
			w = worker.New(worker.Spec{URL: base, Role: worker.RoleRegular, DPRank: -1, ModelID: m, Source: worker.SourceStatic}, bc)
			byURL[base] = w
		}
		b, err := upstream.New(upstream.Options{
			Worker:            w,
			Client:            a.proxyClient(),
			APIKey:            key,
			ForwardClientAuth: a.cfg.ForwardClientAuthorization,
			Retry:             ropts.Retry,
			RequestTimeout:    a.cfg.RequestTimeout(),
			StreamIdleTimeout: a.cfg.StreamIdleTimeout(),
			Metrics:           a.m,
			Logger:            a.log.With("model", m),
		})
		if err != nil {
			return nil, fmt.Errorf("models.%s.upstream: %w", m, err)
		}
		out[m] = igw.Upstream{Dispatcher: b, Worker: w}
	}
	return out, nil
}

// upstreamModel refuses a worker joining a model an upstream serves.
func (a *app) upstreamModel(model string) error {
	if mc, ok := a.cfg.Models[model]; ok && mc.Upstream != "" {
		return fmt.Errorf("model %q is served by the upstream %s (config file models section); a worker cannot join it", model, mc.Upstream)
	}
	return nil
}
