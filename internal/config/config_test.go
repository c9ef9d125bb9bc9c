package config

import (
	"math"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestEffectiveRetry(t *testing.T) {
	c := parse(t, "--retry-max-retries", "7", "--retry-initial-backoff-ms", "10", "--retry-max-backoff-ms", "2000",
		"--retry-backoff-multiplier", "2", "--retry-jitter-factor", "0.1", "--retry-budget-ratio", "0.3")
	want := RetryConfig{MaxAttempts: 7, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 2 * time.Second,
		BackoffMultiplier: 2, JitterFactor: 0.1, BudgetRatio: 0.3}
	if diff := cmp.Diff(want, c.EffectiveRetry()); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	c.DisableRetries = true
	want.MaxAttempts = 1
	if diff := cmp.Diff(want, c.EffectiveRetry()); diff != "" {
		t.Errorf("disabled (-want +got):\n%s", diff)
	}
}

func TestEffectiveCircuitBreaker(t *testing.T) {
	c := parse(t)
	want := CircuitBreakerConfig{FailureThreshold: 10, SuccessThreshold: 3, OpenDuration: time.Minute, Window: 2 * time.Minute,
		FailureRate: 0.5, MinRequests: 20, HalfOpenMax: 1}
	if diff := cmp.Diff(want, c.EffectiveCircuitBreaker()); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	c.DisableCircuitBreaker = true
	want.Disabled, want.FailureThreshold, want.FailureRate = true, math.MaxUint32, 0
	if diff := cmp.Diff(want, c.EffectiveCircuitBreaker()); diff != "" {
		t.Errorf("disabled (-want +got):\n%s", diff)
	}
}

func TestEffectivePoliciesAndLists(t *testing.T) {
	c := parse(t, "--policy", "random")
	if c.EffectivePrefillPolicy() != "random" || c.EffectiveDecodePolicy() != "random" {
		t.Errorf("fallback: %q %q", c.EffectivePrefillPolicy(), c.EffectiveDecodePolicy())
	}
	c = parse(t, "--policy", "random", "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two")
	if c.EffectivePrefillPolicy() != "cache_aware" || c.EffectiveDecodePolicy() != "power_of_two" {
		t.Errorf("explicit: %q %q", c.EffectivePrefillPolicy(), c.EffectiveDecodePolicy())
	}

	c = parse(t)
	if diff := cmp.Diff([]string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"}, c.EffectiveRequestIDHeaders()); diff != "" {
		t.Errorf("request-id default (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"/health", "/health_generate", "/liveness", "/readiness"}, c.EffectiveOtelExcludedPaths()); diff != "" {
		t.Errorf("otel default (-want +got):\n%s", diff)
	}
	c = parse(t, "--request-id-headers", "x-a", "--otel-excluded-paths", "/m")
	hs := c.EffectiveRequestIDHeaders()
	hs[0] = "mutated"
	if diff := cmp.Diff([]string{"x-a"}, c.EffectiveRequestIDHeaders()); diff != "" {
		t.Errorf("request-id set (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"/m"}, c.EffectiveOtelExcludedPaths()); diff != "" {
		t.Errorf("otel set (-want +got):\n%s", diff)
	}
}

func TestSelectors(t *testing.T) {
	c := parse(t, "--selector", "app=vllm", "tier=a=b", "junk", "--prefill-selector", "role=p", "--decode-selector", "role=d")
	want := []map[string]string{{"app": "vllm", "tier": "a=b"}, {"role": "p"}, {"role": "d"}}
	if diff := cmp.Diff(want, []map[string]string{c.SelectorMap(), c.PrefillSelectorMap(), c.DecodeSelectorMap()}); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestDurations(t *testing.T) {
	c := parse(t, "--stream-idle-timeout-secs", "0.25", "--connect-timeout-secs", "0")
	got := []time.Duration{c.RequestTimeout(), c.WorkerStartupTimeout(), c.WorkerStartupCheckInterval(), c.EvictionInterval(),
		c.HealthCheckTimeout(), c.HealthCheckInterval(), c.QueueTimeout(), c.ShutdownTimeout(), c.PrefillTimeout(),
		c.KVWaitTimeout(), c.StreamIdleTimeout(), c.ConnectTimeout(), c.DiscoveryTTL(), c.LoadPollInterval(), c.BodyReadTimeout()}
	want := []time.Duration{1800 * time.Second, 600 * time.Second, 30 * time.Second, 120 * time.Second,
		5 * time.Second, 60 * time.Second, 60 * time.Second, 30 * time.Second, 0,
		300 * time.Second, 250 * time.Millisecond, 0, 9 * time.Second, 0, 60 * time.Second}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if secondsU(math.MaxUint64) != math.MaxInt64 || secondsF(1e300) != math.MaxInt64 || secondsF(math.NaN()) != 0 || secondsF(-1) != 0 {
		t.Errorf("saturation broken")
	}
}

func TestWarnings(t *testing.T) {
	tests := []struct {
		args []string
		want []string
	}{
		{[]string{"--worker-urls", "http://w"}, nil},
		{[]string{"--runtime", "anthropic"}, []string{"WARNING: runtime 'anthropic' not implemented yet; falling back to regular routing. Provide --worker-urls or PD flags as usual."}},
		{[]string{"--prefill", "http://p", "--vllm-discovery-address", "h:1"}, []string{
			"--prefill/--decode are ignored without --vllm-pd-disaggregation",
			"--vllm-discovery-address is ignored without --vllm-pd-disaggregation",
		}},
	}
	for _, tc := range tests {
		if diff := cmp.Diff(tc.want, parse(t, tc.args...).Warnings()); diff != "" {
			t.Errorf("%q (-want +got):\n%s", tc.args, diff)
		}
	}
}

func TestRedacted(t *testing.T) {
	c := parse(t, "--api-key", "sk-1", "--admin-api-key", "adm", "--router-api-keys", "a", "b", "--host", "h")
	r := c.Redacted()
	if r.APIKey != "REDACTED" || r.AdminAPIKey != "REDACTED" || !cmp.Equal(r.RouterAPIKeys, []string{"REDACTED", "REDACTED"}) || r.Host != "h" {
		t.Errorf("redacted: %+v", r)
	}
	if c.APIKey != "sk-1" || c.RouterAPIKeys[0] != "a" {
		t.Errorf("original modified")
	}
	if !r.IsSet("api-key") {
		t.Errorf("explicit lost")
	}
	if d := Default().Redacted(); d.APIKey != "" || d.RouterAPIKeys != nil {
		t.Errorf("empty secrets redacted: %+v", d)
	}
}

func TestExplicitIsACopy(t *testing.T) {
	c := parse(t, "--port", "1")
	c.Explicit()["host"] = true
	if c.IsSet("host") {
		t.Error("Explicit() exposed internal state")
	}
	if !c.IsSet("port") || c.IsSet("policy") {
		t.Errorf("explicit = %v", c.Explicit())
	}
}

func TestRoleDPSizes(t *testing.T) {
	for _, tc := range []struct {
		args         []string
		prefill, dec int
	}{
		{nil, 1, 1},
		{[]string{"--intra-node-data-parallel-size", "2"}, 2, 2},
		{[]string{"--intra-node-data-parallel-size", "0"}, 1, 1},
		// P dp=2, D dp=1: the decode must not be expanded (vLLM 400s on a rank it lacks)
		{[]string{"--prefill-data-parallel-size", "2"}, 2, 1},
		{[]string{"--intra-node-data-parallel-size", "4", "--decode-data-parallel-size", "1"}, 4, 1},
		{[]string{"--prefill-data-parallel-size", "2", "--decode-data-parallel-size", "8", "--intra-node-data-parallel-size", "4"}, 2, 8},
	} {
		c := parse(t, append([]string{"--vllm-pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1"}, tc.args...)...)
		if err := c.Validate(); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if p, d := c.PrefillDPSize(), c.DecodeDPSize(); p != tc.prefill || d != tc.dec {
			t.Errorf("%v: prefill %d decode %d, want %d %d", tc.args, p, d, tc.prefill, tc.dec)
		}
	}
}

func TestPDDeadlineDefaults(t *testing.T) {
	c := Default()
	if c.KVWaitTimeout() != 300*time.Second || c.StreamIdleTimeout() != 300*time.Second {
		t.Fatalf("kv wait %s, stream idle %s; want bounded 300 s defaults", c.KVWaitTimeout(), c.StreamIdleTimeout())
	}
	if c.PDSplitResponses {
		t.Fatal("/v1/responses must be unsplit by default")
	}
	c = parse(t, "--kv-wait-timeout-secs", "0", "--stream-idle-timeout-secs", "0")
	if c.KVWaitTimeout() != 0 || c.StreamIdleTimeout() != 0 {
		t.Fatal("0 must still turn the deadlines off")
	}
}

func TestBodyReadTimeout(t *testing.T) {
	if d := Default().BodyReadTimeout(); d != 60*time.Second {
		t.Fatalf("default body read timeout %s, want 60 s", d)
	}
	if d := parse(t, "--body-read-timeout-secs", "0.3").BodyReadTimeout(); d != 300*time.Millisecond {
		t.Fatalf("--body-read-timeout-secs 0.3: %s", d)
	}
	c := parse(t, "--body-read-timeout-secs", "0", "--worker-urls", "http://w:8000")
	if d := c.BodyReadTimeout(); d != 0 {
		t.Fatalf("--body-read-timeout-secs 0: %s, want 0 (none)", d)
	}
	if err := c.Validate(); err != nil {
		t.Fatalf("0 must be valid: %v", err)
	}
}
