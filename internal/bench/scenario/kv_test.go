package scenario

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestKVBestHitRate(t *testing.T) {
	for _, tc := range []struct {
		groups, per, prefix, question, bs int
		want                              float64
	}{
		{16, 16, 512, 64, 16, 16 * 15 * 512 / float64(256*576)},
		{1, 2, 32, 32, 16, 32 / float64(2*64)},
		{2, 4, 40, 8, 16, 2 * 3 * 32 / float64(8*48)}, // a partial last block never hits
	} {
		c := KVConfig{Groups: tc.groups, PerGroup: tc.per, PrefixLen: tc.prefix, QuestionLen: tc.question, BlockSize: tc.bs}
		if got := c.BestHitRate(); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("%+v: best %v, want %v", tc, got, tc.want)
		}
	}
	c := DefaultKVConfig()
	if !c.FitsFleet(c.Unified, 4) || c.FitsFleet(1, 4) {
		t.Errorf("FitsFleet: 4 workers %v, 1 worker %v", c.FitsFleet(c.Unified, 4), c.FitsFleet(1, 4))
	}
}

func TestKVFlags(t *testing.T) {
	var o Options
	c, err := parseKV([]string{"--quick", "--policies", "kv_aware,kv_aware+--kv-load-weight=0.1", "--concurrency", "2,4", "--pd=false"}, &o, io.Discard)
	if err != nil || len(c.Policies) != 2 || c.Concurrency[1] != 4 || c.PD || c.Repeats != 1 {
		t.Fatalf("%+v %v", c, err)
	}
	if p, extra := policyFlags(c.Policies[1]); p != "kv_aware" || len(extra) != 1 || extra[0] != "--kv-load-weight=0.1" {
		t.Fatalf("policyFlags: %q %q", p, extra)
	}
	for _, bad := range [][]string{{"--per-group", "1"}, {"--repeats", "0"}, {"--num-blocks", "2"}, {"--prefix-len", "4"}} {
		if _, err := parseKV(bad, &o, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestKVQuick runs a tiny comparison on real sims: every request served,
// the workers' counters see every prompt token, and no run beats the
// bound (which would mean the bound or the measurement is wrong).
func TestKVQuick(t *testing.T) {
	out := t.TempDir()
	var log bytes.Buffer
	c := KVConfig{Policies: []string{"round_robin", "kv_aware"}, Concurrency: []int{2}, Repeats: 1,
		Groups: 3, PerGroup: 4, PrefixLen: 64, QuestionLen: 8, OutputLen: 4, BlockSize: 16, NumBlocks: 64,
		Unified: 2, PD: true, Seed: 1, PointTimeout: 30 * time.Second}
	rep, err := RunKV(context.Background(), Options{BinDir: binDir, OutDir: out, MaxDuration: 2 * time.Minute, Out: &log, Command: "test"}, c)
	if err != nil {
		t.Fatalf("RunKV: %v\n%s", err, log.String())
	}
	noChildren(t)
	if len(rep.Runs) != 4 {
		t.Fatalf("runs = %d, want 4\n%s", len(rep.Runs), log.String())
	}
	best := c.BestHitRate()
	for _, r := range rep.Runs {
		if r.Note != "" || r.Row.Failed != 0 || !(r.Row.TTFTP50 > 0) {
			t.Errorf("%s %s: note %q failed %d TTFT %v", r.Fleet, r.Policy, r.Note, r.Row.Failed, r.Row.TTFTP50)
		}
		if want := uint64(c.prompts() * (c.PrefixLen + c.QuestionLen)); r.Queries != want {
			t.Errorf("%s %s: %d prefix-cache queries, want %d", r.Fleet, r.Policy, r.Queries, want)
		}
		if r.HitRate() > best+1e-9 {
			t.Errorf("%s %s: hit rate %v above the bound %v", r.Fleet, r.Policy, r.HitRate(), best)
		}
	}
	md, err := os.ReadFile(filepath.Join(out, "kv.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"**Best achievable hit rate: 66.7 %.**", "| 2 unified | 2 | kv_aware |", "| 2P2D NIXL | 2 | round_robin |", "## Targets"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("kv.md lacks %q:\n%s", want, md)
		}
	}
}
