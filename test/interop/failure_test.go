package interop

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// outcome is how one request through a failing fleet ended.
type outcome struct {
	status int
	body   string
	err    error
	took   time.Duration
}

// explicit reports whether o is a complete answer or an explicit error:
// an HTTP error with a JSON error body, or a stream that ends with an SSE
// error event and [DONE]. Anything else (a cut stream, a timeout) is not.
func (o outcome) explicit() (ok bool, why string) {
	if o.err != nil {
		return false, o.err.Error()
	}
	if o.status != 200 {
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal([]byte(o.body), &e) != nil || e.Error.Message == "" {
			return false, fmt.Sprintf("status %d without a JSON error body: %q", o.status, o.body)
		}
		return true, ""
	}
	if !strings.HasSuffix(o.body, "data: [DONE]\n\n") {
		return false, "stream cut without [DONE]: " + harness.Tail(o.body, 200)
	}
	return true, ""
}

// streamRequest sends a streaming completion and reads it to the end
// within d.
func streamRequest(base, prompt string, maxTokens int, d time.Duration) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	start := time.Now()
	body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":%d,"ignore_eos":true,"temperature":0,"stream":true}`, modelDir, prompt, maxTokens)
	code, _, b, err := postE(ctx, base+"/v1/completions", body)
	return outcome{status: code, body: string(b), err: err, took: time.Since(start)}
}

// waitServes waits until a request through r is answered with the unified
// engine's tokens again.
func waitServes(t *testing.T, r *harnessRouter, within time.Duration) {
	t.Helper()
	want := generate(t, unified.URL(), false, false, "[back] the fleet is whole again", 8)
	var last string
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		code, _, b, err := postE(ctxT(t, 30*time.Second), r.Base+"/v1/completions", genBody(false, false, "[back] the fleet is whole again", 8))
		if err == nil && code == 200 {
			got, perr := parseResultE(b)
			if perr == nil && slices.Equal(got.Tokens, want.Tokens) {
				return
			}
			last = fmt.Sprintf("tokens %v want %v (%v)", got.Tokens, want.Tokens, perr)
		} else {
			last = fmt.Sprintf("%d %s %v", code, b, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("router did not serve again within %v: %s", within, last)
}

// TestFailurePrefillKilled: kill -9 of the prefill engine (its whole
// process group) while requests are in flight. Every request ends with a
// complete answer or an explicit error within a bound, never a hang; a
// request sent while the prefill is down gets an explicit error; once the
// engine is back the router serves the unified engine's tokens again.
func TestFailurePrefillKilled(t *testing.T) {
	needEnv(t)
	r := pdRouter(t, "--request-timeout-secs", "60")
	t.Cleanup(func() {
		if _, err := prefill.waitReady(time.Second); err != nil {
			prefill.restart(t)
		}
	})
	const n = 6
	outs := make([]outcome, n)
	var wg sync.WaitGroup
	for i := range n {
		prompt := fmt.Sprintf("[prefill-kill %d] %s", i, strings.Repeat("prefill work ", 60))
		wg.Go(func() { outs[i] = streamRequest(r.Base, prompt, 300, 90*time.Second) })
	}
	harness.WaitFor(t, 20*time.Second, 2*time.Millisecond, "requests in flight at the router", func() bool {
		return metric(t, r.Metrics, "vllm_router_inflight_requests") >= 1
	})
	prefill.kill()
	wg.Wait()
	for i, o := range outs {
		if ok, why := o.explicit(); !ok {
			t.Errorf("request %d (after %v): %s", i, o.took.Round(time.Millisecond), why)
		}
		t.Logf("in flight %d: status %d after %v, ends %q", i, o.status, o.took.Round(time.Millisecond), harness.Tail(strings.TrimSpace(o.body), 160))
	}
	o := streamRequest(r.Base, "[prefill-kill] while down", 8, 60*time.Second)
	if ok, why := o.explicit(); !ok || o.status == 200 {
		t.Fatalf("request with the prefill down: %d %q %s", o.status, o.body, why)
	}
	t.Logf("with the prefill down: %d %s (in %v)", o.status, strings.TrimSpace(o.body), o.took.Round(time.Millisecond))

	prefill.restart(t)
	waitServes(t, r, 90*time.Second)
}

// TestFailureDecodeKilledMidStream: kill -9 of the decode engine in the
// middle of a stream ends the stream with an SSE error event and [DONE];
// once the engine is back the router serves again.
func TestFailureDecodeKilledMidStream(t *testing.T) {
	needEnv(t)
	r := pdRouter(t, "--request-timeout-secs", "60")
	t.Cleanup(func() {
		if _, err := decode.waitReady(time.Second); err != nil {
			decode.restart(t)
		}
	})
	ctx := ctxT(t, 60*time.Second)
	body := fmt.Sprintf(`{"model":%q,"prompt":"[decode-kill] a long answer","max_tokens":900,"ignore_eos":true,"temperature":0,"stream":true}`, modelDir)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d %s", resp.StatusCode, b)
	}
	br := bufio.NewReader(resp.Body)
	for chunks := 0; chunks < 3; {
		l, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("stream ended after %d chunks: %v", chunks, err)
		}
		if strings.HasPrefix(l, "data: {") {
			chunks++
		}
	}
	killed := time.Now()
	decode.kill()
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatalf("reading the rest of the stream: %v (after %v)", err, time.Since(killed))
	}
	var events []string
	for _, ev := range strings.Split(strings.TrimSpace(string(rest)), "\n\n") {
		events = append(events, strings.TrimPrefix(ev, "data: "))
	}
	n := len(events)
	if n < 2 || events[n-1] != "[DONE]" || !strings.Contains(events[n-2], `"error"`) {
		t.Fatalf("stream did not end with an error event and [DONE]: %q", harness.Tail(string(rest), 400))
	}
	t.Logf("stream ended %v after the kill with %s", time.Since(killed).Round(time.Millisecond), events[n-2])

	decode.restart(t)
	waitServes(t, r, 90*time.Second)
}
