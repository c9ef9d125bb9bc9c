package app

import (
	"github.com/switchyard-llm/switchyard/internal/pd"
	"github.com/switchyard-llm/switchyard/internal/policy"
)

// pdOptions are the PD engine's settings from the flags, with policies pp
// (prefill) and dp (decode): the engine of --vllm-pd-disaggregation, and
// each PD model's engine under --enable-igw.
func (a *app) pdOptions(pp, dp policy.Policy) pd.Options {
	cfg := a.cfg
	return pd.Options{
		Registry:          a.reg,
		PrefillPolicy:     pp,
		DecodePolicy:      dp,
		Connector:         cfg.KVConnector,
		Client:            a.client,
		APIKey:            cfg.APIKey,
		ForwardClientAuth: cfg.ForwardClientAuthorization,
		OutputLength:      cfg.DecodeOutputLength,
		PrefillTimeout:    cfg.PrefillTimeout(),
		KVWaitTimeout:     cfg.KVWaitTimeout(),
		RequestTimeout:    cfg.RequestTimeout(),
		StreamIdleTimeout: cfg.StreamIdleTimeout(),
		MaxFailovers:      cfg.PDMaxFailovers,
		MaxMigrations:     cfg.MaxMigrations,
		MigrationMetrics:  a.migm,
		SplitResponses:    cfg.PDSplitResponses,
		Warmup:            cfg.PDWarmup,
		Panic:             a.panic,
		BypassThreshold:   cfg.PDUncachedTokenThreshold,
		Profile:           cfg.Profile,
		Metrics:           a.m,
		Logger:            a.log,
		Tracer:            a.tracer,
	}
}
