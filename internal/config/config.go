package config

import (
	"cmp"
	"math"
	"strings"
	"time"
)

// Policy names accepted by --policy, --prefill-policy and --decode-policy.
const (
	PolicyRandom         = "random"
	PolicyRoundRobin     = "round_robin"
	PolicyCacheAware     = "cache_aware"
	PolicyPowerOfTwo     = "power_of_two"
	PolicyKVAware        = "kv_aware"
	PolicyConsistentHash = "consistent_hash"
	PolicyRendezvousHash = "rendezvous_hash"
)

// KV connectors accepted by --kv-connector.
const (
	KVConnectorNIXL     = "nixl"
	KVConnectorMooncake = "mooncake"
	KVConnectorMoRIIO   = "moriio"
	KVConnectorP2PNCCL  = "p2pnccl" // Switchyard addition
)

// Backends accepted by --backend (alias --runtime).
const (
	BackendVLLM      = "vllm"
	BackendTRTLLM    = "trtllm"
	BackendOpenAI    = "openai"
	BackendAnthropic = "anthropic"
)

// Values of --log-format and --decode-output-length.
const (
	LogFormatText = "text"
	LogFormatJSON = "json"

	DecodeOutputExact    = "exact"
	DecodeOutputToyProxy = "toy-proxy"

	HTTPServerBuiltin = "builtin"  // internal/h1server
	HTTPServerNetHTTP = "net/http" // the standard library's
)

var (
	policyNames      = []string{PolicyRandom, PolicyRoundRobin, PolicyCacheAware, PolicyPowerOfTwo, PolicyConsistentHash, PolicyRendezvousHash, PolicyKVAware}
	kvConnectorNames = []string{KVConnectorNIXL, KVConnectorMooncake, KVConnectorMoRIIO, KVConnectorP2PNCCL}
	backendNames     = []string{BackendVLLM, BackendTRTLLM, BackendOpenAI, BackendAnthropic}
	// The Rust binary's levels plus the Python launcher's "warning" and
	// "critical" (REFERENCE §1.6), so either command line starts switchyard.
	logLevelNames       = []string{"debug", "info", "warn", "error", "warning", "critical"}
	logFormatNames      = []string{LogFormatText, LogFormatJSON}
	historyBackendNames = []string{"memory", "none"}
	decodeOutputNames   = []string{DecodeOutputExact, DecodeOutputToyProxy}
	httpServerNames     = []string{HTTPServerBuiltin, HTTPServerNetHTTP}
	flowOrderNames      = []string{FlowOrderArrival, FlowOrderDeadline}
	flowFairnessNames   = []string{"header", "api-key", "user"}
)

// Flow-control queue orders within a band.
const (
	FlowOrderArrival  = "arrival"
	FlowOrderDeadline = "deadline"
)

// DefaultRequestIDHeaders is the inbound request-id header search order used
// when --request-id-headers is empty (REFERENCE §6.9).
func DefaultRequestIDHeaders() []string {
	return []string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"}
}

// DefaultOtelExcludedPaths are the paths without a server span when
// --otel-excluded-paths is empty (REFERENCE §1.1).
func DefaultOtelExcludedPaths() []string {
	return []string{"/health", "/health_generate", "/liveness", "/readiness"}
}

// PrefillWorker is one --prefill URL [PORT|none] entry.
type PrefillWorker struct {
	URL string `json:"url"`
	// BootstrapPort is the Mooncake bootstrap port; nil means "none".
	BootstrapPort *int `json:"bootstrap_port"`
}

// Mode is the routing mode derived from the flags (REFERENCE §1.3).
type Mode string

// Routing modes, named as the Rust RouterConfig's mode.type.
const (
	ModeRegular Mode = "regular"
	ModeOpenAI  Mode = "openai"
	ModeVLLMPD  Mode = "vllm_prefill_decode"
	// ModeIGW is derived from --enable-igw: several models, one fleet each.
	ModeIGW Mode = "igw"
)

