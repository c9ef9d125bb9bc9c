package tracing_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/pd"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/server"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

const (
	clientTrace   = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientParent  = "00-" + clientTrace + "-00f067aa0ba902b7-01"
	clientState   = "vendor=opaque"
	clientBaggage = "tenant=acme"
)

// fakeWorker answers like a vLLM prefill (JSON with kv_transfer_params) or
// decode/regular worker (an SSE stream) and records the trace headers.
type fakeWorker struct {
	*httptest.Server
	mu  sync.Mutex
	hdr []http.Header
}

func newFakeWorker(t *testing.T, prefill bool) *fakeWorker {
	t.Helper()
	f := &fakeWorker{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		f.mu.Lock()
		f.hdr = append(f.hdr, r.Header.Clone())
		f.mu.Unlock()
		if prefill {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"cmpl-p","choices":[{"index":0,"text":"a","finish_reason":"length"}],`+
				`"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_host":"127.0.0.1","remote_port":5600}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for _, tok := range []string{"hello", " world"} {
			_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"`+tok+`"}]}`+"\n\n")
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}))
	t.Cleanup(f.Close)
	return f
}

func (f *fakeWorker) headers(t *testing.T) http.Header {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.hdr) != 1 {
		t.Fatalf("%s received %d requests, want 1", f.URL, len(f.hdr))
	}
	return f.hdr[0]
}

type routerEnv struct {
	url  string
	p, d *fakeWorker // PD mode
	w    *fakeWorker // regular mode
}

func newRouter(t *testing.T, mode string, tr *tracing.Tracer) *routerEnv {
	t.Helper()
	reg := worker.NewRegistry(worker.BreakerConfig{})
	base := proxy.NewTransport(proxy.TransportOptions{})
	t.Cleanup(base.CloseIdleConnections)
	client := &http.Client{Transport: base}
	rr := func() policy.Policy {
		p, err := policy.New(policy.NameRoundRobin, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	m := metrics.NewForTest()
	env := &routerEnv{}
	so := server.Options{Registry: reg, Upstream: client, Tracer: tr, Metrics: m}
	if mode == server.ModePD {
		env.p, env.d = newFakeWorker(t, true), newFakeWorker(t, false)
		if _, err := reg.Add(worker.Spec{URL: env.p.URL, Role: worker.RolePrefill, DPRank: -1},
			worker.Spec{URL: env.d.URL, Role: worker.RoleDecode, DPRank: -1}); err != nil {
			t.Fatal(err)
		}
		eng, err := pd.New(pd.Options{Registry: reg, PrefillPolicy: rr(), DecodePolicy: rr(), Connector: pd.ConnectorNIXL,
			Client: client, Tracer: tr, Metrics: m})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(eng.Close)
		so.Mode, so.Generate = server.ModePD, eng
	} else {
		env.w = newFakeWorker(t, false)
		if _, err := reg.Add(worker.Spec{URL: env.w.URL, Role: worker.RoleRegular, DPRank: -1}); err != nil {
			t.Fatal(err)
		}
		// what app.proxyClient does
		rt := tr.Transport(base, tracing.TransportOptions{Route: func(r *http.Request) string {
			if c := proxy.CallFrom(r.Context()); c != nil {
				return c.Route
			}
			return ""
		}})
		disp := proxy.NewRegular(proxy.RegularOptions{Registry: reg, Role: worker.RoleRegular, Policy: rr(),
			Client: &http.Client{Transport: rt}, Metrics: m})
		so.Mode, so.Generate, so.Passthrough = server.ModeRegular, disp, http.HandlerFunc(disp.ServePassthrough)
	}
	s, err := server.New(so)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.Handler())
	t.Cleanup(srv.Close)
	env.url = srv.URL
	return env
}

func (e *routerEnv) complete(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	body := `{"model":"m","prompt":"hi","max_tokens":2,"stream":true}`
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Traceparent", clientParent)
	req.Header.Set("Tracestate", clientState)
	req.Header.Set("Baggage", clientBaggage)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), "world") {
		t.Fatalf("status %d body %s", resp.StatusCode, b)
	}
}

func spanAttrs(s tracetest.SpanStub) map[string]attribute.Value {
	m := map[string]attribute.Value{}
	for _, kv := range s.Attributes {
		m[string(kv.Key)] = kv.Value
	}
	return m
}

// waitSpans waits for n ended spans: the server span ends in the
// middleware after the handler returned, which may be just after the
// client read the last byte.
func waitSpans(t *testing.T, exp *tracetest.InMemoryExporter, n int) tracetest.SpanStubs {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		spans := exp.GetSpans()
		if len(spans) >= n || time.Now().After(deadline) {
			if len(spans) != n {
				for _, s := range spans {
					t.Logf("span %q kind %v", s.Name, s.SpanKind)
				}
				t.Fatalf("%d spans, want %d", len(spans), n)
			}
			return spans
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// traceparentOf is the header value a worker must receive for span s.
func traceparentOf(s tracetest.SpanStub) string {
	return "00-" + s.SpanContext.TraceID().String() + "-" + s.SpanContext.SpanID().String() + "-01"
}

// TestPDSpanTree: one PD request gives a server span (child of the
// client's traceparent) with a prefill and a decode client span under it;
// each worker receives its own leg span as parent, with the client's
// tracestate and baggage.
func TestPDSpanTree(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tr, err := tracing.NewWithExporter(tracing.Config{SamplingRatio: 1}, exp)
	if err != nil {
		t.Fatal(err)
	}
	env := newRouter(t, server.ModePD, tr)
	env.complete(t)
	spans := waitSpans(t, exp, 3)

	byPhase := map[string]tracetest.SpanStub{}
	var srv tracetest.SpanStub
	for _, s := range spans {
		if s.SpanKind == trace.SpanKindServer {
			srv = s
			continue
		}
		byPhase[spanAttrs(s)[tracing.AttrPhase].AsString()] = s
	}
	if srv.Name != "POST /v1/completions" || srv.Parent.TraceID().String() != clientTrace || srv.Parent.SpanID().String() != "00f067aa0ba902b7" {
		t.Fatalf("server span %q parent %v", srv.Name, srv.Parent)
	}
	if got := spanAttrs(srv)["http.response.status_code"].AsInt64(); got != 200 {
		t.Fatalf("server span status %d", got)
	}
	for phase, w := range map[string]*fakeWorker{tracing.PhasePrefill: env.p, tracing.PhaseDecode: env.d} {
		s, ok := byPhase[phase]
		if !ok {
			t.Fatalf("no %s span among %v", phase, spans)
		}
		if s.SpanKind != trace.SpanKindClient || s.Parent.SpanID() != srv.SpanContext.SpanID() || s.SpanContext.TraceID() != srv.SpanContext.TraceID() {
			t.Fatalf("%s span is not a client child of the server span: kind %v parent %s", phase, s.SpanKind, s.Parent.SpanID())
		}
		a := spanAttrs(s)
		for k, want := range map[string]string{
			tracing.AttrWorker: w.URL, tracing.AttrConnector: "nixl", tracing.AttrOrder: "sequential",
			"url.full": w.URL + "/v1/completions", "http.route": "/v1/completions",
		} {
			if got := a[k].Emit(); got != want {
				t.Errorf("%s span %s = %q, want %q", phase, k, got, want)
			}
		}
		if a[tracing.AttrAttempt].AsInt64() != 1 || a["http.response.status_code"].AsInt64() != 200 || a[tracing.AttrPDRequestID].AsString() == "" {
			t.Errorf("%s span attrs %v", phase, a)
		}
		h := w.headers(t)
		if got, want := h.Get("Traceparent"), traceparentOf(s); got != want {
			t.Errorf("%s worker got traceparent %q, want its leg span %q", phase, got, want)
		}
		if h.Get("Tracestate") != clientState || h.Get("Baggage") != clientBaggage {
			t.Errorf("%s worker got tracestate %q baggage %q", phase, h.Get("Tracestate"), h.Get("Baggage"))
		}
	}
	p, d := byPhase[tracing.PhasePrefill], byPhase[tracing.PhaseDecode]
	if spanAttrs(p)[tracing.AttrPDRequestID] != spanAttrs(d)[tracing.AttrPDRequestID] {
		t.Error("legs carry different PD request ids")
	}
	if len(d.Events) != 1 || d.Events[0].Name != tracing.EventFirstByte {
		t.Errorf("decode span events %v, want first_byte", d.Events)
	}
	if d.StartTime.Before(p.EndTime) {
		t.Errorf("sequential (NIXL) decode span started %v before the prefill span ended", p.EndTime.Sub(d.StartTime))
	}
}

// TestRegularSpanTree: server span → one "inference" client span, whose
// context reaches the worker.
func TestRegularSpanTree(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tr, err := tracing.NewWithExporter(tracing.Config{SamplingRatio: 1}, exp)
	if err != nil {
		t.Fatal(err)
	}
	env := newRouter(t, server.ModeRegular, tr)
	env.complete(t)
	spans := waitSpans(t, exp, 2)
	c, s := spans[0], spans[1]
	if c.SpanKind != trace.SpanKindClient || s.SpanKind != trace.SpanKindServer || c.Parent.SpanID() != s.SpanContext.SpanID() {
		t.Fatalf("spans %q (%v) %q (%v): client parent %s", c.Name, c.SpanKind, s.Name, s.SpanKind, c.Parent.SpanID())
	}
	a := spanAttrs(c)
	if a[tracing.AttrPhase].AsString() != tracing.PhaseInference || a[tracing.AttrWorker].AsString() != env.w.URL || c.Name != "POST /v1/completions" {
		t.Fatalf("client span %q attrs %v", c.Name, a)
	}
	h := env.w.headers(t)
	if got, want := h.Get("Traceparent"), traceparentOf(c); got != want {
		t.Fatalf("worker got traceparent %q, want %q", got, want)
	}
	if h.Get("Baggage") != clientBaggage || h.Get("Tracestate") != clientState {
		t.Fatalf("worker got baggage %q tracestate %q", h.Get("Baggage"), h.Get("Tracestate"))
	}
}

// TestDisabledPassesTraceHeadersVerbatim: with tracing off the client's
// traceparent, tracestate and baggage reach every worker unchanged, on the
// regular path and on both PD legs.
func TestDisabledPassesTraceHeadersVerbatim(t *testing.T) {
	for _, mode := range []string{server.ModeRegular, server.ModePD} {
		t.Run(mode, func(t *testing.T) {
			env := newRouter(t, mode, nil)
			env.complete(t)
			for _, w := range []*fakeWorker{env.w, env.p, env.d} {
				if w == nil {
					continue
				}
				h := w.headers(t)
				if h.Get("Traceparent") != clientParent || h.Get("Tracestate") != clientState || h.Get("Baggage") != clientBaggage {
					t.Errorf("%s got traceparent %q tracestate %q baggage %q", w.URL, h.Get("Traceparent"), h.Get("Tracestate"), h.Get("Baggage"))
				}
			}
		})
	}
}
