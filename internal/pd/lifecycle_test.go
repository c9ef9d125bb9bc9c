package pd

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// cancelled records when a handler's request context ended.
func blockUntilCancelled(ch chan<- time.Time) func(http.ResponseWriter, *http.Request, *recorded) {
	return func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		<-r.Context().Done()
		ch <- time.Now()
	}
}

func TestSequentialDecodeNeverCalledOnPrefillFailure(t *testing.T) {
	cases := []struct {
		name, connector, mode string
		handler               func(http.ResponseWriter, *http.Request, *recorded)
		status                int
		msg                   string
	}{
		{"read-500", "moriio", "READ", func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 500, `{"error":"boom"}`) }, 502, "returned HTTP 500"},
		{"read-null-params", "moriio", "READ", prefillOK("null"), 502, "kv_transfer_params is null"},
		{"read-no-block-ids", "moriio", "READ", prefillOK(`{"remote_engine_id":"e"}`), 502, "remote_block_ids"},
		{"read-not-json", "moriio", "READ", func(w http.ResponseWriter, r *http.Request, _ *recorded) {
			w.Header().Set("Content-Type", "text/html")
			w.WriteHeader(200)
			_, _ = w.Write([]byte("<html>oops</html>"))
		}, 502, "not a JSON object"},
		{"nixl-null-params", "nixl", "", prefillOK("null"), 502, "kv_transfer_params is null"},
		{"nixl-400", "nixl", "", func(w http.ResponseWriter, r *http.Request, _ *recorded) {
			writeJSON(w, 400, `{"error":{"message":"prompt too long","code":400}}`)
		}, 400, "prompt too long"},
		{"p2p-503", "p2pnccl", "", func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 503, `{}`) }, 502, "HTTP 503"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			P := newFake(t, tc.handler)
			D := newFake(t, decodeSSE)
			reg := worker.NewRegistry(worker.BreakerConfig{})
			var po, do []specOpt
			if tc.mode != "" {
				po = append(po, zmqAddr4(pZMQ, tc.mode))
				do = append(do, zmqAddr4(dZMQ, tc.mode))
			}
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill, po...)
			addWorker(t, reg, D.URL(), worker.RoleDecode, do...)
			m := metrics.NewForTest()
			h := newHarness(t, reg, Options{Connector: tc.connector, MaxFailovers: 2, Metrics: m})
			res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
			if res.status != tc.status || !strings.Contains(res.body, tc.msg) {
				t.Fatalf("status %d body %s; want %d containing %q", res.status, res.body, tc.status, tc.msg)
			}
			D.none(t)
			if !strings.Contains(res.body, `"error"`) {
				t.Fatalf("not an OpenAI error body: %s", res.body)
			}
			waitIdle(t, pw)
		})
	}
}

func TestWriteDecodeCancelledWhenPrefillFails(t *testing.T) {
	for _, pw := range prefillWaits {
		t.Run(pw.name, func(t *testing.T) { testWriteDecodeCancelledWhenPrefillFails(t, pw.client(t)) })
	}
}

func testWriteDecodeCancelledWhenPrefillFails(t *testing.T, client *http.Client) {
	dCancel := make(chan time.Time, 1)
	dGot := make(chan struct{})
	pFail := make(chan time.Time, 1)
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		close(dGot)
		startSSE(w) // vLLM sends 200 headers before any token exists
		<-r.Context().Done()
		dCancel <- time.Now()
	})
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		<-dGot
		time.Sleep(20 * time.Millisecond)
		pFail <- time.Now()
		writeJSON(w, 500, `{"error":"prefill crashed"}`)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	m := metrics.NewForTest()
	h := newHarness(t, reg, Options{Connector: "moriio", Metrics: m, Client: client})

	start := time.Now()
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 502 || !strings.Contains(res.body, "prefill worker") {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	tf := <-pFail
	tc := waitDone(t, dCancel, 2*time.Second, "decode cancellation")
	if d := tc.Sub(tf); d > 100*time.Millisecond {
		t.Fatalf("decode cancelled %v after the prefill failed (want < 100ms)", d)
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("client waited %v", d)
	}
	waitIdle(t, pw, dw)
	if v := counter(t, m.PDPrefillErrors.WithLabelValues(pw.Key())); v != 1 {
		t.Fatalf("prefill errors %v", v)
	}
	if v := counter(t, m.PDDecodeErrors.WithLabelValues(dw.Key())); v != 0 {
		t.Fatalf("decode errors %v (the decode was cancelled, not failed)", v)
	}
}

