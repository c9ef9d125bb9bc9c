package server

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeWorker is a tiny vLLM stand-in for the router's own calls.
type fakeWorker struct {
	*httptest.Server
	mu     sync.Mutex
	hits   map[string]int
	models []string
	status map[string]int // per-path status override
	auth   []string       // Authorization headers seen
}

func newFakeWorker(t *testing.T, models ...string) *fakeWorker {
	t.Helper()
	f := &fakeWorker{hits: map[string]int{}, models: models, status: map[string]int{}}
	f.Server = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeWorker) setStatus(path string, code int) {
	f.mu.Lock()
	f.status[path] = code
	f.mu.Unlock()
}

func (f *fakeWorker) hit(path string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.hits[path]
}

func (f *fakeWorker) serve(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.hits[r.Method+" "+r.URL.Path]++
	f.hits[r.URL.Path]++
	f.auth = append(f.auth, r.Header.Get("Authorization"))
	code := f.status[r.URL.Path]
	f.mu.Unlock()
	if code != 0 {
		openai.WriteError(w, code, "fake failure")
		return
	}
	switch r.URL.Path {
	case "/health":
		w.WriteHeader(200)
	case "/v1/models":
		data := make([]map[string]any, 0, len(f.models))
		for _, m := range f.models {
			data = append(data, map[string]any{"id": m, "object": "model", "owned_by": "vllm", "root": f.URL})
		}
		writeJSON(w, 200, map[string]any{"object": "list", "data": data})
	case "/get_model_info":
		w.Header().Set("X-Worker", f.URL)
		writeJSON(w, 200, map[string]any{"model_path": "m", "worker": f.URL})
	case "/get_server_info":
		writeJSON(w, 200, map[string]any{"engine": "fake", "worker": f.URL})
	case "/flush_cache", "/start_profile", "/stop_profile":
		w.WriteHeader(200)
	default:
		http.NotFound(w, r)
	}
}

// fakeDispatcher records calls and answers with a small JSON body, or runs
// fn when set.
type fakeDispatcher struct {
	mu    sync.Mutex
	calls []*proxy.Call
	fn    func(w http.ResponseWriter, r *http.Request, c *proxy.Call)
}

func (d *fakeDispatcher) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	d.mu.Lock()
	d.calls = append(d.calls, c)
	fn := d.fn
	d.mu.Unlock()
	if proxy.CallFrom(r.Context()) != c {
		openai.WriteError(w, 500, "call not in context")
		return
	}
	if fn != nil {
		fn(w, r, c)
		return
	}
	c.Receipt.Policy = "round_robin"
	c.Receipt.Worker = "http://w1:8000"
	c.Receipt.Attempts = 1
	c.Receipt.Reason = "next in turn"
	writeJSON(w, 200, map[string]any{"route": c.Route, "stream": c.Stream, "id": c.RequestID})
}

func (d *fakeDispatcher) last() *proxy.Call {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.calls) == 0 {
		return nil
	}
	return d.calls[len(d.calls)-1]
}

func (d *fakeDispatcher) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.calls)
}

// fakePassthrough echoes what it received.
type fakePassthrough struct {
	mu    sync.Mutex
	calls int
}

func (p *fakePassthrough) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	p.calls++
	p.mu.Unlock()
	b, err := io.ReadAll(r.Body)
	if err != nil {
		openai.WriteError(w, 502, "read body: "+err.Error())
		return
	}
	writeJSON(w, 200, map[string]any{
		"passthrough": true, "method": r.Method, "path": r.URL.Path, "query": r.URL.RawQuery,
		"body_len": len(b), "request_id": RequestID(r.Context()),
	})
}

func (p *fakePassthrough) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

type env struct {
	t    *testing.T
	s    *Server
	srv  *httptest.Server
	reg  *worker.Registry
	gen  *fakeDispatcher
	pass *fakePassthrough
	m    *metrics.Metrics
}

// newEnv builds a server behind httptest with fakes; mod may change Options.
func newEnv(t *testing.T, mod func(*Options)) *env {
	t.Helper()
	e := &env{t: t, reg: worker.NewRegistry(worker.BreakerConfig{}), gen: &fakeDispatcher{},
		pass: &fakePassthrough{}, m: metrics.NewForTest()}
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	o := Options{
		Mode: ModeRegular, Registry: e.reg, Generate: e.gen, Passthrough: e.pass,
		Upstream: client, Metrics: e.m, Version: "test-1.2.3",
		Policies: map[string]string{"policy": "round_robin"},
	}
	if mod != nil {
		mod(&o)
	}
	s, err := New(o)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	e.s = s
	e.srv = httptest.NewServer(s.Handler())
	t.Cleanup(e.srv.Close)
	return e
}

func (e *env) add(url string, role worker.Role, rank, size int) *worker.Worker {
	e.t.Helper()
	ws, err := e.reg.Add(worker.Spec{URL: url, Role: role, DPRank: rank, DPSize: size, ModelID: "m1"})
	if err != nil {
		e.t.Fatalf("add %s: %v", url, err)
	}
	return ws[0]
}

type resp struct {
	status int
	header http.Header
	body   []byte
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("body is not a JSON object (%v): %s", err, r.body)
	}
	return m
}

// errMsg returns the OpenAI error message of the body.
func (r resp) errMsg(t *testing.T) string {
	t.Helper()
	var b openai.ErrorBody
	if err := json.Unmarshal(r.body, &b); err != nil || b.Error.Code == 0 {
		t.Fatalf("not an OpenAI error body (%v): %s", err, r.body)
	}
	if b.Error.Code != r.status {
		t.Fatalf("error code %d != status %d", b.Error.Code, r.status)
	}
	return b.Error.Message
}

func (e *env) do(method, path, body string, hdr ...string) resp {
	e.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(e.t.Context(), method, e.srv.URL+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	return e.send(req)
}

func (e *env) send(req *http.Request) resp {
	e.t.Helper()
	res, err := e.srv.Client().Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", req.Method, req.URL.Path, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		e.t.Fatalf("read body: %v", err)
	}
	return resp{status: res.StatusCode, header: res.Header, body: b}
}

// value reads a counter, gauge or histogram sample count.
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Histogram != nil:
		return float64(m.Histogram.GetSampleCount())
	}
	return 0
}

func histCount(o prometheus.Observer) float64 { return value(o.(prometheus.Metric)) }

// serve runs s.Serve on a fresh listener and returns its URL and a stop
// func that cancels and waits for Serve to return.
func serve(t *testing.T, s *Server) (url string, stop func() error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, ln) }()
	var once sync.Once
	var serr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case serr = <-done:
			case <-time.After(20 * time.Second):
				serr = fmt.Errorf("Serve did not return")
			}
		})
		return serr
	}
	t.Cleanup(func() { _ = stop() })
	return "http://" + ln.Addr().String(), stop
}
