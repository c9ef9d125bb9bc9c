package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// twoWorkers returns two fake workers ordered by URL (registry key order).
func twoWorkers(t *testing.T) (lo, hi *fakeWorker) {
	a := newFakeWorker(t, nil)
	b := newFakeWorker(t, nil)
	if a.srv.URL > b.srv.URL {
		a, b = b, a
	}
	a.set(a.recordingOK("lo"))
	b.set(b.recordingOK("hi"))
	return a, b
}

func status503(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	openai.WriteError(w, http.StatusServiceUnavailable, "busy")
}

func TestForwardsBodyByteForByte(t *testing.T) {
	wk := newFakeWorker(t, nil)
	wk.set(wk.recordingOK("w"))
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
	body := "{ \"zeta\":1,\n\t\"model\" : \"m\",  \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9 \\\"q\\\"\"}],\n" +
		"\"unknown_field\": {\"nested\": [1, 2.50, true, null]}, \"alpha\":\"last\"   }"
	code, h, got := f.post(testCtx(t), "/v1/chat/completions", body)
	if code != http.StatusOK || got != `{"worker":"w"}` {
		t.Fatalf("got %d %q", code, got)
	}
	if h.Get("Content-Length") != fmt.Sprint(len(got)) {
		t.Errorf("Content-Length %q not relayed", h.Get("Content-Length"))
	}
	req, raw := wk.lastRequest()
	if string(raw) != body {
		t.Fatalf("worker received\n%q\nwant\n%q", raw, body)
	}
	if req.URL.Path != "/v1/chat/completions" || req.Method != http.MethodPost {
		t.Errorf("upstream %s %s", req.Method, req.URL.Path)
	}
	if req.ContentLength != int64(len(body)) {
		t.Errorf("upstream Content-Length %d want %d", req.ContentLength, len(body))
	}
	rc := f.lastReceipt()
	if rc.Mode != "regular" || rc.Policy != "test_rr" || rc.Worker != wk.srv.URL || rc.Attempts != 1 || rc.Reason != "rr" {
		t.Errorf("receipt %+v", rc)
	}
}

func TestSSEChunksFlushedInOrder(t *testing.T) {
	const n = 20
	ack := make(chan struct{})
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		w.WriteHeader(http.StatusOK)
		rc.Flush()
		for i := range n {
			fmt.Fprintf(w, "data: {\"i\":%d}\n\n", i)
			rc.Flush()
			// the next chunk is produced only once the client has read this one
			select {
			case <-ack:
			case <-r.Context().Done():
				return
			}
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{StreamIdleTimeout: 5 * time.Second})
	ctx := testCtx(t)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.front.URL+"/v1/completions", strings.NewReader(`{"prompt":"x","stream":true}`))
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content-type %q", ct)
	}
	br := bufio.NewReader(resp.Body)
	for i := range n {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("chunk %d: %v", i, err)
		}
		if want := fmt.Sprintf("data: {\"i\":%d}\n", i); line != want {
			t.Fatalf("chunk %d = %q want %q", i, line, want)
		}
		if blank, _ := br.ReadString('\n'); blank != "\n" {
			t.Fatalf("chunk %d: no blank line (%q)", i, blank)
		}
		select {
		case ack <- struct{}{}:
		case <-ctx.Done():
			t.Fatal("worker gone")
		}
	}
	rest, err := io.ReadAll(br)
	if err != nil || string(rest) != "data: [DONE]\n\n" {
		t.Fatalf("tail %q %v", rest, err)
	}
}

func TestRoundRobinSpread(t *testing.T) {
	lo, hi := twoWorkers(t)
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{})
	for range 10 {
		if code, _, _ := f.post(testCtx(t), "/generate", `{"text":"x"}`); code != 200 {
			t.Fatalf("status %d", code)
		}
	}
	if lo.hits.Load() != 5 || hi.hits.Load() != 5 {
		t.Fatalf("spread %d/%d", lo.hits.Load(), hi.hits.Load())
	}
}

