package worker

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

func TestConnectFailedHintThenConfirm(t *testing.T) {
	t0 := time.Now()
	tests := []struct {
		name       string
		second     time.Duration // after the first failure; <0 = no second failure
		probeFirst bool          // a passing probe between the two failures
		wantDown   bool
	}{
		{name: "one failure is a hint", second: -1},
		{name: "second failure within the window confirms", second: time.Second, wantDown: true},
		{name: "second failure after the window is a new hint", second: ConnectHintWindow + time.Second},
		{name: "a passing probe clears the hint", second: time.Second, probeFirst: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRegistry(BreakerConfig{})
			ws, err := r.Add(ExpandDP(Spec{URL: "http://10.0.0.1:8000", DPRank: -1}, 2)...)
			if err != nil {
				t.Fatal(err)
			}
			var probes [][]*Worker
			r.Subscribe(func(c Change) {
				if len(c.Probe) > 0 {
					probes = append(probes, c.Probe)
				}
			})
			if down := r.ConnectFailed(ws[0], t0); down != nil {
				t.Fatalf("first failure marked %v down", down)
			}
			if len(probes) != 1 || len(probes[0]) != 2 {
				t.Fatalf("probe requests %v, want one for both ranks", probes)
			}
			for _, w := range ws {
				if !w.Healthy() || !w.Suspect() {
					t.Fatalf("%s after one failure: healthy %v suspect %v", w.Key(), w.Healthy(), w.Suspect())
				}
			}
			if tt.second < 0 {
				return
			}
			if tt.probeFirst {
				for _, w := range ws {
					w.MarkProbed()
				}
				if ws[1].Suspect() || !ws[1].Probed() {
					t.Fatal("MarkProbed must clear the hint")
				}
			}
			down := r.ConnectFailed(ws[1], t0.Add(tt.second))
			if got := len(down) == 2; got != tt.wantDown {
				t.Fatalf("second failure: down %v, want down=%v", down, tt.wantDown)
			}
			for _, w := range ws {
				if w.Healthy() == tt.wantDown {
					t.Errorf("%s healthy=%v", w.Key(), w.Healthy())
				}
			}
			// an unhealthy worker is the prober's: nothing more to decide
			if tt.wantDown && r.ConnectFailed(ws[0], t0.Add(tt.second)) != nil {
				t.Error("an unhealthy worker reported down again")
			}
		})
	}
}

func TestWithSuspects(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	ws, _ := r.Add(Spec{URL: "http://a:1", DPRank: -1}, Spec{URL: "http://b:1", DPRank: -1}, Spec{URL: "http://c:1", DPRank: -1})
	if WithSuspects(ws, map[string]bool{"x": true}) != nil {
		t.Fatal("no suspect: nil expected")
	}
	r.ConnectFailed(ws[1], time.Now())
	in := map[string]bool{"http://a:1": true}
	got := WithSuspects(ws, in)
	if len(got) != 2 || !got["http://a:1"] || !got["http://b:1"] {
		t.Fatalf("got %v", got)
	}
	if len(in) != 1 {
		t.Fatal("the caller's map was modified")
	}
	if WithSuspects(ws, map[string]bool{"http://b:1": true}) != nil {
		t.Fatal("an already excluded suspect needs no new map")
	}
}

