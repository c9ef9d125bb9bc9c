package e2e

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/switchyard-llm/switchyard/internal/tracing/otlptest"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// prefillBase makes every simulated prefill take at least this long, so
// the phase histograms and spans show where it sits relative to the KV wait.
const prefillBase = 150 * time.Millisecond

// scrape fetches and parses the router's /metrics.
func scrape(t *testing.T, url string) (map[string]*dto.MetricFamily, []byte) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(bytes.NewReader(raw))
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return mfs, raw
}

// hist returns the sample count and sum of the histogram series of family
// name whose labels include want.
func hist(mfs map[string]*dto.MetricFamily, name string, want map[string]string) (count uint64, sum float64) {
	mf := mfs[name]
	if mf == nil {
		return 0, 0
	}
	for _, m := range mf.GetMetric() {
		if !hasLabels(m, want) {
			continue
		}
		count += m.GetHistogram().GetSampleCount()
		sum += m.GetHistogram().GetSampleSum()
	}
	return count, sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := want[l.GetName()]; ok {
			if v != l.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(want)
}

// promtoolCheck lints a live exposition with promtool (Debian package
// prometheus), when it is installed.
func promtoolCheck(t *testing.T, raw []byte) {
	t.Helper()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Log("promtool not installed: skipping the metrics lint (apt-get install prometheus)")
		return
	}
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = bytes.NewReader(raw)
	if out, err := cmd.CombinedOutput(); err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Fatalf("promtool check metrics on a live scrape: %v\n%s", err, out)
	}
}

// startPhaseFleet is a MoRI-IO 1P1D fleet in transfer mode `mode`, with
// slow prefills, behind a router that exports traces to col.
func startPhaseFleet(t *testing.T, mode string, col *otlptest.Collector) *fleet {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	f := &fleet{r: startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "moriio", "--vllm-discovery-address", addr,
		"--policy", "round_robin", "--discovery-ttl-secs", "1.5", "--route-receipt", "--log-level", "debug",
		"--enable-trace", "--otlp-traces-endpoint", col.Addr(), "--otel-sampling-ratio", "1")}
	simArgs := []string{"--kv-connector", "moriio", "--transfer-mode", mode, "--proxy-address", addr,
		"--heartbeat-interval", "200ms", "--prefill-base", prefillBase.String()}
	f.p = append(f.p, startSim(t, append([]string{"--role", "prefill"}, simArgs...)...))
	f.d = append(f.d, startSim(t, append([]string{"--role", "decode"}, simArgs...)...))
	f.r.WaitReady(t, 5*time.Second)
	return f
}

