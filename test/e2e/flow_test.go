package e2e

import (
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

// Flow control end to end: two vllm-sim workers of capacity 2 each
// (--max-num-seqs 2), a router holding requests while both are at
// --flow-worker-max-inflight 2, priorities and tenants mixed.

// flowSimArgs: ~24 decode steps of 20 ms = ~0.5 s per request.
// flowSimArgs: vLLM's priority scheduling, since one request carries the
// "priority" field (an fcfs vLLM answers it with 400).
var flowSimArgs = []string{"--role", "unified", "--max-num-seqs", "2", "--decode-step-base", "20ms", "--decode-step-per-seq", "0", "--scheduling-policy", "priority"}

const flowBody = `{"model":"sim-model","prompt":"flow control","max_tokens":24,"ignore_eos":true%s}`

type flowResult struct {
	name   string
	status int
	hdr    http.Header
	body   []byte
	end    time.Time
}

// flowClient sends requests in the background and collects the results.
type flowClient struct {
	t   *testing.T
	url string
	mu  sync.Mutex
	res []flowResult
	wg  sync.WaitGroup
}

func (c *flowClient) send(ctx context.Context, name, extra string, hdr ...string) {
	c.wg.Go(func() {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url+"/v1/completions", strings.NewReader(fmt.Sprintf(flowBody, extra)))
		if err != nil {
			panic(err)
		}
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		r := flowResult{name: name, status: -1}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			r.status, r.hdr = resp.StatusCode, resp.Header
			r.body, err = io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		if err != nil {
			r.body = []byte(err.Error())
			if ctx.Err() != nil {
				r.status = 499
			}
		}
		r.end = time.Now()
		c.mu.Lock()
		c.res = append(c.res, r)
		c.mu.Unlock()
	})
}

// wait waits (≤ 60 s) for every request and returns the results by end time.
func (c *flowClient) wait() []flowResult {
	done := make(chan struct{})
	go func() { c.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		c.t.Fatal("flow requests did not finish within 60 s")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	out := slices.Clone(c.res)
	slices.SortFunc(out, func(a, b flowResult) int { return a.end.Compare(b.end) })
	return out
}

// routerGauge reads one sample of the router's /metrics (sum over the
// series whose line starts with prefix).
func routerGauge(t *testing.T, r *router, prefix string) float64 {
	t.Helper()
	resp, err := http.Get(r.Metrics)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, prefix) {
			var v float64
			if _, err := fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v); err == nil {
				sum += v
			}
		}
	}
	return sum
}

func startFlowFleet(t *testing.T, extra ...string) (*router, []*sim) {
	t.Helper()
	return startCountedFlowFleet(t, nil, extra...)
}

// startCountedFlowFleet is startFlowFleet with, when c is not nil, a
// counting proxy in front of each sim (the router is given the proxies).
func startCountedFlowFleet(t *testing.T, c *harness.InFlight, extra ...string) (*router, []*sim) {
	t.Helper()
	a, b := startSim(t, flowSimArgs...), startSim(t, flowSimArgs...)
	urls := []string{a.URL(), b.URL()}
	if c != nil {
		for i, u := range urls {
			urls[i] = harness.CountingProxy(t, u, c)
		}
	}
	args := append([]string{"--worker-urls", urls[0], urls[1], "--policy", "power_of_two", "--flow-control",
		"--flow-worker-max-inflight", "2", "--flow-poll-interval-secs", "0.05", "--queue-size", "64"}, extra...)
	r := startRouter(t, args...)
	r.WaitReady(t, 10*time.Second)
	return r, []*sim{a, b}
}

// waitQueued waits until the router's flow queue holds n requests.
func waitQueued(t *testing.T, r *router, n int) {
	t.Helper()
	waitFor(t, 20*time.Second, fmt.Sprintf("%d requests queued in the router", n), func() bool {
		return routerGauge(t, r, "vllm_router_queue_depth ") == float64(n)
	})
}

