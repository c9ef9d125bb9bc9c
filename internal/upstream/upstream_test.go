package upstream

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/freeport"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestBaseURL(t *testing.T) {
	for in, want := range map[string]string{
		"https://api.openai.com":         "https://api.openai.com",
		"https://api.openai.com/":        "https://api.openai.com",
		"https://api.openai.com/v1":      "https://api.openai.com",
		"https://api.openai.com/v1/":     "https://api.openai.com",
		"https://host/openai/v1":         "https://host/openai",
		"http://127.0.0.1:8000/v1beta":   "http://127.0.0.1:8000/v1beta",
		"http://127.0.0.1:8000/prefix/x": "http://127.0.0.1:8000/prefix/x",
	} {
		if got := BaseURL(in); got != want {
			t.Errorf("BaseURL(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestStrip(t *testing.T) {
	cases := []struct {
		in, want string
		removed  []string
	}{
		{`{"model":"m","messages":[],"top_k":5}`, `{"model":"m","messages":[]}`, []string{"top_k"}},
		{`{"top_k":5,  "model":"m" , "ignore_eos":true,"x":{"top_k":1}}`, `{  "model":"m","x":{"top_k":1}}`, []string{"top_k", "ignore_eos"}},
		{`{"model":"m","temperature":0.2}`, `{"model":"m","temperature":0.2}`, nil},
		{`{"min_tokens":1}`, `{}`, []string{"min_tokens"}},
	}
	for _, tc := range cases {
		obj, err := rawjson.Parse([]byte(tc.in))
		if err != nil {
			t.Fatal(err)
		}
		got, removed := Strip(obj)
		if string(got) != tc.want || fmt.Sprint(removed) != fmt.Sprint(tc.removed) {
			t.Errorf("Strip(%s) = %s %v, want %s %v", tc.in, got, removed, tc.want, tc.removed)
		}
		if !json.Valid(got) {
			t.Errorf("Strip(%s) = invalid JSON %s", tc.in, got)
		}
	}
}

// fakeUpstream answers with the handlers in turn (the last one repeats) and
// records what it received.
type fakeUpstream struct {
	*httptest.Server
	mu       sync.Mutex
	handlers []http.HandlerFunc
	n        int
	bodies   []string
	auths    []string
	headers  []http.Header
}

func newUpstream(t *testing.T, hs ...http.HandlerFunc) *fakeUpstream {
	f := &fakeUpstream{handlers: hs}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		h := f.handlers[min(f.n, len(f.handlers)-1)]
		f.n++
		f.bodies = append(f.bodies, r.Method+" "+r.URL.Path+" "+string(b))
		f.auths = append(f.auths, r.Header.Get("Authorization"))
		f.headers = append(f.headers, r.Header.Clone())
		f.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeUpstream) calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

func jsonAnswer(status int, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}
}

func sseAnswer(events ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for _, e := range events {
			fmt.Fprintf(w, "data: %s\n\n", e)
			http.NewResponseController(w).Flush()
		}
	}
}

type setup struct {
	b   *Backend
	wk  *worker.Worker
	m   *metrics.Metrics
	srv *httptest.Server // the router side
}

func newBackend(t *testing.T, url string, mod func(*Options)) *setup {
	t.Helper()
	wk := worker.New(worker.Spec{URL: url, Role: worker.RoleRegular, DPRank: -1},
		worker.BreakerConfig{FailureThreshold: 3, SuccessThreshold: 1, OpenDuration: time.Hour, HalfOpenMax: 1})
	tr := proxy.NewTransport(proxy.TransportOptions{})
	t.Cleanup(tr.CloseIdleConnections)
	m := metrics.NewForTest()
	o := Options{
		Worker: wk, Client: &http.Client{Transport: tr}, APIKey: "sk-test",
		Retry:          proxy.RetryConfig{MaxAttempts: 3, InitialBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond, Multiplier: 2},
		RequestTimeout: 10 * time.Second, Metrics: m, Rand: func() float64 { return 0.5 },
	}
	if mod != nil {
		mod(&o)
	}
	b, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	s := &setup{b: b, wk: wk, m: m}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		obj, err := rawjson.Parse(body)
		if err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		stream, _ := obj.Bool("stream")
		c := &proxy.Call{Route: r.URL.Path, Path: r.URL.Path, Body: body, Obj: obj, Stream: stream, Start: time.Now(), Receipt: &proxy.Receipt{}}
		b.Dispatch(w, r, c)
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *setup) post(t *testing.T, path, body string, hdr ...string) (int, http.Header, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), "POST", s.srv.URL+path, strings.NewReader(body))
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := s.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

