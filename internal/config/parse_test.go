package config

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// noEnv is an empty environment, so tests never see the real one.
func noEnv(string) (string, bool) { return "", false }

func parse(t *testing.T, args ...string) *Config {
	t.Helper()
	c, err := ParseWith(args, Options{LookupEnv: noEnv, Stdout: &bytes.Buffer{}})
	if err != nil {
		t.Fatalf("ParseWith(%q): %v", args, err)
	}
	return c
}

func parseErr(t *testing.T, args ...string) error {
	t.Helper()
	c, err := ParseWith(args, Options{LookupEnv: noEnv, Stdout: &bytes.Buffer{}})
	if err == nil {
		t.Fatalf("ParseWith(%q) = %+v, want an error", args, c)
	}
	return err
}

var ignoreExplicit = cmpopts.IgnoreUnexported(Config{})

func ptr(i int) *int { return &i }

func TestDefaults(t *testing.T) {
	want := &Config{
		Host:                           "127.0.0.1",
		Port:                           30000,
		Policy:                         "cache_aware",
		WorkerStartupTimeoutSecs:       600,
		WorkerStartupCheckIntervalSecs: 30,
		CacheThreshold:                 0.3,
		BalanceAbsThreshold:            64,
		BalanceRelThreshold:            1.5,
		EvictionIntervalSecs:           120,
		MaxTreeSize:                    67108864,
		MaxPayloadSize:                 536870912,
		IntraNodeDataParallelSize:      1,
		Backend:                        "vllm",
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
		KVConnector:                    "nixl",
		QueueSize:                      100,
		QueueTimeoutSecs:               60,
		ForwardClientAuthorization:     true,
		PDWarmup:                       true,
		HealthUnhealthyIntervalSecs:    0.5,
		HealthUnhealthyMaxIntervalSecs: 1,
		PanicRouting:                   true,
		ShutdownTimeoutSecs:            30,
		LogFormat:                      "text",
		HTTPServer:                     "builtin",
		GCHeapFloorMB:                  16,
		ConnectTimeoutSecs:             3,
		KVWaitTimeoutSecs:              300,
		StreamIdleTimeoutSecs:          300,
		BodyReadTimeoutSecs:            60,
		DecodeOutputLength:             "exact",
		DiscoveryTTLSecs:               9,
		DPSizeAnnotation:               "vllm.ai/dp-size",
		PDMaxFailovers:                 2,
		MaxMigrations:                  2,
		HistoryMaxEntries:              100000,
		HistoryTTLSecs:                 86400,
		RetryBudgetRatio:               0.2,
		CBFailureRate:                  0.5,
		CBMinRequests:                  20,
		CBHalfOpenMaxRequests:          1,
		MaxHeaderBytes:                 1 << 20,
		KVBlockSize:                    16,
		KVSpeculativeIndexing:          true,
		KVSpeculativeTTLMS:             2000,
		KVIndexMaxEntries:              10_000_000,
		KVEventsPort:                   5557,
		KVOverlapScoreWeight:           1,
		KVLoadWeight:                   0.02,
		KVTieBand:                      0.1,
		KVFallbackPolicy:               "cache_aware",
		FlowBands:                      []string{"high=10", "default=0", "low=-10"},
		FlowDefaultBand:                "default",
		FlowOrder:                      "arrival",
		FlowFairnessKey:                "header",
		FlowObjectiveHeader:            "x-gateway-inference-objective",
		FlowFairnessHeader:             "x-gateway-inference-fairness-id",
		FlowDeadlineHeader:             "x-envoy-expected-rq-timeout-ms",
		FlowMaxWaiting:                 5,
		FlowMaxKVUsage:                 0.8,
		FlowPollIntervalSecs:           0.25,
	}
	if diff := cmp.Diff(want, Default(), ignoreExplicit); diff != "" {
		t.Errorf("Default() mismatch (-want +got):\n%s", diff)
	}
	got := parse(t)
	if diff := cmp.Diff(want, got, ignoreExplicit); diff != "" {
		t.Errorf("Parse(nil) mismatch (-want +got):\n%s", diff)
	}
	if len(got.Explicit()) != 0 {
		t.Errorf("Explicit() = %v, want empty", got.Explicit())
	}
	if got.Mode() != ModeRegular {
		t.Errorf("Mode() = %q, want regular", got.Mode())
	}
}

