package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// flagDef describes one flag: its binding to a Config field and its help.
type flagDef struct {
	name  string
	alias string
	meta  string // value placeholder in --help; "" for booleans
	usage string
	value flag.Value
	multi bool // consumes following tokens until the next flag
	min   int  // minimum number of values of a multi flag
	extra bool // Switchyard extra (separate --help section)
}

func (d *flagDef) isBool() bool {
	b, ok := d.value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// flagDefs binds every flag to c's fields, in --help order. --prefill is
// hand-parsed (splitPrefill); --help and --version are handled by tokenize.
func flagDefs(c *Config) []flagDef { return append(baseFlagDefs(c), kvFlagDefs(c)...) }

func baseFlagDefs(c *Config) []flagDef {
	str := func(p *string) flag.Value { return stringValue{p} }
	boo := func(p *bool) flag.Value { return boolValue{p} }
	u16 := func(p *uint16) flag.Value { return uintValue[uint16]{p} }
	u32 := func(p *uint32) flag.Value { return uintValue[uint32]{p} }
	u64 := func(p *uint64) flag.Value { return uintValue[uint64]{p} }
	num := func(p *int) flag.Value { return intValue{p} }
	flt := func(p *float64) flag.Value { return floatValue{p} }
	enum := func(p *string, allowed []string) flag.Value { return enumValue{p, allowed} }
	list := func(p *[]string) flag.Value { return &listValue{p: p} }
	return []flagDef{
		{name: "host", meta: "HOST", usage: "Host address to bind the router server", value: str(&c.Host)},
		{name: "port", meta: "PORT", usage: "Port number to bind the router server", value: u16(&c.Port)},
		{name: "worker-urls", meta: "URL", multi: true, usage: "List of worker URLs (e.g., http://worker1:8000 http://worker2:8000)", value: list(&c.WorkerURLs)},
		{name: "policy", meta: "POLICY", usage: "Load balancing policy to use", value: enum(&c.Policy, policyNames)},
		{name: "vllm-pd-disaggregation", usage: "Enable vLLM PD (Prefill-Decode) disaggregated mode", value: boo(&c.VLLMPDDisaggregation)},
		{name: "vllm-discovery-address", meta: "HOST:PORT", usage: "ZMQ service discovery address where vLLM workers register (e.g. 0.0.0.0:30001); static --prefill/--decode are used as well", value: str(&c.VLLMDiscoveryAddress)},
		{name: "decode", meta: "URL", multi: true, min: 1, usage: "Decode server URL (repeatable)", value: list(&c.Decode)},
		{name: "prefill-policy", meta: "POLICY", usage: "Specific policy for prefill nodes in PD mode (default: --policy)", value: enum(&c.PrefillPolicy, policyNames)},
		{name: "decode-policy", meta: "POLICY", usage: "Specific policy for decode nodes in PD mode (default: --policy)", value: enum(&c.DecodePolicy, policyNames)},
		{name: "worker-startup-timeout-secs", meta: "SECS", usage: "Timeout in seconds for worker startup", value: u64(&c.WorkerStartupTimeoutSecs)},
		{name: "worker-startup-check-interval", meta: "SECS", usage: "Interval in seconds between checks for worker startup", value: u64(&c.WorkerStartupCheckIntervalSecs)},
		{name: "cache-threshold", meta: "RATIO", usage: "Cache threshold (0.0-1.0) for cache-aware routing", value: flt(&c.CacheThreshold)},
		{name: "balance-abs-threshold", meta: "N", usage: "Absolute threshold for load balancing", value: num(&c.BalanceAbsThreshold)},
		{name: "balance-rel-threshold", meta: "RATIO", usage: "Relative threshold for load balancing", value: flt(&c.BalanceRelThreshold)},
		{name: "eviction-interval", meta: "SECS", usage: "Interval in seconds between cache eviction operations", value: u64(&c.EvictionIntervalSecs)},
		{name: "max-tree-size", meta: "N", usage: "Maximum size of the approximation tree for cache-aware routing", value: num(&c.MaxTreeSize)},
		{name: "max-payload-size", meta: "BYTES", usage: "Maximum payload size in bytes", value: num(&c.MaxPayloadSize)},
		{name: "intra-node-data-parallel-size", meta: "N", usage: "Intra-node data parallel size (DP replicas per worker URL)", value: num(&c.IntraNodeDataParallelSize)},
		{name: "api-key", meta: "KEY", usage: "API key for worker authorization (with --backend openai: the upstream's key, default $OPENAI_API_KEY)", value: str(&c.APIKey)},
		{name: "api-key-validation-urls", meta: "URL", multi: true, usage: "API key validation URLs (default: env API_KEY_VALIDATION_URLS, comma-separated)", value: list(&c.APIKeyValidationURLs)},
		{name: "backend", alias: "runtime", meta: "BACKEND", usage: "Backend to route requests to (openai: one OpenAI-compatible upstream, --worker-urls BASE_URL)", value: enum(&c.Backend, backendNames)},
		{name: "log-dir", meta: "DIR", usage: "Directory to store log files", value: str(&c.LogDir)},
		{name: "log-level", meta: "LEVEL", usage: "Set the logging level", value: enum(&c.LogLevel, logLevelNames)},
		{name: "enable-trace", usage: "Enable OpenTelemetry tracing", value: boo(&c.EnableTrace)},
		{name: "otlp-traces-endpoint", meta: "HOST:PORT", usage: "OTLP collector endpoint; if omitted, respects OTEL_EXPORTER_OTLP_ENDPOINT", value: str(&c.OTLPTracesEndpoint)},
		{name: "otel-sampling-ratio", meta: "RATIO", usage: "Parent-based sampling ratio for OpenTelemetry traces", value: flt(&c.OtelSamplingRatio)},
		{name: "otel-excluded-paths", meta: "PATH", multi: true, usage: "Exact HTTP paths to exclude from OpenTelemetry server spans (default: /health /health_generate /liveness /readiness)", value: list(&c.OtelExcludedPaths)},
		{name: "service-discovery", usage: "Enable Kubernetes service discovery", value: boo(&c.ServiceDiscovery)},
		{name: "selector", meta: "KEY=VALUE", multi: true, usage: "Label selector for Kubernetes service discovery", value: list(&c.Selector)},
		{name: "service-discovery-port", meta: "PORT", usage: "Port to use for discovered worker pods", value: u16(&c.ServiceDiscoveryPort)},
		{name: "service-discovery-namespace", meta: "NAMESPACE", usage: "Kubernetes namespace to watch for pods (default: all)", value: str(&c.ServiceDiscoveryNamespace)},
		{name: "prefill-selector", meta: "KEY=VALUE", multi: true, usage: "Label selector for prefill server pods in PD mode", value: list(&c.PrefillSelector)},
		{name: "decode-selector", meta: "KEY=VALUE", multi: true, usage: "Label selector for decode server pods in PD mode", value: list(&c.DecodeSelector)},
		{name: "prometheus-port", meta: "PORT", usage: "Port to expose Prometheus metrics", value: u16(&c.PrometheusPort)},
		{name: "prometheus-host", meta: "IP", usage: "IP address to bind the Prometheus metrics server", value: str(&c.PrometheusHost)},
		{name: "request-id-headers", meta: "HEADER", multi: true, usage: "Custom HTTP headers to check for request IDs (default: x-request-id x-correlation-id x-trace-id request-id)", value: list(&c.RequestIDHeaders)},
		{name: "request-timeout-secs", meta: "SECS", usage: "Request timeout in seconds", value: u64(&c.RequestTimeoutSecs)},
		{name: "max-concurrent-requests", meta: "N", usage: "Maximum number of concurrent requests allowed", value: num(&c.MaxConcurrentRequests)},
		{name: "cors-allowed-origins", meta: "ORIGIN", multi: true, usage: "CORS allowed origins (default: any)", value: list(&c.CORSAllowedOrigins)},
		{name: "retry-max-retries", meta: "N", usage: "Maximum number of attempts", value: u32(&c.RetryMaxRetries)},
		{name: "retry-initial-backoff-ms", meta: "MS", usage: "Initial backoff in milliseconds for retries", value: u64(&c.RetryInitialBackoffMS)},
		{name: "retry-max-backoff-ms", meta: "MS", usage: "Maximum backoff in milliseconds for retries", value: u64(&c.RetryMaxBackoffMS)},
		{name: "retry-backoff-multiplier", meta: "X", usage: "Backoff multiplier for exponential backoff", value: flt(&c.RetryBackoffMultiplier)},
		{name: "retry-jitter-factor", meta: "RATIO", usage: "Jitter factor for retry backoff", value: flt(&c.RetryJitterFactor)},
		{name: "disable-retries", usage: "Disable retries", value: boo(&c.DisableRetries)},
		{name: "cb-failure-threshold", meta: "N", usage: "Number of consecutive failures before the circuit breaker opens", value: u32(&c.CBFailureThreshold)},
		{name: "cb-success-threshold", meta: "N", usage: "Number of successes before the circuit breaker closes", value: u32(&c.CBSuccessThreshold)},
		{name: "cb-timeout-duration-secs", meta: "SECS", usage: "Open to half-open delay in seconds", value: u64(&c.CBTimeoutDurationSecs)},
		{name: "cb-window-duration-secs", meta: "SECS", usage: "Failure-rate window in seconds", value: u64(&c.CBWindowDurationSecs)},
		{name: "disable-circuit-breaker", usage: "Disable circuit breaker", value: boo(&c.DisableCircuitBreaker)},
		{name: "health-failure-threshold", meta: "N", usage: "Consecutive health check failures before marking a worker unhealthy", value: u32(&c.HealthFailureThreshold)},
		{name: "health-success-threshold", meta: "N", usage: "Consecutive health check successes before marking a worker healthy", value: u32(&c.HealthSuccessThreshold)},
		{name: "health-check-timeout-secs", meta: "SECS", usage: "Timeout in seconds for health check requests", value: u64(&c.HealthCheckTimeoutSecs)},
		{name: "health-check-interval-secs", meta: "SECS", usage: "Interval in seconds between runtime health checks", value: u64(&c.HealthCheckIntervalSecs)},
		{name: "health-check-endpoint", meta: "PATH", usage: "Health check endpoint path", value: str(&c.HealthCheckEndpoint)},
		{name: "enable-igw", usage: "Enable Inference Gateway mode: several models behind one router, routed by the body's model", value: boo(&c.EnableIGW)},
		{name: "history-backend", meta: "BACKEND", usage: "History backend (memory or none)", value: enum(&c.HistoryBackend, historyBackendNames)},
		{name: "profile", usage: "Enable profiling calls to vLLM workers", value: boo(&c.Profile)},
		{name: "kv-connector", meta: "CONNECTOR", usage: "KV connector type for PD disaggregation", value: enum(&c.KVConnector, kvConnectorNames)},

		{extra: true, name: "config", meta: "FILE", usage: "YAML or JSON file of settings (keys are flag names with _); flags override it", value: str(&c.ConfigFile)},
		{extra: true, name: "queue-size", meta: "N", usage: "Requests that may wait for a concurrency slot (0 = reject at once)", value: num(&c.QueueSize)},
		{extra: true, name: "queue-timeout-secs", meta: "SECS", usage: "Maximum wait in the queue", value: u64(&c.QueueTimeoutSecs)},
		{extra: true, name: "rate-limit-tokens-per-second", meta: "RATE", usage: "Request rate limit (0 = off)", value: flt(&c.RateLimitTokensPerSecond)},
		{extra: true, name: "router-api-keys", meta: "KEY", multi: true, usage: "Static API keys accepted from clients", value: list(&c.RouterAPIKeys)},
		{extra: true, name: "admin-api-key", meta: "KEY", usage: "API key required on admin endpoints", value: str(&c.AdminAPIKey)},
		{extra: true, name: "forward-client-authorization", usage: "Forward the client's Authorization header upstream when --api-key is unset (use =false to disable)", value: boo(&c.ForwardClientAuthorization)},
		{extra: true, name: "shutdown-timeout-secs", meta: "SECS", usage: "Graceful shutdown deadline for in-flight requests", value: flt(&c.ShutdownTimeoutSecs)},
		{extra: true, name: "log-format", meta: "FORMAT", usage: "Log format", value: enum(&c.LogFormat, logFormatNames)},
		{extra: true, name: "http-server", meta: "SERVER", usage: "HTTP/1.1 server of the client listener: builtin (default; internal/h1server: no goroutine but the connection's, buffers pooled between reads, docs/BENCHMARKS.md section 11) or net/http", value: enum(&c.HTTPServer, httpServerNames)},
		{extra: true, name: "gc-heap-floor-mb", meta: "MIB", usage: "Go garbage collector heap floor: while the live heap is small, collect no earlier than at MIB MiB of heap (GOGC raised; docs/BENCHMARKS.md section 24). 0 = Go's default pacing; a GOGC environment variable also turns it off", value: num(&c.GCHeapFloorMB)},
		{extra: true, name: "enable-pprof", usage: "Serve Go's net/http/pprof profiles under /debug/pprof/ on the metrics listener (--prometheus-host/--prometheus-port); off by default", value: boo(&c.EnablePprof)},
		{extra: true, name: "prefill-timeout-secs", meta: "SECS", usage: "Deadline for the prefill leg (0 = only the overall deadline)", value: flt(&c.PrefillTimeoutSecs)},
		{extra: true, name: "kv-wait-timeout-secs", meta: "SECS", usage: "PD: deadline for a streaming decode's first byte, i.e. for its KV to arrive (0 = none)", value: flt(&c.KVWaitTimeoutSecs)},
		{extra: true, name: "stream-idle-timeout-secs", meta: "SECS", usage: "Abort a stream idle for this long (0 = none)", value: flt(&c.StreamIdleTimeoutSecs)},
		{extra: true, name: "body-read-timeout-secs", meta: "SECS", usage: "Answer 408 and close the connection when a request body is not received within SECS (0 = none)", value: flt(&c.BodyReadTimeoutSecs)},
		{extra: true, name: "connect-timeout-secs", meta: "SECS", usage: "Upstream TCP connect timeout (0 = none)", value: flt(&c.ConnectTimeoutSecs)},
		{extra: true, name: "decode-output-length", meta: "MODE", usage: "How the decode leg's output length is set", value: enum(&c.DecodeOutputLength, decodeOutputNames)},
		{extra: true, name: "discovery-ttl-secs", meta: "SECS", usage: "Forget a ZMQ-registered worker after this long without a ping", value: flt(&c.DiscoveryTTLSecs)},
		{extra: true, name: "route-receipt", usage: "Add a routing receipt header to responses", value: boo(&c.RouteReceipt)},
		{extra: true, name: "dp-size-annotation", meta: "KEY", usage: "Pod annotation carrying the data-parallel size", value: str(&c.DPSizeAnnotation)},
		{extra: true, name: "load-poll-interval-secs", meta: "SECS", usage: "Poll vLLM /load for power_of_two every SECS (0 = off)", value: flt(&c.LoadPollIntervalSecs)},
		{extra: true, name: "pd-max-failovers", meta: "N", usage: "Times a P/D request may move to another prefill/decode worker", value: num(&c.PDMaxFailovers)},
		{extra: true, name: "max-migrations", meta: "N", usage: "Times an answer whose worker died mid-way may continue on another worker (0 = off)", value: num(&c.MaxMigrations)},
		{extra: true, name: "retry-budget-ratio", meta: "RATIO", usage: "Retries allowed as a fraction of requests", value: flt(&c.RetryBudgetRatio)},
		{extra: true, name: "cb-failure-rate", meta: "RATIO", usage: "Open the circuit when the windowed failure rate reaches this (0 = off)", value: flt(&c.CBFailureRate)},
		{extra: true, name: "cb-min-requests", meta: "N", usage: "Outcomes in the window before the failure rate counts", value: u32(&c.CBMinRequests)},
		{extra: true, name: "cb-half-open-max-requests", meta: "N", usage: "Concurrent probes allowed while half-open", value: u32(&c.CBHalfOpenMaxRequests)},
		{extra: true, name: "max-header-bytes", meta: "BYTES", usage: "Maximum size of inbound request headers", value: num(&c.MaxHeaderBytes)},
		{extra: true, name: "prefill-data-parallel-size", meta: "N", usage: "DP replicas per static --prefill URL (0 = --intra-node-data-parallel-size)", value: num(&c.PrefillDataParallelSize)},
		{extra: true, name: "decode-data-parallel-size", meta: "N", usage: "DP replicas per static --decode URL (0 = --intra-node-data-parallel-size)", value: num(&c.DecodeDataParallelSize)},
		{extra: true, name: "flow-control", usage: "Flow control: priority bands, fair shares between flows, saturation-aware dispatch (replaces the FIFO queue)", value: boo(&c.FlowControl)},
		{extra: true, name: "flow-bands", meta: "NAME=PRIO[:SECS[:ORDER]]", multi: true, min: 1, usage: "Priority bands (higher PRIO first), optional queue timeout and order (default: high=10 default=0 low=-10, timeout --queue-timeout-secs, order --flow-order)", value: list(&c.FlowBands)},
		{extra: true, name: "flow-default-band", meta: "NAME", usage: "Band of requests that name no priority", value: str(&c.FlowDefaultBand)},
		{extra: true, name: "flow-order", meta: "ORDER", usage: "Order within a band (unless the band sets its own)", value: enum(&c.FlowOrder, flowOrderNames)},
		{extra: true, name: "flow-fairness-key", meta: "KEY", usage: "What identifies a flow for fair sharing", value: enum(&c.FlowFairnessKey, flowFairnessNames)},
		{extra: true, name: "flow-objective-header", meta: "HEADER", usage: "Header naming a request's band (or an integer priority)", value: str(&c.FlowObjectiveHeader)},
		{extra: true, name: "flow-fairness-header", meta: "HEADER", usage: "Header carrying the flow id (--flow-fairness-key header)", value: str(&c.FlowFairnessHeader)},
		{extra: true, name: "flow-deadline-header", meta: "HEADER", usage: "Header carrying a request deadline in milliseconds from arrival", value: str(&c.FlowDeadlineHeader)},
		{extra: true, name: "flow-weights", meta: "FLOW=WEIGHT", multi: true, usage: "Fair-share weights of flows (default 1)", value: list(&c.FlowWeights)},
		{extra: true, name: "flow-headroom", meta: "N", usage: "In-flight slots (of --max-concurrent-requests and of the workers' --flow-worker-max-inflight capacity) only the highest band may use", value: num(&c.FlowHeadroom)},
		{extra: true, name: "flow-worker-max-inflight", meta: "N", usage: "Hold requests in the router while every worker has N in flight (0 = no limit)", value: num(&c.FlowWorkerMaxInFlight)},
		{extra: true, name: "flow-max-waiting", meta: "N", usage: "A worker whose vllm:num_requests_waiting reaches N is saturated (0 = not used)", value: flt(&c.FlowMaxWaiting)},
		{extra: true, name: "flow-max-kv-usage", meta: "RATIO", usage: "A worker whose vllm:kv_cache_usage_perc reaches RATIO is saturated (0 = not used)", value: flt(&c.FlowMaxKVUsage)},
		{extra: true, name: "flow-engine-priority", usage: "Carry each request's band to the engine as vLLM's \"priority\" field (minus the band's priority) when the body has none; only for workers run with --scheduling-policy priority (an fcfs vLLM rejects a non-zero priority with 400)", value: boo(&c.FlowEnginePriority)},
		{extra: true, name: "flow-avoid-prefill", usage: "Send a highest-band request to a worker with the fewest requests awaiting their first byte (regular mode)", value: boo(&c.FlowAvoidPrefill)},
		{extra: true, name: "flow-isolate-prefill", usage: "Hold lower-band requests off a worker while a highest-band request there awaits its first byte (regular mode)", value: boo(&c.FlowIsolatePrefill)},
		{extra: true, name: "flow-prefill-reserve", meta: "N", usage: "Keep N workers free of lower-band prefills for the highest band: a lower-band request joins a worker already prefilling unless more than N workers have nothing awaiting a first byte (regular mode; 0 = off)", value: num(&c.FlowPrefillReserve)},
		{extra: true, name: "flow-poll-interval-secs", meta: "SECS", usage: "Poll each worker's /metrics for saturation every SECS", value: flt(&c.FlowPollIntervalSecs)},
		{extra: true, name: "pd-warmup", usage: "PD: send one 1-token request through every new prefill/decode pair so its first-contact KV handshake happens before real traffic (use =false to disable)", value: boo(&c.PDWarmup)},
		{extra: true, name: "health-unhealthy-interval-secs", meta: "SECS", usage: "Re-probe an unhealthy or never-probed worker SECS after a failed probe, doubling up to --health-unhealthy-max-interval-secs (healthy workers keep --health-check-interval-secs)", value: flt(&c.HealthUnhealthyIntervalSecs)},
		{extra: true, name: "health-unhealthy-max-interval-secs", meta: "SECS", usage: "Longest delay between two probes of an unhealthy or never-probed worker (at most --health-check-interval-secs)", value: flt(&c.HealthUnhealthyMaxIntervalSecs)},
		{extra: true, name: "panic-routing", usage: "When every worker of a role is unhealthy or open-circuit, route to the registered ones anyway instead of answering 503 (use =false to disable)", value: boo(&c.PanicRouting)},
		{extra: true, name: "history-max-entries", meta: "N", usage: "--history-backend memory: response ids remembered (oldest forgotten first)", value: num(&c.HistoryMaxEntries)},
		{extra: true, name: "history-ttl-secs", meta: "SECS", usage: "--history-backend memory: forget a response id this long after it was learned", value: flt(&c.HistoryTTLSecs)},
		{extra: true, name: "pd-split-responses", usage: "PD-split /v1/responses (needs vLLM with kv_transfer_params on ResponsesRequest; default: serve it unsplit on a prefill worker)", value: boo(&c.PDSplitResponses)},
	}
}

// canonicalName maps an alias to its flag's name.
func canonicalName(name string) string {
	if name == "runtime" {
		return "backend"
	}
	return name
}

// Options are the process dependencies of ParseWith; zero fields take the
// real process's.
type Options struct {
	Stdout    io.Writer                    // --help/--version output (os.Stdout)
	Version   string                       // printed by --version (module build info, else "dev")
	LookupEnv func(string) (string, bool)  // environment (os.LookupEnv)
	ReadFile  func(string) ([]byte, error) // --config reader (os.ReadFile)
}

func (o Options) withDefaults() Options {
	if o.Stdout == nil {
		o.Stdout = os.Stdout
	}
	if o.Version == "" {
		o.Version = buildVersion()
	}
	if o.LookupEnv == nil {
		o.LookupEnv = os.LookupEnv
	}
	if o.ReadFile == nil {
		o.ReadFile = os.ReadFile
	}
	return o
}

func buildVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// Parse builds the configuration from args (without the program name):
// defaults, then the --config file, then the flags, then the
// API_KEY_VALIDATION_URLS fallback. It does not validate; call Validate.
// --help and --version print to os.Stdout and return ErrHelp / ErrVersion.
func Parse(args []string) (*Config, error) { return ParseWith(args, Options{}) }

// ParseWith is Parse with injectable process dependencies.
func ParseWith(args []string, opts Options) (*Config, error) {
	opts = opts.withDefaults()

	prefill, prefillSet, rest, err := splitPrefill(args)
	if err != nil {
		return nil, err
	}

	cfg := Default()
	fs := flag.NewFlagSet("switchyard", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	defs := map[string]*flagDef{}
	table := flagDefs(cfg)
	for i := range table {
		d := &table[i]
		fs.Var(d.value, d.name, d.usage)
		defs[d.name] = d
		if d.alias != "" {
			fs.Var(d.value, d.alias, d.usage)
			defs[d.alias] = d
		}
	}

	occs, err := tokenize(rest, defs)
	switch {
	case errors.Is(err, ErrHelp):
		WriteUsage(opts.Stdout, opts.Version)
		return nil, ErrHelp
	case errors.Is(err, ErrVersion):
		fmt.Fprintf(opts.Stdout, "switchyard %s\n", opts.Version)
		return nil, ErrVersion
	case err != nil:
		return nil, err
	}

	// The file comes first so that flags override it.
	for i := len(occs) - 1; i >= 0; i-- {
		if occs[i].def.name != "config" {
			continue
		}
		path := occs[i].values[0]
		if path == "" {
			return nil, invalid("--config", `""`, "Must be a file path")
		}
		if err := cfg.loadFile(path, opts.ReadFile); err != nil {
			return nil, err
		}
		break
	}

	for _, oc := range occs {
		d := oc.def
		cfg.markExplicit(d.name)
		if len(oc.values) == 0 { // multi-value flag given without values
			d.value.(*listValue).reset()
			continue
		}
		for _, v := range oc.values {
			if err := fs.Set(d.name, v); err != nil {
				return nil, invalid(oc.spelled, quoteIfEmpty(v), err.Error())
			}
		}
	}

	if prefillSet {
		cfg.Prefill = prefill
		cfg.markExplicit("prefill")
	}

	// REFERENCE §1.5: env fallback when no validation URL was given.
	if len(cfg.APIKeyValidationURLs) == 0 {
		if raw, ok := opts.LookupEnv("API_KEY_VALIDATION_URLS"); ok {
			var urls []string
			for _, u := range strings.Split(raw, ",") {
				if u = strings.TrimSpace(u); u != "" {
					urls = append(urls, u)
				}
			}
			if len(urls) > 0 {
				cfg.APIKeyValidationURLs = urls
				cfg.markExplicit("api-key-validation-urls")
			}
		}
	}
	return cfg, nil
}

func quoteIfEmpty(s string) string {
	if s == "" {
		return `""`
	}
	return s
}

// splitPrefill is the Rust split_prefill_args_from_others (REFERENCE §1.2):
// each exact `--prefill` takes the next token as URL; the token after it is
// the bootstrap port if it parses as u16 and does not start with '-', is
// dropped if it is "none" (any case), and is otherwise left for the flag
// parser. Improvement: `--prefill=URL` is accepted too, with the same
// optional port after it.
func splitPrefill(args []string) (prefill []PrefillWorker, seen bool, rest []string, err error) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		var url string
		switch {
		case a == "--prefill":
			if i+1 >= len(args) {
				return nil, false, nil, usage("--prefill", "--prefill requires a URL immediately after")
			}
			i++
			url = args[i]
		case strings.HasPrefix(a, "--prefill="):
			url = strings.TrimPrefix(a, "--prefill=")
			if url == "" {
				return nil, false, nil, usage("--prefill", "--prefill requires a URL immediately after")
			}
		default:
			rest = append(rest, a)
			continue
		}
		if strings.HasPrefix(url, "-") {
			return nil, false, nil, usage("--prefill", "Invalid url "+url)
		}
		pw := PrefillWorker{URL: url}
		if i+1 < len(args) {
			next := args[i+1]
			if strings.EqualFold(next, "none") {
				i++
			} else if !strings.HasPrefix(next, "-") {
				if p, ok := parseU16(next); ok {
					i++
					pw.BootstrapPort = &p
				}
			}
		}
		prefill = append(prefill, pw)
		seen = true
	}
	return prefill, seen, rest, nil
}

