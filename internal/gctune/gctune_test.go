package gctune

import (
	"runtime"
	"runtime/metrics"
	"testing"
	"time"
)

func TestPercentFor(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		name        string
		live, floor uint64
		base, want  int
	}{
		{"live above the floor", 64 * mib, 32 * mib, 100, 100},
		{"live at the floor", 32 * mib, 32 * mib, 100, 100},
		{"default goal already above the floor", 20 * mib, 32 * mib, 100, 100},
		{"a quarter of the floor", 8 * mib, 32 * mib, 100, 300},
		{"a tenth, rounded up to 10 points", 3 * mib, 32 * mib, 100, 970},
		{"nothing live", 0, 32 * mib, 100, maxPercent},
		{"a tiny heap is capped", 1000, 32 * mib, 100, maxPercent},
		{"base 200", 8 * mib, 32 * mib, 200, 300},
		{"base 50 steps by 5", 7 * mib, 32 * mib, 50, 360},
		{"GC off stays off", 1 * mib, 32 * mib, -1, -1},
	} {
		if got := PercentFor(c.live, c.floor, c.base); got != c.want {
			t.Errorf("%s: PercentFor(%d, %d, %d) = %d, want %d", c.name, c.live, c.floor, c.base, got, c.want)
		}
		// The goal is at the floor or above it, unless capped or at base.
		if p := PercentFor(c.live, c.floor, c.base); p > c.base && p < maxPercent && c.live*uint64(100+p)/100 < c.floor {
			t.Errorf("%s: goal %d below the floor %d", c.name, c.live*uint64(100+p)/100, c.floor)
		}
	}
}

// gogc reads the GOGC the runtime applies.
func gogc(t *testing.T) int {
	t.Helper()
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 {
		t.Fatal("no /gc/gogc:percent")
	}
	return int(s[0].Value.Uint64())
}

// waitPercent collects until the tuner has set a GOGC that ok accepts.
func waitPercent(t *testing.T, tu *Tuner, ok func(int) bool) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		if p := tu.Percent(); ok(p) {
			return p
		}
		if time.Now().After(deadline) {
			t.Fatalf("GOGC still %d (runtime %d) after 10 s of collections", tu.Percent(), gogc(t))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestFloorRaisesAndRestores: with a floor far above this test's live heap
// the tuner raises GOGC after a collection (the runtime applies it), and
// Stop puts the base back.
func TestFloorRaisesAndRestores(t *testing.T) {
	tu := Start(512<<20, 100)
	p := waitPercent(t, tu, func(p int) bool { return p > 100 })
	if got := gogc(t); got != p {
		t.Fatalf("tuner set %d, runtime applies %d", p, got)
	}
	tu.Stop()
	if got := gogc(t); got != 100 {
		t.Fatalf("GOGC %d after Stop, want 100", got)
	}
	runtime.GC()
	runtime.GC()
	time.Sleep(20 * time.Millisecond)
	if got := gogc(t); got != 100 {
		t.Fatalf("GOGC %d after Stop and collections, want 100 (the chain did not end)", got)
	}
}

// TestLargeLiveHeapKeepsBase: a live heap above the floor leaves GOGC at
// its base.
func TestLargeLiveHeapKeepsBase(t *testing.T) {
	live := make([][]byte, 48)
	for i := range live {
		live[i] = make([]byte, 1<<20)
	}
	tu := Start(32<<20, 100)
	defer tu.Stop()
	deadline := time.Now().Add(10 * time.Second)
	for runs := 0; runs < 2; {
		runtime.GC()
		time.Sleep(5 * time.Millisecond)
		tu.mu.Lock()
		runs = tu.runs
		tu.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("the tuner ran %d times in 10 s of collections", runs)
		}
	}
	if p, got := tu.Percent(), gogc(t); p != 100 || got != 100 {
		t.Fatalf("GOGC %d (runtime %d) with %d MiB live above a 32 MiB floor, want 100", p, got, len(live))
	}
	runtime.KeepAlive(live)
}

func TestZeroFloorInstallsNothing(t *testing.T) {
	if tu := Start(0, 100); tu != nil {
		t.Fatal("a zero floor returned a tuner")
	}
	var tu *Tuner
	tu.Stop() // nil: no panic
}