// flagCases sets every flag to a non-default value. TestEveryFlagHasACase
// keeps it complete.
var flagCases = []struct {
	flag  string
	value string // "" for a boolean given bare
	get   func(*Config) any
	want  any
}{
	{"host", "0.0.0.0", func(c *Config) any { return c.Host }, "0.0.0.0"},
	{"port", "8080", func(c *Config) any { return c.Port }, uint16(8080)},
	{"worker-urls", "http://w:1", func(c *Config) any { return c.WorkerURLs }, []string{"http://w:1"}},
	{"policy", "round_robin", func(c *Config) any { return c.Policy }, "round_robin"},
	{"vllm-pd-disaggregation", "", func(c *Config) any { return c.VLLMPDDisaggregation }, true},
	{"vllm-discovery-address", "0.0.0.0:30001", func(c *Config) any { return c.VLLMDiscoveryAddress }, "0.0.0.0:30001"},
	{"decode", "http://d:1", func(c *Config) any { return c.Decode }, []string{"http://d:1"}},
	{"prefill-policy", "random", func(c *Config) any { return c.PrefillPolicy }, "random"},
	{"decode-policy", "rendezvous_hash", func(c *Config) any { return c.DecodePolicy }, "rendezvous_hash"},
	{"worker-startup-timeout-secs", "7", func(c *Config) any { return c.WorkerStartupTimeoutSecs }, uint64(7)},
	{"worker-startup-check-interval", "2", func(c *Config) any { return c.WorkerStartupCheckIntervalSecs }, uint64(2)},
	{"cache-threshold", "0.75", func(c *Config) any { return c.CacheThreshold }, 0.75},
	{"balance-abs-threshold", "3", func(c *Config) any { return c.BalanceAbsThreshold }, 3},
	{"balance-rel-threshold", "2.5", func(c *Config) any { return c.BalanceRelThreshold }, 2.5},
	{"eviction-interval", "9", func(c *Config) any { return c.EvictionIntervalSecs }, uint64(9)},
	{"max-tree-size", "1000", func(c *Config) any { return c.MaxTreeSize }, 1000},
	{"max-payload-size", "1048576", func(c *Config) any { return c.MaxPayloadSize }, 1048576},
	{"intra-node-data-parallel-size", "4", func(c *Config) any { return c.IntraNodeDataParallelSize }, 4},
	{"api-key", "sk-x", func(c *Config) any { return c.APIKey }, "sk-x"},
	{"api-key-validation-urls", "http://v/check", func(c *Config) any { return c.APIKeyValidationURLs }, []string{"http://v/check"}},
	{"backend", "openai", func(c *Config) any { return c.Backend }, "openai"},
	{"runtime", "trtllm", func(c *Config) any { return c.Backend }, "trtllm"},
	{"log-dir", "/var/log/sy", func(c *Config) any { return c.LogDir }, "/var/log/sy"},
	{"log-level", "debug", func(c *Config) any { return c.LogLevel }, "debug"},
	{"enable-trace", "", func(c *Config) any { return c.EnableTrace }, true},
	{"otlp-traces-endpoint", "otel:4317", func(c *Config) any { return c.OTLPTracesEndpoint }, "otel:4317"},
	{"otel-sampling-ratio", "0.25", func(c *Config) any { return c.OtelSamplingRatio }, 0.25},
	{"otel-excluded-paths", "/metrics", func(c *Config) any { return c.OtelExcludedPaths }, []string{"/metrics"}},
	{"service-discovery", "", func(c *Config) any { return c.ServiceDiscovery }, true},
	{"selector", "app=vllm", func(c *Config) any { return c.Selector }, []string{"app=vllm"}},
	{"service-discovery-port", "8000", func(c *Config) any { return c.ServiceDiscoveryPort }, uint16(8000)},
	{"service-discovery-namespace", "llm", func(c *Config) any { return c.ServiceDiscoveryNamespace }, "llm"},
	{"prefill-selector", "role=prefill", func(c *Config) any { return c.PrefillSelector }, []string{"role=prefill"}},
	{"decode-selector", "role=decode", func(c *Config) any { return c.DecodeSelector }, []string{"role=decode"}},
	{"prometheus-port", "9100", func(c *Config) any { return c.PrometheusPort }, uint16(9100)},
	{"prometheus-host", "0.0.0.0", func(c *Config) any { return c.PrometheusHost }, "0.0.0.0"},
	{"request-id-headers", "x-req", func(c *Config) any { return c.RequestIDHeaders }, []string{"x-req"}},
	{"request-timeout-secs", "30", func(c *Config) any { return c.RequestTimeoutSecs }, uint64(30)},
	{"max-concurrent-requests", "16", func(c *Config) any { return c.MaxConcurrentRequests }, 16},
	{"cors-allowed-origins", "https://ui", func(c *Config) any { return c.CORSAllowedOrigins }, []string{"https://ui"}},
	{"retry-max-retries", "3", func(c *Config) any { return c.RetryMaxRetries }, uint32(3)},
	{"retry-initial-backoff-ms", "10", func(c *Config) any { return c.RetryInitialBackoffMS }, uint64(10)},
	{"retry-max-backoff-ms", "100", func(c *Config) any { return c.RetryMaxBackoffMS }, uint64(100)},
	{"retry-backoff-multiplier", "2", func(c *Config) any { return c.RetryBackoffMultiplier }, 2.0},
	{"retry-jitter-factor", "0.5", func(c *Config) any { return c.RetryJitterFactor }, 0.5},
	{"disable-retries", "", func(c *Config) any { return c.DisableRetries }, true},
	{"cb-failure-threshold", "4", func(c *Config) any { return c.CBFailureThreshold }, uint32(4)},
	{"cb-success-threshold", "5", func(c *Config) any { return c.CBSuccessThreshold }, uint32(5)},
	{"cb-timeout-duration-secs", "6", func(c *Config) any { return c.CBTimeoutDurationSecs }, uint64(6)},
	{"cb-window-duration-secs", "7", func(c *Config) any { return c.CBWindowDurationSecs }, uint64(7)},
	{"disable-circuit-breaker", "", func(c *Config) any { return c.DisableCircuitBreaker }, true},
	{"health-failure-threshold", "8", func(c *Config) any { return c.HealthFailureThreshold }, uint32(8)},
	{"health-success-threshold", "9", func(c *Config) any { return c.HealthSuccessThreshold }, uint32(9)},
	{"health-check-timeout-secs", "10", func(c *Config) any { return c.HealthCheckTimeoutSecs }, uint64(10)},
	{"health-check-interval-secs", "11", func(c *Config) any { return c.HealthCheckIntervalSecs }, uint64(11)},
	{"health-check-endpoint", "/ready", func(c *Config) any { return c.HealthCheckEndpoint }, "/ready"},
	{"enable-igw", "", func(c *Config) any { return c.EnableIGW }, true},
	{"history-backend", "none", func(c *Config) any { return c.HistoryBackend }, "none"},
	{"history-max-entries", "7", func(c *Config) any { return c.HistoryMaxEntries }, 7},
	{"history-ttl-secs", "1.5", func(c *Config) any { return c.HistoryTTLSecs }, 1.5},
	{"profile", "", func(c *Config) any { return c.Profile }, true},
	{"kv-connector", "p2pnccl", func(c *Config) any { return c.KVConnector }, "p2pnccl"},
	{"queue-size", "5", func(c *Config) any { return c.QueueSize }, 5},
	{"queue-timeout-secs", "6", func(c *Config) any { return c.QueueTimeoutSecs }, uint64(6)},
	{"rate-limit-tokens-per-second", "12.5", func(c *Config) any { return c.RateLimitTokensPerSecond }, 12.5},
	{"router-api-keys", "k1", func(c *Config) any { return c.RouterAPIKeys }, []string{"k1"}},
	{"admin-api-key", "adm", func(c *Config) any { return c.AdminAPIKey }, "adm"},
	{"forward-client-authorization", "false", func(c *Config) any { return c.ForwardClientAuthorization }, false},
	{"shutdown-timeout-secs", "1.5", func(c *Config) any { return c.ShutdownTimeoutSecs }, 1.5},
	{"log-format", "json", func(c *Config) any { return c.LogFormat }, "json"},
	{"http-server", "net/http", func(c *Config) any { return c.HTTPServer }, "net/http"},
	{"enable-pprof", "", func(c *Config) any { return c.EnablePprof }, true},
	{"gc-heap-floor-mb", "0", func(c *Config) any { return c.GCHeapFloorMB }, 0},
	{"prefill-timeout-secs", "2", func(c *Config) any { return c.PrefillTimeoutSecs }, 2.0},
	{"kv-wait-timeout-secs", "3", func(c *Config) any { return c.KVWaitTimeoutSecs }, 3.0},
	{"stream-idle-timeout-secs", "0.2", func(c *Config) any { return c.StreamIdleTimeoutSecs }, 0.2},
	{"body-read-timeout-secs", "2.5", func(c *Config) any { return c.BodyReadTimeoutSecs }, 2.5},
	{"connect-timeout-secs", "1", func(c *Config) any { return c.ConnectTimeoutSecs }, 1.0},
	{"decode-output-length", "toy-proxy", func(c *Config) any { return c.DecodeOutputLength }, "toy-proxy"},
	{"discovery-ttl-secs", "4.5", func(c *Config) any { return c.DiscoveryTTLSecs }, 4.5},
	{"route-receipt", "", func(c *Config) any { return c.RouteReceipt }, true},
	{"dp-size-annotation", "x/dp", func(c *Config) any { return c.DPSizeAnnotation }, "x/dp"},
	{"load-poll-interval-secs", "0.5", func(c *Config) any { return c.LoadPollIntervalSecs }, 0.5},
	{"pd-max-failovers", "0", func(c *Config) any { return c.PDMaxFailovers }, 0},
	{"max-migrations", "0", func(c *Config) any { return c.MaxMigrations }, 0},
	{"retry-budget-ratio", "0.1", func(c *Config) any { return c.RetryBudgetRatio }, 0.1},
	{"cb-failure-rate", "0.9", func(c *Config) any { return c.CBFailureRate }, 0.9},
	{"cb-min-requests", "3", func(c *Config) any { return c.CBMinRequests }, uint32(3)},
	{"cb-half-open-max-requests", "2", func(c *Config) any { return c.CBHalfOpenMaxRequests }, uint32(2)},
	{"max-header-bytes", "4096", func(c *Config) any { return c.MaxHeaderBytes }, 4096},
	{"prefill-data-parallel-size", "2", func(c *Config) any { return c.PrefillDataParallelSize }, 2},
	{"decode-data-parallel-size", "3", func(c *Config) any { return c.DecodeDataParallelSize }, 3},
	{"pd-split-responses", "", func(c *Config) any { return c.PDSplitResponses }, true},
	{"pd-warmup", "false", func(c *Config) any { return c.PDWarmup }, false},
	{"health-unhealthy-interval-secs", "0.25", func(c *Config) any { return c.HealthUnhealthyIntervalSecs }, 0.25},
	{"health-unhealthy-max-interval-secs", "4", func(c *Config) any { return c.HealthUnhealthyMaxIntervalSecs }, 4.0},
	{"panic-routing", "false", func(c *Config) any { return c.PanicRouting }, false},
	{"kv-block-size", "32", func(c *Config) any { return c.KVBlockSize }, 32},
	{"kv-hash-seed", "7", func(c *Config) any { return c.KVHashSeed }, uint64(7)},
	{"kv-speculative-indexing", "false", func(c *Config) any { return c.KVSpeculativeIndexing }, false},
	{"kv-speculative-ttl-ms", "500", func(c *Config) any { return c.KVSpeculativeTTLMS }, uint64(500)},
	{"kv-index-max-entries", "1000", func(c *Config) any { return c.KVIndexMaxEntries }, 1000},
	{"kv-events-port", "6000", func(c *Config) any { return c.KVEventsPort }, uint16(6000)},
	{"kv-events-replay-port", "6001", func(c *Config) any { return c.KVEventsReplayPort }, uint16(6001)},
	{"kv-events-topic", "kv@", func(c *Config) any { return c.KVEventsTopic }, "kv@"},
	{"kv-events-endpoints", "http://a:1=tcp://a:2", func(c *Config) any { return c.KVEventsEndpoints }, []string{"http://a:1=tcp://a:2"}},
	{"kv-overlap-score-weight", "2", func(c *Config) any { return c.KVOverlapScoreWeight }, 2.0},
	{"kv-load-weight", "0", func(c *Config) any { return c.KVLoadWeight }, 0.0},
	{"kv-tie-band", "0.05", func(c *Config) any { return c.KVTieBand }, 0.05},
	{"kv-fallback-policy", "round_robin", func(c *Config) any { return c.KVFallbackPolicy }, "round_robin"},
	{"tokenizer-path", "/m/tokenizer.json", func(c *Config) any { return c.TokenizerPath }, "/m/tokenizer.json"},
	{"chat-template", "/m/t.jinja", func(c *Config) any { return c.ChatTemplate }, "/m/t.jinja"},
	{"pd-uncached-token-threshold", "128", func(c *Config) any { return c.PDUncachedTokenThreshold }, 128},
	{"flow-control", "", func(c *Config) any { return c.FlowControl }, true},
	{"flow-bands", "gold=5", func(c *Config) any { return c.FlowBands }, []string{"gold=5"}},
	{"flow-default-band", "low", func(c *Config) any { return c.FlowDefaultBand }, "low"},
	{"flow-order", "deadline", func(c *Config) any { return c.FlowOrder }, "deadline"},
	{"flow-fairness-key", "user", func(c *Config) any { return c.FlowFairnessKey }, "user"},
	{"flow-objective-header", "x-o", func(c *Config) any { return c.FlowObjectiveHeader }, "x-o"},
	{"flow-fairness-header", "x-f", func(c *Config) any { return c.FlowFairnessHeader }, "x-f"},
	{"flow-deadline-header", "x-d", func(c *Config) any { return c.FlowDeadlineHeader }, "x-d"},
	{"flow-weights", "a=2", func(c *Config) any { return c.FlowWeights }, []string{"a=2"}},
	{"flow-headroom", "4", func(c *Config) any { return c.FlowHeadroom }, 4},
	{"flow-worker-max-inflight", "8", func(c *Config) any { return c.FlowWorkerMaxInFlight }, 8},
	{"flow-max-waiting", "2", func(c *Config) any { return c.FlowMaxWaiting }, 2.0},
	{"flow-max-kv-usage", "0.9", func(c *Config) any { return c.FlowMaxKVUsage }, 0.9},
	{"flow-engine-priority", "", func(c *Config) any { return c.FlowEnginePriority }, true},
	{"flow-avoid-prefill", "", func(c *Config) any { return c.FlowAvoidPrefill }, true},
	{"flow-isolate-prefill", "", func(c *Config) any { return c.FlowIsolatePrefill }, true},
	{"flow-prefill-reserve", "1", func(c *Config) any { return c.FlowPrefillReserve }, 1},
	{"flow-poll-interval-secs", "0.1", func(c *Config) any { return c.FlowPollIntervalSecs }, 0.1},
	{"config", "", nil, nil}, // covered by the config-file tests
}