// Config holds every setting of the vllm-router command line plus the
// Switchyard extras. JSON/YAML keys are the flag names with '-' → '_'.
// The zero value is not useful: start from Default or Parse.
//
// Field types mirror the Rust types (u16 → uint16, u32 → uint32, u64 →
// uint64, usize → int, f32/f64 → float64); "" stands for an absent optional
// string. Switchyard-only timeouts are float64 seconds so tests and operators
// can use sub-second values.
type Config struct {
	Host                           string          `json:"host"`
	Port                           uint16          `json:"port"`
	WorkerURLs                     []string        `json:"worker_urls"`
	Policy                         string          `json:"policy"`
	VLLMPDDisaggregation           bool            `json:"vllm_pd_disaggregation"`
	VLLMDiscoveryAddress           string          `json:"vllm_discovery_address"`
	Prefill                        []PrefillWorker `json:"prefill"`
	Decode                         []string        `json:"decode"`
	PrefillPolicy                  string          `json:"prefill_policy"`
	DecodePolicy                   string          `json:"decode_policy"`
	WorkerStartupTimeoutSecs       uint64          `json:"worker_startup_timeout_secs"`
	WorkerStartupCheckIntervalSecs uint64          `json:"worker_startup_check_interval"`
	CacheThreshold                 float64         `json:"cache_threshold"`
	BalanceAbsThreshold            int             `json:"balance_abs_threshold"`
	BalanceRelThreshold            float64         `json:"balance_rel_threshold"`
	EvictionIntervalSecs           uint64          `json:"eviction_interval"`
	MaxTreeSize                    int             `json:"max_tree_size"`
	MaxPayloadSize                 int             `json:"max_payload_size"`
	IntraNodeDataParallelSize      int             `json:"intra_node_data_parallel_size"`
	APIKey                         string          `json:"api_key"`
	APIKeyValidationURLs           []string        `json:"api_key_validation_urls"`
	Backend                        string          `json:"backend"`
	LogDir                         string          `json:"log_dir"`
	LogLevel                       string          `json:"log_level"`
	EnableTrace                    bool            `json:"enable_trace"`
	OTLPTracesEndpoint             string          `json:"otlp_traces_endpoint"`
	OtelSamplingRatio              float64         `json:"otel_sampling_ratio"`
	OtelExcludedPaths              []string        `json:"otel_excluded_paths"`
	ServiceDiscovery               bool            `json:"service_discovery"`
	Selector                       []string        `json:"selector"`
	ServiceDiscoveryPort           uint16          `json:"service_discovery_port"`
	ServiceDiscoveryNamespace      string          `json:"service_discovery_namespace"`
	PrefillSelector                []string        `json:"prefill_selector"`
	DecodeSelector                 []string        `json:"decode_selector"`
	PrometheusPort                 uint16          `json:"prometheus_port"`
	PrometheusHost                 string          `json:"prometheus_host"`
	RequestIDHeaders               []string        `json:"request_id_headers"`
	RequestTimeoutSecs             uint64          `json:"request_timeout_secs"`
	MaxConcurrentRequests          int             `json:"max_concurrent_requests"`
	CORSAllowedOrigins             []string        `json:"cors_allowed_origins"`
	RetryMaxRetries                uint32          `json:"retry_max_retries"`
	RetryInitialBackoffMS          uint64          `json:"retry_initial_backoff_ms"`
	RetryMaxBackoffMS              uint64          `json:"retry_max_backoff_ms"`
	RetryBackoffMultiplier         float64         `json:"retry_backoff_multiplier"`
	RetryJitterFactor              float64         `json:"retry_jitter_factor"`
	DisableRetries                 bool            `json:"disable_retries"`
	CBFailureThreshold             uint32          `json:"cb_failure_threshold"`
	CBSuccessThreshold             uint32          `json:"cb_success_threshold"`
	CBTimeoutDurationSecs          uint64          `json:"cb_timeout_duration_secs"`
	CBWindowDurationSecs           uint64          `json:"cb_window_duration_secs"`
	DisableCircuitBreaker          bool            `json:"disable_circuit_breaker"`
	HealthFailureThreshold         uint32          `json:"health_failure_threshold"`
	HealthSuccessThreshold         uint32          `json:"health_success_threshold"`
	HealthCheckTimeoutSecs         uint64          `json:"health_check_timeout_secs"`
	HealthCheckIntervalSecs        uint64          `json:"health_check_interval_secs"`
	HealthCheckEndpoint            string          `json:"health_check_endpoint"`
	EnableIGW                      bool            `json:"enable_igw"`
	HistoryBackend                 string          `json:"history_backend"`
	Profile                        bool            `json:"profile"`
	KVConnector                    string          `json:"kv_connector"`

	// Switchyard extras.
	QueueSize                  int      `json:"queue_size"`
	QueueTimeoutSecs           uint64   `json:"queue_timeout_secs"`
	RateLimitTokensPerSecond   float64  `json:"rate_limit_tokens_per_second"` // 0 = off
	RouterAPIKeys              []string `json:"router_api_keys"`
	AdminAPIKey                string   `json:"admin_api_key"`
	ForwardClientAuthorization bool     `json:"forward_client_authorization"`
	ShutdownTimeoutSecs        float64  `json:"shutdown_timeout_secs"`
	LogFormat                  string   `json:"log_format"`
	EnablePprof                bool     `json:"enable_pprof"`             // /debug/pprof/ on the metrics listener
	HTTPServer                 string   `json:"http_server"`              // the client listener's HTTP/1.1 server
	GCHeapFloorMB              int      `json:"gc_heap_floor_mb"`         // Go GC heap floor (0 = Go's default pacing)
	PrefillTimeoutSecs         float64  `json:"prefill_timeout_secs"`     // 0 = only the overall deadline
	KVWaitTimeoutSecs          float64  `json:"kv_wait_timeout_secs"`     // 0 = none (default 300)
	StreamIdleTimeoutSecs      float64  `json:"stream_idle_timeout_secs"` // 0 = none (default 300)
	ConnectTimeoutSecs         float64  `json:"connect_timeout_secs"`     // 0 = no dial timeout
	BodyReadTimeoutSecs        float64  `json:"body_read_timeout_secs"`   // 0 = none (default 60)
	DecodeOutputLength         string   `json:"decode_output_length"`
	DiscoveryTTLSecs           float64  `json:"discovery_ttl_secs"`
	RouteReceipt               bool     `json:"route_receipt"`
	DPSizeAnnotation           string   `json:"dp_size_annotation"`
	LoadPollIntervalSecs       float64  `json:"load_poll_interval_secs"` // 0 = off
	PDMaxFailovers             int      `json:"pd_max_failovers"`
	MaxMigrations              int      `json:"max_migrations"` // mid-stream continuations per request (0 = off)
	HistoryMaxEntries          int      `json:"history_max_entries"`
	HistoryTTLSecs             float64  `json:"history_ttl_secs"`
	RetryBudgetRatio           float64  `json:"retry_budget_ratio"`
	CBFailureRate              float64  `json:"cb_failure_rate"` // 0 = rate rule off
	CBMinRequests              uint32   `json:"cb_min_requests"`
	CBHalfOpenMaxRequests      uint32   `json:"cb_half_open_max_requests"`
	MaxHeaderBytes             int      `json:"max_header_bytes"`
	PrefillDataParallelSize    int      `json:"prefill_data_parallel_size"` // 0 = --intra-node-data-parallel-size
	DecodeDataParallelSize     int      `json:"decode_data_parallel_size"`  // 0 = --intra-node-data-parallel-size
	PDSplitResponses           bool     `json:"pd_split_responses"`
	PDWarmup                   bool     `json:"pd_warmup"`
	// fast recovery (docs/RELIABILITY.md)
	HealthUnhealthyIntervalSecs    float64 `json:"health_unhealthy_interval_secs"`
	HealthUnhealthyMaxIntervalSecs float64 `json:"health_unhealthy_max_interval_secs"`
	PanicRouting                   bool    `json:"panic_routing"`

	// kv_aware (kvaware.go)
	KVBlockSize              int      `json:"kv_block_size"`
	KVHashSeed               uint64   `json:"kv_hash_seed"`
	KVSpeculativeIndexing    bool     `json:"kv_speculative_indexing"`
	KVSpeculativeTTLMS       uint64   `json:"kv_speculative_ttl_ms"`
	KVIndexMaxEntries        int      `json:"kv_index_max_entries"`
	KVEventsPort             uint16   `json:"kv_events_port"`
	KVEventsReplayPort       uint16   `json:"kv_events_replay_port"`
	KVEventsTopic            string   `json:"kv_events_topic"`
	KVEventsEndpoints        []string `json:"kv_events_endpoints"`
	KVOverlapScoreWeight     float64  `json:"kv_overlap_score_weight"`
	KVLoadWeight             float64  `json:"kv_load_weight"`
	KVTieBand                float64  `json:"kv_tie_band"`
	KVFallbackPolicy         string   `json:"kv_fallback_policy"`
	TokenizerPath            string   `json:"tokenizer_path"`
	ChatTemplate             string   `json:"chat_template"`
	PDUncachedTokenThreshold int      `json:"pd_uncached_token_threshold"`

	// Flow control (off unless FlowControl).
	FlowControl           bool     `json:"flow_control"`
	FlowBands             []string `json:"flow_bands"` // NAME=PRIORITY[:QUEUE_TIMEOUT_SECS]
	FlowDefaultBand       string   `json:"flow_default_band"`
	FlowOrder             string   `json:"flow_order"`
	FlowFairnessKey       string   `json:"flow_fairness_key"`
	FlowObjectiveHeader   string   `json:"flow_objective_header"`
	FlowFairnessHeader    string   `json:"flow_fairness_header"`
	FlowDeadlineHeader    string   `json:"flow_deadline_header"`
	FlowWeights           []string `json:"flow_weights"`             // FLOW=WEIGHT
	FlowHeadroom          int      `json:"flow_headroom"`            // slots only the highest band may use
	FlowWorkerMaxInFlight int      `json:"flow_worker_max_inflight"` // 0 = no per-worker limit
	FlowMaxWaiting        float64  `json:"flow_max_waiting"`         // 0 = not used
	FlowMaxKVUsage        float64  `json:"flow_max_kv_usage"`        // 0 = not used
	FlowPollIntervalSecs  float64  `json:"flow_poll_interval_secs"`
	FlowEnginePriority    bool     `json:"flow_engine_priority"` // add vLLM's "priority" from the band
	FlowAvoidPrefill      bool     `json:"flow_avoid_prefill"`   // highest band: fewest requests awaiting a first byte
	FlowIsolatePrefill    bool     `json:"flow_isolate_prefill"` // lower bands held off a worker with a highest-band prefill
	FlowPrefillReserve    int      `json:"flow_prefill_reserve"` // workers kept free of lower-band prefills

	// Models are the config file's per-model sections (--enable-igw);
	// no flag sets them.
	Models map[string]ModelConfig `json:"models"`

	// ConfigFile is --config; it cannot be set from inside a config file.
	ConfigFile string `json:"-"`

	// explicit holds the flag names (no dashes, canonical spelling) set on
	// the command line, in the config file, or (api-key-validation-urls)
	// by the environment fallback.
	explicit map[string]bool
}