// parseU16 accepts what Rust's u16::from_str accepts (an optional '+').
func parseU16(s string) (int, bool) {
	n, err := strconv.ParseUint(strings.TrimPrefix(s, "+"), 10, 16)
	if err != nil || s == "+" || strings.HasPrefix(s, "++") || strings.HasPrefix(s, "+-") {
		return 0, false
	}
	return int(n), true
}

type occurrence struct {
	def     *flagDef
	spelled string // as written, e.g. "--runtime"
	values  []string
}

// isFlagToken reports whether a token ends a multi-value run: anything
// that looks like a flag, as in clap ("-" alone is a value).
func isFlagToken(s string) bool { return len(s) > 1 && s[0] == '-' }

// tokenize turns argv (after splitPrefill) into flag occurrences, accepting
// `--x v` and `--x=v`; multi-value flags consume following tokens until the
// next flag-looking token. It stops at --help/-h and --version/-V.
func tokenize(args []string, defs map[string]*flagDef) ([]occurrence, error) {
	var out []occurrence
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case a == "--":
			if i+1 < len(args) {
				return nil, unexpected(args[i+1])
			}
			return out, nil
		case a == "--help" || a == "-h":
			return out, ErrHelp
		case a == "--version" || a == "-V":
			return out, ErrVersion
		case strings.HasPrefix(a, "--"):
			name, val, hasVal := strings.Cut(a[2:], "=")
			d := defs[name]
			if d == nil {
				if name == "help" || name == "version" {
					return nil, usage("--"+name, "unexpected value '"+val+"' for --"+name)
				}
				return nil, usage("--"+name, "unknown flag: --"+name)
			}
			oc := occurrence{def: d, spelled: "--" + name}
			switch {
			case hasVal:
				oc.values = []string{val}
			case d.multi:
				for i+1 < len(args) && !isFlagToken(args[i+1]) {
					i++
					oc.values = append(oc.values, args[i])
				}
			case d.isBool():
				oc.values = []string{"true"}
			case i+1 < len(args) && !strings.HasPrefix(args[i+1], "--"):
				i++
				oc.values = []string{args[i]}
			}
			if len(oc.values) < d.min || (!d.multi && len(oc.values) == 0) {
				return nil, usage(oc.spelled, "a value is required for "+oc.spelled+" but none was supplied")
			}
			out = append(out, oc)
		case isFlagToken(a):
			return nil, usage(a, "unknown flag: "+a)
		default:
			return nil, unexpected(a)
		}
	}
	return out, nil
}