func TestEveryFlagHasACase(t *testing.T) {
	covered := map[string]bool{}
	for _, tc := range flagCases {
		covered[tc.flag] = true
	}
	for _, d := range flagDefs(Default()) {
		if !covered[d.name] {
			t.Errorf("flag --%s has no entry in flagCases", d.name)
		}
		if d.alias != "" && !covered[d.alias] {
			t.Errorf("alias --%s has no entry in flagCases", d.alias)
		}
	}
}

func TestEveryFlagParses(t *testing.T) {
	for _, tc := range flagCases {
		if tc.get == nil {
			continue
		}
		forms := map[string][]string{}
		switch tc.value {
		case "": // boolean
			forms["bare"] = []string{"--" + tc.flag}
			forms["equals"] = []string{"--" + tc.flag + "=true"}
		case "false": // boolean with a true default
			forms["equals"] = []string{"--" + tc.flag + "=false"}
		default:
			forms["space"] = []string{"--" + tc.flag, tc.value}
			forms["equals"] = []string{"--" + tc.flag + "=" + tc.value}
		}
		for form, args := range forms {
			t.Run(tc.flag+"/"+form, func(t *testing.T) {
				c := parse(t, args...)
				if diff := cmp.Diff(tc.want, tc.get(c)); diff != "" {
					t.Errorf("%q (-want +got):\n%s", args, diff)
				}
				if !c.IsSet(tc.flag) || !c.IsSet("--"+tc.flag) {
					t.Errorf("IsSet(%q) = false", tc.flag)
				}
				if n := len(c.Explicit()); n != 1 {
					t.Errorf("Explicit() = %v, want exactly one flag", c.Explicit())
				}
			})
		}
	}
}

