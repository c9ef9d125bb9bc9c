package tracing

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/tracing/otlptest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const inboundParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

func newTestTracer(t *testing.T, cfg Config) (*Tracer, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tr, err := NewWithExporter(cfg, exp)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = tr.Shutdown(ctx)
	})
	return tr, exp
}

func attrs(s tracetest.SpanStub) map[string]attribute.Value {
	m := map[string]attribute.Value{}
	for _, kv := range s.Attributes {
		m[string(kv.Key)] = kv.Value
	}
	return m
}

// TestDisabledIsFree: every hook on a disabled (nil) tracer returns at once
// without allocating, and Transport returns the base transport itself.
func TestDisabledIsFree(t *testing.T) {
	var tr *Tracer
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	req.Header.Set("Traceparent", inboundParent)
	h := http.Header{"Traceparent": {inboundParent}}
	ctx := t.Context()
	allocs := testing.AllocsPerRun(1000, func() {
		if tr.Enabled() {
			t.Fatal("nil tracer enabled")
		}
		c, span := tr.StartServer(req, "/v1/completions")
		if span != nil || c != req.Context() {
			t.Fatal("disabled StartServer returned a span")
		}
		EndServer(span, 200, "id", "")
		cs := tr.StartClient(ctx, Leg{Phase: PhasePrefill, Method: "POST"})
		tr.Inject(ctx, cs, h)
		SetStatus(cs, 500)
		Fail(cs, "x", nil)
		Event(cs, EventFirstByte)
		_ = tr.Excluded("/v1/completions")
	})
	if allocs != 0 {
		t.Fatalf("disabled tracing allocates %v times per request", allocs)
	}
	if got := h.Get("Traceparent"); got != inboundParent {
		t.Fatalf("disabled Inject changed traceparent to %q", got)
	}
	base := &http.Transport{}
	if rt := tr.Transport(base, TransportOptions{}); rt != base {
		t.Fatalf("disabled Transport wrapped the base transport: %T", rt)
	}
	if err := tr.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestResolveEndpoint(t *testing.T) {
	for _, tc := range []struct {
		name, flag, traces, generic, want string
	}{
		{"default", "", "", "", "http://localhost:4317"},
		{"flag host:port", "collector:4317", "", "", "http://collector:4317"},
		{"flag url kept", "https://collector:4317", "", "", "https://collector:4317"},
		{"flag beats env", "a:1", "b:2", "c:3", "http://a:1"},
		{"traces env", "", "b:2", "c:3", "http://b:2"},
		{"generic env", "", "", "http://c:3", "http://c:3"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", tc.traces)
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tc.generic)
			if got := ResolveEndpoint(tc.flag); got != tc.want {
				t.Fatalf("ResolveEndpoint(%q) = %q, want %q", tc.flag, got, tc.want)
			}
		})
	}
}

func TestSamplingRatioValidated(t *testing.T) {
	for _, r := range []float64{-0.1, 1.5} {
		if _, err := NewWithExporter(Config{SamplingRatio: r}, tracetest.NewInMemoryExporter()); err == nil {
			t.Errorf("ratio %v accepted", r)
		}
	}
}

func TestExcludedPaths(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 1})
	for _, p := range DefaultExcludedPaths {
		if !tr.Excluded(p) {
			t.Errorf("default excluded path %s not excluded", p)
		}
		if _, span := tr.StartServer(httptest.NewRequest("GET", p, nil), p); span != nil {
			t.Errorf("%s got a server span", p)
		}
	}
	if tr.Excluded("/v1/completions") {
		t.Error("/v1/completions excluded by default")
	}
	custom, _ := newTestTracer(t, Config{SamplingRatio: 1, ExcludedPaths: []string{"/metrics"}})
	if !custom.Excluded("/metrics") || custom.Excluded("/health") {
		t.Error("custom excluded paths must replace the defaults")
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("%d spans exported for excluded paths", n)
	}
}

