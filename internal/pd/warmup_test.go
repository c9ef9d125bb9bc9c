package pd

import (
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool, state ...func() string) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			for _, f := range state {
				what += " (" + f() + ")"
			}
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestWarmupEveryNewPair: every live prefill/decode instance pair gets one
// real 1-token PD request, once; an instance that leaves and comes back is
// warmed again.
func TestWarmupEveryNewPair(t *testing.T) {
	// A decode answers only once the prefill of the same request (same
	// X-Request-Id) has answered, i.e. once its KV "arrived", as a real WRITE
	// decode does; else a warm-up could end before its prefill leg was sent.
	var kv sync.Map // X-Request-Id → chan struct{}, closed when P answered
	arrived := func(r *http.Request) chan struct{} {
		ch, _ := kv.LoadOrStore(r.Header.Get("X-Request-Id"), make(chan struct{}))
		return ch.(chan struct{})
	}
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		prefillOK(`{"ok":true}`)(w, r, rec)
		close(arrived(r))
	})
	decode := func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		select {
		case <-arrived(r):
			sendEvents(w)
		case <-r.Context().Done():
		}
	}
	D1 := newFake(t, decode)
	D2 := newFake(t, decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	model := func(s *worker.Spec) { s.ModelID = "m1" }
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"), model)
	addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"), model)
	addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4(d2ZMQ, "WRITE"), model)
	h := newHarness(t, reg, Options{Connector: "moriio", Warmup: true})

	waitUntil(t, 3*time.Second, "both pairs warmed", func() bool {
		return h.eng.warm.ok.Load() == 2
	}, func() string {
		return fmt.Sprintf("ok %d failed %d P=%d D1=%d D2=%d status %+v", h.eng.warm.ok.Load(), h.eng.warm.failed.Load(),
			P.count.Load(), D1.count.Load(), D2.count.Load(), h.eng.Status())
	})
	if P.count.Load() != 2 || D1.count.Load() != 1 || D2.count.Load() != 1 {
		t.Fatalf("requests P=%d D1=%d D2=%d, want 2/1/1", P.count.Load(), D1.count.Load(), D2.count.Load())
	}
	for range 2 {
		rec := P.next(t)
		o := rec.obj(t)
		if p, _ := o.String("prompt"); p != warmupPrompt || rec.path != "/v1/completions" {
			t.Fatalf("warm-up prefill %s %s", rec.path, rec.body)
		}
		if m, _ := o.String("model"); m != "m1" {
			t.Fatalf("warm-up prefill model: %s", rec.body)
		}
		if n, _ := o.Int("max_tokens"); n != 1 {
			t.Fatalf("warm-up prefill max_tokens: %s", rec.body)
		}
		if len(rec.params(t)) == 0 {
			t.Fatalf("warm-up prefill without kv_transfer_params: %s", rec.body)
		}
	}
	if d := D1.next(t); len(d.params(t)) == 0 {
		t.Fatalf("warm-up decode without kv_transfer_params: %s", d.body)
	}
	time.Sleep(warmupScan + 300*time.Millisecond) // a rescan must not warm again
	if P.count.Load() != 2 {
		t.Fatalf("pairs warmed twice: P saw %d requests", P.count.Load())
	}

	// D2 leaves and comes back (a restart): warmed again.
	reg.Remove(D2.URL())
	addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4(d2ZMQ, "WRITE"), model)
	waitUntil(t, 3*time.Second, "re-added decode warmed", func() bool { return h.eng.warm.ok.Load() == 3 })
	if D2.count.Load() != 2 || D1.count.Load() != 1 {
		t.Fatalf("D1=%d D2=%d after the re-add, want 1/2", D1.count.Load(), D2.count.Load())
	}
}

// TestWarmupColdPairAvoided: while a new decode's pair is warming up, real
// requests go to a warm pair even though the policy prefers the new one;
// once warm, it is used.
func TestWarmupColdPairAvoided(t *testing.T) {
	P := newFake(t, prefillOK(`{"ok":true}`))
	release := make(chan struct{})
	D1 := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		if p, _ := rec.obj(t).String("prompt"); p == warmupPrompt {
			select { // a slow first contact
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		decodeJSON(w, r, rec)
	})
	D2 := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4(d2ZMQ, "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", Warmup: true, DecodePolicy: &prefer{urls: []string{D1.URL()}}})
	waitUntil(t, 3*time.Second, "P/D2 warmed", func() bool { return h.eng.warm.ok.Load() == 1 })

	addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	waitUntil(t, 3*time.Second, "P/D1 warm-up started", func() bool { return D1.count.Load() == 1 })
	if ws := h.eng.Status().Warmup; ws == nil || len(ws.Running) != 1 || ws.Running[0] != [2]string{P.URL(), D1.URL()} || ws.Warm != 1 || ws.OK != 1 {
		t.Fatalf("warm-up status while P/D1 warms up: %+v", ws)
	}
	for i := range 3 {
		res := h.post(t, "/v1/completions", `{"prompt":"hi","max_tokens":3}`)
		if res.status != 200 {
			t.Fatalf("request %d: %d %s", i, res.status, res.body)
		}
		if rc := h.last.Load().Receipt; rc.Decode != D2.URL() {
			t.Fatalf("request %d went to %s while P/D1 was warming up", i, rc.Decode)
		}
	}
	close(release)
	waitUntil(t, 3*time.Second, "P/D1 warmed", func() bool { return h.eng.warm.ok.Load() == 2 })
	if res := h.post(t, "/v1/completions", `{"prompt":"hi","max_tokens":3}`); res.status != 200 || h.last.Load().Receipt.Decode != D1.URL() {
		t.Fatalf("after warm-up: %d, decode %s", res.status, h.last.Load().Receipt.Decode)
	}
}

// TestWarmupOffAndOnlyLivePairs: no warm-up when disabled, and none to an
// unhealthy worker.
func TestWarmupOffAndOnlyLivePairs(t *testing.T) {
	P := newFake(t, prefillOK(`{"ok":true}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	d := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	newHarness(t, reg, Options{Connector: "moriio"})
	time.Sleep(warmupScan / 2)
	P.none(t)

	d.SetHealthy(false)
	h := newHarness(t, reg, Options{Connector: "moriio", Warmup: true})
	time.Sleep(warmupScan + 200*time.Millisecond)
	P.none(t)
	d.SetHealthy(true) // no registry event: the periodic scan finds it
	waitUntil(t, 3*time.Second, "warmed once healthy", func() bool { return h.eng.warm.ok.Load() == 1 })
}