func TestAliasRuntime(t *testing.T) {
	c := parse(t, "--runtime", "openai")
	if c.Backend != "openai" || c.Mode() != ModeOpenAI {
		t.Fatalf("Backend=%q Mode=%q", c.Backend, c.Mode())
	}
	if !c.IsSet("backend") || !c.IsSet("--runtime") {
		t.Errorf("explicit = %v, want backend", c.Explicit())
	}
}

// The Python launcher's log levels start switchyard too (drop-in).
func TestLauncherLogLevels(t *testing.T) {
	for _, lvl := range []string{"debug", "info", "warn", "warning", "error", "critical"} {
		if c := parse(t, "--log-level", lvl); c.LogLevel != lvl {
			t.Errorf("--log-level %s: LogLevel = %q", lvl, c.LogLevel)
		}
	}
}

func TestMultiValueFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		get  func(*Config) any
		want any
	}{
		{"three values then a flag", []string{"--worker-urls", "http://a", "http://b", "http://c", "--port", "1"},
			func(c *Config) any { return []any{c.WorkerURLs, c.Port} }, []any{[]string{"http://a", "http://b", "http://c"}, uint16(1)}},
		{"occurrences append", []string{"--worker-urls", "http://a", "--policy", "random", "--worker-urls", "http://b", "http://c"},
			func(c *Config) any { return c.WorkerURLs }, []string{"http://a", "http://b", "http://c"}},
		{"equals form is one value", []string{"--worker-urls=http://a", "--worker-urls=http://b"},
			func(c *Config) any { return c.WorkerURLs }, []string{"http://a", "http://b"}},
		{"zero values", []string{"--worker-urls", "--port", "2"},
			func(c *Config) any { return []any{c.WorkerURLs, c.IsSet("worker-urls")} }, []any{[]string{}, true}},
		{"zero values at end", []string{"--cors-allowed-origins"},
			func(c *Config) any { return c.CORSAllowedOrigins }, []string{}},
		{"stops at a short flag", []string{"--selector", "a=b", "-V"}, nil, nil},
		{"lone dash is a value", []string{"--request-id-headers", "-", "x"},
			func(c *Config) any { return c.RequestIDHeaders }, []string{"-", "x"}},
		{"decode repeated", []string{"--decode", "http://d1", "--decode", "http://d2"},
			func(c *Config) any { return c.Decode }, []string{"http://d1", "http://d2"}},
		{"decode several", []string{"--decode", "http://d1", "http://d2"},
			func(c *Config) any { return c.Decode }, []string{"http://d1", "http://d2"}},
		{"every list flag", []string{
			"--api-key-validation-urls", "http://v1", "http://v2",
			"--otel-excluded-paths", "/a", "/b",
			"--selector", "a=1", "b=2",
			"--prefill-selector", "p=1",
			"--decode-selector", "d=1", "e=2",
			"--request-id-headers", "h1", "h2",
			"--cors-allowed-origins", "https://o1", "https://o2",
			"--router-api-keys", "k1", "k2", "k3",
		}, func(c *Config) any {
			return [][]string{c.APIKeyValidationURLs, c.OtelExcludedPaths, c.Selector, c.PrefillSelector,
				c.DecodeSelector, c.RequestIDHeaders, c.CORSAllowedOrigins, c.RouterAPIKeys}
		}, [][]string{{"http://v1", "http://v2"}, {"/a", "/b"}, {"a=1", "b=2"}, {"p=1"}, {"d=1", "e=2"},
			{"h1", "h2"}, {"https://o1", "https://o2"}, {"k1", "k2", "k3"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.get == nil {
				_, err := ParseWith(tc.args, Options{LookupEnv: noEnv, Stdout: &bytes.Buffer{}})
				if !errors.Is(err, ErrVersion) {
					t.Fatalf("err = %v, want ErrVersion", err)
				}
				return
			}
			c := parse(t, tc.args...)
			if diff := cmp.Diff(tc.want, tc.get(c)); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
		})
	}
}