// TestServerSpan: the server span continues the inbound trace, is named
// "METHOD route", carries the HTTP attributes and is an error on 5xx.
func TestServerSpan(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 1})
	req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	req.Header.Set("Traceparent", inboundParent)
	_, span := tr.StartServer(req, "/v1/chat/completions")
	EndServer(span, 503, "req-1", "no_available_workers")
	_, span = tr.StartServer(httptest.NewRequest(http.MethodPut, "/whatever/123", nil), "")
	EndServer(span, 200, "req-2", "")

	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	s := spans[0]
	if s.Name != "POST /v1/chat/completions" || s.SpanKind != trace.SpanKindServer {
		t.Fatalf("span %q kind %v", s.Name, s.SpanKind)
	}
	if s.SpanContext.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || s.Parent.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("server span does not continue the inbound trace: trace %s parent %s", s.SpanContext.TraceID(), s.Parent.SpanID())
	}
	a := attrs(s)
	for k, want := range map[string]string{
		"http.request.method": "POST", "http.route": "/v1/chat/completions", "url.path": "/v1/chat/completions",
		AttrRequestID: "req-1", AttrErrorType: "no_available_workers",
	} {
		if got := a[k].AsString(); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if a["http.response.status_code"].AsInt64() != 503 || s.Status.Code != codes.Error {
		t.Errorf("5xx: status attr %v, span status %v", a["http.response.status_code"], s.Status)
	}
	if s2 := spans[1]; s2.Name != "PUT" || s2.Status.Code == codes.Error || s2.Parent.IsValid() {
		t.Errorf("catch-all span %q status %v parent %v", s2.Name, s2.Status, s2.Parent)
	}
	if _, ok := attrs(spans[1])["http.route"]; ok {
		t.Error("catch-all span has http.route")
	}
}

// upstream records the trace headers it receives.
type upstream struct {
	*httptest.Server
	mu  sync.Mutex
	hdr []http.Header
}

func newUpstream(t *testing.T, status int) *upstream {
	u := &upstream{}
	u.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.hdr = append(u.hdr, r.Header.Clone())
		u.mu.Unlock()
		w.WriteHeader(status)
		_, _ = io.WriteString(w, "data: hello\n\n")
	}))
	t.Cleanup(u.Close)
	return u
}

func (u *upstream) last() http.Header {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.hdr[len(u.hdr)-1]
}

type routeKey struct{}

// TestTransport: a client span per upstream request, child of the span in
// the request context, ended when the body is closed, with its context
// injected (replacing the client's traceparent) and baggage carried.
func TestTransport(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 1})
	up := newUpstream(t, 200)
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	rt := tr.Transport(base, TransportOptions{Route: func(r *http.Request) string {
		s, _ := r.Context().Value(routeKey{}).(string)
		return s
	}})

	in := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	in.Header.Set("Traceparent", inboundParent)
	in.Header.Set("Baggage", "tenant=acme")
	ctx, server := tr.StartServer(in, "/v1/completions")
	if got := baggage.FromContext(ctx).Member("tenant").Value(); got != "acme" {
		t.Fatalf("inbound baggage not extracted: %q", got)
	}
	ctx = context.WithValue(ctx, routeKey{}, "/v1/completions")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, up.URL+"/v1/completions?x=1", strings.NewReader("{}"))
	req.Header.Set("Traceparent", inboundParent) // forwarded client header: must be replaced
	req.Header.Set("X-Data-Parallel-Rank", "3")
	resp, err := rt.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if req.Header.Get("Traceparent") != inboundParent {
		t.Fatal("RoundTrip modified the caller's request headers")
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("client span ended before the body was read (%d spans)", n)
	}
	_, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	EndServer(server, 200, "r", "")

	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want client + server", len(spans))
	}
	c, s := spans[0], spans[1]
	if c.SpanKind != trace.SpanKindClient || c.Name != "POST /v1/completions" || c.Parent.SpanID() != s.SpanContext.SpanID() {
		t.Fatalf("client span %q kind %v parent %s (server %s)", c.Name, c.SpanKind, c.Parent.SpanID(), s.SpanContext.SpanID())
	}
	a := attrs(c)
	host := strings.TrimPrefix(up.URL, "http://")
	for k, want := range map[string]string{
		AttrPhase: PhaseInference, AttrWorker: up.URL + "@3", "url.full": up.URL + "/v1/completions?x=1",
		"server.address": "127.0.0.1", "http.route": "/v1/completions",
	} {
		if got := a[k].Emit(); got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	if a[AttrDPRank].AsInt64() != 3 || a["http.response.status_code"].AsInt64() != 200 || !strings.HasSuffix(host, ":"+a["server.port"].Emit()) {
		t.Errorf("attrs %v", a)
	}
	h := up.last()
	want := "00-" + c.SpanContext.TraceID().String() + "-" + c.SpanContext.SpanID().String() + "-01"
	if got := h.Get("Traceparent"); got != want {
		t.Fatalf("upstream traceparent %q, want the client span's %q", got, want)
	}
	if got := h.Get("Baggage"); got != "tenant=acme" {
		t.Fatalf("upstream baggage %q", got)
	}
}