func TestPanicPick(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	ws, _ := r.Add(Spec{URL: "http://a:1", DPRank: -1}, Spec{URL: "http://b:1", DPRank: -1}, Spec{URL: "http://c:1", DPRank: -1})
	for _, w := range ws {
		w.SetHealthy(false)
	}
	ws[2].SetRoutable(false) // held aside: never routed, even in panic
	rel := ws[0].Acquire()   // a busier than b
	defer rel()
	var buf bytes.Buffer
	picks := 0
	p := &Panic{Logger: slog.New(slog.NewTextHandler(&buf, nil)), OnPick: func(r Role) {
		if r != RoleDecode {
			t.Errorf("role %v", r)
		}
		picks++
	}}
	for range 4 {
		if w := p.Pick(RoleDecode, ws, nil); w != ws[1] {
			t.Fatalf("picked %v, want the least loaded routable one", w)
		}
	}
	if w := p.Pick(RoleDecode, ws, func(w *Worker) bool { return w == ws[1] }); w != ws[0] {
		t.Fatalf("skip ignored: %v", w)
	}
	if w := p.Pick(RoleDecode, ws, func(*Worker) bool { return true }); w != nil {
		t.Fatalf("everything skipped, picked %v", w)
	}
	if picks != 5 {
		t.Errorf("OnPick called %d times, want 5", picks)
	}
	if n := strings.Count(buf.String(), "panic routing:"); n != 1 {
		t.Errorf("%d panic log lines for one panic period, want 1:\n%s", n, buf.String())
	}
	p.Normal(RoleDecode)
	p.Normal(RoleDecode)
	if n := strings.Count(buf.String(), "panic routing over"); n != 1 {
		t.Errorf("%d end-of-panic lines, want 1", n)
	}
	p.Pick(RoleDecode, ws, nil)
	if n := strings.Count(buf.String(), "panic routing:"); n != 2 {
		t.Errorf("a new panic period must be logged again (%d lines)", n)
	}
	off := &Panic{Disabled: true}
	if off.Pick(RoleDecode, ws, nil) != nil || (*Panic)(nil).Pick(RoleDecode, ws, nil) != nil {
		t.Error("disabled or nil panic must never pick")
	}
	(*Panic)(nil).Normal(RoleDecode) // no panic
}

// A breaker that opens asks for a probe of its worker; HalfOpen lets
// traffic test a worker that came back without waiting out the timeout.
func TestBreakerOpenRequestsProbeAndHalfOpen(t *testing.T) {
	var transitions []string
	r := NewRegistry(BreakerConfig{FailureThreshold: 2, SuccessThreshold: 1, OpenDuration: time.Hour, HalfOpenMax: 1,
		OnTransitionFor: func(key string, from, to BreakerState) { transitions = append(transitions, key+":"+to.String()) }})
	ws, _ := r.Add(Spec{URL: "http://a:1", DPRank: -1})
	w := ws[0]
	var probes []string
	r.Subscribe(func(c Change) {
		for _, p := range c.Probe {
			probes = append(probes, p.Key())
		}
	})
	w.Breaker().Record(false)
	if len(probes) != 0 {
		t.Fatalf("probe before the breaker opened: %v", probes)
	}
	w.Breaker().Record(false)
	if w.Breaker().State() != BreakerOpen || len(probes) != 1 || probes[0] != "http://a:1" {
		t.Fatalf("state %v probes %v", w.Breaker().State(), probes)
	}
	if !w.Breaker().HalfOpen() || w.Breaker().State() != BreakerHalfOpen || w.Breaker().HalfOpen() {
		t.Fatalf("HalfOpen: state %v", w.Breaker().State())
	}
	if len(transitions) != 2 || transitions[1] != "http://a:1:half_open" {
		t.Errorf("transitions %v: the caller's callback must still see every change", transitions)
	}
}

// A re-registration (identical heartbeat) of an instance whose workers are
// unhealthy asks for a probe of them at once; a healthy one asks nothing.
func TestReRegistrationOfUnhealthyProbes(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	spec := Spec{URL: "http://a:1", Role: RolePrefill, DPRank: -1}
	ws, _ := r.Upsert("a:1", []Spec{spec}, time.Now())
	var probes int
	r.Subscribe(func(c Change) { probes += len(c.Probe) })
	r.Upsert("a:1", []Spec{spec}, time.Now())
	if probes != 0 {
		t.Fatalf("a healthy instance's heartbeat asked for %d probes", probes)
	}
	ws[0].SetHealthy(false)
	if _, changed := r.Upsert("a:1", []Spec{spec}, time.Now()); changed || probes != 1 {
		t.Fatalf("changed %v probes %d, want an unchanged registry and one probe", changed, probes)
	}
}

// No panic while some worker is available, even if this request excluded it.
func TestPanicNotWhileOneAvailable(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	ws, _ := r.Add(Spec{URL: "http://a:1", DPRank: -1}, Spec{URL: "http://b:1", DPRank: -1})
	ws[1].SetHealthy(false)
	p := &Panic{}
	if w := p.Pick(RoleRegular, ws, func(w *Worker) bool { return w == ws[0] }); w != nil {
		t.Fatalf("panic pick %v while %v is available", w, ws[0])
	}
}
