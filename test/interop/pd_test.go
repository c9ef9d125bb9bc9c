package interop

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// pdRouter starts switchyard in PD mode in front of the real NIXL pair and
// waits until both legs are routed.
func pdRouter(t *testing.T, extra ...string) *harnessRouter {
	t.Helper()
	args := append([]string{"--vllm-pd-disaggregation", "--kv-connector", "nixl",
		"--prefill", prefill.URL(), "--decode", decode.URL(),
		"--health-check-interval-secs", "1"}, extra...)
	r := bins.StartRouter(t, args...)
	r.WaitReady(t, 60*time.Second)
	return r
}

// kvCounters are the decode engine's counters that tell a KV transfer from
// a recomputation.
type kvCounters struct {
	external, local, cacheHit, xfers float64
}

func decodeCounters(t *testing.T) kvCounters {
	t.Helper()
	u := decode.URL() + "/metrics"
	return kvCounters{
		external: metric(t, u, "vllm:prompt_tokens_by_source_total", `source="external_kv_transfer"`),
		local:    metric(t, u, "vllm:prompt_tokens_by_source_total", `source="local_compute"`),
		cacheHit: metric(t, u, "vllm:prompt_tokens_by_source_total", `source="local_cache_hit"`),
		xfers:    metric(t, u, "vllm:nixl_xfer_time_seconds_count"),
	}
}

// pdPrompts are the oracle's prompts: several lengths, the longest well
// over several 32-token KV blocks.
func pdPrompts() []string {
	long := strings.Repeat("The decode engine pulls every block the prefill engine computed. ", 30)
	return []string{
		"Hi",
		"The router",
		"Prefill and decode run on different engines.",
		"Every request becomes a prefill leg and a decode leg with kv_transfer_params.",
		strings.Repeat("KV blocks move between engines. ", 4),
		long,
	}
}

// TestPDNixlTokenIdenticalToUnified: for every prompt, in completions and
// chat, streaming and not, the tokens Switchyard returns from the real
// prefill+decode pair equal the unified engine's at temperature 0, and the
// decode engine's counters show it received the prompt's KV through NIXL
// instead of computing it.
func TestPDNixlTokenIdenticalToUnified(t *testing.T) {
	needEnv(t)
	r := pdRouter(t)
	type tcase struct {
		chat, stream bool
		prompt       string
	}
	var cases []tcase
	for i, p := range pdPrompts() {
		for _, chat := range []bool{false, true} {
			for _, stream := range []bool{false, true} {
				// A distinct prefix per case: the decode engine's own prefix
				// cache must not serve a prompt it has already seen.
				cases = append(cases, tcase{chat, stream, fmt.Sprintf("[case %d %v %v] %s", i, chat, stream, p)})
			}
		}
	}
	if len(cases) < 20 {
		t.Fatalf("only %d cases", len(cases))
	}
	before := decodeCounters(t)
	var promptTokens int
	for _, c := range cases {
		want := generate(t, unified.URL(), c.chat, c.stream, c.prompt, 16)
		got := generate(t, r.Base, c.chat, c.stream, c.prompt, 16)
		if len(got.Tokens) == 0 || !slices.Equal(got.Tokens, want.Tokens) || got.Text != want.Text {
			t.Errorf("chat=%v stream=%v prompt %.40q:\n PD      %v %q\n unified %v %q", c.chat, c.stream, c.prompt, got.Tokens, got.Text, want.Tokens, want.Text)
		}
		if got.PromptTokens != want.PromptTokens {
			t.Errorf("prompt_tokens %d through PD, %d unified", got.PromptTokens, want.PromptTokens)
		}
		promptTokens += want.PromptTokens
	}
	after := decodeCounters(t)
	n := float64(len(cases))
	ext, local := after.external-before.external, after.local-before.local
	t.Logf("decode: %v prompt tokens over %d requests: %v from NIXL, %v computed locally, %v from its prefix cache, %v transfers",
		promptTokens, len(cases), ext, local, after.cacheHit-before.cacheHit, after.xfers-before.xfers)
	// NIXL moves whole prompts' KV; the decode computes at most the last
	// token of each prompt itself. A recomputing decode fails both checks.
	if ext < float64(promptTokens)-n || local > n {
		t.Fatalf("decode recomputed: %v of %d prompt tokens came through NIXL, %v were computed locally", ext, promptTokens, local)
	}
	if after.xfers-before.xfers < n {
		t.Fatalf("decode made %v NIXL transfers for %d requests", after.xfers-before.xfers, len(cases))
	}
	if f := metric(t, decode.URL()+"/metrics", "vllm:nixl_num_failed_transfers_total"); f != 0 {
		t.Fatalf("decode counts %v failed NIXL transfers", f)
	}
}

