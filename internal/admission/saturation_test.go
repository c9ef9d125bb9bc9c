package admission

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestParseVLLMMetrics(t *testing.T) {
	for _, tc := range []struct {
		name        string
		text        string
		waiting, kv float64
		bad         bool
	}{
		{name: "vllm-sim exposition", text: "# HELP vllm:num_requests_waiting x\n# TYPE vllm:num_requests_waiting gauge\n" +
			`vllm:num_requests_waiting{engine="0",model_name="m1"} 3` + "\n" +
			`vllm:kv_cache_usage_perc{engine="0",model_name="m1"} 0.25` + "\n", waiting: 3, kv: 0.25},
		{name: "DP engines: waiting summed, usage max", text: `vllm:num_requests_waiting{engine="0"} 2` + "\n" + `vllm:num_requests_waiting{engine="1"} 5` + "\n" +
			`vllm:kv_cache_usage_perc{engine="0"} 0.9` + "\n" + `vllm:kv_cache_usage_perc{engine="1"} 0.4` + "\n", waiting: 7, kv: 0.9},
		{name: "older vLLM gpu_cache name, no labels, timestamp", text: "vllm:gpu_cache_usage_perc 0.5 1700000000\nvllm:num_requests_waiting 1\n", waiting: 1, kv: 0.5},
		{name: "label value with a brace and space", text: `vllm:num_requests_waiting{model_name="a} b"} 4` + "\n", waiting: 4},
		{name: "other families only", text: "vllm:num_requests_running 3\nprocess_cpu_seconds_total 1\n", bad: true},
		{name: "empty", text: "", bad: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, kv, err := parseVLLMMetrics(strings.NewReader(tc.text))
			if tc.bad {
				if err == nil {
					t.Fatalf("no error (waiting %v kv %v)", w, kv)
				}
				return
			}
			if err != nil || w != tc.waiting || kv != tc.kv {
				t.Fatalf("waiting %v kv %v err %v, want %v %v", w, kv, err, tc.waiting, tc.kv)
			}
		})
	}
}

// fakeEngine serves a /metrics page whose two gauges the test sets.
type fakeEngine struct {
	srv         *httptest.Server
	mu          sync.Mutex
	waiting, kv float64
	fail        bool
	hits        atomic.Int64
}

func newFakeEngine(t *testing.T) *fakeEngine {
	e := &fakeEngine{}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.hits.Add(1)
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.fail || r.URL.Path != "/metrics" {
			http.Error(w, "down", http.StatusInternalServerError)
			return
		}
		fmt.Fprintf(w, "vllm:num_requests_waiting{engine=\"0\"} %g\nvllm:kv_cache_usage_perc{engine=\"0\"} %g\n", e.waiting, e.kv)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *fakeEngine) set(waiting, kv float64, fail bool) {
	e.mu.Lock()
	e.waiting, e.kv, e.fail = waiting, kv, fail
	e.mu.Unlock()
}

func addWorkers(t *testing.T, reg *worker.Registry, role worker.Role, urls ...string) []*worker.Worker {
	t.Helper()
	var out []*worker.Worker
	for _, u := range urls {
		ws, err := reg.Add(worker.Spec{URL: u, Role: role, DPRank: -1})
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, ws...)
	}
	return out
}

func pollOnce(d *Detector) {
	var wg sync.WaitGroup
	d.pollAll(context.Background(), &wg)
	wg.Wait()
}

func TestDetectorInFlight(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ws := addWorkers(t, reg, worker.RoleRegular, "http://127.0.0.1:1", "http://127.0.0.1:2")
	d := NewDetector(SaturationConfig{Registry: reg, MaxInFlight: 2, Metrics: metrics.NewForTest()})
	if !d.Open(0, true) {
		t.Fatal("idle fleet saturated")
	}
	// capacity 2×2: slots granted but not yet on a worker count too
	if d.Open(4, true) || !d.Open(3, true) {
		t.Fatalf("capacity: Open(4)=%v Open(3)=%v", d.Open(4, true), d.Open(3, true))
	}
	r1, r2 := ws[0].Acquire(), ws[0].Acquire()
	if !d.Open(2, true) || !d.Worker(ws[0]).Saturated || d.Worker(ws[1]).Saturated {
		t.Fatal("one worker at its limit must not saturate the fleet")
	}
	r3, r4 := ws[1].Acquire(), ws[1].Acquire()
	if d.Open(4, true) {
		t.Fatal("every worker at its limit: fleet must be saturated")
	}
	ws[1].SetHealthy(false) // the saturated-worker set shrinks to ws[0]: still all saturated
	if d.Open(4, true) {
		t.Fatal("remaining available worker is saturated")
	}
	r1()
	if !d.Open(3, true) {
		t.Fatal("a freed slot on an available worker must open the gate")
	}
	ws[0].SetHealthy(false)
	if !d.Open(100, true) {
		t.Fatal("no available worker: never hold (the dispatcher answers 503)")
	}
	r2()
	r3()
	r4()
}

