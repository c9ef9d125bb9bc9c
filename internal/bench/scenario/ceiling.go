package scenario

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

// CeilingConfig is the concurrency ceiling scenario.
type CeilingConfig struct {
	Preset      string
	Mode        string // MoRI-IO transfer mode
	Concurrency []int  // ramp
	Input       int
	OutputLen   int
	PromptsPerC float64
	Seed        int64
	Policy      string
	// StepTimeout bounds one step; requests still open then count as
	// failed.
	StepTimeout time.Duration
}

// DefaultCeilingConfig ramps 256 → 4096 streams through PD MoRI-IO WRITE
// with the default preset and short outputs: the decode worker runs 256
// sequences at a time, so most streams sit open on the router waiting for
// their turn, which is what the ramp is meant to stress.
func DefaultCeilingConfig() CeilingConfig {
	return CeilingConfig{
		Preset:      "default",
		Mode:        "WRITE",
		Concurrency: []int{256, 512, 1024, 2048, 4096},
		Input:       128,
		OutputLen:   16,
		PromptsPerC: 2,
		Seed:        1234,
		Policy:      "consistent_hash",
		StepTimeout: 2 * time.Minute,
	}
}

// QuickCeilingConfig is a smoke run.
func QuickCeilingConfig() CeilingConfig {
	c := DefaultCeilingConfig()
	c.Concurrency = []int{256, 1024}
	c.PromptsPerC = 1
	c.StepTimeout = time.Minute
	return c
}

// CeilingStep is one step of the ramp.
type CeilingStep struct {
	Concurrency int
	Prompts     int
	Completed   int
	Failed      int
	// PeakConcurrent is the client-measured peak of requests in flight.
	PeakConcurrent   int
	Row              bench.SweepRow
	RouterCPU        time.Duration
	RouterFDs        int   // peak open fds of the router
	RouterRSS        int64 // peak RSS of the router, bytes
	RouterGoroutines int   // peak go_goroutines of the router (0: not read)
	Wall             time.Duration
	Stopped          bool
	Errors           []string // up to 3 distinct failure reasons
}

// rssPerStream is the router's peak RSS over the peak of open streams, KiB
// (the whole process: its idle footprint is included).
func (s CeilingStep) rssPerStream() float64 {
	if s.PeakConcurrent == 0 {
		return 0
	}
	return float64(s.RouterRSS) / 1024 / float64(s.PeakConcurrent)
}

// goroutinesPerStream is the router's peak goroutine count over the peak
// of open streams (its idle goroutines included).
func (s CeilingStep) goroutinesPerStream() float64 {
	if s.PeakConcurrent == 0 {
		return 0
	}
	return float64(s.RouterGoroutines) / float64(s.PeakConcurrent)
}

// CeilingReport is the result of RunCeiling.
type CeilingReport struct {
	Config  CeilingConfig
	Options Options
	Machine string
	Steps   []CeilingStep
	Notes   []string
	Elapsed time.Duration
}

// FirstFailing is the first concurrency with a failed request (0: none).
func (r *CeilingReport) FirstFailing() int {
	for _, s := range r.Steps {
		if s.Failed > 0 {
			return s.Concurrency
		}
	}
	return 0
}

// RunCeiling ramps the number of concurrent streams through one PD fleet
// and reports, per step, completed and failed requests and the router's
// peak fds and memory.
func RunCeiling(ctx context.Context, o Options, c CeilingConfig) (*CeilingReport, error) {
	return runScenario(ctx, o, scenarioSpec[*CeilingReport]{
		name: "ceiling", defMax: 10 * time.Minute, skipped: "steps",
		report: func(e *env) *CeilingReport {
			return &CeilingReport{Config: c, Options: e.o, Machine: e.m.String()}
		},
		run:   func(ctx context.Context, e *env, rep *CeilingReport) error { return e.runCeiling(ctx, c, rep) },
		files: []scenarioFile[*CeilingReport]{{"ceiling.md", (*CeilingReport).WriteMarkdown}},
	})
}

