package engine

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func testParams() Params {
	return Params{
		MaxNumSeqs:          8,
		NumBlocks:           1000,
		BlockSize:           16,
		MaxNumBatchedTokens: 4096,
		PrefillBase:         5 * time.Millisecond,
		PrefillPerToken:     20 * time.Microsecond,
		DecodeStepBase:      2 * time.Millisecond,
		DecodeStepPerSeq:    50 * time.Microsecond,
		NumLayers:           4,
		KVBytesPerToken:     1000,
		KVBandwidth:         1e8, // 10 µs per token
		TransferBase:        1 * time.Millisecond,
		HandshakeTime:       3 * time.Millisecond,
	}
}

// withEngine runs f inside a synctest bubble with a running engine.
func withEngine(t *testing.T, p Params, f func(t *testing.T, e *Engine)) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		e := New(p)
		done := make(chan struct{})
		go func() { e.Run(ctx); close(done) }()
		f(t, e)
		cancel()
		<-done
	})
}

// withQueued is withEngine for tests that submit several requests "at
// once": the engine starts when f calls run, so none of them can be
// scheduled before the others are queued (a goroutine race even inside the
// bubble).
func withQueued(t *testing.T, p Params, f func(t *testing.T, e *Engine, run func())) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		e := New(p)
		done := make(chan struct{})
		started := false
		f(t, e, func() {
			started = true
			go func() { e.Run(ctx); close(done) }()
		})
		cancel()
		if started {
			<-done
		}
	})
}

func submit(t *testing.T, e *Engine, r *Request) *Handle {
	t.Helper()
	h, err := e.Submit(r)
	if err != nil {
		t.Fatalf("Submit(%s): %v", r.ID, err)
	}
	return h
}

// waitTokens blocks until h has n tokens or finished and returns the time.
func waitTokens(h *Handle, n int) (time.Time, Progress) {
	for {
		p := h.Progress()
		if p.Generated >= n || p.Finished {
			return time.Now(), p
		}
		<-h.Updates()
	}
}

func waitFinished(h *Handle) (time.Time, Progress) {
	for {
		p := h.Progress()
		if p.Finished {
			return time.Now(), p
		}
		<-h.Updates()
	}
}

func TestPrefillTimeIsABL(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		start := time.Now()
		h := submit(t, e, &Request{ID: "p", PromptTokens: 1000, MaxTokens: 1})
		end, p := waitFinished(h)
		if want := 5*time.Millisecond + 1000*20*time.Microsecond; end.Sub(start) != want {
			t.Errorf("prefill took %v, want %v", end.Sub(start), want)
		}
		if p.Reason != FinishLength || p.Generated != 1 {
			t.Errorf("progress = %+v, want 1 token, length", p)
		}
		if s := e.Snapshot(); s.BlocksUsed != 0 || s.Running != 0 {
			t.Errorf("after finish: %+v", s)
		}
	})
}

func TestContinuousBatching(t *testing.T) {
	withQueued(t, testParams(), func(t *testing.T, e *Engine, start func()) {
		t0 := time.Now()
		a := submit(t, e, &Request{ID: "a", PromptTokens: 10, MaxTokens: 3})
		b := submit(t, e, &Request{ID: "b", PromptTokens: 10, MaxTokens: 3})
		start()
		endA, _ := waitFinished(a)
		endB, _ := waitFinished(b)
		// One prefill step for both (20 tokens), then two decode steps of 2.
		want := 5*time.Millisecond + 20*20*time.Microsecond + 2*(2*time.Millisecond+2*50*time.Microsecond)
		if endA.Sub(t0) != want || endB.Sub(t0) != want {
			t.Errorf("finished at %v/%v, want both %v", endA.Sub(t0), endB.Sub(t0), want)
		}
		if s := e.Snapshot(); s.Steps != 3 || s.Tokens != 6 {
			t.Errorf("steps=%d tokens=%d, want 3 and 6", s.Steps, s.Tokens)
		}
	})
}

func TestJoinAtStepBoundary(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		start := time.Now()
		a := submit(t, e, &Request{ID: "a", PromptTokens: 100, MaxTokens: 50})
		// a's prefill is 7 ms; b arrives at 1 ms and waits for the boundary.
		time.Sleep(time.Millisecond)
		b := submit(t, e, &Request{ID: "b", PromptTokens: 100, MaxTokens: 1})
		end, _ := waitFinished(b)
		// b's prefill runs with a's first decode: S(1) + F(100).
		want := 7*time.Millisecond + (2*time.Millisecond + 50*time.Microsecond) + 7*time.Millisecond
		if end.Sub(start) != want {
			t.Errorf("b finished at %v, want %v", end.Sub(start), want)
		}
		a.Abort()
	})
}

