package server

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
)

// waitFor polls cond until it holds or 5 s pass.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// streamer is a dispatcher whose streams send one chunk, then wait for
// release (or the request context) before finishing.
type streamer struct {
	mu      sync.Mutex
	order   []string
	release chan struct{}
}

func (s *streamer) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	name, _ := c.Obj.String("name")
	s.mu.Lock()
	s.order = append(s.order, name)
	s.mu.Unlock()
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	_, _ = io.WriteString(w, "data: "+name+"-1\n\n")
	_ = http.NewResponseController(w).Flush()
	select {
	case <-s.release:
		_, _ = io.WriteString(w, "data: "+name+"-2\n\ndata: [DONE]\n\n")
	case <-r.Context().Done():
		// What the real dispatchers do when cancelled mid-stream.
		_, _ = w.Write(openai.SSEError(503, "router shutting down"))
	}
}

func (s *streamer) names() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.order...)
}

// startStream sends a streaming request and returns once the first chunk
// arrived; the returned reader yields the rest.
func startStream(t *testing.T, client *http.Client, base, name string) (*bufio.Reader, func()) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), "POST", base+"/v1/chat/completions",
		strings.NewReader(`{"stream":true,"name":"`+name+`"}`))
	res, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if res.StatusCode != 200 {
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		t.Fatalf("%s: status %d %s", name, res.StatusCode, b)
	}
	br := bufio.NewReader(res.Body)
	if line, err := br.ReadString('\n'); err != nil || line != "data: "+name+"-1\n" {
		t.Fatalf("%s first line %q %v", name, line, err)
	}
	return br, func() { res.Body.Close() }
}

func TestAdmissionHeldUntilStreamEnds(t *testing.T) {
	st := &streamer{release: make(chan struct{})}
	e := newEnv(t, func(o *Options) {
		o.Generate = st
		o.MaxConcurrent = 1
		o.QueueSize = 1
		o.QueueTimeout = 10 * time.Second
	})
	client := e.srv.Client()
	brA, closeA := startStream(t, client, e.srv.URL, "a")
	defer closeA()

	// B queues behind A's open stream (headers of A were sent long ago).
	bDone := make(chan resp, 1)
	go func() {
		req, _ := http.NewRequestWithContext(t.Context(), "POST", e.srv.URL+"/v1/chat/completions",
			strings.NewReader(`{"stream":true,"name":"b"}`))
		res, err := client.Do(req)
		if err != nil {
			t.Errorf("b: %v", err)
			bDone <- resp{}
			return
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		bDone <- resp{status: res.StatusCode, body: b}
	}()
	waitFor(t, "b queued", func() bool { return e.s.limiter.Queued() == 1 })

	// C finds the queue full.
	r := e.do("POST", "/v1/chat/completions", `{"stream":true,"name":"c"}`)
	if r.status != 429 || r.header.Get("Retry-After") == "" {
		t.Fatalf("c: %d %s", r.status, r.body)
	}
	r.errMsg(t)
	if got := st.names(); len(got) != 1 {
		t.Fatalf("dispatched %v while the slot was held", got)
	}

	close(st.release) // A (and then B) finish their streams
	rest, _ := io.ReadAll(brA)
	if !strings.Contains(string(rest), "a-2") {
		t.Fatalf("a rest %q", rest)
	}
	rb := <-bDone
	if rb.status != 200 || !strings.Contains(string(rb.body), "b-2") {
		t.Fatalf("b: %d %q", rb.status, rb.body)
	}
	if got := st.names(); len(got) != 2 || got[1] != "b" {
		t.Fatalf("order %v", got)
	}
	waitFor(t, "slot released", func() bool { return e.s.limiter.InUse() == 0 })
	if got := value(e.m.AdmissionReject.WithLabelValues("queue_full")); got != 1 {
		t.Fatalf("queue_full = %v", got)
	}
}

func TestAdmissionTimeoutAndClientGone(t *testing.T) {
	st := &streamer{release: make(chan struct{})}
	e := newEnv(t, func(o *Options) {
		o.Generate = st
		o.MaxConcurrent = 1
		o.QueueSize = 4
		o.QueueTimeout = 50 * time.Millisecond
	})
	_, closeA := startStream(t, e.srv.Client(), e.srv.URL, "a")
	r := e.do("POST", "/v1/chat/completions", `{"name":"late"}`)
	if r.status != 408 {
		t.Fatalf("queued request: %d %s, want 408", r.status, r.body)
	}
	r.errMsg(t)

	// A client that leaves while queued frees its place and gets nothing.
	e2 := newEnv(t, func(o *Options) {
		o.Generate = st
		o.MaxConcurrent = 1
		o.QueueSize = 4
		o.QueueTimeout = time.Minute
	})
	_, closeA2 := startStream(t, e2.srv.Client(), e2.srv.URL, "a2")
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", e2.srv.URL+"/v1/chat/completions", strings.NewReader(`{"name":"gone"}`))
		res, err := e2.srv.Client().Do(req)
		if err == nil {
			res.Body.Close()
		}
		errc <- err
	}()
	waitFor(t, "queued", func() bool { return e2.s.limiter.Queued() == 1 })
	cancel()
	if err := <-errc; err == nil {
		t.Fatal("cancelled request got a response")
	}
	waitFor(t, "queue emptied", func() bool { return e2.s.limiter.Queued() == 0 })
	waitFor(t, "499 logged", func() bool {
		return value(e2.m.HTTPRequests.WithLabelValues("/v1/chat/completions", "POST", "499", "regular")) == 1
	})
	for _, n := range st.names() {
		if n == "gone" {
			t.Fatal("request dispatched after its client left")
		}
	}
	close(st.release)
	closeA()
	closeA2()
	waitFor(t, "slots released", func() bool { return e2.s.limiter.InUse() == 0 })
}

