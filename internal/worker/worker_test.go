package worker

import (
	"testing"
	"time"
)

func TestParseZMQAddress(t *testing.T) {
	tests := []struct {
		in      string
		want    ZMQAddr
		wantErr bool
	}{
		{"host:10.0.0.1,handshake:6301,notify:61005", ZMQAddr{Host: "10.0.0.1", Handshake: 6301, Notify: 61005}, false},
		{"host:::1,handshake:6301,notify:61005", ZMQAddr{Host: "::1", Handshake: 6301, Notify: 61005}, false},
		{"10.0.0.2:21001", ZMQAddr{Host: "10.0.0.2", Port: 21001}, false},
		{"[::1]:21001", ZMQAddr{Host: "::1", Port: 21001}, false},
		{"host:1.2.3.4,handshake:x,notify:1", ZMQAddr{}, true},
		{"host:1.2.3.4,handshake:1", ZMQAddr{}, true},
		{"", ZMQAddr{}, true},
		{"nonsense", ZMQAddr{}, true},
	}
	for _, tt := range tests {
		got, err := ParseZMQAddress(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("%q: err = %v", tt.in, err)
			continue
		}
		if !tt.wantErr && got != tt.want {
			t.Errorf("%q: got %+v want %+v", tt.in, got, tt.want)
		}
	}
}