func TestRetryAfterDialError(t *testing.T) {
	live := newFakeWorker(t, nil)
	live.set(live.recordingOK("live"))
	dead := deadURL(t)
	f := newFixture(t, []string{dead, live.srv.URL}, RegularOptions{
		Policy: orderPolicy{[]string{dead}},
		Retry:  RetryConfig{MaxAttempts: 3, InitialBackoff: time.Millisecond},
	})
	code, h, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != 200 || body != `{"worker":"live"}` {
		t.Fatalf("got %d %s", code, body)
	}
	if h.Get("X-Test-Attempts") != "2" || h.Get("X-Test-Worker") != live.srv.URL {
		t.Errorf("receipt header attempts=%s worker=%s", h.Get("X-Test-Attempts"), h.Get("X-Test-Worker"))
	}
	rc := f.lastReceipt()
	if len(rc.Failovers) != 1 || rc.Failovers[0] != dead {
		t.Errorf("failovers %v", rc.Failovers)
	}
	if w := f.reg.Get(dead); !w.Suspect() {
		t.Error("dead worker must be suspect (avoided) after one connect failure")
	}
	if v := counterValue(t, f.m.Retries.WithLabelValues("/v1/completions")); v != 1 {
		t.Errorf("retries metric %v", v)
	}
	if v := counterValue(t, f.m.CBOutcomes.WithLabelValues(dead, "failure")); v != 1 {
		t.Errorf("breaker failure outcomes %v", v)
	}
	// now unhealthy: not even tried
	code, h, _ = f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != 200 || h.Get("X-Test-Attempts") != "1" {
		t.Errorf("second request %d attempts=%s", code, h.Get("X-Test-Attempts"))
	}
}

func TestRetryAfter503OnDifferentWorker(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(status503)
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy: firstPolicy{}, // without exclusion the retry would hit lo again
		Retry:  RetryConfig{MaxAttempts: 5, InitialBackoff: time.Millisecond},
	})
	code, h, body := f.post(testCtx(t), "/v1/chat/completions", `{"messages":[]}`)
	if code != 200 || body != `{"worker":"hi"}` || h.Get("X-Test-Attempts") != "2" {
		t.Fatalf("got %d %s attempts=%s", code, body, h.Get("X-Test-Attempts"))
	}
	if lo.hits.Load() != 1 || hi.hits.Load() != 1 {
		t.Fatalf("hits lo=%d hi=%d", lo.hits.Load(), hi.hits.Load())
	}
	if !f.reg.Get(lo.srv.URL).Healthy() {
		t.Error("a 503 is not a connect failure: the worker stays healthy")
	}
	if v := counterValue(t, f.m.CBOutcomes.WithLabelValues(lo.srv.URL, "failure")); v != 1 {
		t.Errorf("breaker failure outcomes %v", v)
	}
}

func TestAllFailReturnsLastUpstreamResponse(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(status503)
	hi.set(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "3")
		openai.WriteError(w, http.StatusTooManyRequests, "slow down")
	})
	for _, attempts := range []int{2, 5} {
		f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
			Policy: firstPolicy{},
			Retry:  RetryConfig{MaxAttempts: attempts, InitialBackoff: time.Millisecond},
		})
		code, h, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
		if code != http.StatusTooManyRequests || !strings.Contains(body, "slow down") || h.Get("Retry-After") != "3" {
			t.Fatalf("attempts=%d: got %d %s %v", attempts, code, body, h)
		}
		exhausted := counterValue(t, f.m.RetriesExhausted.WithLabelValues("/v1/completions"))
		if want := map[int]float64{2: 1, 5: 0}[attempts]; exhausted != want {
			t.Errorf("attempts=%d: exhausted metric %v want %v", attempts, exhausted, want)
		}
	}
}

func TestNonRetryableStatusRelayed(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(func(w http.ResponseWriter, r *http.Request) {
		openai.WriteError(w, http.StatusBadRequest, "bad prompt")
	})
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy: firstPolicy{}, Retry: RetryConfig{MaxAttempts: 3},
	})
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != 400 || !strings.Contains(body, "bad prompt") || hi.hits.Load() != 0 {
		t.Fatalf("got %d %s, hi hits %d", code, body, hi.hits.Load())
	}
	// The outcome is recorded once the relay returns, which can be just after
	// the client has read the whole (Content-Length) body.
	if v := eventuallyCounter(t, f.m.CBOutcomes.WithLabelValues(lo.srv.URL, "success"), 1); v != 1 {
		t.Errorf("4xx must count as breaker success, got %v", v)
	}
}

