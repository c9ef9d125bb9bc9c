package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

const completionBody = `{"model":"sim-model","prompt":"the quick brown fox jumps over the lazy dog","max_tokens":12%s}`

// TestRegularProxy: the router in front of two simulated workers forwards
// streaming and non-streaming requests faithfully, spreads round-robin,
// and maps bad input to the right statuses.
func TestRegularProxy(t *testing.T) {
	a := startSim(t, "--role", "unified")
	b := startSim(t, "--role", "unified")
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin", "--max-payload-size", "4096")
	r.WaitReady(t, 5*time.Second)
	ctx := ctxT(t, 30*time.Second)

	// Oracle: the worker's own answer.
	code, _, direct := post(t, ctx, a.URL()+"/v1/completions", fmt.Sprintf(completionBody, ""))
	if code != 200 {
		t.Fatalf("direct: %d %s", code, direct)
	}
	want := completionText(t, direct)

	t.Run("non-streaming", func(t *testing.T) {
		code, hdr, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(completionBody, ""))
		if code != 200 || completionText(t, body) != want {
			t.Fatalf("got %d %s want text %q", code, body, want)
		}
		if hdr.Get("x-request-id") == "" {
			t.Errorf("no x-request-id echoed")
		}
	})
	t.Run("streaming", func(t *testing.T) {
		code, hdr, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(completionBody, `,"stream":true,"stream_options":{"include_usage":true}`))
		if code != 200 || !strings.HasPrefix(hdr.Get("Content-Type"), "text/event-stream") {
			t.Fatalf("got %d %v", code, hdr)
		}
		text, events := harness.SSEText(t, body)
		if text != want || events != 12 {
			t.Fatalf("stream text %q (%d events) want %q (12)", text, events, want)
		}
		if !strings.Contains(string(body), `"usage"`) {
			t.Errorf("usage chunk not relayed")
		}
	})
	t.Run("round-robin spread", func(t *testing.T) {
		sa, sb := a.Stats(t).Requests.Completions, b.Stats(t).Requests.Completions
		for range 10 {
			if code, _, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(completionBody, "")); code != 200 {
				t.Fatalf("%d %s", code, body)
			}
		}
		da, db := a.Stats(t).Requests.Completions-sa, b.Stats(t).Requests.Completions-sb
		if da != 5 || db != 5 {
			t.Fatalf("round robin spread %d/%d, want 5/5", da, db)
		}
	})
	t.Run("bad input", func(t *testing.T) {
		cases := []struct {
			name, method, path, body string
			want                     int
		}{
			{"malformed JSON", "POST", "/v1/completions", `{"prompt": "x",`, 400},
			{"not an object", "POST", "/v1/chat/completions", `[1,2]`, 400},
			{"oversized", "POST", "/v1/completions", `{"prompt":"` + strings.Repeat("a", 5000) + `"}`, 413},
			{"wrong method", "GET", "/v1/completions", ``, 405},
			{"unknown path", "GET", "/no/such/path", ``, 404},
		}
		for _, c := range cases {
			req, _ := http.NewRequestWithContext(ctx, c.method, r.Base+c.path, strings.NewReader(c.body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var e struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			_ = json.NewDecoder(resp.Body).Decode(&e)
			resp.Body.Close()
			if resp.StatusCode != c.want {
				t.Errorf("%s: status %d want %d", c.name, resp.StatusCode, c.want)
			}
			if e.Error.Message == "" {
				t.Errorf("%s: no JSON error message", c.name)
			}
		}
	})
}

// TestRegularStreamingFlushAndCancel: events reach the client as the worker
// produces them, and a client disconnect cancels the upstream request, with
// either HTTP server on the client listener (--http-server).
func TestRegularStreamingFlushAndCancel(t *testing.T) {
	for _, srv := range []string{"net/http", "builtin"} {
		t.Run(srv, func(t *testing.T) { testStreamingFlushAndCancel(t, srv) })
	}
}

func testStreamingFlushAndCancel(t *testing.T, srv string) {
	slow := startSim(t, "--role", "unified", "--decode-step-base", "40ms", "--prefill-base", "1s")
	r := startRouter(t, "--worker-urls", slow.URL(), "--policy", "round_robin", "--http-server", srv)
	r.WaitReady(t, 5*time.Second)

	t.Run("flushed per event", func(t *testing.T) {
		ctx := ctxT(t, 20*time.Second)
		req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/v1/completions",
			strings.NewReader(`{"prompt":"a b c","max_tokens":10,"stream":true}`))
		start := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		var arrivals []time.Duration
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "data: {") {
				arrivals = append(arrivals, time.Since(start))
			}
		}
		if len(arrivals) != 10 {
			t.Fatalf("%d events, want 10", len(arrivals))
		}
		// 10 steps of 40 ms: with per-event flushing, the first event arrives
		// long before the last; a buffering proxy would deliver them together.
		if gap := arrivals[9] - arrivals[0]; gap < 250*time.Millisecond {
			t.Fatalf("events arrived bunched: first %v last %v", arrivals[0], arrivals[9])
		}
	})
	t.Run("client cancel propagates", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", r.Base+"/v1/completions",
			strings.NewReader(`{"prompt":"a b c","max_tokens":2000,"stream":true}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(resp.Body)
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		if st := slow.Stats(t); st.Requests.InFlight != 1 {
			t.Fatalf("worker in_flight %d, want 1", st.Requests.InFlight)
		}
		cancel()
		resp.Body.Close()
		took := waitFor(t, 2*time.Second, "worker to see the cancellation", func() bool { return slow.Stats(t).Requests.InFlight == 0 })
		harness.TimingBound(t, "client cancel reaching the worker", took, 150*time.Millisecond)
	})
	// Nothing is written to the client while the worker prefills, so only
	// the server's own watch of the client connection can notice it left.
	t.Run("client gone before the first byte", func(t *testing.T) {
		conn, err := net.Dial("tcp", strings.TrimPrefix(r.Base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		body := `{"prompt":"a b c","max_tokens":5,"stream":true}`
		fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		waitFor(t, 2*time.Second, "the worker to receive the request", func() bool { return slow.Stats(t).Requests.InFlight == 1 })
		conn.Close()
		took := waitFor(t, 900*time.Millisecond, "worker to see the cancellation", func() bool { return slow.Stats(t).Requests.InFlight == 0 })
		harness.TimingBound(t, "client close reaching the worker during prefill", took, 400*time.Millisecond)
	})
}

// TestRegularUpstreamFailures: a dead worker answers 502 (connect failure;
// panic routing keeps trying the only worker, each attempt refused at
// once); without panic routing it is taken out once the router has marked
// it down (503); upstream timeout → 504.
func TestRegularUpstreamFailures(t *testing.T) {
	dead := fmt.Sprintf("http://127.0.0.1:%d", harness.FreePort(t))
	r := startRouter(t, "--worker-urls", dead, "--policy", "round_robin", "--disable-retries")
	ctx := ctxT(t, 20*time.Second)
	for i := range 2 {
		code, _, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(completionBody, ""))
		if code != 502 || !strings.Contains(string(body), "connect") {
			t.Fatalf("request %d to a dead worker: %d %s, want 502", i, code, body)
		}
	}
	r0 := startRouter(t, "--worker-urls", dead, "--policy", "round_robin", "--disable-retries", "--panic-routing=false")
	waitFor(t, 10*time.Second, "the dead worker marked unhealthy", func() bool {
		var ws struct {
			Workers []struct {
				Healthy bool `json:"is_healthy"`
			} `json:"workers"`
		}
		return getJSON(t, r0.Base+"/workers", &ws) == 200 && len(ws.Workers) == 1 && !ws.Workers[0].Healthy
	})
	code, _, body := post(t, ctx, r0.Base+"/v1/completions", fmt.Sprintf(completionBody, ""))
	if code != 503 || !strings.Contains(string(body), "worker") {
		t.Fatalf("dead worker not taken out: %d %s, want 503", code, body)
	}

	stall := startSim(t, "--role", "unified", "--stall-first-token", "5s")
	r2 := startRouter(t, "--worker-urls", stall.URL(), "--policy", "round_robin", "--request-timeout-secs", "1", "--disable-retries")
	start := time.Now()
	code, _, body = post(t, ctx, r2.Base+"/v1/completions", fmt.Sprintf(completionBody, ""))
	if code != 504 || time.Since(start) > 3*time.Second {
		t.Fatalf("upstream timeout: %d %s after %v, want 504 after ~1s", code, body, time.Since(start))
	}
}
