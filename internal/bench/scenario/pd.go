package scenario

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"image"
	"image/draw"
	"image/png"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
	"github.com/switchyard-llm/switchyard/internal/bench/chart"
)

// PDInput is one input length of the PD sweep and its concurrency points.
type PDInput struct {
	Len         int
	Concurrency []int
	// MaxWarmups caps the warm-ups of a point at min(C, MaxWarmups).
	MaxWarmups int
}

// PDConfig is the READ vs WRITE scenario (MORIIO-RESULTS.md's load, scaled
// to a 2-core simulation).
type PDConfig struct {
	Preset      string   // vllm-sim --profile-preset
	Modes       []string // MoRI-IO transfer modes, one fleet each
	Inputs      []PDInput
	OutputLen   int
	PromptsPerC float64 // --num-prompts = ceil(PromptsPerC × C)
	Seed        int64
	GoodputTTFT float64 // ms
	Policy      string  // switchyard --policy
	// PointTimeout bounds one point (sybench --max-duration).
	PointTimeout time.Duration
}

// DefaultPDConfig is the full sweep (~10 minutes on 2 cores): the published
// concurrencies plus C=1 (uncontended latency, not in the published table).
// The 8000-token points stop at C=64: the simulated prefill of 8k tokens
// takes ~0.74 s, so every 8k request costs that much P time whatever the
// concurrency, and C=128/256 would need 3-6 more minutes per mode.
func DefaultPDConfig() PDConfig {
	return PDConfig{
		Preset: "deepseek-r1-1p1d",
		Modes:  []string{"READ", "WRITE"},
		Inputs: []PDInput{
			{Len: 1000, Concurrency: []int{1, 16, 32, 64, 128, 256}, MaxWarmups: 16},
			{Len: 8000, Concurrency: []int{1, 16, 32, 64}, MaxWarmups: 4},
		},
		OutputLen:    100,
		PromptsPerC:  2,
		Seed:         1234,
		GoodputTTFT:  1000,
		Policy:       "consistent_hash",
		PointTimeout: 3 * time.Minute,
	}
}

// QuickPDConfig is a smoke run: two points per mode, short outputs.
func QuickPDConfig() PDConfig {
	c := DefaultPDConfig()
	c.Inputs = []PDInput{{Len: 1000, Concurrency: []int{16, 64}, MaxWarmups: 4}}
	c.OutputLen = 20
	c.PromptsPerC = 1
	c.PointTimeout = time.Minute
	return c
}

// PDPoint is one measured point.
type PDPoint struct {
	Mode        string
	Input       int
	Concurrency int
	Prompts     int
	Warmups     int
	Row         bench.SweepRow
	Wall        time.Duration
	Stopped     bool   // cut short by its max duration
	Note        string // e.g. a crash of a fleet member
	Load        string // equivalent sybench flags
}

// PDReport is the result of RunPD.
type PDReport struct {
	Config  PDConfig
	Options Options
	Machine string
	Points  []PDPoint
	Notes   []string
	Elapsed time.Duration
}

// RunPD runs the READ vs WRITE sweep: for each mode a fresh 1P1D fleet
// (switchyard in PD mode with ZMQ discovery, MoRI-IO prefill and decode
// vllm-sims), then every input length and concurrency point through the
// router. It writes pd-readwrite.md and pd-readwrite.png under OutDir.
func RunPD(ctx context.Context, o Options, c PDConfig) (*PDReport, error) {
	return runScenario(ctx, o, scenarioSpec[*PDReport]{
		name: "pd", defMax: 13 * time.Minute, skipped: "points",
		report:  func(e *env) *PDReport { return &PDReport{Config: c, Options: e.o, Machine: e.m.String()} },
		run:     func(ctx context.Context, e *env, rep *PDReport) error { return e.runPD(ctx, c, rep) },
		partial: func(rep *PDReport) bool { return len(rep.Points) > 0 },
		files: []scenarioFile[*PDReport]{
			{"pd-readwrite.md", (*PDReport).WriteMarkdown},
			{"pd-readwrite.png", (*PDReport).WritePlot},
		},
	})
}

