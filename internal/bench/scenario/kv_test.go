package scenario

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

func TestKVBound(t *testing.T) {
	for _, tc := range []struct {
		groups, per, prefix, question, turns int
		hits, blocks                         int
	}{
		// single questions: each group's prefix once, then per−1 hits of
		// its full blocks; a partial last block never hits
		{16, 16, 512, 64, 0, 16 * 15 * 512, 16 * (32 + 16*4)},
		{1, 2, 32, 32, 0, 32, 2 + 2*2},
		{2, 4, 40, 8, 0, 2 * 3 * 32, 2 * (2 + 4*1)},
		// two conversations of 2 turns: turn 1 is 32 + 8 tokens, turn 2
		// 40 + answer 8 + question 8; the second turn 1 and both turn 2s
		// find 2 blocks (turn 1's full blocks are the prefix); distinct
		// blocks: the prefix's 2 and each turn 2's third block
		{1, 4, 32, 8, 2, 3 * 32, 2 + 2},
	} {
		c := KVConfig{Groups: tc.groups, PerGroup: tc.per, PrefixLen: tc.prefix, QuestionLen: tc.question, OutputLen: 8, Turns: tc.turns, BlockSize: 16, Seed: 3}
		b, err := c.Bound()
		if err != nil {
			t.Fatal(err)
		}
		if int(b.Hits) != tc.hits || b.Blocks != tc.blocks || b.Queries == 0 {
			t.Errorf("%+v: bound %+v, want hits %d blocks %d", tc, b, tc.hits, tc.blocks)
		}
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
	c, err = parseKV([]string{"--quick", "--routers", "2", "--unified=false"}, &o, io.Discard)
	if err != nil || c.Routers != 2 || !c.NoUnified || !c.PD || c.fileName() != "kv-2routers.md" {
		t.Fatalf("--routers 2 --unified=false: %+v %v", c, err)
	}
	if c, _ := parseKV([]string{"--quick"}, &o, io.Discard); c.Routers != 1 || c.fileName() != "kv.md" {
		t.Errorf("default routers %d, file %s", c.Routers, c.fileName())
	}
	for _, bad := range [][]string{{"--per-group", "1"}, {"--turns", "0"}, {"--repeats", "0"}, {"--num-blocks", "2"}, {"--prefix-len", "4"},
		{"--routers", "0"}, {"--routers", "9"}, {"--unified=false", "--pd=false"}} {
		if _, err := parseKV(bad, &o, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// TestKVRates: --request-rates makes every load point an open loop
// (Poisson arrivals at that rate, the in-flight bound of
// --rate-max-concurrency), and the report names the points by rate.
func TestKVRates(t *testing.T) {
	var o Options
	c, err := parseKV([]string{"--quick", "--request-rates", "50,120.5", "--rate-max-concurrency", "64", "--pd=false"}, &o, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.fileName() != "kv-rates.md" {
		t.Errorf("file %s", c.fileName())
	}
	want := []kvLoad{{Conc: 64, Rate: 50}, {Conc: 64, Rate: 120.5}}
	if got := c.loads(); !slices.Equal(got, want) {
		t.Fatalf("loads %+v, want %+v", got, want)
	}
	cfg := c.benchConfig("http://127.0.0.1:1", want[1], time.Minute)
	if cfg.RequestRate != 120.5 || cfg.MaxConcurrency != 64 || cfg.Burstiness != 1 {
		t.Errorf("bench config: rate %v, max concurrency %d, burstiness %v", cfg.RequestRate, cfg.MaxConcurrency, cfg.Burstiness)
	}
	if f := c.flags(want[0]); !strings.Contains(f, "--request-rate 50 --max-concurrency 64") {
		t.Errorf("flags %q", f)
	}
	closed, _ := parseKV([]string{"--quick", "--concurrency", "8"}, &o, io.Discard)
	if cfg := closed.benchConfig("http://127.0.0.1:1", closed.loads()[0], time.Minute); !math.IsInf(cfg.RequestRate, 1) || cfg.MaxConcurrency != 8 {
		t.Errorf("closed loop: rate %v, max concurrency %d", cfg.RequestRate, cfg.MaxConcurrency)
	}
	for _, bad := range [][]string{{"--request-rates", "0"}, {"--request-rates", "x"}, {"--request-rates", "inf"}, {"--request-rates", "5", "--rate-max-concurrency", "0"}} {
		if _, err := parseKV(bad, &o, io.Discard); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
	rep := KVReport{Config: c, Bound: KVBound{Hits: 1, Queries: 2}, Runs: []KVRun{
		{Fleet: "4 unified", Policy: "cache_aware", Concurrency: 64, Rate: 50, Rep: 1, Queries: 2, Hits: 1, Row: bench.SweepRow{TTFTP50: 20}},
		{Fleet: "4 unified", Policy: "kv_aware", Concurrency: 64, Rate: 50, Rep: 1, Queries: 2, Hits: 1, Row: bench.SweepRow{TTFTP50: 19}},
		{Fleet: "4 unified", Policy: "cache_aware", Concurrency: 64, Rate: 50, Rep: 2, Queries: 2, Hits: 1, Row: bench.SweepRow{TTFTP50: 18}},
		{Fleet: "4 unified", Policy: "kv_aware", Concurrency: 64, Rate: 50, Rep: 2, Queries: 2, Hits: 1, Row: bench.SweepRow{TTFTP50: 18.5}},
		{Fleet: "4 unified", Policy: "kv_aware", Concurrency: 64, Rate: 100, Rep: 1, Queries: 2, Hits: 1, Row: bench.SweepRow{TTFTP50: 1}},
	}}
	var b bytes.Buffer
	if err := rep.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"| fleet | offered req/s | policy |", "| 4 unified | 50/s | kv_aware |", "- 4 unified 50/s: kv_aware hit rate", "(below; lower in 1 of 2 repetitions)", "--request-rate 50 --max-concurrency 64"} {
		if !strings.Contains(b.String(), w) {
			t.Errorf("report lacks %q:\n%s", w, b.String())
		}
	}
}

// TestKVQuick runs a tiny comparison on real sims: every request served,
// the workers' counters see every prompt token, and no run beats the
// bound (which would mean the bound or the measurement is wrong).
func TestKVQuick(t *testing.T) {
	out := t.TempDir()
	var log bytes.Buffer
	const bypass = "kv_aware+--pd-uncached-token-threshold=64" // PD fleet only
	c := KVConfig{Policies: []string{"round_robin", "kv_aware", bypass}, Concurrency: []int{2}, Repeats: 1,
		Groups: 3, PerGroup: 4, PrefixLen: 64, QuestionLen: 8, OutputLen: 4, BlockSize: 16, NumBlocks: 64,
		Unified: 2, PD: true, Seed: 1, PointTimeout: 30 * time.Second}
	rep, err := RunKV(context.Background(), Options{BinDir: binDir, OutDir: out, MaxDuration: 2 * time.Minute, Out: &log, Command: "test"}, c)
	if err != nil {
		t.Fatalf("RunKV: %v\n%s", err, log.String())
	}
	noChildren(t)
	if len(rep.Runs) != 5 {
		t.Fatalf("runs = %d, want 4 and the PD-only one\n%s", len(rep.Runs), log.String())
	}
	bound, err := c.Bound()
	if err != nil {
		t.Fatal(err)
	}
	best := bound.Rate()
	for _, r := range rep.Runs {
		if r.Note != "" || r.Row.Failed != 0 || !(r.Row.TTFTP50 > 0) {
			t.Errorf("%s %s: note %q failed %d TTFT %v", r.Fleet, r.Policy, r.Note, r.Row.Failed, r.Row.TTFTP50)
		}
		if want := uint64(c.prompts() * (c.PrefixLen + c.QuestionLen)); r.Queries != want {
			t.Errorf("%s %s: %d prefix-cache queries, want %d", r.Fleet, r.Policy, r.Queries, want)
		}
		// kv_aware tokenizes every distinct prompt once (12 here) at an
		// engine; round_robin never.
		if tok := r.TokenizeCalls; strings.HasPrefix(r.Policy, "kv_aware") != (tok == uint64(c.prompts()) && r.TokenizeSeconds > 0) {
			t.Errorf("%s %s: %d /tokenize calls in %v s", r.Fleet, r.Policy, tok, r.TokenizeSeconds)
		}
		// Read, not NaN (process_cpu_seconds_total counts in 10 ms steps:
		// 12 requests may cost less than one).
		if !(r.RouterCPU >= 0) || r.Requests != c.prompts() {
			t.Errorf("%s %s: router CPU %v s over %d requests, want >= 0 over %d", r.Fleet, r.Policy, r.RouterCPU, r.Requests, c.prompts())
		}
		if capped := bound.CappedRate(cachesOf(r.PD, r.Policy)); r.HitRate() > capped+1e-9 || capped > best {
			t.Errorf("%s %s: hit rate %v, bound %v with the fleet's caches, %v without eviction", r.Fleet, r.Policy, r.HitRate(), capped, best)
		}
		// A group's later prompts (8 uncached tokens on the decode that
		// holds the group's prefix) go to the decode alone.
		if (r.Policy == bypass) != (r.Bypassed > 0) || (r.Policy == bypass && !r.PD) {
			t.Errorf("%s %s: %d requests bypassed the prefill", r.Fleet, r.Policy, r.Bypassed)
		}
	}
	md, err := os.ReadFile(filepath.Join(out, "kv.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"**Best achievable hit rate: 66.7 %** (576 of 864 prompt tokens)", "| 2 unified | 2 | kv_aware |", "| 2P2D NIXL | 2 | round_robin |", "| 2P2D NIXL | 2 | " + bypass + " |", "router CPU s / 1k req |", "## Targets", "- 2 unified C=2: kv_aware hit rate", "**Best achievable with the fleet's caches**", "below the fleet's bound", "## The router's /tokenize calls (kv_aware)"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("kv.md lacks %q:\n%s", want, md)
		}
	}
}

// TestKVBoundTokenizer: with --tokenizer the bound counts the tokenizer's
// tokens (what the sims cache), not words.
func TestKVBoundTokenizer(t *testing.T) {
	c := KVConfig{Groups: 2, PerGroup: 4, PrefixLen: 40, QuestionLen: 8, OutputLen: 8, BlockSize: 16, Seed: 3}
	words, err := c.Bound()
	if err != nil {
		t.Fatal(err)
	}
	c.Tokenizer = "../../tokenizer/testdata/tiny-llama.json"
	toks, err := c.Bound()
	if err != nil {
		t.Fatal(err)
	}
	if toks.Queries <= words.Queries || toks.Hits == 0 || toks.Hits >= toks.Queries {
		t.Fatalf("tokenizer bound %+v against the word bound %+v: want more tokens than words, some but not all cached", toks, words)
	}
	if args := c.kvSimArgs(64); !strings.Contains(strings.Join(args, " "), "--tokenizer "+c.Tokenizer) {
		t.Fatalf("sim args %v lack --tokenizer", args)
	}
	c.Tokenizer = "/nonexistent/tokenizer.json"
	if _, err := c.Bound(); err == nil {
		t.Fatal("a missing tokenizer was accepted")
	}
}

// TestKVBoundsPerRepetition: each repetition's bound is that of its own
// seed (Seed + r × SeedStep), and the report's is their sum; with
// SeedStep 0 every repetition has the first one's.
func TestKVBoundsPerRepetition(t *testing.T) {
	c := KVConfig{Groups: 2, PerGroup: 4, PrefixLen: 40, QuestionLen: 8, OutputLen: 8, BlockSize: 16, Seed: 3,
		Repeats: 3, SeedStep: 5, Tokenizer: "../../tokenizer/testdata/tiny-llama.json"}
	per, sum, err := c.Bounds()
	if err != nil {
		t.Fatal(err)
	}
	if len(per) != 3 {
		t.Fatalf("%d bounds for 3 repetitions", len(per))
	}
	var hits, queries uint64
	for r, b := range per {
		cr := c
		cr.Seed = 3 + 5*int64(r)
		want, err := cr.Bound()
		if err != nil {
			t.Fatal(err)
		}
		if b != want {
			t.Errorf("repetition %d: bound %+v, want seed %d's %+v", r, b, cr.Seed, want)
		}
		hits, queries = hits+b.Hits, queries+b.Queries
	}
	if per[0] == per[1] && per[1] == per[2] {
		t.Errorf("three seeds, one bound %+v: the seeds were not used", per[0])
	}
	if sum.Hits != hits || sum.Queries != queries {
		t.Errorf("sum %+v, want hits %d queries %d", sum, hits, queries)
	}
	c.SeedStep = 0
	if per, _, err = c.Bounds(); err != nil || per[1] != per[0] || per[2] != per[0] {
		t.Errorf("seed step 0: bounds %+v (%v), want the first one's thrice", per, err)
	}
}