func TestNormalizeURL(t *testing.T) {
	tests := []struct {
		in, base string
		rank     int
		wantErr  string
	}{
		{"http://h:8000/", "http://h:8000", -1, ""},
		{"http://h:8000@3", "http://h:8000", 3, ""},
		{"http://[::1]:8000@0", "http://[::1]:8000", 0, ""},
		{"https://x.y", "https://x.y", -1, ""},
		{"", "", -1, "URL cannot be empty"},
		{"h:8000", "", -1, "URL must start with http:// or https://"},
		{"http://", "", -1, "URL must have a valid host"},
	}
	for _, tt := range tests {
		base, rank, err := NormalizeURL(tt.in)
		if tt.wantErr != "" {
			if err == nil || err.Error() != tt.wantErr {
				t.Errorf("%q: err %v want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil || base != tt.base || rank != tt.rank {
			t.Errorf("%q: got %q %d %v", tt.in, base, rank, err)
		}
	}
}

func TestRegistryUpsertKeepsState(t *testing.T) {
	r := NewRegistry(BreakerConfig{})
	var changes int
	r.Subscribe(func(Change) { changes++ })
	spec := Spec{URL: "http://a:1", Role: RolePrefill, DPRank: -1, ZMQAddress: "z1"}
	ws, changed := r.Upsert("a:1", []Spec{spec}, time.Now())
	if !changed || len(ws) != 1 {
		t.Fatalf("first upsert: %v %v", ws, changed)
	}
	release := ws[0].Acquire()
	ws2, changed := r.Upsert("a:1", []Spec{spec}, time.Now())
	if changed || ws2[0] != ws[0] || ws2[0].Load() != 1 {
		t.Fatalf("same spec must keep worker and load")
	}
	release()
	release()
	if ws[0].Load() != 0 {
		t.Fatalf("release not idempotent: %d", ws[0].Load())
	}
	spec.ZMQAddress = "z2"
	ws3, changed := r.Upsert("a:1", []Spec{spec}, time.Now())
	if !changed || ws3[0] == ws[0] || r.Get(spec.Key()).ZMQAddress != "z2" {
		t.Fatalf("new zmq address must replace the entry")
	}
	if got := len(r.Snapshot().Prefill); got != 1 {
		t.Fatalf("prefill count %d", got)
	}
	// DP expansion: one instance, two ranks
	ds := ExpandDP(Spec{URL: "http://d:2", Role: RoleDecode, DPRank: -1}, 2)
	r.Upsert("d:2", ds, time.Now())
	if got := len(r.Snapshot().Decode); got != 2 || r.Get("http://d:2@1") == nil {
		t.Fatalf("decode ranks %d", got)
	}
	if n := len(r.RemoveInstance("d:2")); n != 2 {
		t.Fatalf("removed %d", n)
	}
	if changes != 4 {
		t.Fatalf("changes %d want 4", changes)
	}
	if _, err := r.Add(Spec{URL: "http://b:1", DPRank: -1}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Add(Spec{URL: "http://b:1", DPRank: -1}); !IsExists(err) {
		t.Fatalf("duplicate add: %v", err)
	}
}

func TestBreaker(t *testing.T) {
	now := time.Unix(0, 0)
	var trans []string
	b := NewBreaker(BreakerConfig{FailureThreshold: 3, SuccessThreshold: 2, OpenDuration: 10 * time.Second,
		Window: 10 * time.Second, FailureRate: 0.5, MinRequests: 1000, HalfOpenMax: 1,
		Now: func() time.Time { return now }, OnTransition: func(f, to BreakerState) { trans = append(trans, f.String()+">"+to.String()) }})
	for range 2 {
		b.Record(false)
	}
	if b.State() != BreakerClosed {
		t.Fatal("opened too early")
	}
	b.Record(true) // resets consecutive
	for range 3 {
		b.Record(false)
	}
	if b.State() != BreakerOpen || b.Allow() {
		t.Fatal("should be open")
	}
	now = now.Add(10 * time.Second)
	if !b.Allow() || b.State() != BreakerHalfOpen {
		t.Fatal("should be half-open")
	}
	done, ok := b.Start()
	if !ok {
		t.Fatal("first probe refused")
	}
	if _, ok := b.Start(); ok || b.Allow() {
		t.Fatal("second concurrent probe must be refused")
	}
	done(true)
	done2, _ := b.Start()
	done2(true)
	if b.State() != BreakerClosed {
		t.Fatalf("should be closed, got %v", b.State())
	}
	want := []string{"closed>open", "open>half_open", "half_open>closed"}
	if len(trans) != len(want) {
		t.Fatalf("transitions %v", trans)
	}
	for i := range want {
		if trans[i] != want[i] {
			t.Fatalf("transitions %v", trans)
		}
	}
}

func TestBreakerFailureRate(t *testing.T) {
	now := time.Unix(0, 0)
	b := NewBreaker(BreakerConfig{FailureThreshold: 100, Window: 10 * time.Second, FailureRate: 0.5, MinRequests: 10,
		Now: func() time.Time { return now }})
	for i := range 10 {
		b.Record(i%2 == 0) // alternating: 50% failures, never 2 consecutive
	}
	if b.State() != BreakerOpen {
		t.Fatal("failure rate should open the breaker")
	}
	// an old window's failures age out
	b2 := NewBreaker(BreakerConfig{FailureThreshold: 100, Window: 10 * time.Second, FailureRate: 0.5, MinRequests: 10,
		Now: func() time.Time { return now }})
	for range 9 {
		b2.Record(false)
	}
	now = now.Add(11 * time.Second)
	b2.Record(false)
	if b2.State() != BreakerClosed {
		t.Fatal("expired failures must not count")
	}
}

// TestBreakerNeutralOutcome: a neutral outcome neither resets nor extends
// the consecutive-failure count, never enters the failure-rate window and
// only gives back a half-open probe slot.
func TestBreakerNeutralOutcome(t *testing.T) {
	now := time.Unix(0, 0)
	newB := func(threshold, minReq int) *Breaker {
		return NewBreaker(BreakerConfig{FailureThreshold: threshold, SuccessThreshold: 1, OpenDuration: 10 * time.Second,
			Window: 10 * time.Second, FailureRate: 0.5, MinRequests: minReq, HalfOpenMax: 1, Now: func() time.Time { return now }})
	}
	start := func(b *Breaker) func(Outcome) {
		t.Helper()
		done, ok := b.StartOutcome()
		if !ok {
			t.Fatal("refused")
		}
		return done
	}

	// consecutive failures: neutral outcomes in between neither count nor reset
	b := newB(2, 1000)
	start(b)(OutcomeFailure)
	for range 5 {
		start(b)(OutcomeNeutral)
	}
	if b.State() != BreakerClosed {
		t.Fatal("neutral outcomes counted as failures")
	}
	done := start(b)
	done(OutcomeFailure)
	done(OutcomeSuccess) // only the first call counts
	if b.State() != BreakerOpen {
		t.Fatal("neutral outcomes reset the consecutive failures")
	}

	// failure rate: neutral outcomes are not in the window (2 failures of
	// 2 outcomes, not of 7)
	r := newB(100, 2)
	start(r)(OutcomeFailure)
	for range 5 {
		start(r)(OutcomeNeutral)
	}
	if r.State() != BreakerClosed {
		t.Fatal("neutral outcomes entered the window as failures")
	}
	start(r)(OutcomeFailure)
	if r.State() != BreakerOpen {
		t.Fatal("neutral outcomes entered the window as successes")
	}

	// half-open: a neutral probe gives its slot back and changes nothing
	now = now.Add(10 * time.Second)
	probe := start(b)
	if _, ok := b.StartOutcome(); ok {
		t.Fatal("second concurrent probe must be refused")
	}
	probe(OutcomeNeutral)
	if b.State() != BreakerHalfOpen || !b.Allow() {
		t.Fatalf("a neutral probe must give its slot back and leave the state (%v)", b.State())
	}
	start(b)(OutcomeSuccess)
	if b.State() != BreakerClosed {
		t.Fatalf("state %v after a successful probe", b.State())
	}

	// the bool form is unchanged
	for range 2 {
		d, ok := b.Start()
		if !ok {
			t.Fatal("refused")
		}
		d(false)
	}
	if b.State() != BreakerOpen {
		t.Fatal("Start's done(false) must record failures")
	}
	// a nil breaker accepts anything
	var nb *Breaker
	f, ok := nb.StartOutcome()
	if !ok {
		t.Fatal("nil breaker refused")
	}
	f(OutcomeFailure)
}

func TestSlotCounts(t *testing.T) {
	w := New(Spec{URL: "http://a:1", DPRank: -1}, BreakerConfig{})
	fired := 0
	hook := func() { fired++ }
	w.OnPrefillDone(&hook)
	check := func(step string, load, pre, top int64, hooks int) {
		t.Helper()
		if w.Load() != load || w.Prefilling() != pre || w.PrefillingTop() != top || fired != hooks {
			t.Fatalf("%s: load %d prefilling %d top %d hooks %d, want %d %d %d %d",
				step, w.Load(), w.Prefilling(), w.PrefillingTop(), fired, load, pre, top, hooks)
		}
	}
	var low, hi1, hi2 Slot
	low.Start(w, false)
	hi1.Start(w, true)
	hi2.Start(w, true)
	check("started", 3, 3, 2, 0)
	hi1.FirstByte()
	hi1.FirstByte() // idempotent
	check("one top streams", 3, 2, 1, 0)
	low.FirstByte()
	check("low streams", 3, 1, 1, 0)
	hi2.Release() // ended before its first byte (an error, a client gone): both counts reach 0, one call
	check("last top released", 2, 0, 0, 1)
	hi2.Release()
	hi2.FirstByte() // after release: nothing
	check("released twice", 2, 0, 0, 1)
	hi1.Release()
	low.Release()
	check("all released", 0, 0, 0, 1)
	release := w.Acquire() // counts as awaiting its first byte until released
	check("acquired", 1, 1, 0, 1)
	release()
	release()
	check("acquire released", 0, 0, 0, 2) // Prefilling dropped to 0 again
	if w.TotalRequests() != 4 {
		t.Fatalf("total %d, want 4", w.TotalRequests())
	}
}

// TestBreakerTicket: Begin holds a half-open probe slot until Finish; a
// neutral Finish only gives it back, a success closes the breaker; a
// disabled breaker's ticket records nothing.
func TestBreakerTicket(t *testing.T) {
	now := time.Unix(0, 0)
	b := NewBreaker(BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, OpenDuration: time.Second,
		Window: 10 * time.Second, FailureRate: 0.5, MinRequests: 1000, HalfOpenMax: 1, Now: func() time.Time { return now }})
	b.Record(false)
	if _, ok := b.Begin(); ok || b.State() != BreakerOpen {
		t.Fatalf("open breaker let a request through (state %v)", b.State())
	}
	now = now.Add(time.Second)
	tk, ok := b.Begin()
	if !ok || b.State() != BreakerHalfOpen {
		t.Fatalf("probe refused (state %v)", b.State())
	}
	if _, ok := b.Begin(); ok {
		t.Fatal("a second probe got through while the first holds the slot")
	}
	tk.Finish(OutcomeNeutral)
	if b.State() != BreakerHalfOpen {
		t.Fatalf("neutral outcome moved the breaker to %v", b.State())
	}
	tk, ok = b.Begin()
	if !ok {
		t.Fatal("the neutral outcome did not give the probe slot back")
	}
	tk.Finish(OutcomeSuccess)
	if b.State() != BreakerClosed {
		t.Fatalf("successful probe left the breaker %v", b.State())
	}

	d := NewBreaker(BreakerConfig{Disabled: true})
	for range 10 {
		tk, ok := d.Begin()
		if !ok {
			t.Fatal("disabled breaker refused")
		}
		tk.Finish(OutcomeFailure)
	}
	if d.State() != BreakerClosed {
		t.Fatalf("disabled breaker moved to %v", d.State())
	}
}
