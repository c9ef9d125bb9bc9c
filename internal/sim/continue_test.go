package sim

import (
	"context"
	"net/http"
	"slices"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// TestContinuationRequests checks the three ways a router continues an
// interrupted answer on another worker: a completion with the prompt plus
// the partial text, a completion with the prompt's and the partial's token
// ids, and a chat request whose last message is the partial answer
// (continue_final_message, add_generation_prompt=false). Each must
// generate exactly the rest of the uninterrupted answer.
func TestContinuationRequests(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--profile-preset", "zero", "--seed", "5")
	const n, k = 12, 5
	prompt := "tell me a story about the sea"
	full := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": n, "ignore_eos": true, "return_token_ids": true}, nil)
	fc := full.body["choices"].([]any)[0].(map[string]any)
	fullText := fc["text"].(string)
	if want := oracle.Text(oracle.DigestText(prompt), 5, n); fullText != want {
		t.Fatalf("full text %q, want %q", fullText, want)
	}
	fullIDs := toIDs(t, fc["token_ids"])
	if !slices.Equal(fullIDs, oracle.Generate(oracle.DigestText(prompt), 5, n)) {
		t.Fatalf("token_ids %v differ from the oracle", fullIDs)
	}
	if got := toIDs(t, fc["prompt_token_ids"]); !slices.Equal(got, oracle.Tokenize(prompt)) {
		t.Errorf("prompt_token_ids %v", got)
	}
	partial := oracle.Text(oracle.DigestText(prompt), 5, k)

	t.Run("completion text", func(t *testing.T) {
		r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": prompt + partial, "max_tokens": n - k, "ignore_eos": true}, nil)
		if got := r.body["choices"].([]any)[0].(map[string]any)["text"]; partial+got.(string) != fullText {
			t.Errorf("continued %q + %q, want %q", partial, got, fullText)
		}
	})
	t.Run("completion token ids", func(t *testing.T) {
		ids := append(oracle.Tokenize(prompt), fullIDs[:k]...)
		res := doStream(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": ids, "max_tokens": n - k, "ignore_eos": true, "stream": true, "return_token_ids": true}, nil)
		if partial+res.text != fullText || !res.done {
			t.Errorf("continued %q, want the rest of %q", res.text, fullText)
		}
		var got []uint32
		for i, ev := range res.events {
			c := ev["choices"].([]any)[0].(map[string]any)
			got = append(got, toIDs(t, c["token_ids"])...)
			if _, has := c["prompt_token_ids"]; has != (i == 0) {
				t.Errorf("event %d: prompt_token_ids present=%v (first chunk only)", i, has)
			}
		}
		if !slices.Equal(got, fullIDs[k:]) {
			t.Errorf("streamed token_ids %v, want %v", got, fullIDs[k:])
		}
	})
	t.Run("chat continue_final_message", func(t *testing.T) {
		user := []any{map[string]any{"role": "user", "content": prompt}}
		whole := postJSON(t, ctx, u.url("/v1/chat/completions"), map[string]any{"messages": user, "max_completion_tokens": n, "ignore_eos": true}, nil)
		wholeText := whole.body["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
		cut := oracle.Text(oracle.DigestText(oracle.ChatPrompt([]oracle.Message{{Role: "user", Content: prompt}})), 5, k)
		if wholeText[:len(cut)] != cut {
			t.Fatalf("chat text %q does not start with %q", wholeText, cut)
		}
		msgs := append(slices.Clone(user), map[string]any{"role": "assistant", "content": cut})
		res := doStream(t, ctx, u.url("/v1/chat/completions"), map[string]any{"messages": msgs, "max_completion_tokens": n - k, "ignore_eos": true, "stream": true,
			"continue_final_message": true, "add_generation_prompt": false, "return_token_ids": true}, nil)
		if cut+res.text != wholeText {
			t.Errorf("chat continued %q + %q, want %q", cut, res.text, wholeText)
		}
		if _, ok := res.events[0]["prompt_token_ids"]; !ok {
			t.Errorf("chat first chunk without prompt_token_ids: %v", res.events[0])
		}
		bad := postJSON(t, ctx, u.url("/v1/chat/completions"), map[string]any{"messages": msgs, "continue_final_message": true, "add_generation_prompt": true}, nil)
		if bad.status != http.StatusBadRequest {
			t.Errorf("both template options: status %d, want 400", bad.status)
		}
	})
	t.Run("no token ids unless asked", func(t *testing.T) {
		r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": 2}, nil)
		c := r.body["choices"].([]any)[0].(map[string]any)
		if _, ok := c["token_ids"]; ok {
			t.Errorf("token_ids without return_token_ids: %s", r.raw)
		}
	})
}

func toIDs(t *testing.T, v any) []uint32 {
	t.Helper()
	arr, ok := v.([]any)
	if !ok {
		t.Fatalf("not an id list: %v", v)
	}
	out := make([]uint32, len(arr))
	for i, x := range arr {
		out[i] = uint32(x.(float64))
	}
	return out
}

// TestCutAfterTokens: the fault ends a stream after K tokens without
// [DONE] (the connection closes), and a non-streaming request gets no
// response at all, as when the worker dies.
func TestCutAfterTokens(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--profile-preset", "zero", "--cut-after-tokens", "3")
	res := doStream(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a b c", "max_tokens": 10, "ignore_eos": true, "stream": true}, nil)
	if res.done || res.tokens != 3 {
		t.Errorf("cut stream: %d tokens, done %v", res.tokens, res.done)
	}
	if want := oracle.Text(oracle.DigestText("a b c"), 0, res.tokens); res.text != want {
		t.Errorf("cut stream text %q, want prefix %q", res.text, want)
	}
	req := newReq(t, ctx, http.MethodPost, u.url("/v1/completions"), map[string]any{"prompt": "a b c", "max_tokens": 10, "ignore_eos": true}, nil)
	if resp, err := testClient.Do(req); err == nil {
		resp.Body.Close()
		t.Errorf("non-streaming request with the cut fault answered %d", resp.StatusCode)
	}
	waitFor(t, "the cut requests to leave the engine", func() bool { return statsOf(t, u).Running == 0 })
	f := postJSON(t, context.Background(), u.url("/sim/faults"), map[string]any{"cut_after_tokens": 0}, nil)
	if f.body["cut_after_tokens"] != 0.0 {
		t.Errorf("faults %s", f.raw)
	}
	res = doStream(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a b c", "max_tokens": 10, "ignore_eos": true, "stream": true}, nil)
	if !res.done || res.tokens != 10 {
		t.Errorf("after clearing the fault: %d tokens, done %v", res.tokens, res.done)
	}
}
