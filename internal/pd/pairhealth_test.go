package pd

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestPairHealthUnit(t *testing.T) {
	now := time.Unix(0, 0)
	h := newPairHealth(2, 10*time.Second, func() time.Time { return now })
	d1 := worker.New(worker.Spec{URL: "http://d1", DPRank: -1}, worker.BreakerConfig{})
	d2 := worker.New(worker.Spec{URL: "http://d2", DPRank: -1}, worker.BreakerConfig{})
	ds := []*worker.Worker{d1, d2}
	h.record("p", d1.Key(), false)
	if len(h.suspects("p", ds)) != 0 {
		t.Fatal("one failure must not make a pair suspect")
	}
	h.record("p", d1.Key(), false)
	if s := h.suspects("p", ds); !s[d1.Key()] || s[d2.Key()] {
		t.Fatalf("suspects %v", s)
	}
	if len(h.suspects("other-p", ds)) != 0 {
		t.Fatal("pair health is per pair, not per decode")
	}
	now = now.Add(11 * time.Second)
	if len(h.suspects("p", ds)) != 0 {
		t.Fatal("cooldown must expire")
	}
	h.record("p", d1.Key(), false)
	h.record("p", d1.Key(), true)
	if len(h.m) != 0 {
		t.Fatal("success must clear the pair")
	}
}

// TestPairAvoidedAfterTransferTimeouts: a decode that is healthy on its own
// but never receives KV from one prefill is avoided for that prefill after
// repeated KV-wait timeouts, before its circuit breaker would open.
func TestPairAvoidedAfterTransferTimeouts(t *testing.T) {
	P := newFake(t, prefillOK(`{"ok":true}`))
	stuck := make(chan time.Time, 16)
	D1 := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		blockUntilCancelled(stuck)(w, r, rec)
	})
	D2 := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 100})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4("host:127.0.0.3,handshake:6301,notify:61005", "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: 100 * time.Millisecond, MaxFailovers: -1,
		PairFailureThreshold: 2, DecodePolicy: &prefer{urls: []string{D1.URL()}}})
	for i := range 2 {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 504 || !strings.Contains(res.body, "produced no output") {
			t.Fatalf("request %d: want the stuck decode's 504 (no failover budget), got %d %q", i, res.status, res.body)
		}
	}
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("pair not avoided: %d %q", res.status, res.body)
	}
}
