package bench

import (
	"encoding/json"
	"math"
	"strings"
	"testing"
)

func randomCfg(in, out int, r float64, n int, seed int64) Config {
	c := DefaultConfig()
	c.InputLen, c.OutputLen, c.RangeRatio, c.NumPrompts, c.Seed = in, out, r, n, seed
	return c
}

func TestRandomDatasetLengthBounds(t *testing.T) {
	cases := []struct {
		in, out      int
		r            float64
		inLo, inHi   int
		outLo, outHi int
	}{
		{1024, 128, 0, 1024, 1024, 128, 128},
		{1000, 1000, 0.5, 500, 1500, 500, 1500},
		{10, 3, 0.25, 7, 13, 2, 4}, // floor(7.5), ceil(12.5); floor(2.25), ceil(3.75)
		{5, 1, 0.99, 0, 10, 1, 2},  // output low clamped to 1
		{0, 1, 0, 0, 0, 1, 1},
	}
	for _, c := range cases {
		cfg := randomCfg(c.in, c.out, c.r, 4000, 7)
		s := randomSamples(&cfg)
		gotInLo, gotInHi, gotOutLo, gotOutHi := math.MaxInt, -1, math.MaxInt, -1
		for _, x := range s {
			gotInLo, gotInHi = min(gotInLo, x.PromptLen), max(gotInHi, x.PromptLen)
			gotOutLo, gotOutHi = min(gotOutLo, x.OutputLen), max(gotOutHi, x.OutputLen)
		}
		// With 4000 draws every endpoint of these small ranges is hit.
		if gotInLo != c.inLo || gotInHi != c.inHi || gotOutLo != c.outLo || gotOutHi != c.outHi {
			t.Errorf("in=%d out=%d r=%v: input [%d,%d] output [%d,%d], want [%d,%d] [%d,%d]",
				c.in, c.out, c.r, gotInLo, gotInHi, gotOutLo, gotOutHi, c.inLo, c.inHi, c.outLo, c.outHi)
		}
	}
}

func TestRandomDatasetUniformAndDeterministic(t *testing.T) {
	cfg := randomCfg(100, 100, 0.1, 20000, 1234)
	a := randomSamples(&cfg)
	b := randomSamples(&cfg)
	counts := map[int]int{}
	for i := range a {
		if a[i].PromptLen != b[i].PromptLen || a[i].OutputLen != b[i].OutputLen || a[i].Prompt() != b[i].Prompt() {
			t.Fatalf("sample %d differs between runs with the same seed", i)
		}
		counts[a[i].PromptLen]++
	}
	// floor(100*0.9)=90 .. ceil(100*1.1)=111: in binary floating point
	// 100*1.1 is 110.00000000000001, so (as in Python) the top is 111.
	// 22 values, ~909 each; allow generous slack.
	if len(counts) != 22 || counts[90] == 0 || counts[111] == 0 {
		t.Errorf("got %d distinct input lengths, want 22 (90..111)", len(counts))
	}
	for v, n := range counts {
		if n < 750 || n > 1070 {
			t.Errorf("length %d drawn %d times: not uniform", v, n)
		}
	}
	cfg.Seed = 1235
	c := randomSamples(&cfg)
	same := 0
	for i := range a {
		if a[i].PromptLen == c[i].PromptLen {
			same++
		}
	}
	if same > len(a)/10 {
		t.Errorf("different seeds gave %d/%d equal lengths", same, len(a))
	}
}

func TestPromptsTokenizeToSampledLength(t *testing.T) {
	cfg := randomCfg(50, 8, 0.5, 200, 3)
	cfg.RandomPrefixLen = 7
	s := randomSamples(&cfg)
	prefix := strings.Join(strings.Fields(s[0].Prompt())[:7], " ")
	for _, x := range s {
		p := x.Prompt()
		if got := len(strings.Fields(p)); got != x.PromptLen {
			t.Fatalf("prompt has %d whitespace tokens, want %d: %q", got, x.PromptLen, p)
		}
		if !strings.HasPrefix(p, prefix) {
			t.Fatalf("prompt does not start with the shared random prefix")
		}
		if strings.Contains(p, "  ") || strings.HasSuffix(p, " ") {
			t.Fatalf("prompt has stray spaces: %q", p)
		}
		if b, _ := json.Marshal(p); string(b) != `"`+p+`"` {
			t.Fatalf("prompt needs JSON escaping: %q", p)
		}
	}
	if s[0].Prompt() == s[1].Prompt() {
		t.Error("two prompts are identical")
	}
}