func TestTransportErrors(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 1})
	up := newUpstream(t, 502)
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	rt := tr.Transport(base, TransportOptions{})

	req, _ := http.NewRequest(http.MethodGet, up.URL+"/x", nil)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body) // EOF ends the span, Close after is harmless
	resp.Body.Close()

	up.Close()
	req, _ = http.NewRequest(http.MethodGet, up.URL+"/x", nil)
	if _, err := rt.RoundTrip(req); err == nil {
		t.Fatal("round trip to a closed server succeeded")
	}
	spans := exp.GetSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	if spans[0].Status.Code != codes.Error || attrs(spans[0])["http.response.status_code"].AsInt64() != 502 {
		t.Errorf("5xx span status %v", spans[0].Status)
	}
	if spans[1].Status.Code != codes.Error || attrs(spans[1])[AttrErrorType].AsString() != "transport" || len(spans[1].Events) == 0 {
		t.Errorf("transport error span: status %v attrs %v", spans[1].Status, attrs(spans[1]))
	}
	if spans[0].Name != "GET" {
		t.Errorf("span without a route named %q, want the method", spans[0].Name)
	}
}

// TestSampledOutPropagates: a root sampled out records nothing but still
// propagates an (unsampled) trace context; a sampled parent is followed
// whatever the ratio.
func TestSampledOutPropagates(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 0})
	_, span := tr.StartServer(httptest.NewRequest(http.MethodPost, "/v1/completions", nil), "/v1/completions")
	if span.IsRecording() {
		t.Fatal("ratio 0 root span records")
	}
	h := http.Header{}
	tr.Inject(t.Context(), span, h)
	if tp := h.Get("Traceparent"); !strings.HasSuffix(tp, "-00") || len(tp) != 55 {
		t.Fatalf("unsampled traceparent %q", tp)
	}
	EndServer(span, 200, "r", "")

	req := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
	req.Header.Set("Traceparent", inboundParent)
	_, span = tr.StartServer(req, "/v1/completions")
	if !span.IsRecording() {
		t.Fatal("sampled parent not followed at ratio 0")
	}
	EndServer(span, 200, "r", "")
	if n := len(exp.GetSpans()); n != 1 {
		t.Fatalf("%d spans exported, want the parent-sampled one", n)
	}
}

func TestHostPort(t *testing.T) {
	for _, tc := range []struct {
		in   string
		host string
		port int
		ok   bool
	}{
		{"http://10.0.0.1:8000/v1/completions", "10.0.0.1", 8000, true},
		{"http://user:pw@h:1/x?y", "h", 1, true},
		{"http://[::1]:9/x", "::1", 9, true},
		{"http://noport/x", "noport", 0, true},
		{"nourl", "", 0, false},
	} {
		h, p, ok := hostPort(tc.in)
		if h != tc.host || p != tc.port || ok != tc.ok {
			t.Errorf("hostPort(%q) = %q %d %v", tc.in, h, p, ok)
		}
	}
}

func TestFailRecordsError(t *testing.T) {
	tr, exp := newTestTracer(t, Config{SamplingRatio: 1})
	span := tr.StartClient(t.Context(), Leg{Phase: PhaseDecode, Method: "POST", URL: "http://d:1/v1/completions", Worker: "http://d:1", DPRank: -1})
	Event(span, EventFirstByte)
	Fail(span, "kv_wait_timeout", errors.New("no KV"))
	span.End()
	s := exp.GetSpans()[0]
	if s.Status.Code != codes.Error || s.Status.Description != "no KV" || attrs(s)[AttrErrorType].AsString() != "kv_wait_timeout" {
		t.Fatalf("status %v attrs %v", s.Status, attrs(s))
	}
	if len(s.Events) != 2 || s.Events[0].Name != EventFirstByte {
		t.Fatalf("events %v", s.Events)
	}
	if _, ok := attrs(s)[AttrDPRank]; ok {
		t.Fatal("dp rank set for a worker without one")
	}
}

var _ sdktrace.SpanExporter = (*tracetest.InMemoryExporter)(nil)

// TestOTLPExportAndShutdownFlush: New exports over OTLP/gRPC to the
// endpoint (host:port, http:// implied) and Shutdown flushes spans still
// in the batch.
func TestOTLPExportAndShutdownFlush(t *testing.T) {
	col, err := otlptest.Start()
	if err != nil {
		t.Fatal(err)
	}
	defer col.Stop()
	tr, err := New(t.Context(), Config{Endpoint: col.Addr(), SamplingRatio: 1, ServiceVersion: "9.9.9"})
	if err != nil {
		t.Fatal(err)
	}
	_, span := tr.StartServer(httptest.NewRequest(http.MethodPost, "/v1/completions", nil), "/v1/completions")
	EndServer(span, 200, "req-otlp", "")
	// The batch timeout (500 ms) has not passed: only Shutdown's flush
	// can have delivered the span.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := tr.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	spans := col.Spans()
	if len(spans) != 1 {
		t.Fatalf("collector got %d spans, want 1", len(spans))
	}
	s := spans[0]
	if s.Service != "switchyard" || s.Name != "POST /v1/completions" || s.Attrs[AttrRequestID] != "req-otlp" || s.Kind != 2 {
		t.Fatalf("exported span %+v", s)
	}
}