// Default returns the configuration with every default of REFERENCE §1.1
// and the Switchyard extras.
func Default() *Config {
	return &Config{
		Host:                           "127.0.0.1",
		Port:                           30000,
		Policy:                         PolicyCacheAware,
		WorkerStartupTimeoutSecs:       600,
		WorkerStartupCheckIntervalSecs: 30,
		CacheThreshold:                 0.3,
		BalanceAbsThreshold:            64,
		BalanceRelThreshold:            1.5,
		EvictionIntervalSecs:           120,
		MaxTreeSize:                    1 << 26,
		MaxPayloadSize:                 512 << 20,
		IntraNodeDataParallelSize:      1,
		Backend:                        BackendVLLM,
		LogLevel:                       "info",
		OtelSamplingRatio:              1.0,
		ServiceDiscoveryPort:           80,
		PrometheusPort:                 29000,
		PrometheusHost:                 "127.0.0.1",
		RequestTimeoutSecs:             1800,
		MaxConcurrentRequests:          32768,
		RetryMaxRetries:                5,
		RetryInitialBackoffMS:          50,
		RetryMaxBackoffMS:              30000,
		RetryBackoffMultiplier:         1.5,
		RetryJitterFactor:              0.2,
		CBFailureThreshold:             10,
		CBSuccessThreshold:             3,
		CBTimeoutDurationSecs:          60,
		CBWindowDurationSecs:           120,
		HealthFailureThreshold:         3,
		HealthSuccessThreshold:         2,
		HealthCheckTimeoutSecs:         5,
		HealthCheckIntervalSecs:        60,
		HealthCheckEndpoint:            "/health",
		HistoryBackend:                 "memory",
		KVConnector:                    KVConnectorNIXL,

		QueueSize:                  100,
		QueueTimeoutSecs:           60,
		ForwardClientAuthorization: true,
		PDWarmup:                   true,
		ShutdownTimeoutSecs:        30,
		LogFormat:                  LogFormatText,
		HTTPServer:                 HTTPServerBuiltin,
		GCHeapFloorMB:              16,
		ConnectTimeoutSecs:         3,
		KVWaitTimeoutSecs:          300,
		StreamIdleTimeoutSecs:      300,
		BodyReadTimeoutSecs:        60,
		DecodeOutputLength:         DecodeOutputExact,
		DiscoveryTTLSecs:           9,
		DPSizeAnnotation:           "vllm.ai/dp-size",
		PDMaxFailovers:             2,
		MaxMigrations:              2,
		HistoryMaxEntries:          100000,
		HistoryTTLSecs:             86400,
		RetryBudgetRatio:           0.2,
		CBFailureRate:              0.5,
		CBMinRequests:              20,
		CBHalfOpenMaxRequests:      1,
		MaxHeaderBytes:             1 << 20,

		KVBlockSize:           16,
		KVSpeculativeIndexing: true,
		KVSpeculativeTTLMS:    2000,
		KVIndexMaxEntries:     10_000_000,
		KVEventsPort:          5557,
		KVOverlapScoreWeight:  1,
		KVLoadWeight:          0.02,
		KVTieBand:             0.1, // kvaware.DefaultTieBand
		KVFallbackPolicy:      PolicyCacheAware,

		HealthUnhealthyIntervalSecs:    0.5,
		HealthUnhealthyMaxIntervalSecs: 1,
		PanicRouting:                   true,
		FlowBands:                      []string{"high=10", "default=0", "low=-10"},
		FlowDefaultBand:                "default",
		FlowOrder:                      FlowOrderArrival,
		FlowFairnessKey:                "header",
		FlowObjectiveHeader:            "x-gateway-inference-objective",
		FlowFairnessHeader:             "x-gateway-inference-fairness-id",
		FlowDeadlineHeader:             "x-envoy-expected-rq-timeout-ms",
		FlowMaxWaiting:                 5,
		FlowMaxKVUsage:                 0.8,
		FlowPollIntervalSecs:           0.25,
	}
}

