package config

import (
	"errors"
	"math"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// messages flattens Validate's errors.Join into its messages, checking each
// is a *Error.
func messages(t *testing.T, err error) []string {
	t.Helper()
	if err == nil {
		return nil
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("Validate error %T is not an errors.Join", err)
	}
	var out []string
	for _, e := range joined.Unwrap() {
		var ce *Error
		if !errors.As(e, &ce) {
			t.Errorf("%v is %T, not *config.Error", e, e)
		}
		out = append(out, e.Error())
	}
	return out
}

const (
	msgRegularNeedsWorkers = "validation failed: Regular mode requires --worker-urls when not using service discovery"
	msgPDNeedsSource       = "validation failed: vLLM PD disaggregation mode requires one of: --vllm-discovery-address, --prefill/--decode URLs, or --service-discovery with --prefill-selector/--decode-selector"
	msgMoRI                = "incompatible configuration: MoRI-IO KV connector requires service discovery to be enabled (ZMQ addresses are obtained via instance registration). Please run with `--vllm-discovery-address ${address}`"
)

func TestValidate(t *testing.T) {
	w := []string{"--worker-urls", "http://w1:8000"}
	pd := []string{"--vllm-pd-disaggregation", "--prefill", "http://p1:8000", "--decode", "http://d1:8000"}
	zmq := []string{"--vllm-pd-disaggregation", "--vllm-discovery-address", "0.0.0.0:30001"}
	with := func(base []string, more ...string) []string { return append(append([]string{}, base...), more...) }

	tests := []struct {
		name   string
		args   []string
		mutate func(*Config) // for values the command line cannot express
		want   []string
	}{
		// Valid configurations.
		{name: "regular", args: w},
		{name: "regular with k8s discovery", args: []string{"--service-discovery", "--selector", "app=vllm"}},
		{name: "static pd", args: pd},
		{name: "zmq pd", args: zmq},
		{name: "zmq pd plus static workers (deliberate difference)", args: with(zmq, "--prefill", "http://p1:8000", "--decode", "http://d1:8000")},
		{name: "zmq pd with only static decode", args: with(zmq, "--decode", "http://d1:8000")},
		{name: "k8s pd", args: []string{"--vllm-pd-disaggregation", "--service-discovery", "--prefill-selector", "role=p"}},
		{name: "openai", args: []string{"--backend", "openai", "--worker-urls", "https://api.openai.com"}},
		{name: "moriio with discovery", args: with(zmq, "--kv-connector", "moriio")},
		{name: "power of two with two workers", args: []string{"--policy", "power_of_two", "--worker-urls", "http://a", "http://b"}},
		{name: "power of two pd counts both sides", args: with(pd, "--policy", "power_of_two")},
		{name: "power of two with discovery", args: []string{"--policy", "power_of_two", "--service-discovery", "--selector", "a=b"}},
		{name: "disable retries fixes max retries", args: with(w, "--retry-max-retries", "0", "--disable-retries")},
		{name: "disable cb fixes threshold", args: with(w, "--cb-failure-threshold", "0", "--disable-circuit-breaker")},
		{name: "cache params ignored when not cache_aware", args: with(w, "--policy", "random", "--cache-threshold", "1.5", "--balance-rel-threshold", "0.5", "--eviction-interval", "0", "--max-tree-size", "0")},
		{name: "prometheus ipv6", args: with(w, "--prometheus-host", "::")},
		{name: "discovery address forms", args: with(zmq[:1], "--vllm-discovery-address", "[::1]:0")},
		{name: "discovery star", args: with(zmq[:1], "--vllm-discovery-address", "*:5555")},
		{name: "boundary values", args: with(w, "--cache-threshold", "0", "--balance-rel-threshold", "1", "--retry-jitter-factor", "1",
			"--retry-max-backoff-ms", "50", "--retry-backoff-multiplier", "1", "--otel-sampling-ratio", "0", "--cb-failure-rate", "0",
			"--retry-budget-ratio", "1", "--connect-timeout-secs", "0", "--queue-size", "0", "--pd-max-failovers", "0", "--intra-node-data-parallel-size", "0")},
		{name: "url with userinfo passes as in rust", args: []string{"--worker-urls", "http://h:8000@0"}},
		{name: "bootstrap port bounds", args: []string{"--vllm-pd-disaggregation", "--prefill", "http://p", "1", "--prefill", "http://q", "65535", "--decode", "http://d"}},

		// §1.3 mode derivation.
		{name: "regular without workers", args: nil, want: []string{msgRegularNeedsWorkers}},
		{name: "regular with empty worker list", args: []string{"--worker-urls"}, want: []string{msgRegularNeedsWorkers}},
		{name: "pd without a source", args: []string{"--vllm-pd-disaggregation"}, want: []string{msgPDNeedsSource}},
		{name: "pd with k8s but no selector", args: []string{"--vllm-pd-disaggregation", "--service-discovery"}, want: []string{
			msgPDNeedsSource,
			"validation failed: vLLM PD mode with service discovery requires at least one non-empty selector (prefill or decode)",
		}},
		{name: "igw", args: with(w, "--enable-igw"), want: nil},
		{name: "igw without workers", args: []string{"--enable-igw"}, want: nil},
		{name: "igw skips compatibility", args: []string{"--enable-igw", "--kv-connector", "nixl", "--policy", "power_of_two"}, want: nil},
		{name: "igw bad url", args: []string{"--enable-igw", "--worker-urls", "h:1"}, want: []string{"invalid value for --worker-urls: h:1 - URL must start with http:// or https://"}},
		{name: "igw with PD", args: []string{"--enable-igw", "--vllm-pd-disaggregation", "--prefill", "http://p:1", "9000", "--decode", "http://d:1", "--worker-urls", "http://r:1"}, want: nil},
		{name: "igw PD bad input", args: []string{"--enable-igw", "--prefill", "http://p:1", "0", "--decode", "d:1"}, want: []string{
			"invalid value for --prefill: http://p:1 0 - Port must be between 1 and 65535",
			"invalid value for --decode: d:1 - URL must start with http:// or https://",
		}},
		{name: "igw refusals", args: []string{"--enable-igw", "--kv-connector", "moriio", "--panic-routing", "--pd-warmup=true", "--service-discovery", "--backend", "openai"}, want: []string{
			"not supported: --backend openai (with --enable-igw: an OpenAI-compatible upstream serves one model there; name it in the config file (models: {MODEL: {upstream: URL, api_key_env: VAR}}) beside the vLLM models)",
			"validation failed: --enable-igw with service discovery requires a non-empty --selector, --prefill-selector or --decode-selector",
			"not supported: --panic-routing (with --enable-igw: panic routing picks among every registered worker, whatever its model (it is off there; drop the flag))",
			"not supported: --pd-warmup (with --enable-igw: the warm-up pairs prefill and decode workers across models (it is off there; drop the flag))",
			"incompatible configuration: with --enable-igw, --kv-connector moriio needs --vllm-discovery-address: MoRI-IO workers register over ZMQ discovery",
		}},
		{name: "igw with Kubernetes discovery", args: []string{"--enable-igw", "--service-discovery", "--selector", "app=vllm", "--prefill-selector", "app=p", "--decode-selector", "app=d"}, want: nil},
		{name: "igw with ZMQ discovery", args: []string{"--enable-igw", "--kv-connector", "moriio", "--vllm-discovery-address", "127.0.0.1:5555"}, want: nil},
		{name: "igw explicit off is fine", args: []string{"--enable-igw", "--panic-routing=false", "--pd-warmup=false"}, want: nil},

		// Rule 1: mode.
		{name: "empty url", args: []string{"--worker-urls", ""}, want: []string{`invalid value for --worker-urls: "" - URL cannot be empty`}},
		{name: "url without scheme", args: []string{"--worker-urls", "w1:8000"}, want: []string{"invalid value for --worker-urls: w1:8000 - URL must start with http:// or https://"}},
		{name: "grpc scheme", args: []string{"--worker-urls", "grpc://w1:8000"}, want: []string{"invalid value for --worker-urls: grpc://w1:8000 - URL must start with http:// or https://"}},
		{name: "unparsable url", args: []string{"--worker-urls", "http://[::1"}, want: []string{"invalid value for --worker-urls: http://[::1 - Invalid URL format: missing ']' in host"}},
		{name: "bad port in url", args: []string{"--worker-urls", "http://w:port"}, want: []string{`invalid value for --worker-urls: http://w:port - Invalid URL format: invalid port ":port" after host`}},
		{name: "url without host", args: []string{"--worker-urls", "http://"}, want: []string{"invalid value for --worker-urls: http:// - URL must have a valid host"}},
		{name: "every bad url reported", args: []string{"--worker-urls", "a", "http://ok", "b"}, want: []string{
			"invalid value for --worker-urls: a - URL must start with http:// or https://",
			"invalid value for --worker-urls: b - URL must start with http:// or https://",
		}},
		{name: "pd without decode", args: []string{"--vllm-pd-disaggregation", "--prefill", "http://p1"}, want: []string{"validation failed: vLLM PD mode requires at least one decode worker URL"}},
		{name: "pd without prefill", args: []string{"--vllm-pd-disaggregation", "--decode", "http://d1"}, want: []string{"validation failed: vLLM PD mode requires at least one prefill worker URL"}},
		{name: "pd bad urls", args: []string{"--vllm-pd-disaggregation", "--prefill", "p1", "--decode", "ftp://d1"}, want: []string{
			"invalid value for --prefill: p1 - URL must start with http:// or https://",
			"invalid value for --decode: ftp://d1 - URL must start with http:// or https://",
		}},
		{name: "pd static urls validated with discovery", args: with(zmq, "--decode", "d1"), want: []string{"invalid value for --decode: d1 - URL must start with http:// or https://"}},
		{name: "bootstrap port zero", args: []string{"--vllm-pd-disaggregation", "--prefill", "http://p1", "0", "--decode", "http://d1"},
			want: []string{"invalid value for --prefill: http://p1 0 - Port must be between 1 and 65535"}},
		{name: "bootstrap port too big (file)", args: pd, mutate: func(c *Config) { c.Prefill[0].BootstrapPort = ptr(70000) },
			want: []string{"invalid value for --prefill: http://p1:8000 70000 - Port must be between 1 and 65535"}},
		{name: "openai without url", args: []string{"--backend", "openai"}, want: []string{"validation failed: OpenAI mode requires exactly one --worker-urls entry"}},
		{name: "openai two urls", args: []string{"--runtime", "openai", "--worker-urls", "http://a", "http://b"}, want: []string{"validation failed: OpenAI mode requires exactly one --worker-urls entry"}},
		{name: "openai relative url", args: []string{"--backend", "openai", "--worker-urls", "api.openai.com"}, want: []string{"validation failed: Invalid OpenAI worker URL 'api.openai.com': relative URL without a base"}},
		{name: "openai empty host", args: []string{"--backend", "openai", "--worker-urls", "https://"}, want: []string{"validation failed: Invalid OpenAI worker URL 'https://': empty host"}},
		{name: "openai unparsable", args: []string{"--backend", "openai", "--worker-urls", "http://[x"}, want: []string{"validation failed: Invalid OpenAI worker URL 'http://[x': missing ']' in host"}},

		// Rule 2: policy.
		{name: "cache threshold", args: with(w, "--cache-threshold", "1.5"), want: []string{"invalid value for --cache-threshold: 1.5 - Must be between 0.0 and 1.0"}},
		{name: "cache threshold negative", args: with(w, "--cache-threshold", "-0.1"), want: []string{"invalid value for --cache-threshold: -0.1 - Must be between 0.0 and 1.0"}},
		{name: "cache threshold NaN", args: with(w, "--cache-threshold", "NaN"), want: []string{"invalid value for --cache-threshold: NaN - Must be between 0.0 and 1.0"}},
		{name: "balance rel", args: with(w, "--balance-rel-threshold", "0.9"), want: []string{"invalid value for --balance-rel-threshold: 0.9 - Must be >= 1.0"}},
		{name: "eviction interval", args: with(w, "--eviction-interval", "0"), want: []string{"invalid value for --eviction-interval: 0 - Must be > 0"}},
		{name: "max tree size", args: with(w, "--max-tree-size", "0"), want: []string{"invalid value for --max-tree-size: 0 - Must be > 0"}},
		{name: "cache params checked for a pd side policy", args: with(pd, "--policy", "random", "--decode-policy", "cache_aware", "--cache-threshold", "2"),
			want: []string{"invalid value for --cache-threshold: 2 - Must be between 0.0 and 1.0"}},
		{name: "bad policy names (file)", args: w, mutate: func(c *Config) { c.Policy = "lru"; c.PrefillPolicy = "x" }, want: []string{
			"invalid value for --policy: lru - Must be one of: random, round_robin, cache_aware, power_of_two, consistent_hash, rendezvous_hash, kv_aware",
			"invalid value for --prefill-policy: x - Must be one of: random, round_robin, cache_aware, power_of_two, consistent_hash, rendezvous_hash, kv_aware",
		}},

		// Rule 3: server.
		{name: "port zero", args: with(w, "--port", "0"), want: []string{"invalid value for --port: 0 - Port must be > 0"}},
		{name: "server zeros", args: with(w, "--max-payload-size", "0", "--request-timeout-secs", "0", "--worker-startup-timeout-secs", "0", "--worker-startup-check-interval", "0"), want: []string{
			"invalid value for --max-payload-size: 0 - Must be > 0",
			"invalid value for --request-timeout-secs: 0 - Must be > 0",
			"invalid value for --worker-startup-timeout-secs: 0 - Must be > 0",
			"invalid value for --worker-startup-check-interval: 0 - Must be > 0",
		}},

		// Rule 4: discovery.
		{name: "discovery port", args: []string{"--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"}, want: []string{"invalid value for --service-discovery-port: 0 - Port must be > 0"}},
		{name: "regular discovery without selector", args: []string{"--service-discovery"}, want: []string{"validation failed: Regular mode with service discovery requires a non-empty selector"}},
		{name: "openai discovery", args: []string{"--backend", "openai", "--worker-urls", "http://a", "--service-discovery"}, want: []string{"validation failed: OpenAI mode does not support service discovery"}},
		{name: "selector item without =", args: []string{"--service-discovery", "--selector", "app"}, want: []string{
			"validation failed: Regular mode with service discovery requires a non-empty selector",
			"invalid value for --selector: app - Must be key=value",
		}},

		// Rule 5: metrics.
		{name: "prometheus port", args: with(w, "--prometheus-port", "0"), want: []string{"invalid value for --prometheus-port: 0 - Port must be > 0"}},
		{name: "prometheus empty host", args: with(w, "--prometheus-host", ""), want: []string{`invalid value for --prometheus-host: "" - Host cannot be empty`}},
		{name: "prometheus hostname", args: with(w, "--prometheus-host", "localhost"), want: []string{"invalid value for --prometheus-host: localhost - Must be an IP address"}},

		// Rule 6: compatibility.
		{name: "power of two one worker", args: with(w, "--policy", "power_of_two"), want: []string{"incompatible configuration: Power-of-two policy requires at least 2 workers"}},
		{name: "power of two no worker", args: []string{"--policy", "power_of_two"}, want: []string{msgRegularNeedsWorkers, "incompatible configuration: Power-of-two policy requires at least 2 workers"}},
		{name: "power of two prefill and decode", args: with(pd, "--prefill-policy", "power_of_two", "--decode-policy", "power_of_two"), want: []string{
			"incompatible configuration: Power-of-two policy for prefill requires at least 2 prefill workers",
			"incompatible configuration: Power-of-two policy for decode requires at least 2 decode workers",
		}},
		{name: "power of two sides ignored with discovery", args: with(zmq, "--prefill-policy", "power_of_two", "--decode-policy", "power_of_two")},
		{name: "moriio without discovery", args: with(pd, "--kv-connector", "moriio"), want: []string{msgMoRI}},
		{name: "moriio in regular mode", args: with(w, "--kv-connector", "moriio", "--vllm-discovery-address", "0.0.0.0:1"), want: []string{msgMoRI}},

		// Rule 7: retry.
		{name: "retry zero", args: with(w, "--retry-max-retries", "0"), want: []string{"invalid value for --retry-max-retries: 0 - Must be >= 1 (set to 1 to effectively disable retries)"}},
		{name: "retry backoffs", args: with(w, "--retry-initial-backoff-ms", "0", "--retry-backoff-multiplier", "0.5", "--retry-jitter-factor", "1.5"), want: []string{
			"invalid value for --retry-initial-backoff-ms: 0 - Must be > 0",
			"invalid value for --retry-backoff-multiplier: 0.5 - Must be >= 1.0",
			"invalid value for --retry-jitter-factor: 1.5 - Must be between 0.0 and 1.0",
		}},
		{name: "retry max below initial", args: with(w, "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "99"), want: []string{"invalid value for --retry-max-backoff-ms: 99 - Must be >= initial_backoff_ms"}},

		// Rule 8: circuit breaker.
		{name: "cb zeros", args: with(w, "--cb-failure-threshold", "0", "--cb-success-threshold", "0", "--cb-timeout-duration-secs", "0", "--cb-window-duration-secs", "0"), want: []string{
			"invalid value for --cb-failure-threshold: 0 - Must be >= 1 (set to u32::MAX to effectively disable CB)",
			"invalid value for --cb-success-threshold: 0 - Must be >= 1",
			"invalid value for --cb-timeout-duration-secs: 0 - Must be > 0",
			"invalid value for --cb-window-duration-secs: 0 - Must be > 0",
		}},

		// Switchyard rules.
		{name: "bad enums (file)", args: w, mutate: func(c *Config) {
			c.Backend, c.LogLevel, c.HistoryBackend, c.KVConnector, c.LogFormat, c.DecodeOutputLength = "x", "trace", "", "lmcache", "yaml", "max"
		}, want: []string{
			"invalid value for --backend: x - Must be one of: vllm, trtllm, openai, anthropic",
			"invalid value for --log-level: trace - Must be one of: debug, info, warn, error, warning, critical",
			`invalid value for --history-backend: "" - Must be one of: memory, none`,
			"invalid value for --kv-connector: lmcache - Must be one of: nixl, mooncake, moriio, p2pnccl",
			"invalid value for --log-format: yaml - Must be one of: text, json",
			"invalid value for --decode-output-length: max - Must be one of: exact, toy-proxy",
		}},
		{name: "history bounds", args: with(w, "--history-max-entries", "0", "--history-ttl-secs", "0"), want: []string{
			"invalid value for --history-max-entries: 0 - Must be >= 1",
			"invalid value for --history-ttl-secs: 0 - Must be a finite number > 0",
		}},
		{name: "otel sampling ratio", args: with(w, "--otel-sampling-ratio", "1.5"), want: []string{"invalid value for --otel-sampling-ratio: 1.5 - Must be between 0.0 and 1.0"}},
		{name: "discovery address not host:port", args: with(zmq[:1], "--vllm-discovery-address", "0.0.0.0"), want: []string{"invalid value for --vllm-discovery-address: 0.0.0.0 - Must be host:port"}},
		{name: "discovery address bad port", args: with(zmq[:1], "--vllm-discovery-address", "h:http"), want: []string{"invalid value for --vllm-discovery-address: h:http - Must be host:port"}},
		{name: "discovery address no host", args: with(zmq[:1], "--vllm-discovery-address", ":5555"), want: []string{"invalid value for --vllm-discovery-address: :5555 - Must be host:port"}},
		{name: "discovery address tcp url", args: with(zmq[:1], "--vllm-discovery-address", "tcp://h:1"), want: []string{"invalid value for --vllm-discovery-address: tcp://h:1 - Must be host:port"}},
		{name: "validation urls", args: with(w, "--api-key-validation-urls", "auth.example/v"), want: []string{"invalid value for --api-key-validation-urls: auth.example/v - URL must start with http:// or https://"}},
		{name: "selectors", args: with(w, "--prefill-selector", "=x", "--decode-selector", ""), want: []string{
			"invalid value for --prefill-selector: =x - Must be key=value",
			`invalid value for --decode-selector: "" - Must be key=value`,
		}},
		{name: "negative ints (file)", args: w, mutate: func(c *Config) {
			c.BalanceAbsThreshold, c.IntraNodeDataParallelSize, c.MaxConcurrentRequests, c.QueueSize, c.PDMaxFailovers = -1, -2, -3, -4, -5
			c.PrefillDataParallelSize, c.DecodeDataParallelSize = -6, -7
		}, want: []string{
			"invalid value for --balance-abs-threshold: -1 - Must be >= 0",
			"invalid value for --intra-node-data-parallel-size: -2 - Must be >= 0",
			"invalid value for --prefill-data-parallel-size: -6 - Must be >= 0",
			"invalid value for --decode-data-parallel-size: -7 - Must be >= 0",
			"invalid value for --max-concurrent-requests: -3 - Must be >= 0",
			"invalid value for --queue-size: -4 - Must be >= 0",
			"invalid value for --pd-max-failovers: -5 - Must be >= 0",
		}},
		{name: "max header bytes", args: with(w, "--max-header-bytes", "0"), want: []string{"invalid value for --max-header-bytes: 0 - Must be > 0"}},
		{name: "negative timeouts", args: with(w, "--rate-limit-tokens-per-second", "-1", "--shutdown-timeout-secs", "-1", "--prefill-timeout-secs", "-1",
			"--kv-wait-timeout-secs", "-1", "--stream-idle-timeout-secs", "-1", "--body-read-timeout-secs", "-1", "--connect-timeout-secs", "-1", "--load-poll-interval-secs", "-1"), want: []string{
			"invalid value for --rate-limit-tokens-per-second: -1 - Must be a finite number >= 0",
			"invalid value for --shutdown-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --prefill-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --kv-wait-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --stream-idle-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --body-read-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --connect-timeout-secs: -1 - Must be a finite number >= 0",
			"invalid value for --load-poll-interval-secs: -1 - Must be a finite number >= 0",
		}},
		{name: "infinite timeout", args: with(w, "--shutdown-timeout-secs", "+Inf"), want: []string{"invalid value for --shutdown-timeout-secs: +Inf - Must be a finite number >= 0"}},
		{name: "discovery ttl", args: with(w, "--discovery-ttl-secs", "0"), want: []string{"invalid value for --discovery-ttl-secs: 0 - Must be a finite number > 0"}},
		{name: "unhealthy intervals", args: with(w, "--health-unhealthy-interval-secs", "0", "--health-unhealthy-max-interval-secs", "-1"), want: []string{
			"invalid value for --health-unhealthy-interval-secs: 0 - Must be a finite number > 0",
			"invalid value for --health-unhealthy-max-interval-secs: -1 - Must be a finite number > 0",
		}},
		{name: "ratios", args: with(w, "--retry-budget-ratio", "1.1", "--cb-failure-rate", "-0.5"), want: []string{
			"invalid value for --retry-budget-ratio: 1.1 - Must be between 0.0 and 1.0",
			"invalid value for --cb-failure-rate: -0.5 - Must be between 0.0 and 1.0",
		}},
		{name: "cb extras", args: with(w, "--cb-min-requests", "0", "--cb-half-open-max-requests", "0"), want: []string{
			"invalid value for --cb-min-requests: 0 - Must be >= 1",
			"invalid value for --cb-half-open-max-requests: 0 - Must be >= 1",
		}},

		{name: "flow control", args: with(w, "--flow-control", "--flow-bands", "a=1", "a=2", "b", "c=x", "d=1:-1", "e=1::lifo", "f=2::deadline", "--flow-default-band", "z",
			"--flow-weights", "t=0", "=1", "--flow-max-kv-usage", "1.5", "--flow-poll-interval-secs", "0", "--flow-fairness-header", " "), want: []string{
			"invalid value for --flow-max-kv-usage: 1.5 - Must be between 0.0 and 1.0",
			"invalid value for --flow-poll-interval-secs: 0 - Must be a finite number > 0",
			"invalid value for --flow-bands: a=2 - Band names must be unique",
			"invalid value for --flow-bands: b - Must be NAME=PRIORITY[:QUEUE_TIMEOUT_SECS[:ORDER]] with an integer priority",
			"invalid value for --flow-bands: c=x - Must be NAME=PRIORITY[:QUEUE_TIMEOUT_SECS[:ORDER]] with an integer priority",
			"invalid value for --flow-bands: d=1:-1 - The queue timeout must be a finite number of seconds >= 0",
			"invalid value for --flow-bands: e=1::lifo - The order must be arrival or deadline",
			"invalid value for --flow-default-band: z - Must be one of the --flow-bands names",
			"invalid value for --flow-weights: t=0 - Must be FLOW=WEIGHT with a finite weight > 0",
			"invalid value for --flow-weights: =1 - Must be FLOW=WEIGHT with a finite weight > 0",
			`invalid value for --flow-fairness-header: "" - Must be a header name`,
		}},
		{name: "engine priority without flow control", args: with(w, "--flow-engine-priority"), want: []string{
			"invalid value for --flow-engine-priority: true - Needs --flow-control (the priority is the request's flow-control band)",
		}},
		{name: "prefill rules outside regular mode", args: []string{"--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--flow-control", "--flow-avoid-prefill"}, want: []string{
			"invalid value for --flow-avoid-prefill: true - Regular mode only (the router picks a worker per request there), not vllm_prefill_decode mode",
		}},
		{name: "prefill rules without flow control", args: with(w, "--flow-avoid-prefill", "--flow-isolate-prefill", "--flow-prefill-reserve", "1"), want: []string{
			"invalid value for --flow-avoid-prefill: true - Needs --flow-control (the rule is about the flow-control bands)",
			"invalid value for --flow-isolate-prefill: true - Needs --flow-control (the rule is about the flow-control bands)",
			"invalid value for --flow-prefill-reserve: 1 - Needs --flow-control (the rule is about the flow-control bands)",
		}},
		{name: "flow lists unchecked while flow control is off", args: with(w, "--flow-bands", "b", "--flow-weights", "x")},

		// Order across rules.
		{name: "everything at once, in rule order", args: []string{"--vllm-pd-disaggregation", "--prefill", "x", "--cache-threshold", "3", "--port", "0",
			"--prometheus-host", "any", "--kv-connector", "moriio", "--retry-max-retries", "0", "--cb-success-threshold", "0", "--log-format", "json", "--otel-sampling-ratio", "2"},
			want: []string{
				"validation failed: vLLM PD mode requires at least one decode worker URL",
				"invalid value for --prefill: x - URL must start with http:// or https://",
				"invalid value for --cache-threshold: 3 - Must be between 0.0 and 1.0",
				"invalid value for --port: 0 - Port must be > 0",
				"invalid value for --prometheus-host: any - Must be an IP address",
				msgMoRI,
				"invalid value for --retry-max-retries: 0 - Must be >= 1 (set to 1 to effectively disable retries)",
				"invalid value for --cb-success-threshold: 0 - Must be >= 1",
				"invalid value for --otel-sampling-ratio: 2 - Must be between 0.0 and 1.0",
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := parse(t, tc.args...)
			if tc.mutate != nil {
				tc.mutate(c)
			}
			got := messages(t, c.Validate())
			if diff := cmp.Diff(tc.want, got, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Validate() (-want +got):\n%s", diff)
			}
		})
	}
}

func TestErrorFields(t *testing.T) {
	c := parse(t, "--worker-urls", "http://w", "--cache-threshold", "1.5")
	var ce *Error
	if !errors.As(c.Validate(), &ce) {
		t.Fatal("no *Error")
	}
	want := &Error{Field: "--cache-threshold", Value: "1.5", Reason: "Must be between 0.0 and 1.0", Kind: KindInvalidValue}
	if diff := cmp.Diff(want, ce); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	for k, s := range map[Kind]string{KindInvalidValue: "invalid_value", KindValidationFailed: "validation_failed", KindIncompatible: "incompatible",
		KindNotSupported: "not_supported", KindUsage: "usage", KindConfigFile: "config_file", Kind(0): "unknown"} {
		if k.String() != s {
			t.Errorf("Kind(%d).String() = %q, want %q", k, k.String(), s)
		}
	}
	if got := (&Error{Kind: KindNotSupported, Field: "--x", Reason: "why"}).Error(); got != "not supported: --x (why)" {
		t.Errorf("got %q", got)
	}
}

func TestModeAndDiscovery(t *testing.T) {
	tests := []struct {
		args  []string
		mode  Mode
		hasSD bool
	}{
		{nil, ModeRegular, false},
		{[]string{"--backend", "trtllm"}, ModeRegular, false},
		{[]string{"--vllm-pd-disaggregation"}, ModeVLLMPD, false},
		{[]string{"--vllm-pd-disaggregation", "--vllm-discovery-address", "h:1"}, ModeVLLMPD, true},
		{[]string{"--vllm-discovery-address", "h:1"}, ModeRegular, false},
		{[]string{"--service-discovery"}, ModeRegular, true},
		{[]string{"--backend", "openai", "--vllm-pd-disaggregation"}, ModeOpenAI, false},
		{[]string{"--enable-igw", "--backend", "openai"}, ModeIGW, false},
	}
	for _, tc := range tests {
		c := parse(t, tc.args...)
		if c.Mode() != tc.mode || c.HasServiceDiscovery() != tc.hasSD {
			t.Errorf("%q: Mode=%q HasServiceDiscovery=%v, want %q %v", tc.args, c.Mode(), c.HasServiceDiscovery(), tc.mode, tc.hasSD)
		}
	}
}

func TestValidateCannotPanicOnExtremes(t *testing.T) {
	c := Default()
	c.CacheThreshold = math.Inf(1)
	c.DiscoveryTTLSecs = math.NaN()
	c.Prefill = []PrefillWorker{{URL: "http://p", BootstrapPort: ptr(-1)}}
	c.VLLMPDDisaggregation = true
	if err := c.Validate(); err == nil {
		t.Fatal("no error")
	}
}
