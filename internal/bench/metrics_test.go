package bench

import (
	"testing"
	"time"
)

const ms = time.Millisecond

// handOutputs is a small run worked by hand in TestComputeMetricsByHand.
func handOutputs() []RequestOutput {
	return []RequestOutput{
		{ // A: 3 tokens reported by usage
			Success: true, PromptLen: 10, OutputTokens: 3, TokenEvents: 3,
			Start: 0, TTFT: 100 * ms, ITL: []time.Duration{20 * ms, 30 * ms}, Latency: 150 * ms,
		},
		{ // B: a single token
			Success: true, PromptLen: 20, OutputTokens: 1, TokenEvents: 1,
			Start: 50 * ms, TTFT: 200 * ms, Latency: 200 * ms,
		},
		{ // C: failed, must not count anywhere but "failed"
			Success: false, Error: "Internal Server Error", PromptLen: 99,
			Start: 10 * ms, TTFT: 5 * ms, Latency: 0,
		},
		{ // D: server sent no usage: output_len falls back to token events (2)
			Success: true, PromptLen: 5, TokenEvents: 2,
			Start: 1200 * ms, TTFT: 50 * ms, ITL: []time.Duration{10 * ms}, Latency: 60 * ms,
		},
	}
}

func TestComputeMetricsByHand(t *testing.T) {
	m := computeMetrics(handOutputs(), 2*time.Second, []float64{50, 99},
		map[string]float64{"ttft": 100, "tpot": 25})

	if m.Completed != 3 || m.Failed != 1 {
		t.Fatalf("completed/failed = %d/%d, want 3/1", m.Completed, m.Failed)
	}
	if m.TotalInput != 35 || m.TotalOutput != 6 {
		t.Errorf("total input/output = %d/%d, want 35/6", m.TotalInput, m.TotalOutput)
	}
	if got := m.OutputLens; len(got) != 4 || got[0] != 3 || got[1] != 1 || got[2] != 0 || got[3] != 2 {
		t.Errorf("output lens = %v, want [3 1 0 2]", got)
	}
	// Goodput: A meets ttft 100 and tpot 25 exactly (inclusive); B misses
	// ttft; D meets both.
	if m.GoodCompleted != 2 {
		t.Errorf("good = %d, want 2", m.GoodCompleted)
	}
	checks := []struct {
		name      string
		got, want float64
	}{
		{"request throughput", m.RequestThroughput, 1.5},
		{"goodput", m.RequestGoodput, 1.0},
		{"output throughput", m.OutputThroughput, 3},
		{"total token throughput", m.TotalTokenThroughput, 20.5},
		// TTFT [100, 200, 50]
		{"mean ttft", m.TTFT.Mean, 350.0 / 3},
		{"median ttft", m.TTFT.Median, 100},
		{"p99 ttft", m.TTFT.Percentiles[1].Value, 198}, // index 1.98 over [50 100 200]
		// TPOT: A (150-100)/2 = 25, D (60-50)/1 = 10; B excluded (1 token)
		{"mean tpot", m.TPOT.Mean, 17.5},
		{"median tpot", m.TPOT.Median, 17.5},
		{"p99 tpot", m.TPOT.Percentiles[1].Value, 24.85},
		// ITL pooled: [20, 30, 10]
		{"mean itl", m.ITL.Mean, 20},
		{"median itl", m.ITL.Median, 20},
		{"p50 itl", m.ITL.Percentiles[0].Value, 20},
		// E2EL [150, 200, 60]
		{"mean e2el", m.E2EL.Mean, 410.0 / 3},
		{"median e2el", m.E2EL.Median, 150},
		// Token events: 0.10 0.12 0.15 0.25 in second 0; 1.25 1.26 in second 1.
		{"peak tokens/s", m.MaxOutputTokensPerS, 4},
	}
	for _, c := range checks {
		if !near(c.got, c.want) {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	// A [0, 150ms) and B [50ms, 250ms) overlap; D is alone.
	if m.MaxConcurrentRequests != 2 {
		t.Errorf("peak concurrency = %d, want 2", m.MaxConcurrentRequests)
	}
	if m.TPOT.N() != 2 || m.ITL.N() != 3 {
		t.Errorf("tpot n=%d itl n=%d, want 2 and 3", m.TPOT.N(), m.ITL.N())
	}
}

func TestGoodputSingleTokenCountsAsZeroTPOT(t *testing.T) {
	out := []RequestOutput{{Success: true, OutputTokens: 1, TokenEvents: 1, TTFT: 10 * ms, Latency: 500 * ms}}
	m := computeMetrics(out, time.Second, []float64{99}, map[string]float64{"tpot": 0})
	if m.GoodCompleted != 1 {
		t.Errorf("a 1-token request has TPOT 0 for goodput; good = %d, want 1", m.GoodCompleted)
	}
	m = computeMetrics(out, time.Second, []float64{99}, map[string]float64{"e2el": 499.999})
	if m.GoodCompleted != 0 {
		t.Errorf("e2el 500ms > 499.999ms SLO counted as good")
	}
	m = computeMetrics(out, time.Second, []float64{99}, map[string]float64{"e2el": 500})
	if m.GoodCompleted != 1 {
		t.Errorf("e2el SLO is inclusive; good = %d, want 1", m.GoodCompleted)
	}
}

func TestPeakConcurrencyHalfOpen(t *testing.T) {
	mk := func(start, lat time.Duration) RequestOutput {
		return RequestOutput{Success: true, TokenEvents: 1, Start: start, TTFT: lat, Latency: lat}
	}
	cases := []struct {
		name string
		outs []RequestOutput
		want int
	}{
		{"back to back", []RequestOutput{mk(0, time.Second), mk(time.Second, time.Second)}, 1},
		{"nested", []RequestOutput{mk(0, 10*time.Second), mk(time.Second, time.Second), mk(1500*ms, time.Second), mk(5*time.Second, time.Second)}, 3},
		{"identical", []RequestOutput{mk(0, time.Second), mk(0, time.Second), mk(0, time.Second)}, 3},
		{"none", []RequestOutput{{Success: false}}, 0},
	}
	for _, c := range cases {
		if _, got := peaks(c.outs); got != c.want {
			t.Errorf("%s: peak = %d, want %d", c.name, got, c.want)
		}
	}
}

func TestMetricsEmptyRun(t *testing.T) {
	m := computeMetrics([]RequestOutput{{Error: "x"}, {Error: "y"}}, time.Second, []float64{99}, nil)
	if m.Completed != 0 || m.Failed != 2 || m.TTFT.Mean != 0 || m.MaxOutputTokensPerS != 0 {
		t.Errorf("unexpected metrics for an all-failed run: %+v", m)
	}
	m = computeMetrics(nil, 0, []float64{99}, nil)
	if m.RequestThroughput != 0 {
		t.Errorf("zero duration must not divide by zero")
	}
}
