package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/freeport"
)

type fakeReq struct {
	path   string
	header http.Header
	body   map[string]any
}

// fakeVLLM is an httptest stand-in for a vLLM OpenAI server (§5.3 shapes).
type fakeVLLM struct {
	mode string // ok, 500, notoken, miderror, garbage, hang
	mu   sync.Mutex
	reqs []fakeReq
	srv  *httptest.Server
}

func newFakeVLLM(t *testing.T, mode string) *fakeVLLM {
	f := &fakeVLLM{mode: mode}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeVLLM) requests() []fakeReq {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeReq(nil), f.reqs...)
}

func promptText(body map[string]any) string {
	if p, ok := body["prompt"].(string); ok {
		return p
	}
	msgs, _ := body["messages"].([]any)
	if len(msgs) == 0 {
		return ""
	}
	content, _ := msgs[0].(map[string]any)["content"].([]any)
	if len(content) == 0 {
		return ""
	}
	s, _ := content[0].(map[string]any)["text"].(string)
	return s
}

func (f *fakeVLLM) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodGet && r.URL.Path == "/v1/models" {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"fake-model","object":"model","owned_by":"vllm","root":"/models/fake-root","parent":null}]}`)
		return
	}
	var body map[string]any
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.reqs = append(f.reqs, fakeReq{path: r.URL.Path, header: r.Header.Clone(), body: body})
	f.mu.Unlock()
	chat := strings.HasSuffix(r.URL.Path, "chat/completions")
	n := 0
	if v, ok := body["max_tokens"].(float64); ok {
		n = int(v)
	}
	if v, ok := body["max_completion_tokens"].(float64); ok {
		n = int(v)
	}
	if f.mode == "500" {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusInternalServerError)
		fmt.Fprint(w, `{"error":{"message":"boom","type":"InternalServerError","code":500}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	fl.Flush()
	send := func(s string) {
		fmt.Fprint(w, s)
		fl.Flush()
	}
	token := func(i int) string {
		fin := "null"
		if i == n-1 {
			fin = `"length"`
		}
		if chat {
			delta := `{"content":" w"}`
			if i == 0 {
				delta = `{"role":"assistant","content":" w"}`
			}
			return `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"fake-model","choices":[{"index":0,"delta":` + delta + `,"logprobs":null,"finish_reason":` + fin + `}]}` + "\n\n"
		}
		return `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"fake-model","choices":[{"index":0,"text":" w","logprobs":null,"finish_reason":` + fin + `,"stop_reason":null}]}` + "\n\n"
	}
	switch f.mode {
	case "hang":
		<-r.Context().Done()
		return
	case "notoken":
		send(`data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}}` + "\n\n")
		send("data: [DONE]\n\n")
		return
	case "miderror":
		send(token(0))
		send(token(1))
		send(`data: {"error":{"message":"engine dead","type":"InternalServerError","code":500}}` + "\n\n")
		send("data: [DONE]\n\n")
		return
	case "garbage":
		send(token(0))
		send("data: {not json\n\n")
		return
	}
	send(": ping\n\n")
	for i := range n {
		send(token(i))
	}
	pt := len(strings.Fields(promptText(body)))
	send(fmt.Sprintf(`data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"fake-model","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`+"\n\n", pt, n, pt+n))
	send("data: [DONE]\n\n")
}

// savedJSON runs the benchmark and returns the decoded --save-result JSON.
func savedJSON(t *testing.T, cfg Config) (*Result, map[string]any) {
	t.Helper()
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	path, err := res.SaveResult(t.TempDir(), "", true)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("saved JSON: %v", err)
	}
	return res, m
}

func num(m map[string]any, k string) float64 {
	v, _ := m[k].(float64)
	return v
}