// Mode derives the routing mode with the Rust priority (REFERENCE §1.3):
// --enable-igw, then --backend openai, then --vllm-pd-disaggregation, else
// regular.
func (c *Config) Mode() Mode {
	switch {
	case c.EnableIGW:
		return ModeIGW
	case c.Backend == BackendOpenAI:
		return ModeOpenAI
	case c.VLLMPDDisaggregation:
		return ModeVLLMPD
	default:
		return ModeRegular
	}
}

// HasServiceDiscovery is the Rust validator's "has service discovery":
// Kubernetes discovery on, or P/D mode with a ZMQ discovery address.
func (c *Config) HasServiceDiscovery() bool {
	return c.ServiceDiscovery || c.hasVLLMDiscovery()
}

func (c *Config) hasVLLMDiscovery() bool {
	return c.Mode() == ModeVLLMPD && c.VLLMDiscoveryAddress != ""
}

// IsSet reports whether the flag (with or without leading dashes, either
// spelling of an alias) was set on the command line or in the config file.
// API_KEY_VALIDATION_URLS from the environment counts as setting
// --api-key-validation-urls.
func (c *Config) IsSet(flagName string) bool {
	return c.explicit[canonicalName(strings.TrimLeft(flagName, "-"))]
}

// Explicit returns a copy of the set of flag names (no dashes) that were set
// explicitly; see IsSet.
func (c *Config) Explicit() map[string]bool {
	out := make(map[string]bool, len(c.explicit))
	for k, v := range c.explicit {
		if v {
			out[k] = true
		}
	}
	return out
}

