package bench

import (
	"bytes"
	"os"
	"strings"
	"testing"
	"time"
)

// goldenResult has hand-set metrics; testdata/table.golden was produced by
// running vLLM's own format strings ("{:<40} {:<10.2f}" etc.) in Python
// over the same values, so the test pins byte-for-byte parity, including
// Python's rounding (0.995 -> 0.99, 15000.125 -> 15000.12).
func goldenResult() *Result {
	cfg := DefaultConfig()
	cfg.MaxConcurrency = 16
	cfg.RequestRate = 2.5
	cfg.Goodput = map[string]float64{"ttft": 1000}
	cfg.PercentileMetrics = []string{"e2el", "ttft"} // printed in vLLM's fixed order
	cfg.MetricPercentiles = []float64{99, 99.9}
	st := func(mean, median, p99, p999 float64) Stats {
		return Stats{Mean: mean, Median: median, Percentiles: []Percentile{{99, p99}, {99.9, p999}}}
	}
	return &Result{
		Config:   cfg,
		Duration: time.Duration(155.123456 * float64(time.Second)),
		Metrics: Metrics{
			Completed: 158, Failed: 2, TotalInput: 158000, TotalOutput: 158000,
			RequestThroughput: 1.0185, RequestGoodput: 0.995, OutputThroughput: 1018.5,
			MaxOutputTokensPerS: 1100, MaxConcurrentRequests: 16, TotalTokenThroughput: 123456.789,
			TTFT: st(261.96, 250.004, 997.72, 1200.5),
			E2EL: st(15000.125, 14999.5, 16000, 16500),
		},
	}
}

func TestWriteTableGolden(t *testing.T) {
	var b bytes.Buffer
	if err := goldenResult().WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	want, err := os.ReadFile("testdata/table.golden")
	if err != nil {
		t.Fatal(err)
	}
	if b.String() != string(want) {
		t.Errorf("table mismatch\n got:\n%s\nwant:\n%s", b.String(), want)
	}
}

func TestWriteTableDefaults(t *testing.T) {
	r := goldenResult()
	r.Config = DefaultConfig()
	var b bytes.Buffer
	if err := r.WriteTable(&b); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, absent := range []string{"Maximum request concurrency", "Request rate configured", "Request goodput", "End-to-end"} {
		if strings.Contains(out, absent) {
			t.Errorf("default table should not print %q", absent)
		}
	}
	for _, present := range []string{
		"---------------Time to First Token----------------\n",
		"-----Time per Output Token (excl. 1st token)------\n",
		"---------------Inter-token Latency----------------\n",
		"Median ITL (ms):",
	} {
		if !strings.Contains(out, present) {
			t.Errorf("default table lacks %q", present)
		}
	}
}

func TestWriteFailuresCapsAtTen(t *testing.T) {
	r := &Result{}
	for i := range 15 {
		r.Outputs = append(r.Outputs, RequestOutput{Error: "boom " + itoa(i)})
	}
	r.Outputs = append(r.Outputs, RequestOutput{Success: true})
	var b bytes.Buffer
	if err := r.WriteFailures(&b); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 11 || lines[0] != "Failed requests during benchmark run detected (capping to 10):" ||
		lines[1] != "Error 0: boom 0" || lines[10] != "Error 9: boom 9" {
		t.Errorf("failure list:\n%s", b.String())
	}
	b.Reset()
	_ = (&Result{Outputs: []RequestOutput{{Success: true}}}).WriteFailures(&b)
	if b.Len() != 0 {
		t.Errorf("no failures should print nothing, got %q", b.String())
	}
}

func TestCenterLikePython(t *testing.T) {
	// "{:-^50}".format("Time to First Token"): 31 fill chars, 15 left, 16 right.
	if got := center("Time to First Token", 50, '-'); got != strings.Repeat("-", 15)+"Time to First Token"+strings.Repeat("-", 16) {
		t.Errorf("center = %q", got)
	}
}