func counter(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Counter != nil {
		return m.Counter.GetValue()
	}
	return float64(m.Histogram.GetSampleCount())
}

func TestClientDisconnectCancelsBothLegs(t *testing.T) {
	for _, mode := range []string{"WRITE", "READ"} {
		t.Run(mode, func(t *testing.T) {
			pCancel := make(chan time.Time, 1)
			dCancel := make(chan time.Time, 1)
			dGot := make(chan struct{}, 1)
			pGot := make(chan struct{}, 1)
			P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				pGot <- struct{}{}
				if mode == "READ" {
					prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)(w, r, rec)
					return
				}
				blockUntilCancelled(pCancel)(w, r, rec)
			})
			D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				dGot <- struct{}{}
				startSSE(w)
				_, _ = w.Write([]byte(sseEvents[0]))
				_ = http.NewResponseController(w).Flush()
				blockUntilCancelled(dCancel)(w, r, rec)
			})
			reg := worker.NewRegistry(worker.BreakerConfig{})
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, mode))
			dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, mode))
			h := newHarness(t, reg, Options{Connector: "moriio"})

			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan result, 1)
			go func() { done <- h.postCtx(ctx, t, "/v1/completions", `{"prompt":"p","stream":true}`) }()
			waitDone(t, pGot, 2*time.Second, "prefill")
			waitDone(t, dGot, 2*time.Second, "decode")
			time.Sleep(20 * time.Millisecond)
			t0 := time.Now()
			cancel()
			td := waitDone(t, dCancel, 2*time.Second, "decode cancellation")
			if d := td.Sub(t0); d > 100*time.Millisecond {
				t.Fatalf("decode cancelled %v after the client left", d)
			}
			if mode == "WRITE" {
				tp := waitDone(t, pCancel, 2*time.Second, "prefill cancellation")
				if d := tp.Sub(t0); d > 100*time.Millisecond {
					t.Fatalf("prefill cancelled %v after the client left", d)
				}
			}
			<-done
			waitIdle(t, pw, dw)
		})
	}
}