func TestEndToEndCompletions(t *testing.T) {
	f := newFakeVLLM(t, "ok")
	cfg := DefaultConfig()
	cfg.BaseURL = f.srv.URL
	cfg.NumPrompts, cfg.MaxConcurrency, cfg.NumWarmups = 20, 4, 2
	cfg.InputLen, cfg.OutputLen, cfg.RangeRatio = 32, 8, 0.5
	cfg.Goodput = map[string]float64{"ttft": 10000}
	cfg.RequestIDPrefix = "t-"
	cfg.APIKey = "sekret"
	cfg.Header = http.Header{"X-Extra": {"1"}}
	cfg.PercentileMetrics = []string{"ttft", "tpot", "itl", "e2el"}

	res, m := savedJSON(t, cfg)
	if num(m, "completed") != 20 || num(m, "failed") != 0 {
		t.Fatalf("completed/failed = %v/%v, errors %v", m["completed"], m["failed"], m["errors"])
	}
	if m["model_id"] != "/models/fake-root" || m["backend"] != "openai" || m["max_concurrency"] != 4.0 || m["request_rate"] != "inf" {
		t.Errorf("header fields: model_id=%v backend=%v max_concurrency=%v request_rate=%v", m["model_id"], m["backend"], m["max_concurrency"], m["request_rate"])
	}
	wantOut, wantIn := 0, 0
	samples, _ := buildSamples(&res.Config)
	for _, s := range samples {
		wantOut += s.OutputLen
		wantIn += s.PromptLen
	}
	if int(num(m, "total_output_tokens")) != wantOut || int(num(m, "total_input_tokens")) != wantIn {
		t.Errorf("tokens in/out = %v/%v, want %d/%d", m["total_input_tokens"], m["total_output_tokens"], wantIn, wantOut)
	}
	if num(m, "request_goodput") <= 0 || num(m, "max_concurrent_requests") > 4 || num(m, "max_concurrent_requests") < 1 {
		t.Errorf("goodput %v, peak concurrency %v", m["request_goodput"], m["max_concurrent_requests"])
	}
	for _, k := range []string{"date", "num_prompts", "burstiness", "duration", "request_throughput", "output_throughput",
		"total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
		"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
		"max_output_tokens_per_s"} {
		if _, ok := m[k]; !ok {
			t.Errorf("saved JSON lacks %q", k)
		}
	}
	itls := m["itls"].([]any)
	texts := m["generated_texts"].([]any)
	for i, s := range samples {
		if got := len(itls[i].([]any)); got != s.OutputLen-1 {
			t.Errorf("request %d: %d ITLs, want %d", i, got, s.OutputLen-1)
		}
		if texts[i] != strings.Repeat(" w", s.OutputLen) {
			t.Errorf("request %d text %q", i, texts[i])
		}
	}

	reqs := f.requests()
	if len(reqs) != 22 {
		t.Fatalf("server saw %d requests, want 20 + 2 warm-ups", len(reqs))
	}
	ids := map[string]bool{}
	warm := 0
	for _, r := range reqs {
		if r.header.Get("Authorization") != "Bearer sekret" || r.header.Get("X-Extra") != "1" || r.header.Get("Content-Type") != "application/json" {
			t.Errorf("headers %v", r.header)
		}
		b := r.body
		if b["model"] != "fake-model" || b["repetition_penalty"] != 1.0 || b["logprobs"] != nil || b["stream"] != true ||
			b["ignore_eos"] != true || b["stream_options"].(map[string]any)["include_usage"] != true {
			t.Errorf("body %v", b)
		}
		if len(strings.Fields(b["prompt"].(string))) < 16 {
			t.Errorf("prompt too short: %v", b["prompt"])
		}
		id := r.header.Get("X-Request-Id")
		if id == "" {
			warm++
			continue
		}
		ids[id] = true
	}
	if warm != 2 || len(ids) != 20 || !ids["t-0"] || !ids["t-19"] {
		t.Errorf("warm-ups %d, distinct ids %d (%v)", warm, len(ids), ids)
	}

	var table bytes.Buffer
	if err := res.WriteReport(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(table.String(), "============ Serving Benchmark Result ============\nSuccessful requests:                     20") {
		t.Errorf("report:\n%s", table.String())
	}
	row := NewSweepRow("fake", "WRITE", res)
	if row.Concurrency != 4 || row.Failed != 0 || row.TTFTP99 < row.TTFTP50 {
		t.Errorf("sweep row %+v", row)
	}
}

// TestMoreBaseURLsAlternate: with router replicas, request i goes to the
// (i mod n)-th base URL.
func TestMoreBaseURLsAlternate(t *testing.T) {
	a, b := newFakeVLLM(t, "ok"), newFakeVLLM(t, "ok")
	cfg := DefaultConfig()
	cfg.BaseURL, cfg.MoreBaseURLs = a.srv.URL, []string{b.srv.URL + "/"}
	cfg.NumPrompts, cfg.MaxConcurrency, cfg.NumWarmups = 10, 3, 0
	cfg.InputLen, cfg.OutputLen = 16, 4
	cfg.DiscardText = true
	res, err := Run(context.Background(), cfg)
	if err != nil || res.Metrics.Completed != 10 {
		t.Fatalf("run: %v, %+v", err, res)
	}
	if na, nb := len(a.requests()), len(b.requests()); na != 5 || nb != 5 {
		t.Errorf("requests per base URL: %d and %d, want 5 and 5", na, nb)
	}
	cfg.MoreBaseURLs = []string{"ftp://x"}
	if _, err := Run(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), "ftp://x") {
		t.Errorf("a bad extra base URL: %v", err)
	}
}

