package interop

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/chattmpl"
	"github.com/switchyard-llm/switchyard/internal/kvaware"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// tokenizerPrompts are varied texts for the in-process tokenizer: unicode,
// digit runs, contractions, runs of spaces, newlines, tabs, emoji, CJK,
// the model's special tokens inside words.
func tokenizerPrompts() []string {
	ps := []string{
		"Hello world", " leading space", "trailing spaces   ", "many     spaces between",
		"It's I'm you're we've they'll he'd DON'T", "digits 1 12 123 1234 1234567890 3.14159",
		"line one\nline two\n\n\nline five", "crlf\r\nline\r\n", "tabs\tand\t\tmore\t",
		"Emoji 😀🎉👍🏽 👨‍👩‍👧 ❤️ 🇫🇷", "日本語のテキストと中文文本", "한국어 텍스트", "Ünïcödé café naïve résumé",
		"cafe\u0301 combining", "Русский текст и ελληνικά", "\u00a0nbsp\u3000ideographic",
		"def f(x):\n    return x**2\n", `{"json": [1, 2, {"k": null}]}`, "<html><body>a &amp; b</body></html>",
		"in<s>side a word</s>", "<s>at the start", "punct!!! ??? ... ---", "$100 €200 £300",
		"mixed123abc456 x1y22z333", strings.Repeat("a", 200), strings.Repeat("word ", 120),
		"\n\n  \n", " ", "x  \n  y",
	}
	for i := 0; len(ps) < 40; i++ {
		ps = append(ps, fmt.Sprintf("Request %d of a shared system prompt: %s", i, strings.Repeat("Switchyard routes by prefix. ", i%4+1)))
	}
	return ps
}

