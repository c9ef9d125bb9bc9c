package scenario

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

// CompareConfig is the head-to-head scenario: the same fleet and the same
// load through each router in turn.
type CompareConfig struct {
	// PeersDir is scripts/install-peers.sh's folder (.venv-peers).
	PeersDir string
	Preset   string // vllm-sim preset of every worker ("zero")
	Policy   string // --policy of the routers (round_robin)
	// WrkConns are wrk's connection counts (2 threads, 1-token completions).
	WrkConns    []int
	WrkDuration time.Duration
	// StreamConcurrency are the sybench stream points of regular mode.
	StreamConcurrency []int
	// PDConcurrency are the sybench points of PD NIXL (static workers).
	PDConcurrency []int
	Input         int
	OutputLen     int
	MinPrompts    int
	PromptsPerC   float64
	Seed          int64
	// Repeats interleaved repetitions of every point (min-max shown).
	Repeats      int
	PointTimeout time.Duration
	// Only, when set, limits the routers measured (direct always runs).
	Only []string
	// MoRIModes are the MoRI-IO transfer modes of scenario 3 (empty:
	// skipped), measured at MoRIConcurrency with --policy MoRIPolicy.
	MoRIModes       []string
	MoRIConcurrency []int
	MoRIPolicy      string
	// Faults runs scenario 5 on the MoRI-IO WRITE pairs.
	Faults bool
	// Turnover runs the READ→WRITE fleet turnover fault (scenario 5) on
	// fresh MoRI-IO pairs per router.
	Turnover bool
	// RealConcurrency, RealInput, RealOutput, RealPrompts and RealRepeats
	// are the small load over the real vLLM pair.
	RealConcurrency                    []int
	RealInput, RealOutput, RealPrompts int
	RealRepeats                        int
	// Sections, when set, limits the run to these of CompareSections.
	Sections []string
	// CeilingConcurrency is the PD ramp of scenario 4 (empty: skipped).
	CeilingConcurrency          []int
	CeilingPreset               string
	CeilingInput, CeilingOutput int
}

// DefaultCompareConfig is the full table (about 20 minutes).
func DefaultCompareConfig() CompareConfig {
	return CompareConfig{
		PeersDir:          ".venv-peers",
		Preset:            "zero",
		Policy:            "round_robin",
		WrkConns:          []int{64, 256},
		WrkDuration:       6 * time.Second,
		StreamConcurrency: []int{64, 256, 1024},
		PDConcurrency:     []int{16, 64, 256, 1024},
		Input:             1000,
		OutputLen:         100,
		MinPrompts:        1000,
		PromptsPerC:       2,
		Seed:              1234,
		Repeats:           3,
		PointTimeout:      90 * time.Second,

		MoRIModes:          []string{"WRITE", "READ"},
		MoRIConcurrency:    []int{16, 64, 256},
		MoRIPolicy:         "consistent_hash",
		Faults:             true,
		Turnover:           true,
		RealConcurrency:    []int{4},
		RealInput:          64,
		RealOutput:         16,
		RealPrompts:        32,
		RealRepeats:        3,
		CeilingConcurrency: []int{256, 1024, 2048, 4096},
		CeilingPreset:      "default",
		CeilingInput:       128,
		CeilingOutput:      16,
	}
}

// QuickCompareConfig is a few-minute run: one repetition, the smallest
// points.
func QuickCompareConfig() CompareConfig {
	c := DefaultCompareConfig()
	c.WrkConns = []int{64}
	c.WrkDuration = 3 * time.Second
	c.StreamConcurrency = []int{64}
	c.PDConcurrency = []int{16, 64}
	c.OutputLen = 20
	c.MinPrompts = 200
	c.Repeats = 1
	c.PointTimeout = 30 * time.Second
	c.CeilingConcurrency = []int{64, 256}
	c.MoRIModes = []string{"WRITE"}
	c.MoRIConcurrency = []int{16}
	c.RealRepeats = 1
	return c
}

// Compare sections.
const (
	SectionWrk     = "wrk"
	SectionStreams = "streams"
	SectionPD      = "pd-nixl"
)

// CompareRow is one measured run (or a router that could not run).
type CompareRow struct {
	Section     string
	Router      string
	Concurrency int // wrk connections or sybench concurrency
	Rep         int
	// Skipped says why the router has no figures here ("" when measured).
	Skipped string
	// wrk figures (latencies in ms).
	Wrk wrkResult
	// sybench figures.
	Row bench.SweepRow
	// E2EP50 and E2EP99 are the end-to-end latency percentiles of the
	// completed requests, ms (sybench streams).
	E2EP50, E2EP99 float64
	Completed      int
	Failed         int
	// RouterCPU is the router's process-group CPU time during the run;
	// RouterRSS its summed RSS right after it.
	RouterCPU time.Duration
	RouterRSS int64
	Wall      time.Duration
}

