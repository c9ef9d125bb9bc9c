package legctx

import (
	"sync"
	"testing"
	"time"
)

func TestSlots(t *testing.T) {
	var s Slots[string]
	a, okA := s.Put("a")
	b, okB := s.Put("b")
	if _, ok := s.Put("c"); !okA || !okB || ok || a == b {
		t.Fatalf("Put: ids %d %d, ok %v %v, third accepted %v", a, b, okA, okB, ok)
	}
	if s.Remove(0) || !s.Remove(a) || s.Remove(a) {
		t.Fatalf("Remove: id 0 or a removed id reported present, or a present one absent")
	}
	c, ok := s.Put("c")
	if !ok || c == a || c == b {
		t.Fatalf("a freed slot: id %d ok %v (ids are never reused)", c, ok)
	}
	var got []string
	s.Take().Each(func(v string) { got = append(got, v) })
	if len(got) != 2 || s.Has(0) || s.Has(1) {
		t.Fatalf("Take: got %v, slots still held %v %v", got, s.Has(0), s.Has(1))
	}
}

func TestAfterFuncs(t *testing.T) {
	var mu sync.Mutex
	var a AfterFuncs
	ran := make(chan int, 4)
	var stops []func() bool
	mu.Lock()
	for i := range 4 { // two inline, two allocated
		stops = append(stops, a.Add(&mu, func() { ran <- i }))
	}
	mu.Unlock()
	if !stops[1]() || !stops[2]() || stops[1]() {
		t.Fatalf("stop: a pending registration reported stopped=false, or a stopped one true")
	}
	mu.Lock()
	if a.Len() != 2 {
		t.Fatalf("%d pending, want 2", a.Len())
	}
	fire := a.Take()
	mu.Unlock()
	if stops[0]() {
		t.Fatalf("stop after Take reported true")
	}
	fire.Run()
	seen := map[int]bool{}
	for range 2 {
		select {
		case i := <-ran:
			seen[i] = true
		case <-time.After(5 * time.Second):
			t.Fatalf("registrations did not run: %v", seen)
		}
	}
	if !seen[0] || !seen[3] {
		t.Errorf("ran %v, want 0 and 3", seen)
	}
}