func (c *Config) markExplicit(name string) {
	if c.explicit == nil {
		c.explicit = make(map[string]bool)
	}
	c.explicit[canonicalName(name)] = true
}

// RetryConfig is the effective retry configuration.
type RetryConfig struct {
	MaxAttempts       int // total attempts including the first (Rust max_retries)
	InitialBackoff    time.Duration
	MaxBackoff        time.Duration
	BackoffMultiplier float64
	JitterFactor      float64
	BudgetRatio       float64
}

// EffectiveRetry applies --disable-retries (one attempt) as the Rust
// effective_retry_config does.
func (c *Config) EffectiveRetry() RetryConfig {
	r := RetryConfig{
		MaxAttempts:       int(c.RetryMaxRetries),
		InitialBackoff:    time.Duration(c.RetryInitialBackoffMS) * time.Millisecond,
		MaxBackoff:        time.Duration(c.RetryMaxBackoffMS) * time.Millisecond,
		BackoffMultiplier: c.RetryBackoffMultiplier,
		JitterFactor:      c.RetryJitterFactor,
		BudgetRatio:       c.RetryBudgetRatio,
	}
	if c.DisableRetries {
		r.MaxAttempts = 1
	}
	return r
}

// CircuitBreakerConfig is the effective per-worker breaker configuration.
type CircuitBreakerConfig struct {
	Disabled         bool
	FailureThreshold int // consecutive failures that open the circuit
	SuccessThreshold int // consecutive half-open successes that close it
	OpenDuration     time.Duration
	Window           time.Duration
	FailureRate      float64 // 0 = rate rule off
	MinRequests      int
	HalfOpenMax      int
}