func TestNoRetryAfterFirstByte(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"i\":0}\n\n")
		http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler) // connection cut mid-stream
	})
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy: firstPolicy{}, Retry: RetryConfig{MaxAttempts: 3, InitialBackoff: time.Millisecond},
	})
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p","stream":true}`)
	if code != 200 {
		t.Fatalf("status %d", code)
	}
	if !strings.HasPrefix(body, "data: {\"i\":0}\n\ndata: {\"error\":") || !strings.HasSuffix(body, "\n\ndata: [DONE]\n\n") {
		t.Fatalf("body %q", body)
	}
	if hi.hits.Load() != 0 {
		t.Fatal("retried after the first byte")
	}
	if v := counterValue(t, f.m.CBOutcomes.WithLabelValues(lo.srv.URL, "failure")); v != 1 {
		t.Errorf("mid-stream break must be a breaker failure, got %v", v)
	}
}

func TestMidStreamBreakSSEError(t *testing.T) {
	for _, tc := range []struct {
		name, sent, want string
	}{
		{"at event boundary", "data: {\"a\":1}\n\n", "data: {\"a\":1}\n\n"},
		{"mid event", "data: {\"a\":1}\n\ndata: {\"par", "data: {\"a\":1}\n\ndata: {\"par\n\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
				fmt.Fprint(w, tc.sent)
				http.NewResponseController(w).Flush()
				time.Sleep(10 * time.Millisecond)
				panic(http.ErrAbortHandler)
			})
			f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
			code, _, body := f.post(testCtx(t), "/v1/chat/completions", `{"messages":[],"stream":true}`)
			if code != 200 || !strings.HasPrefix(body, tc.want) {
				t.Fatalf("got %d %q", code, body)
			}
			ev := strings.TrimPrefix(body, tc.want)
			if !strings.HasPrefix(ev, "data: ") || !strings.HasSuffix(ev, "\n\ndata: [DONE]\n\n") {
				t.Fatalf("error event %q", ev)
			}
			var e openai.ErrorBody
			if err := json.Unmarshal([]byte(strings.TrimSuffix(strings.TrimPrefix(ev, "data: "), "\n\ndata: [DONE]\n\n")), &e); err != nil {
				t.Fatalf("error event is not JSON: %v", err)
			}
			if e.Error.Code != http.StatusBadGateway {
				t.Errorf("code %d", e.Error.Code)
			}
		})
	}
}