func unexpected(a string) *Error {
	return &Error{Kind: KindUsage, Value: a, Reason: "unexpected argument '" + a + "' found"}
}

// WriteUsage prints the --help text.
func WriteUsage(w io.Writer, version string) {
	var b strings.Builder
	fmt.Fprintf(&b, "switchyard %s - router for vLLM prefill/decode disaggregated serving\n", version)
	b.WriteString(`(command-line compatible with vllm-router)

Usage: switchyard [OPTIONS]

Examples:
  # Regular mode
  switchyard --worker-urls http://worker1:8000 http://worker2:8000

  # vLLM PD mode with static workers
  switchyard --vllm-pd-disaggregation \
    --prefill http://prefill1:8000 none --decode http://decode1:8000

  # vLLM PD mode with ZMQ self-registration
  switchyard --vllm-pd-disaggregation \
    --vllm-discovery-address 0.0.0.0:30001 --policy consistent_hash

Options:
  --prefill URL [PORT|none]
      Prefill server URL and optional bootstrap port (repeatable; --prefill=URL also accepted)
`)
	defaults := flagDefs(Default())
	section := false
	for i := range defaults {
		d := &defaults[i]
		if d.extra && !section {
			b.WriteString("\nSwitchyard options:\n")
			section = true
		}
		b.WriteString("  --" + d.name)
		if d.meta != "" {
			b.WriteString(" <" + d.meta + ">")
			if d.multi {
				b.WriteString("...")
			}
		}
		if d.alias != "" {
			b.WriteString("  (alias --" + d.alias + ")")
		}
		b.WriteString("\n      " + d.usage)
		if ev, ok := d.value.(enumValue); ok {
			b.WriteString(" [possible values: " + strings.Join(ev.allowed, ", ") + "]")
		}
		if def := d.value.String(); def != "" && !d.multi && (!d.isBool() || def == "true") {
			b.WriteString(" [default: " + def + "]")
		}
		b.WriteString("\n")
	}
	b.WriteString(`  -h, --help
      Print help
  -V, --version
      Print version
`)
	_, _ = io.WriteString(w, b.String())
}