func TestSlotsQueueFCFS(t *testing.T) {
	p := testParams()
	p.MaxNumSeqs = 1
	withQueued(t, p, func(t *testing.T, e *Engine, run func()) {
		start := time.Now()
		a := submit(t, e, &Request{ID: "a", PromptTokens: 100, MaxTokens: 2})
		b := submit(t, e, &Request{ID: "b", PromptTokens: 100, MaxTokens: 1})
		if s := e.Snapshot(); s.Waiting != 2 {
			t.Errorf("waiting = %d, want 2 before the first step", s.Waiting)
		}
		run()
		endA, _ := waitFinished(a)
		endB, _ := waitFinished(b)
		f := 7 * time.Millisecond
		s1 := 2*time.Millisecond + 50*time.Microsecond
		if endA.Sub(start) != f+s1 {
			t.Errorf("a finished at %v, want %v", endA.Sub(start), f+s1)
		}
		if endB.Sub(start) != f+s1+f {
			t.Errorf("b finished at %v, want %v (queued behind a)", endB.Sub(start), f+s1+f)
		}
	})
}

func TestBlockAccountingAndWait(t *testing.T) {
	p := testParams()
	p.NumBlocks = 10 // 160 tokens
	withEngine(t, p, func(t *testing.T, e *Engine) {
		a := submit(t, e, &Request{ID: "a", PromptTokens: 100, MaxTokens: 1, KeepBlocks: true})
		_, pa := waitFinished(a)
		if pa.Reason != FinishLength {
			t.Fatalf("a: %+v", pa)
		}
		if got := len(a.Blocks()); got != 7 {
			t.Errorf("a holds %d blocks, want ceil(100/16)=7", got)
		}
		if s := e.Snapshot(); s.BlocksUsed != 7 || s.PinnedFinished != 1 {
			t.Errorf("snapshot %+v, want 7 blocks pinned", s)
		}
		// b needs 5 blocks; only 3 are free until a's pinned blocks go.
		b := submit(t, e, &Request{ID: "b", PromptTokens: 70, MaxTokens: 1})
		time.Sleep(50 * time.Millisecond)
		if pb := b.Progress(); pb.Admitted {
			t.Fatalf("b admitted while blocks are pinned: %+v", pb)
		}
		released := time.Now()
		if !a.Release() {
			t.Fatal("Release returned false")
		}
		end, _ := waitFinished(b)
		if want := 5*time.Millisecond + 70*20*time.Microsecond; end.Sub(released) != want {
			t.Errorf("b ran %v after release, want %v", end.Sub(released), want)
		}
		if s := e.Snapshot(); s.BlocksUsed != 0 {
			t.Errorf("blocks used %d, want 0", s.BlocksUsed)
		}
	})
}

func TestTooLarge(t *testing.T) {
	p := testParams()
	p.NumBlocks = 2
	e := New(p)
	if _, err := e.Submit(&Request{ID: "x", PromptTokens: 100, MaxTokens: 1}); err != ErrTooLarge {
		t.Errorf("err = %v, want ErrTooLarge", err)
	}
}

func TestMaxWaiting(t *testing.T) {
	e := New(testParams())
	e.SetMaxWaiting(1)
	if _, err := e.Submit(&Request{ID: "a", PromptTokens: 1, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Submit(&Request{ID: "b", PromptTokens: 1, MaxTokens: 1}); err != ErrQueueFull {
		t.Errorf("err = %v, want ErrQueueFull", err)
	}
}

func TestRemoteKVWrite(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		admitted := make(chan []int, 1)
		start := time.Now()
		h := submit(t, e, &Request{
			ID: "d", PromptTokens: 50, MaxTokens: 3, RemoteKV: true,
			OnAdmit: func(h *Handle) { admitted <- h.Blocks() },
		})
		blocks := <-admitted
		if len(blocks) != 4 {
			t.Errorf("admitted with %d blocks, want 4", len(blocks))
		}
		time.Sleep(100 * time.Millisecond)
		s := e.Snapshot()
		if s.WaitingRemote != 1 || s.BlocksUsed != 4 || s.Steps != 0 {
			t.Errorf("while waiting for KV: %+v", s)
		}
		h.KVReady(0, false)
		first, _ := waitTokens(h, 1)
		step := 2*time.Millisecond + 50*time.Microsecond
		if d := first.Sub(start); d != 100*time.Millisecond+step {
			t.Errorf("first token at %v, want %v (one decode step after KV)", d, 100*time.Millisecond+step)
		}
		end, p := waitFinished(h)
		if end.Sub(first) != 2*step || p.Generated != 3 {
			t.Errorf("rest took %v with %d tokens", end.Sub(first), p.Generated)
		}
	})
}

