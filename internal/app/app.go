// Package app wires Switchyard together: configuration, the worker
// registry, policies, discovery, health checking, the regular proxy or the
// PD engine, the HTTP server and the metrics listener. It is the only
// package that knows about all the others.
package app

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/admission"
	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/discovery/k8s"
	"github.com/switchyard-llm/switchyard/internal/discovery/zmq"
	"github.com/switchyard-llm/switchyard/internal/gctune"
	"github.com/switchyard-llm/switchyard/internal/health"
	"github.com/switchyard-llm/switchyard/internal/history"
	"github.com/switchyard-llm/switchyard/internal/igw"
	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/migrate"
	"github.com/switchyard-llm/switchyard/internal/pd"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/server"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/upstream"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Version is the router version reported by --version and /get_server_info.
const Version = "0.1.0"

// notImplemented lists flags whose feature is not built yet: setting one is
// a startup error rather than a silently ignored flag.
var notImplemented = map[string]string{}

// Main runs the router until ctx is cancelled.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if err := config.LoadDotEnv(".env"); err != nil {
		fmt.Fprintln(stderr, "warning: .env:", err)
	}
	cfg, err := config.ParseWith(args, config.Options{Stdout: stdout, Version: Version})
	if errors.Is(err, config.ErrHelp) || errors.Is(err, config.ErrVersion) {
		return nil
	}
	if err != nil {
		return err
	}
	var unimpl []string
	for flag, what := range notImplemented {
		if cfg.IsSet(flag) {
			unimpl = append(unimpl, fmt.Sprintf("not implemented yet: --%s (%s)", flag, what))
		}
	}
	if len(unimpl) > 0 {
		return errors.New(strings.Join(sortStrings(unimpl), "; "))
	}
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid configuration:\n%w", err)
	}
	if cfg.Mode() == config.ModeOpenAI {
		if err := resolveUpstreamKey(cfg, os.LookupEnv); err != nil {
			return err
		}
	}
	log, closeLog, err := newLogger(cfg, stderr)
	if err != nil {
		return err
	}
	defer closeLog()
	for _, w := range cfg.Warnings() {
		log.Warn(w)
	}
	defer startGCTuning(cfg, log, os.LookupEnv).Stop()
	a, err := build(ctx, cfg, log)
	if err != nil {
		return err
	}
	return a.run(ctx)
}

// startGCTuning installs --gc-heap-floor-mb's floor over Go's default
// GOGC of 100, unless it is 0 or the environment sets GOGC (the
// operator's own choice); nil when not installed (Stop does nothing).
func startGCTuning(cfg *config.Config, log *slog.Logger, lookup func(string) (string, bool)) *gctune.Tuner {
	if cfg.GCHeapFloorMB <= 0 {
		return nil
	}
	if v, ok := lookup("GOGC"); ok {
		log.Info("GOGC is set: --gc-heap-floor-mb left off", "GOGC", v)
		return nil
	}
	return gctune.Start(uint64(cfg.GCHeapFloorMB)<<20, 100)
}

// resolveUpstreamKey sets cfg.APIKey for --backend openai: --api-key, else
// $OPENAI_API_KEY. Without either the router would send unauthenticated
// requests to a paid API, so it is a startup error unless
// --forward-client-authorization is given explicitly (each client's own
// Authorization header is then forwarded, as vllm-router does).
func resolveUpstreamKey(cfg *config.Config, lookup func(string) (string, bool)) error {
	if cfg.APIKey != "" {
		return nil
	}
	if v, ok := lookup("OPENAI_API_KEY"); ok && strings.TrimSpace(v) != "" {
		cfg.APIKey = strings.TrimSpace(v)
		return nil
	}
	if cfg.IsSet("forward-client-authorization") && cfg.ForwardClientAuthorization {
		return nil
	}
	return errors.New("--backend openai: no upstream API key: set --api-key KEY or the OPENAI_API_KEY environment variable " +
		"(or pass --forward-client-authorization to forward each client's own Authorization header)")
}

func sortStrings(s []string) []string {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s
}