// CPUPer1k is router CPU seconds per 1000 completed requests.
func (r CompareRow) CPUPer1k() float64 { return per1k(r.RouterCPU, r.Completed) }

// CompareReport is the result of RunCompare.
type CompareReport struct {
	Config  CompareConfig
	Options Options
	Machine string
	// Commands are the command lines used, in start order.
	Commands []string
	Rows     []CompareRow
	Faults   []FaultRow
	Turnover []TurnoverRow
	Real     []RealRow
	Notes    []string
	Elapsed  time.Duration
}

// RunCompare runs the head-to-head scenario.
func RunCompare(ctx context.Context, o Options, c CompareConfig) (*CompareReport, error) {
	return runScenario(ctx, o, scenarioSpec[*CompareReport]{
		name: "compare", defMax: 30 * time.Minute, skipped: "points",
		report: func(e *env) *CompareReport {
			return &CompareReport{Config: c, Options: e.o, Machine: e.m.String()}
		},
		run: func(ctx context.Context, e *env, rep *CompareReport) error { return e.runCompare(ctx, c, rep) },
		files: []scenarioFile[*CompareReport]{
			{"compare.md", (*CompareReport).WriteMarkdown},
			{"compare.png", (*CompareReport).WritePNG},
		},
	})
}

// running is a router started for one section.
type running struct {
	peer
	r    *router
	base string
}

func (e *env) runCompare(ctx context.Context, c CompareConfig, rep *CompareReport) error {
	all := peers(e.o.BinDir, c.PeersDir, c.Policy)
	if len(c.Only) > 0 {
		var keep []peer
		for _, p := range all {
			if p.name == PeerDirect || contains(c.Only, p.name) {
				keep = append(keep, p)
			}
		}
		all = keep
	}
	steps := []struct {
		name string
		run  func(context.Context, CompareConfig, *CompareReport, []peer) error
	}{
		{CompareRegular, e.compareRegular},
		{ComparePD, e.comparePD},
		{CompareMoRI, e.compareMoRI},
		{CompareTurnover, func(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
			if !c.Turnover {
				return nil
			}
			return e.compareTurnover(ctx, c, rep, all)
		}},
		{CompareCeiling, e.compareCeiling},
		{CompareReal, e.compareReal},
	}
	for _, st := range steps {
		if len(c.Sections) > 0 && !contains(c.Sections, st.name) {
			continue
		}
		if err := st.run(ctx, c, rep, all); err != nil {
			return err
		}
	}
	return nil
}

// The parts of the compare scenario (--sections).
const (
	CompareRegular  = "regular"
	ComparePD       = "pd"
	CompareMoRI     = "moriio"
	CompareTurnover = "turnover"
	CompareCeiling  = "ceiling"
	CompareReal     = "real"
)

// CompareSections lists the parts in run order.
var CompareSections = []string{CompareRegular, ComparePD, CompareMoRI, CompareTurnover, CompareCeiling, CompareReal}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// stopPeers stops the routers startPeers started.
func (e *env) stopPeers(rs []running) {
	for _, r := range rs {
		if r.r != nil {
			e.g.stop(r.r.proc)
		}
	}
}

// startPeers starts every router of a section in front of f; routers that
// cannot run it get a Skipped row per section.
func (e *env) startPeers(ctx context.Context, all []peer, f fleetURLs, sections []string, rep *CompareReport) ([]running, error) {
	var out []running
	for _, p := range all {
		dir := filepath.Join(e.o.LogDir, fmt.Sprintf("%s-%s", p.name, sections[0]))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return out, err
		}
		r, cmd, err := e.g.startPeer(ctx, p, f, dir, nil)
		if err != nil {
			if ctx.Err() != nil {
				return out, ctx.Err()
			}
			why := err.Error()
			if !errors.Is(err, errUnsupported) {
				why = "did not start: " + oneLine(why, 240)
			}
			e.printf("%-14s %s: %s\n", p.name, sections[0], why)
			for _, s := range sections {
				rep.Rows = append(rep.Rows, CompareRow{Section: s, Router: p.name, Skipped: why})
			}
			continue
		}
		base := f.worker
		if r != nil {
			base = r.base
			rep.Commands = append(rep.Commands, cmd)
		}
		out = append(out, running{peer: p, r: r, base: base})
	}
	return out, nil
}

// oneLine folds a multi-line reason (a crash summary with its log tail)
// into one table cell of at most n bytes.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(strings.ReplaceAll(s, "|", "/")), " ")
	if len(s) > n {
		s = s[:n] + "…"
	}
	return s
}

