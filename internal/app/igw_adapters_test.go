package app

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestAdapterRefreshRounds: a caller gets a round that starts after it
// came; callers arriving during a round share the next one; rounds start
// refreshEvery apart; the first caller's going away does not end the round
// it runs, and a waiter whose context ends returns.
func TestAdapterRefreshRounds(t *testing.T) {
	var reads atomic.Int32
	release := make(chan struct{})
	r := &adapterRefresh{
		learn: func(ctx context.Context, base, model string) {
			reads.Add(1)
			select {
			case <-release:
			case <-ctx.Done():
				t.Error("a read's context ended: the first caller's going away ended the round")
			}
		},
		workers: func() [][2]string { return [][2]string{{"http://a", "m"}, {"http://b", "m"}, {"http://c", "n"}} },
	}
	waitReads := func(n int32) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); reads.Load() < n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d reads, want %d", reads.Load(), n)
			}
		}
	}
	first, cancelFirst := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { r.refresh(first) })
	waitReads(3) // round 1 runs, its reads held
	for range 4 {
		wg.Go(func() { r.refresh(context.Background()) })
	}
	gone, cancelGone := context.WithCancel(context.Background())
	goneDone := make(chan struct{})
	go func() { r.refresh(gone); close(goneDone) }()
	cancelFirst()
	cancelGone()
	<-goneDone // a waiter whose context ended returned, round 1 still held
	if n := reads.Load(); n != 3 {
		t.Fatalf("%d reads while round 1 is held, want 3", n)
	}
	end1 := time.Now()
	close(release)
	wg.Wait()
	if n := reads.Load(); n != 6 {
		t.Fatalf("%d reads: round 1 and one shared round 2 over 3 workers, want 6", n)
	}
	if d := time.Since(end1); d < refreshEvery {
		t.Fatalf("round 2 ended %v after round 1: rounds closer than %v", d, refreshEvery)
	}
	r.refresh(context.Background()) // a new call: a new round
	if n := reads.Load(); n != 9 {
		t.Fatalf("%d reads after one more call, want 9", n)
	}
}
