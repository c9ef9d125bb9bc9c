package sim

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

func TestCompletionNonStreaming(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--seed", "3")
	r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "hello there world", "max_tokens": 5, "ignore_eos": true},
		map[string]string{"X-Request-Id": "abc"})
	if r.status != 200 {
		t.Fatalf("status %d %s", r.status, r.raw)
	}
	if r.body["id"] != "cmpl-abc" || r.body["object"] != "text_completion" || r.body["model"] != "sim-model" {
		t.Errorf("envelope %s", r.raw)
	}
	if _, ok := r.body["kv_transfer_params"]; !ok || r.body["kv_transfer_params"] != nil {
		t.Errorf("kv_transfer_params must be present and null: %s", r.raw)
	}
	c := r.body["choices"].([]any)[0].(map[string]any)
	want := oracle.Text(oracle.DigestText("hello there world"), 3, 5)
	if c["text"] != want || c["finish_reason"] != "length" {
		t.Errorf("choice %v, want text %q", c, want)
	}
	us := r.body["usage"].(map[string]any)
	if us["prompt_tokens"] != 3.0 || us["completion_tokens"] != 5.0 || us["total_tokens"] != 8.0 {
		t.Errorf("usage %v", us)
	}
	// Default max_tokens for completions is 16; seed from the request.
	r = postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a b", "seed": 9}, nil)
	c = r.body["choices"].([]any)[0].(map[string]any)
	if c["text"] != oracle.Text(oracle.DigestText("a b"), 9, 16) {
		t.Errorf("default max_tokens/seed: %v", c["text"])
	}
	if id, _ := r.body["id"].(string); !strings.HasPrefix(id, "cmpl-") || len(id) != len("cmpl-")+32 {
		t.Errorf("generated id %q", id)
	}
}

func TestChatStreamingShape(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t)
	msgs := []any{
		map[string]any{"role": "system", "content": "be brief"},
		map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "hi there"}}},
	}
	res := doStream(t, ctx, u.url("/v1/chat/completions"), map[string]any{
		"messages": msgs, "max_completion_tokens": 4, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	}, map[string]string{"X-Request-Id": "chat1"})
	if res.status != 200 || !res.done {
		t.Fatalf("status %d done %v", res.status, res.done)
	}
	first := res.events[0]
	delta := first["choices"].([]any)[0].(map[string]any)["delta"].(map[string]any)
	if delta["role"] != "assistant" || delta["content"] != "" || first["object"] != "chat.completion.chunk" || first["id"] != "chatcmpl-chat1" {
		t.Errorf("first chat event %v", first)
	}
	if len(res.events) != 1+4+1 {
		t.Errorf("%d events, want role + 4 tokens + usage", len(res.events))
	}
	prompt := oracle.ChatPrompt([]oracle.Message{{Role: "system", Content: "be brief"}, {Role: "user", Content: "hi there"}})
	if want := oracle.Text(oracle.DigestText(prompt), 0, 4); res.text != want {
		t.Errorf("chat text %q, want %q", res.text, want)
	}
	if res.usage["prompt_tokens"] != float64(len(oracle.Tokenize(prompt))) || res.usage["completion_tokens"] != 4.0 {
		t.Errorf("usage %v", res.usage)
	}
	if res.finish != "length" {
		t.Errorf("finish %q", res.finish)
	}
	// Non-streaming chat without a limit: max_model_len - prompt (ok).
	r := postJSON(t, ctx, u.url("/v1/chat/completions"), map[string]any{"messages": msgs, "max_tokens": 2}, nil)
	msg := r.body["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)
	if r.body["object"] != "chat.completion" || msg["role"] != "assistant" || msg["content"] != oracle.Text(oracle.DigestText(prompt), 0, 2) {
		t.Errorf("chat response %s", r.raw)
	}
}

func TestCompletionStreamOneTokenPerEvent(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--profile-preset", "zero")
	res := doStream(t, ctx, u.url("/v1/completions"), map[string]any{
		"prompt": "one two", "max_tokens": 200, "ignore_eos": true, "stream": true,
		"stream_options": map[string]any{"include_usage": true, "continuous_usage_stats": true},
	}, nil)
	if res.tokens != 200 || len(res.events) != 201 || !res.done {
		t.Fatalf("zero preset: %d token events, %d events, done %v", res.tokens, len(res.events), res.done)
	}
	u1 := res.events[0]["usage"].(map[string]any)
	if u1["completion_tokens"] != 1.0 {
		t.Errorf("continuous usage on first chunk: %v", u1)
	}
	if res.text != oracle.Text(oracle.DigestText("one two"), 0, 200) {
		t.Error("zero-preset text differs from the oracle")
	}
}