// measure runs fn with the router's CPU and RSS read around it.
func measure(rr running, fn func() (CompareRow, error)) (CompareRow, error) {
	var c0 time.Duration
	if rr.r != nil {
		c0 = groupCPU(rr.r.Pid())
	}
	t0 := time.Now()
	row, err := fn()
	row.Wall = time.Since(t0)
	if rr.r != nil {
		row.RouterCPU = groupCPU(rr.r.Pid()) - c0
		row.RouterRSS = groupRSS(rr.r.Pid())
	}
	row.Router = rr.name
	return row, err
}

// compareRegular is scenario 1: one unified worker, every router in front
// of it, wrk and sybench streams.
func (e *env) compareRegular(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	uni, err := e.g.unifiedSim(ctx, c.Preset)
	if err != nil {
		return err
	}
	rep.Commands = append(rep.Commands, fmt.Sprintf("vllm-sim --role unified --profile-preset %s", c.Preset))
	defer e.g.stop(uni.proc)
	rs, err := e.startPeers(ctx, all, fleetURLs{worker: uni.URL()}, []string{SectionWrk, SectionStreams}, rep)
	defer e.stopPeers(rs)
	if err != nil {
		return err
	}
	script := filepath.Join(e.o.LogDir, "completion.lua")
	if err := os.WriteFile(script, []byte(wrkScript), 0o644); err != nil {
		return err
	}
	for _, conns := range c.WrkConns {
		rep.Commands = append(rep.Commands, "wrk "+joinArgs(wrkArgs(2, conns, c.WrkDuration, "completion.lua", "http://ROUTER")))
		for k := range max(c.Repeats, 1) {
			for _, rr := range rs {
				if _, err := e.budget(c.WrkDuration+30*time.Second, c.WrkDuration+30*time.Second); err != nil {
					return err
				}
				if k == 0 { // warm the connection pools, unmeasured
					if _, err := runWrk(ctx, wrkArgs(2, conns, time.Second, script, rr.base), time.Second); err != nil {
						rep.Rows = append(rep.Rows, CompareRow{Section: SectionWrk, Router: rr.name, Concurrency: conns, Rep: k, Skipped: "warm-up failed: " + oneLine(err.Error(), 240)})
						continue
					}
				}
				row, err := measure(rr, func() (CompareRow, error) {
					w, err := runWrk(ctx, wrkArgs(2, conns, c.WrkDuration, script, rr.base), c.WrkDuration)
					return CompareRow{Section: SectionWrk, Concurrency: conns, Rep: k, Wrk: w,
						Completed: w.Requests - w.Non2xx, Failed: w.Non2xx + w.SocketErrors}, err
				})
				if err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					row.Skipped = "failed: " + oneLine(err.Error(), 240)
				}
				rep.Rows = append(rep.Rows, row)
				e.printf("#%d wrk -c%-4d %-14s %9.0f req/s  P50 %6.2f ms  P99 %7.2f ms  non-2xx %d  errors %d  CPU %.3f s/1k  RSS %d MiB %s\n",
					k+1, conns, rr.name, row.Wrk.ReqPerS, row.Wrk.P50, row.Wrk.P99, row.Wrk.Non2xx, row.Wrk.SocketErrors, row.CPUPer1k(), row.RouterRSS>>20, row.Skipped)
				if err := e.checkPeer(rr, uni); err != nil {
					return err
				}
			}
		}
	}
	return e.streams(ctx, c, rep, SectionStreams, c.StreamConcurrency, rs, uni.proc)
}

// checkPeer fails the section when the router or a worker died (its log
// names why).
func (e *env) checkPeer(rr running, workers ...*sim) error {
	ps := []*proc{}
	if rr.r != nil {
		ps = append(ps, rr.r.proc)
	}
	for _, w := range workers {
		ps = append(ps, w.proc)
	}
	return dead(ps...)
}

