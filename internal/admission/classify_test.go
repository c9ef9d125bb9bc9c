package admission

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

func TestClassify(t *testing.T) {
	now := time.Unix(1000, 0)
	bands, err := ParseBands([]string{"high=10", "default=0", "low=-10:5"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	const high, def, low = 0, 1, 2
	for _, tc := range []struct {
		name     string
		key      string
		hdr      map[string]string
		body     string
		band     int
		flow     string
		deadline time.Duration // 0 = none
		bad      string        // error substring
	}{
		{name: "nothing: default band, default flow", body: `{}`, band: def, flow: DefaultFlow},
		{name: "objective header by name", hdr: map[string]string{"X-Gateway-Inference-Objective": "high"}, body: `{}`, band: high, flow: DefaultFlow},
		{name: "objective header as a priority", hdr: map[string]string{"x-gateway-inference-objective": "-3"}, body: `{}`, band: low, flow: DefaultFlow},
		{name: "objective header beats the body", hdr: map[string]string{"x-gateway-inference-objective": "low"}, body: `{"priority":-10}`, band: low, flow: DefaultFlow},
		{name: "unknown objective", hdr: map[string]string{"x-gateway-inference-objective": "gold"}, body: `{}`, bad: `unknown inference objective "gold"`},
		{name: "vLLM priority: lower is earlier", body: `{"priority":-10}`, band: high, flow: DefaultFlow},
		{name: "vLLM priority 0", body: `{"priority":0}`, band: def, flow: DefaultFlow},
		{name: "vLLM priority above every band", body: `{"priority":50}`, band: low, flow: DefaultFlow},
		{name: "vLLM priority between bands", body: `{"priority":-5}`, band: def, flow: DefaultFlow},
		{name: "non-integer priority is vLLM's to reject", body: `{"priority":"x"}`, band: def, flow: DefaultFlow},
		{name: "fairness header", hdr: map[string]string{"x-gateway-inference-fairness-id": "tenant-a"}, body: `{}`, band: def, flow: "tenant-a"},
		{name: "user field", key: FairnessUser, body: `{"user":"alice"}`, band: def, flow: "alice"},
		{name: "user key ignores the header", key: FairnessUser, hdr: map[string]string{"x-gateway-inference-fairness-id": "t"}, body: `{}`, band: def, flow: DefaultFlow},
		{name: "api key is hashed", key: FairnessAPIKey, hdr: map[string]string{"Authorization": "Bearer sk-secret"}, body: `{}`, band: def, flow: "key-"},
		{name: "too long a flow id", hdr: map[string]string{"x-gateway-inference-fairness-id": strings.Repeat("x", 300)}, body: `{}`, bad: "longer than 256"},
		{name: "deadline header", hdr: map[string]string{"x-envoy-expected-rq-timeout-ms": "1500"}, body: `{}`, band: def, flow: DefaultFlow, deadline: 1500 * time.Millisecond},
		{name: "absurd deadline is none", hdr: map[string]string{"x-envoy-expected-rq-timeout-ms": "1e300"}, body: `{}`, band: def, flow: DefaultFlow},
		{name: "bad deadline header", hdr: map[string]string{"x-envoy-expected-rq-timeout-ms": "soon"}, body: `{}`, bad: "must be a number of milliseconds"},
		{name: "negative deadline header", hdr: map[string]string{"x-envoy-expected-rq-timeout-ms": "-1"}, body: `{}`, bad: "must be a number of milliseconds"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl, err := newClassifier(FlowConfig{Bands: bands, FairnessKey: tc.key})
			if err != nil {
				t.Fatal(err)
			}
			h := http.Header{}
			for k, v := range tc.hdr {
				h.Set(k, v)
			}
			obj, err := rawjson.Parse([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			r, err := cl.classify(h, obj, now)
			if tc.bad != "" {
				if !errors.Is(err, ErrBadFlowRequest) || Status(err) != 400 || !strings.Contains(err.Error(), tc.bad) {
					t.Fatalf("err %v, want a 400 containing %q", err, tc.bad)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.Band != tc.band {
				t.Errorf("band %s, want %s", bands[r.Band].Name, bands[tc.band].Name)
			}
			if tc.key == FairnessAPIKey {
				if !strings.HasPrefix(r.Flow, tc.flow) || strings.Contains(r.Flow, "secret") || len(r.Flow) != 16 {
					t.Errorf("flow %q, want a key- hash", r.Flow)
				}
			} else if r.Flow != tc.flow {
				t.Errorf("flow %q, want %q", r.Flow, tc.flow)
			}
			var want time.Time
			if tc.deadline > 0 {
				want = now.Add(tc.deadline)
			}
			if !r.Deadline.Equal(want) {
				t.Errorf("deadline %v, want %v", r.Deadline, want)
			}
		})
	}
}

func TestParseBandsAndWeights(t *testing.T) {
	for _, tc := range []struct {
		in  []string
		bad string
	}{
		{in: []string{"a=1", "b=-2:0.5"}},
		{in: []string{"a=1", "b=-2:0.5:arrival"}},
		{in: nil, bad: "at least one band"},
		{in: []string{"a"}, bad: "want NAME=PRIORITY"},
		{in: []string{"a=x"}, bad: "not an integer"},
		{in: []string{"a=1", "a=2"}, bad: "repeated"},
		{in: []string{"a=1:-3"}, bad: "seconds >= 0"},
		{in: []string{"a=1:5:lifo"}, bad: "arrival or deadline"},
	} {
		bands, err := ParseBands(tc.in, time.Minute)
		if tc.bad != "" {
			if err == nil || !strings.Contains(err.Error(), tc.bad) {
				t.Errorf("%v: err %v, want %q", tc.in, err, tc.bad)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v: %v", tc.in, err)
		}
		if bands[0].QueueTimeout != time.Minute || bands[1].QueueTimeout != 500*time.Millisecond || bands[1].Priority != -2 {
			t.Errorf("bands %+v", bands)
		}
	}
	bands, err := ParseBands([]string{"a=1::deadline", "b=0:3:arrival"}, time.Minute)
	if err != nil || bands[0].Order != OrderDeadline || bands[0].QueueTimeout != time.Minute || bands[1].Order != OrderArrival || bands[1].QueueTimeout != 3*time.Second {
		t.Fatalf("orders: %+v %v", bands, err)
	}
	if _, err := NewScheduler(SchedulerConfig{Bands: []Band{{Name: "x", Order: "lifo"}}}); err == nil {
		t.Error("unknown order accepted by NewScheduler")
	}
	w, err := ParseWeights([]string{"a=2", "b=0.5"})
	if err != nil || w["a"] != 2 || w["b"] != 0.5 {
		t.Fatalf("weights %v %v", w, err)
	}
	for _, bad := range []string{"a", "a=0", "=1", "a=-1", "a=x"} {
		if _, err := ParseWeights([]string{bad}); err == nil {
			t.Errorf("weight %q accepted", bad)
		}
	}
	if _, err := newClassifier(FlowConfig{Bands: []Band{{Name: "x"}}, DefaultBand: "nope"}); err == nil {
		t.Error("unknown default band accepted")
	}
	if _, err := newClassifier(FlowConfig{Bands: []Band{{Name: "x"}}, FairnessKey: "ip"}); err == nil {
		t.Error("unknown fairness key accepted")
	}
}

// TestLimiterAdmit: with flow control Admit classifies (400 for a bad
// header), applies the rate limit, and queues by band; without, it is
// Acquire.
func TestLimiterAdmit(t *testing.T) {
	bands, _ := ParseBands([]string{"high=1", "default=0"}, time.Minute)
	l, err := NewWithFlow(Config{MaxConcurrent: 1, QueueSize: 4, RateLimitPerSecond: 1, Burst: 2, Flow: &FlowConfig{Bands: bands}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if !l.FlowControl() || l.FlowQueued()["high"] != 0 {
		t.Fatal("flow control off")
	}
	bad := http.Header{}
	bad.Set(DefaultObjectiveHeader, "nope")
	if _, _, err := l.Admit(t.Context(), bad, nil); Status(err) != 400 {
		t.Fatalf("bad objective: %v", err)
	}
	rel, _, err := l.Admit(t.Context(), http.Header{}, nil)
	if err != nil || l.InUse() != 1 {
		t.Fatalf("first: %v in use %d", err, l.InUse())
	}
	rel.Release()
	_, _, _ = l.Admit(t.Context(), http.Header{}, nil) // second token (burst 2), slot taken
	if _, _, err := l.Admit(t.Context(), http.Header{}, nil); !errors.Is(err, ErrRateLimited) {
		t.Fatalf("over the rate: %v", err)
	}
	if _, err := NewWithFlow(Config{Flow: &FlowConfig{Bands: bands, FairnessKey: "nope"}}); err == nil {
		t.Fatal("bad flow config accepted")
	}
	off, err := NewWithFlow(Config{MaxConcurrent: 1})
	if err != nil || off.FlowControl() || off.FlowQueued() != nil || off.Saturation(nil) != nil {
		t.Fatalf("flow off: %v", err)
	}
	rel, _, err = off.Admit(t.Context(), http.Header{}, nil)
	if err != nil || off.InUse() != 1 {
		t.Fatalf("flow off Admit: %v", err)
	}
	rel.Release()
}

// TestSlotReleasesOnce: a Slot frees its limiter slot at the first
// Release and never again, with or without flow control; the zero Slot's
// Release does nothing. Without flow control, admitting and releasing
// allocates nothing.
func TestSlotReleasesOnce(t *testing.T) {
	bands := []Band{{Name: "high", Priority: 1}, {Name: "low"}}
	withFlow, err := NewWithFlow(Config{MaxConcurrent: 2, Flow: &FlowConfig{Bands: bands}})
	if err != nil {
		t.Fatal(err)
	}
	defer withFlow.Close()
	for name, l := range map[string]*Limiter{"plain": New(Config{MaxConcurrent: 2}), "flow": withFlow} {
		a, _, err := l.Admit(t.Context(), http.Header{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _, err := l.Admit(t.Context(), http.Header{}, nil)
		if err != nil || l.InUse() != 2 {
			t.Fatalf("%s: %v, in use %d", name, err, l.InUse())
		}
		a.Release()
		a.Release()
		if l.InUse() != 1 {
			t.Fatalf("%s: in use %d after releasing one slot twice, want 1", name, l.InUse())
		}
		b.Release()
		var zero Slot
		zero.Release()
		if l.InUse() != 0 {
			t.Fatalf("%s: in use %d, want 0", name, l.InUse())
		}
	}
	l := New(Config{MaxConcurrent: 4})
	if n := testing.AllocsPerRun(100, func() {
		s, _, err := l.Admit(t.Context(), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		s.Release()
	}); n != 0 {
		t.Errorf("Admit and Release allocate %v times, want 0", n)
	}
}

// TestEnginePriority: with FlowConfig.EnginePriority a request's band is
// carried to vLLM as -band priority unless the body has its own "priority"
// or the value is vLLM's default 0; without the option (or without flow
// control) nothing is added.
func TestEnginePriority(t *testing.T) {
	bands, _ := ParseBands([]string{"high=10", "default=0", "low=-10"}, time.Minute)
	on, err := NewWithFlow(Config{Flow: &FlowConfig{Bands: bands, EnginePriority: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer on.Close()
	optOff, _ := NewWithFlow(Config{Flow: &FlowConfig{Bands: bands}})
	defer optOff.Close()
	flowOff, _ := NewWithFlow(Config{})
	for _, tc := range []struct {
		name string
		l    *Limiter
		obj  string
		hdr  string
		want int64
		ok   bool
	}{
		{"high band", on, `{}`, "high", -10, true},
		{"low band", on, `{}`, "low", 10, true},
		{"integer objective", on, `{}`, "-3", 10, true},
		{"default band adds nothing", on, `{}`, "", 0, false},
		{"the body's priority is kept", on, `{"priority":3}`, "high", 0, false},
		{"a null priority is the body's too", on, `{"priority":null}`, "high", 0, false},
		{"option off", optOff, `{}`, "high", 0, false},
		{"flow control off", flowOff, `{}`, "high", 0, false},
	} {
		h := http.Header{}
		if tc.hdr != "" {
			h.Set(DefaultObjectiveHeader, tc.hdr)
		}
		obj, err := rawjson.Parse([]byte(tc.obj))
		if err != nil {
			t.Fatal(err)
		}
		if p, ok := tc.l.EnginePriority(h, obj); p != tc.want || ok != tc.ok {
			t.Errorf("%s: (%d, %v), want (%d, %v)", tc.name, p, ok, tc.want, tc.ok)
		}
	}
	if _, ok := on.EnginePriority(http.Header{}, nil); ok {
		t.Error("nil body: ok")
	}
}
