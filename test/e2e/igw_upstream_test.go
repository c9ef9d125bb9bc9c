package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// TestIGWWithOpenAIUpstream: one --enable-igw router in front of a regular
// model (a static vllm-sim), a PD MoRI-IO WRITE model (a pair registering
// over ZMQ) and a model served by an OpenAI-compatible upstream (a third
// process, vllm-sim --openai-strict: a wrong key is a 401, vLLM-only
// fields a 400), named in the config file's models section with its key
// in an environment variable. Each request lands on its model's fleet;
// /v1/models and /workers list all three; the PD model going away leaves
// the others serving; a worker cannot join the upstream's model.
func TestIGWWithOpenAIUpstream(t *testing.T) {
	const key = "sk-igw-upstream-91c2"
	up := startSim(t, "--role", "unified", "--model", "gpt-sim", "--api-key", key, "--openai-strict")
	chat := startSim(t, "--role", "unified", "--model", "chat")
	addr := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	body := fmt.Sprintf("models:\n  gpt-sim: {upstream: %q, api_key_env: SY_E2E_UPSTREAM_KEY, max_concurrent_requests: 8}\n", up.URL()+"/v1")
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SY_E2E_UPSTREAM_KEY", key)
	r := startRouter(t, "--enable-igw", "--config", cfg, "--kv-connector", "moriio", "--vllm-discovery-address", addr,
		"--discovery-ttl-secs", "1.5", "--policy", "round_robin", "--worker-urls", chat.URL(), "--log-level", "debug")
	simArgs := []string{"--kv-connector", "moriio", "--transfer-mode", "WRITE", "--proxy-address", addr, "--heartbeat-interval", "200ms", "--strict", "--model", "big"}
	bigP := startSim(t, append([]string{"--role", "prefill"}, simArgs...)...)
	bigD := startSim(t, append([]string{"--role", "decode"}, simArgs...)...)
	type modelsView struct {
		Models map[string]struct {
			Kind    string   `json:"kind"`
			Total   int      `json:"total"`
			Healthy int      `json:"healthy"`
			Workers []string `json:"workers"`
		} `json:"models"`
	}
	waitFor(t, 20*time.Second, "the PD pair and the static worker registered with their models", func() bool {
		var ws modelsView
		return getJSON(t, r.Base+"/workers", &ws) == 200 && ws.Models["big"].Total == 2 && ws.Models["chat"].Healthy == 1
	})
	var ws modelsView
	getJSON(t, r.Base+"/workers", &ws)
	if g := ws.Models["gpt-sim"]; g.Kind != "upstream" || g.Healthy != 1 || !slices.Equal(g.Workers, []string{up.URL()}) {
		t.Fatalf("/workers gpt-sim entry: %+v", g)
	}
	if got := listModels(t, r.Base); !slices.Equal(got, []string{"big", "chat", "gpt-sim"}) {
		t.Fatalf("/v1/models: %v", got)
	}

	ctx := ctxT(t, 90*time.Second)
	// vLLM-only fields (top_k, ignore_eos) would be a 400 from the strict
	// upstream: the router removes them for the upstream's model only.
	send := func(model string, stream bool) (int, []byte) {
		t.Helper()
		code, _, b := post(t, ctx, r.Base+"/v1/chat/completions",
			fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"top_k":5,"ignore_eos":true,"stream":%t}`, model, stream))
		return code, b
	}
	for i := range 3 {
		for _, m := range []string{"big", "chat", "gpt-sim"} {
			if code, b := send(m, i%2 == 1); code != 200 {
				t.Fatalf("%s: %d %s", m, code, b)
			}
		}
	}
	if n := up.Stats(t).Requests.ChatCompletions; n != 3 {
		t.Fatalf("the upstream served %d chats, want 3", n)
	}
	if n := chat.Stats(t).Requests.ChatCompletions; n != 3 {
		t.Fatalf("chat served %d, want 3", n)
	}
	waitFor(t, 10*time.Second, "big's 3 requests split on its pair", func() bool {
		return bigP.Stats(t).Requests.PrefillLeg == 3 && bigD.Stats(t).Requests.DecodeLeg == 3
	})

	// The upstream has no vLLM endpoints; a worker cannot join its model.
	if code, _, b := post(t, ctx, r.Base+"/tokenize", `{"model":"gpt-sim","prompt":"hi"}`); code != 501 || !strings.Contains(string(b), "served by an OpenAI-compatible upstream") {
		t.Fatalf("/tokenize on the upstream model: %d %s", code, b)
	}
	spare := startSim(t, "--role", "unified", "--model", "gpt-sim")
	if code, _, b := post(t, ctx, r.Base+"/workers", fmt.Sprintf(`{"url":%q,"model_id":"gpt-sim"}`, spare.URL())); code != 400 || !strings.Contains(string(b), "is served by the upstream") {
		t.Fatalf("POST /workers into the upstream's model: %d %s", code, b)
	}

	// The PD model leaves: the regular and upstream models keep serving.
	bigP.Kill()
	bigD.Kill()
	waitFor(t, 20*time.Second, "big gone", func() bool {
		code, b := send("big", false)
		return code == 404 && strings.Contains(string(b), "The model `big` does not exist.")
	})
	for _, m := range []string{"chat", "gpt-sim"} {
		if code, b := send(m, true); code != 200 {
			t.Fatalf("%s after big left: %d %s", m, code, b)
		}
	}
	// The upstream dies: its model fails on its own (a 5xx naming the
	// upstream), chat is untouched, and /v1/models drops it once its
	// breaker opens.
	up.Kill()
	if code, b := send("gpt-sim", false); code < 500 {
		t.Fatalf("gpt-sim with its upstream dead: %d %s", code, b)
	}
	if code, b := send("chat", false); code != 200 {
		t.Fatalf("chat with the upstream dead: %d %s", code, b)
	}
	waitFor(t, 20*time.Second, "the dead upstream's model is no longer listed", func() bool {
		send("gpt-sim", false)
		return slices.Equal(listModels(t, r.Base), []string{"chat"})
	})
	if strings.Contains(r.Logs.String(), key) {
		t.Fatal("the upstream API key appears in the router's logs")
	}
}

// TestIGWUpstreamKeyMissing: an upstream model whose api_key_env is unset
// stops the router at startup, naming the variable.
func TestIGWUpstreamKeyMissing(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(cfg, []byte("models:\n  gpt: {upstream: \"https://api.example.com/v1\", api_key_env: SY_E2E_UNSET_KEY}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SY_E2E_UNSET_KEY", "")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	args := []string{"--port", fmt.Sprint(harness.FreePort(t)), "--prometheus-port", fmt.Sprint(harness.FreePort(t)), "--enable-igw", "--config", cfg}
	out, err := exec.CommandContext(ctx, filepath.Join(bins.Dir, "switchyard"), args...).CombinedOutput()
	if want := "models.gpt.api_key_env: the environment variable SY_E2E_UNSET_KEY is not set"; err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("err %v, output %s; want an exit with %q", err, out, want)
	}
}