func newLogger(cfg *config.Config, stderr io.Writer) (*slog.Logger, func(), error) {
	var level slog.Level
	switch strings.ToLower(cfg.LogLevel) {
	case "debug":
		level = slog.LevelDebug
	case "warn", "warning":
		level = slog.LevelWarn
	case "error", "critical":
		level = slog.LevelError
	default:
		level = slog.LevelInfo
	}
	out := stderr
	closeFn := func() {}
	if cfg.LogDir != "" {
		if err := os.MkdirAll(cfg.LogDir, 0o755); err != nil {
			return nil, nil, fmt.Errorf("--log-dir: %w", err)
		}
		name := filepath.Join(cfg.LogDir, "switchyard."+time.Now().UTC().Format("2006-01-02"))
		f, err := os.OpenFile(name, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, nil, fmt.Errorf("--log-dir: %w", err)
		}
		out = io.MultiWriter(stderr, f)
		closeFn = func() { _ = f.Close() }
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	if cfg.LogFormat == config.LogFormatJSON {
		h = slog.NewJSONHandler(out, opts)
	} else {
		h = slog.NewTextHandler(out, opts)
	}
	return slog.New(h), closeFn, nil
}

// app is the assembled router.
type app struct {
	cfg      *config.Config
	log      *slog.Logger
	m        *metrics.Metrics
	reg      *worker.Registry
	client   *http.Client
	tr       *proxy.H1Transport
	srv      *server.Server
	apiLn    net.Listener
	metricLn net.Listener
	health   *health.Checker
	panic    *worker.Panic // --panic-routing
	zmq      *zmq.Listener
	kube     *k8s.Source
	engine   *pd.Engine
	tracer   *tracing.Tracer // nil = tracing off
	kvs      *kvState        // nil unless a policy is kv_aware
	// adapters re-reads the workers' LoRA adapters for a request naming
	// an unknown model (--enable-igw).
	adapters adapterRefresh
	// LoRA adapter names the router learned of before kv_aware's index
	// existed (noteLoRA), and the index once it does.
	loraMu    sync.Mutex
	loraNames []string
	loraIndex *kvevents.Index
	history   *history.Store // nil = --history-backend none
	upstream  *worker.Worker // --backend openai: the upstream's registry entry
	igw       *igw.Router    // --enable-igw
	// igwModels names discovered workers' models (--enable-igw with discovery)
	igwModels *modelCache
	migm      *migrate.Metrics
	closers   []func()
}

func build(ctx context.Context, cfg *config.Config, log *slog.Logger) (*app, error) {
	a := &app{cfg: cfg, log: log}
	a.m = metrics.New(prometheus.NewRegistry())
	bc := breakerConfig(cfg, a.m)
	a.reg = worker.NewRegistry(bc)
	ct := cfg.ConnectTimeout()
	if ct == 0 {
		ct = -1 // --connect-timeout-secs 0: no dial timeout
	}
	a.tr = proxy.NewH1Transport(proxy.TransportOptions{ConnectTimeout: ct})
	a.client = &http.Client{Transport: a.tr}
	a.closers = append(a.closers, a.tr.Close)
	a.m.Registry.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "vllm_router_upstream_resends_total",
		Help: "Requests written again on a new connection because the worker had closed their pooled one before answering"},
		func() float64 { return float64(a.tr.Resends()) }))
	if cfg.HistoryBackend == "memory" {
		h, err := history.New(history.Options{MaxEntries: cfg.HistoryMaxEntries, TTL: cfg.HistoryTTL(), Registerer: a.m.Registry})
		if err != nil {
			return nil, fmt.Errorf("--history-backend memory: %w", err)
		}
		a.history = h
	}
	a.reg.Subscribe(a.onRegistryChange)

	// Listeners first: a busy port is a clear startup error, and the API
	// answers /liveness (and 503 on /readiness) while workers come up.
	apiAddr := net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port)))
	ln, err := net.Listen("tcp", apiAddr)
	if err != nil {
		return nil, fmt.Errorf("cannot listen on --host %s --port %d: %w", cfg.Host, cfg.Port, err)
	}
	a.apiLn = ln
	mAddr := net.JoinHostPort(cfg.PrometheusHost, strconv.Itoa(int(cfg.PrometheusPort)))
	mln, err := net.Listen("tcp", mAddr)
	if err != nil {
		ln.Close()
		return nil, fmt.Errorf("cannot listen on --prometheus-host %s --prometheus-port %d: %w", cfg.PrometheusHost, cfg.PrometheusPort, err)
	}
	a.metricLn = mln

	if err := a.addStaticWorkers(); err != nil {
		a.closeListeners()
		return nil, err
	}
	if err := a.startTracing(ctx); err != nil {
		a.closeListeners()
		return nil, err
	}
	if err := a.buildServer(ctx); err != nil {
		a.closeListeners()
		a.closeAll()
		return nil, err
	}
	return a, nil
}

