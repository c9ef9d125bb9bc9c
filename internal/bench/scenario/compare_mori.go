package scenario

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// moriSection is the compare section of one MoRI-IO transfer mode.
func moriSection(mode string) string { return "pd-moriio-" + strings.ToLower(mode) }

// isMoRISection reports whether a section is a MoRI-IO one.
func isMoRISection(s string) bool { return strings.HasPrefix(s, "pd-moriio-") }

// compareMoRI is scenario 3: PD MoRI-IO with ZMQ discovery (the published
// setup: --kv-connector moriio --vllm-discovery-address, the MoRI policy),
// per transfer mode. Workers register with one router only, so each router
// gets its own prefill/decode pair; all pairs stay up and the routers are
// measured interleaved, as in the other sections.
func (e *env) compareMoRI(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	for _, mode := range c.MoRIModes {
		if err := e.moriMode(ctx, c, rep, all, mode); err != nil {
			return err
		}
	}
	return nil
}

func (e *env) moriMode(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer, mode string) error {
	section := moriSection(mode)
	var rs []running
	var workers []*proc
	defer func() {
		for _, r := range rs {
			e.g.stop(r.r.proc)
		}
		e.g.stop(workers...)
	}()
	simArgs := func(role, addr string) []string {
		return []string{"--role", role, "--kv-connector", "moriio", "--transfer-mode", mode, "--proxy-address", addr,
			"--profile-preset", c.Preset, "--heartbeat-interval", "1s"}
	}
	rep.Commands = append(rep.Commands, "vllm-sim "+strings.Join(simArgs("prefill|decode", "ROUTER_ZMQ"), " ")+" (one pair per router)")
	var pairs []faultPair
	for _, p := range all {
		if p.name == PeerDirect {
			continue
		}
		if _, err := p.args(fleetURLs{discovery: "127.0.0.1:1", policy: c.MoRIPolicy}, 1, 2, ""); errors.Is(err, errUnsupported) {
			rep.Rows = append(rep.Rows, CompareRow{Section: section, Router: p.name, Skipped: err.Error()})
			continue
		}
		dir := filepath.Join(e.o.LogDir, p.name+"-"+section)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		var pair []*sim
		startPair := func(addr string) error {
			// A retried start replaces the pair registered with the last router.
			for _, s := range pair {
				e.g.stop(s.proc)
				workers = slices.DeleteFunc(workers, func(w *proc) bool { return w == s.proc })
			}
			pair = pair[:0]
			for _, role := range []string{"prefill", "decode"} {
				s, err := e.g.startSim(ctx, fmt.Sprintf("sim-%s-%s-%s", role, strings.ToLower(mode), p.name), simArgs(role, addr)...)
				if err != nil {
					return err
				}
				workers = append(workers, s.proc)
				pair = append(pair, s)
			}
			return nil
		}
		r, cmd, err := e.g.startPeer(ctx, p, fleetURLs{discovery: "zmq", policy: c.MoRIPolicy}, dir, startPair)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			why := err.Error()
			if !errors.Is(err, errUnsupported) {
				why = "did not start: " + oneLine(why, 240)
			}
			e.printf("%-14s %s: %s\n", p.name, section, why)
			rep.Rows = append(rep.Rows, CompareRow{Section: section, Router: p.name, Skipped: why})
			continue
		}
		rep.Commands = append(rep.Commands, cmd)
		rs = append(rs, running{peer: p, r: r, base: r.base})
		pairs = append(pairs, faultPair{rr: rs[len(rs)-1], prefill: pair[len(pair)-2], decode: pair[len(pair)-1]})
	}
	if err := e.streams(ctx, c, rep, section, c.MoRIConcurrency, rs, workers...); err != nil {
		return err
	}
	if c.Faults && mode == "WRITE" {
		e.compareFaults(ctx, rep, pairs)
	}
	return nil
}
