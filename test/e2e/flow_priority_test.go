package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestFlowEnginePriority: --flow-engine-priority carries the band to a
// vllm-sim running --scheduling-policy priority. One engine slot, no
// router-side limit, so requests queue in the engine: a low request holds
// the slot, another low one and then a high one queue behind it; when the
// first is aborted the engine admits the high one first with the option,
// the low one (arrival order) without it.
func TestFlowEnginePriority(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags []string
		first string
	}{
		{"band sent as priority", []string{"--flow-engine-priority"}, "high"},
		{"no priority field", nil, "low2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startSim(t, "--role", "unified", "--max-num-seqs", "1", "--decode-step-base", "20ms", "--decode-step-per-seq", "0",
				"--scheduling-policy", "priority")
			r := startRouter(t, append([]string{"--worker-urls", s.URL(), "--flow-control"}, tc.flags...)...)
			r.WaitReady(t, 10*time.Second)
			ctx := ctxT(t, 60*time.Second)

			firstToken := make(chan string, 3)
			stream := func(ctx context.Context, name, band string, maxTokens int) {
				body := fmt.Sprintf(`{"model":"sim-model","prompt":"flow %s","max_tokens":%d,"ignore_eos":true,"stream":true}`, name, maxTokens)
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+"/v1/completions", strings.NewReader(body))
				if err != nil {
					t.Error(err)
					return
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("x-gateway-inference-objective", band)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return // the aborted one
				}
				defer resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Errorf("%s: status %d", name, resp.StatusCode)
					return
				}
				sc := bufio.NewScanner(resp.Body)
				for sc.Scan() {
					if strings.HasPrefix(sc.Text(), "data: {") {
						firstToken <- name
						for sc.Scan() { // drain
						}
						return
					}
				}
			}
			done := make(chan struct{}, 3)
			hold, abort := context.WithCancel(ctx)
			go func() { stream(hold, "low1", "low", 30000); done <- struct{}{} }()
			waitFor(t, 20*time.Second, "low1 running", func() bool { return s.Stats(t).Running == 1 })
			if got := <-firstToken; got != "low1" {
				t.Fatalf("first token from %s", got)
			}
			go func() { stream(ctx, "low2", "low", 100); done <- struct{}{} }()
			waitFor(t, 20*time.Second, "low2 queued in the engine", func() bool { return s.Stats(t).Waiting == 1 })
			go func() { stream(ctx, "high", "high", 100); done <- struct{}{} }()
			waitFor(t, 20*time.Second, "high queued in the engine", func() bool { return s.Stats(t).Waiting == 2 })
			abort()
			// The slot's next holder streams 100 tokens (2 s) before the
			// other can start: the first token seen names it.
			select {
			case got := <-firstToken:
				if got != tc.first {
					t.Errorf("admitted first: %s, want %s", got, tc.first)
				}
			case <-ctx.Done():
				t.Fatal("no token after the abort")
			}
			for range 3 {
				select {
				case <-done:
				case <-ctx.Done():
					t.Fatal("requests did not end")
				}
			}
		})
	}
}
