package scenario

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// SectionCeiling is the concurrency ramp of the compare scenario.
const SectionCeiling = "ceiling"

// groupSampler records the peak summed RSS of a process group.
type groupSampler struct {
	stop chan struct{}
	wg   sync.WaitGroup
	peak int64
}

func sampleGroup(pgid int, every time.Duration) *groupSampler {
	s := &groupSampler{stop: make(chan struct{})}
	pids := groupPids(pgid) // fixed for a running router: one /proc scan
	s.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			var rss int64
			for _, p := range pids {
				rss += procRSS(p)
			}
			s.peak = max(s.peak, rss)
			select {
			case <-s.stop:
				return
			case <-t.C:
			}
		}
	})
	return s
}

func (s *groupSampler) finish() int64 {
	close(s.stop)
	s.wg.Wait()
	return s.peak
}

// compareCeiling is scenario 4: PD NIXL with paced workers (the decode
// runs 256 sequences at a time, the rest stay open in its queue); each
// router in turn ramps C concurrent streams, C requests per step, until a
// step has a failed request. Routers run one after the other (a ramp cannot
// be interleaved), each on a fresh fleet.
func (e *env) compareCeiling(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	if len(c.CeilingConcurrency) == 0 {
		return nil
	}
	rep.Commands = append(rep.Commands, fmt.Sprintf("vllm-sim --role prefill|decode --kv-connector nixl --profile-preset %s (a fresh pair per router)", c.CeilingPreset))
	l0 := load{input: c.CeilingInput, output: c.CeilingOutput, seed: c.Seed}
	rep.Commands = append(rep.Commands, "sybench "+strings.Replace(l0.flags(), "--max-concurrency 0 --num-prompts 0", "--max-concurrency C --num-prompts C", 1))
	for _, p := range all {
		if err := e.ceilingFor(ctx, c, rep, p, l0); err != nil {
			return err
		}
	}
	return nil
}

func (e *env) ceilingFor(ctx context.Context, c CompareConfig, rep *CompareReport, p peer, l0 load) error {
	if p.name == PeerDirect {
		return nil
	}
	probe := fleetURLs{prefill: "http://127.0.0.1:1", decode: "http://127.0.0.1:2"}
	if _, err := p.args(probe, 1, 2, ""); errors.Is(err, errUnsupported) { // no fleet for a router that cannot run PD
		rep.Rows = append(rep.Rows, CompareRow{Section: SectionCeiling, Router: p.name, Skipped: err.Error()})
		return nil
	}
	sims, err := e.startNIXLPair(ctx, "ceiling", c.CeilingPreset)
	defer e.stopSims(sims)
	if err != nil {
		return err
	}
	f := fleetURLs{prefill: sims[0].URL(), decode: sims[1].URL()}
	rs, err := e.startPeers(ctx, []peer{p}, f, []string{SectionCeiling}, rep)
	defer e.stopPeers(rs)
	if err != nil || len(rs) == 0 {
		return err
	}
	rr := rs[0]
	for _, conc := range c.CeilingConcurrency {
		d, err := e.budget(c.PointTimeout, 15*time.Second)
		if err != nil {
			return err
		}
		tr := newBenchTransport(conc)
		l := l0
		l.base, l.transport, l.concurrency, l.prompts, l.maxDuration = rr.base, tr, conc, conc, d
		smp := sampleGroup(rr.r.Pid(), 100*time.Millisecond)
		row, err := measure(rr, func() (CompareRow, error) {
			res, err := l.run(ctx)
			if err != nil {
				return CompareRow{Section: SectionCeiling, Concurrency: conc}, err
			}
			sr := sweepRow(rr.name, SectionCeiling, res)
			return CompareRow{Section: SectionCeiling, Concurrency: conc, Row: sr, Completed: res.Metrics.Completed,
				Failed: conc - res.Metrics.Completed}, nil
		})
		row.RouterRSS = max(row.RouterRSS, smp.finish())
		tr.close()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			row.Skipped = "failed: " + oneLine(err.Error(), 240)
		}
		rep.Rows = append(rep.Rows, row)
		e.printf("ceiling C=%-5d %-14s completed %d/%d, %.1f req/s, TTFT P50 %s ms, peak RSS %d MiB, CPU %.3f s/1k %s\n",
			conc, rr.name, row.Completed, conc, row.Row.RequestThroughput, ms(row.Row.TTFTP50), row.RouterRSS>>20, row.CPUPer1k(), row.Skipped)
		if derr := dead(rr.r.proc, sims[0].proc, sims[1].proc); derr != nil {
			rep.Notes = append(rep.Notes, fmt.Sprintf("ceiling: %s at C=%d: %s", rr.name, conc, oneLine(derr.Error(), 300)))
			return nil
		}
		if row.Failed > 0 || row.Skipped != "" {
			return nil // the first failing step ends this router's ramp
		}
	}
	return nil
}

// ceilingTable writes the ramp table and each router's first failing C.
func (r *CompareReport) ceilingTable(b *strings.Builder) {
	names := r.routers(SectionCeiling)
	if len(names) == 0 {
		return
	}
	c := r.Config
	fmt.Fprintf(b, "## Concurrency ceiling, PD NIXL (static workers, `--profile-preset %s`)\n\n", c.CeilingPreset)
	fmt.Fprintf(b, "Each router in turn on a fresh prefill/decode pair; C concurrent streams, C requests per step (input %d, output %d), every step bounded to %v; a router's ramp stops at its first step with a failed request. RSS is the router's peak during the step (sampled every 100 ms).\n\n",
		c.CeilingInput, c.CeilingOutput, c.PointTimeout)
	b.WriteString("| Router | C | Completed | Failed | Req/s | TTFT P50 / P99 ms | Router peak RSS MiB | RSS per stream KiB | Router CPU s / 1k req |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	var first []string
	for _, n := range names {
		failedAt := 0
		for _, x := range r.Rows {
			if x.Section != SectionCeiling || x.Router != n {
				continue
			}
			if x.Concurrency == 0 {
				fmt.Fprintf(b, "| %s | — | — | — | — | — | — | — | %s |\n", n, x.Skipped)
				continue
			}
			if x.Skipped != "" {
				fmt.Fprintf(b, "| %s | %d | — | — | — | — | %.0f | — | %s |\n", n, x.Concurrency, float64(x.RouterRSS)/(1<<20), x.Skipped)
			} else {
				fmt.Fprintf(b, "| %s | %d | %d | %d | %.1f | %s / %s | %.0f | %.0f | %.3f |\n", n, x.Concurrency, x.Completed, x.Failed,
					x.Row.RequestThroughput, ms(x.Row.TTFTP50), ms(x.Row.TTFTP99), float64(x.RouterRSS)/(1<<20),
					float64(x.RouterRSS)/1024/float64(x.Concurrency), x.CPUPer1k())
			}
			if (x.Failed > 0 || x.Skipped != "") && failedAt == 0 {
				failedAt = x.Concurrency
			}
		}
		ran := false
		for _, x := range r.Rows {
			ran = ran || (x.Section == SectionCeiling && x.Router == n && x.Concurrency > 0)
		}
		switch {
		case !ran:
			first = append(first, n+": not run")
		case failedAt > 0:
			first = append(first, fmt.Sprintf("%s: C=%d", n, failedAt))
		default:
			first = append(first, n+": none")
		}
	}
	fmt.Fprintf(b, "\nFirst concurrency with a failed request: %s.\n\n", strings.Join(first, "; "))
}