// EffectiveCircuitBreaker applies --disable-circuit-breaker: the threshold
// becomes math.MaxUint32 (as in Rust) and Disabled is set so the breaker can
// also skip its failure-rate rule.
func (c *Config) EffectiveCircuitBreaker() CircuitBreakerConfig {
	cb := CircuitBreakerConfig{
		FailureThreshold: int(c.CBFailureThreshold),
		SuccessThreshold: int(c.CBSuccessThreshold),
		OpenDuration:     secondsU(c.CBTimeoutDurationSecs),
		Window:           secondsU(c.CBWindowDurationSecs),
		FailureRate:      c.CBFailureRate,
		MinRequests:      int(c.CBMinRequests),
		HalfOpenMax:      int(c.CBHalfOpenMaxRequests),
	}
	if c.DisableCircuitBreaker {
		cb.Disabled = true
		cb.FailureThreshold = math.MaxUint32
		cb.FailureRate = 0
	}
	return cb
}

// PrefillDPSize is the data-parallel size of each static --prefill URL:
// --prefill-data-parallel-size, else --intra-node-data-parallel-size
// (never below 1).
func (c *Config) PrefillDPSize() int {
	return max(cmp.Or(c.PrefillDataParallelSize, c.IntraNodeDataParallelSize), 1)
}