func TestEndToEndChat(t *testing.T) {
	f := newFakeVLLM(t, "ok")
	cfg := DefaultConfig()
	cfg.BaseURL = f.srv.URL
	cfg.Model = "given-model"
	cfg.Backend = BackendOpenAIChat
	cfg.Endpoint = "/v1/chat/completions"
	cfg.NumPrompts, cfg.InputLen, cfg.OutputLen = 6, 10, 5
	_, m := savedJSON(t, cfg)
	if num(m, "completed") != 6 || num(m, "failed") != 0 || num(m, "total_output_tokens") != 30 || num(m, "total_input_tokens") != 60 {
		t.Fatalf("completed %v failed %v tokens %v/%v errors %v", m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"], m["errors"])
	}
	if m["model_id"] != "given-model" || m["backend"] != "openai-chat" {
		t.Errorf("model_id %v backend %v", m["model_id"], m["backend"])
	}
	for _, r := range f.requests() {
		b := r.body
		if r.path != "/v1/chat/completions" || b["max_completion_tokens"] != 5.0 || b["max_tokens"] != nil || b["model"] != "given-model" {
			t.Errorf("chat request %s %v", r.path, b)
		}
		if len(strings.Fields(promptText(b))) != 10 {
			t.Errorf("chat prompt %q", promptText(b))
		}
	}
}

func unreachableURL(t *testing.T) string {
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", port)
}

func TestEndToEndFailures(t *testing.T) {
	cases := []struct {
		mode    string
		wantErr string
	}{
		{"500", "Internal Server Error"},
		{"notoken", neverReceived},
		{"miderror", "engine dead"},
		{"garbage", "malformed SSE event"},
		{"unreachable", "connection refused"},
	}
	for _, c := range cases {
		t.Run(c.mode, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Model = "m"
			if c.mode == "unreachable" {
				cfg.BaseURL = unreachableURL(t)
			} else {
				cfg.BaseURL = newFakeVLLM(t, c.mode).srv.URL
			}
			cfg.NumPrompts, cfg.InputLen, cfg.OutputLen, cfg.MaxConcurrency = 5, 4, 4, 2
			res, m := savedJSON(t, cfg)
			if num(m, "completed") != 0 || num(m, "failed") != 5 || num(m, "total_output_tokens") != 0 {
				t.Fatalf("completed %v failed %v out %v", m["completed"], m["failed"], m["total_output_tokens"])
			}
			for _, e := range m["errors"].([]any) {
				if !strings.Contains(e.(string), c.wantErr) {
					t.Errorf("error %q does not mention %q", e, c.wantErr)
				}
			}
			var b bytes.Buffer
			_ = res.WriteReport(&b)
			if !strings.HasPrefix(b.String(), "Failed requests during benchmark run detected (capping to 10):\nError 0: ") ||
				!strings.Contains(b.String(), "Successful requests:                     0") {
				t.Errorf("report:\n%s", b.String())
			}
		})
	}
}

func TestTimeoutAndMaxDuration(t *testing.T) {
	f := newFakeVLLM(t, "hang")
	cfg := DefaultConfig()
	cfg.BaseURL, cfg.Model = f.srv.URL, "m"
	cfg.NumPrompts, cfg.InputLen, cfg.OutputLen, cfg.MaxConcurrency = 4, 4, 4, 4
	cfg.Timeout = 100 * time.Millisecond
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Metrics.Failed != 4 || !strings.Contains(res.Outputs[0].Error, "timed out after 100ms") {
		t.Errorf("failed %d, error %q", res.Metrics.Failed, res.Outputs[0].Error)
	}

	cfg.Timeout = 0
	cfg.NumPrompts, cfg.MaxConcurrency = 10, 2
	cfg.MaxDuration = 200 * time.Millisecond
	begin := time.Now()
	res, err = Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(begin); el > 3*time.Second {
		t.Errorf("max duration not enforced: ran %v", el)
	}
	if !res.Stopped || res.Metrics.Failed != 10 || len(res.Outputs) != 10 {
		t.Fatalf("stopped %v failed %d", res.Stopped, res.Metrics.Failed)
	}
	if !strings.Contains(res.Outputs[0].Error, "max-duration") || !strings.HasPrefix(res.Outputs[9].Error, "not sent") {
		t.Errorf("errors %q / %q", res.Outputs[0].Error, res.Outputs[9].Error)
	}
}

