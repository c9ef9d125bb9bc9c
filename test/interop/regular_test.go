package interop

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// regularRouter starts switchyard in regular mode in front of the unified
// engine and waits until it routes.
func regularRouter(t *testing.T) *harnessRouter {
	t.Helper()
	r := bins.StartRouter(t, "--worker-urls", unified.URL(), "--health-check-interval-secs", "1")
	r.WaitReady(t, 30*time.Second)
	return r
}

// genBody is a greedy request for path with prompt (a chat message for
// chat), asking for the token ids.
func genBody(chat, stream bool, prompt string, maxTokens int) string {
	m := map[string]any{"model": modelDir, "max_tokens": maxTokens, "temperature": 0, "return_token_ids": true}
	if chat {
		m["messages"] = []map[string]string{{"role": "user", "content": prompt}}
	} else {
		m["prompt"] = prompt
	}
	if stream {
		m["stream"] = true
		m["stream_options"] = map[string]any{"include_usage": true}
	}
	b, _ := json.Marshal(m)
	return string(b)
}

func genPath(chat bool) string {
	if chat {
		return "/v1/chat/completions"
	}
	return "/v1/completions"
}

// generate sends one greedy request to base and returns what it generated.
func generate(t *testing.T, base string, chat, stream bool, prompt string, maxTokens int) result {
	t.Helper()
	code, hdr, body := post(t, ctxT(t, 60*time.Second), base+genPath(chat), genBody(chat, stream, prompt, maxTokens))
	if code != 200 {
		t.Fatalf("%s %s: %d %s", base, genPath(chat), code, body)
	}
	if stream {
		if ct := hdr.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
			t.Fatalf("stream Content-Type %q", ct)
		}
		return parseStream(t, body)
	}
	return parseResult(t, body)
}

func TestRegularGenerationsMatchEngine(t *testing.T) {
	needEnv(t)
	r := regularRouter(t)
	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("chat=%v/stream=%v", chat, stream), func(t *testing.T) {
				prompt := "Switchyard forwards the request body byte for byte."
				direct := generate(t, unified.URL(), chat, stream, prompt, 24)
				via := generate(t, r.Base, chat, stream, prompt, 24)
				if len(via.Tokens) == 0 || !slices.Equal(via.Tokens, direct.Tokens) {
					t.Fatalf("tokens through the router %v, engine alone %v", via.Tokens, direct.Tokens)
				}
				if via.Text != direct.Text || via.Finish != direct.Finish {
					t.Fatalf("router %q/%s, engine %q/%s", via.Text, via.Finish, direct.Text, direct.Finish)
				}
				if via.PromptTokens == 0 || via.PromptTokens != direct.PromptTokens {
					t.Fatalf("usage prompt_tokens %d through the router, %d alone (include_usage must reach the client)", via.PromptTokens, direct.PromptTokens)
				}
			})
		}
	}
}

func TestRegularInfoEndpoints(t *testing.T) {
	needEnv(t)
	r := regularRouter(t)
	ctx := ctxT(t, 30*time.Second)

	var models struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if code := harness.GetJSON(t, nil, r.Base+"/v1/models", &models); code != 200 || len(models.Data) != 1 ||
		models.Data[0].ID != modelDir || models.Data[0].MaxModelLen != 1024 {
		t.Fatalf("/v1/models: %d %+v", code, models)
	}

	tok := fmt.Sprintf(`{"model":%q,"prompt":"hello router"}`, modelDir)
	code, _, viaTok := post(t, ctx, r.Base+"/tokenize", tok)
	_, _, directTok := post(t, ctx, unified.URL()+"/tokenize", tok)
	if code != 200 || string(viaTok) != string(directTok) {
		t.Fatalf("/tokenize through the router %d %s, engine %s", code, viaTok, directTok)
	}
	var tr struct {
		Tokens []int `json:"tokens"`
	}
	if err := json.Unmarshal(viaTok, &tr); err != nil || len(tr.Tokens) == 0 {
		t.Fatalf("/tokenize body %s: %v", viaTok, err)
	}
	ids, _ := json.Marshal(tr.Tokens)
	code, _, detok := post(t, ctx, r.Base+"/detokenize", fmt.Sprintf(`{"model":%q,"tokens":%s}`, modelDir, ids))
	var dr struct {
		Prompt string `json:"prompt"`
	}
	if code != 200 || json.Unmarshal(detok, &dr) != nil || dr.Prompt != "hello router" {
		t.Fatalf("/detokenize: %d %s", code, detok)
	}

	if code := harness.GetJSON(t, nil, r.Base+"/health", nil); code != 200 {
		t.Fatalf("/health: %d", code)
	}

	// The router's own Prometheus listener counts what it relayed to the
	// real engine.
	before := metric(t, r.Metrics, "vllm_router_processed_requests_total")
	generate(t, r.Base, false, false, "count me", 2)
	harness.WaitFor(t, 10*time.Second, 20*time.Millisecond, "processed_requests_total to grow", func() bool {
		return metric(t, r.Metrics, "vllm_router_processed_requests_total") > before
	})
}