func (e *env) runPD(ctx context.Context, c PDConfig, rep *PDReport) error {
	for _, mode := range c.Modes {
		if _, err := e.budget(time.Hour, 30*time.Second); err != nil {
			return err
		}
		t0 := time.Now()
		f, err := e.g.pdFleet(ctx, c.Preset, mode, c.Policy)
		if err != nil {
			return fmt.Errorf("start %s fleet: %w", mode, err)
		}
		e.printf("%s fleet ready in %s (%s)\n", mode, sec(time.Since(t0)), f.desc)
		for _, in := range c.Inputs {
			for _, conc := range in.Concurrency {
				d, err := e.budget(c.PointTimeout, 20*time.Second)
				if err != nil {
					f.stop()
					return err
				}
				l := load{
					base: f.r.base, input: in.Len, output: c.OutputLen, concurrency: conc,
					prompts: promptsFor(conc, c.PromptsPerC, 1), warmups: min(conc, in.MaxWarmups),
					seed: c.Seed, goodputTTFTms: c.GoodputTTFT, maxDuration: d,
				}
				pt := PDPoint{Mode: mode, Input: in.Len, Concurrency: conc, Prompts: l.prompts, Warmups: l.warmups, Load: l.flags()}
				t1 := time.Now()
				res, err := l.run(ctx)
				pt.Wall = time.Since(t1)
				if ctx.Err() != nil {
					f.stop()
					return ctx.Err()
				}
				if res != nil {
					pt.Row = sweepRow("switchyard", mode, res)
					pt.Stopped = res.Stopped
					if errs := failureReasons(res, 3); len(errs) > 0 {
						rep.Notes = append(rep.Notes, fmt.Sprintf("%s input %d C=%d: %d failed: %s", mode, in.Len, conc, res.Metrics.Failed, strings.Join(errs, " | ")))
					}
				} else {
					pt.Row = failedRow("switchyard", mode, conc, l.prompts)
					pt.Note = "run failed: " + err.Error()
				}
				if derr := f.check(); derr != nil {
					pt.Note = strings.TrimSpace(pt.Note + " fleet member died: " + derr.Error())
					rep.Notes = append(rep.Notes, fmt.Sprintf("%s input %d C=%d: %s; the fleet was restarted.", mode, in.Len, conc, firstLine(derr.Error())))
					f.stop()
					if f, err = f.restart(ctx); err != nil {
						rep.Points = append(rep.Points, pt)
						return fmt.Errorf("restart %s fleet: %w", mode, err)
					}
				}
				rep.Points = append(rep.Points, pt)
				e.printf("%-5s in=%-5d C=%-4d n=%-4d %s  (%s)%s\n", mode, in.Len, conc, l.prompts, rowSummary(pt.Row), sec(pt.Wall), stoppedMark(pt.Stopped))
			}
		}
		if n := kvProblems(ctx, f); n != "" {
			rep.Notes = append(rep.Notes, mode+" fleet: "+n)
		}
		f.stop()
	}
	return nil
}