func TestKVWaitTimeout(t *testing.T) {
	t.Run("before-commit", func(t *testing.T) {
		// P hangs, D sends headers but never a token: 504, nothing committed, both cancelled.
		pCancel := make(chan time.Time, 1)
		dCancel := make(chan time.Time, 1)
		P := newFake(t, blockUntilCancelled(pCancel))
		D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
			startSSE(w)
			blockUntilCancelled(dCancel)(w, r, rec)
		})
		reg := worker.NewRegistry(worker.BreakerConfig{})
		pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
		dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
		m := metrics.NewForTest()
		h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 150 * time.Millisecond, Metrics: m})
		start := time.Now()
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		el := time.Since(start)
		if res.status != 504 || !strings.Contains(res.body, "produced no output within") {
			t.Fatalf("status %d body %s", res.status, res.body)
		}
		if el < 150*time.Millisecond || el > 3*time.Second {
			t.Fatalf("answered after %v", el)
		}
		waitDone(t, pCancel, time.Second, "prefill cancellation")
		waitDone(t, dCancel, time.Second, "decode cancellation")
		waitIdle(t, pw, dw)
		if v := counter(t, m.PDLegErrors.WithLabelValues("decode", "kv_wait_timeout")); v != 1 {
			t.Fatalf("kv_wait_timeout leg errors %v", v)
		}
	})
	t.Run("after-prefill-ok", func(t *testing.T) {
		// P finished OK, D sent its headers but never a token: nothing was
		// committed (headers wait for D's first byte), so the client gets a
		// 504, not a 200 stream with an error event. The timeout is the
		// pair's: D's breaker records nothing.
		dCancel := make(chan time.Time, 1)
		P := newFake(t, prefillOK(`{"ok":true}`))
		D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
			startSSE(w)
			blockUntilCancelled(dCancel)(w, r, rec)
		})
		reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 1})
		pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
		dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
		m := metrics.NewForTest()
		h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 150 * time.Millisecond, Metrics: m})
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 504 || !strings.Contains(res.body, "produced no output within") || strings.Contains(res.body, "data:") {
			t.Fatalf("status %d body %q", res.status, res.body)
		}
		waitDone(t, dCancel, time.Second, "decode cancellation")
		waitIdle(t, pw, dw)
		if pw.Breaker().State() != worker.BreakerClosed || dw.Breaker().State() != worker.BreakerClosed {
			t.Fatalf("a single pair's KV-wait timeout opened a breaker (P %v, D %v)", pw.Breaker().State(), dw.Breaker().State())
		}
		for _, w := range []*worker.Worker{pw, dw} {
			if v := counter(t, m.CBOutcomes.WithLabelValues(w.Key(), "failure")); v != 0 {
				t.Fatalf("%s: %v breaker failures", w.Key(), v)
			}
		}
		if v := counter(t, m.PDLegErrors.WithLabelValues("decode", "kv_wait_timeout")); v != 1 {
			t.Fatalf("kv_wait_timeout leg errors %v", v)
		}
	})
	t.Run("after-prefill-ok-fails-over", func(t *testing.T) {
		// the same stuck decode with a failover budget: the request moves
		// to a pair sharing no worker with the failed one, and the client
		// sees one clean stream
		dCancel := make(chan time.Time, 1)
		P1 := newFake(t, prefillOK(`{"ok":true}`))
		P2 := newFake(t, prefillOK(`{"ok":true}`))
		D1 := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
			startSSE(w)
			blockUntilCancelled(dCancel)(w, r, rec)
		})
		D2 := newFake(t, decodeSSE)
		reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 1})
		p1 := addWorker(t, reg, P1.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
		p2 := addWorker(t, reg, P2.URL(), worker.RolePrefill, zmqAddr4("host:127.0.0.4,handshake:6303,notify:61007", "WRITE"))
		d1 := addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
		d2 := addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4("host:127.0.0.3,handshake:6301,notify:61005", "WRITE"))
		h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: time.Second, MaxFailovers: 1,
			PrefillPolicy: &prefer{urls: []string{P1.URL()}}, DecodePolicy: &prefer{urls: []string{D1.URL()}}})
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 200 || res.body != sseAll() {
			t.Fatalf("status %d body %q", res.status, res.body)
		}
		waitDone(t, dCancel, time.Second, "stuck decode cancellation")
		rc := h.last.Load().Receipt
		if rc.Attempts != 2 || len(rc.Failovers) != 1 || rc.Failovers[0] != "pair "+p1.Key()+"+"+d1.Key()+": kv_wait_timeout" ||
			rc.Prefill != p2.Key() || rc.Decode != d2.Key() {
			t.Fatalf("receipt %+v", rc)
		}
		waitIdle(t, p1, p2, d1, d2)
		if d1.Breaker().State() != worker.BreakerClosed || p1.Breaker().State() != worker.BreakerClosed {
			t.Fatal("the failed pair's workers were charged on their breakers")
		}
	})
}

