package sim

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestPriorityField: a non-zero "priority" is vLLM's 400 unless the engine
// runs --scheduling-policy priority; zero is always accepted; a non-integer
// is a type error.
func TestPriorityField(t *testing.T) {
	fcfs := startSim(t, "--profile-preset", "zero")
	prio := startSim(t, "--profile-preset", "zero", "--scheduling-policy", "priority")
	bodies := map[string]func(p any) map[string]any{
		"/v1/completions": func(p any) map[string]any {
			return map[string]any{"prompt": "a b c", "max_tokens": 2, "priority": p}
		},
		"/v1/chat/completions": func(p any) map[string]any {
			return map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}, "max_tokens": 2, "priority": p}
		},
		"/v1/responses": func(p any) map[string]any {
			return map[string]any{"input": "hi", "max_output_tokens": 2, "priority": p}
		},
	}
	for _, tc := range []struct {
		name     string
		in       *Instance
		priority any
		status   int
		message  string
	}{
		{"fcfs zero", fcfs, 0, 200, ""},
		{"fcfs positive", fcfs, 3, 400, "Got priority 3 but Priority scheduling is not enabled."},
		{"fcfs negative", fcfs, -2, 400, "Got priority -2 but Priority scheduling is not enabled."},
		{"priority positive", prio, 3, 200, ""},
		{"priority negative", prio, -2, 200, ""},
		{"not an integer", prio, 1.5, 400, `invalid type for field "priority"`},
		{"a string", fcfs, "high", 400, `invalid type for field "priority"`},
	} {
		for path, body := range bodies {
			r := postJSON(t, t.Context(), tc.in.url(path), body(tc.priority), nil)
			if r.status != tc.status {
				t.Errorf("%s %s: status %d, want %d (%s)", tc.name, path, r.status, tc.status, r.raw)
				continue
			}
			if tc.status == 200 {
				continue
			}
			e, _ := r.body["error"].(map[string]any)
			if msg, _ := e["message"].(string); !strings.Contains(msg, tc.message) || e["type"] != "BadRequestError" || e["code"] != float64(400) {
				t.Errorf("%s %s: error %v, want a BadRequestError 400 with %q", tc.name, path, e, tc.message)
			}
		}
	}
}

// TestPriorityReachesTheEngine: requests queued behind a full engine are
// ordered by their "priority" field with --scheduling-policy priority and by
// arrival without it.
func TestPriorityReachesTheEngine(t *testing.T) {
	for _, tc := range []struct {
		policy string
		want   []string
	}{
		{"fcfs", []string{"cmpl-lo", "cmpl-mid", "cmpl-hi"}},
		{"priority", []string{"cmpl-hi", "cmpl-mid", "cmpl-lo"}},
	} {
		t.Run(tc.policy, func(t *testing.T) {
			in := startSim(t, "--max-num-seqs", "1", "--scheduling-policy", tc.policy)
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			reqCtx, stop := context.WithCancel(ctx)
			var wg sync.WaitGroup
			defer wg.Wait()
			defer stop() // every request is aborted once the queue was read
			send := func(id string, prio int) {
				body := map[string]any{"prompt": "a b c", "max_tokens": 30000, "ignore_eos": true}
				if tc.policy == "priority" {
					body["priority"] = prio
				}
				wg.Go(func() {
					resp, err := testClient.Do(newReq(t, reqCtx, "POST", in.url("/v1/completions"), body, map[string]string{"X-Request-Id": id}))
					if err == nil {
						resp.Body.Close()
					}
				})
			}
			waitFor := func(what string, cond func() bool) {
				t.Helper()
				for !cond() {
					if ctx.Err() != nil {
						t.Fatalf("timed out waiting for %s", what)
					}
					time.Sleep(2 * time.Millisecond)
				}
			}
			e := in.engines[0]
			send("blocker", 0)
			waitFor("the blocker to run", func() bool { return e.Snapshot().Running == 1 })
			// One at a time, so arrival order is known.
			for i, r := range []struct {
				id   string
				prio int
			}{{"lo", 5}, {"mid", 0}, {"hi", -5}} {
				send(r.id, r.prio)
				waitFor(r.id+" to queue", func() bool { return len(e.WaitingIDs()) == i+1 })
			}
			if got := e.WaitingIDs(); !slices.Equal(got, tc.want) {
				t.Errorf("waiting queue %v, want %v", got, tc.want)
			}
		})
	}
}
