package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/proxy"
)

func TestGenerateBody(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MaxPayloadSize = 64; o.RouteReceipt = true })
	for _, tc := range []struct {
		name, path, body string
		chunked          bool
		status           int
		msg              string // substring of the error message
	}{
		{"malformed", "/v1/completions", `{"prompt": "x",}`, false, 400, "offset 16"},
		{"truncated", "/v1/completions", `{"prompt": "x"`, false, 400, "Invalid request body"},
		{"array", "/v1/chat/completions", `[1,2]`, false, 400, "expected a JSON object"},
		{"string", "/generate", `"hi"`, false, 400, "expected a JSON object"},
		{"empty", "/v1/completions", ``, false, 400, "empty"},
		{"too large", "/v1/completions", `{"prompt":"` + strings.Repeat("x", 100) + `"}`, false, 413, "64 bytes"},
		{"too large chunked", "/v1/completions", `{"prompt":"` + strings.Repeat("x", 100) + `"}`, true, 413, "64 bytes"},
		{"ok", "/v1/completions", `{"prompt":"x","stream":true}`, false, 200, ""},
		{"ok chunked", "/inference/v1/generate", `{"prompt":"x"}`, true, 200, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var rd io.Reader = strings.NewReader(tc.body)
			if tc.chunked {
				rd = io.MultiReader(rd) // hides the length: chunked encoding
			}
			req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+tc.path, rd)
			r := e.send(req)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if tc.status != 200 {
				if msg := r.errMsg(t); !strings.Contains(msg, tc.msg) {
					t.Fatalf("message %q lacks %q", msg, tc.msg)
				}
				return
			}
			c := e.gen.last()
			if c.Route != tc.path || c.Path != tc.path || string(c.Body) != tc.body || c.Obj == nil ||
				c.RequestID != r.header.Get("X-Request-Id") || c.Start.IsZero() || c.Receipt.Mode != "regular" {
				t.Fatalf("call %+v", c)
			}
			if c.Stream != strings.Contains(tc.body, `"stream":true`) {
				t.Fatalf("stream = %v", c.Stream)
			}
			want := "mode=regular; policy=round_robin; worker=http://w1:8000; attempts=1; reason=next in turn"
			if got := r.header.Get("X-Switchyard-Route"); got != want {
				t.Fatalf("receipt %q, want %q", got, want)
			}
		})
	}
	if got := value(e.m.RequestErrors.WithLabelValues("/v1/completions", "invalid_json")); got != 3 {
		t.Fatalf("invalid_json errors = %v, want 3", got)
	}
}

func TestReceiptOffAndSanitised(t *testing.T) {
	e := newEnv(t, nil)
	if r := e.do("POST", "/v1/completions", `{}`); r.header.Get("X-Switchyard-Route") != "" {
		t.Fatal("receipt sent although RouteReceipt is off")
	}
	rc := &proxy.Receipt{Mode: "pd", Policy: "consistent_hash", Prefill: "http://p:1", Decode: "http://d:2@1",
		Attempts: 2, Failovers: []string{"http://d:3"}, Reason: "owner; \nmoved"}
	want := "mode=pd; policy=consistent_hash; prefill=http://p:1; decode=http://d:2@1; attempts=2; failovers=http://d:3; reason=owner, ?moved"
	if got := receiptHeader(rc); got != want {
		t.Fatalf("got  %q\nwant %q", got, want)
	}
}