func TestSharedPrefixDataset(t *testing.T) {
	cfg := DefaultConfig()
	cfg.DatasetName = DatasetSharedPrefix
	cfg.SharedPrefixGroups, cfg.SharedPrefixPromptsPerGroup, cfg.SharedPrefixLen = 4, 5, 32
	cfg.InputLen, cfg.OutputLen = 16, 4
	if err := cfg.normalize(); err != nil {
		t.Fatal(err)
	}
	if cfg.NumPrompts != 20 {
		t.Fatalf("num prompts = %d, want 20", cfg.NumPrompts)
	}
	s, err := buildSamples(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	groups := map[string]int{}
	for i, x := range s {
		if x.Index != i {
			t.Fatalf("index %d at position %d", x.Index, i)
		}
		w := strings.Fields(x.Prompt())
		if len(w) != x.PromptLen || x.PromptLen != 32+16 {
			t.Fatalf("prompt len %d / %d, want 48", len(w), x.PromptLen)
		}
		groups[strings.Join(w[:32], " ")]++
	}
	if len(groups) != 4 {
		t.Fatalf("got %d distinct prefixes, want 4", len(groups))
	}
	for _, n := range groups {
		if n != 5 {
			t.Errorf("group size %d, want 5", n)
		}
	}
	// Shuffled: the first five are not all one group.
	if samePrefix(s[0], s[1]) && samePrefix(s[1], s[2]) && samePrefix(s[2], s[3]) && samePrefix(s[3], s[4]) {
		t.Error("shared-prefix requests are not interleaved")
	}
}

func TestArrivalOffsets(t *testing.T) {
	d := arrivalOffsets(5, math.Inf(1), 1, 0)
	for _, v := range d {
		if v != 0 {
			t.Fatalf("infinite rate must send at t=0, got %v", d)
		}
	}
	for _, burst := range []float64{0.5, 1, 3, math.Inf(1)} {
		d = arrivalOffsets(1000, 50, burst, 42)
		if !near(d[len(d)-1], 1000.0/50) {
			t.Errorf("burstiness %v: last offset %v, want 20 (rescaled)", burst, d[len(d)-1])
		}
		for i := 1; i < len(d); i++ {
			if d[i] < d[i-1] {
				t.Fatalf("offsets not monotonic")
			}
		}
		e := arrivalOffsets(1000, 50, burst, 42)
		if e[500] != d[500] {
			t.Errorf("arrival offsets not deterministic")
		}
	}
}

// TestConversationSamples: every turn resends its predecessor's prompt and
// an answer, comes after it, and counts its words.
func TestConversationSamples(t *testing.T) {
	for _, tc := range []struct{ groups, per, turns int }{{2, 6, 3}, {3, 5, 2}, {1, 4, 4}} {
		cfg := DefaultConfig()
		cfg.BaseURL, cfg.Model, cfg.DatasetName = "http://127.0.0.1:1", "m", DatasetSharedPrefix
		cfg.SharedPrefixGroups, cfg.SharedPrefixPromptsPerGroup, cfg.SharedPrefixLen, cfg.SharedPrefixTurns = tc.groups, tc.per, 32, tc.turns
		cfg.InputLen, cfg.OutputLen, cfg.RangeRatio = 8, 4, 0
		s, err := Samples(cfg)
		if err != nil || len(s) != tc.groups*tc.per {
			t.Fatalf("%+v: %d samples, %v", tc, len(s), err)
		}
		firsts := 0
		for i, a := range s {
			p := a.Prompt()
			if n := len(strings.Fields(p)); n != a.PromptLen || a.Index != i {
				t.Fatalf("%+v sample %d: %d words, PromptLen %d, index %d", tc, i, n, a.PromptLen, a.Index)
			}
			if a.PromptLen == 32+8 {
				firsts++
				continue
			}
			// Its predecessor: an earlier prompt it extends by one answer and
			// one question.
			found := false
			for _, b := range s[:i] {
				if q := b.Prompt(); strings.HasPrefix(p, q+" ") && a.PromptLen == b.PromptLen+4+8 {
					found = true
				}
			}
			if !found {
				t.Fatalf("%+v sample %d (%d words) has no predecessor before it", tc, i, a.PromptLen)
			}
		}
		if want := tc.groups * ((tc.per + tc.turns - 1) / tc.turns); firsts != want {
			t.Fatalf("%+v: %d first turns, want %d", tc, firsts, want)
		}
	}
}
