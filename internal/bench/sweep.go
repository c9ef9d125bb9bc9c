package bench

import (
	"bufio"
	"fmt"
	"io"

	"github.com/switchyard-llm/switchyard/internal/bench/chart"
)

// SweepRow is one line of a MORIIO-RESULTS.md style table. Latencies are in
// ms.
type SweepRow struct {
	Router      string
	Mode        string
	Concurrency int
	Failed      int
	// RequestThroughput is completed requests per second.
	RequestThroughput float64
	TTFTP50, TTFTP99  float64
	TPOTP50, TPOTP99  float64
	ITLP50, ITLP99    float64
}

// NewSweepRow summarises a run. The concurrency is the run's
// MaxConcurrency, or its measured peak when the run had no cap.
func NewSweepRow(router, mode string, r *Result) SweepRow {
	c := r.Config.MaxConcurrency
	if c <= 0 {
		c = r.Metrics.MaxConcurrentRequests
	}
	m := &r.Metrics
	return SweepRow{
		Router:            router,
		Mode:              mode,
		Concurrency:       c,
		Failed:            m.Failed,
		RequestThroughput: m.RequestThroughput,
		TTFTP50:           m.TTFT.At(50),
		TTFTP99:           m.TTFT.At(99),
		TPOTP50:           m.TPOT.At(50),
		TPOTP99:           m.TPOT.At(99),
		ITLP50:            m.ITL.At(50),
		ITLP99:            m.ITL.At(99),
	}
}

// Sweep collects rows of a concurrency sweep.
type Sweep struct {
	// Title is used for the plot (the Markdown has no title line).
	Title string
	Rows  []SweepRow
}

// Add appends the summary of r.
func (s *Sweep) Add(router, mode string, r *Result) {
	s.Rows = append(s.Rows, NewSweepRow(router, mode, r))
}

// WriteMarkdown writes the rows as the table layout of MORIIO-RESULTS.md:
//
//	| Router | Mode | C | Failed | Req/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms |
func (s *Sweep) WriteMarkdown(w io.Writer) error {
	bw := bufio.NewWriter(w)
	fmt.Fprintln(bw, "| Router | Mode | C | Failed | Req/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms |")
	fmt.Fprintln(bw, "|---|---|---|---|---|---|---|---|")
	for _, r := range s.Rows {
		fmt.Fprintf(bw, "| %s | %s | %d | %d | %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |\n",
			r.Router, r.Mode, r.Concurrency, r.Failed, r.RequestThroughput,
			r.TTFTP50, r.TTFTP99, r.TPOTP50, r.TPOTP99, r.ITLP50, r.ITLP99)
	}
	return bw.Flush()
}

// WritePlot writes a PNG with two panels, TTFT and TPOT against
// concurrency (log2 axis). Each Router/Mode pair is one colour; P50 is
// drawn solid and P99 dashed.
func (s *Sweep) WritePlot(w io.Writer) error {
	ttft, tpot := s.Panels()
	return chart.WritePNG(w, chart.Options{Width: 1200, Height: 520, Title: s.Title}, ttft, tpot)
}

// Panels returns the TTFT and TPOT panels WritePlot draws: one colour per
// Router/Mode pair in order of first appearance, P50 solid and P99 dashed,
// points in row order.
func (s *Sweep) Panels() (ttft, tpot chart.Panel) {
	type key struct{ router, mode string }
	var order []key
	groups := map[key][]SweepRow{}
	for _, r := range s.Rows {
		k := key{r.Router, r.Mode}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r)
	}
	ttft = chart.Panel{Title: "TTFT vs concurrency", XLabel: "concurrency", YLabel: "TTFT ms", LogX: true}
	tpot = chart.Panel{Title: "TPOT vs concurrency", XLabel: "concurrency", YLabel: "TPOT ms", LogX: true}
	for i, k := range order {
		rows := groups[k]
		col := chart.Palette[i%len(chart.Palette)]
		var x, t50, t99, p50, p99 []float64
		for _, r := range rows {
			x = append(x, float64(r.Concurrency))
			t50 = append(t50, r.TTFTP50)
			t99 = append(t99, r.TTFTP99)
			p50 = append(p50, r.TPOTP50)
			p99 = append(p99, r.TPOTP99)
		}
		name := k.router
		if k.mode != "" {
			name += " " + k.mode
		}
		ttft.Series = append(ttft.Series,
			chart.Series{Name: name + " P50", X: x, Y: t50, Color: col},
			chart.Series{Name: name + " P99", X: x, Y: t99, Color: col, Dashed: true})
		tpot.Series = append(tpot.Series,
			chart.Series{Name: name + " P50", X: x, Y: p50, Color: col},
			chart.Series{Name: name + " P99", X: x, Y: p99, Color: col, Dashed: true})
	}
	return ttft, tpot
}