// TestLocalTokenizerMatchesEngine: the in-process tokenizer loaded from
// the tiny model's directory gives vLLM's /tokenize ids for every prompt
// (with and without special tokens); then switchyard --policy kv_aware
// --tokenizer-path, in front of the same engine, tokenizes the completions
// prompts in-process after probing the engine with its own corpus, checks
// the first 32 prompts against the engine in the background, with no
// mismatch, renders a plain chat request with the model directory's chat
// template (checked at the engine, agreeing), and keeps a chat request it
// does not render exactly on /tokenize.
func TestLocalTokenizerMatchesEngine(t *testing.T) {
	needEnv(t)
	lt, err := tokenizer.Load(modelDir)
	if err != nil {
		t.Fatal(err)
	}
	prompts := tokenizerPrompts()
	for _, p := range prompts {
		for _, add := range []bool{true, false} {
			body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": p, "add_special_tokens": add})
			code, _, b := post(t, ctxT(t, 30*time.Second), unified.URL()+"/tokenize", string(body))
			var out struct{ Tokens []uint32 }
			if code != 200 || json.Unmarshal(b, &out) != nil {
				t.Fatalf("/tokenize %q: %d %s", p, code, b)
			}
			if got := lt.Encode(p, add); !slices.Equal(got, out.Tokens) {
				t.Errorf("%q (add_special_tokens %v): local %v, engine %v", p, add, got, out.Tokens)
			}
		}
	}

	measureLocalVsEngine(t, lt)

	r := bins.StartRouter(t, "--worker-urls", unified.URL(), "--policy", "kv_aware", "--tokenizer-path", modelDir,
		"--health-check-interval-secs", "1")
	r.WaitReady(t, 30*time.Second)
	for _, p := range prompts {
		body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": p, "max_tokens": 1, "temperature": 0})
		if code, _, b := post(t, ctxT(t, 60*time.Second), r.Base+"/v1/completions", string(body)); code != 200 {
			t.Fatalf("completion %q: %d %s", p, code, b)
		}
	}
	m := func(name string) float64 { return metric(t, r.Metrics, "vllm_router_kv_tokenize_"+name) }
	// The router probes the engine when it learns of it; the prompts'
	// checks run after their requests were answered, at most the first
	// 4 on the request's path (those that came before the probe passed).
	want := float64(kvaware.ProbeChecks(true) + min(len(prompts), kvaware.DefaultVerify+kvaware.DefaultBackground))
	deadline := time.Now().Add(30 * time.Second)
	for m("verify_checks_total")+m("verify_dropped_total") < want && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	checks, mismatches, local, enabled := m("verify_checks_total"), m("verify_mismatches_total"), m("local_total"), m("local_enabled")
	dropped, background := m("verify_dropped_total"), m("verify_background_total")
	if checks+dropped != want || checks-background > float64(kvaware.DefaultVerify) ||
		mismatches != 0 || local != float64(len(prompts)) || enabled != 1 {
		t.Errorf("verify checks %v + dropped %v (want %v; %v of them in the background, want all but at most %d), mismatches %v (want 0), local encodes %v (want %d), enabled %v (want 1)",
			checks, dropped, want, background, kvaware.DefaultVerify, mismatches, local, len(prompts), enabled)
	}
	var ws struct {
		KV struct {
			Tokenizer struct {
				Enabled      bool   `json:"enabled"`
				VerifyChecks uint64 `json:"verify_checks"`
				Chat         bool   `json:"chat_in_process"`
			} `json:"tokenizer"`
		} `json:"kv_aware"`
	}
	if harness.GetJSON(t, http.DefaultClient, r.Base+"/workers", &ws) != 200 || !ws.KV.Tokenizer.Enabled ||
		ws.KV.Tokenizer.VerifyChecks != uint64(checks) || !ws.KV.Tokenizer.Chat {
		t.Errorf("/workers kv_aware.tokenizer %+v, want enabled with %v checks, chat in-process", ws.KV.Tokenizer, checks)
	}

	// A plain chat request is rendered with the model directory's chat
	// template and tokenized in-process (the first ones also asked of
	// the engine on their path, and agreeing); one whose message has a
	// name goes to /tokenize.
	chatBefore := m("local_chat_total")
	if code, _, b := post(t, ctxT(t, 60*time.Second), r.Base+"/v1/chat/completions", genBody(true, false, "a chat message", 1)); code != 200 {
		t.Fatalf("chat: %d %s", code, b)
	}
	if c, mm, on := m("local_chat_total"), m("verify_mismatches_total"), m("local_chat_enabled"); c != chatBefore+1 || mm != 0 || on != 1 {
		t.Errorf("plain chat: rendered in-process %v -> %v, mismatches %v, chat enabled %v; want one more, 0, 1", chatBefore, c, mm, on)
	}
	asksBefore, localBefore := m("requests_total"), m("local_total")
	named, _ := json.Marshal(map[string]any{"model": modelDir, "max_tokens": 1,
		"messages": []map[string]string{{"role": "user", "name": "bob", "content": "a named message"}}})
	if code, _, b := post(t, ctxT(t, 60*time.Second), r.Base+"/v1/chat/completions", string(named)); code != 200 {
		t.Fatalf("named chat: %d %s", code, b)
	}
	if asks, local := m("requests_total"), m("local_total"); asks != asksBefore+1 || local != localBefore {
		t.Errorf("chat with a name: /tokenize calls %v -> %v, local encodes %v -> %v; want one more /tokenize call, no local encode",
			asksBefore, asks, localBefore, local)
	}
	t.Logf("%d prompts: local ids equal the engine's; the router encoded them in-process (%v verified, %v of them in the background, %v dropped, %v mismatches)", len(prompts), checks, background, dropped, mismatches)
}

// measureLocalVsEngine times, in one run, the two ways of getting a new
// 1k-word prompt's ids: the real engine's /tokenize over loopback HTTP and
// the in-process encode (its per-word cache warm, as on a running router),
// and checks they agree. docs/KV-ROUTING.md quotes the medians.
func measureLocalVsEngine(t *testing.T, lt *tokenizer.Tokenizer) {
	t.Helper()
	words := strings.Fields("the router sends each request to the engine whose prefix cache already holds most of " +
		"its prompt blended with load tokens blocks events index worker prefill decode system user assistant " +
		"It's we'll don't 2026 3.14 1,000 (see below): caching, routing; latency! throughput? 東京 café 😀")
	var remote, local []time.Duration
	ntoks := 0
	for i := range 20 {
		r := rand.New(rand.NewPCG(uint64(i), 7))
		ws := make([]string, 1000)
		for j := range ws {
			ws[j] = words[r.IntN(len(words))]
		}
		p := strings.Join(ws, " ")
		body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": p})
		start := time.Now()
		code, _, b := post(t, ctxT(t, 30*time.Second), unified.URL()+"/tokenize", string(body))
		remote = append(remote, time.Since(start))
		var out struct{ Tokens []uint32 }
		if code != 200 || json.Unmarshal(b, &out) != nil {
			t.Fatalf("/tokenize: %d %s", code, b)
		}
		start = time.Now()
		ids := lt.Encode(p, true)
		local = append(local, time.Since(start))
		if !slices.Equal(ids, out.Tokens) {
			t.Errorf("1k-word prompt %d: local ids differ from the engine's", i)
		}
		ntoks = len(ids)
	}
	med := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	t.Logf("1k-word prompt (%d tokens), median of 20 distinct prompts: engine /tokenize %v, in-process encode %v",
		ntoks, med(remote), med(local))
}