func (e *env) runCeiling(ctx context.Context, c CeilingConfig, rep *CeilingReport) error {
	f, err := e.g.pdFleet(ctx, c.Preset, c.Mode, c.Policy)
	if err != nil {
		return err
	}
	for _, conc := range c.Concurrency {
		d, err := e.budget(c.StepTimeout, 15*time.Second)
		if err != nil {
			return err
		}
		l := load{base: f.r.base, input: c.Input, output: c.OutputLen, concurrency: conc,
			prompts: promptsFor(conc, c.PromptsPerC, 1), seed: c.Seed, maxDuration: d}
		rpid := f.r.Pid()
		cpu0, _ := cpuTime(rpid)
		smp := startSampler(rpid, 200*time.Millisecond, f.r.metrics)
		t1 := time.Now()
		res, err := l.run(ctx)
		wall := time.Since(t1)
		fds, rss, gor := smp.finish()
		cpu1, _ := cpuTime(rpid)
		if err != nil {
			return fmt.Errorf("C=%d: %w", conc, err)
		}
		st := CeilingStep{
			Concurrency: conc, Prompts: l.prompts, Completed: res.Metrics.Completed, Failed: res.Metrics.Failed,
			PeakConcurrent: res.Metrics.MaxConcurrentRequests, Row: sweepRow("switchyard", c.Mode, res),
			RouterCPU: cpu1 - cpu0, RouterFDs: fds, RouterRSS: rss, RouterGoroutines: gor, Wall: wall, Stopped: res.Stopped,
			Errors: failureReasons(res, 3),
		}
		rep.Steps = append(rep.Steps, st)
		e.printf("C=%-5d n=%-5d completed %d failed %d peak in flight %d, %.1f req/s, TTFT p50/p99 %s/%s ms, router fds %d RSS %d MiB (%.0f KiB/stream) goroutines %d (%.2f/stream) (%s)%s\n",
			conc, l.prompts, st.Completed, st.Failed, st.PeakConcurrent, st.Row.RequestThroughput, ms(st.Row.TTFTP50), ms(st.Row.TTFTP99),
			fds, rss>>20, st.rssPerStream(), gor, st.goroutinesPerStream(), sec(wall), stoppedMark(st.Stopped))
		if derr := f.check(); derr != nil {
			rep.Notes = append(rep.Notes, fmt.Sprintf("C=%d: %s", conc, firstLine(derr.Error())))
			return nil // later steps would only measure a dead fleet
		}
	}
	if n := kvProblems(ctx, f); n != "" {
		rep.Notes = append(rep.Notes, "fleet: "+n)
	}
	return nil
}

// WriteMarkdown writes the ramp table.
func (r *CeilingReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	fmt.Fprintf(&b, "# Concurrency ceiling (PD MoRI-IO %s, simulated workers)\n\n", c.Mode)
	fmt.Fprintf(&b, "Generated by `%s`.\n\n", orDefault(r.Options.Command, "sybench scenario ceiling"))
	fmt.Fprintf(&b, "- Machine: %s.\n", r.Machine)
	fmt.Fprintf(&b, "- Scenario wall time: %s.\n", sec(r.Elapsed))
	queue := ""
	if c.Preset == "default" {
		queue = " (max_num_seqs 256 on the decode: the other streams wait open in its queue)"
	}
	fmt.Fprintf(&b, "- Fleet: `switchyard --vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address … --policy %s` with one prefill and one decode `vllm-sim --profile-preset %s --transfer-mode %s`%s.\n",
		c.Policy, c.Preset, c.Mode, queue)
	fmt.Fprintf(&b, "- Load per step: `--random-input-len %d --random-output-len %d --max-concurrency C --num-prompts %s --ignore-eos --seed %d`, no per-request timeout; a step is bounded by --max-duration %v (requests still open then count as failed). RLIMIT_NOFILE is raised to its hard limit for sybench and the children.\n\n",
		c.Input, c.OutputLen, promptsExpr(c.PromptsPerC), c.Seed, c.StepTimeout)
	if ff := r.FirstFailing(); ff > 0 {
		fmt.Fprintf(&b, "**First concurrency with a failed request: %d.**\n\n", ff)
	} else if len(r.Steps) > 0 {
		fmt.Fprintf(&b, "**No failed request up to C=%d.**\n\n", r.Steps[len(r.Steps)-1].Concurrency)
	}
	b.WriteString("| C | n | Completed | Failed | Peak in flight | Req/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | Router peak fds | Router peak RSS MiB | RSS KiB / stream | Router peak goroutines | Goroutines / stream | Router CPU s / 1k req | Wall s |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, s := range r.Steps {
		fmt.Fprintf(&b, "| %d | %d | %d | %d | %d | %.1f | %s / %s | %s / %s | %d | %d | %.0f | %d | %.2f | %.3f | %.1f |\n",
			s.Concurrency, s.Prompts, s.Completed, s.Failed, s.PeakConcurrent, s.Row.RequestThroughput,
			ms(s.Row.TTFTP50), ms(s.Row.TTFTP99), ms(s.Row.TPOTP50), ms(s.Row.TPOTP99),
			s.RouterFDs, s.RouterRSS>>20, s.rssPerStream(), s.RouterGoroutines, s.goroutinesPerStream(),
			per1k(s.RouterCPU, s.Completed), s.Wall.Seconds())
	}
	b.WriteString("\n")
	var notes []string
	for _, s := range r.Steps {
		if len(s.Errors) > 0 {
			notes = append(notes, fmt.Sprintf("C=%d failures: %s", s.Concurrency, strings.Join(s.Errors, " | ")))
		}
		if s.Stopped {
			notes = append(notes, fmt.Sprintf("C=%d was cut short by its max duration.", s.Concurrency))
		}
	}
	notes = append(notes, r.Notes...)
	if len(notes) > 0 {
		b.WriteString("## Notes\n")
		for _, n := range notes {
			fmt.Fprintf(&b, "- %s\n", strings.ReplaceAll(n, "\n", " "))
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}
