package scenario

import (
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

// benchTransport is a keep-alive pool shared by a warm-up run and the
// measured run that follows, so the measured run opens no connections.
type benchTransport struct{ t *http.Transport }

// newBenchTransport mirrors sybench's own transport for c streams.
func newBenchTransport(c int) *benchTransport {
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	return &benchTransport{t: &http.Transport{
		DialContext:         d.DialContext,
		MaxIdleConnsPerHost: max(c, 16),
		IdleConnTimeout:     90 * time.Second,
		DisableCompression:  true,
		ReadBufferSize:      16 << 10,
		WriteBufferSize:     16 << 10,
	}}
}

func (b *benchTransport) close() { b.t.CloseIdleConnections() }

// OverheadConfig is the router overhead scenario.
type OverheadConfig struct {
	Preset      string // vllm-sim preset of every worker ("zero")
	Concurrency []int
	Input       int
	OutputLen   int
	PromptsPerC float64
	MinPrompts  int
	Seed        int64
	Policy      string
	// PDMode is the MoRI-IO transfer mode of the PD fleet.
	PDMode string
	// Repeats interleaved repetitions of every (C, target) run; tables
	// report medians.
	Repeats      int
	PointTimeout time.Duration
}

// DefaultOverheadConfig: zero-latency workers, C = 64, 256, 1024.
func DefaultOverheadConfig() OverheadConfig {
	return OverheadConfig{
		Preset:       "zero",
		Concurrency:  []int{64, 256, 1024},
		Input:        1000,
		OutputLen:    100,
		PromptsPerC:  8,
		MinPrompts:   5000,
		Seed:         1234,
		Policy:       "consistent_hash",
		PDMode:       "WRITE",
		Repeats:      3,
		PointTimeout: 2 * time.Minute,
	}
}

// QuickOverheadConfig is a smoke run.
func QuickOverheadConfig() OverheadConfig {
	c := DefaultOverheadConfig()
	c.Concurrency = []int{64}
	c.OutputLen = 20
	c.PromptsPerC = 2
	c.MinPrompts = 100
	c.Repeats = 1
	c.PointTimeout = 30 * time.Second
	return c
}

// Overhead targets.
const (
	TargetDirect  = "direct"
	TargetRegular = "regular"
	TargetPD      = "pd"
)

// OverheadRow is one measured run of a (concurrency, target) pair.
type OverheadRow struct {
	Target      string
	Concurrency int
	Rep         int // repetition index
	Prompts     int
	Row         bench.SweepRow
	Completed   int
	// Events is the token events the run streamed (Σ output tokens: every
	// token is one SSE event of the worker, relayed by the router).
	Events int
	// RouterCPU and WorkerCPU are CPU time (user+system) of the router and
	// of the workers during the measured run.
	RouterCPU, WorkerCPU time.Duration
	Wall                 time.Duration
	Stopped              bool
}

// RouterCPUPer1k is router CPU seconds per 1000 completed requests.
func (r OverheadRow) RouterCPUPer1k() float64 { return per1k(r.RouterCPU, r.Completed) }

// RouterCPUPer1kEvents is router CPU seconds per 1000 relayed token events.
func (r OverheadRow) RouterCPUPer1kEvents() float64 { return per1k(r.RouterCPU, r.Events) }

// WorkerCPUPer1k is worker CPU seconds per 1000 completed requests.
func (r OverheadRow) WorkerCPUPer1k() float64 { return per1k(r.WorkerCPU, r.Completed) }

func per1k(d time.Duration, n int) float64 {
	if n == 0 {
		return math.NaN()
	}
	return d.Seconds() * 1000 / float64(n)
}

// OverheadReport is the result of RunOverhead.
type OverheadReport struct {
	Config  OverheadConfig
	Options Options
	Machine string
	Rows    []OverheadRow
	Notes   []string
	Elapsed time.Duration
}

// RunOverhead sends the same load (a) straight to a unified worker, (b)
// through switchyard in regular mode in front of that worker and (c)
// through switchyard in PD mode (1P1D MoRI-IO, registered over ZMQ), all
// with the zero-latency preset so the workers add no simulated time. For
// each concurrency the three targets run back to back; each measured run
// follows an unmeasured warm-up run on the same keep-alive pool. The
// router's CPU time is read from /proc/<pid>/stat around the measured run.
func RunOverhead(ctx context.Context, o Options, c OverheadConfig) (*OverheadReport, error) {
	return runScenario(ctx, o, scenarioSpec[*OverheadReport]{
		name: "overhead", defMax: 12 * time.Minute, skipped: "points",
		report: func(e *env) *OverheadReport {
			return &OverheadReport{Config: c, Options: e.o, Machine: e.m.String()}
		},
		run:   func(ctx context.Context, e *env, rep *OverheadReport) error { return e.runOverhead(ctx, c, rep) },
		files: []scenarioFile[*OverheadReport]{{"overhead.md", (*OverheadReport).WriteMarkdown}},
	})
}

func (e *env) runOverhead(ctx context.Context, c OverheadConfig, rep *OverheadReport) error {
	uni, err := e.g.unifiedSim(ctx, c.Preset)
	if err != nil {
		return err
	}
	reg, err := e.g.regularRouter(ctx, uni, c.Policy)
	if err != nil {
		return err
	}
	pd, err := e.g.pdFleet(ctx, c.Preset, c.PDMode, c.Policy)
	if err != nil {
		return err
	}
	type target struct {
		name    string
		base    string
		router  *proc
		workers []int
		all     []*proc
	}
	targets := []target{
		{TargetDirect, uni.URL(), nil, []int{uni.Pid()}, []*proc{uni.proc}},
		{TargetRegular, reg.base, reg.proc, []int{uni.Pid()}, []*proc{reg.proc, uni.proc}},
		{TargetPD, pd.r.base, pd.r.proc, pd.simPids(), pd.procs()},
	}
	for _, conc := range c.Concurrency {
		for k := range max(c.Repeats, 1) {
			for _, t := range targets {
				d, err := e.budget(c.PointTimeout, 15*time.Second)
				if err != nil {
					return err
				}
				n := promptsFor(conc, c.PromptsPerC, c.MinPrompts)
				tr := newBenchTransport(conc)
				l := load{base: t.base, input: c.Input, output: c.OutputLen, concurrency: conc,
					prompts: conc, seed: c.Seed + 1, maxDuration: d / 4, transport: tr}
				// Warm-up: C concurrent requests open C connections (and the
				// router's upstream pool) and are not measured.
				if _, err := l.run(ctx); err != nil {
					tr.close()
					return fmt.Errorf("%s C=%d warm-up: %w", t.name, conc, err)
				}
				l.prompts, l.seed, l.maxDuration = n, c.Seed, d
				var r0, w0 time.Duration
				if t.router != nil {
					r0, _ = cpuTime(t.router.Pid())
				}
				w0 = cpuTimes(t.workers...)
				t1 := time.Now()
				res, err := l.run(ctx)
				wall := time.Since(t1)
				var r1 time.Duration
				if t.router != nil {
					r1, _ = cpuTime(t.router.Pid())
				}
				w1 := cpuTimes(t.workers...)
				tr.close()
				if err != nil {
					return fmt.Errorf("%s C=%d: %w", t.name, conc, err)
				}
				row := OverheadRow{Target: t.name, Concurrency: conc, Rep: k, Prompts: n, Row: sweepRow(t.name, "", res),
					Completed: res.Metrics.Completed, Events: res.Metrics.TotalOutput, RouterCPU: r1 - r0, WorkerCPU: w1 - w0, Wall: wall, Stopped: res.Stopped}
				rep.Rows = append(rep.Rows, row)
				e.printf("#%d %-7s C=%-5d n=%-5d failed %d, %.1f req/s, TTFT p50/p99 %s/%s ms, router CPU %.3f s/1k req, worker CPU %.3f s/1k req (%s)%s\n",
					k+1, t.name, conc, n, row.Row.Failed, row.Row.RequestThroughput, ms(row.Row.TTFTP50), ms(row.Row.TTFTP99),
					row.RouterCPUPer1k(), row.WorkerCPUPer1k(), sec(wall), stoppedMark(row.Stopped))
				if derr := dead(t.all...); derr != nil {
					return fmt.Errorf("%s C=%d: %w", t.name, conc, derr)
				}
			}
		}
	}
	if n := kvProblems(ctx, pd); n != "" {
		rep.Notes = append(rep.Notes, "PD fleet: "+n)
	}
	return nil
}

// overheadAgg is the median over the repetitions of one (target, C).
type overheadAgg struct {
	runs                               int
	prompts, failed, events            int // events: Σ over the repetitions
	reqPerS, ttft50, ttft99            float64
	routerCPU1k, workerCPU1k           float64
	ttft50Lo, ttft50Hi, rcpuLo, rcpuHi float64
	// Per relayed event.
	itl50, itl99, tpot50, cpuPer1kEvents float64
	itl50Lo, itl50Hi                     float64
}

// row aggregates the runs of (target, concurrency).
func (r *OverheadReport) row(target string, c int) (overheadAgg, bool) {
	var a overheadAgg
	var rps, t50, t99, rc, wc, i50, i99, tp50, ce []float64
	for _, x := range r.Rows {
		if x.Target != target || x.Concurrency != c {
			continue
		}
		a.runs++
		a.prompts = x.Prompts
		a.failed += x.Row.Failed
		a.events += x.Events
		rps = append(rps, x.Row.RequestThroughput)
		t50 = append(t50, x.Row.TTFTP50)
		t99 = append(t99, x.Row.TTFTP99)
		rc = append(rc, x.RouterCPUPer1k())
		wc = append(wc, x.WorkerCPUPer1k())
		i50 = append(i50, x.Row.ITLP50)
		i99 = append(i99, x.Row.ITLP99)
		tp50 = append(tp50, x.Row.TPOTP50)
		ce = append(ce, x.RouterCPUPer1kEvents())
	}
	if a.runs == 0 {
		return a, false
	}
	a.reqPerS, a.ttft50, a.ttft99 = medianOf(rps), medianOf(t50), medianOf(t99)
	a.routerCPU1k, a.workerCPU1k = medianOf(rc), medianOf(wc)
	a.ttft50Lo, a.ttft50Hi = slices.Min(t50), slices.Max(t50)
	a.rcpuLo, a.rcpuHi = slices.Min(rc), slices.Max(rc)
	a.itl50, a.itl99, a.tpot50, a.cpuPer1kEvents = medianOf(i50), medianOf(i99), medianOf(tp50), medianOf(ce)
	a.itl50Lo, a.itl50Hi = slices.Min(i50), slices.Max(i50)
	return a, true
}

// medianOf is the median (mean of the middle two for even lengths).
func medianOf(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return math.NaN()
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

func (r *OverheadReport) concurrencies() []int {
	var cs []int
	for _, x := range r.Rows {
		if !slices.Contains(cs, x.Concurrency) {
			cs = append(cs, x.Concurrency)
		}
	}
	return cs
}

// writeEventTable writes what the router adds per relayed token event:
// the inter-token latency against direct and its CPU per event.
func (r *OverheadReport) writeEventTable(b *strings.Builder) {
	b.WriteString("## Per relayed token event\n\n")
	b.WriteString("Every output token is one SSE event of the worker, relayed by the router as it arrives. ITL is the gap between two events " +
		"at the client; the added ITL is the router's per-event latency (regular against direct; PD's decode is a second worker, so its ITL is " +
		"compared with direct too, as an upper bound). Router CPU per 1k events is the router's CPU over Σ output tokens of the run " +
		"(it includes the requests' own routing, so it is an upper bound of the relay's share).\n\n")
	b.WriteString("| C | Target | Events | ITL P50 / P99 ms | Added ITL P50 µs | TPOT P50 ms | Router CPU s / 1k events | Router CPU µs / event |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|\n")
	r.eachRow(func(conc int, t string, x, d overheadAgg, haveD bool) {
		added, cpu, us := "—", "—", "—"
		if haveD && t != TargetDirect {
			added = fmt.Sprintf("%+.0f (%+.0f to %+.0f)", (x.itl50-d.itl50)*1000, (x.itl50Lo-d.itl50)*1000, (x.itl50Hi-d.itl50)*1000)
		}
		if t != TargetDirect {
			cpu = fmt.Sprintf("%.4f", x.cpuPer1kEvents)
			us = fmt.Sprintf("%.1f", x.cpuPer1kEvents*1000)
		}
		fmt.Fprintf(b, "| %d | %s | %d | %s / %s | %s | %s | %s | %s |\n",
			conc, t, x.events, ms(x.itl50), ms(x.itl99), added, ms(x.tpot50), cpu, us)
	})
	b.WriteString("\n")
}

// eachRow calls f for every measured target of every concurrency, in table
// order (direct, regular, pd), with direct's row at that concurrency when
// it was measured.
func (r *OverheadReport) eachRow(f func(conc int, target string, x, direct overheadAgg, haveDirect bool)) {
	for _, conc := range r.concurrencies() {
		d, haveD := r.row(TargetDirect, conc)
		for _, t := range []string{TargetDirect, TargetRegular, TargetPD} {
			if x, ok := r.row(t, conc); ok {
				f(conc, t, x, d, haveD)
			}
		}
	}
}

// WriteMarkdown writes the measurements and the ratios vs direct.
func (r *OverheadReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	if c.Preset == "zero" {
		fmt.Fprintf(&b, "# Router overhead (zero-latency simulated workers)\n\n")
	} else {
		fmt.Fprintf(&b, "# Router overhead (simulated workers, preset %s)\n\n", c.Preset)
	}
	fmt.Fprintf(&b, "Generated by `%s`.\n\n", orDefault(r.Options.Command, "sybench scenario overhead"))
	fmt.Fprintf(&b, "- Machine: %s.\n", r.Machine)
	fmt.Fprintf(&b, "- Scenario wall time: %s.\n", sec(r.Elapsed))
	fmt.Fprintf(&b, "- Targets (all `vllm-sim --profile-preset %s`, alive for the whole run, one target measured at a time): "+
		"**direct** = sybench → one unified worker; **regular** = sybench → `switchyard --worker-urls <that worker> --policy %s` → the same worker; "+
		"**pd** = sybench → `switchyard --vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address … --policy %s` → 1 prefill + 1 decode worker (MoRI-IO %s, registered over ZMQ). "+
		"PD MoRI-IO %s is the mode with the most router work per request: two upstream legs in flight at once, the address-embedding request id, both bodies rewritten, P's leg watched and drained while D streams.\n",
		c.Preset, c.Policy, c.Policy, c.PDMode, c.PDMode)
	fmt.Fprintf(&b, "- Load: `--random-input-len %d --random-output-len %d --max-concurrency C --num-prompts max(%d, %gC) --ignore-eos --seed %d`; before each measured run an unmeasured run of C requests warms the same keep-alive pool. Routers log at `warn`.\n",
		c.Input, c.OutputLen, c.MinPrompts, c.PromptsPerC, c.Seed)
	fmt.Fprintf(&b, "- CPU: utime+stime from /proc/<pid>/stat before and after the measured run, per 1000 completed requests. Client, router and workers share the same 2 cores, so latencies include CPU contention; the ratios are taken within one run.\n")
	fmt.Fprintf(&b, "- pd vs direct is not only router work: it also adds the second worker, the prefill leg and the simulated P→D KV handoff (ZMQ side channel), so its added TTFT is an upper bound of the router's share. The router CPU column is the router alone.\n\n")

	fmt.Fprintf(&b, "Medians of %d interleaved repetitions (direct, regular, pd, direct, ...) per concurrency; Failed is the sum over them; ranges are min-max over the repetitions.\n\n", max(c.Repeats, 1))
	b.WriteString("| C | Target | n | Failed | Req/s | TTFT P50 / P99 ms | Added TTFT P50 / P99 ms | TTFT P50 / P99 vs direct | Router CPU s / 1k req | Worker CPU s / 1k req |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	r.eachRow(func(conc int, t string, x, d overheadAgg, haveD bool) {
		added, ratio := "—", "—"
		if haveD && t != TargetDirect {
			added = fmt.Sprintf("%+.2f / %+.2f", x.ttft50-d.ttft50, x.ttft99-d.ttft99)
			ratio = fmt.Sprintf("%.2fx / %.2fx", x.ttft50/d.ttft50, x.ttft99/d.ttft99)
		}
		rcpu := "—"
		if t != TargetDirect {
			rcpu = fmt.Sprintf("%.3f (%.3f-%.3f)", x.routerCPU1k, x.rcpuLo, x.rcpuHi)
		}
		fmt.Fprintf(&b, "| %d | %s | %d | %d | %.1f | %s (%s-%s) / %s | %s | %s | %s | %.3f |\n",
			conc, t, x.prompts, x.failed, x.reqPerS, ms(x.ttft50), ms(x.ttft50Lo), ms(x.ttft50Hi), ms(x.ttft99),
			added, ratio, rcpu, x.workerCPU1k)
	})
	b.WriteString("\n")
	r.writeEventTable(&b)
	var sum []string
	for _, conc := range r.concurrencies() {
		rg, ok1 := r.row(TargetRegular, conc)
		pd, ok2 := r.row(TargetPD, conc)
		if ok1 && ok2 {
			sum = append(sum, fmt.Sprintf("C=%d: PD/regular router CPU per request %.2fx; router CPU / worker CPU: regular %.2f, PD %.2f",
				conc, pd.routerCPU1k/rg.routerCPU1k, rg.routerCPU1k/rg.workerCPU1k, pd.routerCPU1k/pd.workerCPU1k))
		}
	}
	if len(sum) > 0 {
		b.WriteString("## Ratios\n")
		for _, s := range sum {
			fmt.Fprintf(&b, "- %s.\n", s)
		}
		b.WriteString("\n")
	}
	notes := append([]string(nil), r.Notes...)
	for _, x := range r.Rows {
		if x.Stopped {
			notes = append(notes, fmt.Sprintf("%s C=%d (repetition %d) was cut short by its max duration.", x.Target, x.Concurrency, x.Rep+1))
		}
	}
	if len(notes) > 0 {
		b.WriteString("## Notes\n")
		for _, n := range notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}