func (a *app) closeListeners() {
	if a.apiLn != nil {
		a.apiLn.Close()
	}
	if a.metricLn != nil {
		a.metricLn.Close()
	}
}

func (a *app) closeAll() {
	for i := len(a.closers) - 1; i >= 0; i-- {
		a.closers[i]()
	}
}

func breakerConfig(cfg *config.Config, m *metrics.Metrics) worker.BreakerConfig {
	cb := cfg.EffectiveCircuitBreaker()
	return worker.BreakerConfig{
		Disabled:         cb.Disabled,
		FailureThreshold: min(cb.FailureThreshold, 1<<30),
		SuccessThreshold: cb.SuccessThreshold,
		OpenDuration:     cb.OpenDuration,
		Window:           cb.Window,
		FailureRate:      cb.FailureRate,
		MinRequests:      cb.MinRequests,
		HalfOpenMax:      cb.HalfOpenMax,
		OnTransitionFor: func(key string, from, to worker.BreakerState) {
			m.CBState.WithLabelValues(key).Set(float64(to))
			m.CBTransitions.WithLabelValues(key, from.String(), to.String()).Inc()
		},
	}
}

func (a *app) onRegistryChange(c worker.Change) {
	if len(c.Added) == 0 && len(c.Removed) == 0 {
		return // a probe request (worker.Change.Probe), no membership change
	}
	for _, w := range c.Removed {
		if a.reg.Get(w.Key()) == nil {
			a.m.ForgetWorker(w.Key())
		}
		if a.history != nil && !slices.ContainsFunc(c.Snap.All, func(x *worker.Worker) bool { return x.URL == w.URL }) {
			a.history.ForgetWorker(w.URL)
		}
	}
	a.m.ActiveWorkers.Set(float64(len(c.Snap.All)))
	counts := map[[2]string]int{}
	for _, w := range c.Snap.All {
		counts[[2]string{w.Role.String(), w.Source.String()}]++
	}
	a.m.Workers.Reset()
	for k, n := range counts {
		a.m.Workers.WithLabelValues(k[0], k[1]).Set(float64(n))
	}
}

// addStaticWorkers registers --worker-urls (regular) or --prefill/--decode.
func (a *app) addStaticWorkers() error {
	cfg := a.cfg
	dp := max(cfg.IntraNodeDataParallelSize, 1)
	if cfg.Mode() == config.ModeIGW {
		return nil // registered by resolveStaticIGW once each worker names its model
	}
	if cfg.Mode() == config.ModeOpenAI {
		base := upstream.BaseURL(cfg.WorkerURLs[0])
		ws, err := a.addURL(base, worker.RoleRegular, nil, worker.SourceStatic, 1)
		if err != nil {
			return fmt.Errorf("--worker-urls %s: %w", cfg.WorkerURLs[0], err)
		}
		a.upstream = ws[0]
		return nil
	}
	if cfg.Mode() != config.ModeVLLMPD {
		for _, u := range cfg.WorkerURLs {
			if _, err := a.addURL(u, worker.RoleRegular, nil, worker.SourceStatic, dp); err != nil {
				return fmt.Errorf("--worker-urls %s: %w", u, err)
			}
		}
		return nil
	}
	for _, p := range cfg.Prefill {
		if _, err := a.addURL(p.URL, worker.RolePrefill, p.BootstrapPort, worker.SourceStatic, cfg.PrefillDPSize()); err != nil {
			return fmt.Errorf("--prefill %s: %w", p.URL, err)
		}
	}
	for _, u := range cfg.Decode {
		if _, err := a.addURL(u, worker.RoleDecode, nil, worker.SourceStatic, cfg.DecodeDPSize()); err != nil {
			return fmt.Errorf("--decode %s: %w", u, err)
		}
	}
	return nil
}

func (a *app) addURL(raw string, role worker.Role, bootstrap *int, src worker.Source, dp int) ([]*worker.Worker, error) {
	base, rank, err := worker.NormalizeURL(raw)
	if err != nil {
		return nil, err
	}
	spec := worker.Spec{URL: base, Role: role, DPRank: -1, Source: src}
	if bootstrap != nil {
		spec.BootstrapPort = *bootstrap
	}
	var specs []worker.Spec
	if rank >= 0 {
		spec.DPRank, spec.DPSize = rank, max(dp, rank+1)
		specs = []worker.Spec{spec}
	} else {
		specs = worker.ExpandDP(spec, dp)
	}
	return a.reg.Add(specs...)
}