func TestRunCancelledReturnsPartialResult(t *testing.T) {
	f := newFakeVLLM(t, "hang")
	cfg := DefaultConfig()
	cfg.BaseURL, cfg.Model = f.srv.URL, "m"
	cfg.NumPrompts, cfg.InputLen, cfg.OutputLen = 3, 4, 4
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	res, err := Run(ctx, cfg)
	if !errors.Is(err, context.DeadlineExceeded) || res == nil || res.Metrics.Failed != 3 {
		t.Fatalf("err %v res %v", err, res)
	}
}

func TestMainCLI(t *testing.T) {
	f := newFakeVLLM(t, "ok")
	dir := t.TempDir()
	var out, errOut bytes.Buffer
	args := []string{"--base-url", f.srv.URL, "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "4",
		"--max-concurrency", "2", "--save-result", "--result-dir", dir, "--label", "cli", "--disable-tqdm",
		"--goodput", "ttft:5000", "e2el:5000", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"}
	if err := Main(context.Background(), args, &out, &errOut); err != nil {
		t.Fatalf("Main: %v\n%s", err, errOut.String())
	}
	s := out.String()
	for _, want := range []string{
		"Model not specified, fetching first model from server...",
		"First model name: fake-model, first model id: /models/fake-root",
		"============ Serving Benchmark Result ============",
		"Successful requests:                     8",
		"Request goodput (req/s):",
		"P50 E2EL (ms):",
		"Result saved to ",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("stdout lacks %q:\n%s", want, s)
		}
	}
	files, _ := filepath.Glob(filepath.Join(dir, "cli-infqps-concurrency2-fake-root-*.json"))
	if len(files) != 1 {
		t.Fatalf("result files %v", files)
	}
	if err := Main(context.Background(), []string{"--random-range-ratio", "1.5"}, &out, &errOut); err == nil {
		t.Error("invalid range ratio accepted")
	}
	if err := Main(context.Background(), []string{"-h"}, &out, &errOut); err != nil {
		t.Errorf("-h returned %v", err)
	}
}

func TestSelfTestOverheadSmall(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumPrompts, cfg.MaxConcurrency, cfg.InputLen, cfg.OutputLen = 200, 50, 64, 16
	var out bytes.Buffer
	if err := selfTest(context.Background(), cfg, 2*time.Millisecond, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "Successful requests:                     200") || !strings.Contains(out.String(), "Self-overhead: ") ||
		!strings.Contains(out.String(), "Measured ITL vs server pause 2ms") {
		t.Errorf("self-test output:\n%s", out.String())
	}
}

func TestEndToEndRequestRateAndQueueMetrics(t *testing.T) {
	f := newFakeVLLM(t, "ok")
	cfg := DefaultConfig()
	cfg.BaseURL, cfg.Model = f.srv.URL, "m"
	cfg.NumPrompts, cfg.InputLen, cfg.OutputLen, cfg.MaxConcurrency = 20, 8, 3, 2
	cfg.RequestRate, cfg.Burstiness, cfg.Seed = 100, 2, 9
	cfg.PercentileMetrics = []string{"ttft", "client_queue_time", "e2el_including_client_queue"}
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if res.Metrics.Completed != 20 {
		t.Fatalf("completed %d: %v", res.Metrics.Completed, res.Outputs[0].Error)
	}
	// 20 requests at 100 req/s: the last is sent at 0.2 s after the start.
	if res.Duration < 190*time.Millisecond {
		t.Errorf("duration %v shorter than the arrival schedule", res.Duration)
	}
	last := res.Outputs[19].Start
	if last < 190*time.Millisecond {
		t.Errorf("last request sent at %v, want >= 0.19s", last)
	}
	var b bytes.Buffer
	_ = res.WriteTable(&b)
	for _, want := range []string{"Request rate configured (RPS):           100.00", "-------------Client-side Queueing--------------",
		"Mean Client Queue Time (ms):", "P99 E2EL incl. Client Queue (ms):"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
	js, err := res.MarshalJSONResult(false)
	if err != nil || !bytes.Contains(js, []byte(`"p99_client_queue_time_ms"`)) || !bytes.Contains(js, []byte(`"request_rate": 100`)) ||
		bytes.Contains(js, []byte(`"ttfts"`)) {
		t.Errorf("json %s %v", js, err)
	}
}
