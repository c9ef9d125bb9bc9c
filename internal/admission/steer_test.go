package admission

import (
	"context"
	"maps"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// wstate is one worker's state in a steering case: slots in flight, how
// many of them already streamed (past the first byte), how many are of
// the highest band and still in prefill.
type wstate struct {
	lowPrefill, topPrefill, streaming int
	down                              bool
}

func steerFleet(t *testing.T, states []wstate) ([]*worker.Worker, func()) {
	t.Helper()
	reg := worker.NewRegistry(worker.BreakerConfig{})
	var urls []string
	for i := range states {
		urls = append(urls, "http://127.0.0.1:"+string(rune('1'+i)))
	}
	ws := addWorkers(t, reg, worker.RoleRegular, urls...)
	var slots []*worker.Slot
	for i, st := range states {
		for range st.lowPrefill {
			s := new(worker.Slot)
			s.Start(ws[i], false)
			slots = append(slots, s)
		}
		for range st.topPrefill {
			s := new(worker.Slot)
			s.Start(ws[i], true)
			slots = append(slots, s)
		}
		for range st.streaming {
			s := new(worker.Slot)
			s.Start(ws[i], false)
			s.FirstByte()
			slots = append(slots, s)
		}
		ws[i].SetHealthy(!st.down)
	}
	return ws, func() {
		for _, s := range slots {
			s.Release()
		}
	}
}

func TestSteer(t *testing.T) {
	for _, tc := range []struct {
		name    string
		steer   Steer
		top     bool
		states  []wstate
		exclude []int // request's own excludes (worker indexes)
		want    []int // excluded worker indexes; nil = no narrowing
	}{
		{name: "top: the worker without prefill", steer: Steer{AvoidPrefill: true}, top: true,
			states: []wstate{{lowPrefill: 1}, {streaming: 5}}, want: []int{0}},
		{name: "top: fewest in prefill", steer: Steer{AvoidPrefill: true}, top: true,
			states: []wstate{{lowPrefill: 2}, {lowPrefill: 1, topPrefill: 1}, {lowPrefill: 1}}, want: []int{0, 1}},
		{name: "top: all equal, no narrowing", steer: Steer{AvoidPrefill: true}, top: true,
			states: []wstate{{lowPrefill: 1}, {topPrefill: 1}}, want: nil},
		{name: "top: a worker at its in-flight limit is not preferred", steer: Steer{AvoidPrefill: true, MaxInFlight: 4}, top: true,
			states: []wstate{{streaming: 4}, {lowPrefill: 1, streaming: 1}}, want: []int{0}},
		{name: "top: every worker at its limit, no narrowing", steer: Steer{AvoidPrefill: true, MaxInFlight: 1}, top: true,
			states: []wstate{{streaming: 1}, {lowPrefill: 1}}, want: nil},
		{name: "top: unavailable and excluded workers ignored", steer: Steer{AvoidPrefill: true}, top: true,
			states: []wstate{{down: true}, {lowPrefill: 1}, {lowPrefill: 2}, {}}, exclude: []int{3}, want: []int{2, 3}},
		{name: "top: rule off", steer: Steer{IsolatePrefill: true}, top: true,
			states: []wstate{{lowPrefill: 1}, {}}, want: nil},
		{name: "low: held off a worker with a top request in prefill", steer: Steer{IsolatePrefill: true},
			states: []wstate{{topPrefill: 1}, {lowPrefill: 3}}, want: []int{0}},
		{name: "low: every worker held, no narrowing (the gate holds)", steer: Steer{IsolatePrefill: true},
			states: []wstate{{topPrefill: 1}, {topPrefill: 2}}, want: nil},
		{name: "low: a top request past its first byte holds nothing", steer: Steer{IsolatePrefill: true},
			states: []wstate{{streaming: 1}, {lowPrefill: 1}}, want: nil},
		{name: "low: rule off", steer: Steer{AvoidPrefill: true},
			states: []wstate{{topPrefill: 1}, {}}, want: nil},
		{name: "low: reserve 1 joins the worker already prefilling", steer: Steer{PrefillReserve: 1},
			states: []wstate{{lowPrefill: 1}, {streaming: 1}}, want: []int{1}},
		{name: "low: reserve 1 with two free workers, no narrowing", steer: Steer{PrefillReserve: 1},
			states: []wstate{{streaming: 3}, {streaming: 1}}, want: nil},
		{name: "low: reserve 1, three workers, one prefilling: free ones may go", steer: Steer{PrefillReserve: 1},
			states: []wstate{{lowPrefill: 1}, {}, {}}, want: nil},
		{name: "low: reserve 2, three workers, one prefilling", steer: Steer{PrefillReserve: 2},
			states: []wstate{{lowPrefill: 1}, {}, {}}, want: []int{1, 2}},
		{name: "low: a free worker at its limit is no reserve", steer: Steer{PrefillReserve: 1, MaxInFlight: 2},
			states: []wstate{{streaming: 2}, {streaming: 1}, {lowPrefill: 1}}, want: []int{0, 1}},
		{name: "low: nothing to join below its limit: a free worker may go", steer: Steer{PrefillReserve: 1, MaxInFlight: 2},
			states: []wstate{{lowPrefill: 2}, {streaming: 1}}, want: nil},
		{name: "low: one worker, nothing to join: never held", steer: Steer{PrefillReserve: 1},
			states: []wstate{{streaming: 1}}, want: nil},
		{name: "low: reserve and isolation together", steer: Steer{PrefillReserve: 1, IsolatePrefill: true},
			states: []wstate{{topPrefill: 1}, {lowPrefill: 1}, {}}, want: []int{0, 2}},
		{name: "low: a top prefill is nothing to join under isolation", steer: Steer{PrefillReserve: 1, IsolatePrefill: true},
			states: []wstate{{topPrefill: 1}, {}}, want: []int{0}},
		{name: "low: the reserve alone joins a top prefill", steer: Steer{PrefillReserve: 1},
			states: []wstate{{topPrefill: 1}, {}}, want: []int{1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ws, done := steerFleet(t, tc.states)
			defer done()
			req := &policy.Request{Top: tc.top}
			for _, i := range tc.exclude {
				if req.Exclude == nil {
					req.Exclude = map[string]bool{}
				}
				req.Exclude[ws[i].Key()] = true
			}
			got := tc.steer.Steer(ws, req)
			var want map[string]bool
			for _, i := range tc.want {
				if want == nil {
					want = map[string]bool{}
				}
				want[ws[i].Key()] = true
			}
			if !maps.Equal(got, want) {
				t.Fatalf("excluded %v, want %v", slices.Sorted(maps.Keys(got)), slices.Sorted(maps.Keys(want)))
			}
		})
	}
}

func TestNewSteer(t *testing.T) {
	if NewSteer(nil) != nil || NewSteer(&SaturationConfig{MaxInFlight: 3}) != nil {
		t.Fatal("a steer without a rule")
	}
	if s := NewSteer(&SaturationConfig{MaxInFlight: 3, IsolatePrefill: true}); s == nil || s.MaxInFlight != 3 || s.AvoidPrefill || !s.IsolatePrefill {
		t.Fatalf("steer %+v", s)
	}
	if s := NewSteer(&SaturationConfig{PrefillReserve: 1}); s == nil || s.PrefillReserve != 1 {
		t.Fatalf("steer %+v", s)
	}
}

// TestIsolatePrefillGate: with IsolatePrefill, a lower-band request is held
// while every worker has a highest-band request awaiting its first byte,
// and goes the moment one of them streams (the worker's hook kicks the
// scheduler; the detector's own period is an hour, so nothing else does).
// The highest band is never held by the rule.
func TestIsolatePrefillGate(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		reg := worker.NewRegistry(worker.BreakerConfig{})
		ws := addWorkers(t, reg, worker.RoleRegular, "http://127.0.0.1:1", "http://127.0.0.1:2")
		d := NewDetector(SaturationConfig{Registry: reg, MaxInFlight: 8, PollInterval: time.Hour, IsolatePrefill: true})
		h := newHarness(t, SchedulerConfig{MaxConcurrent: 16, QueueSize: 10, Gate: d.Open})
		ctx, cancel := context.WithCancel(t.Context())
		var wg sync.WaitGroup
		wg.Go(func() { d.Run(ctx, h.s.Kick) })
		defer wg.Wait()
		defer cancel()
		synctest.Wait() // hooks armed

		var t0, t1 worker.Slot
		t0.Start(ws[0], true)
		t1.Start(ws[1], true)
		defer t0.Release()
		defer t1.Release()
		h.start(ctx, "low", FlowRequest{Band: bLow})
		h.start(ctx, "default", FlowRequest{Band: bDefault})
		h.start(ctx, "high", FlowRequest{Band: bHigh})
		if got := h.granted(); !slices.Equal(got, []string{"high"}) || h.s.Queued() != 2 {
			t.Fatalf("granted %v queued %d: the lower bands must wait while both workers prefill a high request", got, h.s.Queued())
		}
		time.Sleep(30 * time.Second) // virtual (the bands' queue timeout is a minute): nothing but a first byte opens it
		synctest.Wait()
		if got := h.granted(); len(got) != 1 {
			t.Fatalf("granted %v without a first byte", got)
		}
		t1.FirstByte()
		synctest.Wait()
		if got := h.granted(); len(got) != 3 || h.s.Queued() != 0 { // both in one dispatch round: any order
			t.Fatalf("granted %v after ws[1]'s high request streamed", got)
		}
		for _, n := range []string{"high", "default", "low"} {
			h.release(n)
		}
	})
}

// TestIsolatePrefillOff: without the rule, a high request in prefill on
// every worker holds nothing.
func TestIsolatePrefillOff(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	ws := addWorkers(t, reg, worker.RoleRegular, "http://127.0.0.1:1")
	d := NewDetector(SaturationConfig{Registry: reg, MaxInFlight: 8})
	var s worker.Slot
	s.Start(ws[0], true)
	defer s.Release()
	if !d.Open(1, false) {
		t.Fatal("held without --flow-isolate-prefill")
	}
	if ws := d.Worker(ws[0]); ws.AwaitingFirstByte != nil {
		t.Fatalf("/workers shows the prefill counts without a prefill rule: %+v", ws)
	}
	d = NewDetector(SaturationConfig{Registry: reg, MaxInFlight: 8, IsolatePrefill: true})
	if d.Open(1, false) || !d.Open(1, true) {
		t.Fatalf("with the rule: low open %v, top open %v; want held and open", d.Open(1, false), d.Open(1, true))
	}
	if ws := d.Worker(ws[0]); ws.AwaitingFirstByte == nil || *ws.AwaitingFirstByte != 1 || *ws.AwaitingFirstByteTop != 1 {
		t.Fatalf("/workers view %+v", ws)
	}
}
