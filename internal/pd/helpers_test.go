package pd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/freeport"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ---------------------------------------------------------------------------
// fake vLLM worker

type recorded struct {
	path string
	hdr  http.Header
	body []byte
	at   time.Time
}

// params returns the raw kv_transfer_params of the recorded body.
func (r *recorded) params(t *testing.T) []byte {
	t.Helper()
	o, err := rawjson.Parse(r.body)
	if err != nil {
		t.Fatalf("upstream body is not a JSON object: %v: %s", err, r.body)
	}
	return o.Get("kv_transfer_params")
}

func (r *recorded) obj(t *testing.T) *rawjson.Object {
	t.Helper()
	o, err := rawjson.Parse(r.body)
	if err != nil {
		t.Fatalf("upstream body is not a JSON object: %v: %s", err, r.body)
	}
	return o
}

type fake struct {
	t      *testing.T
	srv    *httptest.Server
	got    chan *recorded
	count  atomic.Int32
	handle atomic.Pointer[func(http.ResponseWriter, *http.Request, *recorded)]
}

func newFake(t *testing.T, h func(http.ResponseWriter, *http.Request, *recorded)) *fake {
	f := &fake{t: t, got: make(chan *recorded, 64)}
	f.setHandler(h)
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		rec := &recorded{path: r.URL.Path, hdr: r.Header.Clone(), body: body, at: time.Now()}
		f.count.Add(1)
		select {
		case f.got <- rec:
		default:
		}
		(*f.handle.Load())(w, r, rec)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fake) setHandler(h func(http.ResponseWriter, *http.Request, *recorded)) { f.handle.Store(&h) }

func (f *fake) URL() string { return f.srv.URL }

func (f *fake) port() int {
	_, p, _ := net.SplitHostPort(strings.TrimPrefix(f.srv.URL, "http://"))
	n, _ := strconv.Atoi(p)
	return n
}

// next waits for the next recorded request.
func (f *fake) next(t *testing.T) *recorded {
	t.Helper()
	select {
	case r := <-f.got:
		return r
	case <-time.After(5 * time.Second):
		t.Fatalf("no request reached %s", f.srv.URL)
		return nil
	}
}

func (f *fake) none(t *testing.T) {
	t.Helper()
	if n := f.count.Load(); n != 0 {
		t.Fatalf("%s received %d request(s), want none", f.srv.URL, n)
	}
}

// prefillJSON is a vLLM non-streaming completion as P returns it.
func prefillJSON(params string) string {
	return `{"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1},"kv_transfer_params":` + params + `}`
}

func writeJSON(w http.ResponseWriter, status int, body string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = io.WriteString(w, body)
}

// prefillOK answers like a prefill returning params in its response
// (the request's own kv_transfer_params when params == "").
func prefillOK(params string) func(http.ResponseWriter, *http.Request, *recorded) {
	return func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		p := params
		if p == "" {
			if o, err := rawjson.Parse(rec.body); err == nil {
				p = string(o.Get("kv_transfer_params"))
			}
			if p == "" {
				p = "null"
			}
		}
		writeJSON(w, 200, prefillJSON(p))
	}
}

var sseEvents = []string{
	`data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"Hel"}]}` + "\n\n",
	`data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"lo","finish_reason":"length"}]}` + "\n\n",
	"data: [DONE]\n\n",
}

func sseAll() string { return strings.Join(sseEvents, "") }

func startSSE(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(200)
	_ = http.NewResponseController(w).Flush()
}

// decodeSSE streams sseEvents.
func decodeSSE(w http.ResponseWriter, r *http.Request, rec *recorded) {
	startSSE(w)
	sendEvents(w)
}

func sendEvents(w http.ResponseWriter) {
	for _, ev := range sseEvents {
		_, _ = io.WriteString(w, ev)
		_ = http.NewResponseController(w).Flush()
	}
}

// decodeJSON answers a non-streaming decode.
func decodeJSON(w http.ResponseWriter, r *http.Request, rec *recorded) {
	writeJSON(w, 200, `{"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":"Hello","finish_reason":"length"}]}`)
}

// ---------------------------------------------------------------------------
// policies

// prefer picks the first usable worker whose URL is listed in order, else
// the first usable worker.
type prefer struct{ urls []string }

func (p *prefer) Name() string { return "test" }

func (p *prefer) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	for _, u := range p.urls {
		for _, w := range c.Workers {
			if w.URL == u && req.Usable(w) {
				return policy.Choice{Worker: w, Reason: "preferred"}, nil
			}
		}
	}
	for _, w := range c.Workers {
		if req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "first usable"}, nil
		}
	}
	return policy.Choice{}, policy.ErrNoWorker
}