func TestFlowControlPriorityAndSaturation(t *testing.T) {
	var upstream harness.InFlight
	r, _ := startCountedFlowFleet(t, &upstream)
	ctx := ctxT(t, 90*time.Second)
	c := &flowClient{t: t, url: r.Base}

	// 4 low requests fill the fleet, 8 more wait in the router, then two
	// high ones (one by header, one by vLLM's priority field) arrive.
	for i := range 12 {
		c.send(ctx, fmt.Sprintf("low%02d", i), "", "x-gateway-inference-objective", "low")
	}
	waitQueued(t, r, 8)
	var workers struct {
		Workers []struct {
			URL        string `json:"url"`
			Saturation *struct {
				Saturated   bool `json:"saturated"`
				InFlight    int  `json:"in_flight"`
				MaxInFlight int  `json:"max_in_flight"`
			} `json:"saturation"`
		} `json:"workers"`
	}
	if code := getJSON(t, r.Base+"/workers", &workers); code != 200 || len(workers.Workers) != 2 {
		t.Fatalf("/workers: %d %+v", code, workers)
	}
	for _, w := range workers.Workers {
		if w.Saturation == nil || !w.Saturation.Saturated || w.Saturation.InFlight != 2 || w.Saturation.MaxInFlight != 2 {
			t.Fatalf("/workers saturation of %s: %+v", w.URL, w.Saturation)
		}
	}
	c.send(ctx, "high-hdr", "", "x-gateway-inference-objective", "high")
	c.send(ctx, "high-body", `,"priority":-10`)
	waitQueued(t, r, 10)
	res := c.wait()

	pos := map[string]int{}
	for i, x := range res {
		if x.status != 200 || completionText(t, x.body) == "" {
			t.Fatalf("%s: %d %s", x.name, x.status, x.body)
		}
		pos[x.name] = i
	}
	// Waves of 4: four lows run first; the highs take the next two free
	// slots (beside two lows); the other six queued lows end a wave or
	// two later. FIFO would put the highs last.
	lateLows := 0
	for i := range 12 {
		if pos[fmt.Sprintf("low%02d", i)] > max(pos["high-hdr"], pos["high-body"]) {
			lateLows++
		}
	}
	if lateLows < 6 {
		t.Fatalf("only %d of the 12 low requests ended after both high ones: %v", lateLows, names(res))
	}
	// The router lets at most 4 through (2 workers × 2), counted by one
	// counter in front of both workers. Without flow control all 14 would
	// be in the engines at once.
	if peak := upstream.Peak(); peak != 4 {
		t.Fatalf("the workers held at most %d requests at once; the router limit is 4 and the fleet was full", peak)
	}
	if v := routerGauge(t, r, `vllm_router_flow_queue_wait_seconds_count{band="low"}`); v != 12 {
		t.Fatalf("low band wait samples %v, want 12", v)
	}
}

func names(rs []flowResult) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.name
	}
	return out
}

func TestFlowControlFairShare(t *testing.T) {
	r, _ := startFlowFleet(t, "--flow-weights", "gold=2")
	ctx := ctxT(t, 90*time.Second)
	c := &flowClient{t: t, url: r.Base}
	// Fill the fleet, then a heavy tenant queues 16 requests before a
	// light one queues 4: the light tenant must not wait behind all 16.
	for i := range 4 {
		c.send(ctx, fmt.Sprintf("fill%d", i), "")
	}
	waitFor(t, 20*time.Second, "fleet full", func() bool {
		return routerGauge(t, r, "vllm_router_running_requests{") == 4
	})
	for i := range 16 {
		c.send(ctx, fmt.Sprintf("heavy%02d", i), "", "x-gateway-inference-fairness-id", "heavy")
	}
	waitQueued(t, r, 16)
	for i := range 4 {
		c.send(ctx, fmt.Sprintf("light%d", i), `,"user":"ignored"`, "x-gateway-inference-fairness-id", "light")
	}
	waitQueued(t, r, 20)
	res := c.wait()
	lastLight, heavyAfter := 0, 0
	for i, x := range res {
		if x.status != 200 {
			t.Fatalf("%s: %d %s", x.name, x.status, x.body)
		}
		if strings.HasPrefix(x.name, "light") {
			lastLight = i
		}
	}
	for _, x := range res[lastLight+1:] {
		if strings.HasPrefix(x.name, "heavy") {
			heavyAfter++
		}
	}
	// Alternating turns: the 4 light requests are dispatched within the
	// first 8 queue slots, so at least 8 heavy ones end after the last light.
	if heavyAfter < 8 {
		t.Fatalf("only %d heavy requests ended after the last light one: %v", heavyAfter, names(res))
	}
	if v := routerGauge(t, r, `vllm_router_flow_flow_queue_wait_seconds_count{flow="light"}`); v != 4 {
		t.Fatalf("light flow wait samples %v", v)
	}
}