func TestPrefillForms(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []PrefillWorker
		rest func(*Config) any // other flags that must survive
		wRes any
	}{
		{"url only", []string{"--prefill", "http://p:8000"}, []PrefillWorker{{URL: "http://p:8000"}}, nil, nil},
		{"url port", []string{"--prefill", "http://p:8000", "9000"}, []PrefillWorker{{URL: "http://p:8000", BootstrapPort: ptr(9000)}}, nil, nil},
		{"url plus-port", []string{"--prefill", "http://p:8000", "+80"}, []PrefillWorker{{URL: "http://p:8000", BootstrapPort: ptr(80)}}, nil, nil},
		{"url none", []string{"--prefill", "http://p:8000", "none"}, []PrefillWorker{{URL: "http://p:8000"}}, nil, nil},
		{"url NONE", []string{"--prefill", "http://p:8000", "NoNe"}, []PrefillWorker{{URL: "http://p:8000"}}, nil, nil},
		{"url then flag", []string{"--prefill", "http://p:8000", "--policy", "random"},
			[]PrefillWorker{{URL: "http://p:8000"}}, func(c *Config) any { return c.Policy }, "random"},
		{"port then flag", []string{"--prefill", "http://p:8000", "0", "--port", "1"},
			[]PrefillWorker{{URL: "http://p:8000", BootstrapPort: ptr(0)}}, func(c *Config) any { return c.Port }, uint16(1)},
		{"repeated", []string{"--port", "3000", "--prefill", "http://p0:8000", "9000", "--policy", "random",
			"--prefill", "http://p1:8000", "none", "--prefill", "http://p2:8000"},
			[]PrefillWorker{{URL: "http://p0:8000", BootstrapPort: ptr(9000)}, {URL: "http://p1:8000"}, {URL: "http://p2:8000"}},
			func(c *Config) any { return []any{c.Port, c.Policy} }, []any{uint16(3000), "random"}},
		{"equals form", []string{"--prefill=http://p:8000"}, []PrefillWorker{{URL: "http://p:8000"}}, nil, nil},
		{"equals form with port", []string{"--prefill=http://p:8000", "8998", "--decode", "http://d"},
			[]PrefillWorker{{URL: "http://p:8000", BootstrapPort: ptr(8998)}}, func(c *Config) any { return c.Decode }, []string{"http://d"}},
		{"inside a list run", []string{"--decode", "http://d", "--prefill", "http://p", "--decode", "http://e"},
			[]PrefillWorker{{URL: "http://p"}}, func(c *Config) any { return c.Decode }, []string{"http://d", "http://e"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := parse(t, tc.args...)
			if diff := cmp.Diff(tc.want, c.Prefill); diff != "" {
				t.Errorf("Prefill (-want +got):\n%s", diff)
			}
			if !c.IsSet("prefill") {
				t.Errorf("IsSet(prefill) = false")
			}
			if tc.rest != nil {
				if diff := cmp.Diff(tc.wRes, tc.rest(c)); diff != "" {
					t.Errorf("other flags (-want +got):\n%s", diff)
				}
			}
		})
	}
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"prefill non-numeric token left for the parser", []string{"--prefill", "http://p:8000", "abc"}, "unexpected argument 'abc' found"},
		{"prefill out-of-range port left for the parser", []string{"--prefill", "http://p:8000", "65536"}, "unexpected argument '65536' found"},
		{"prefill without url", []string{"--prefill"}, "--prefill requires a URL immediately after"},
		{"prefill equals without url", []string{"--prefill="}, "--prefill requires a URL immediately after"},
		{"prefill flag as url", []string{"--prefill", "--help"}, "Invalid url --help"},
		{"prefill dash url", []string{"--prefill=-x"}, "Invalid url -x"},
		{"unknown long flag", []string{"--port", "1", "--no-such-flag", "x"}, "unknown flag: --no-such-flag"},
		{"unknown long flag with value", []string{"--nope=1"}, "unknown flag: --nope"},
		{"unknown short flag", []string{"-p", "80"}, "unknown flag: -p"},
		{"single-dash long flag", []string{"-port", "80"}, "unknown flag: -port"},
		{"missing value at end", []string{"--port"}, "a value is required for --port but none was supplied"},
		{"missing value before flag", []string{"--host", "--port", "1"}, "a value is required for --host but none was supplied"},
		{"decode needs a value", []string{"--decode", "--port", "1"}, "a value is required for --decode but none was supplied"},
		{"stray positional", []string{"--port", "80", "extra"}, "unexpected argument 'extra' found"},
		{"bool takes no separate value", []string{"--profile", "true"}, "unexpected argument 'true' found"},
		{"positional after --", []string{"--", "x"}, "unexpected argument 'x' found"},
		{"help with value", []string{"--help=1"}, "unexpected value '1' for --help"},
		{"equals list then positional", []string{"--worker-urls=http://a", "http://b"}, "unexpected argument 'http://b' found"},
		{"bad uint16", []string{"--port", "abc"}, "invalid value for --port: abc - Must be an integer between 0 and 65535"},
		{"uint16 overflow", []string{"--port=70000"}, "invalid value for --port: 70000 - Must be an integer between 0 and 65535"},
		{"negative uint32", []string{"--retry-max-retries", "-1"}, "invalid value for --retry-max-retries: -1 - Must be an integer between 0 and 4294967295"},
		{"negative usize", []string{"--max-tree-size", "-1"}, "invalid value for --max-tree-size: -1 - Must be a non-negative integer"},
		{"bad float", []string{"--cache-threshold", "x"}, "invalid value for --cache-threshold: x - Must be a number"},
		{"bad bool", []string{"--profile=maybe"}, "invalid value for --profile: maybe - Must be true or false"},
		{"empty value", []string{"--port="}, `invalid value for --port: "" - Must be an integer between 0 and 65535`},
		{"bad policy", []string{"--policy", "sticky"}, "invalid value for --policy: sticky - Must be one of: random, round_robin, cache_aware, power_of_two, consistent_hash, rendezvous_hash, kv_aware"},
		{"bad alias value", []string{"--runtime", "tgi"}, "invalid value for --runtime: tgi - Must be one of: vllm, trtllm, openai, anthropic"},
		{"bad kv connector", []string{"--kv-connector", "lmcache"}, "invalid value for --kv-connector: lmcache - Must be one of: nixl, mooncake, moriio, p2pnccl"},
		{"bad log level", []string{"--log-level", "verbose"}, "invalid value for --log-level: verbose - Must be one of: debug, info, warn, error, warning, critical"},
		{"bad log format", []string{"--log-format", "xml"}, "invalid value for --log-format: xml - Must be one of: text, json"},
		{"bad history backend", []string{"--history-backend", "redis"}, "invalid value for --history-backend: redis - Must be one of: memory, none"},
		{"bad decode output length", []string{"--decode-output-length", "max"}, "invalid value for --decode-output-length: max - Must be one of: exact, toy-proxy"},
		{"empty config path", []string{"--config="}, `invalid value for --config: "" - Must be a file path`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := parseErr(t, tc.args...)
			if err.Error() != tc.want {
				t.Errorf("error = %q\nwant    %q", err, tc.want)
			}
			var ce *Error
			if !errors.As(err, &ce) {
				t.Errorf("error %T is not a *config.Error", err)
			}
		})
	}
}