// ---------------------------------------------------------------------------
// workers

type specOpt func(*worker.Spec)

func dp(size, rank int) specOpt {
	return func(s *worker.Spec) { s.DPSize, s.DPRank = size, rank }
}

func tp(n int) specOpt { return func(s *worker.Spec) { s.TPSize = n } }

func zmqAddr4(addr, mode string) specOpt {
	return func(s *worker.Spec) {
		s.ZMQAddress = addr
		s.ZMQ, _ = worker.ParseZMQAddress(addr)
		s.TransferMode = mode
		s.Source = worker.SourceZMQ
	}
}

func bootPort(p int) specOpt { return func(s *worker.Spec) { s.BootstrapPort = p } }

func addWorker(t *testing.T, reg *worker.Registry, url string, role worker.Role, opts ...specOpt) *worker.Worker {
	t.Helper()
	s := worker.Spec{URL: url, Role: role, DPRank: -1, DPSize: 1, TPSize: 1}
	for _, o := range opts {
		o(&s)
	}
	ws, err := reg.Add(s)
	if err != nil {
		t.Fatal(err)
	}
	ws[0].MarkProbed() // as if the health checker had probed it (warm-ups wait for that)
	return ws[0]
}

// deadURL is an http URL on a port nothing listens on.
func deadURL(t *testing.T) string {
	t.Helper()
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", port)
}

// ---------------------------------------------------------------------------
// router harness

type harness struct {
	eng    *Engine
	reg    *worker.Registry
	front  *httptest.Server
	client *http.Client
	last   atomic.Pointer[proxy.Call]
}

func newHarness(t *testing.T, reg *worker.Registry, o Options) *harness {
	t.Helper()
	// Loopback connects are instant, but a machine with every core busy
	// has delayed one past a 1 s deadline (i/o timeout): no test here
	// depends on the connect timeout.
	tr := proxy.NewH1Transport(proxy.TransportOptions{ConnectTimeout: 10 * time.Second})
	t.Cleanup(tr.Close)
	o.Registry = reg
	if o.Client == nil {
		o.Client = &http.Client{Transport: tr}
	}
	if o.PrefillPolicy == nil {
		o.PrefillPolicy = &prefer{}
	}
	if o.DecodePolicy == nil {
		o.DecodePolicy = &prefer{}
	}
	eng, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{eng: eng, reg: reg}
	h.front = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		c := &proxy.Call{Route: r.URL.Path, Path: r.URL.Path, Body: body, Start: time.Now(), Receipt: &proxy.Receipt{}}
		if obj, err := rawjson.Parse(body); err == nil {
			c.Obj = obj
			c.Stream, _ = obj.Bool("stream")
		}
		h.last.Store(c)
		eng.Dispatch(w, r, c)
	}))
	ctr := &http.Transport{}
	h.client = &http.Client{Transport: ctr}
	t.Cleanup(func() {
		h.front.Close()
		ctr.CloseIdleConnections()
		eng.Close()
	})
	return h
}

type result struct {
	status int
	hdr    http.Header
	body   string
	err    error
}

func (h *harness) post(t *testing.T, path, body string, hdr ...string) result {
	t.Helper()
	return h.postCtx(context.Background(), t, path, body, hdr...)
}

func (h *harness) postCtx(ctx context.Context, t *testing.T, path, body string, hdr ...string) result {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.front.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := h.client.Do(req)
	if err != nil {
		return result{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, hdr: resp.Header, body: string(b), err: err}
}

// ---------------------------------------------------------------------------
// assertions

// PROTOCOL §2.4 connector regexes.
var (
	prefillZMQRE = regexp.MustCompile(`___prefill_addr_(.+?)___decode_addr_`)
	decodeZMQRE  = regexp.MustCompile(`___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$`)
	uid32RE      = regexp.MustCompile(`_([0-9a-f]{32})$`)
	txRE         = regexp.MustCompile(`^tx-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
	xferRE       = regexp.MustCompile(`^xfer-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)
)

func checkRequestID(t *testing.T, id, pZMQ, dZMQ string) {
	t.Helper()
	want := regexp.MustCompile(`^___prefill_addr_` + regexp.QuoteMeta(pZMQ) + `___decode_addr_` + regexp.QuoteMeta(dZMQ) + `_[0-9a-f]{32}$`)
	if !want.MatchString(id) {
		t.Fatalf("X-Request-Id %q does not match %s", id, want)
	}
	if m := prefillZMQRE.FindStringSubmatch(id); m == nil || m[1] != pZMQ {
		t.Fatalf("decode-side regex finds prefill %q in %q, want %q", m, id, pZMQ)
	}
	if m := decodeZMQRE.FindStringSubmatch(id); m == nil || m[1] != dZMQ {
		t.Fatalf("prefill-side regex finds decode %q in %q, want %q", m, id, dZMQ)
	}
	// vLLM appends "-<seq>-<hex>"; the prefill-side regex must still work.
	if m := decodeZMQRE.FindStringSubmatch(id + "-0-deadbeef"); m == nil || m[1] != dZMQ {
		t.Fatalf("prefill-side regex fails on the suffixed id")
	}
	if !uid32RE.MatchString(id) {
		t.Fatalf("no 32-hex uid at the end of %q", id)
	}
}

// jsonEq compares two JSON documents semantically.
func jsonEq(t *testing.T, what string, got []byte, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("%s: %v: %s", what, err, got)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatalf("%s: bad want: %v", what, err)
	}
	gb, _ := json.Marshal(g)
	wb, _ := json.Marshal(w)
	if string(gb) != string(wb) {
		t.Fatalf("%s:\n got  %s\n want %s", what, got, want)
	}
}