func (a *app) policyOptions() policy.Options {
	cfg := a.cfg
	o := policy.DefaultOptions()
	o.CacheThreshold = cfg.CacheThreshold
	o.BalanceAbsThreshold = cfg.BalanceAbsThreshold
	o.BalanceRelThreshold = cfg.BalanceRelThreshold
	o.EvictionInterval = cfg.EvictionInterval()
	o.MaxTreeSize = cfg.MaxTreeSize
	o.Metrics = a.m
	o.Registry = a.reg
	return o
}

func (a *app) newPolicy(name string) (policy.Policy, error) {
	if name == config.PolicyKVAware {
		p, err := a.newKVAware()
		if err != nil {
			return nil, err
		}
		a.closers = append(a.closers, func() { _ = policy.Close(p) })
		return p, nil
	}
	p, err := policy.New(name, a.policyOptions())
	if err != nil {
		return nil, err
	}
	a.closers = append(a.closers, func() { _ = policy.Close(p) })
	if a.history != nil {
		// previous_response_id goes to the worker that stored it
		p = history.Pin(p, a.history)
	}
	return p, nil
}

// buildServer builds the HTTP server, the mode's dispatchers and the
// workers' health checker from the flags.
func (a *app) buildServer(ctx context.Context) error {
	cfg := a.cfg
	a.panic = &worker.Panic{Disabled: !cfg.PanicRouting, Logger: a.log,
		OnPick: func(r worker.Role) { a.m.PanicRouted.WithLabelValues(r.String()).Inc() }}
	a.migm = migrate.NewMetrics(a.m.Registry)
	ropts := a.regularOptions()
	sopts := a.serverOptions()
	if cfg.FlowControl {
		fc, err := flowConfig(cfg)
		if err != nil {
			return err
		}
		sopts.Flow = fc
	}
	var err error
	switch cfg.Mode() {
	case config.ModeIGW:
		err = a.buildIGW(&sopts, ropts)
	case config.ModeOpenAI:
		err = a.buildOpenAI(&sopts, ropts)
	case config.ModeVLLMPD:
		err = a.buildPD(&sopts, ropts)
	default:
		err = a.buildRegular(&sopts, ropts)
	}
	if err != nil {
		return err
	}
	if cfg.ServiceDiscovery {
		if err := a.buildKube(&sopts); err != nil {
			return err
		}
	}
	a.health = a.newHealthChecker()
	if a.kvs != nil {
		sopts.Sections = map[string]func() any{"kv_aware": a.kvStatus}
	}
	given := sopts.LoRAChanged
	sopts.LoRAChanged = func(name string, models []string) {
		if given != nil {
			given(name, models)
		}
		if len(models) > 0 {
			a.noteLoRA(name)
		}
	}
	srv, err := server.New(sopts)
	if err != nil {
		return err
	}
	a.srv = srv
	return nil
}

// regularOptions are the regular dispatcher's options from the flags (its
// Role and Policy are the mode's to set).
func (a *app) regularOptions() proxy.RegularOptions {
	cfg := a.cfg
	retry := cfg.EffectiveRetry()
	return proxy.RegularOptions{
		MaxMigrations:     cfg.MaxMigrations,
		MigrationMetrics:  a.migm,
		Panic:             a.panic,
		Registry:          a.reg,
		Client:            a.proxyClient(),
		APIKey:            cfg.APIKey,
		ForwardClientAuth: cfg.ForwardClientAuthorization,
		Retry: proxy.RetryConfig{
			MaxAttempts:    retry.MaxAttempts,
			InitialBackoff: retry.InitialBackoff,
			MaxBackoff:     retry.MaxBackoff,
			Multiplier:     retry.BackoffMultiplier,
			Jitter:         retry.JitterFactor,
			BudgetRatio:    retry.BudgetRatio,
		},
		RequestTimeout:    cfg.RequestTimeout(),
		StreamIdleTimeout: cfg.StreamIdleTimeout(),
		Metrics:           a.m,
		Logger:            a.log,
	}
}