func TestRequestID(t *testing.T) {
	e := newEnv(t, nil)
	gen := regexp.MustCompile(`^(chatcmpl|cmpl|gnt|req)-[A-Za-z0-9]{24}$`)
	for _, tc := range []struct {
		method, path string
		hdr          []string
		want         string // exact id, or a prefix ending in '-'
	}{
		{"POST", "/v1/chat/completions", nil, "chatcmpl-"},
		{"POST", "/v1/completions", nil, "cmpl-"},
		{"POST", "/generate", nil, "gnt-"},
		{"POST", "/inference/v1/generate", nil, "gnt-"},
		{"GET", "/v1/models", nil, "req-"},
		{"GET", "/some/passthrough", nil, "req-"},
		{"POST", "/v1/completions", []string{"X-Request-Id", "client-id-1"}, "client-id-1"},
		{"POST", "/v1/completions", []string{"X-Correlation-Id", "corr-7"}, "corr-7"},
		{"POST", "/v1/completions", []string{"Request-Id", "r-1", "X-Trace-Id", "trace-1"}, "trace-1"},
		{"POST", "/v1/completions", []string{"X-Request-Id", "has space"}, "cmpl-"},
		{"POST", "/v1/completions", []string{"X-Request-Id", strings.Repeat("a", 300)}, "cmpl-"},
	} {
		r := e.do(tc.method, tc.path, `{}`, tc.hdr...)
		got := r.header.Get("X-Request-Id")
		if strings.HasSuffix(tc.want, "-") {
			if !strings.HasPrefix(got, tc.want) || !gen.MatchString(got) {
				t.Errorf("%s %v: id %q, want generated %s…", tc.path, tc.hdr, got, tc.want)
			}
		} else if got != tc.want {
			t.Errorf("%s %v: id %q, want %q", tc.path, tc.hdr, got, tc.want)
		}
	}
	// Passthrough handlers see the id.
	r := e.do("POST", "/anything", `{}`, "X-Request-Id", "pt-1")
	if r.json(t)["request_id"] != "pt-1" {
		t.Fatalf("passthrough saw %s", r.body)
	}

	// Custom header list replaces the default one.
	e2 := newEnv(t, func(o *Options) { o.RequestIDHeaders = []string{"X-My-Id"} })
	if got := e2.do("GET", "/liveness", "", "X-My-Id", "mine").header.Get("X-Request-Id"); got != "mine" {
		t.Fatalf("custom header: %q", got)
	}
	if got := e2.do("GET", "/liveness", "", "X-Request-Id", "ignored").header.Get("X-Request-Id"); got == "ignored" {
		t.Fatal("default header used although a custom list is set")
	}

	// An upstream x-request-id copied by the dispatcher does not replace ours.
	e.gen.fn = func(w http.ResponseWriter, _ *http.Request, _ *proxy.Call) {
		w.Header().Set("X-Request-Id", "upstream-id")
		writeJSON(w, 200, map[string]any{})
	}
	if got := e.do("POST", "/v1/completions", `{}`, "X-Request-Id", "mine").header.Get("X-Request-Id"); got != "mine" {
		t.Fatalf("id %q after upstream overwrite", got)
	}
	ids := map[string]bool{}
	for range 1000 {
		id := newRequestID("/x")
		if ids[id] {
			t.Fatalf("duplicate id %s", id)
		}
		ids[id] = true
	}
}

func TestCORS(t *testing.T) {
	preflight := func(e *env, origin string) resp {
		return e.do("OPTIONS", "/v1/chat/completions", "", "Origin", origin,
			"Access-Control-Request-Method", "POST", "Access-Control-Request-Headers", "authorization,content-type")
	}
	// Any origin (default), with auth on: the preflight must not need a key.
	e := newEnv(t, func(o *Options) { o.RouterAPIKeys = []string{"k"} })
	r := preflight(e, "https://app.example")
	if r.status != 204 || r.header.Get("Access-Control-Allow-Origin") != "*" ||
		r.header.Get("Access-Control-Allow-Methods") != "POST" ||
		r.header.Get("Access-Control-Allow-Headers") != "authorization,content-type" ||
		r.header.Get("Access-Control-Max-Age") != "3600" {
		t.Fatalf("any-origin preflight: %d %v", r.status, r.header)
	}
	if e.gen.count() != 0 {
		t.Fatal("preflight reached the dispatcher")
	}
	r = e.do("GET", "/liveness", "", "Origin", "https://app.example")
	if r.header.Get("Access-Control-Allow-Origin") != "*" || r.header.Get("Access-Control-Expose-Headers") != "*" {
		t.Fatalf("simple request: %v", r.header)
	}

	// A configured list.
	e2 := newEnv(t, func(o *Options) { o.CORSAllowedOrigins = []string{"https://ok.example/"} })
	r = preflight(e2, "https://ok.example")
	if r.status != 204 || r.header.Get("Access-Control-Allow-Origin") != "https://ok.example" ||
		r.header.Get("Access-Control-Allow-Methods") != corsAllowedMethods ||
		r.header.Get("Access-Control-Allow-Headers") != corsAllowedHeaders {
		t.Fatalf("allowed-origin preflight: %d %v", r.status, r.header)
	}
	r = preflight(e2, "https://evil.example")
	if r.status != 204 || r.header.Get("Access-Control-Allow-Origin") != "" {
		t.Fatalf("refused origin got CORS headers: %v", r.header)
	}
	r = e2.do("GET", "/liveness", "", "Origin", "https://ok.example")
	if r.header.Get("Access-Control-Expose-Headers") != corsExposedHeaders || !strings.Contains(r.header.Get("Vary"), "Origin") {
		t.Fatalf("simple request: %v", r.header)
	}
	// OPTIONS without a preflight header is an ordinary request (405 here).
	if r := e2.do("OPTIONS", "/health", ""); r.status != 405 {
		t.Fatalf("plain OPTIONS: %d", r.status)
	}
}