// DecodeDPSize is the data-parallel size of each static --decode URL:
// --decode-data-parallel-size, else --intra-node-data-parallel-size (never
// below 1).
func (c *Config) DecodeDPSize() int {
	return max(cmp.Or(c.DecodeDataParallelSize, c.IntraNodeDataParallelSize), 1)
}

// EffectivePrefillPolicy is --prefill-policy, falling back to --policy.
func (c *Config) EffectivePrefillPolicy() string {
	if c.PrefillPolicy != "" {
		return c.PrefillPolicy
	}
	return c.Policy
}

// EffectiveDecodePolicy is --decode-policy, falling back to --policy.
func (c *Config) EffectiveDecodePolicy() string {
	if c.DecodePolicy != "" {
		return c.DecodePolicy
	}
	return c.Policy
}

// EffectiveRequestIDHeaders is --request-id-headers or the default list.
func (c *Config) EffectiveRequestIDHeaders() []string {
	if len(c.RequestIDHeaders) == 0 {
		return DefaultRequestIDHeaders()
	}
	return append([]string(nil), c.RequestIDHeaders...)
}

// EffectiveOtelExcludedPaths is --otel-excluded-paths or the default list.
func (c *Config) EffectiveOtelExcludedPaths() []string {
	if len(c.OtelExcludedPaths) == 0 {
		return DefaultOtelExcludedPaths()
	}
	return append([]string(nil), c.OtelExcludedPaths...)
}

// ParseSelector turns "k=v" items into a map; the first '=' splits. Items
// without '=' are dropped, as in Rust (Validate reports them).
func ParseSelector(items []string) map[string]string {
	m := make(map[string]string, len(items))
	for _, it := range items {
		if k, v, ok := strings.Cut(it, "="); ok {
			m[k] = v
		}
	}
	return m
}

// SelectorMap is --selector as a label map.
func (c *Config) SelectorMap() map[string]string { return ParseSelector(c.Selector) }

// PrefillSelectorMap is --prefill-selector as a label map.
func (c *Config) PrefillSelectorMap() map[string]string { return ParseSelector(c.PrefillSelector) }

// DecodeSelectorMap is --decode-selector as a label map.
func (c *Config) DecodeSelectorMap() map[string]string { return ParseSelector(c.DecodeSelector) }

// RequestTimeout is --request-timeout-secs.
func (c *Config) RequestTimeout() time.Duration { return secondsU(c.RequestTimeoutSecs) }

// WorkerStartupTimeout is --worker-startup-timeout-secs.
func (c *Config) WorkerStartupTimeout() time.Duration { return secondsU(c.WorkerStartupTimeoutSecs) }

// WorkerStartupCheckInterval is --worker-startup-check-interval.
func (c *Config) WorkerStartupCheckInterval() time.Duration {
	return secondsU(c.WorkerStartupCheckIntervalSecs)
}

// EvictionInterval is --eviction-interval.
func (c *Config) EvictionInterval() time.Duration { return secondsU(c.EvictionIntervalSecs) }

// HealthCheckTimeout is --health-check-timeout-secs.
func (c *Config) HealthCheckTimeout() time.Duration { return secondsU(c.HealthCheckTimeoutSecs) }

// HealthCheckInterval is --health-check-interval-secs.
func (c *Config) HealthCheckInterval() time.Duration { return secondsU(c.HealthCheckIntervalSecs) }

// HealthUnhealthyInterval is --health-unhealthy-interval-secs.
func (c *Config) HealthUnhealthyInterval() time.Duration {
	return secondsF(c.HealthUnhealthyIntervalSecs)
}

// HealthUnhealthyMaxInterval is --health-unhealthy-max-interval-secs.
func (c *Config) HealthUnhealthyMaxInterval() time.Duration {
	return secondsF(c.HealthUnhealthyMaxIntervalSecs)
}

