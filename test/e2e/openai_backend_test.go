package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// TestOpenAIBackend: --backend openai in front of an upstream process that
// behaves like OpenAI's API (vllm-sim --openai-strict: a bad key is a 401,
// vLLM-only request fields are a 400). The router's key comes from
// OPENAI_API_KEY, never reaches the logs, and vLLM-only fields are removed.
func TestOpenAIBackend(t *testing.T) {
	const key = "sk-e2e-secret-7f3a"
	up := startSim(t, "--role", "unified", "--model", "gpt-sim", "--api-key", key, "--openai-strict")
	t.Setenv("OPENAI_API_KEY", key)
	r := startRouter(t, "--backend", "openai", "--worker-urls", up.URL()+"/v1", "--log-level", "debug",
		"--retry-initial-backoff-ms", "5")
	r.WaitReady(t, 10*time.Second)
	ctx := ctxT(t, 60*time.Second)

	// Chat with vLLM extensions: the strict upstream would answer 400.
	code, _, body := post(t, ctx, r.Base+"/v1/chat/completions",
		`{"model":"gpt-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"top_k":5,"ignore_eos":true,"repetition_penalty":1.1,"temperature":0.2}`,
		"Authorization", "Bearer client-token-not-for-upstream")
	if code != 200 || completionText(t, body) == "" {
		t.Fatalf("chat: %d %s", code, body)
	}
	code, _, body = post(t, ctx, r.Base+"/v1/completions", `{"model":"gpt-sim","prompt":"hello","max_tokens":3,"min_tokens":1,"skip_special_tokens":false}`)
	if code != 200 || completionText(t, body) == "" {
		t.Fatalf("completions: %d %s", code, body)
	}

	// Streaming: SSE relayed to [DONE].
	req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/v1/chat/completions",
		strings.NewReader(`{"model":"gpt-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true,"top_k":2}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("stream: %d %s", resp.StatusCode, ct)
	}
	var events []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, d)
		}
	}
	resp.Body.Close()
	if len(events) < 3 || events[len(events)-1] != "[DONE]" {
		t.Fatalf("stream events %q", events)
	}

	// /v1/models is the upstream's (it needs the key too).
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	if code := getJSON(t, r.Base+"/v1/models", &models); code != 200 || len(models.Data) != 1 || models.Data[0].ID != "gpt-sim" {
		t.Fatalf("/v1/models: %d %+v", code, models)
	}
	// An upstream error keeps its status and body: unknown model is 404.
	code, _, body = post(t, ctx, r.Base+"/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`)
	if code != 404 || !strings.Contains(string(body), "The model `nope` does not exist.") {
		t.Fatalf("unknown model: %d %s", code, body)
	}
	// vLLM-only routes are refused clearly.
	code, _, body = post(t, ctx, r.Base+"/generate", `{"text":"x"}`)
	if code != 501 || !strings.Contains(string(body), "--backend openai") {
		t.Fatalf("/generate: %d %s", code, body)
	}
	var st struct {
		Requests struct {
			Completions int64 `json:"completions"`
			Chat        int64 `json:"chat_completions"`
			Status4xx   int64 `json:"status_4xx"`
		} `json:"requests"`
	}
	if code := getJSON(t, up.URL()+"/sim/stats", &st); code != 200 || st.Requests.Chat != 3 || st.Requests.Completions != 1 {
		t.Fatalf("upstream stats: %d %+v", code, st)
	}

	// Upstream gone: retried, then a 502 naming it; it never hung.
	up.Kill()
	start := time.Now()
	code, _, body = post(t, ctx, r.Base+"/v1/chat/completions", `{"model":"gpt-sim","messages":[{"role":"user","content":"hi"}]}`)
	if code != 502 || !strings.Contains(string(body), "attempt(s)") || time.Since(start) > 10*time.Second {
		t.Fatalf("upstream down: %d %s after %v", code, body, time.Since(start))
	}
	if logs := r.Logs.String(); strings.Contains(logs, key) {
		t.Fatal("the upstream API key appears in the router's logs")
	}
}

// TestOpenAIBackendWrongKey: the upstream's 401 reaches the client as is.
func TestOpenAIBackendWrongKey(t *testing.T) {
	up := startSim(t, "--role", "unified", "--model", "gpt-sim", "--api-key", "right", "--openai-strict")
	r := startRouter(t, "--backend", "openai", "--worker-urls", up.URL(), "--api-key", "wrong")
	ctx := ctxT(t, 30*time.Second)
	code, _, body := post(t, ctx, r.Base+"/v1/chat/completions", `{"model":"gpt-sim","messages":[{"role":"user","content":"hi"}]}`)
	if code != 401 || !strings.Contains(string(body), "Incorrect API key provided") {
		t.Fatalf("%d %s", code, body)
	}
}

// TestOpenAIBackendStartupErrors: a missing key and a wrong number of
// upstream URLs stop the router at startup with a message naming them.
func TestOpenAIBackendStartupErrors(t *testing.T) {
	t.Setenv("OPENAI_API_KEY", "")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--backend", "openai", "--worker-urls", "http://127.0.0.1:9"}, "no upstream API key: set --api-key KEY or the OPENAI_API_KEY environment variable"},
		{[]string{"--backend", "openai", "--worker-urls", "http://127.0.0.1:9", "http://127.0.0.1:10", "--api-key", "k"}, "OpenAI mode requires exactly one --worker-urls entry"},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		args := append([]string{"--port", fmt.Sprint(harness.FreePort(t)), "--prometheus-port", fmt.Sprint(harness.FreePort(t))}, tc.args...)
		out, err := exec.CommandContext(ctx, filepath.Join(bins.Dir, "switchyard"), args...).CombinedOutput()
		cancel()
		if err == nil || !strings.Contains(string(out), tc.want) {
			t.Errorf("%v: err %v, output %s; want an exit with %q", tc.args, err, out, tc.want)
		}
	}
}