// TestLocalChatTemplateMatchesEngine: the model directory's chat template
// rendered by internal/chattmpl and tokenized in-process gives vLLM's
// /tokenize ids for chat requests: system and multi-turn conversations,
// unicode, newlines, tabs, empty and whitespace contents, with and without
// the generation prompt.
func TestLocalChatTemplateMatchesEngine(t *testing.T) {
	needEnv(t)
	lt, err := tokenizer.Load(modelDir)
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := chattmpl.Load(modelDir, "")
	if err != nil {
		t.Fatal(err)
	}
	prompts := tokenizerPrompts()
	var convs [][]chattmpl.Message
	for i := 0; i+2 < len(prompts); i += 3 {
		convs = append(convs,
			[]chattmpl.Message{{Role: "user", Content: prompts[i]}},
			[]chattmpl.Message{{Role: "system", Content: prompts[i]}, {Role: "user", Content: prompts[i+1]},
				{Role: "assistant", Content: prompts[i+2]}, {Role: "user", Content: prompts[(i+3)%len(prompts)]}})
	}
	convs = append(convs, []chattmpl.Message{{Role: "user", Content: ""}, {Role: "assistant", Content: "  "}, {Role: "user", Content: "\n"}})
	var remote, local []time.Duration
	for i, conv := range convs {
		for _, gen := range []bool{true, false} {
			body, _ := json.Marshal(map[string]any{"model": modelDir, "messages": conv, "add_generation_prompt": gen})
			start := time.Now()
			code, _, b := post(t, ctxT(t, 30*time.Second), unified.URL()+"/tokenize", string(body))
			remote = append(remote, time.Since(start))
			var out struct{ Tokens []uint32 }
			if code != 200 || json.Unmarshal(b, &out) != nil {
				t.Fatalf("/tokenize chat %d: %d %s", i, code, b)
			}
			start = time.Now()
			text, err := tmpl.Render(conv, gen)
			if err != nil {
				t.Fatalf("chat %d: %v", i, err)
			}
			ids := lt.Encode(text, false)
			local = append(local, time.Since(start))
			if !slices.Equal(ids, out.Tokens) {
				t.Errorf("chat %d (generation prompt %v): local %v, engine %v", i, gen, ids, out.Tokens)
			}
		}
	}
	// Content given as text parts: vLLM joins the non-empty texts with
	// newlines before the template sees them.
	parts := `{"model":` + strconv.Quote(modelDir) + `,"messages":[{"role":"user","content":[{"type":"text","text":"first part"},` +
		`{"type":"text","text":""},{"type":"text","text":"second part"}]}]}`
	code, _, b := post(t, ctxT(t, 30*time.Second), unified.URL()+"/tokenize", parts)
	var out struct{ Tokens []uint32 }
	if code != 200 || json.Unmarshal(b, &out) != nil {
		t.Fatalf("/tokenize text parts: %d %s", code, b)
	}
	text, err := tmpl.Render([]chattmpl.Message{{Role: "user", Content: "first part\nsecond part"}}, true)
	if err != nil {
		t.Fatal(err)
	}
	if ids := lt.Encode(text, false); !slices.Equal(ids, out.Tokens) {
		t.Errorf("text parts: local %v, engine %v", ids, out.Tokens)
	}
	med := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	t.Logf("%d chat requests agree; median engine /tokenize %v, in-process render and encode %v", len(remote)+1, med(remote), med(local))
}
