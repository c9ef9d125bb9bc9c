package server

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/tracing"
)

// lockedBuffer is a log sink safe for concurrent handlers.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// lines returns the JSON log records with msg == msg.
func (l *lockedBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, ln := range strings.Split(strings.TrimSpace(l.b.String()), "\n") {
		if ln == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(ln), &m); err != nil {
			t.Fatalf("bad log line %q: %v", ln, err)
		}
		if m["msg"] == msg {
			out = append(out, m)
		}
	}
	return out
}

func TestRouteReceiptDebugLog(t *testing.T) {
	for _, tc := range []struct {
		level slog.Level
		want  int
	}{{slog.LevelDebug, 1}, {slog.LevelInfo, 0}} {
		t.Run(tc.level.String(), func(t *testing.T) {
			var buf lockedBuffer
			log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: tc.level}))
			e := newEnv(t, func(o *Options) { o.Logger = log; o.Mode = ModePD })
			e.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
				rc := c.Receipt
				rc.Policy, rc.Prefill, rc.Decode = "random/round_robin", "http://p2:8000", "http://d1:8000"
				rc.Reason, rc.Attempts = "prefill: random; decode: next in turn", 2
				rc.Failovers = []string{"prefill http://p1:8000: connect"}
				writeJSON(w, 200, map[string]any{"ok": true})
			}
			if r := e.do("POST", "/v1/completions", `{"prompt":"x"}`, "X-Request-Id", "rid-1"); r.status != 200 {
				t.Fatalf("status %d", r.status)
			}
			got := buf.lines(t, "route receipt")
			if len(got) != tc.want {
				t.Fatalf("%d route receipt lines at %v, want %d", len(got), tc.level, tc.want)
			}
			if tc.want == 0 {
				return
			}
			l := got[0]
			for k, want := range map[string]any{
				"request_id": "rid-1", "mode": "pd", "policy": "random/round_robin", "prefill": "http://p2:8000",
				"decode": "http://d1:8000", "reason": "prefill: random; decode: next in turn", "attempts": 2.0,
				"failovers": 1.0, "route": "/v1/completions", "status": 200.0,
			} {
				if l[k] != want {
					t.Errorf("%s = %v, want %v", k, l[k], want)
				}
			}
			if f, _ := l["failed"].([]any); len(f) != 1 || f[0] != "prefill http://p1:8000: connect" {
				t.Errorf("failed = %v", l["failed"])
			}
		})
	}
}

func TestServerSpans(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tr, err := tracing.NewWithExporter(tracing.Config{SamplingRatio: 1}, exp)
	if err != nil {
		t.Fatal(err)
	}
	var buf lockedBuffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	e := newEnv(t, func(o *Options) { o.Tracer = tr; o.Logger = log })
	e.add("http://w1:8000", 0, -1, 1)
	e.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
		e.s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", "no workers")
	}
	if r := e.do("POST", "/v1/completions", `{"prompt":"x"}`, "X-Request-Id", "rid-2"); r.status != 503 {
		t.Fatalf("status %d", r.status)
	}
	e.do("GET", "/health", "")
	e.do("GET", "/liveness", "")
	spans := exp.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want one (probes are excluded)", len(spans))
	}
	sp := spans[0]
	a := map[string]string{}
	for _, kv := range sp.Attributes {
		a[string(kv.Key)] = kv.Value.Emit()
	}
	if sp.Name != "POST /v1/completions" || a["http.response.status_code"] != "503" || a["request_id"] != "rid-2" ||
		a["error.type"] != "no_available_workers" || sp.Status.Code.String() != "Error" {
		t.Fatalf("span %q status %v attrs %v", sp.Name, sp.Status, a)
	}
	reqs := buf.lines(t, "request")
	var logged bool
	for _, l := range reqs {
		if l["request_id"] == "rid-2" {
			logged = l["trace_id"] == sp.SpanContext.TraceID().String()
		}
	}
	if !logged {
		t.Fatalf("access log line lacks the trace id %s: %v", sp.SpanContext.TraceID(), reqs)
	}
}

// TestTracingOffAddsNoAllocations: with tracing off the request chain
// allocates less than with tracing on even for a sampled-out request: no
// span work runs at all. (The chain did 31 allocs/op before tracing
// existed and still does with it off; tracing.TestDisabledIsFree shows the
// disabled hooks allocate nothing.)
func TestTracingOffAddsNoAllocations(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	count := func(tr *tracing.Tracer) float64 {
		s := benchServer(t, func(o *Options) { o.Tracer = tr })
		body, req := newBenchRequest(t)
		req.Header.Del("Traceparent")
		w := &nopWriter{h: http.Header{}}
		return testing.AllocsPerRun(200, func() { runGenerate(s, body, w, req) })
	}
	off := count(nil)
	tr, err := tracing.NewWithExporter(tracing.Config{SamplingRatio: 0}, discardExporter{})
	if err != nil {
		t.Fatal(err)
	}
	sampledOut := count(tr)
	t.Logf("allocs per request: tracing off %v, on but sampled out %v", off, sampledOut)
	if off >= sampledOut {
		t.Errorf("tracing off (%v allocs) is not cheaper than sampled-out tracing (%v)", off, sampledOut)
	}
}
