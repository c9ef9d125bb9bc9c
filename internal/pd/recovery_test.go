package pd

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// A pair is warmed up only once both members passed a health probe (an
// engine still starting would only refuse the warm-up).
func TestWarmupWaitsForProbe(t *testing.T) {
	g := newKVGate()
	P := newFake(t, g.prefill(prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)))
	D := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ps, err := reg.Add(worker.Spec{URL: P.URL(), Role: worker.RolePrefill, DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	ds, err := reg.Add(worker.Spec{URL: D.URL(), Role: worker.RoleDecode, DPRank: -1})
	if err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, reg, Options{Connector: "nixl", Warmup: true})
	h.eng.warm.scan() // synchronous: it registers every warm-up it starts
	ps[0].MarkProbed()
	h.eng.warm.scan() // the decode is still unprobed
	h.eng.warm.mu.Lock()
	n := len(h.eng.warm.running)
	h.eng.warm.mu.Unlock()
	if n != 0 || P.count.Load() != 0 || h.eng.warm.ok.Load() != 0 {
		t.Fatalf("warm-up started before both members passed a probe (running %d, P saw %d)", n, P.count.Load())
	}
	ds[0].MarkProbed()
	h.eng.warm.scan()
	waitUntil(t, 10*time.Second, "pair warmed after both probes passed", func() bool { return h.eng.warm.ok.Load() == 1 })
}

// A warm-up's connect failure is no health verdict: the prefill is neither
// suspect nor unhealthy afterwards.
func TestWarmupConnectFailureNoVerdict(t *testing.T) {
	dead := deadURL(t)
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	pw := addWorker(t, reg, dead, worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", Warmup: true})
	waitUntil(t, 10*time.Second, "warm-up failed", func() bool { return h.eng.warm.failed.Load() == 1 })
	if !pw.Healthy() || pw.Suspect() {
		t.Fatalf("warm-up connect failure changed health: healthy %v suspect %v", pw.Healthy(), pw.Suspect())
	}
}

// Panic routing in PD: every prefill unhealthy, the registered one serves
// anyway (metric, receipt); turned off, the answer is 503.
func TestPanicPair(t *testing.T) {
	for _, tc := range []struct {
		name     string
		disabled bool
		want     int
	}{{"on", false, 200}, {"off", true, http.StatusServiceUnavailable}} {
		t.Run(tc.name, func(t *testing.T) {
			g := newKVGate()
			P := newFake(t, g.prefill(prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)))
			D := newFake(t, g.decode)
			reg := worker.NewRegistry(worker.BreakerConfig{})
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
			addWorker(t, reg, D.URL(), worker.RoleDecode)
			pw.SetHealthy(false)
			m := metrics.NewForTest()
			pn := &worker.Panic{Disabled: tc.disabled, OnPick: func(r worker.Role) { m.PanicRouted.WithLabelValues(r.String()).Inc() }}
			h := newHarness(t, reg, Options{Connector: "nixl", Metrics: m, Panic: pn})
			res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
			if res.status != tc.want {
				t.Fatalf("status %d %s, want %d", res.status, res.body, tc.want)
			}
			want := 0.0
			if !tc.disabled {
				want = 1
				if rc := h.last.Load().Receipt; rc.Prefill != pw.Key() || !strings.Contains(rc.Reason, "panic") {
					t.Errorf("receipt %+v", rc)
				}
			}
			if v := counter(t, m.PanicRouted.WithLabelValues("prefill")); v != want {
				t.Errorf("panic metric %v, want %v", v, want)
			}
		})
	}
}

// A dead prefill fleet in panic mode answers at once with a clear error.
func TestPanicPairDeadFleetFailsFast(t *testing.T) {
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	for range 2 {
		addWorker(t, reg, deadURL(t), worker.RolePrefill).SetHealthy(false)
	}
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", MaxFailovers: 2, Panic: &worker.Panic{}})
	start := time.Now()
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("dead fleet answered after %v", el)
	}
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	if res.status < 500 || json.Unmarshal([]byte(res.body), &e) != nil || e.Error.Message == "" {
		t.Fatalf("status %d body %q: want a 5xx JSON error", res.status, res.body)
	}
	if D.count.Load() != 0 {
		t.Errorf("decode called %d times for a request whose prefill is unreachable", D.count.Load())
	}
	t.Logf("dead fleet: %d %s", res.status, e.Error.Message)
}

// A prefill with an unconfirmed connect failure is avoided while another
// prefill is available.
func TestSuspectPrefillAvoided(t *testing.T) {
	g := newKVGate()
	P1 := newFake(t, g.prefill(prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)))
	P2 := newFake(t, g.prefill(prefillOK(`{"remote_engine_id":"e","remote_block_ids":[1]}`)))
	D := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	p1 := addWorker(t, reg, P1.URL(), worker.RolePrefill)
	p2 := addWorker(t, reg, P2.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", PrefillPolicy: &prefer{urls: []string{P1.URL()}}})
	reg.ConnectFailed(p1, time.Now())
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 {
		t.Fatalf("status %d %s", res.status, res.body)
	}
	if rc := h.last.Load().Receipt; rc.Prefill != p2.Key() {
		t.Fatalf("prefill %s, want the non-suspect %s", rc.Prefill, p2.Key())
	}
}
