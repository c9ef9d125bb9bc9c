package sim

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestUpstreamChecks(t *testing.T) {
	ctx := testCtx(t)
	vllm := startSim(t, "--api-key", "k1")
	strict := startSim(t, "--api-key", "k2", "--openai-strict")
	open := startSim(t, "--openai-strict")
	chat := `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2`
	cases := []struct {
		name   string
		in     *Instance
		path   string
		auth   string
		body   string
		status int
		want   string // substring of the body
	}{
		{"vllm key ok", vllm, "/v1/chat/completions", "Bearer k1", chat + `,"top_k":3}`, 200, `"choices"`},
		{"vllm no key", vllm, "/v1/chat/completions", "", chat + `}`, 401, `{"error":"Unauthorized"}`},
		{"vllm wrong key", vllm, "/v1/models", "Bearer k2", "", 401, `Unauthorized`},
		{"vllm health needs no key", vllm, "/health", "", "", 200, ""},
		{"strict wrong key", strict, "/v1/completions", "Bearer nope", `{"model":"sim-model","prompt":"x","max_tokens":1}`, 401, `Incorrect API key provided`},
		{"strict vLLM fields", strict, "/v1/chat/completions", "Bearer k2", chat + `,"top_k":3,"ignore_eos":true}`, 400, `Unrecognized request argument supplied: ignore_eos, top_k`},
		{"strict completions vLLM field", open, "/v1/completions", "", `{"model":"sim-model","prompt":"x","max_tokens":1,"min_tokens":1}`, 400, `Unrecognized request argument supplied: min_tokens`},
		{"strict OpenAI fields ok", open, "/v1/chat/completions", "", chat + `,"temperature":0.5,"stream_options":null,"user":"u"}`, 200, `"choices"`},
		{"strict completions ok", open, "/v1/completions", "", `{"model":"sim-model","prompt":"x","max_tokens":1,"echo":false}`, 200, `"choices"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			method, hdr := http.MethodGet, map[string]string{}
			var body any
			if tc.body != "" {
				method, body = http.MethodPost, tc.body
			}
			if tc.auth != "" {
				hdr["Authorization"] = tc.auth
			}
			resp, err := testClient.Do(newReq(t, ctx, method, tc.in.url(tc.path), body, hdr))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status || !strings.Contains(string(b), tc.want) {
				t.Fatalf("%d %s, want %d with %q", resp.StatusCode, b, tc.status, tc.want)
			}
		})
	}
}
