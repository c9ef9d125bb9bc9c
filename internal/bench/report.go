package bench

import (
	"bufio"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// center pads s to width n with fill, as Python's "{:{c}^{n}}" (the extra
// fill character goes to the right).
func center(s string, n int, fill byte) string {
	if len(s) >= n {
		return s
	}
	pad := n - len(s)
	left := pad / 2
	return strings.Repeat(string(fill), left) + s + strings.Repeat(string(fill), pad-left)
}

// percentWord formats a percentile as vLLM's p_word: "99", "99.9".
func percentWord(p float64) string {
	if p == math.Trunc(p) {
		return strconv.Itoa(int(p))
	}
	return strconv.FormatFloat(p, 'f', -1, 64)
}

type metricSpec struct {
	key, name, header string
	stats             func(*Metrics) *Stats
}

// metricSpecs lists the percentile metrics in vLLM's print order.
var metricSpecs = []metricSpec{
	{MetricTTFT, "TTFT", "Time to First Token", func(m *Metrics) *Stats { return &m.TTFT }},
	{MetricTPOT, "TPOT", "Time per Output Token (excl. 1st token)", func(m *Metrics) *Stats { return &m.TPOT }},
	{MetricITL, "ITL", "Inter-token Latency", func(m *Metrics) *Stats { return &m.ITL }},
	{MetricE2EL, "E2EL", "End-to-end Latency", func(m *Metrics) *Stats { return &m.E2EL }},
	{MetricQueue, "Client Queue Time", "Client-side Queueing", func(m *Metrics) *Stats { return &m.Queue }},
	{MetricE2ELInclQueue, "E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency", func(m *Metrics) *Stats { return &m.E2ELInclQueue }},
}

// metricApplies mirrors when vLLM computes the queue metrics at all: only
// with --max-concurrency, and the queue-inclusive E2EL only with a finite
// request rate as well.
func (r *Result) metricApplies(key string) bool {
	switch key {
	case MetricQueue:
		return r.Config.MaxConcurrency > 0
	case MetricE2ELInclQueue:
		return r.Config.MaxConcurrency > 0 && !math.IsInf(r.Config.RequestRate, 1)
	}
	return true
}

// WriteFailures writes vLLM's list of up to 10 failure reasons (nothing when
// every request succeeded). vLLM prints it just before the table.
func (r *Result) WriteFailures(w io.Writer) error {
	bw := bufio.NewWriter(w)
	n := 0
	for i := range r.Outputs {
		o := &r.Outputs[i]
		if o.Success {
			continue
		}
		if n == 0 {
			fmt.Fprintln(bw, "Failed requests during benchmark run detected (capping to 10):")
		}
		fmt.Fprintf(bw, "Error %d: %s\n", n, o.Error)
		n++
		if n == 10 {
			break
		}
	}
	return bw.Flush()
}

// WriteTable writes the "Serving Benchmark Result" table exactly as vllm
// bench serve prints it (§6.5).
func (r *Result) WriteTable(w io.Writer) error {
	bw := bufio.NewWriter(w)
	m := &r.Metrics
	c := &r.Config
	row := func(label string, v int) { fmt.Fprintf(bw, "%-40s %-10d\n", label, v) }
	rowf := func(label string, v float64) { fmt.Fprintf(bw, "%-40s %-10s\n", label, pyFixed2(v)) }

	fmt.Fprintln(bw, center(" Serving Benchmark Result ", 50, '='))
	row("Successful requests:", m.Completed)
	row("Failed requests:", m.Failed)
	if c.MaxConcurrency > 0 {
		row("Maximum request concurrency:", c.MaxConcurrency)
	}
	if !math.IsInf(c.RequestRate, 1) {
		rowf("Request rate configured (RPS):", c.RequestRate)
	}
	rowf("Benchmark duration (s):", r.Duration.Seconds())
	row("Total input tokens:", m.TotalInput)
	row("Total generated tokens:", m.TotalOutput)
	rowf("Request throughput (req/s):", m.RequestThroughput)
	if len(c.Goodput) > 0 {
		rowf("Request goodput (req/s):", m.RequestGoodput)
	}
	rowf("Output token throughput (tok/s):", m.OutputThroughput)
	rowf("Peak output token throughput (tok/s):", m.MaxOutputTokensPerS)
	rowf("Peak concurrent requests:", float64(m.MaxConcurrentRequests))
	rowf("Total token throughput (tok/s):", m.TotalTokenThroughput)
	for _, spec := range metricSpecs {
		if !slices.Contains(c.PercentileMetrics, spec.key) || !r.metricApplies(spec.key) {
			continue
		}
		st := spec.stats(m)
		fmt.Fprintln(bw, center(spec.header, 50, '-'))
		rowf("Mean "+spec.name+" (ms):", st.Mean)
		rowf("Median "+spec.name+" (ms):", st.Median)
		for _, p := range st.Percentiles {
			rowf("P"+percentWord(p.P)+" "+spec.name+" (ms):", p.Value)
		}
	}
	fmt.Fprintln(bw, strings.Repeat("=", 50))
	return bw.Flush()
}

// WriteReport writes the failure list (if any) followed by the table, the
// order in which vllm bench serve prints them.
func (r *Result) WriteReport(w io.Writer) error {
	if err := r.WriteFailures(w); err != nil {
		return err
	}
	return r.WriteTable(w)
}

// pyFixed2 formats like Python's "{:.2f}" (nan/inf spelled as Python does).
func pyFixed2(v float64) string {
	switch {
	case math.IsNaN(v):
		return "nan"
	case math.IsInf(v, 1):
		return "inf"
	case math.IsInf(v, -1):
		return "-inf"
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}
