package pd

import (
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestPairHealthUnit(t *testing.T) {
	now := time.Unix(0, 0)
	h := newPairHealth(2, 10*time.Second, 0, func() time.Time { return now })
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

// TestPairHalfOpenProbe: after the cooldown one request at a time probes a
// pair; the others keep avoiding it until the probe's outcome is known.
func TestPairHalfOpenProbe(t *testing.T) {
	now := time.Unix(0, 0)
	h := newPairHealth(2, 10*time.Second, 3*time.Second, func() time.Time { return now })
	d1 := worker.New(worker.Spec{URL: "http://d1", DPRank: -1}, worker.BreakerConfig{})
	ds := []*worker.Worker{d1}
	if h.claim("p", d1.Key()) {
		t.Fatal("a pair never failed has no probe to claim")
	}
	h.record("p", d1.Key(), false)
	h.record("p", d1.Key(), false)
	if h.claim("p", d1.Key()) || !h.suspects("p", ds)[d1.Key()] {
		t.Fatal("cooling down: no probe, suspect")
	}
	now = now.Add(11 * time.Second)
	if h.suspects("p", ds)[d1.Key()] {
		t.Fatal("half-open without a probe in flight must be pickable")
	}
	if !h.claim("p", d1.Key()) {
		t.Fatal("the first pick after the cooldown is the probe")
	}
	if !h.suspects("p", ds)[d1.Key()] || h.claim("p", d1.Key()) {
		t.Fatal("while the probe is in flight the pair is avoided and no second probe is granted")
	}
	now = now.Add(3 * time.Second)
	if h.suspects("p", ds)[d1.Key()] || !h.claim("p", d1.Key()) {
		t.Fatal("a probe never reported is given up after probeTTL")
	}
	h.record("p", d1.Key(), false) // the probe failed: another full cooldown
	now = now.Add(9 * time.Second)
	if !h.suspects("p", ds)[d1.Key()] || h.claim("p", d1.Key()) {
		t.Fatal("a failed probe must start a new cooldown")
	}
	now = now.Add(2 * time.Second)
	if !h.claim("p", d1.Key()) {
		t.Fatal("second probe")
	}
	h.record("p", d1.Key(), true)
	if len(h.suspects("p", ds)) != 0 || len(h.m) != 0 || h.claim("p", d1.Key()) {
		t.Fatal("a successful probe clears the pair")
	}
}

// TestPairAvoidedAfterTransferTimeouts: a decode that is healthy on its own
// but never receives KV from one prefill is avoided for that prefill after
// repeated KV-wait timeouts, before its circuit breaker would open.
func TestPairAvoidedAfterTransferTimeouts(t *testing.T) {
	// The kv-wait also judges the healthy decode's answer: 100 ms was too
	// short for it on a loaded machine under -race.
	h, _ := stuckPairFleet(t, time.Second, 0)
	st := h.eng.Status()
	if len(st.Pairs) != 1 || st.Pairs[0].State != "avoided" || st.Pairs[0].ConsecutiveFailures != 2 ||
		st.Pairs[0].AvoidedUntil.IsZero() || st.Connector != "moriio" || st.Warmup != nil {
		t.Fatalf("status %+v", st)
	}
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("pair not avoided: %d %q", res.status, res.body)
	}
}

// stuckPairFleet is one prefill and two decodes; the policy prefers D1,
// which never gets its KV (its stream stays silent until cancelled). Two
// requests have already timed out on P/D1, making the pair suspect
// (PairFailureThreshold 2, no failover). It returns the harness and D1's
// request counter.
func stuckPairFleet(t *testing.T, kvWait, cooldown time.Duration) (*harness, *atomic.Int32) {
	t.Helper()
	P := newFake(t, prefillOK(`{"ok":true}`))
	d1Hits := new(atomic.Int32)
	D1 := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		d1Hits.Add(1)
		startSSE(w)
		<-r.Context().Done()
	})
	D2 := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 100})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	addWorker(t, reg, D1.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	addWorker(t, reg, D2.URL(), worker.RoleDecode, zmqAddr4("host:127.0.0.3,handshake:6301,notify:61005", "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", KVWaitTimeout: kvWait, MaxFailovers: -1,
		PairFailureThreshold: 2, PairCooldown: cooldown, DecodePolicy: &prefer{urls: []string{D1.URL()}}})
	for i := range 2 {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 504 || !strings.Contains(res.body, "produced no output") {
			t.Fatalf("request %d: want the stuck decode's 504 (no failover budget), got %d %q", i, res.status, res.body)
		}
	}
	return h, d1Hits
}

// TestPairHalfOpenOneProbeAtATime: once a suspect pair's cooldown is over,
// concurrent requests send only one probe to it; the rest go elsewhere.
func TestPairHalfOpenOneProbeAtATime(t *testing.T) {
	h, d1Hits := stuckPairFleet(t, 2*time.Second, 200*time.Millisecond)
	time.Sleep(250 * time.Millisecond) // cooldown over: half-open
	d1Hits.Store(0)
	probe := make(chan int, 1)
	go func() { probe <- h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`).status }()
	waitUntil(t, 5*time.Second, "the probe reached the half-open pair", func() bool { return d1Hits.Load() == 1 })
	// While the probe waits for its KV, nobody else is sent to the pair.
	var wg sync.WaitGroup
	codes := make([]int, 5)
	for i := range codes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`).status
		}()
	}
	wg.Wait()
	if n := d1Hits.Load(); n != 1 {
		t.Fatalf("the half-open pair got %d requests, want exactly one probe (codes %v)", n, codes)
	}
	if c := <-probe; c != 504 {
		t.Fatalf("probe: %d, want the stuck decode's 504", c)
	}
	ok := 0
	for _, c := range codes {
		if c == 200 {
			ok++
		}
	}
	if ok != len(codes) {
		t.Fatalf("codes %v: every request but the probe must succeed on the other decode", codes)
	}
}
