package pd

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

const (
	p2ZMQ = "host:127.0.0.4,handshake:6303,notify:61007"
	d2ZMQ = "host:127.0.0.3,handshake:6304,notify:61008"
)

// byHeader picks the usable worker whose URL is in the request header h,
// else the first usable worker.
type byHeader struct{ h string }

func (p *byHeader) Name() string { return "test" }

func (p *byHeader) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	u := req.Headers.Get(p.h)
	for _, w := range c.Workers {
		if w.URL == u && req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "header"}, nil
		}
	}
	for _, w := range c.Workers {
		if req.Usable(w) {
			return policy.Choice{Worker: w, Reason: "first usable"}, nil
		}
	}
	return policy.Choice{}, policy.ErrNoWorker
}

// decodeUnlessFrom streams like decodeSSE unless the request comes paired
// with the prefill registered with zmq address bad (read from the PD
// X-Request-Id): that KV never arrives, so it sends headers and waits.
func decodeUnlessFrom(bad string) func(http.ResponseWriter, *http.Request, *recorded) {
	return func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		if m := prefillZMQRE.FindStringSubmatch(r.Header.Get("X-Request-Id")); m != nil && m[1] == bad {
			<-r.Context().Done()
			return
		}
		sendEvents(w)
	}
}

func TestPairHealthBlame(t *testing.T) {
	now := time.Unix(0, 0)
	h := newPairHealth(3, 10*time.Second, 0, func() time.Time { return now })
	if bp, bd := h.failed("p1", "d1"); bp || bd {
		t.Fatal("one pair's failure blames nobody")
	}
	if bp, bd := h.failed("p1", "d1"); bp || bd {
		t.Fatal("repeated failures of one pair blame nobody")
	}
	if bp, bd := h.failed("p1", "d2"); !bp || bd {
		t.Fatalf("p1 failed with two decodes: blameP=%v blameD=%v", bp, bd)
	}
	if bp, bd := h.failed("p2", "d2"); bp || !bd {
		t.Fatalf("d2 failed with two prefills: blameP=%v blameD=%v", bp, bd)
	}
	// a success clears the pair: the evidence goes with it
	h.succeeded("p1", "d2")
	h.succeeded("p2", "d2")
	if bp, bd := h.failed("p3", "d2"); bp || bd {
		t.Fatal("cleared pairs still count")
	}
	// old failures (older than the cooldown) do not count
	now = now.Add(11 * time.Second)
	if bp, bd := h.failed("p1", "d3"); bp || bd {
		t.Fatal("stale failures still count")
	}
}

// TestBadPrefillSparesDecodes is the chaos suite's "prefill drops
// write_done" in miniature: every pair of one prefill times out. Requests
// fail over to the good prefill, the decodes' breakers record nothing,
// the bad prefill is blamed once it failed with both decodes, and once
// all its pairs are suspect it gets no more traffic.
func TestBadPrefillSparesDecodes(t *testing.T) {
	Pbad := newFake(t, prefillOK(`{"ok":true}`))
	Pgood := newFake(t, prefillOK(`{"ok":true}`))
	D1 := newFake(t, decodeUnlessFrom(pZMQ))
	D2 := newFake(t, decodeUnlessFrom(pZMQ))
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 100})
	pb := addWorker(t, reg, Pbad.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	pg := addWorker(t, reg, Pgood.URL(), worker.RolePrefill, zmqAddr4(p2ZMQ, "WRITE"))
	d1 := addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	d2 := addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4(d2ZMQ, "WRITE"))
	m := metrics.NewForTest()
	h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 500 * time.Millisecond, MaxFailovers: 2,
		PairFailureThreshold: 1, Metrics: m,
		PrefillPolicy: &prefer{urls: []string{Pbad.URL()}}, DecodePolicy: &prefer{urls: []string{D1.URL()}}})
	for i := range 6 {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 200 || res.body != sseAll() {
			t.Fatalf("request %d: status %d body %q", i, res.status, res.body)
		}
		rc := h.last.Load().Receipt
		if rc.Prefill != pg.Key() {
			t.Fatalf("request %d served by %s", i, rc.Prefill)
		}
		if i < 2 && (rc.Attempts != 2 || !strings.HasPrefix(rc.Failovers[0], "pair "+pb.Key()+"+")) {
			t.Fatalf("request %d: receipt %+v", i, rc)
		}
		if i >= 2 && rc.Attempts != 1 {
			t.Fatalf("request %d: the prefill whose pairs are all suspect was picked again: %+v", i, rc)
		}
	}
	if n := Pbad.count.Load(); n != 2 {
		t.Fatalf("bad prefill got %d prefill legs, want 2 (one per decode)", n)
	}
	waitIdle(t, pb, pg, d1, d2)
	for _, w := range []*worker.Worker{d1, d2, pg} {
		if v := counter(t, m.CBOutcomes.WithLabelValues(w.Key(), "failure")); v != 0 {
			t.Fatalf("%s: %v breaker failures", w.Key(), v)
		}
	}
	// the bad prefill: its first timeout is the pair's (neutral), the second
	// (with another decode) blames it; it never counts a success, although
	// it answered 200 both times (its job ends when its KV arrives)
	if f, s := counter(t, m.CBOutcomes.WithLabelValues(pb.Key(), "failure")), counter(t, m.CBOutcomes.WithLabelValues(pb.Key(), "success")); f != 1 || s != 0 {
		t.Fatalf("bad prefill breaker outcomes: %v failures, %v successes", f, s)
	}
	if v := counter(t, m.CBOutcomes.WithLabelValues(pg.Key(), "success")); v != 6 {
		t.Fatalf("good prefill: %v successes, want 6", v)
	}
}