// TestPDNixlDecodeReadsOnlyWhatItLacks: a prompt whose prefix the decode
// engine already holds (an earlier request through the pair left it in its
// prefix cache) has only the rest of its KV read over NIXL; the held blocks
// count as the decode's own cache hits. vllm-sim's NIXL decode is built to
// the same rule (internal/sim TestNIXLDecodeReadsOnlyWhatItLacks), which
// kv_aware relies on when it picks a decode for its cached prefix.
func TestPDNixlDecodeReadsOnlyWhatItLacks(t *testing.T) {
	needEnv(t)
	r := pdRouter(t)
	shared := "[reads only what it lacks] " + strings.Repeat("A shared system prompt that stays in the decode's prefix cache. ", 10)
	first := generate(t, r.Base, false, false, shared+"First question?", 4)
	before := decodeCounters(t)
	second := generate(t, r.Base, false, false, shared+"A second and different question?", 4)
	after := decodeCounters(t)
	ext, hit, local := after.external-before.external, after.cacheHit-before.cacheHit, after.local-before.local
	t.Logf("decode, second prompt (%d tokens; the first had %d): %v read over NIXL, %v from its own prefix cache, %v computed, %v transfers",
		second.PromptTokens, first.PromptTokens, ext, hit, local, after.xfers-before.xfers)
	// The shared text is most of both prompts: whole 32-token blocks of it
	// must come from the decode's cache, and only the rest over NIXL.
	if hit < float64(kvBlockSize) || int(hit)%kvBlockSize != 0 || hit < float64(first.PromptTokens)/2 {
		t.Errorf("decode served %v tokens of the second prompt from its prefix cache, want whole blocks of the ~%d shared tokens", hit, first.PromptTokens)
	}
	if ext+hit+local != float64(second.PromptTokens) || ext >= float64(second.PromptTokens)/2 {
		t.Errorf("decode read %v of %d prompt tokens over NIXL (%v cached, %v computed): want only what its cache lacks", ext, second.PromptTokens, hit, local)
	}
}

// TestPDNixlConcurrent: concurrent requests through the pair stay
// token-identical to the unified engine (KV of different requests is not
// mixed up).
func TestPDNixlConcurrent(t *testing.T) {
	needEnv(t)
	r := pdRouter(t)
	const n = 8
	want := make([]result, n)
	prompts := make([]string, n)
	for i := range n {
		prompts[i] = fmt.Sprintf("[concurrent %d] %s", i, strings.Repeat("block ", 10+9*i))
		want[i] = generate(t, unified.URL(), false, false, prompts[i], 12)
	}
	got := make([]result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { got[i] = generateE(t, r.Base, prompts[i], 12) })
	}
	wg.Wait()
	for i := range n {
		if !slices.Equal(got[i].Tokens, want[i].Tokens) || len(want[i].Tokens) == 0 {
			t.Errorf("prompt %d: PD %v, unified %v", i, got[i].Tokens, want[i].Tokens)
		}
	}
}

// generateE is generate for goroutines: errors are reported with t.Errorf.
func generateE(t *testing.T, base, prompt string, maxTokens int) result {
	code, _, body, err := postE(ctxT(t, 90*time.Second), base+"/v1/completions", genBody(false, false, prompt, maxTokens))
	if err != nil || code != 200 {
		t.Errorf("%s: %d %s %v", base, code, body, err)
		return result{}
	}
	res, err := parseResultE(body)
	if err != nil {
		t.Error(err)
	}
	return res
}