// The catch-all runs through the same chain: request id, auth, body limit.
func TestCatchAllMiddleware(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MaxPayloadSize = 32; o.RouterAPIKeys = []string{"k"} })
	big := `{"x":"` + strings.Repeat("y", 64) + `"}`
	r := e.do("POST", "/v1/whatever", big, "Authorization", "Bearer k")
	if r.status != 413 || r.header.Get("X-Request-Id") == "" {
		t.Fatalf("oversized passthrough: %d %v", r.status, r.header)
	}
	r.errMsg(t)
	req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/whatever", io.MultiReader(strings.NewReader(big)))
	req.Header.Set("Authorization", "Bearer k")
	if r := e.send(req); r.status != 413 {
		t.Fatalf("oversized chunked passthrough: %d", r.status)
	}
	if r := e.do("POST", "/v1/whatever", `{}`); r.status != 401 {
		t.Fatalf("unauthenticated passthrough: %d", r.status)
	}
	if e.pass.count() != 0 {
		t.Fatalf("passthrough called %d times", e.pass.count())
	}
	r = e.do("POST", "/v1/whatever", `{"a":1}`, "Authorization", "Bearer k")
	if r.status != 200 || r.json(t)["body_len"] != 7.0 || r.header.Get("X-Request-Id") != r.json(t)["request_id"] {
		t.Fatalf("passthrough: %d %s", r.status, r.body)
	}
	req, _ = http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/whatever", io.MultiReader(strings.NewReader(`{"a":1}`)))
	req.Header.Set("Authorization", "Bearer k")
	if r := e.send(req); r.status != 200 || r.json(t)["body_len"] != 7.0 {
		t.Fatalf("chunked passthrough: %d %s", r.status, r.body)
	}
	if got := value(e.m.HTTPRequests.WithLabelValues("other", "POST", "413", "regular")); got != 2 {
		t.Fatalf("catch-all 413 metric = %v", got)
	}
}

func TestPanicRecovered(t *testing.T) {
	e := newEnv(t, nil)
	e.gen.fn = func(http.ResponseWriter, *http.Request, *proxy.Call) { panic("boom") }
	r := e.do("POST", "/v1/completions", `{}`)
	if r.status != 500 || r.header.Get("X-Request-Id") == "" {
		t.Fatalf("%d %v", r.status, r.header)
	}
	r.errMsg(t)
	if got := value(e.m.HTTPRequests.WithLabelValues("/v1/completions", "POST", "500", "regular")); got != 1 {
		t.Fatalf("metric = %v", got)
	}
	// After the status line, a panic aborts the connection.
	e.gen.fn = func(w http.ResponseWriter, _ *http.Request, _ *proxy.Call) {
		w.WriteHeader(200)
		_, _ = w.Write([]byte("partial"))
		http.NewResponseController(w).Flush()
		panic("late boom")
	}
	req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/completions", strings.NewReader(`{}`))
	res, err := e.srv.Client().Do(req)
	if err == nil {
		_, err = io.ReadAll(res.Body)
		res.Body.Close()
	}
	if err == nil {
		t.Fatal("late panic did not abort the response")
	}
}