func TestRetryBudgetStopsStorm(t *testing.T) {
	var urls []string
	var ws []*fakeWorker
	for range 3 {
		w := newFakeWorker(t, status503)
		ws = append(ws, w)
		urls = append(urls, w.srv.URL)
	}
	// breakers off: they would stop the storm too, and this is about the budget
	f := newFixtureWith(t, urls, RegularOptions{Retry: RetryConfig{
		MaxAttempts: 3, InitialBackoff: time.Microsecond, BudgetRatio: 0.1, BudgetMinPerSec: 0.5,
	}}, worker.BreakerConfig{Disabled: true})
	const n = 50
	for range n {
		if code, _, _ := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`); code != 503 {
			t.Fatalf("status %d", code)
		}
	}
	var hits int64
	for _, w := range ws {
		hits += w.hits.Load()
	}
	// unbudgeted: 3n; budget: n first attempts + 0.1·n + 5 (floor over the window)
	if max := int64(n + n/10 + 5); hits > max || hits < n+5 {
		t.Fatalf("upstream attempts %d, want within [%d, %d]", hits, n+5, max)
	}
}

func TestBackoffRespectsDeadline(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(status503)
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy:         firstPolicy{},
		RequestTimeout: 5 * time.Second,
		Retry:          RetryConfig{MaxAttempts: 3, InitialBackoff: 60 * time.Second},
	})
	start := time.Now()
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	// A backoff past the deadline is not slept: the answer comes at once,
	// well before the 5 s deadline (the bound leaves room for a loaded
	// machine) and the 60 s backoff.
	if el := time.Since(start); el > 2500*time.Millisecond {
		t.Fatalf("took %v: slept toward the deadline", el)
	}
	if code != 503 || !strings.Contains(body, "busy") || hi.hits.Load() != 0 {
		t.Fatalf("got %d %s (hi hits %d): want the worker's 503 at once", code, body, hi.hits.Load())
	}

	// a backoff that fits is slept, then the retry succeeds
	f2 := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy:         firstPolicy{},
		RequestTimeout: 2 * time.Second,
		Retry:          RetryConfig{MaxAttempts: 3, InitialBackoff: 150 * time.Millisecond},
	})
	start = time.Now()
	code, _, _ = f2.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if el := time.Since(start); code != 200 || el < 150*time.Millisecond {
		t.Fatalf("got %d after %v", code, el)
	}
	if v := counterValue(t, f2.m.RetryBackoff.WithLabelValues("2").(prometheus.Metric)); v != 1 {
		t.Errorf("backoff histogram count %v", v)
	}
}

func TestClientCancelPropagates(t *testing.T) {
	started := make(chan struct{})
	doneAt := make(chan time.Time, 1)
	var once sync.Once
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		http.NewResponseController(w).Flush()
		once.Do(func() { close(started) })
		select {
		case <-r.Context().Done():
			doneAt <- time.Now()
		case <-time.After(5 * time.Second):
		}
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
	ctx, cancel := context.WithCancel(testCtx(t))
	var wg sync.WaitGroup
	wg.Go(func() {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.front.URL+"/v1/completions", strings.NewReader(`{"stream":true}`))
		if resp, err := f.client.Do(req); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	})
	defer wg.Wait()
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("worker never got the request")
	}
	t0 := time.Now()
	cancel()
	select {
	case d := <-doneAt:
		if lag := d.Sub(t0); lag > 100*time.Millisecond {
			t.Fatalf("upstream saw the cancel after %v", lag)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("upstream request never canceled")
	}
}

func TestUpstreamTimeout504(t *testing.T) {
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body) // as vLLM does; net/http watches for a disconnect only after the body
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{RequestTimeout: 200 * time.Millisecond,
		Retry: RetryConfig{MaxAttempts: 3}})
	start := time.Now()
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != http.StatusGatewayTimeout || time.Since(start) > 2*time.Second {
		t.Fatalf("got %d after %v: %s", code, time.Since(start), body)
	}
	var e openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Type != "GatewayTimeoutError" {
		t.Fatalf("body %s (%v)", body, err)
	}
	if wk.hits.Load() != 1 {
		t.Errorf("a spent deadline is not retried: %d hits", wk.hits.Load())
	}
	if v := counterValue(t, f.m.RequestErrors.WithLabelValues("/v1/completions", "timeout")); v != 1 {
		t.Errorf("request_errors{timeout} %v", v)
	}
}

func TestConnectFailureNoAlternatives502(t *testing.T) {
	dead := deadURL(t)
	f := newFixture(t, []string{dead}, RegularOptions{Retry: RetryConfig{MaxAttempts: 3, InitialBackoff: time.Millisecond}})
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	var e openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("body %q: %v", body, err)
	}
	if code != http.StatusBadGateway || !strings.HasPrefix(e.Error.Message, "upstream connect failed: ") {
		t.Fatalf("got %d %q", code, e.Error.Message)
	}
	if w := f.reg.Get(dead); !w.Healthy() || !w.Suspect() {
		t.Error("one connect failure is a hint: suspect, not yet unhealthy")
	}
	// the only worker is tried again (suspects are only avoided while
	// another exists); a second connect failure confirms it down
	code, _, _ = f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != http.StatusBadGateway || f.reg.Get(dead).Healthy() {
		t.Fatalf("second failure: %d, healthy %v", code, f.reg.Get(dead).Healthy())
	}
	// the only worker is now unhealthy (no panic routing): immediate 503, no backoff
	code, _, body = f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "No available workers") {
		t.Fatalf("got %d %s", code, body)
	}
}

func TestNoWorker503Immediate(t *testing.T) {
	f := newFixture(t, nil, RegularOptions{Retry: RetryConfig{MaxAttempts: 5, InitialBackoff: 10 * time.Second}})
	start := time.Now()
	code, h, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != 503 || time.Since(start) > 3*time.Second || h.Get("Content-Type") != "application/json" {
		t.Fatalf("got %d after %v", code, time.Since(start))
	}
	var e openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Type != "ServiceUnavailableError" {
		t.Fatalf("body %s", body)
	}
	if v := counterValue(t, f.m.RequestErrors.WithLabelValues("/v1/completions", "no_available_workers")); v != 1 {
		t.Errorf("metric %v", v)
	}
}

func TestHeaderTimeoutRetried(t *testing.T) {
	lo, hi := twoWorkers(t)
	lo.set(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		select { // never sends headers
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	hi.set(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: ok\n\ndata: [DONE]\n\n")
	})
	f := newFixture(t, []string{lo.srv.URL, hi.srv.URL}, RegularOptions{
		Policy: firstPolicy{}, HeaderTimeout: time.Second, // the answering worker is far faster, even on a loaded runner
		Retry: RetryConfig{MaxAttempts: 2, InitialBackoff: time.Millisecond},
	})
	code, h, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p","stream":true}`)
	if code != 200 || body != "data: ok\n\ndata: [DONE]\n\n" || h.Get("X-Test-Attempts") != "2" {
		t.Fatalf("got %d %q attempts=%s", code, body, h.Get("X-Test-Attempts"))
	}
	// a non-streaming request is never cut by the header timeout
	hi.set(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(200 * time.Millisecond)
		fmt.Fprint(w, `{"slow":true}`)
	})
	f2 := newFixture(t, []string{hi.srv.URL}, RegularOptions{HeaderTimeout: 50 * time.Millisecond})
	if code, _, body := f2.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`); code != 200 || body != `{"slow":true}` {
		t.Fatalf("non-streaming: %d %s", code, body)
	}
}

func TestStreamIdleTimeout(t *testing.T) {
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: 1\n\n")
		http.NewResponseController(w).Flush()
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{StreamIdleTimeout: 150 * time.Millisecond})
	start := time.Now()
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p","stream":true}`)
	if code != 200 || !strings.HasPrefix(body, "data: 1\n\ndata: {\"error\":") || !strings.Contains(body, `"code":504`) {
		t.Fatalf("got %d %q", code, body)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("idle timeout took %v", el)
	}
}