func TestFailoverOnConnectRefused(t *testing.T) {
	for _, tc := range []struct{ name, connector, mode string }{{"nixl", "nixl", ""}, {"moriio-write", "moriio", "WRITE"}} {
		t.Run(tc.name, func(t *testing.T) {
			dead := deadURL(t)
			g := newKVGate()
			P := newFake(t, g.prefill(prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)))
			D := newFake(t, g.decode)
			reg := worker.NewRegistry(worker.BreakerConfig{})
			var o []specOpt
			if tc.mode != "" {
				o = append(o, zmqAddr4(pZMQ, tc.mode))
			}
			deadW := addWorker(t, reg, dead, worker.RolePrefill, o...)
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill, o...)
			var do []specOpt
			if tc.mode != "" {
				do = append(do, zmqAddr4(dZMQ, tc.mode))
			}
			dw := addWorker(t, reg, D.URL(), worker.RoleDecode, do...)
			m := metrics.NewForTest()
			h := newHarness(t, reg, Options{Connector: tc.connector, MaxFailovers: 2, Metrics: m,
				PrefillPolicy: &prefer{urls: []string{dead}}})
			res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
			if res.status != 200 || res.body != sseAll() {
				t.Fatalf("status %d body %q", res.status, res.body)
			}
			rc := h.last.Load().Receipt
			if rc.Attempts != 2 || len(rc.Failovers) != 1 || !strings.Contains(rc.Failovers[0], deadW.Key()) || rc.Prefill != pw.Key() {
				t.Fatalf("receipt %+v", rc)
			}
			if !deadW.Suspect() {
				t.Fatal("unreachable prefill not suspect after a connect failure")
			}
			if v := counter(t, m.PDFailovers.WithLabelValues("connect")); v != 1 {
				t.Fatalf("failovers %v", v)
			}
			// the decode of the failed attempt (WRITE sends it first) was cancelled
			waitIdle(t, deadW, pw, dw)
		})
	}
}

func TestWriteDecodeUnreachableNeverSendsPrefill(t *testing.T) {
	dead := deadURL(t)
	g := newKVGate()
	P := newFake(t, g.prefill(prefillOK(`{}`)))
	D := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	deadW := addWorker(t, reg, dead, worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4("host:127.0.0.3,handshake:1,notify:2", "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", MaxFailovers: 1, DecodePolicy: &prefer{urls: []string{dead}}})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 {
		t.Fatalf("status %d %s", res.status, res.body)
	}
	if n := P.count.Load(); n != 1 {
		t.Fatalf("prefill called %d times; the attempt with the unreachable decode must not send it", n)
	}
	if !deadW.Suspect() {
		t.Fatal("unreachable decode not suspect after a connect failure")
	}
}

func TestDecodeMidStreamFailureYieldsSSEError(t *testing.T) {
	P := newFake(t, prefillOK(`{"k":1}`))
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		_, _ = w.Write([]byte(sseEvents[0] + `data: {"id":"cmpl-1","cho`)) // break mid-event
		_ = http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler) // drop the connection
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	dw := addWorker(t, reg, D.URL(), worker.RoleDecode)
	m := metrics.NewForTest()
	h := newHarness(t, reg, Options{Connector: "nixl", Metrics: m, MaxFailovers: 3})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 {
		t.Fatalf("status %d", res.status)
	}
	if !strings.HasPrefix(res.body, sseEvents[0]) {
		t.Fatalf("first event lost: %q", res.body)
	}
	data := sseData(res.body)
	n := len(data)
	if n < 3 || !strings.Contains(data[n-2], `"error"`) || data[n-1] != "[DONE]" {
		t.Fatalf("no SSE error event at the end: %q", res.body)
	}
	if v := counter(t, m.PDStreamErrors.WithLabelValues(dw.Key())); v != 1 {
		t.Fatalf("stream errors %v", v)
	}
	if D.count.Load() != 1 {
		t.Fatal("failed over after bytes were sent")
	}
}