func TestRemoteKVReadStallsStep(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		// A running decode shares the step with the reading request.
		a := submit(t, e, &Request{ID: "a", PromptTokens: 10, MaxTokens: 1000})
		waitTokens(a, 1)
		h := submit(t, e, &Request{ID: "d", PromptTokens: 1000, MaxTokens: 2, RemoteKV: true})
		for !h.Progress().Admitted {
			time.Sleep(time.Millisecond)
		}
		ready := time.Now()
		x := e.Params().TransferTime(1000) // 1 ms + 10 ms
		h.KVReady(x, false)
		first, _ := waitTokens(h, 1)
		// The step that carries d starts at the next boundary (<= one step
		// after ready) and ends at start + X + S(2)/layers.
		s2 := 2*time.Millisecond + 100*time.Microsecond
		lo := x + s2/4
		if d := first.Sub(ready); d < lo || d > lo+s2 {
			t.Errorf("first token %v after KV, want in [%v, %v]", d, lo, lo+s2)
		}
		a.Abort()
	})
}

func TestRecomputeOnReadFailure(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		h := submit(t, e, &Request{ID: "d", PromptTokens: 500, MaxTokens: 1, RemoteKV: true})
		for !h.Progress().Admitted {
			time.Sleep(time.Millisecond)
		}
		start := time.Now()
		h.KVReady(0, true)
		end, _ := waitFinished(h)
		if want := 5*time.Millisecond + 500*20*time.Microsecond; end.Sub(start) != want {
			t.Errorf("recompute took %v, want F(500)=%v", end.Sub(start), want)
		}
	})
}

func TestForwardNotBeforeAndOnForward(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		start := time.Now()
		type fwd struct {
			at time.Time
			d  time.Duration
		}
		got := make(chan fwd, 1)
		h := submit(t, e, &Request{
			ID: "p", PromptTokens: 100, MaxTokens: 1,
			ForwardNotBefore: start.Add(3 * time.Millisecond),
			OnForward:        func(_ *Handle, at time.Time, d time.Duration) { got <- fwd{at, d} },
		})
		end, _ := waitFinished(h)
		f := <-got
		if f.at.Sub(start) != 3*time.Millisecond || f.d != 7*time.Millisecond {
			t.Errorf("OnForward(%v, %v), want (3ms, 7ms)", f.at.Sub(start), f.d)
		}
		if end.Sub(start) != 10*time.Millisecond {
			t.Errorf("finished at %v, want 10ms", end.Sub(start))
		}
	})
}

func TestChunkedPrefill(t *testing.T) {
	p := testParams()
	p.MaxNumBatchedTokens = 400
	withEngine(t, p, func(t *testing.T, e *Engine) {
		start := time.Now()
		h := submit(t, e, &Request{ID: "p", PromptTokens: 1000, MaxTokens: 1})
		end, _ := waitFinished(h)
		// 400 + 400 + 200 tokens in three steps, each paying a.
		want := 3*5*time.Millisecond + 1000*20*time.Microsecond
		if end.Sub(start) != want {
			t.Errorf("chunked prefill took %v, want %v", end.Sub(start), want)
		}
		if s := e.Snapshot(); s.Steps != 3 {
			t.Errorf("steps = %d, want 3", s.Steps)
		}
	})
}

func TestPreemptionRecomputes(t *testing.T) {
	p := testParams()
	p.BlockSize = 4
	p.NumBlocks = 12 // 48 tokens
	withQueued(t, p, func(t *testing.T, e *Engine, run func()) {
		// Each needs 5 blocks for its prompt and grows to 8 by the end.
		a := submit(t, e, &Request{ID: "a", PromptTokens: 20, MaxTokens: 12})
		b := submit(t, e, &Request{ID: "b", PromptTokens: 20, MaxTokens: 12})
		run()
		_, pa := waitFinished(a)
		_, pb := waitFinished(b)
		if pa.Generated != 12 || pb.Generated != 12 {
			t.Errorf("generated %d/%d, want 12 each", pa.Generated, pb.Generated)
		}
		s := e.Snapshot()
		if s.Preemptions == 0 {
			t.Error("expected at least one preemption")
		}
		if s.BlocksUsed != 0 {
			t.Errorf("blocks used %d after finish", s.BlocksUsed)
		}
	})
}

func TestEOSStops(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		h := submit(t, e, &Request{ID: "x", PromptTokens: 5, MaxTokens: 10, EOS: func(i int) bool { return i == 2 }})
		_, p := waitFinished(h)
		if p.Reason != FinishStop || p.Generated != 3 {
			t.Errorf("progress %+v, want stop after 3 tokens", p)
		}
	})
}