// serverOptions are the HTTP server's options from the flags (its mode,
// dispatchers and the mode's extras are the mode's to set).
func (a *app) serverOptions() server.Options {
	cfg := a.cfg
	return server.Options{
		Registry:                   a.reg,
		Upstream:                   a.client,
		AddWorker:                  a.adminAdd,
		RemoveWorker:               a.adminRemove,
		Version:                    Version,
		MaxPayloadSize:             int64(cfg.MaxPayloadSize),
		MaxHeaderBytes:             cfg.MaxHeaderBytes,
		BuiltinHTTP:                cfg.HTTPServer == config.HTTPServerBuiltin,
		RequestIDHeaders:           cfg.EffectiveRequestIDHeaders(),
		CORSAllowedOrigins:         cfg.CORSAllowedOrigins,
		APIKeyValidationURLs:       cfg.APIKeyValidationURLs,
		RouterAPIKeys:              cfg.RouterAPIKeys,
		AdminAPIKey:                cfg.AdminAPIKey,
		MaxConcurrent:              cfg.MaxConcurrentRequests,
		QueueSize:                  cfg.QueueSize,
		QueueTimeout:               cfg.QueueTimeout(),
		RateLimitPerSecond:         cfg.RateLimitTokensPerSecond,
		RouteReceipt:               cfg.RouteReceipt,
		ShutdownTimeout:            cfg.ShutdownTimeout(),
		BodyReadTimeout:            cmp.Or(cfg.BodyReadTimeout(), -1), // 0 = none; the server takes 0 as its default
		Logger:                     a.log,
		Metrics:                    a.m,
		Tracer:                     a.tracer,
		History:                    a.history,
		APIKey:                     cfg.APIKey,
		ForwardClientAuthorization: cfg.ForwardClientAuthorization,
	}
}

// buildOpenAI sets the server up for --backend openai: one upstream.
func (a *app) buildOpenAI(sopts *server.Options, ropts proxy.RegularOptions) error {
	cfg := a.cfg
	b, err := upstream.New(upstream.Options{
		Worker:            a.upstream,
		Client:            a.proxyClient(),
		APIKey:            cfg.APIKey,
		ForwardClientAuth: cfg.ForwardClientAuthorization,
		Retry:             ropts.Retry,
		RequestTimeout:    cfg.RequestTimeout(),
		StreamIdleTimeout: cfg.StreamIdleTimeout(),
		Metrics:           a.m,
		Logger:            a.log,
	})
	if err != nil {
		return err
	}
	sopts.Mode = server.ModeRegular
	sopts.Generate = b
	sopts.Policies = map[string]string{"backend": config.BackendOpenAI}
	return nil
}

// buildPD sets the server up for --vllm-pd-disaggregation: the PD engine
// for generation, prefill workers for the other routes, and ZMQ discovery
// when it is on.
func (a *app) buildPD(sopts *server.Options, ropts proxy.RegularOptions) error {
	cfg := a.cfg
	pp, err := a.newPolicy(cfg.EffectivePrefillPolicy())
	if err != nil {
		return fmt.Errorf("--prefill-policy: %w", err)
	}
	dp, err := a.newPolicy(cfg.EffectiveDecodePolicy())
	if err != nil {
		return fmt.Errorf("--decode-policy: %w", err)
	}
	eng, err := pd.New(a.pdOptions(pp, dp))
	if err != nil {
		return err
	}
	a.engine = eng
	a.closers = append(a.closers, eng.Close)
	// Non-generation endpoints (tokenize, embeddings, unknown paths)
	// go to prefill workers, which serve plain requests like any vLLM.
	ropts.Role = worker.RolePrefill
	ropts.Policy = pp
	pass := proxy.NewRegular(ropts)
	sopts.Mode = server.ModePD
	sopts.Generate = eng
	sopts.Passthrough = http.HandlerFunc(pass.ServePassthrough)
	sopts.Ready = eng.Ready
	sopts.PDStatus = func() any { return eng.Status() }
	sopts.Profile = eng.ServeProfile
	sopts.Policies = map[string]string{"policy": cfg.Policy, "prefill": cfg.EffectivePrefillPolicy(), "decode": cfg.EffectiveDecodePolicy()}
	if cfg.VLLMDiscoveryAddress != "" {
		return a.buildZMQ(sopts, nil)
	}
	return nil
}

// buildRegular sets the server up for regular mode: one policy over the
// workers, with flow control's prefill rules when they are on.
func (a *app) buildRegular(sopts *server.Options, ropts proxy.RegularOptions) error {
	p, err := a.newPolicy(a.cfg.Policy)
	if err != nil {
		return fmt.Errorf("--policy: %w", err)
	}
	ropts.Role = worker.RoleRegular
	ropts.Policy = p
	if sopts.Flow != nil {
		if st := admission.NewSteer(sopts.Flow.Saturation); st != nil {
			ropts.Steer = st // the prefill rules (regular mode only)
		}
	}
	reg := proxy.NewRegular(ropts)
	sopts.Mode = server.ModeRegular
	sopts.Generate = reg
	sopts.Passthrough = http.HandlerFunc(reg.ServePassthrough)
	sopts.Policies = map[string]string{"policy": a.cfg.Policy}
	return nil
}