func TestDispatch(t *testing.T) {
	ok := jsonAnswer(200, `{"id":"chatcmpl-1","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
	fail503 := jsonAnswer(503, `{"error":{"message":"overloaded","type":"server_error","param":null,"code":null}}`)
	cases := []struct {
		name     string
		handlers []http.HandlerFunc
		path     string
		body     string
		status   int
		want     string // substring of the client's body
		calls    int    // upstream calls
		sent     string // body the upstream received (when set)
	}{
		{"chat forwarded, vLLM fields removed", []http.HandlerFunc{ok}, "/v1/chat/completions",
			`{"model":"gpt-x","messages":[{"role":"user","content":"hi"}],"top_k":4,"temperature":0.5,"ignore_eos":true}`,
			200, `"chatcmpl-1"`, 1, `{"model":"gpt-x","messages":[{"role":"user","content":"hi"}],"temperature":0.5}`},
		{"completions forwarded", []http.HandlerFunc{ok}, "/v1/completions", `{"model":"m","prompt":"x","min_p":0.1}`, 200, `"chatcmpl-1"`, 1, `{"model":"m","prompt":"x"}`},
		{"embeddings untouched", []http.HandlerFunc{ok}, "/v1/embeddings", `{"model":"e","input":"x","top_k":1}`, 200, "", 1, `{"model":"e","input":"x","top_k":1}`},
		{"4xx relayed, not retried", []http.HandlerFunc{jsonAnswer(400, `{"error":{"message":"bad model","type":"invalid_request_error","param":"model","code":null}}`)},
			"/v1/chat/completions", `{"model":"m","messages":[]}`, 400, `bad model`, 1, ""},
		{"401 relayed", []http.HandlerFunc{jsonAnswer(401, `{"error":{"message":"Incorrect API key provided"}}`)},
			"/v1/chat/completions", `{"model":"m","messages":[]}`, 401, `Incorrect API key`, 1, ""},
		{"503 retried", []http.HandlerFunc{fail503, ok}, "/v1/chat/completions", `{"model":"m","messages":[]}`, 200, `"chatcmpl-1"`, 2, ""},
		{"retries exhausted: the last answer", []http.HandlerFunc{fail503}, "/v1/chat/completions", `{"model":"m","messages":[]}`, 503, `overloaded`, 3, ""},
		{"stream relayed", []http.HandlerFunc{sseAnswer(`{"choices":[{"delta":{"content":"a"}}]}`, `[DONE]`)}, "/v1/chat/completions",
			`{"model":"m","messages":[],"stream":true}`, 200, "data: [DONE]\n\n", 1, ""},
		{"vLLM route refused", []http.HandlerFunc{ok}, "/generate", `{"text":"x"}`, 501, `--backend openai`, 0, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, tc.handlers...)
			s := newBackend(t, up.URL, nil)
			status, _, body := s.post(t, tc.path, tc.body, "Authorization", "Bearer client-key", "OpenAI-Organization", "org-1", "Cookie", "c=1")
			if status != tc.status || !strings.Contains(body, tc.want) {
				t.Fatalf("%d %q, want %d with %q", status, body, tc.status, tc.want)
			}
			if n := up.calls(); n != tc.calls {
				t.Fatalf("upstream called %d times, want %d", n, tc.calls)
			}
			if tc.calls == 0 {
				return
			}
			if tc.sent != "" && up.bodies[0] != "POST "+tc.path+" "+tc.sent {
				t.Fatalf("upstream got %q, want %q", up.bodies[0], tc.sent)
			}
			h := up.headers[0]
			if up.auths[0] != "Bearer sk-test" || h.Get("OpenAI-Organization") != "org-1" || h.Get("Cookie") != "" {
				t.Fatalf("upstream headers %v", h)
			}
		})
	}
}

func TestDispatchForwardsClientAuth(t *testing.T) {
	up := newUpstream(t, jsonAnswer(200, `{}`))
	s := newBackend(t, up.URL, func(o *Options) { o.APIKey, o.ForwardClientAuth = "", true })
	if st, _, b := s.post(t, "/v1/chat/completions", `{"model":"m"}`, "Authorization", "Bearer client-key"); st != 200 {
		t.Fatalf("%d %s", st, b)
	}
	if up.auths[0] != "Bearer client-key" {
		t.Fatalf("auth %q", up.auths[0])
	}
}

func TestDispatchConnectFailure(t *testing.T) {
	port, err := freeport.Pick() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	s := newBackend(t, url, nil)
	st, _, body := s.post(t, "/v1/chat/completions", `{"model":"m"}`)
	if st != 502 || !strings.Contains(body, "after 3 attempt(s)") || !strings.Contains(body, url) {
		t.Fatalf("%d %s", st, body)
	}
	// Three more failures open the breaker (threshold 3 over both requests).
	if st, _, body := s.post(t, "/v1/chat/completions", `{"model":"m"}`); st != 503 || !strings.Contains(body, "circuit breaker open") {
		t.Fatalf("breaker: %d %s", st, body)
	}
}

func TestDispatchTimeouts(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	var hits atomic.Int32
	slow := func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}
	up := newUpstream(t, slow)
	s := newBackend(t, up.URL, func(o *Options) { o.RequestTimeout = 300 * time.Millisecond })
	start := time.Now()
	st, _, body := s.post(t, "/v1/chat/completions", `{"model":"m"}`)
	if st != 504 || time.Since(start) > 5*time.Second {
		t.Fatalf("request timeout: %d %s after %v", st, body, time.Since(start))
	}
	// A streaming request whose headers do not come in time is retried.
	up2 := newUpstream(t, slow, sseAnswer(`{"ok":1}`, "[DONE]"))
	s2 := newBackend(t, up2.URL, func(o *Options) { o.HeaderTimeout = 200 * time.Millisecond })
	st, _, body = s2.post(t, "/v1/chat/completions", `{"model":"m","stream":true}`)
	if st != 200 || !strings.Contains(body, "[DONE]") || up2.calls() != 2 {
		t.Fatalf("header timeout retry: %d %q after %d calls", st, body, up2.calls())
	}
	once.Do(func() { close(release) })
}

func TestDispatchStreamBroken(t *testing.T) {
	up := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"a\":1}\n\n")
		http.NewResponseController(w).Flush()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	})
	s := newBackend(t, up.URL, nil)
	st, _, body := s.post(t, "/v1/chat/completions", `{"model":"m","stream":true}`)
	if st != 200 || !strings.HasPrefix(body, "data: {\"a\":1}\n\n") || !strings.Contains(body, "upstream stream broken") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("%d %q", st, body)
	}
	if up.calls() != 1 {
		t.Fatalf("retried after the first byte: %d calls", up.calls())
	}
}
