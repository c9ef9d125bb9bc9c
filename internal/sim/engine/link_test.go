package engine

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

func withLink(t *testing.T, f func(t *testing.T, l *Link)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		l := NewLink()
		done := make(chan struct{})
		go func() { l.Run(ctx); close(done) }()
		f(t, l)
		cancel()
		<-done
	})
}

func layerTimes(start time.Time, compute time.Duration, n int) []time.Time {
	out := make([]time.Time, n)
	for i := range n {
		out[i] = start.Add(time.Duration(i+1) * compute / time.Duration(n))
	}
	return out
}

func TestLinkWritesTrackLayers(t *testing.T) {
	withLink(t, func(t *testing.T, l *Link) {
		start := time.Now()
		ended := make(chan time.Time, 1)
		// 4 layers of 10 ms compute, 2 ms writes: the last write ends 2 ms
		// after the forward.
		l.Add("t", layerTimes(start, 40*time.Millisecond, 4), 2*time.Millisecond, false, func(end time.Time) { ended <- end })
		end := <-ended
		if d := end.Sub(start); d != 42*time.Millisecond {
			t.Errorf("done at %v, want 42ms", d)
		}
		if now := time.Now(); !now.Equal(end) {
			t.Errorf("done ran at %v, want at the simulated end %v", now.Sub(start), end.Sub(start))
		}
	})
}

func TestLinkGateDelaysWrites(t *testing.T) {
	withLink(t, func(t *testing.T, l *Link) {
		start := time.Now()
		ended := make(chan time.Time, 1)
		l.Add("t", layerTimes(start, 40*time.Millisecond, 4), 5*time.Millisecond, true, func(end time.Time) { ended <- end })
		time.Sleep(25 * time.Millisecond)
		if !l.Open("t", time.Now()) {
			t.Fatal("Open returned false")
		}
		end := <-ended
		// Layers 0 and 1 wait for the gate (25 ms) and run 25-30, 30-35;
		// layer 2 (ready 30) runs 35-40, layer 3 (ready 40) runs 40-45.
		if d := end.Sub(start); d != 45*time.Millisecond {
			t.Errorf("done at %v, want 45ms", d)
		}
	})
}

func TestLinkSerialisesTransfers(t *testing.T) {
	withLink(t, func(t *testing.T, l *Link) {
		start := time.Now()
		ends := make(chan string, 2)
		same := layerTimes(start, 10*time.Millisecond, 2) // ready at 5, 10
		l.Add("a", same, 4*time.Millisecond, false, func(time.Time) { ends <- "a" })
		l.Add("b", same, 4*time.Millisecond, false, func(time.Time) { ends <- "b" })
		first, second := <-ends, <-ends
		// a0 5-9, b0 9-13, a1 13-17, b1 17-21.
		if first != "a" || second != "b" {
			t.Errorf("order %s,%s", first, second)
		}
		if d := time.Since(start); d != 21*time.Millisecond {
			t.Errorf("last done at %v, want 21ms", d)
		}
	})
}

func TestLinkCancel(t *testing.T) {
	withLink(t, func(t *testing.T, l *Link) {
		fired := make(chan struct{}, 1)
		l.Add("t", layerTimes(time.Now(), 10*time.Millisecond, 2), time.Millisecond, true, func(time.Time) { fired <- struct{}{} })
		l.Cancel("t")
		if l.Open("t", time.Now()) {
			t.Error("Open after Cancel returned true")
		}
		time.Sleep(time.Second)
		select {
		case <-fired:
			t.Error("cancelled transfer fired")
		default:
		}
		if l.Pending() != 0 {
			t.Errorf("pending %d", l.Pending())
		}
	})
}