func TestEOSAndMinTokens(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--eos-probability", "1")
	r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a b", "max_tokens": 5}, nil)
	c := r.body["choices"].([]any)[0].(map[string]any)
	if c["finish_reason"] != "stop" || c["text"] != "" || r.body["usage"].(map[string]any)["completion_tokens"] != 1.0 {
		t.Errorf("EOS: %s", r.raw)
	}
	for _, body := range []map[string]any{
		{"prompt": "a b", "max_tokens": 5, "ignore_eos": true},
		{"prompt": "a b", "max_tokens": 5, "min_tokens": 2},
	} {
		r := postJSON(t, ctx, u.url("/v1/completions"), body, nil)
		if c := r.body["choices"].([]any)[0].(map[string]any); c["finish_reason"] != "length" {
			t.Errorf("%v: %s", body, r.raw)
		}
	}
}

func TestErrorsLikeVLLM(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--max-model-len", "100")
	cases := []struct {
		name   string
		path   string
		body   any
		status int
	}{
		{"malformed JSON", "/v1/completions", `{"prompt":`, 400},
		{"non-object body", "/v1/completions", `[1,2]`, 400},
		{"missing prompt", "/v1/completions", map[string]any{"max_tokens": 3}, 400},
		{"missing messages", "/v1/chat/completions", map[string]any{"max_tokens": 3}, 400},
		{"bad type", "/v1/completions", map[string]any{"prompt": "a", "max_tokens": "x"}, 400},
		{"zero max_tokens", "/v1/completions", map[string]any{"prompt": "a", "max_tokens": 0}, 400},
		{"max_tokens over max_model_len", "/v1/completions", map[string]any{"prompt": "a", "max_tokens": 101}, 400},
		{"stream_options without stream", "/v1/completions", map[string]any{"prompt": "a", "stream_options": map[string]any{"include_usage": true}}, 400},
		{"wrong model", "/v1/completions", map[string]any{"prompt": "a", "model": "other"}, 404},
		{"bad kv params", "/v1/completions", map[string]any{"prompt": "a", "kv_transfer_params": 3}, 400},
		{"unknown path", "/v1/nope", map[string]any{}, 404},
	}
	for _, c := range cases {
		r := postJSON(t, ctx, u.url(c.path), c.body, nil)
		e, ok := r.body["error"].(map[string]any)
		if r.status != c.status || !ok || e["message"] == "" || e["code"] != float64(c.status) {
			t.Errorf("%s: status %d body %s, want %d with an error object", c.name, r.status, r.raw, c.status)
		}
	}
	resp, err := testClient.Get(u.url("/v1/completions"))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Errorf("GET /v1/completions: %d, want 405", resp.StatusCode)
	}
}

func TestSimpleEndpoints(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--model", "m1")
	resp, err := testClient.Get(u.url("/health"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || len(b) != 0 {
		t.Errorf("/health: %d %q", resp.StatusCode, b)
	}
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID, Object, OwnedBy, Root string
			MaxModelLen               int `json:"max_model_len"`
		} `json:"data"`
	}
	getJSON(t, u.url("/v1/models"), &models)
	if models.Object != "list" || len(models.Data) != 1 || models.Data[0].ID != "m1" || models.Data[0].Root != "m1" || models.Data[0].MaxModelLen != 32768 {
		t.Errorf("/v1/models %+v", models)
	}
	var load map[string]int
	getJSON(t, u.url("/load"), &load)
	if _, ok := load["server_load"]; !ok {
		t.Errorf("/load %v", load)
	}
	tok := postJSON(t, ctx, u.url("/tokenize"), map[string]any{"prompt": "alpha beta gamma"}, nil)
	if tok.body["count"] != 3.0 {
		t.Errorf("/tokenize %s", tok.raw)
	}
	de := postJSON(t, ctx, u.url("/detokenize"), map[string]any{"tokens": tok.body["tokens"]}, nil)
	if de.body["prompt"] != "alpha beta gamma" {
		t.Errorf("/detokenize %s", de.raw)
	}
	for _, p := range []string{"/start_profile", "/stop_profile"} {
		if r := postJSON(t, ctx, u.url(p), map[string]any{}, nil); r.status != 200 {
			t.Errorf("%s: %d", p, r.status)
		}
	}
	postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a b c", "max_tokens": 2}, nil)
	resp, err = testClient.Get(u.url("/metrics"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`vllm:num_requests_running{engine="0",model_name="m1"} 0`,
		`vllm:num_requests_waiting{engine="0",model_name="m1"} 0`,
		`vllm:kv_cache_usage_perc{engine="0",model_name="m1"} 0`,
		`vllm:generation_tokens_total{model_name="m1"} 2`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("/metrics lacks %q:\n%s", want, b)
		}
	}
}