func stoppedMark(stopped bool) string {
	if stopped {
		return " STOPPED by max duration"
	}
	return ""
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

func rowSummary(r bench.SweepRow) string {
	return fmt.Sprintf("failed %d, %.2f req/s, TTFT %s/%s ms, TPOT %s/%s ms, ITL %s/%s ms",
		r.Failed, r.RequestThroughput, ms(r.TTFTP50), ms(r.TTFTP99), ms(r.TPOTP50), ms(r.TPOTP99), ms(r.ITLP50), ms(r.ITLP99))
}

// sweepRow is bench.NewSweepRow with NaN latencies (printed "NaN", not
// plotted) when no request succeeded.
func sweepRow(router, mode string, res *bench.Result) bench.SweepRow {
	r := bench.NewSweepRow(router, mode, res)
	if res.Metrics.Completed == 0 {
		nan := math.NaN()
		r.TTFTP50, r.TTFTP99, r.TPOTP50, r.TPOTP99, r.ITLP50, r.ITLP99 = nan, nan, nan, nan, nan, nan
	}
	return r
}

// failureReasons returns up to n distinct failure reasons of a run.
func failureReasons(res *bench.Result, n int) []string {
	var out []string
	for _, o := range res.Outputs {
		if !o.Success && !slices.Contains(out, o.Error) {
			if len(out) == n {
				break
			}
			out = append(out, o.Error)
		}
	}
	return out
}

func failedRow(router, mode string, c, n int) bench.SweepRow {
	nan := math.NaN()
	return bench.SweepRow{Router: router, Mode: mode, Concurrency: c, Failed: n,
		TTFTP50: nan, TTFTP99: nan, TPOTP50: nan, TPOTP99: nan, ITLP50: nan, ITLP99: nan}
}

// simStats is the part of vllm-sim's GET /sim/stats the scenarios check.
type simStats struct {
	Transfers struct {
		KVDigestMismatch int64 `json:"kv_digest_mismatch"`
		KVGarbage        int64 `json:"kv_garbage"`
		DeferExpired     int64 `json:"defer_expired"`
		KVWaitTimeouts   int64 `json:"kv_wait_timeouts"`
		HandshakeFailure int64 `json:"handshake_failures"`
	} `json:"transfers"`
}

// kvProblems reads every worker's /sim/stats and describes KV handoff
// problems (wrong or missing KV), or returns "".
func kvProblems(ctx context.Context, f *fleet) string {
	var out []string
	client := &http.Client{Timeout: httpGetTimeout}
	for _, s := range f.sims {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+"/sim/stats", nil)
		resp, err := client.Do(req)
		if err != nil {
			continue
		}
		var st simStats
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil {
			continue
		}
		t := st.Transfers
		if t.KVDigestMismatch+t.KVGarbage+t.DeferExpired+t.KVWaitTimeouts+t.HandshakeFailure > 0 {
			out = append(out, fmt.Sprintf("%s: kv_digest_mismatch %d, kv_garbage %d, defer_expired %d, kv_wait_timeouts %d, handshake_failures %d",
				s.name, t.KVDigestMismatch, t.KVGarbage, t.DeferExpired, t.KVWaitTimeouts, t.HandshakeFailure))
		}
	}
	return strings.Join(out, "; ")
}

// sorted returns the points of one input ordered as MORIIO-RESULTS.md
// (by concurrency, then mode in Config.Modes order).
func (r *PDReport) sorted(input int) []PDPoint {
	var ps []PDPoint
	for _, p := range r.Points {
		if p.Input == input {
			ps = append(ps, p)
		}
	}
	slices.SortStableFunc(ps, func(a, b PDPoint) int {
		if a.Concurrency != b.Concurrency {
			return a.Concurrency - b.Concurrency
		}
		return slices.Index(r.Config.Modes, a.Mode) - slices.Index(r.Config.Modes, b.Mode)
	})
	return ps
}

func (r *PDReport) inputs() []int {
	var ins []int
	for _, p := range r.Points {
		if !slices.Contains(ins, p.Input) {
			ins = append(ins, p.Input)
		}
	}
	return ins
}