// badDecodeFleet is a NIXL fleet of one prefill and two decodes where the
// policy prefers the decode served by bad. One streaming request is sent
// with a failover budget of 1; it must succeed on the good decode. It
// returns the harness, the prefill, the registry and the bad decode's
// fake and worker.
func badDecodeFleet(t *testing.T, badH func(http.ResponseWriter, *http.Request, *recorded)) (*harness, *fake, *worker.Registry, *fake, *worker.Worker) {
	t.Helper()
	P := newFake(t, prefillOK(`{"k":1}`))
	bad := newFake(t, badH)
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	bw := addWorker(t, reg, bad.URL(), worker.RoleDecode)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", MaxFailovers: 1, DecodePolicy: &prefer{urls: []string{bad.URL()}}})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	return h, P, reg, bad, bw
}

func TestDecode5xxBeforeBodyFailsOver(t *testing.T) {
	h, P, reg, bad, bw := badDecodeFleet(t, func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 500, `{"error":"oom"}`) })
	if P.count.Load() != 2 {
		t.Fatalf("prefill calls %d, want 2 (a new pair per attempt)", P.count.Load())
	}
	rc := h.last.Load().Receipt
	if rc.Attempts != 2 || !strings.Contains(rc.Failovers[0], bw.Key()) {
		t.Fatalf("receipt %+v", rc)
	}
	// without failover budget the decode's own error is relayed
	h2 := newHarness(t, reg, Options{Connector: "nixl", DecodePolicy: &prefer{urls: []string{bad.URL()}}})
	res := h2.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 500 || res.body != `{"error":"oom"}` {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
}

func TestMixedTransferModesNeverPaired(t *testing.T) {
	var readHits atomic.Int32
	Pr := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		readHits.Add(1)
		prefillOK(`{}`)(w, r, rec)
	})
	g := newKVGate()
	Pw := newFake(t, g.prefill(prefillOK(`{}`)))
	Dw := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, Pr.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "READ"))
	addWorker(t, reg, Dw.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", PrefillPolicy: &prefer{urls: []string{Pr.URL()}}})

	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 503 || !strings.Contains(res.body, "no decode worker compatible with transfer mode READ") {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	if ok, why := h.eng.Ready(); ok || !strings.Contains(why, "compatible") {
		t.Fatalf("Ready %v %q", ok, why)
	}
	addWorker(t, reg, Pw.URL(), worker.RolePrefill, zmqAddr4("host:127.0.0.9,handshake:7,notify:8", "WRITE"))
	for range 5 {
		res = h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 200 {
			t.Fatalf("status %d body %s", res.status, res.body)
		}
	}
	if readHits.Load() != 0 {
		t.Fatal("the READ prefill was paired with a WRITE decode")
	}
	if ok, _ := h.eng.Ready(); !ok {
		t.Fatal("not ready with a WRITE pair")
	}
}

func TestStaticMoRIIOWorkersRejected(t *testing.T) {
	P := newFake(t, prefillOK(`{}`))
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "moriio"})
	res := h.post(t, "/v1/completions", `{"prompt":"p"}`)
	if res.status != 503 || !strings.Contains(res.body, "zmq_address") {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	P.none(t)
	D.none(t)
}