// QueueTimeout is --queue-timeout-secs.
func (c *Config) QueueTimeout() time.Duration { return secondsU(c.QueueTimeoutSecs) }

// ShutdownTimeout is --shutdown-timeout-secs.
func (c *Config) ShutdownTimeout() time.Duration { return secondsF(c.ShutdownTimeoutSecs) }

// PrefillTimeout is --prefill-timeout-secs (0 = only the overall deadline).
func (c *Config) PrefillTimeout() time.Duration { return secondsF(c.PrefillTimeoutSecs) }

// KVWaitTimeout is --kv-wait-timeout-secs (0 = none; default 300 s).
func (c *Config) KVWaitTimeout() time.Duration { return secondsF(c.KVWaitTimeoutSecs) }

// StreamIdleTimeout is --stream-idle-timeout-secs (0 = none; default 300 s).
func (c *Config) StreamIdleTimeout() time.Duration { return secondsF(c.StreamIdleTimeoutSecs) }

// BodyReadTimeout is --body-read-timeout-secs: the deadline for receiving a
// whole request body the router reads (0 = none; default 60 s).
func (c *Config) BodyReadTimeout() time.Duration { return secondsF(c.BodyReadTimeoutSecs) }

// ConnectTimeout is --connect-timeout-secs (0 = no dial timeout).
func (c *Config) ConnectTimeout() time.Duration { return secondsF(c.ConnectTimeoutSecs) }

// DiscoveryTTL is --discovery-ttl-secs.
func (c *Config) DiscoveryTTL() time.Duration { return secondsF(c.DiscoveryTTLSecs) }

// HistoryTTL is --history-ttl-secs.
func (c *Config) HistoryTTL() time.Duration { return secondsF(c.HistoryTTLSecs) }

// FlowPollInterval is --flow-poll-interval-secs.
func (c *Config) FlowPollInterval() time.Duration { return secondsF(c.FlowPollIntervalSecs) }

// LoadPollInterval is --load-poll-interval-secs (0 = off).
func (c *Config) LoadPollInterval() time.Duration { return secondsF(c.LoadPollIntervalSecs) }

// secondsU converts whole seconds, saturating instead of overflowing.
func secondsU(s uint64) time.Duration {
	if s > uint64(math.MaxInt64/int64(time.Second)) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(s) * time.Second
}

// secondsF converts fractional seconds; negative or NaN → 0, saturating.
func secondsF(s float64) time.Duration {
	if !(s > 0) {
		return 0
	}
	d := s * float64(time.Second)
	if d >= math.MaxInt64 {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(d)
}

// Redacted returns a copy with secrets replaced by "REDACTED", for logging
// the effective configuration.
func (c *Config) Redacted() *Config {
	cp := *c
	const r = "REDACTED"
	if cp.APIKey != "" {
		cp.APIKey = r
	}
	if cp.AdminAPIKey != "" {
		cp.AdminAPIKey = r
	}
	if len(cp.RouterAPIKeys) > 0 {
		keys := make([]string, len(cp.RouterAPIKeys))
		for i := range keys {
			keys[i] = r
		}
		cp.RouterAPIKeys = keys
	}
	cp.explicit = c.Explicit()
	return &cp
}

// Warnings returns non-fatal notes the Rust router prints (or silently
// ignores) for this configuration; the app logs them at startup.
func (c *Config) Warnings() []string {
	var w []string
	if c.Backend == BackendTRTLLM || c.Backend == BackendAnthropic {
		w = append(w, "WARNING: runtime '"+c.Backend+"' not implemented yet; falling back to regular routing. Provide --worker-urls or PD flags as usual.")
	}
	if c.Mode() == ModeRegular && (len(c.Prefill) > 0 || len(c.Decode) > 0) {
		w = append(w, "--prefill/--decode are ignored without --vllm-pd-disaggregation")
	}
	if c.Mode() != ModeVLLMPD && c.VLLMDiscoveryAddress != "" {
		w = append(w, "--vllm-discovery-address is ignored without --vllm-pd-disaggregation")
	}
	return w
}