// newHealthChecker is the workers' health checker from the flags.
func (a *app) newHealthChecker() *health.Checker {
	return health.NewChecker(health.Options{
		Registry:         a.reg,
		Client:           a.client,
		Interval:         a.cfg.HealthCheckInterval(),
		Timeout:          a.cfg.HealthCheckTimeout(),
		Endpoint:         a.cfg.HealthCheckEndpoint,
		FailureThreshold: int(a.cfg.HealthFailureThreshold),
		SuccessThreshold: int(a.cfg.HealthSuccessThreshold),
		// fast recovery of unhealthy and never-probed workers
		UnhealthyInterval:    a.cfg.HealthUnhealthyInterval(),
		UnhealthyMaxInterval: a.cfg.HealthUnhealthyMaxInterval(),
		LoadPollInterval:     a.loadPollInterval(),
		Metrics:              a.m,
		Logger:               a.log,
		BeforeHealthy:        a.prepareLoRA,
		WhileHealthy:         a.followAdapters,
		HoldNew:              a.holdForLoRA,
	})
}

// startTracing starts OpenTelemetry tracing when --enable-trace is set; the
// exporter is flushed and stopped by the last closer, after the server has
// drained.
func (a *app) startTracing(ctx context.Context) error {
	cfg := a.cfg
	if !cfg.EnableTrace {
		return nil
	}
	t, err := tracing.New(ctx, tracing.Config{
		Endpoint:       cfg.OTLPTracesEndpoint,
		SamplingRatio:  cfg.OtelSamplingRatio,
		ExcludedPaths:  cfg.EffectiveOtelExcludedPaths(),
		ServiceVersion: Version,
		Logger:         a.log,
	})
	if err != nil {
		return fmt.Errorf("--enable-trace: %w", err)
	}
	a.tracer = t
	a.closers = append(a.closers, func() {
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := t.Shutdown(sctx); err != nil {
			a.log.Warn("flushing traces failed", "err", err)
		}
	})
	a.log.Info("tracing enabled", "endpoint", tracing.ResolveEndpoint(cfg.OTLPTracesEndpoint),
		"sampling_ratio", cfg.OtelSamplingRatio, "excluded_paths", cfg.EffectiveOtelExcludedPaths())
	return nil
}

// proxyClient is the upstream client of the regular dispatcher (and the PD
// pass-through): with tracing on, its transport gives every upstream
// request an "inference" client span and injects the trace context.
func (a *app) proxyClient() *http.Client {
	if !a.tracer.Enabled() {
		return a.client
	}
	rt := a.tracer.Transport(a.tr, tracing.TransportOptions{Route: func(r *http.Request) string {
		if c := proxy.CallFrom(r.Context()); c != nil {
			return c.Route
		}
		return ""
	}})
	return &http.Client{Transport: rt}
}

// buildKube creates the Kubernetes pod discovery source (--service-discovery)
// and adds its status to the server's discovery status.
func (a *app) buildKube(sopts *server.Options) error {
	cfg := a.cfg
	cs, err := k8s.NewClientset("switchyard/" + Version)
	if err != nil {
		return fmt.Errorf("--service-discovery: %w", err)
	}
	var model func(string) (string, bool)
	if a.igwModels != nil {
		model = a.igwModels.Model
	}
	src, err := k8s.New(k8s.Options{
		Clientset:        cs,
		Namespace:        cfg.ServiceDiscoveryNamespace,
		Selector:         cfg.SelectorMap(),
		PrefillSelector:  cfg.PrefillSelectorMap(),
		DecodeSelector:   cfg.DecodeSelectorMap(),
		PD:               cfg.Mode() == config.ModeVLLMPD,
		Models:           cfg.Mode() == config.ModeIGW,
		Model:            model,
		Port:             int(cfg.ServiceDiscoveryPort),
		DPSizeAnnotation: cfg.DPSizeAnnotation,
		DefaultDPSize:    cfg.IntraNodeDataParallelSize,
		Registry:         a.reg,
		Metrics:          a.m,
		Logger:           a.log,
	})
	if err != nil {
		return fmt.Errorf("--service-discovery: %w", err)
	}
	a.kube = src
	if a.igwModels != nil {
		a.igwModels.OnKnown(src.Refresh)
	}
	if zs := sopts.DiscoveryStatus; zs != nil {
		sopts.DiscoveryStatus = func() any { return map[string]any{"zmq": zs(), "kubernetes": src.Status()} }
	} else {
		sopts.DiscoveryStatus = src.Status
	}
	return nil
}