func TestPrefillTimeoutFailsOver(t *testing.T) {
	pCancel := make(chan time.Time, 1)
	slow := newFake(t, blockUntilCancelled(pCancel))
	P := newFake(t, prefillOK(`{"k":1}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	sw := addWorker(t, reg, slow.URL(), worker.RolePrefill)
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", PrefillTimeout: time.Second, MaxFailovers: 1,
		PrefillPolicy: &prefer{urls: []string{slow.URL()}}})
	res := h.post(t, "/v1/completions", `{"prompt":"p"}`)
	if res.status != 200 {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	waitDone(t, pCancel, time.Second, "slow prefill cancellation")
	if !sw.Healthy() {
		t.Fatal("a timeout is not a connect failure: the worker must stay healthy")
	}
	if rc := h.last.Load().Receipt; !strings.Contains(rc.Failovers[0], "timeout") {
		t.Fatalf("receipt %+v", rc)
	}
}

func TestRequestTimeout(t *testing.T) {
	P := newFake(t, prefillOK(`{"k":1}`))
	dCancel := make(chan time.Time, 1)
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		_, _ = w.Write([]byte(sseEvents[0]))
		_ = http.NewResponseController(w).Flush()
		blockUntilCancelled(dCancel)(w, r, rec)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", RequestTimeout: time.Second})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	data := sseData(res.body)
	if res.status != 200 || len(data) != 3 || !strings.Contains(data[1], "timed out") || data[2] != "[DONE]" {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	waitDone(t, dCancel, time.Second, "decode cancellation")
}

func TestStreamIdleTimeout(t *testing.T) {
	P := newFake(t, prefillOK(`{"k":1}`))
	dCancel := make(chan time.Time, 1)
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		_, _ = w.Write([]byte(sseEvents[0]))
		_ = http.NewResponseController(w).Flush()
		blockUntilCancelled(dCancel)(w, r, rec)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", StreamIdleTimeout: time.Second})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	data := sseData(res.body)
	if res.status != 200 || len(data) != 3 || !strings.Contains(data[1], "idle") {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	waitDone(t, dCancel, time.Second, "decode cancellation")
}

// TestWritePrefillAnswerAfterDecodeKeepsConnection: a MoRI-IO WRITE
// prefill that answers only after its decode's stream ended is left to
// answer (not cancelled), so its connection serves the next request: every
// request reaches P over the same connection.
func TestWritePrefillAnswerAfterDecodeKeepsConnection(t *testing.T) {
	for _, pw := range prefillWaits {
		t.Run(pw.name, func(t *testing.T) {
			g := newKVGate()
			release := make(chan struct{}, 1)
			var mu sync.Mutex
			conns := map[string]bool{}
			P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				mu.Lock()
				conns[r.RemoteAddr] = true
				mu.Unlock()
				g.open(r) // D streams its answer
				select {
				case <-release: // the client has the whole answer
				case <-r.Context().Done():
					return
				}
				prefillOK(`{}`)(w, r, rec)
			})
			D := newFake(t, g.decode)
			reg := worker.NewRegistry(worker.BreakerConfig{})
			addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
			addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
			m := metrics.NewForTest()
			h := newHarness(t, reg, Options{Connector: "moriio", Metrics: m, Client: pw.client(t)})
			prefills := m.PDPrefillSeconds.WithLabelValues("moriio", Concurrent.String()).(prometheus.Histogram)
			for i := 1; i <= 4; i++ {
				res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
				if res.status != 200 || res.body != sseAll() {
					t.Fatalf("request %d: status %d body %q", i, res.status, res.body)
				}
				release <- struct{}{}
				deadline := time.Now().Add(5 * time.Second)
				for counter(t, prefills) < float64(i) { // P's answer was read
					if time.Now().After(deadline) {
						t.Fatalf("request %d: the prefill's late answer was never read", i)
					}
					time.Sleep(5 * time.Millisecond)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if len(conns) != 1 {
				t.Fatalf("the prefill was reached over %d connections, want 1 (its late answers were cancelled): %v", len(conns), conns)
			}
		})
	}
}

// TestWritePrefillNeverAnsweringIsCancelled: a prefill left to answer
// after its decode's stream ended is cancelled once prefillHandOff passed.
func TestWritePrefillNeverAnsweringIsCancelled(t *testing.T) {
	g := newKVGate()
	cancelled := make(chan time.Time, 1)
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		g.open(r)
		<-r.Context().Done()
		cancelled <- time.Now()
	})
	D := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio"})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	answered := time.Now()
	at := waitDone(t, cancelled, prefillHandOff+5*time.Second, "the prefill's cancellation")
	if d := at.Sub(answered); d < prefillHandOff/2 {
		t.Fatalf("the prefill was cancelled %v after the answer, want about %v", d, prefillHandOff)
	}
	if pw.Breaker().State() != worker.BreakerClosed {
		t.Fatal("the prefill's breaker was charged for an answer nobody needed")
	}
}
