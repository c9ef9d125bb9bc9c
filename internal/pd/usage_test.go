package pd

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// TestDecodeUsageCounted: vllm_router_tokens_total counts the decode's usage
// report (the final SSE usage chunk, or the JSON body's usage object), never
// the prefill's 1-token leg (prefillJSON reports 3 prompt + 1 completion).
func TestDecodeUsageCounted(t *testing.T) {
	const pRet = `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [4, 5], "remote_engine_id": "e1", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600, "tp_size": 1}`
	const usageChunk = `data: {"id":"cmpl-1","object":"text_completion","choices":[],"usage":{"prompt_tokens":7,"total_tokens":18,"completion_tokens":11}}` + "\n\n"
	cases := []struct {
		name, body       string
		decode           func(http.ResponseWriter, *http.Request, *recorded)
		prompt, complete float64
	}{
		{
			name: "sse",
			body: `{"prompt":"x","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`,
			decode: func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				startSSE(w)
				for _, ev := range append(append([]string(nil), sseEvents[:2]...), usageChunk, sseEvents[2]) {
					_, _ = io.WriteString(w, ev)
					_ = http.NewResponseController(w).Flush()
				}
			},
			prompt: 7, complete: 11,
		},
		{
			name: "json",
			body: `{"prompt":"x","max_tokens":5,"stream":false}`,
			decode: func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				writeJSON(w, 200, `{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"Hello","finish_reason":"length"}],"usage":{"prompt_tokens":5,"total_tokens":14,"completion_tokens":9}}`)
			},
			prompt: 5, complete: 9,
		},
		{
			name: "json-merged", // logprobs: the body is buffered and merged with the prefill's
			body: `{"prompt":"x","max_tokens":5,"stream":false,"logprobs":1}`,
			decode: func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				writeJSON(w, 200, `{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"Hello","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":4,"total_tokens":10,"completion_tokens":6}}`)
			},
			prompt: 4, complete: 6,
		},
		{
			name:   "no-usage",
			body:   `{"prompt":"x","max_tokens":5,"stream":true}`,
			decode: decodeSSE,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			P := newFake(t, prefillOK(pRet))
			D := newFake(t, tc.decode)
			reg := worker.NewRegistry(worker.BreakerConfig{})
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
			dw := addWorker(t, reg, D.URL(), worker.RoleDecode)
			m := metrics.NewForTest()
			h := newHarness(t, reg, Options{Connector: "nixl", Metrics: m})

			res := h.post(t, "/v1/completions", tc.body)
			if res.status != 200 || !strings.Contains(res.body, "cmpl-") {
				t.Fatalf("status %d body %s", res.status, res.body)
			}
			P.next(t)
			D.next(t)
			waitIdle(t, pw, dw) // the decode leg ends after its usage is counted
			if v := counter(t, m.TokensTotal.WithLabelValues("prompt")); v != tc.prompt {
				t.Errorf("prompt tokens %v, want %v", v, tc.prompt)
			}
			if v := counter(t, m.TokensTotal.WithLabelValues("completion")); v != tc.complete {
				t.Errorf("completion tokens %v, want %v", v, tc.complete)
			}
		})
	}
}