// loadPollInterval is --load-poll-interval-secs; when it is unset and a
// power_of_two policy is in use, vllm-router's behaviour applies: worker
// loads are polled every --worker-startup-check-interval seconds.
func (a *app) loadPollInterval() time.Duration {
	if d := a.cfg.LoadPollInterval(); d > 0 || a.cfg.IsSet("load-poll-interval-secs") {
		return d
	}
	for _, p := range []string{a.cfg.Policy, a.cfg.EffectivePrefillPolicy(), a.cfg.EffectiveDecodePolicy()} {
		if p == config.PolicyPowerOfTwo {
			return a.cfg.WorkerStartupCheckInterval()
		}
	}
	return 0
}

// adminAdd implements /add_worker and POST /workers: the worker is added at
// once (unhealthy until its first probe passes) so the call never blocks
// for minutes; the probe runs within --worker-startup-timeout-secs.
func (a *app) adminAdd(ctx context.Context, raw string) ([]*worker.Worker, error) {
	role := worker.RoleRegular
	if a.cfg.Mode() == config.ModeOpenAI {
		return nil, errors.New("--backend openai: the one upstream is --worker-urls; workers cannot be added")
	}
	if a.cfg.Mode() == config.ModeVLLMPD {
		return nil, errors.New("PD mode: add prefill/decode workers with POST /workers {\"url\":..., \"worker_type\":\"prefill\"|\"decode\"}")
	}
	ws, err := a.addURL(raw, role, nil, worker.SourceAdmin, max(a.cfg.IntraNodeDataParallelSize, 1))
	if err != nil {
		return nil, err
	}
	timeout := a.cfg.WorkerStartupTimeout()
	pctx, cancel := context.WithTimeout(ctx, min(timeout, 30*time.Second))
	defer cancel()
	if err := a.health.ProbeNow(pctx, ws[0]); err != nil {
		for _, w := range ws {
			w.SetHealthy(false)
		}
		a.log.Warn("added worker is not healthy yet; it will be routed once a health probe passes", "url", raw, "err", err)
	}
	return ws, nil
}

func (a *app) adminRemove(raw string) []*worker.Worker {
	base, rank, err := worker.NormalizeURL(raw)
	if err != nil {
		return nil
	}
	if rank >= 0 {
		return a.reg.Remove(base + "@" + strconv.Itoa(rank))
	}
	return a.reg.RemoveWhere(func(w *worker.Worker) bool { return w.URL == base })
}

// run serves until ctx is cancelled, then shuts everything down in order.
func (a *app) run(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer a.closeAll()

	msrv := &http.Server{Handler: a.metricsMux(), ReadHeaderTimeout: 10 * time.Second}
	wg.Go(func() {
		if err := msrv.Serve(a.metricLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("metrics listener failed", "err", err)
		}
	})
	if a.cfg.Mode() != config.ModeOpenAI {
		// An OpenAI-compatible API has no /health; its breaker is the
		// upstream's passive health.
		wg.Go(func() { a.health.Run(ctx) })
	}
	wg.Go(func() { a.srv.RunLoRASync(ctx, a.cfg.HealthCheckInterval()) })
	if ws := a.staticIGW(); a.igw != nil && len(ws) > 0 {
		wg.Go(func() { a.resolveStaticIGW(ctx, ws) })
	}
	if a.kube != nil {
		wg.Go(func() {
			if err := a.kube.Run(ctx); err != nil && ctx.Err() == nil {
				a.log.Error("Kubernetes discovery stopped", "err", err)
			}
		})
	}
	if a.zmq != nil {
		wg.Go(func() {
			if err := a.zmq.Run(ctx); err != nil && ctx.Err() == nil {
				a.log.Error("ZMQ discovery stopped", "err", err)
			}
		})
	}
	a.log.Info("switchyard started", "version", Version, "mode", string(a.cfg.Mode()), "listen", a.apiLn.Addr().String(),
		"metrics", a.metricLn.Addr().String(), "policy", a.cfg.Policy, "kv_connector", a.cfg.KVConnector,
		"discovery", a.cfg.VLLMDiscoveryAddress, "workers", len(a.reg.Snapshot().All))
	err := a.srv.Serve(ctx, a.apiLn)
	cancel()
	sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = msrv.Shutdown(sctx)
	scancel()
	wg.Wait()
	a.log.Info("switchyard stopped")
	if errors.Is(err, http.ErrServerClosed) || errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// holdForLoRA: while LoRA adapters are remembered, a worker that joins is
// held out of routing until its first passing health probe, before which
// the health checker gives it the adapters (prepareLoRA).
func (a *app) holdForLoRA() bool { return a.srv != nil && a.srv.HasLoRA() }

// prepareLoRA gives a worker about to be healthy again its LoRA adapters
// and, with --enable-igw, reads the adapters it lists (an engine may come
// back with other --lora-modules).
func (a *app) prepareLoRA(ctx context.Context, url string) {
	if a.srv != nil {
		a.srv.PrepareLoRA(ctx, url)
	}
	a.relearnAdapters(ctx, url)
}

// followAdapters re-reads a healthy worker's adapters after each passing
// health probe, so adapters loaded or unloaded on an engine directly are
// followed within an interval. It runs before the probe's result is
// applied, so it gets the probe's timeout, not learnAdapters' own.
func (a *app) followAdapters(ctx context.Context, url string) {
	if a.igw == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, a.cfg.HealthCheckTimeout())
	defer cancel()
	a.relearnAdapters(ctx, url)
}