func TestRateLimit(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.RateLimitPerSecond = 0.001; o.RateLimitBurst = 2 })
	for i, want := range []int{200, 200, 429} {
		if r := e.do("POST", "/v1/completions", `{}`); r.status != want {
			t.Fatalf("request %d: %d, want %d", i, r.status, want)
		}
	}
	if r := e.do("GET", "/liveness", ""); r.status != 200 {
		t.Fatal("rate limit applied outside the generation routes")
	}
}

func TestGracefulShutdownDrains(t *testing.T) {
	st := &streamer{release: make(chan struct{})}
	e := newEnv(t, func(o *Options) { o.Generate = st; o.ShutdownTimeout = 10 * time.Second })
	base, stop := serve(t, e.s)
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	br, closeBody := startStream(t, client, base, "slow")
	defer closeBody()

	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	waitFor(t, "draining", func() bool { return e.s.draining.Load() })
	select {
	case err := <-stopped:
		t.Fatalf("Serve returned (%v) with a stream in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	// New connections are refused while draining.
	if _, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Get(base + "/liveness"); err == nil {
		t.Fatal("new connection accepted during shutdown")
	}
	close(st.release)
	rest, err := io.ReadAll(br)
	if err != nil || !strings.Contains(string(rest), "slow-2") || !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("stream not completed: %q %v", rest, err)
	}
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatalf("Serve: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after the stream ended")
	}
}

func TestGracefulShutdownDeadlineCancels(t *testing.T) {
	st := &streamer{release: make(chan struct{})} // never released
	e := newEnv(t, func(o *Options) {
		o.Generate = st
		o.ShutdownTimeout = 200 * time.Millisecond
		o.MaxConcurrent = 1
		o.QueueSize = 2
	})
	base, stop := serve(t, e.s)
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	br, closeBody := startStream(t, client, base, "endless")
	defer closeBody()

	// A request queued when shutdown starts is refused with 503.
	queued := make(chan int, 1)
	go func() {
		req, _ := http.NewRequestWithContext(t.Context(), "POST", base+"/v1/completions", strings.NewReader(`{"name":"q"}`))
		res, err := client.Do(req)
		if err != nil {
			queued <- 0
			return
		}
		res.Body.Close()
		queued <- res.StatusCode
	}()
	waitFor(t, "queued", func() bool { return e.s.limiter.Queued() == 1 })

	start := time.Now()
	if err := stop(); err != nil {
		t.Fatalf("Serve: %v", err)
	}
	el := time.Since(start)
	if el < 200*time.Millisecond || el > 3*time.Second {
		t.Fatalf("shutdown took %v, want ≈ ShutdownTimeout (200ms) plus a short grace", el)
	}
	if code := <-queued; code != 503 {
		t.Fatalf("queued request got %d, want 503", code)
	}
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"router shutting down"`) || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("cancelled stream did not end with an SSE error event: %q", rest)
	}
}

func TestReadinessWhileDraining(t *testing.T) {
	e := newEnv(t, nil)
	w := newFakeWorker(t)
	e.add(w.URL, 0, -1, 1)
	e.s.draining.Store(true)
	rec := httptest.NewRecorder()
	e.s.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readiness", nil))
	if rec.Code != 503 || !strings.Contains(rec.Body.String(), "shutting down") {
		t.Fatalf("%d %s", rec.Code, rec.Body)
	}
}