func TestFaultInjection(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t)
	f := postJSON(t, ctx, u.url("/sim/faults"), map[string]any{"fail_next": 2, "fail_status": 503}, nil)
	if f.status != 200 || f.body["fail_next"] != 2.0 {
		t.Fatalf("POST /sim/faults: %s", f.raw)
	}
	body := map[string]any{"prompt": "a", "max_tokens": 1}
	for i := range 3 {
		r := postJSON(t, ctx, u.url("/v1/completions"), body, nil)
		want := 503
		if i == 2 {
			want = 200
		}
		if r.status != want {
			t.Errorf("request %d: %d, want %d", i, r.status, want)
		}
	}
	if r := postJSON(t, ctx, u.url("/sim/faults"), map[string]any{"bogus": 1}, nil); r.status != 400 {
		t.Errorf("unknown fault key: %d", r.status)
	}
	// stall_first_token delays the first token.
	postJSON(t, ctx, u.url("/sim/faults"), map[string]any{"stall_first_token_ms": 150}, nil)
	start := time.Now()
	postJSON(t, ctx, u.url("/v1/completions"), body, nil)
	if el := time.Since(start); el < 150*time.Millisecond {
		t.Errorf("stall_first_token: request took %v", el)
	}
	postJSON(t, ctx, u.url("/sim/faults"), map[string]any{"stall_first_token_ms": 0, "slow_factor": 2.5, "max_waiting": 4}, nil)
	s := statsOf(t, u)
	if *s.Faults.SlowFactor != 2.5 || *s.Faults.MaxWaiting != 4 || s.Requests.FaultsInjected != 2 {
		t.Errorf("stats faults %+v injected %d", s.Faults, s.Requests.FaultsInjected)
	}
}

func TestMaxWaiting503(t *testing.T) {
	ctx := testCtx(t)
	// One slot, so the second request queues and the third is rejected.
	u := startSim(t, "--max-num-seqs", "1", "--max-waiting", "1", "--decode-step-base", "20ms")
	body := map[string]any{"prompt": "a", "max_tokens": 100, "ignore_eos": true, "stream": true}
	done := make(chan struct{}, 2)
	// One after the other: sent together, the second can arrive while the
	// first still queues, and is then (rightly) the one rejected.
	for i, want := range []string{"one running", "one running and one waiting"} {
		go func() {
			resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, u.url("/v1/completions"), body, nil))
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			done <- struct{}{}
		}()
		waitFor(t, want, func() bool { s := statsOf(t, u); return s.Running == 1 && s.Waiting == i })
	}
	r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "a", "max_tokens": 1}, nil)
	if r.status != 503 {
		t.Errorf("third request: %d, want 503", r.status)
	}
	<-done
	<-done
}

func TestClientDisconnectAborts(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--decode-step-base", "10ms")
	rctx, cancel := contextWithCancel(ctx)
	resp, err := testClient.Do(newReq(t, rctx, http.MethodPost, u.url("/v1/completions"),
		map[string]any{"prompt": "a b", "max_tokens": 1000, "ignore_eos": true, "stream": true}, nil))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_, _ = resp.Body.Read(buf)
	cancel()
	resp.Body.Close()
	waitFor(t, "abort", func() bool {
		s := statsOf(t, u)
		return s.Running == 0 && s.KVBlocksUsed == 0 && s.Requests.Aborted == 1
	})
}
