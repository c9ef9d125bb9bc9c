package engine

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestWaitingOrder: the waiting queue is served in arrival order under FCFS
// and by (priority, arrival) under priority scheduling, lower values first.
func TestWaitingOrder(t *testing.T) {
	for _, tc := range []struct {
		policy string
		want   string
	}{
		{"", "a b c d e"},
		{PolicyFCFS, "a b c d e"},
		{PolicyPriority, "d a c b e"},
	} {
		t.Run("policy="+tc.policy, func(t *testing.T) {
			p := testParams()
			p.MaxNumSeqs = 1
			p.SchedulingPolicy = tc.policy
			withQueued(t, p, func(t *testing.T, e *Engine, run func()) {
				var mu sync.Mutex
				var order []string
				var hs []*Handle
				for _, r := range []struct {
					id   string
					prio int
				}{{"a", 0}, {"b", 5}, {"c", 0}, {"d", -1}, {"e", 5}} {
					hs = append(hs, submit(t, e, &Request{ID: r.id, Priority: r.prio, PromptTokens: 10, MaxTokens: 2,
						OnAdmit: func(h *Handle) { mu.Lock(); order = append(order, h.ID()); mu.Unlock() }}))
				}
				run()
				for _, h := range hs {
					waitFinished(h)
				}
				mu.Lock()
				defer mu.Unlock()
				if got := strings.Join(order, " "); got != tc.want {
					t.Errorf("admission order %q, want %q", got, tc.want)
				}
			})
		})
	}
}

// TestPriorityPreemptionVictim: when blocks run out, FCFS preempts the most
// recently admitted request and priority scheduling the one with the
// largest (priority, arrival), even if it was admitted first and is
// already scheduled in the step being built.
func TestPriorityPreemptionVictim(t *testing.T) {
	for _, tc := range []struct {
		policy    string
		firstDone string
	}{
		{PolicyFCFS, "lo"},
		{PolicyPriority, "hi"},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			p := testParams()
			p.BlockSize = 4
			p.NumBlocks = 14
			p.SchedulingPolicy = tc.policy
			withEngine(t, p, func(t *testing.T, e *Engine) {
				// lo runs alone first; hi joins at the next step boundary.
				// Together they outgrow the 14 blocks (8 each at the end).
				lo := submit(t, e, &Request{ID: "lo", Priority: 10, PromptTokens: 18, MaxTokens: 14})
				time.Sleep(time.Millisecond)
				hi := submit(t, e, &Request{ID: "hi", Priority: 0, PromptTokens: 20, MaxTokens: 12})
				var mu sync.Mutex
				var done []string
				var wg sync.WaitGroup
				for _, h := range []*Handle{lo, hi} {
					wg.Go(func() {
						_, pr := waitFinished(h)
						if pr.Reason != FinishLength || pr.Generated != h.Request().MaxTokens {
							t.Errorf("%s: %+v, want %d tokens", h.ID(), pr, h.Request().MaxTokens)
						}
						mu.Lock()
						done = append(done, h.ID())
						mu.Unlock()
					})
				}
				wg.Wait()
				s := e.Snapshot()
				if s.Preemptions == 0 {
					t.Fatal("no preemption: the test does not exercise the victim choice")
				}
				if done[0] != tc.firstDone {
					t.Errorf("finish order %v, want %s first (%d preemptions)", done, tc.firstDone, s.Preemptions)
				}
				if s.BlocksUsed != 0 || s.Running != 0 || s.Waiting != 0 {
					t.Errorf("after both finished: %+v", s)
				}
			})
		})
	}
}

// TestPriorityPreemptedKeepsItsPlace: a preempted request goes back to its
// (priority, arrival) place, not ahead of a higher-priority waiter.
func TestPriorityPreemptedKeepsItsPlace(t *testing.T) {
	e := New(Params{MaxNumSeqs: 4, NumBlocks: 100, BlockSize: 16, MaxNumBatchedTokens: 100, NumLayers: 1, SchedulingPolicy: PolicyPriority})
	mk := func(id string, prio int) *Handle {
		h, err := e.Submit(&Request{ID: id, Priority: prio, PromptTokens: 4, MaxTokens: 1})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	run := mk("run", 5)
	mk("w1", 1)
	mk("w9", 9)
	e.mu.Lock()
	e.waiting = removeHandle(e.waiting, run)
	run.st = stRunning
	e.running = append(e.running, run)
	e.preempt(run)
	var ids []string
	for _, h := range e.waiting {
		ids = append(ids, h.ID())
	}
	e.mu.Unlock()
	if want := []string{"w1", "run", "w9"}; !slices.Equal(ids, want) {
		t.Errorf("waiting after preemption %v, want %v", ids, want)
	}
}

func TestSchedulingPolicyValidate(t *testing.T) {
	p := testParams()
	for _, pol := range []string{"", PolicyFCFS, PolicyPriority} {
		p.SchedulingPolicy = pol
		if err := p.Validate(); err != nil {
			t.Errorf("%q: %v", pol, err)
		}
	}
	p.SchedulingPolicy = "lifo"
	if err := p.Validate(); err == nil || !strings.Contains(err.Error(), "scheduling-policy") {
		t.Errorf("lifo: %v, want a scheduling-policy error", err)
	}
}