// TestObservabilityPDPhases drives READ and WRITE traffic through a
// simulated MoRI-IO fleet and checks what an operator would look at:
//   - the phase histograms (prefill, KV wait, decode) count every request
//     under the right connector/mode labels;
//   - WRITE (concurrent): the decode is sent with or before the prefill,
//     so the KV wait covers the prefill (kv_wait ≈ prefill + transfer);
//   - READ (sequential): the decode is sent after the prefill completed,
//     so the KV wait excludes it;
//   - the exported traces show the same thing (decode span start vs
//     prefill span end), continue the client's trace, and are flushed
//     when the router shuts down;
//   - the route receipt debug line names the pair; promtool accepts the
//     live exposition.
func TestObservabilityPDPhases(t *testing.T) {
	const n = 4
	for _, tc := range []struct {
		mode, order string
	}{{"WRITE", "concurrent"}, {"READ", "sequential"}} {
		t.Run(tc.mode, func(t *testing.T) {
			col, err := otlptest.Start()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(col.Stop)
			f := startPhaseFleet(t, tc.mode, col)
			labels := map[string]string{"connector": "moriio", "mode": tc.order}

			before, _ := scrape(t, f.r.Metrics)
			ctx := ctxT(t, 60*time.Second)
			const clientTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
			for i := range n {
				body := fmt.Sprintf(`{"model":"sim-model","prompt":"request %d: tell me about routers","max_tokens":8,"stream":true,"ignore_eos":true}`, i)
				code, _, b := post(t, ctx, f.r.Base+"/v1/completions", body,
					"traceparent", fmt.Sprintf("00-%s-%016x-01", clientTrace, i+1))
				if code != 200 {
					t.Fatalf("request %d: %d %s", i, code, b)
				}
				harness.SSEText(t, b)
			}
			after, raw := scrape(t, f.r.Metrics)

			delta := func(name string) (uint64, float64) {
				c0, s0 := hist(before, name, labels)
				c1, s1 := hist(after, name, labels)
				return c1 - c0, s1 - s0
			}
			pc, ps := delta("vllm_router_pd_prefill_duration_seconds")
			kc, ks := delta("vllm_router_pd_kv_wait_seconds")
			dc, ds := delta("vllm_router_pd_decode_duration_seconds")
			t.Logf("%s: prefill n=%d mean=%.1fms, kv_wait n=%d mean=%.1fms, decode n=%d mean=%.1fms", tc.mode,
				pc, 1000*ps/float64(pc), kc, 1000*ks/float64(kc), dc, 1000*ds/float64(dc))
			if pc != n || kc != n || dc != n {
				t.Fatalf("phase histogram counts moved by prefill %d, kv_wait %d, decode %d; want %d each", pc, kc, dc, n)
			}
			pMean, kMean := ps/n, ks/n
			if pMean < 0.9*prefillBase.Seconds() {
				t.Fatalf("prefill mean %.3fs is below the simulated %s", pMean, prefillBase)
			}
			switch tc.order {
			case "concurrent":
				// D waits for the KV the whole time P computes it (P's
				// response may reach the router a hair after D's first
				// byte, hence the margin).
				if kMean < 0.9*prefillBase.Seconds() || kMean < 0.8*pMean {
					t.Fatalf("WRITE: kv_wait mean %.3fs vs prefill mean %.3fs: the KV wait should include the prefill", kMean, pMean)
				}
			case "sequential":
				// D is only sent once P is done: its wait is transfer + first step.
				if kMean > pMean/2 {
					t.Fatalf("READ: kv_wait mean %.3fs is not well below prefill mean %.3fs: it should exclude the prefill", kMean, pMean)
				}
			}
			if c, _ := hist(after, "vllm_router_ttft_seconds", map[string]string{"mode": "pd"}); c < n {
				t.Fatalf("router TTFT histogram counted %d streamed PD requests, want >= %d", c, n)
			}
			promtoolCheck(t, raw)
			if logs := f.r.Logs.String(); strings.Count(logs, `msg="route receipt"`) < n || !strings.Contains(logs, "decode="+f.d[0].URL()) {
				t.Fatalf("route receipt debug lines missing from the router log:\n%s", harness.Tail(logs, 2000))
			}

			// SIGTERM: the router drains and must flush its spans before exiting.
			f.r.Stop()
			checkPDTraces(t, col.Spans(), n, clientTrace, tc.order)
		})
	}
}