func TestHelpAndVersion(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"-h"}, {"--port", "1", "--help", "--nope"}, {"--worker-urls", "http://a", "-h"}} {
		var out bytes.Buffer
		c, err := ParseWith(args, Options{LookupEnv: noEnv, Stdout: &out, Version: "1.2.3"})
		if !errors.Is(err, ErrHelp) || c != nil {
			t.Fatalf("%q: (%v, %v), want ErrHelp", args, c, err)
		}
		for _, want := range []string{"switchyard 1.2.3", "--prefill URL [PORT|none]", "--worker-urls <URL>...",
			"[default: cache_aware]", "(alias --runtime)", "--forward-client-authorization", "[default: true]",
			"Switchyard options:", "--config <FILE>", "-V, --version", "[possible values: nixl, mooncake, moriio, p2pnccl]"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%q: help lacks %q", args, want)
			}
		}
	}
	for _, args := range [][]string{{"--version"}, {"-V"}, {"--port", "1", "-V"}} {
		var out bytes.Buffer
		_, err := ParseWith(args, Options{LookupEnv: noEnv, Stdout: &out, Version: "1.2.3"})
		if !errors.Is(err, ErrVersion) {
			t.Fatalf("%q: err = %v, want ErrVersion", args, err)
		}
		if out.String() != "switchyard 1.2.3\n" {
			t.Errorf("%q: output %q", args, out.String())
		}
	}
	// An error before --help wins, as in clap.
	if err := parseErr(t, "--nope", "--help"); errors.Is(err, ErrHelp) {
		t.Errorf("unknown flag before --help: got ErrHelp")
	}
}