func TestFlowControlShedDeadlineDisconnect(t *testing.T) {
	r, _ := startFlowFleet(t, "--queue-size", "3")
	ctx := ctxT(t, 90*time.Second)
	c := &flowClient{t: t, url: r.Base}
	for i := range 4 {
		c.send(ctx, fmt.Sprintf("fill%d", i), "")
	}
	waitFor(t, 20*time.Second, "fleet full", func() bool {
		return routerGauge(t, r, "vllm_router_running_requests{") == 4
	})
	// A queued client that leaves frees its queue place at once.
	gone, leave := context.WithCancel(ctx)
	c.send(gone, "gone", "")
	waitQueued(t, r, 1)
	leave()
	waitQueued(t, r, 0)

	for i := range 3 {
		c.send(ctx, fmt.Sprintf("low%d", i), "", "x-gateway-inference-objective", "low")
	}
	waitQueued(t, r, 3)
	// A deadline shorter than the wait: 504 with a JSON error body.
	code, _, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(flowBody, ""), "x-gateway-inference-objective", "high", "x-envoy-expected-rq-timeout-ms", "100")
	if code != http.StatusGatewayTimeout || !strings.Contains(string(body), "deadline") {
		t.Fatalf("deadline: %d %s", code, body)
	}
	// The queue is full of low requests: a default one sheds the newest.
	c.send(ctx, "default", "")
	waitFor(t, 20*time.Second, "a low request shed", func() bool {
		return routerGauge(t, r, `vllm_router_flow_rejections_total{band="low",reason="shed"}`) == 1
	})
	// A low newcomer finds no lower band to shed: 429 queue full.
	code, hdr, body := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(flowBody, ""), "x-gateway-inference-objective", "low")
	if code != http.StatusTooManyRequests || hdr.Get("Retry-After") == "" || !strings.Contains(string(body), "queue is full") {
		t.Fatalf("queue full: %d %v %s", code, hdr, body)
	}
	code, _, body = post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(flowBody, ""), "x-gateway-inference-objective", "nonesuch")
	if code != http.StatusBadRequest || !strings.Contains(string(body), "nonesuch") {
		t.Fatalf("unknown objective: %d %s", code, body)
	}
	res := c.wait()
	shed := 0
	for _, x := range res {
		switch {
		case x.name == "gone":
			if x.status != 499 {
				t.Fatalf("gone: %d %s", x.status, x.body)
			}
		case x.status == http.StatusTooManyRequests:
			var e struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			if json.Unmarshal(x.body, &e) != nil || !strings.Contains(e.Error.Message, "higher-priority") || x.hdr.Get("Retry-After") == "" || !strings.HasPrefix(x.name, "low") {
				t.Fatalf("shed answer of %s: %v %s", x.name, x.hdr, x.body)
			}
			shed++
		case x.status != 200:
			t.Fatalf("%s: %d %s", x.name, x.status, x.body)
		}
	}
	if shed != 1 {
		t.Fatalf("%d requests shed, want 1: %v", shed, names(res))
	}
}