func TestPassthroughKeepsMethodQueryBody(t *testing.T) {
	type seen struct {
		method, path, rawQuery, body, ct string
		length                           int64
	}
	got := make(chan seen, 4)
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.Method, r.URL.EscapedPath(), r.URL.RawQuery, string(b), r.Header.Get("Content-Type"), r.ContentLength}
		w.Header().Set("X-Upstream", "1")
		w.WriteHeader(http.StatusAccepted)
		fmt.Fprint(w, "ok")
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
	ctx := testCtx(t)
	for _, tc := range []struct {
		method, target, body string
		chunked              bool
	}{
		{http.MethodPut, "/v1/files/a%2Fb/c?x=1&y=a%20b&y=2", "hello body", false},
		{http.MethodGet, "/v1/models?verbose", "", false},
		{http.MethodPost, "/tokenize", `{"prompt":"hi"}`, true},
		{http.MethodDelete, "/v1/responses/r1", "", false},
	} {
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
			if tc.chunked {
				body = io.MultiReader(body) // unknown length: chunked upload
			}
		}
		req, _ := http.NewRequestWithContext(ctx, tc.method, f.front.URL+tc.target, body)
		req.Header.Set("Content-Type", "text/plain")
		resp, err := f.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted || string(b) != "ok" || resp.Header.Get("X-Upstream") != "1" {
			t.Fatalf("%s %s: %d %q", tc.method, tc.target, resp.StatusCode, b)
		}
		s := <-got
		path, query, _ := strings.Cut(tc.target, "?")
		if s.method != tc.method || s.path != path || s.rawQuery != query || s.body != tc.body || s.ct != "text/plain" {
			t.Errorf("%s %s: upstream saw %+v", tc.method, tc.target, s)
		}
	}
}

func TestPassthroughRetriesConnectFailureWithBody(t *testing.T) {
	live := newFakeWorker(t, nil)
	live.set(live.recordingOK("live"))
	dead := deadURL(t)
	f := newFixture(t, []string{dead, live.srv.URL}, RegularOptions{
		Policy: firstPolicy{}, Retry: RetryConfig{MaxAttempts: 2},
	})
	req, _ := http.NewRequestWithContext(testCtx(t), http.MethodPost, f.front.URL+"/tokenize", strings.NewReader(`{"prompt":"abc"}`))
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if _, b := live.lastRequest(); string(b) != `{"prompt":"abc"}` {
		t.Fatalf("body after retry %q", b)
	}
}