func TestAbortFreesBlocks(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		h := submit(t, e, &Request{ID: "d", PromptTokens: 100, MaxTokens: 5, RemoteKV: true})
		for !h.Progress().Admitted {
			time.Sleep(time.Millisecond)
		}
		if s := e.Snapshot(); s.BlocksUsed != 7 {
			t.Fatalf("blocks used %d, want 7", s.BlocksUsed)
		}
		h.Abort()
		_, p := waitFinished(h)
		if p.Reason != FinishAbort {
			t.Errorf("reason %v, want abort", p.Reason)
		}
		if s := e.Snapshot(); s.BlocksUsed != 0 || s.WaitingRemote != 0 {
			t.Errorf("after abort: %+v", s)
		}
	})
}

func TestSlowFactor(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		e.SetSlowFactor(2)
		start := time.Now()
		h := submit(t, e, &Request{ID: "p", PromptTokens: 100, MaxTokens: 1})
		end, _ := waitFinished(h)
		if end.Sub(start) != 14*time.Millisecond {
			t.Errorf("took %v, want 14ms", end.Sub(start))
		}
	})
}

func TestZeroLatencyStillOneTokenPerStep(t *testing.T) {
	withEngine(t, Params{MaxNumSeqs: 4, NumBlocks: 100, BlockSize: 16, MaxNumBatchedTokens: 1024, NumLayers: 1}, func(t *testing.T, e *Engine) {
		h := submit(t, e, &Request{ID: "z", PromptTokens: 10, MaxTokens: 100})
		_, p := waitFinished(h)
		if p.Generated != 100 {
			t.Errorf("generated %d", p.Generated)
		}
		if s := e.Snapshot(); s.Steps != 100 {
			t.Errorf("steps %d, want 100", s.Steps)
		}
	})
}

func TestQuadraticPrefillIsChunkInvariant(t *testing.T) {
	p := testParams()
	p.PrefillQuadratic = 10 // 10 ns per token²
	p.MaxNumBatchedTokens = 400
	withEngine(t, p, func(t *testing.T, e *Engine) {
		start := time.Now()
		h := submit(t, e, &Request{ID: "p", PromptTokens: 1000, MaxTokens: 1})
		end, _ := waitFinished(h)
		// Three chunks pay a three times; b·L and c·L² are unchanged.
		want := 3*5*time.Millisecond + 1000*20*time.Microsecond + 10*time.Millisecond
		if end.Sub(start) != want {
			t.Errorf("took %v, want %v", end.Sub(start), want)
		}
	})
	if got := p.PrefillTime(1000); got != 5*time.Millisecond+20*time.Millisecond+10*time.Millisecond {
		t.Errorf("PrefillTime(1000) = %v", got)
	}
}

func TestScaled(t *testing.T) {
	p := testParams().Scaled(0.5)
	if p.PrefillBase != 2500*time.Microsecond || p.HandshakeTime != 1500*time.Microsecond {
		t.Errorf("scaled durations wrong: %+v", p)
	}
	if got, want := p.TransferTime(1000), testParams().TransferTime(1000)/2; got != want {
		t.Errorf("scaled transfer %v, want %v", got, want)
	}
}

func TestReleaseBeforeFinishDoesNotPin(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		h := submit(t, e, &Request{ID: "p", PromptTokens: 100, MaxTokens: 1, KeepBlocks: true,
			OnForward: func(h *Handle, _ time.Time, _ time.Duration) { h.Release() }})
		waitFinished(h)
		if s := e.Snapshot(); s.BlocksUsed != 0 || s.PinnedFinished != 0 {
			t.Errorf("early Release: %+v, want nothing pinned", s)
		}
	})
}

// TestAdmittedBlocksSurviveAbort: a request aborted between the step that
// allocated its blocks and its OnAdmit hook still announces those blocks
// (vLLM builds the connector metadata in the allocating step); an empty
// list would kill a MoRI-IO prefill's notify listener.
func TestAdmittedBlocksSurviveAbort(t *testing.T) {
	withEngine(t, testParams(), func(t *testing.T, e *Engine) {
		type seen struct{ admitted, now []int }
		got := make(chan seen, 1)
		submit(t, e, &Request{
			ID: "d", PromptTokens: 50, MaxTokens: 3, RemoteKV: true,
			OnAdmit: func(h *Handle) {
				h.Abort()
				got <- seen{h.AdmittedBlocks(), h.Blocks()}
			},
		})
		s := <-got
		if len(s.admitted) != 4 || len(s.now) != 0 {
			t.Errorf("after an abort: admitted blocks %v, blocks %v; want 4 admitted, none held", s.admitted, s.now)
		}
	})
}