// TestFlowControlPD: in PD mode the decode fleet's in-flight limit holds
// requests in the router; every request still completes through both legs.
func TestFlowControlPD(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, append([]string{"--role", "decode", "--kv-connector", "nixl", "--strict"}, flowSimArgs[2:]...)...)
	r := startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(),
		"--policy", "round_robin", "--flow-control", "--flow-worker-max-inflight", "2", "--flow-poll-interval-secs", "0.05")
	r.WaitReady(t, 10*time.Second)
	ctx := ctxT(t, 90*time.Second)
	c := &flowClient{t: t, url: r.Base}
	for i := range 8 {
		c.send(ctx, fmt.Sprintf("r%d", i), "")
	}
	waitQueued(t, r, 6) // the single decode holds 2
	var workers struct {
		Workers []struct {
			WorkerType string `json:"worker_type"`
			Saturation *struct {
				Saturated bool `json:"saturated"`
				InFlight  int  `json:"in_flight"`
			} `json:"saturation"`
		} `json:"workers"`
	}
	// the two admitted requests spend a few ms in their prefill leg, then
	// ~0.5 s on the decode
	waitFor(t, 20*time.Second, "/workers showing the decode at its limit", func() bool {
		if code := getJSON(t, r.Base+"/workers", &workers); code != 200 {
			t.Fatalf("/workers: %d", code)
		}
		for _, w := range workers.Workers {
			if w.WorkerType == "decode" && w.Saturation != nil && w.Saturation.Saturated && w.Saturation.InFlight == 2 {
				return true
			}
		}
		return false
	})
	waitFor(t, 20*time.Second, "fleet_saturated{decode}", func() bool {
		return routerGauge(t, r, `vllm_router_fleet_saturated{role="decode"}`) == 1
	})
	for _, x := range c.wait() {
		if x.status != 200 || completionText(t, x.body) == "" {
			t.Fatalf("%s: %d %s", x.name, x.status, x.body)
		}
	}
	if st := d.Stats(t); st.Transfers.ProtocolViolations != 0 || st.Transfers.Failed != 0 {
		t.Fatalf("decode transfers: %+v", st.Transfers)
	}
}

// TestFlowControlPolledWaiting: without an in-flight limit, saturation
// comes from vllm:num_requests_waiting polled from each worker's /metrics.
func TestFlowControlPolledWaiting(t *testing.T) {
	args := []string{"--role", "unified", "--max-num-seqs", "1", "--decode-step-base", "20ms", "--decode-step-per-seq", "0"}
	a, b := startSim(t, args...), startSim(t, args...)
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "power_of_two", "--flow-control",
		"--flow-max-waiting", "1", "--flow-max-kv-usage", "0", "--flow-poll-interval-secs", "0.05")
	r.WaitReady(t, 10*time.Second)
	ctx := ctxT(t, 90*time.Second)
	c := &flowClient{t: t, url: r.Base}
	// one every 100 ms: the engines (one slot each, ~0.5 s per request)
	// build a queue, the router sees it within a poll and holds the rest
	for i := range 10 {
		c.send(ctx, fmt.Sprintf("r%d", i), "")
		time.Sleep(100 * time.Millisecond)
	}
	var workers struct {
		Workers []struct {
			Saturation *struct {
				Waiting *float64 `json:"num_requests_waiting"`
				Polled  string   `json:"polled_at"`
			} `json:"saturation"`
		} `json:"workers"`
	}
	if code := getJSON(t, r.Base+"/workers", &workers); code != 200 || len(workers.Workers) != 2 {
		t.Fatalf("/workers: %d", code)
	}
	for _, w := range workers.Workers {
		if w.Saturation == nil || w.Saturation.Waiting == nil || w.Saturation.Polled == "" {
			t.Fatalf("/workers saturation without polled values: %+v", w.Saturation)
		}
	}
	for _, x := range c.wait() {
		if x.status != 200 {
			t.Fatalf("%s: %d %s", x.name, x.status, x.body)
		}
	}
	// Requests were held in the router: without flow control (and with no
	// slot limit) none would wait there at all.
	n := routerGauge(t, r, `vllm_router_flow_queue_wait_seconds_count{band="default"}`)
	quick := routerGauge(t, r, `vllm_router_flow_queue_wait_seconds_bucket{band="default",le="0.05"}`)
	if n != 10 || n-quick < 1 {
		t.Fatalf("%v requests, %v of them waited < 50 ms in the router: none was held on polled saturation", n, quick)
	}
	if v := routerGauge(t, r, `vllm_router_saturation_polls_total{result="ok"}`); v < 2 {
		t.Fatalf("saturation polls ok = %v", v)
	}
}