// TestDetectorOverLimit: two concurrent picks can put a worker past its
// limit; that must not raise the fleet's capacity.
func TestDetectorOverLimit(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ws := addWorkers(t, reg, worker.RoleRegular, "http://127.0.0.1:1", "http://127.0.0.1:2")
	d := NewDetector(SaturationConfig{Registry: reg, MaxInFlight: 2})
	var rel []func()
	for range 3 {
		rel = append(rel, ws[0].Acquire())
	}
	rel = append(rel, ws[1].Acquire())
	if d.Open(4, true) {
		t.Fatal("4 slots in use of a capacity of 2×2 must hold, however they are spread")
	}
	if !d.Open(3, true) {
		t.Fatal("3 of 4 in use: open")
	}
	for _, r := range rel {
		r()
	}
}

func TestDetectorPolledMetrics(t *testing.T) {
	e1, e2 := newFakeEngine(t), newFakeEngine(t)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ws := addWorkers(t, reg, worker.RoleRegular, e1.srv.URL, e2.srv.URL)
	m := metrics.NewForTest()
	d := NewDetector(SaturationConfig{Registry: reg, MaxWaiting: 4, MaxKVUsage: 0.9, PollInterval: time.Hour, Metrics: m})
	steps := []struct {
		name         string
		w1, kv1      float64
		w2, kv2      float64
		fail2        bool
		open         bool
		sat1, sat2   bool
		wantPollErr2 bool
	}{
		{name: "idle", open: true},
		{name: "one waiting queue full", w1: 4, open: true, sat1: true},
		{name: "both saturated (queue, kv)", w1: 4, kv2: 0.95, open: false, sat1: true, sat2: true},
		{name: "poll fails: fail open", w1: 4, fail2: true, open: true, sat1: true, wantPollErr2: true},
		{name: "recovered", w1: 1, kv2: 0.5, open: true},
	}
	for _, st := range steps {
		e1.set(st.w1, st.kv1, false)
		e2.set(st.w2, st.kv2, st.fail2)
		pollOnce(d)
		if got := d.Open(0, true); got != st.open {
			t.Fatalf("%s: Open %v, want %v", st.name, got, st.open)
		}
		s1, s2 := d.Worker(ws[0]), d.Worker(ws[1])
		if s1.Saturated != st.sat1 || s2.Saturated != st.sat2 {
			t.Fatalf("%s: saturated %v %v, want %v %v", st.name, s1.Saturated, s2.Saturated, st.sat1, st.sat2)
		}
		if (s2.PollError != "") != st.wantPollErr2 {
			t.Fatalf("%s: poll error %q", st.name, s2.PollError)
		}
		if s1.Waiting == nil || *s1.Waiting != st.w1 {
			t.Fatalf("%s: waiting %v", st.name, s1.Waiting)
		}
	}
	if e1.hits.Load() != int64(len(steps)) {
		t.Fatalf("%d polls of worker 1, want one per round (%d)", e1.hits.Load(), len(steps))
	}
}

// TestDetectorSincePoll: a worker that reported a queue is assumed to
// queue what the router sent it since the poll.
func TestDetectorSincePoll(t *testing.T) {
	e := newFakeEngine(t)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ws := addWorkers(t, reg, worker.RoleRegular, e.srv.URL)
	d := NewDetector(SaturationConfig{Registry: reg, MaxWaiting: 4, PollInterval: time.Hour})
	for _, tc := range []struct {
		waiting  float64
		sent     int
		open     bool
		scenario string
	}{
		{0, 6, true, "no queue at the poll: no estimate"},
		{2, 1, true, "2 waiting + 1 sent < 4"},
		{2, 2, false, "2 waiting + 2 sent reach 4"},
	} {
		e.set(tc.waiting, 0, false)
		pollOnce(d)
		var rel []func()
		for range tc.sent {
			rel = append(rel, ws[0].Acquire())
		}
		if got := d.Open(0, true); got != tc.open {
			t.Errorf("%s: Open %v", tc.scenario, got)
		}
		for _, r := range rel {
			r()
		}
	}
}

func TestDetectorPDFleets(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	p := addWorkers(t, reg, worker.RolePrefill, "http://127.0.0.1:1")
	dec := addWorkers(t, reg, worker.RoleDecode, "http://127.0.0.1:2", "http://127.0.0.1:3")
	d := NewDetector(SaturationConfig{Registry: reg, PD: true, MaxInFlight: 1})
	if !d.Open(1, true) {
		t.Fatal("idle PD fleet saturated")
	}
	rp := p[0].Acquire() // the only prefill is saturated: hold, decodes idle
	if d.Open(1, true) {
		t.Fatal("saturated prefill fleet must hold requests")
	}
	rp()
	r1, r2 := dec[0].Acquire(), dec[1].Acquire()
	if d.Open(2, true) {
		t.Fatal("saturated decode fleet must hold requests")
	}
	r1()
	if d.Open(2, true) {
		t.Fatal("decode capacity 2 with 2 slots in use must hold")
	}
	if !d.Open(1, true) {
		t.Fatal("one decode free")
	}
	r2()
}

func TestDetectorRunKicksAndStops(t *testing.T) {
	e := newFakeEngine(t)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorkers(t, reg, worker.RoleRegular, e.srv.URL)
	d := NewDetector(SaturationConfig{Registry: reg, MaxWaiting: 1, PollInterval: 10 * time.Millisecond, Metrics: metrics.NewForTest()})
	var kicks atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); d.Run(ctx, func() { kicks.Add(1) }) }()
	deadline := time.Now().Add(10 * time.Second)
	for kicks.Load() < 3 || e.hits.Load() < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("kicks %d polls %d after 10 s", kicks.Load(), e.hits.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}