// WriteMarkdown writes the tables in MORIIO-RESULTS.md's layout, the set-up
// and a shape comparison with the published figures.
func (r *PDReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	fmt.Fprintf(&b, "# MoRI-IO READ vs WRITE through switchyard (simulated DeepSeek-R1 1P1D)\n\n")
	fmt.Fprintf(&b, "Generated by `%s`.\n\n", orDefault(r.Options.Command, "sybench scenario pd"))
	fmt.Fprintf(&b, "- Machine: %s.\n", r.Machine)
	fmt.Fprintf(&b, "- Scenario wall time: %s.\n", sec(r.Elapsed))
	fmt.Fprintf(&b, "- Fleet (restarted per mode): `switchyard --vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address 127.0.0.1:PORT --policy %s --log-level warn`; "+
		"one `vllm-sim --role prefill` and one `vllm-sim --role decode`, `--kv-connector moriio --transfer-mode MODE --profile-preset %s`, registering over ZMQ.\n", c.Policy, c.Preset)
	fmt.Fprintf(&b, "- Load per point (sybench in-process, against the router): `--backend vllm --dataset-name random --random-input-len IN --random-output-len %d "+
		"--max-concurrency C --num-prompts %s --num-warmups W --ignore-eos --goodput ttft:%g --seed %d`, W = min(C, %s).\n",
		c.OutputLen, promptsExpr(c.PromptsPerC), c.GoodputTTFT, c.Seed, warmupsExpr(c.Inputs))
	fmt.Fprintf(&b, "- Scaling vs MORIIO-RESULTS.md: output %d tokens instead of 1000, %s prompts instead of 10C, warm-ups W instead of 2C (each point's wall time is bounded by --max-duration %v). "+
		"With 10x shorter outputs the decode phase is 10x shorter relative to prefill, so prefill queueing weighs more in TTFT and fewer requests decode at once (lower TPOT under load) than in the published runs.\n\n",
		c.OutputLen, promptsExpr(c.PromptsPerC), c.PointTimeout)
	for _, in := range r.inputs() {
		fmt.Fprintf(&b, "## Input %d / output %d\n", in, c.OutputLen)
		var sw bench.Sweep
		for _, p := range r.sorted(in) {
			sw.Rows = append(sw.Rows, p.Row)
		}
		if err := sw.WriteMarkdown(&b); err != nil {
			return err
		}
		b.WriteString("\n")
	}
	if shape := r.shape(); shape != "" {
		b.WriteString("## Shape vs MORIIO-RESULTS.md\n")
		b.WriteString(shape)
		b.WriteString("\n")
	}
	var notes []string
	notes = append(notes, r.Notes...)
	for _, p := range r.Points {
		if p.Stopped {
			notes = append(notes, fmt.Sprintf("%s input %d C=%d was cut short by its max duration (unsent requests count as failed).", p.Mode, p.Input, p.Concurrency))
		}
	}
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

func orDefault(s, d string) string {
	if s == "" {
		return d
	}
	return s
}

func promptsExpr(f float64) string {
	if f == 1 {
		return "C"
	}
	return fmt.Sprintf("%gC", f)
}

func warmupsExpr(ins []PDInput) string {
	var parts []string
	for _, in := range ins {
		parts = append(parts, fmt.Sprintf("%d for input %d", in.MaxWarmups, in.Len))
	}
	return strings.Join(parts, ", ")
}

// published holds MORIIO-RESULTS.md's vllm-router rows: TTFT P50 and TPOT
// P50 (ms) by input length, concurrency and mode.
var published = map[int]map[int]map[string][2]float64{
	1000: {
		16:  {"READ": {261.96, 15.27}, "WRITE": {238.92, 15.20}},
		32:  {"READ": {243.10, 15.19}, "WRITE": {202.82, 15.28}},
		64:  {"READ": {791.34, 16.51}, "WRITE": {887.21, 15.54}},
		128: {"READ": {2286.87, 19.82}, "WRITE": {949.18, 18.24}},
		256: {"READ": {2857.77, 29.75}, "WRITE": {1299.83, 25.40}},
	},
	8000: {
		16:  {"READ": {2176.66, 17.55}, "WRITE": {766.99, 15.12}},
		32:  {"READ": {2930.00, 20.35}, "WRITE": {790.78, 15.84}},
		64:  {"READ": {3098.27, 29.95}, "WRITE": {6136.02, 17.86}},
		128: {"READ": {68350.20, 42.07}, "WRITE": {83549.72, 18.16}},
	},
}

// shape compares READ and WRITE point by point with the published rows:
// who wins TTFT and by how much, and how TPOT moves with load.
func (r *PDReport) shape() string {
	var b strings.Builder
	b.WriteString("READ/WRITE is READ's TTFT P50 over WRITE's (above 1: WRITE wins). Published = MORIIO-RESULTS.md's vllm-router rows (output 1000).\n\n")
	b.WriteString("| Input | C | READ/WRITE TTFT P50 | published | TPOT P50 READ / WRITE ms | published |\n")
	b.WriteString("|---|---|---|---|---|---|\n")
	rows := 0
	for _, in := range r.inputs() {
		byKey := map[string]bench.SweepRow{}
		var cs []int
		for _, p := range r.Points {
			if p.Input != in {
				continue
			}
			byKey[fmt.Sprint(p.Mode, p.Concurrency)] = p.Row
			if !slices.Contains(cs, p.Concurrency) {
				cs = append(cs, p.Concurrency)
			}
		}
		slices.Sort(cs)
		for _, conc := range cs {
			rd, ok1 := byKey[fmt.Sprint("READ", conc)]
			wr, ok2 := byKey[fmt.Sprint("WRITE", conc)]
			if !ok1 || !ok2 {
				continue
			}
			pubRatio, pubTPOT := "—", "—"
			if pub, ok := published[in][conc]; ok {
				pubRatio = fmt.Sprintf("%.2fx", pub["READ"][0]/pub["WRITE"][0])
				pubTPOT = fmt.Sprintf("%.2f / %.2f", pub["READ"][1], pub["WRITE"][1])
			}
			ratio := fmt.Sprintf("%.2fx", rd.TTFTP50/wr.TTFTP50)
			if rd.Failed+wr.Failed > 0 {
				ratio = fmt.Sprintf("n/a (%d READ / %d WRITE requests failed)", rd.Failed, wr.Failed)
			}
			fmt.Fprintf(&b, "| %d | %d | %s | %s | %s / %s | %s |\n", in, conc, ratio, pubRatio, ms(rd.TPOTP50), ms(wr.TPOTP50), pubTPOT)
			rows++
		}
	}
	if rows == 0 {
		return ""
	}
	return b.String()
}

// WritePlot draws TTFT and TPOT against concurrency, READ vs WRITE (P50
// solid, P99 dashed), one row of panels per input length. Points during
// which a fleet member died are left out (the Markdown keeps them).
func (r *PDReport) WritePlot(w io.Writer) error {
	const width, rowH = 1200, 520
	ins := r.inputs()
	if len(ins) == 0 {
		return errors.New("no points to plot")
	}
	out := image.NewRGBA(image.Rect(0, 0, width, rowH*len(ins)))
	for i, in := range ins {
		var sw bench.Sweep
		for _, p := range r.sorted(in) {
			// A point without a success has no latencies; one during which
			// the fleet died measures the crash, not the transfer mode.
			if !math.IsNaN(p.Row.TTFTP50) && p.Note == "" {
				sw.Rows = append(sw.Rows, p.Row)
			}
		}
		img := renderSweep(sw, fmt.Sprintf("switchyard PD MoRI-IO READ vs WRITE, simulated %s, input %d / output %d", r.Config.Preset, in, r.Config.OutputLen), width, rowH)
		draw.Draw(out, image.Rect(0, i*rowH, width, (i+1)*rowH), img, image.Point{}, draw.Src)
	}
	return png.Encode(w, out)
}

// renderSweep draws one Sweep (TTFT and TPOT panels) as WritePlot does,
// each line's points ordered by concurrency.
func renderSweep(s bench.Sweep, title string, width, height int) *image.RGBA {
	s.Rows = slices.Clone(s.Rows)
	slices.SortStableFunc(s.Rows, func(a, b bench.SweepRow) int { return a.Concurrency - b.Concurrency })
	ttft, tpot := s.Panels()
	return chart.Render(chart.Options{Width: width, Height: height, Title: title}, ttft, tpot)
}