// An SSE chunk reaches the client before the dispatcher produces the next
// one, through the middleware's ResponseWriter wrapper.
func TestSSEFlushThroughChain(t *testing.T) {
	e := newEnv(t, nil)
	got1 := make(chan struct{})
	e.gen.fn = func(w http.ResponseWriter, _ *http.Request, c *proxy.Call) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		_, _ = io.WriteString(w, "data: one\n\n")
		if err := rc.Flush(); err != nil {
			t.Errorf("flush: %v", err)
		}
		if err := rc.SetWriteDeadline(time.Time{}); err != nil {
			t.Errorf("SetWriteDeadline through the wrapper: %v", err)
		}
		select {
		case <-got1:
		case <-time.After(5 * time.Second):
			t.Error("client never saw the first chunk before the second was produced")
		}
		_, _ = io.WriteString(w, "data: two\n\ndata: [DONE]\n\n")
	}
	req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/chat/completions", strings.NewReader(`{"stream":true}`))
	res, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	br := bufio.NewReader(res.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "data: one\n" {
		t.Fatalf("first line %q %v", line, err)
	}
	close(got1)
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "data: two") {
		t.Fatalf("rest %q", rest)
	}
	if got := histCount(e.m.TTFT.WithLabelValues("/v1/chat/completions", "regular")); got != 0 {
		t.Fatalf("ttft observed by the server (%v): the dispatchers own it", got)
	}
}

func TestWrapperUnwrap(t *testing.T) {
	rec := httptest.NewRecorder()
	w := &respWriter{ResponseWriter: rec, s: &Server{}, st: &reqState{id: "x"}}
	if http.NewResponseController(w).Flush() != nil || !rec.Flushed || rec.Code != 200 {
		t.Fatalf("flush through wrapper: flushed=%v code=%d", rec.Flushed, rec.Code)
	}
	if w.Unwrap() != rec {
		t.Fatal("Unwrap")
	}
	var _ http.Flusher = w
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func TestMetricsAndAccessLog(t *testing.T) {
	var buf syncBuffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	e := newEnv(t, func(o *Options) { o.Logger = log; o.RouterAPIKeys = []string{"sekrit-token"} })
	e.gen.fn = func(w http.ResponseWriter, _ *http.Request, c *proxy.Call) {
		c.Receipt.Worker = "http://w9:8000"
		c.Receipt.Attempts = 2
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: x\n\n")
	}
	e.do("POST", "/v1/completions", `{"stream":true}`, "Authorization", "Bearer sekrit-token", "X-Request-Id", "log-1")
	e.do("GET", "/liveness", "")
	if got := value(e.m.RequestsTotal.WithLabelValues("/v1/completions")); got != 1 {
		t.Fatalf("requests_total = %v", got)
	}
	if got := value(e.m.HTTPRequests.WithLabelValues("/liveness", "GET", "200", "regular")); got != 1 {
		t.Fatalf("http_requests = %v", got)
	}
	if got := histCount(e.m.RequestDuration.WithLabelValues("/v1/completions", "200", "regular")); got != 1 {
		t.Fatalf("duration observations = %v", got)
	}
	if got := value(e.m.InFlight.WithLabelValues("regular")); got != 0 {
		t.Fatalf("in flight = %v", got)
	}
	if methodLabel("BREW") != "OTHER" {
		t.Fatal("method label not bounded")
	}
	out := buf.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 1 { // the probe logs at debug
		t.Fatalf("want one info line, got:\n%s", out)
	}
	var rec map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &rec); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{"msg": "request", "request_id": "log-1", "route": "/v1/completions",
		"status": 200.0, "worker": "http://w9:8000", "attempts": 2.0, "method": "POST"} {
		if rec[k] != want {
			t.Errorf("log %s = %v, want %v", k, rec[k], want)
		}
	}
	if _, ok := rec["ttft_ms"]; !ok {
		t.Errorf("no ttft_ms in %s", lines[0])
	}
	if strings.Contains(out, "sekrit") {
		t.Fatal("token logged")
	}
}
