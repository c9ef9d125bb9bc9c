package scenario

import (
	"bytes"
	"context"
	"math"
	"strings"
	"testing"
	"time"
)

// TestFlowTiny runs the flow scenario on a tiny budget: seven runs, nothing
// lost, the high band never timed out with flow control (with and without
// engine priority).
func TestFlowTiny(t *testing.T) {
	c := QuickFlowConfig()
	c.Duration, c.Idle, c.QueueTimout, c.OutputLen, c.InputWords = 2*time.Second, time.Second, time.Second, 8, 16
	var log bytes.Buffer
	rep, err := RunFlow(context.Background(), Options{BinDir: binDir, MaxDuration: 2 * time.Minute, Out: &log, Command: "test"}, c)
	if err != nil {
		t.Fatalf("RunFlow: %v\n%s", err, log.String())
	}
	noChildren(t)
	if len(rep.Runs) != 8 || !(rep.CapacityRPS > 0) || math.IsNaN(rep.IdleP99) {
		t.Fatalf("report: %+v", rep)
	}
	for _, r := range rep.Runs {
		sent := 0
		for _, k := range r.Classes {
			sent += k.Sent
			if k.Lost != 0 || k.Other != 0 {
				t.Errorf("%s %s: lost %d other %d (%v)", r.Name, k.Class, k.Lost, k.Other, r.Failures)
			}
		}
		if sent == 0 {
			t.Errorf("%s: nothing sent", r.Name)
		}
	}
	for _, i := range []int{0, 1, 2} { // flow control; the same with prefill rules, with engine priority
		if hi := rep.Runs[i].Classes[0]; hi.Class != "high" || hi.R408 != 0 || hi.OK200 != hi.Sent {
			t.Errorf("%s: high band %+v", rep.Runs[i].Name, hi)
		}
	}
	if !strings.Contains(rep.Runs[1].Router, "--flow-isolate-prefill") {
		t.Errorf("run 1 router flags %q lack --flow-isolate-prefill", rep.Runs[1].Router)
	}
	if !strings.Contains(rep.Runs[2].Router, "--flow-engine-priority") {
		t.Errorf("run 2 router flags %q lack --flow-engine-priority", rep.Runs[2].Router)
	}
	if rep.IdleMatchN == 0 || rep.IdleMatchDur < c.Idle {
		t.Errorf("matched idle run: %d samples over %v", rep.IdleMatchN, rep.IdleMatchDur)
	}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil || !strings.Contains(md.String(), "### tenants 10:1, flow control") {
		t.Fatalf("markdown (%v):\n%s", err, md.String())
	}
}

func TestFlowSummarize(t *testing.T) {
	var outs []flowOutcome
	add := func(class string, status int, ok bool, n int) {
		for range n {
			outs = append(outs, flowOutcome{class: class, status: status, ok: ok, ttft: 10 * time.Millisecond, reason: "x"})
		}
	}
	add("heavy", 200, true, 70)
	add("heavy", 408, true, 100)
	add("heavy", 429, true, 5)
	add("light", 200, true, 20)
	add("light", 200, false, 1) // a stream cut short: lost
	cls, fails := summarize(outs, []string{"heavy", "light"}, true)
	h, l := cls[0], cls[1]
	if h.Sent != 175 || h.OK200 != 70 || h.R408 != 100 || h.R429 != 5 || l.Lost != 1 || len(fails) != 1 {
		t.Fatalf("counts %+v %+v %v", h, l, fails)
	}
	// light asked for 21 of 90 completions (< half): its fair share is all of it
	if math.Abs(l.FairPct-100*21.0/90) > 1e-9 || math.Abs(l.CompletionShare-100*20.0/90) > 1e-9 || math.Abs(h.FairPct+l.FairPct-100) > 1e-9 {
		t.Fatalf("shares %+v %+v", h, l)
	}
	if p := percentile([]float64{5, 1, 3, 2, 4}, 99); p != 5 {
		t.Fatalf("p99 %v", p)
	}
	if p := percentile([]float64{5, 1, 3, 2, 4}, 50); p != 3 {
		t.Fatalf("p50 %v", p)
	}
}