// TestStalledDecodeBlamed: a decode that never produces a byte, whichever
// prefill it is paired with, is blamed once it failed with two prefills:
// its breaker records the failure; the prefills' do not.
func TestStalledDecodeBlamed(t *testing.T) {
	P1 := newFake(t, prefillOK(`{"ok":true}`))
	P2 := newFake(t, prefillOK(`{"ok":true}`))
	Dstall := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		<-r.Context().Done()
	})
	D2 := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 100})
	p1 := addWorker(t, reg, P1.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	p2 := addWorker(t, reg, P2.URL(), worker.RolePrefill, zmqAddr4(p2ZMQ, "WRITE"))
	ds := addWorker(t, reg, Dstall.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	d2 := addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4(d2ZMQ, "WRITE"))
	m := metrics.NewForTest()
	h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 500 * time.Millisecond, MaxFailovers: 1, Metrics: m,
		PrefillPolicy: &byHeader{h: "X-Prefill"}, DecodePolicy: &prefer{urls: []string{Dstall.URL()}}})
	for i, p := range []*fake{P1, P2} {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`, "X-Prefill", p.URL())
		if res.status != 200 || res.body != sseAll() {
			t.Fatalf("request %d: status %d body %q", i, res.status, res.body)
		}
		if rc := h.last.Load().Receipt; rc.Decode != d2.Key() || rc.Attempts != 2 {
			t.Fatalf("request %d: receipt %+v", i, rc)
		}
	}
	waitIdle(t, p1, p2, ds, d2)
	if v := counter(t, m.CBOutcomes.WithLabelValues(ds.Key(), "failure")); v != 1 {
		t.Fatalf("stalled decode: %v breaker failures, want 1 (the timeout with its second prefill)", v)
	}
	for _, w := range []*worker.Worker{p1, p2, d2} {
		if v := counter(t, m.CBOutcomes.WithLabelValues(w.Key(), "failure")); v != 0 {
			t.Fatalf("%s: %v breaker failures", w.Key(), v)
		}
	}
	if v := counter(t, m.PDDecodeErrors.WithLabelValues(ds.Key())); v != 1 {
		t.Fatalf("decode errors %v", v)
	}
}

// TestSuspectPairFallback: when every pair is suspect, the first suspect
// pair is still used rather than refusing the request.
func TestSuspectPairFallback(t *testing.T) {
	var n atomic.Int32
	P1 := newFake(t, prefillOK(`{"ok":true}`))
	P2 := newFake(t, prefillOK(`{"ok":true}`))
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		if n.Add(1) <= 2 {
			<-r.Context().Done()
			return
		}
		sendEvents(w)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 100})
	p1 := addWorker(t, reg, P1.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	p2 := addWorker(t, reg, P2.URL(), worker.RolePrefill, zmqAddr4(p2ZMQ, "WRITE"))
	addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 500 * time.Millisecond, PairFailureThreshold: 1,
		PrefillPolicy: &prefer{urls: []string{P1.URL()}}})
	for i, want := range []*worker.Worker{p1, p2} {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if rc := h.last.Load().Receipt; res.status != 504 || rc.Prefill != want.Key() {
			t.Fatalf("request %d: status %d on %s, want a 504 on %s", i, res.status, rc.Prefill, want.Key())
		}
	}
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	rc := h.last.Load().Receipt
	if res.status != 200 || res.body != sseAll() || rc.Prefill != p1.Key() || !strings.Contains(rc.Reason, "every pair suspect") {
		t.Fatalf("status %d body %q receipt %+v", res.status, res.body, rc)
	}
	// the success cleared that pair
	if s := h.eng.pairs.suspects(p1.Key(), reg.Snapshot().Decode); len(s) != 0 {
		t.Fatalf("suspects after a success: %v", s)
	}
}

// TestDeadPrefillWakesWaitingDecode: P answered, then is seen dead before
// D got its KV (no KV-wait timeout configured: D would wait forever). The
// attempt stops waiting at once and fails over; nothing had been sent to
// the client.
func TestDeadPrefillWakesWaitingDecode(t *testing.T) {
	for _, how := range []string{"left-registry", "connect-failure"} {
		t.Run(how, func(t *testing.T) {
			answered := make(chan struct{}, 4)
			Pa := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				prefillOK(`{"ok":true}`)(w, r, rec)
				answered <- struct{}{}
			})
			Pb := newFake(t, prefillOK(`{"ok":true}`))
			D := newFake(t, decodeUnlessFrom(pZMQ))
			reg := worker.NewRegistry(worker.BreakerConfig{})
			pa := addWorker(t, reg, Pa.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
			pb := addWorker(t, reg, Pb.URL(), worker.RolePrefill, zmqAddr4(p2ZMQ, "WRITE"))
			dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
			h := newHarness(t, reg, Options{Connector: "moriio", MaxFailovers: 1,
				PrefillPolicy: &prefer{urls: []string{Pa.URL()}}})
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel) // runs before the harness closes: no hang if the test fails
			done := make(chan result, 1)
			go func() { done <- h.postCtx(ctx, t, "/v1/completions", `{"prompt":"p","stream":true}`) }()
			waitDone(t, answered, 2*time.Second, "prefill answer")
			time.Sleep(20 * time.Millisecond)
			select {
			case res := <-done:
				t.Fatalf("answered before the prefill died: %d %q", res.status, res.body)
			default:
			}
			switch how {
			case "left-registry":
				reg.Remove(pa.Key())
			case "connect-failure":
				Pa.srv.Close()
				// another request reaches the dead prefill: connection refused
				res := h.post(t, "/v1/completions", `{"prompt":"q","stream":true}`)
				if res.status != 200 || res.body != sseAll() {
					t.Fatalf("second request: status %d body %q", res.status, res.body)
				}
				if !pa.Suspect() {
					t.Fatal("dead prefill not suspect after a connect failure")
				}
			}
			res := waitDone(t, done, 2*time.Second, "the waiting request")
			if res.status != 200 || res.body != sseAll() {
				t.Fatalf("status %d body %q", res.status, res.body)
			}
			waitIdle(t, pa, pb, dw)
			if how == "left-registry" {
				rc := h.last.Load().Receipt
				if rc.Attempts != 2 || rc.Failovers[0] != "prefill "+pa.Key()+": down" || rc.Prefill != pb.Key() {
					t.Fatalf("receipt %+v", rc)
				}
			}
		})
	}
}

// TestDecodeHeadersWithoutBodyFailOver: the response is committed on D's
// first body byte, not on its headers, so a D that sends 200 and dies
// before any byte fails over (sequential connector here; concurrent ones
// were covered above).
func TestDecodeHeadersWithoutBodyFailOver(t *testing.T) {
	h, _, _, _, bw := badDecodeFleet(t, func(w http.ResponseWriter, r *http.Request, _ *recorded) {
		startSSE(w)
		panic(http.ErrAbortHandler)
	})
	if rc := h.last.Load().Receipt; rc.Attempts != 2 || !strings.Contains(rc.Failovers[0], bw.Key()) {
		t.Fatalf("receipt %+v", rc)
	}
}