func TestEnvFallback(t *testing.T) {
	env := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) {
			if k == "API_KEY_VALIDATION_URLS" {
				return v, true
			}
			return "", false
		}
	}
	tests := []struct {
		name   string
		args   []string
		env    string
		want   []string
		wantIs bool
	}{
		{"env used", nil, " http://a/v , ,http://b/v,", []string{"http://a/v", "http://b/v"}, true},
		{"flag wins", []string{"--api-key-validation-urls", "http://flag"}, "http://env", []string{"http://flag"}, true},
		{"empty flag falls back", []string{"--api-key-validation-urls"}, "http://env", []string{"http://env"}, true},
		{"blank env ignored", nil, " , ", nil, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := ParseWith(tc.args, Options{LookupEnv: env(tc.env)})
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, c.APIKeyValidationURLs, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if c.IsSet("api-key-validation-urls") != tc.wantIs {
				t.Errorf("IsSet = %v, want %v", !tc.wantIs, tc.wantIs)
			}
		})
	}
	// Parse (no options) reads the real environment.
	t.Setenv("API_KEY_VALIDATION_URLS", "http://real/v")
	c, err := Parse([]string{"--worker-urls", "http://w"})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"http://real/v"}, c.APIKeyValidationURLs); diff != "" {
		t.Errorf("Parse env (-want +got):\n%s", diff)
	}
}

func TestParseDoesNotTouchProcessEnv(t *testing.T) {
	before := os.Environ()
	parse(t, "--worker-urls", "http://w")
	if diff := cmp.Diff(before, os.Environ()); diff != "" {
		t.Errorf("environment changed:\n%s", diff)
	}
}
