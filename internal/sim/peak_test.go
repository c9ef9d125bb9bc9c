package sim

import (
	"runtime"
	"sync"
	"testing"
)

func TestCountersPeakInFlight(t *testing.T) {
	var c counters
	outs := make([]func(), 0, 5)
	for range 5 {
		outs = append(outs, c.enter())
	}
	for _, out := range outs[:3] {
		out()
	}
	c.enter()()
	if got := c.inflight.Load(); got != 2 {
		t.Errorf("in flight %d, want 2", got)
	}
	if got := c.peakInflight.Load(); got != 5 {
		t.Errorf("peak %d, want 5", got)
	}

	// concurrent entries: the peak is never below the most seen at once
	var wg sync.WaitGroup
	start := make(chan struct{})
	hold := make(chan struct{})
	for range 50 {
		wg.Go(func() {
			<-start
			out := c.enter()
			<-hold
			out()
		})
	}
	close(start)
	for c.inflight.Load() < 52 {
		runtime.Gosched()
	}
	close(hold)
	wg.Wait()
	if got := c.peakInflight.Load(); got != 52 {
		t.Errorf("peak %d after 50 concurrent entries over 2 held, want 52", got)
	}
}
