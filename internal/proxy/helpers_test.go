package proxy

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/switchyard-llm/switchyard/internal/freeport"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testTimeout = 10 * time.Second

// rrPolicy is a trivial round-robin test double honouring Request.Usable.
type rrPolicy struct{ n atomic.Uint64 }

func (p *rrPolicy) Name() string { return "test_rr" }

func (p *rrPolicy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	n := uint64(len(c.Workers))
	for range n {
		w := c.Workers[(p.n.Add(1)-1)%n]
		if req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "rr"}, nil
		}
	}
	return policy.Choice{}, policy.ErrNoWorker
}

// firstPolicy always picks the first usable worker in key order, so a retry
// lands elsewhere only because the failed worker is excluded.
type firstPolicy struct{}

func (firstPolicy) Name() string { return "test_first" }

func (firstPolicy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	for _, w := range c.Workers {
		if req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "first"}, nil
		}
	}
	return policy.Choice{}, policy.ErrNoWorker
}

// orderPolicy picks the first usable worker whose base URL comes first in
// order (then any other usable worker).
type orderPolicy struct{ order []string }

func (orderPolicy) Name() string { return "test_order" }

func (p orderPolicy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	for _, u := range p.order {
		for _, w := range c.Workers {
			if w.URL == u && req.Usable(w) {
				return policy.Choice{Worker: w, Reason: "order"}, nil
			}
		}
	}
	return firstPolicy{}.Pick(req, c)
}

// fakeWorker is an httptest vLLM stand-in whose behaviour a test sets.
type fakeWorker struct {
	srv  *httptest.Server
	hits atomic.Int64

	mu      sync.Mutex
	handler http.HandlerFunc
	bodies  [][]byte
	reqs    []*http.Request
}

func newFakeWorker(t testing.TB, h http.HandlerFunc) *fakeWorker {
	t.Helper()
	f := &fakeWorker{handler: h}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.hits.Add(1)
		f.mu.Lock()
		h := f.handler
		f.mu.Unlock()
		h(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeWorker) set(h http.HandlerFunc) {
	f.mu.Lock()
	f.handler = h
	f.mu.Unlock()
}

// recordingOK answers 200 with a small JSON body and records the request.
func (f *fakeWorker) recordingOK(tag string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, b)
		f.reqs = append(f.reqs, r.Clone(context.Background()))
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"worker":%q}`, tag)
	}
}

func (f *fakeWorker) lastRequest() (*http.Request, []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.reqs) == 0 {
		return nil, nil
	}
	return f.reqs[len(f.reqs)-1], f.bodies[len(f.bodies)-1]
}

// deadURL returns a URL whose port refuses connections.
func deadURL(t testing.TB) string {
	t.Helper()
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("http://127.0.0.1:%d", port)
}

type fixture struct {
	t      testing.TB
	reg    *worker.Registry
	p      *Regular
	front  *httptest.Server
	client *http.Client
	m      *metrics.Metrics

	mu       sync.Mutex
	receipts []Receipt
}

// newFixture builds a registry of urls (sorted key order), a Regular
// dispatcher and a frontend server that plays the role of the app's server.
func newFixture(t testing.TB, urls []string, o RegularOptions) *fixture {
	t.Helper()
	return newFixtureWith(t, urls, o, worker.BreakerConfig{})
}

func newFixtureWith(t testing.TB, urls []string, o RegularOptions, bc worker.BreakerConfig) *fixture {
	t.Helper()
	f := &fixture{t: t, reg: worker.NewRegistry(bc)}
	for _, u := range urls {
		if _, err := f.reg.Add(worker.Spec{URL: u, DPRank: -1}); err != nil {
			t.Fatal(err)
		}
	}
	tr := NewH1Transport(TransportOptions{})
	t.Cleanup(tr.CloseIdleConnections)
	o.Registry = f.reg
	o.Client = &http.Client{Transport: tr}
	if o.Policy == nil {
		o.Policy = &rrPolicy{}
	}
	if o.Metrics == nil {
		o.Metrics = metrics.NewForTest()
	}
	f.m = o.Metrics
	f.p = NewRegular(o)
	f.front = httptest.NewServer(f.handler())
	t.Cleanup(f.front.Close)
	ctr := &http.Transport{DisableCompression: true}
	t.Cleanup(ctr.CloseIdleConnections)
	f.client = &http.Client{Transport: ctr}
	return f
}

func isGeneration(path string) bool {
	return slices.Contains([]string{"/v1/chat/completions", "/v1/completions", "/generate"}, path)
}

// receiptWriter records the receipt when the headers are written, to check
// that it is complete by then.
type receiptWriter struct {
	http.ResponseWriter
	f   *fixture
	c   *Call
	did bool
}

func (rw *receiptWriter) WriteHeader(code int) {
	if !rw.did {
		rw.did = true
		rw.f.mu.Lock()
		rw.f.receipts = append(rw.f.receipts, *rw.c.Receipt)
		rw.f.mu.Unlock()
		rw.Header().Set("X-Test-Attempts", fmt.Sprint(rw.c.Receipt.Attempts))
		rw.Header().Set("X-Test-Worker", rw.c.Receipt.Worker)
	}
	rw.ResponseWriter.WriteHeader(code)
}

func (rw *receiptWriter) Write(b []byte) (int, error) {
	if !rw.did {
		rw.WriteHeader(http.StatusOK)
	}
	return rw.ResponseWriter.Write(b)
}

func (rw *receiptWriter) Unwrap() http.ResponseWriter { return rw.ResponseWriter }

func (f *fixture) handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "router-id")
		if r.Method == http.MethodPost && isGeneration(r.URL.Path) {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				return
			}
			obj, err := rawjson.Parse(body)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			stream, _ := obj.Bool("stream")
			c := &Call{Route: r.URL.Path, Path: r.URL.Path, Body: body, Obj: obj, Stream: stream,
				RequestID: "router-id", Start: time.Now(), Receipt: &Receipt{}}
			r = r.WithContext(WithCall(r.Context(), c))
			f.p.Dispatch(&receiptWriter{ResponseWriter: w, f: f, c: c}, r, c)
			return
		}
		f.p.ServePassthrough(w, r)
	})
}

func (f *fixture) lastReceipt() Receipt {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.receipts) == 0 {
		return Receipt{}
	}
	return f.receipts[len(f.receipts)-1]
}

// post sends a generation request and returns status, headers and body.
func (f *fixture) post(ctx context.Context, path, body string, hdr ...string) (int, http.Header, string) {
	f.t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, f.front.URL+path, strings.NewReader(body))
	if err != nil {
		f.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := f.client.Do(req)
	if err != nil {
		f.t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		f.t.Fatalf("read body: %v", err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// counterValue reads a counter or gauge child.
// eventuallyCounter waits up to a second for c to reach want and returns its
// last value.
func eventuallyCounter(t testing.TB, c any, want float64) float64 {
	t.Helper()
	v := counterValue(t, c)
	for deadline := time.Now().Add(time.Second); v != want && time.Now().Before(deadline); v = counterValue(t, c) {
		time.Sleep(time.Millisecond)
	}
	return v
}

func counterValue(t testing.TB, c any) float64 {
	t.Helper()
	m, ok := c.(prometheus.Metric)
	if !ok {
		t.Fatalf("%T is not a metric", c)
	}
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	switch {
	case d.Counter != nil:
		return d.Counter.GetValue()
	case d.Gauge != nil:
		return d.Gauge.GetValue()
	case d.Histogram != nil:
		return float64(d.Histogram.GetSampleCount())
	}
	return 0
}