// TestRegularValidationErrorRelayed: a request vLLM rejects reaches the
// client with vLLM's own status and body, byte for byte.
func TestRegularValidationErrorRelayed(t *testing.T) {
	needEnv(t)
	r := regularRouter(t)
	cases := []struct {
		name, path, body string
		status           int
	}{
		{"max_tokens over the context", "/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":5000}`, modelDir), 400},
		{"unknown model", "/v1/completions", `{"model":"no-such-model","prompt":"hi","max_tokens":2}`, 404},
		{"chat without messages", "/v1/chat/completions", fmt.Sprintf(`{"model":%q,"max_tokens":2}`, modelDir), 400},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t, 30*time.Second)
			dcode, _, dbody := post(t, ctx, unified.URL()+tc.path, tc.body)
			vcode, _, vbody := post(t, ctx, r.Base+tc.path, tc.body)
			if dcode != tc.status || vcode != dcode || string(vbody) != string(dbody) {
				t.Fatalf("engine %d %s; through the router %d %s", dcode, dbody, vcode, vbody)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
					Type    string `json:"type"`
					Code    int    `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(vbody, &e); err != nil || e.Error.Message == "" || e.Error.Code != tc.status {
				t.Fatalf("not a vLLM error body: %s", vbody)
			}
		})
	}
}

// TestRegularClientDisconnectAbortsInEngine: a client that goes away in
// the middle of a long stream makes the router close its upstream
// request, and vLLM aborts the request: it stops running long before its
// 900 tokens are generated. (vLLM 0.32 counts such a request in none of
// its vllm:request_success_total reasons, "abort" included.)
func TestRegularClientDisconnectAbortsInEngine(t *testing.T) {
	needEnv(t)
	r := regularRouter(t)
	u := unified.URL() + "/metrics"
	genBefore := metric(t, u, "vllm:generation_tokens_total")
	body := fmt.Sprintf(`{"model":%q,"prompt":"[abort] a long story","max_tokens":900,"ignore_eos":true,"temperature":0,"stream":true}`, modelDir)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(resp.Body)
	chunks := 0
	for chunks < 3 && sc.Scan() {
		if strings.HasPrefix(sc.Text(), "data: {") {
			chunks++
		}
	}
	if chunks < 3 {
		t.Fatalf("stream ended after %d chunks: %v", chunks, sc.Err())
	}
	harness.WaitFor(t, 20*time.Second, 20*time.Millisecond, "vLLM to show the request running", func() bool {
		return metric(t, u, "vllm:num_requests_running") == 1
	})
	cancel()
	resp.Body.Close()
	harness.WaitFor(t, 20*time.Second, 20*time.Millisecond, "vLLM to stop running the request", func() bool {
		return metric(t, u, "vllm:num_requests_running") == 0
	})
	if gen := metric(t, u, "vllm:generation_tokens_total") - genBefore; gen >= 900 {
		t.Fatalf("vLLM generated all %v tokens: the request was not aborted", gen)
	} else {
		t.Logf("vLLM stopped after %v of 900 tokens", gen)
	}
}