func TestDPRankHeader(t *testing.T) {
	wk := newFakeWorker(t, nil)
	wk.set(wk.recordingOK("dp"))
	f := newFixture(t, nil, RegularOptions{})
	if _, err := f.reg.Add(worker.ExpandDP(worker.Spec{URL: wk.srv.URL, DPRank: -1}, 2)...); err != nil {
		t.Fatal(err)
	}
	ranks := map[string]int{}
	for range 4 {
		f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`, "X-Data-Parallel-Rank", "9")
		req, _ := wk.lastRequest()
		ranks[strings.Join(req.Header.Values("X-Data-Parallel-Rank"), ",")]++
	}
	if ranks["0"] != 2 || ranks["1"] != 2 {
		t.Fatalf("ranks %v", ranks)
	}
	// a non-DP worker never gets a rank, not even the client's
	plain := newFakeWorker(t, nil)
	plain.set(plain.recordingOK("plain"))
	f2 := newFixture(t, []string{plain.srv.URL}, RegularOptions{})
	f2.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`, "X-data-parallel-rank", "9")
	if req, _ := plain.lastRequest(); req.Header.Get("X-Data-Parallel-Rank") != "" {
		t.Fatalf("rank header %q on a non-DP worker", req.Header.Get("X-Data-Parallel-Rank"))
	}
}

func TestDialErrorMarksAllRanksAndExcludesInstance(t *testing.T) {
	live := newFakeWorker(t, nil)
	live.set(live.recordingOK("live"))
	dead := deadURL(t)
	f := newFixture(t, []string{live.srv.URL}, RegularOptions{
		Policy: orderPolicy{[]string{dead}}, Retry: RetryConfig{MaxAttempts: 4, InitialBackoff: time.Millisecond},
	})
	if _, err := f.reg.Add(worker.ExpandDP(worker.Spec{URL: dead, DPRank: -1}, 3)...); err != nil {
		t.Fatal(err)
	}
	code, h, _ := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if code != 200 {
		t.Fatalf("status %d", code)
	}
	if h.Get("X-Test-Attempts") != "2" {
		t.Errorf("attempts %s: a retry must skip the other ranks of the dead instance", h.Get("X-Test-Attempts"))
	}
	for _, w := range f.reg.Instance(dead) {
		if !w.Suspect() {
			t.Errorf("rank %s not suspect after its instance refused a connect", w.Key())
		}
	}
}