// relearnAdapters reads the adapters the worker at url lists, with
// --enable-igw.
func (a *app) relearnAdapters(ctx context.Context, url string) {
	if a.igw == nil {
		return
	}
	for _, w := range a.reg.Snapshot().All {
		if w.URL == url && w.ModelID != "" {
			a.learnAdapters(ctx, url, w.ModelID)
			return
		}
	}
}

func (a *app) metricsMux() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", a.m.Handler())
	if a.cfg.EnablePprof {
		// Registered explicitly: the router never uses http.DefaultServeMux.
		mux.HandleFunc("GET /debug/pprof/", pprof.Index)
		mux.HandleFunc("GET /debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("GET /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("POST /debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	}
	mux.HandleFunc("GET /", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, "switchyard metrics: /metrics\n")
		if a.cfg.EnablePprof {
			_, _ = io.WriteString(w, "profiles: /debug/pprof/\n")
		}
	})
	return mux
}

// flowConfig builds the flow-control settings (--flow-*); the server fills
// in the registry, the mode and the client of the saturation detector.
func flowConfig(cfg *config.Config) (*admission.FlowConfig, error) {
	bands, err := admission.ParseBands(cfg.FlowBands, cfg.QueueTimeout())
	if err != nil {
		return nil, fmt.Errorf("--flow-bands: %w", err)
	}
	weights, err := admission.ParseWeights(cfg.FlowWeights)
	if err != nil {
		return nil, fmt.Errorf("--flow-weights: %w", err)
	}
	fc := &admission.FlowConfig{
		Bands:           bands,
		DefaultBand:     cfg.FlowDefaultBand,
		OrderByDeadline: cfg.FlowOrder == config.FlowOrderDeadline,
		FairnessKey:     cfg.FlowFairnessKey,
		ObjectiveHeader: cfg.FlowObjectiveHeader,
		FairnessHeader:  cfg.FlowFairnessHeader,
		DeadlineHeader:  cfg.FlowDeadlineHeader,
		Weights:         weights,
		Headroom:        cfg.FlowHeadroom,
		EnginePriority:  cfg.FlowEnginePriority,
	}
	if cfg.FlowWorkerMaxInFlight > 0 || cfg.FlowMaxWaiting > 0 || cfg.FlowMaxKVUsage > 0 || cfg.FlowAvoidPrefill || cfg.FlowIsolatePrefill || cfg.FlowPrefillReserve > 0 {
		fc.Saturation = &admission.SaturationConfig{
			MaxInFlight:    cfg.FlowWorkerMaxInFlight,
			MaxWaiting:     cfg.FlowMaxWaiting,
			MaxKVUsage:     cfg.FlowMaxKVUsage,
			PollInterval:   cfg.FlowPollInterval(),
			AvoidPrefill:   cfg.FlowAvoidPrefill,
			IsolatePrefill: cfg.FlowIsolatePrefill,
			PrefillReserve: cfg.FlowPrefillReserve,
		}
	}
	return fc, nil
}