// checkPDTraces checks n PD traces: server span continuing the client's
// trace, with a prefill and a decode child whose timing follows the order.
func checkPDTraces(t *testing.T, spans []otlptest.Span, n int, clientTrace, order string) {
	t.Helper()
	servers := map[string]otlptest.Span{} // span id → server span
	warmups := map[string]otlptest.Span{} // span id → the router's pair warm-up
	for _, s := range spans {
		if s.Kind == 2 && s.Name == "POST /v1/completions" {
			servers[s.SpanID] = s
		}
		if s.Kind == 1 && s.Name == "pd warm-up" {
			warmups[s.SpanID] = s
		}
	}
	if len(servers) != n {
		t.Fatalf("%d server spans exported (of %d spans), want %d", len(servers), len(spans), n)
	}
	if len(warmups) > 1 {
		t.Fatalf("%d warm-up spans for one pair", len(warmups))
	}
	legs := map[string]map[string]otlptest.Span{} // server span id → phase → leg
	warmLegs := 0
	for _, s := range spans {
		if s.Kind != 3 {
			continue
		}
		if w, ok := warmups[s.ParentID]; ok && s.TraceID == w.TraceID {
			warmLegs++
			continue
		}
		srv, ok := servers[s.ParentID]
		if !ok || s.TraceID != srv.TraceID {
			t.Fatalf("client span %q has no server parent", s.Name)
		}
		if legs[s.ParentID] == nil {
			legs[s.ParentID] = map[string]otlptest.Span{}
		}
		legs[s.ParentID][s.Attrs["vllm.request_phase"]] = s
	}
	if warmLegs != 2*len(warmups) {
		t.Fatalf("%d leg spans under %d warm-up span(s), want a prefill and a decode each", warmLegs, len(warmups))
	}
	for id, srv := range servers {
		if srv.TraceID != clientTrace || srv.Service != "switchyard" || srv.Attrs["http.response.status_code"] != "200" {
			t.Fatalf("server span %+v", srv)
		}
		p, d := legs[id]["prefill"], legs[id]["decode"]
		if p.SpanID == "" || d.SpanID == "" {
			t.Fatalf("server span %s lacks a prefill or decode child: %v", id, legs[id])
		}
		for _, leg := range []otlptest.Span{p, d} {
			if leg.Attrs["vllm.kv_connector"] != "moriio" || leg.Attrs["vllm.pd_order"] != order ||
				leg.Attrs["vllm.transfer_id"] == "" || leg.Attrs["vllm.transfer_mode"] == "" || leg.Attrs["vllm.worker"] == "" {
				t.Fatalf("leg span attributes %v", leg.Attrs)
			}
		}
		if len(d.Events) == 0 || d.Events[0] != "first_byte" {
			t.Fatalf("decode span events %v", d.Events)
		}
		switch order {
		case "concurrent":
			if !d.Start.Before(p.End) {
				t.Fatalf("WRITE: decode sent %v after the prefill completed; it must be sent before", d.Start.Sub(p.End))
			}
		case "sequential":
			if d.Start.Before(p.End) {
				t.Fatalf("READ: decode sent %v before the prefill completed", p.End.Sub(d.Start))
			}
		}
	}
}

// TestObservabilityRegularTrace: in regular mode with --enable-trace each
// request gives a server span continuing the client's trace and one
// "inference" client span per upstream attempt; excluded probe paths give
// none; the spans are flushed on shutdown.
func TestObservabilityRegularTrace(t *testing.T) {
	col, err := otlptest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(col.Stop)
	w := startSim(t, "--role", "unified")
	r := startRouter(t, "--worker-urls", w.URL(), "--policy", "round_robin", "--enable-trace", "--otlp-traces-endpoint", col.Addr())
	r.WaitReady(t, 5*time.Second)
	ctx := ctxT(t, 30*time.Second)
	const clientTrace = "0af7651916cd43dd8448eb211c80319c"
	code, _, b := post(t, ctx, r.Base+"/v1/chat/completions",
		`{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`,
		"traceparent", "00-"+clientTrace+"-b7ad6b7169203331-01")
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	for _, p := range []string{"/health", "/liveness", "/readiness"} {
		resp, err := http.Get(r.Base + p)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	r.Stop()
	spans := col.Spans()
	var srv, cli otlptest.Span
	for _, s := range spans {
		switch s.Kind {
		case 2:
			if srv.SpanID != "" {
				t.Fatalf("more than one server span: %+v", spans)
			}
			srv = s
		case 3:
			cli = s
		}
	}
	if srv.Name != "POST /v1/chat/completions" || srv.TraceID != clientTrace || srv.ParentID != "b7ad6b7169203331" {
		t.Fatalf("server span %+v", srv)
	}
	if cli.ParentID != srv.SpanID || cli.Attrs["vllm.request_phase"] != "inference" || cli.Attrs["vllm.worker"] != w.URL() ||
		cli.Attrs["http.response.status_code"] != "200" {
		t.Fatalf("client span %+v", cli)
	}
}
