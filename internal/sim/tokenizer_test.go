package sim

import (
	"encoding/json"
	"slices"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

const testTokenizer = "../tokenizer/testdata/tiny-llama.json"

// TestTokenizerFlag: with --tokenizer, /tokenize, the completion's usage
// and its prompt_token_ids are the tokenizer.json's ids (what a router
// tokenizing with the same file computes), add_special_tokens included;
// without it, one id per word as before.
func TestTokenizerFlag(t *testing.T) {
	tok, err := tokenizer.Load(testTokenizer)
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	in := startSim(t, "--role", "unified", "--tokenizer", testTokenizer, "--profile-preset", "zero")
	const prompt = "The router forwards prefill and decode legs, café 42"
	want := tok.Encode(prompt, true)
	if len(want) == len(slices.DeleteFunc([]byte(prompt), func(b byte) bool { return b != ' ' }))+1 {
		t.Fatalf("the test tokenizer splits %q into one id per word: pick another prompt", prompt)
	}
	ids := func(v any) []uint32 {
		b, _ := json.Marshal(v)
		var out []uint32
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("ids %s: %v", b, err)
		}
		return out
	}
	r := postJSON(t, ctx, in.url("/tokenize"), map[string]any{"prompt": prompt}, nil)
	if r.status != 200 || !slices.Equal(ids(r.body["tokens"]), want) {
		t.Fatalf("/tokenize: %d %s, want %v", r.status, r.raw, want)
	}
	r = postJSON(t, ctx, in.url("/tokenize"), map[string]any{"prompt": prompt, "add_special_tokens": false}, nil)
	if noSpecial := tok.Encode(prompt, false); r.status != 200 || !slices.Equal(ids(r.body["tokens"]), noSpecial) {
		t.Fatalf("/tokenize without special tokens: %d %s, want %v", r.status, r.raw, noSpecial)
	}
	r = postJSON(t, ctx, in.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": 2, "return_token_ids": true}, nil)
	if r.status != 200 {
		t.Fatalf("completion: %d %s", r.status, r.raw)
	}
	usage, _ := r.body["usage"].(map[string]any)
	if usage["prompt_tokens"] != float64(len(want)) {
		t.Fatalf("usage %v, want prompt_tokens %d", usage, len(want))
	}
	if got := ids(r.body["choices"].([]any)[0].(map[string]any)["prompt_token_ids"]); !slices.Equal(got, want) {
		t.Fatalf("prompt_token_ids %v, want %v", got, want)
	}

	// A chat /tokenize renders as the generation does: the generation
	// prompt unless add_generation_prompt is false, no special tokens.
	msgs := []map[string]string{{"role": "user", "content": prompt}}
	for _, gen := range []bool{true, false} {
		text, aerr := renderChat([]oracle.Message{{Role: "user", Content: prompt}}, &gen, nil)
		if aerr != nil {
			t.Fatal(aerr.message)
		}
		r = postJSON(t, ctx, in.url("/tokenize"), map[string]any{"messages": msgs, "add_generation_prompt": gen}, nil)
		if want := tok.Encode(text, false); r.status != 200 || !slices.Equal(ids(r.body["tokens"]), want) {
			t.Fatalf("/tokenize chat, add_generation_prompt %v: %d %s, want %v", gen, r.status, r.raw, want)
		}
	}

	plain := startSim(t, "--role", "unified", "--profile-preset", "zero")
	r = postJSON(t, ctx, plain.url("/tokenize"), map[string]any{"prompt": prompt}, nil)
	if n := len(ids(r.body["tokens"])); r.status != 200 || n != 9 {
		t.Fatalf("word tokenizer: %d ids for 9 words (%s)", n, r.raw)
	}
}

func TestTokenizerFlagBadFile(t *testing.T) {
	cfg, err := ParseArgs([]string{"--port", "0", "--tokenizer", "/nonexistent/tokenizer.json"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Start(t.Context(), cfg, Options{Logger: testLogger()}); err == nil {
		t.Fatal("started with a missing tokenizer")
	}
}
