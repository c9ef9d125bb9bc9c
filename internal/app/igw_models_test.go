package app

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestModelCache(t *testing.T) {
	var calls atomic.Int32
	release := make(chan struct{})
	fail := atomic.Bool{}
	fail.Store(true)
	c := newModelCache(func(ctx context.Context, base string) (string, error) {
		calls.Add(1)
		if base == "http://hang:1" {
			<-ctx.Done()
			return "", ctx.Err()
		}
		<-release
		if fail.Load() {
			return "", errors.New("loading")
		}
		return "model-of-" + base, nil
	}, slog.New(slog.DiscardHandler))
	defer c.Close()
	var known atomic.Int32
	c.OnKnown(func() { known.Add(1) })

	if _, ok := c.Model("a:1"); ok {
		t.Fatal("a model known before it was asked for")
	}
	if _, ok := c.Model("a:1"); ok || calls.Load() > 1 {
		t.Fatal("a second registration started a second lookup")
	}
	release <- struct{}{} // the first lookup fails
	waitUntil(t, "the failed lookup to finish", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return !c.pending["a:1"]
	})
	fail.Store(false)
	if _, ok := c.Model("a:1"); ok {
		t.Fatal("a failed lookup answered")
	}
	release <- struct{}{}
	waitUntil(t, "the model to be known", func() bool { m, ok := c.Model("a:1"); return ok && m == "model-of-http://a:1" })
	if calls.Load() != 2 {
		t.Fatalf("lookups: %d, want 2 (one failed, one answered)", calls.Load())
	}
	waitUntil(t, "OnKnown called for the answer", func() bool { return known.Load() == 1 })

	// The instance leaves: its model is forgotten.
	w := worker.New(worker.Spec{URL: "http://a:1", Instance: "a:1", DPRank: -1}, worker.BreakerConfig{})
	c.onRegistryChange(worker.Change{Removed: []*worker.Worker{w}, Snap: &worker.Snapshot{}})
	c.mu.Lock()
	_, still := c.known["a:1"]
	c.mu.Unlock()
	if still {
		t.Fatal("the model of a removed instance is remembered")
	}

	// Close ends a lookup that hangs.
	c.Model("hang:1")
	waitUntil(t, "the hanging lookup to start", func() bool { return calls.Load() == 3 })
	done := make(chan struct{})
	go func() { c.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not stop a hanging lookup")
	}
	if _, ok := c.Model("b:1"); ok || calls.Load() != 3 {
		t.Fatal("a lookup started after Close")
	}
}

func TestModelCacheBounded(t *testing.T) {
	block := make(chan struct{})
	var calls atomic.Int32
	c := newModelCache(func(ctx context.Context, _ string) (string, error) {
		calls.Add(1)
		select {
		case <-block:
		case <-ctx.Done():
		}
		return "", errors.New("no")
	}, slog.New(slog.DiscardHandler))
	defer c.Close()
	for i := range 2 * maxModelLookups {
		c.Model("h:" + string(rune('0'+i%10)) + string(rune('a'+i/10)))
	}
	c.mu.Lock()
	n := len(c.pending)
	c.mu.Unlock()
	if n != maxModelLookups {
		t.Fatalf("%d lookups in flight, want the bound %d", n, maxModelLookups)
	}
	close(block)
}