// streams runs sybench (vllm bench serve) points through every router.
func (e *env) streams(ctx context.Context, c CompareConfig, rep *CompareReport, section string, cs []int, rs []running, workers ...*proc) error {
	// A router whose run failed requests and was cut short by the point's
	// max duration is not measured again in this section: its further
	// repetitions and larger points would only spend the budget.
	gaveUp := map[string]string{}
	for _, conc := range cs {
		n := promptsFor(conc, c.PromptsPerC, c.MinPrompts)
		l0 := load{input: c.Input, output: c.OutputLen, concurrency: conc, prompts: n, seed: c.Seed}
		rep.Commands = append(rep.Commands, "sybench "+l0.flags())
		for k := range max(c.Repeats, 1) {
			for _, rr := range rs {
				if why, ok := gaveUp[rr.name]; ok {
					if k == 0 {
						rep.Rows = append(rep.Rows, CompareRow{Section: section, Router: rr.name, Concurrency: conc, Skipped: why})
					}
					continue
				}
				d, err := e.budget(c.PointTimeout, 15*time.Second)
				if err != nil {
					return err
				}
				tr := newBenchTransport(conc)
				l := l0
				l.base, l.transport, l.prompts, l.seed, l.maxDuration = rr.base, tr, conc, c.Seed+1, d/4
				if _, err := l.run(ctx); err != nil { // warm-up on the same pool
					tr.close()
					if ctx.Err() != nil {
						return ctx.Err()
					}
					rep.Rows = append(rep.Rows, CompareRow{Section: section, Router: rr.name, Concurrency: conc, Rep: k, Skipped: "warm-up failed: " + oneLine(err.Error(), 240)})
					continue
				}
				l.prompts, l.seed, l.maxDuration = n, c.Seed, d
				stopped := false
				row, err := measure(rr, func() (CompareRow, error) {
					res, err := l.run(ctx)
					if err != nil {
						return CompareRow{Section: section, Concurrency: conc, Rep: k}, err
					}
					stopped = res.Stopped
					sr := sweepRow(rr.name, section, res)
					return CompareRow{Section: section, Concurrency: conc, Rep: k, Row: sr,
						E2EP50: e2ePct(res, 50), E2EP99: e2ePct(res, 99),
						Completed: res.Metrics.Completed, Failed: n - res.Metrics.Completed}, nil
				})
				if err == nil && stopped && row.Failed > 0 {
					gaveUp[rr.name] = fmt.Sprintf("not run: at C=%d it failed %d of %d requests within the point's %v bound", conc, row.Failed, n, d.Round(time.Second))
				}
				tr.close()
				if err != nil {
					if ctx.Err() != nil {
						return ctx.Err()
					}
					row.Skipped = "failed: " + oneLine(err.Error(), 240)
				}
				rep.Rows = append(rep.Rows, row)
				e.printf("#%d %-8s C=%-5d %-14s %s  CPU %.3f s/1k  RSS %d MiB %s\n",
					k+1, section, conc, rr.name, rowSummary(row.Row), row.CPUPer1k(), row.RouterRSS>>20, row.Skipped)
				ps := append([]*proc{}, workers...)
				if rr.r != nil {
					ps = append(ps, rr.r.proc)
				}
				if err := dead(ps...); err != nil {
					return fmt.Errorf("%s C=%d %s: %w", section, conc, rr.name, err)
				}
			}
		}
	}
	return nil
}

// startNIXLPair starts a NIXL prefill and decode vllm-sim (in that order,
// named sim-<role>-<tag>); what started is returned even on an error, for
// stopSims.
func (e *env) startNIXLPair(ctx context.Context, tag, preset string) ([]*sim, error) {
	var sims []*sim
	for _, role := range []string{"prefill", "decode"} {
		s, err := e.g.startSim(ctx, "sim-"+role+"-"+tag, "--role", role, "--kv-connector", "nixl", "--profile-preset", preset)
		if err != nil {
			return sims, err
		}
		sims = append(sims, s)
	}
	return sims, nil
}

func (e *env) stopSims(sims []*sim) {
	for _, s := range sims {
		e.g.stop(s.proc)
	}
}

// comparePD is scenario 2: one NIXL prefill and one NIXL decode given as
// static --prefill/--decode.
func (e *env) comparePD(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	sims, err := e.startNIXLPair(ctx, "nixl", c.Preset)
	defer e.stopSims(sims)
	if err != nil {
		return err
	}
	for _, role := range []string{"prefill", "decode"} {
		rep.Commands = append(rep.Commands, fmt.Sprintf("vllm-sim --role %s --kv-connector nixl --profile-preset %s", role, c.Preset))
	}
	f := fleetURLs{prefill: sims[0].URL(), decode: sims[1].URL()}
	rs, err := e.startPeers(ctx, all, f, []string{SectionPD}, rep)
	defer e.stopPeers(rs)
	if err != nil {
		return err
	}
	if err := e.streams(ctx, c, rep, SectionPD, c.PDConcurrency, rs, sims[0].proc, sims[1].proc); err != nil || !c.Faults {
		return err
	}
	e.stopPeers(rs)
	return e.compareKillNIXL(ctx, c, rep, all)
}

func joinArgs(a []string) string {
	s := ""
	for i, x := range a {
		if i > 0 {
			s += " "
		}
		s += x
	}
	return s
}

// e2ePct is a percentile of a run's end-to-end latency (NaN when nothing
// completed).
func e2ePct(res *bench.Result, p float64) float64 {
	if res.Metrics.Completed == 0 {
		return math.NaN()
	}
	return res.Percentile(bench.MetricE2EL, p)
}