func TestHeaderFiltering(t *testing.T) {
	wk := newFakeWorker(t, nil)
	rec := wk.recordingOK("w")
	wk.set(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Add("Set-Cookie", "a=1")
		h.Add("Set-Cookie", "b=2")
		h.Set("Connection", "X-Resp-Hop")
		h.Set("X-Resp-Hop", "v")
		h.Set("X-Request-Id", "worker-id")
		h.Set("Content-Encoding", "identity")
		rec(w, r)
	})
	for _, tc := range []struct {
		name     string
		o        RegularOptions
		wantAuth string
	}{
		{"forward client auth", RegularOptions{ForwardClientAuth: true}, "Bearer client"},
		{"api key wins", RegularOptions{ForwardClientAuth: true, APIKey: "k"}, "Bearer k"},
		{"dropped", RegularOptions{}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, []string{wk.srv.URL}, tc.o)
			_, h, _ := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`,
				"Authorization", "Bearer client",
				"Connection", "X-Hop",
				"X-Hop", "secret",
				"Te", "trailers",
				"Proxy-Authorization", "Basic x",
				"X-Multi", "a", "X-Multi", "b",
				"X-Request-Id", "client-id",
				"Traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
			)
			req, _ := wk.lastRequest()
			up := req.Header
			for _, k := range []string{"X-Hop", "Te", "Proxy-Authorization"} {
				if v := up.Get(k); v != "" {
					t.Errorf("hop-by-hop %s=%q forwarded", k, v)
				}
			}
			if strings.Contains(strings.ToLower(strings.Join(up.Values("Connection"), ",")), "x-hop") {
				t.Errorf("client Connection forwarded: %v", up.Values("Connection"))
			}
			if got := up.Values("X-Multi"); len(got) != 2 || got[0] != "a" || got[1] != "b" {
				t.Errorf("multi-value header %v", got)
			}
			if up.Get("X-Request-Id") != "client-id" || up.Get("Traceparent") == "" {
				t.Errorf("x-request-id/traceparent not forwarded: %v", up)
			}
			if got := up.Get("Authorization"); got != tc.wantAuth {
				t.Errorf("authorization %q want %q", got, tc.wantAuth)
			}
			if req.Host != strings.TrimPrefix(wk.srv.URL, "http://") {
				t.Errorf("upstream Host %q", req.Host)
			}
			if got := h.Values("Set-Cookie"); len(got) != 2 {
				t.Errorf("response Set-Cookie %v", got)
			}
			if h.Get("X-Resp-Hop") != "" {
				t.Error("response header named in Connection relayed")
			}
			if h.Get("X-Request-Id") != "router-id" {
				t.Errorf("x-request-id %q: the router's must win", h.Get("X-Request-Id"))
			}
			if h.Get("Content-Encoding") != "identity" {
				t.Error("content-encoding dropped")
			}
		})
	}
}

func TestUsageTokensCounted(t *testing.T) {
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), `"stream":true`) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n")
			fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"total_tokens\":7,\"completion_tokens\":4}}\n\n")
			fmt.Fprint(w, "data: [DONE]\n\n")
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"id":"x","choices":[{"text":"ab"}],"usage":{"prompt_tokens":10,"total_tokens":12,"completion_tokens":2,"prompt_tokens_details":null}}`)
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
	f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	f.post(testCtx(t), "/v1/completions", `{"prompt":"p","stream":true}`)
	if p := counterValue(t, f.m.TokensTotal.WithLabelValues("prompt")); p != 13 {
		t.Errorf("prompt tokens %v", p)
	}
	if c := counterValue(t, f.m.TokensTotal.WithLabelValues("completion")); c != 6 {
		t.Errorf("completion tokens %v", c)
	}
	if n := counterValue(t, f.m.TTFT.WithLabelValues("/v1/completions", "regular").(prometheus.Metric)); n != 1 {
		t.Errorf("ttft observations %v (streams only)", n)
	}
	if g := counterValue(t, f.m.RunningRequests.WithLabelValues(wk.srv.URL)); g != 0 {
		t.Errorf("running requests gauge %v after completion", g)
	}
	if g := counterValue(t, f.m.WorkerInFlight.WithLabelValues("regular")); g != 0 {
		t.Errorf("role in-flight gauge %v after completion", g)
	}
	if n := eventuallyCounter(t, f.m.CBOutcomes.WithLabelValues(wk.srv.URL, "success"), 2); n != 2 {
		t.Errorf("breaker success outcomes %v, want 2", n)
	}
	if w := f.reg.Get(wk.srv.URL); w.Load() != 0 || w.TotalRequests() != 2 {
		t.Errorf("worker load %d total %d", w.Load(), w.TotalRequests())
	}
}

func TestInFlightHeldUntilStreamEnds(t *testing.T) {
	release := make(chan struct{})
	wk := newFakeWorker(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: 1\n\n")
		http.NewResponseController(w).Flush()
		<-release
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	f := newFixture(t, []string{wk.srv.URL}, RegularOptions{})
	req, _ := http.NewRequestWithContext(testCtx(t), http.MethodPost, f.front.URL+"/v1/completions", strings.NewReader(`{"stream":true}`))
	resp, err := f.client.Do(req)
	if err != nil {
		close(release)
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	br.ReadString('\n')
	w := f.reg.Get(wk.srv.URL)
	if w.Load() != 1 {
		t.Errorf("load %d while streaming", w.Load())
	}
	if g := counterValue(t, f.m.WorkerInFlight.WithLabelValues("regular")); g != 1 {
		t.Errorf("role in-flight gauge %v while streaming, want 1", g)
	}
	if g := counterValue(t, f.m.RunningRequests.WithLabelValues(wk.srv.URL)); g != 1 {
		t.Errorf("running requests gauge %v while streaming, want 1", g)
	}
	close(release)
	io.Copy(io.Discard, br)
	resp.Body.Close()
	deadline := time.Now().Add(2 * time.Second)
	for w.Load() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if w.Load() != 0 {
		t.Errorf("load %d after the stream ended", w.Load())
	}
}