func strField(t *testing.T, raw []byte, k string) string {
	t.Helper()
	o, err := rawjson.Parse(raw)
	if err != nil {
		t.Fatalf("not an object: %s", raw)
	}
	s, ok := o.String(k)
	if !ok {
		t.Fatalf("%s missing or not a string in %s", k, raw)
	}
	return s
}

// waitDone waits for a channel with a timeout.
func waitDone[T any](t *testing.T, ch <-chan T, d time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(d):
		t.Fatalf("timeout waiting for %s", what)
		var z T
		return z
	}
}

// sseLines splits an SSE body into its data payloads.
func sseData(body string) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "data: ") {
			out = append(out, strings.TrimPrefix(l, "data: "))
		}
	}
	return out
}

// kvGate models the KV handoff of concurrent connectors: a decode streams
// its tokens only after the prefill of its own request answered, as vLLM's
// WRITE/Mooncake decodes do. Requests are told apart by the X-Request-Id
// both legs carry: a decode of a failed attempt that has not yet seen its
// cancellation must not take the KV of the next attempt's prefill (with one
// shared token it did, and under load the next attempt's decode waited
// forever).
type kvGate struct {
	mu    sync.Mutex
	gates map[string]chan struct{} // by X-Request-Id; closed once its prefill answered
}

func newKVGate() *kvGate { return &kvGate{gates: map[string]chan struct{}{}} }

func (g *kvGate) of(r *http.Request) chan struct{} {
	id := r.Header.Get("X-Request-Id")
	g.mu.Lock()
	defer g.mu.Unlock()
	c := g.gates[id]
	if c == nil {
		c = make(chan struct{})
		g.gates[id] = c
	}
	return c
}

// open lets the decode of r's request (a prefill leg) stream.
func (g *kvGate) open(r *http.Request) {
	c := g.of(r)
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-c:
	default:
		close(c)
	}
}

// prefill wraps a prefill handler to open the gate after answering.
func (g *kvGate) prefill(h func(http.ResponseWriter, *http.Request, *recorded)) func(http.ResponseWriter, *http.Request, *recorded) {
	return func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		h(w, r, rec)
		g.open(r)
	}
}

// decode sends headers at once, then the events once its prefill answered.
func (g *kvGate) decode(w http.ResponseWriter, r *http.Request, rec *recorded) {
	startSSE(w)
	select {
	case <-g.of(r):
		sendEvents(w)
	case <-r.Context().Done():
	}
}

// syncOnly hides H1Transport's RoundTripAsync: the concurrent prefill then
// parks a goroutine on P's answer (watchPrefill), as with a tracing
// transport.
type syncOnly struct{ t *proxy.H1Transport }

func (s syncOnly) RoundTrip(r *http.Request) (*http.Response, error) { return s.t.RoundTrip(r) }

// prefillWaits are the two ways a concurrent prefill awaits P's answer:
// in the transport's epoll set (the harness's default client) and on a
// goroutine of its own.
var prefillWaits = []struct {
	name   string
	client func(t *testing.T) *http.Client
}{
	{"epoll", func(*testing.T) *http.Client { return nil }},
	{"goroutine", func(t *testing.T) *http.Client {
		tr := proxy.NewH1Transport(proxy.TransportOptions{ConnectTimeout: 10 * time.Second})
		t.Cleanup(tr.Close)
		return &http.Client{Transport: syncOnly{tr}}
	}},
}
