package e2e

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

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// fleet is a router in front of simulated P and D workers, plus a unified
// worker that serves as the correctness oracle.
type fleet struct {
	r       *router
	p, d    []*sim
	unified *sim
}

// pdRequests is the matrix every PD test runs: completions and chat,
// streaming and not.
var pdRequests = []struct {
	name, path, body string
	stream           bool
}{
	{"completions", "/v1/completions", `{"model":"sim-model","prompt":"once upon a time in a land far away there lived","max_tokens":16,"stream":false,"ignore_eos":true}`, false},
	{"completions-stream", "/v1/completions", `{"model":"sim-model","prompt":"once upon a time in a land far away there lived","max_tokens":16,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`, true},
	{"chat", "/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":[{"type":"text","text":"tell me a story about routers"}]}],"max_completion_tokens":16,"ignore_eos":true}`, false},
	{"chat-stream", "/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"tell me a story about routers"}],"max_completion_tokens":16,"stream":true,"ignore_eos":true}`, true},
}

// checkOutputs sends every request of the matrix through the router and
// compares the generated text with the unified worker's answer for the same
// request: a mispaired or lost KV transfer changes the decode's output.
func (f *fleet) checkOutputs(t *testing.T) {
	t.Helper()
	ctx := ctxT(t, 60*time.Second)
	for _, rq := range pdRequests {
		code, _, ob := post(t, ctx, f.unified.URL()+rq.path, rq.body)
		if code != 200 {
			t.Fatalf("%s: oracle %d %s", rq.name, code, ob)
		}
		code, hdr, body := post(t, ctx, f.r.Base+rq.path, rq.body, "x-request-id", "client-id-123")
		if code != 200 {
			t.Fatalf("%s: router %d %s", rq.name, code, body)
		}
		var got, want string
		if rq.stream {
			got, _ = harness.SSEText(t, body)
			want, _ = harness.SSEText(t, ob)
		} else {
			got, want = completionText(t, body), completionText(t, ob)
		}
		if got != want || got == "" {
			t.Fatalf("%s: PD output %q differs from the unified worker's %q", rq.name, got, want)
		}
		if id := hdr.Get("x-request-id"); id != "client-id-123" {
			t.Errorf("%s: client x-request-id not echoed: %q", rq.name, id)
		}
	}
	f.assertClean(t)
}

// assertClean checks every P and D for failed or corrupted transfers and
// protocol violations.
func (f *fleet) assertClean(t *testing.T) {
	t.Helper()
	for _, s := range append(append([]*sim(nil), f.p...), f.d...) {
		s.assertClean(t)
	}
}

// startDiscoveredFleet starts a router with ZMQ discovery and one --strict
// prefill and decode that register with it.
func startDiscoveredFleet(t *testing.T, connector, mode string, routerArgs ...string) *fleet {
	t.Helper()
	return startDiscoveredFleetWith(t, connector, mode, nil, routerArgs...)
}

// startDiscoveredFleetWith is startDiscoveredFleet with extra P/D sim flags.
func startDiscoveredFleetWith(t *testing.T, connector, mode string, simExtra []string, routerArgs ...string) *fleet {
	t.Helper()
	zport := harness.FreePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", zport)
	args := append([]string{"--vllm-pd-disaggregation", "--kv-connector", connector, "--vllm-discovery-address", addr,
		"--policy", "round_robin", "--discovery-ttl-secs", "1.5", "--kv-wait-timeout-secs", "10"}, routerArgs...)
	f := &fleet{r: startRouter(t, args...)}
	simArgs := []string{"--kv-connector", connector, "--proxy-address", addr, "--heartbeat-interval", "200ms", "--strict"}
	if mode != "" {
		simArgs = append(simArgs, "--transfer-mode", mode)
	}
	simArgs = append(simArgs, simExtra...)
	f.p = append(f.p, startSim(t, append([]string{"--role", "prefill"}, simArgs...)...))
	f.d = append(f.d, startSim(t, append([]string{"--role", "decode"}, simArgs...)...))
	f.unified = startSim(t, "--role", "unified")
	f.r.WaitReady(t, 5*time.Second)
	return f
}

func TestPDMoRIIO(t *testing.T) {
	for _, mode := range []string{"WRITE", "READ"} {
		t.Run(mode, func(t *testing.T) {
			f := startDiscoveredFleet(t, "moriio", mode)
			f.checkOutputs(t)
			pst, dst := f.p[0].Stats(t), f.d[0].Stats(t)
			// plus the router's own warm-up of the pair (--pd-warmup), when it
			// ran before the first request found the pair
			want := int64(len(pdRequests)) + warmups(t, f.r)
			if pst.Requests.PrefillLeg != want || dst.Requests.DecodeLeg != want {
				t.Fatalf("legs: prefill %d decode %d, want %d each", pst.Requests.PrefillLeg, dst.Requests.DecodeLeg, want)
			}
			var workers struct {
				Total int `json:"total"`
			}
			if getJSON(t, f.r.Base+"/workers", &workers); workers.Total != 2 {
				t.Fatalf("/workers total %d, want 2 discovered workers", workers.Total)
			}
		})
	}
}

func TestPDP2PNCCLDiscovery(t *testing.T) {
	f := startDiscoveredFleet(t, "p2pnccl", "")
	f.checkOutputs(t)
}

func TestPDStaticNIXL(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	f := &fleet{p: []*sim{p}, d: []*sim{d}, unified: startSim(t, "--role", "unified")}
	f.r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(), "--policy", "round_robin")
	f.r.WaitReady(t, 5*time.Second)
	f.checkOutputs(t)
}

func TestPDStaticMooncake(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "mooncake", "--bootstrap-port", "0", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "mooncake", "--strict")
	f := &fleet{p: []*sim{p}, d: []*sim{d}, unified: startSim(t, "--role", "unified")}
	f.r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
		"--prefill", p.URL(), fmt.Sprint(p.Info.BootstrapPort), "--decode", d.URL(), "--policy", "round_robin")
	f.r.WaitReady(t, 5*time.Second)
	// The bootstrap /query runs in the background; requests before it
	// completes get a clear 503, so wait for the first success.
	ctx := ctxT(t, 10*time.Second)
	waitFor(t, 5*time.Second, "mooncake bootstrap", func() bool {
		code, _, _ := post(t, ctx, f.r.Base+"/v1/completions", `{"prompt":"warm up","max_tokens":2}`)
		return code == 200
	})
	f.checkOutputs(t)
}

// TestPDWritePrefillFailureFailsFast: in WRITE mode a failed prefill must
// cancel the decode that waits for KV (vLLM would wait forever) and the
// client must get an explicit error quickly.
func TestPDWritePrefillFailureFailsFast(t *testing.T) {
	f := startDiscoveredFleet(t, "moriio", "WRITE", "--pd-max-failovers", "0")
	f.p[0].SetFaults(t, map[string]any{"fail_next": 1, "fail_status": 500})
	ctx := ctxT(t, 20*time.Second)
	start := time.Now()
	code, _, body := post(t, ctx, f.r.Base+"/v1/completions", pdRequests[1].body)
	took := time.Since(start)
	if code < 500 || took > 2*time.Second {
		t.Fatalf("prefill failure: status %d after %v (%s), want a 5xx within 2s", code, took, body)
	}
	waitFor(t, 2*time.Second, "the decode to release the request", func() bool {
		st := f.d[0].Stats(t)
		return st.Requests.InFlight == 0 && st.WaitingRemote == 0
	})
	// the fleet keeps serving afterwards
	f.checkOutputs(t)
}

// TestPDClientDisconnectCancelsBothLegs: a client that goes away mid-stream
// frees the decode within ~100 ms.
func TestPDClientDisconnectCancelsBothLegs(t *testing.T) {
	f := startDiscoveredFleet(t, "moriio", "WRITE")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", f.r.Base+"/v1/completions",
		strings.NewReader(`{"prompt":"a b c d","max_tokens":5000,"stream":true,"ignore_eos":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if st := f.d[0].Stats(t); st.Requests.InFlight != 1 {
		t.Fatalf("decode in_flight %d, want 1", st.Requests.InFlight)
	}
	cancel()
	resp.Body.Close()
	took := waitFor(t, 2*time.Second, "decode to see the disconnect", func() bool { return f.d[0].Stats(t).Requests.InFlight == 0 })
	harness.TimingBound(t, "client disconnect reaching the decode", took, 150*time.Millisecond)
}

// TestPDModeRollout: a READ fleet is replaced by a WRITE fleet without
// restarting the router; a WRITE instance is held while READ instances are
// live, and prefill/decode of different modes are never paired.
func TestPDModeRollout(t *testing.T) {
	for _, tc := range []struct {
		name     string
		args     []string
		failover bool
	}{
		{"discovery TTL 1.5 s", nil, false},
		// a TTL far past the wait: only the failover can switch in time
		{"discovery TTL 60 s", []string{"--discovery-ttl-secs", "60"}, true},
	} {
		t.Run(tc.name, func(t *testing.T) { pdModeRollout(t, tc.failover, tc.args...) })
	}
}

// pdModeRollout: a READ pair serves, a WRITE pair registers and is held,
// the READ pair is killed, and the WRITE pair serves (failover: before the
// READ instances' TTL, the router having seen they cannot serve).
func pdModeRollout(t *testing.T, failover bool, routerArgs ...string) {
	f := startDiscoveredFleet(t, "moriio", "READ", routerArgs...)
	f.checkOutputs(t)
	addr := ""
	for i, a := range f.r.Cmd.Args {
		if a == "--vllm-discovery-address" {
			addr = f.r.Cmd.Args[i+1]
		}
	}
	simArgs := []string{"--kv-connector", "moriio", "--proxy-address", addr, "--heartbeat-interval", "200ms", "--transfer-mode", "WRITE", "--strict"}
	wp := startSim(t, append([]string{"--role", "prefill"}, simArgs...)...)
	wd := startSim(t, append([]string{"--role", "decode"}, simArgs...)...)
	var ws struct {
		Workers []struct {
			URL      string `json:"url"`
			Routable bool   `json:"routable"`
		} `json:"workers"`
	}
	waitFor(t, 3*time.Second, "WRITE instances listed", func() bool {
		getJSON(t, f.r.Base+"/workers", &ws)
		return len(ws.Workers) == 4
	})
	for _, w := range ws.Workers {
		isWrite := w.URL == wp.URL() || w.URL == wd.URL()
		if isWrite == w.Routable {
			t.Fatalf("while READ is live, WRITE must be held and READ routable: %+v", ws.Workers)
		}
	}
	f.checkOutputs(t) // still served by READ
	f.p[0].Kill()
	f.d[0].Kill()
	f.p, f.d = []*sim{wp}, []*sim{wd}
	took := waitFor(t, 15*time.Second, "fleet switched to WRITE", func() bool {
		code, _, _ := post(t, ctxT(t, 5*time.Second), f.r.Base+"/v1/completions", `{"prompt":"x","max_tokens":2}`)
		return code == 200 && wd.Stats(t).Requests.DecodeLeg > 0
	})
	t.Logf("the WRITE pair served %v after the READ pair was killed", took)
	if failover && !strings.Contains(f.r.Logs.String(), "failing over to the held instances") {
		t.Fatalf("the fleet switched without the failover: %s", harness.Tail(f.r.Logs.String(), 2000))
	}
	f.checkOutputs(t)
}

// TestPDMoRIIODataParallel: prefill and decode run two DP engines each. The
// router must pin P's rank (X-data-parallel-rank) and send the same rank as
// remote_dp_rank to D; a mismatch makes READ decode garbage (and strand P's
// blocks) and WRITE hang. Many concurrent requests, every output checked
// against the unified worker.
func TestPDMoRIIODataParallel(t *testing.T) {
	for _, mode := range []string{"WRITE", "READ"} {
		t.Run(mode, func(t *testing.T) {
			f := startDiscoveredFleetWith(t, "moriio", mode, []string{"--data-parallel-size", "2"})
			f.checkOutputs(t)
			const n = 48
			ctx := ctxT(t, 60*time.Second)
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := range n {
				wg.Go(func() {
					body := fmt.Sprintf(`{"model":"sim-model","prompt":"request %d asks about data parallel rank pinning %d","max_tokens":8,"ignore_eos":true,"stream":%t}`, i, i*7919, i%2 == 0)
					want, err := generate(ctx, f.unified.URL()+"/v1/completions", body, i%2 == 0)
					if err != nil {
						errs <- fmt.Errorf("request %d: oracle: %w", i, err)
						return
					}
					got, err := generate(ctx, f.r.Base+"/v1/completions", body, i%2 == 0)
					if err != nil {
						errs <- fmt.Errorf("request %d: router: %w", i, err)
						return
					}
					if got != want {
						errs <- fmt.Errorf("request %d: PD output %q differs from the unified worker's %q", i, got, want)
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if t.Failed() {
				return
			}
			for _, s := range []*sim{f.p[0], f.d[0]} {
				for _, e := range s.Stats(t).Engines {
					if e.Steps == 0 {
						t.Errorf("%s DP rank %d never ran a request: the router does not spread over P's DP ranks", s.Info.Role, e.DPRank)
					}
				}
			}
			// Every transfer was released on the rank that pinned it.
			waitFor(t, 5*time.Second, "prefill blocks released", func() bool {
				st := f.p[0].Stats(t)
				return st.KVBlocksUsed == 0 && st.Transfers.Pending == 0
			})
			f.assertClean(t)
		})
	}
}

// generate posts body and returns the generated text (SSE or JSON), with
// errors instead of test failures so it can run on any goroutine.
func generate(ctx context.Context, url, body string, stream bool) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	if !stream {
		var r struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(b, &r); err != nil || len(r.Choices) != 1 {
			return "", fmt.Errorf("bad completion %s: %v", b, err)
		}
		return r.Choices[0].Text, nil
	}
	s := string(b)
	if !strings.HasSuffix(s, "data: [DONE]\n\n") {
		return "", fmt.Errorf("stream does not end with [DONE]: %q", harness.Tail(s, 300))
	}
	var text string
	for _, ev := range strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n") {
		data, ok := strings.CutPrefix(ev, "data: ")
		if !ok {
			return "", fmt.Errorf("bad SSE event %q", ev)
		}
		if data == "[DONE]" {
			continue
		}
		var c struct {
			Error   any `json:"error"`
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil || c.Error != nil {
			return "", fmt.Errorf("bad chunk %q: %v", data, err)
		}
		for _, ch := range c.Choices {
			text += ch.Text
		}
	}
	return text, nil
}

// responsesText extracts the output text of a /v1/responses answer: the
// message's output_text (JSON) or the concatenated output_text deltas (SSE:
// "event: <type>\ndata: <json>" events, no [DONE]).
func responsesText(t *testing.T, body []byte, stream bool) string {
	t.Helper()
	if !stream {
		var r struct {
			Output []struct {
				Type    string `json:"type"`
				Content []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				} `json:"content"`
			} `json:"output"`
		}
		if err := json.Unmarshal(body, &r); err != nil || len(r.Output) == 0 || len(r.Output[0].Content) == 0 {
			t.Fatalf("bad /v1/responses answer %s: %v", body, err)
		}
		return r.Output[0].Content[0].Text
	}
	var text string
	completed := false
	for _, ev := range strings.Split(strings.TrimSpace(string(body)), "\n\n") {
		var typ, data string
		for _, line := range strings.Split(ev, "\n") {
			if v, ok := strings.CutPrefix(line, "event: "); ok {
				typ = v
			} else if v, ok := strings.CutPrefix(line, "data: "); ok {
				data = v
			}
		}
		var e struct {
			Type  string `json:"type"`
			Delta string `json:"delta"`
		}
		if err := json.Unmarshal([]byte(data), &e); err != nil || e.Type != typ {
			t.Fatalf("bad /v1/responses event %q: %v", ev, err)
		}
		switch typ {
		case "response.output_text.delta":
			text += e.Delta
		case "response.completed":
			completed = true
		case "error", "response.failed":
			t.Fatalf("/v1/responses stream failed: %s", data)
		}
	}
	if !completed {
		t.Fatalf("/v1/responses stream without response.completed: %q", harness.Tail(string(body), 300))
	}
	return text
}

// TestPDResponsesAndBatchedPrompts: /v1/responses cannot be PD-split (vLLM
// before PR #37424 drops kv_transfer_params on that route), so the router
// must serve it whole and correctly; a batched completion cannot be
// PD-split either and must be rejected with 400 before reaching a worker.
func TestPDResponsesAndBatchedPrompts(t *testing.T) {
	for _, mode := range []string{"WRITE", "READ"} {
		t.Run(mode, func(t *testing.T) {
			f := startDiscoveredFleet(t, "moriio", mode)
			ctx := ctxT(t, 30*time.Second)
			for _, stream := range []bool{false, true} {
				body := fmt.Sprintf(`{"model":"sim-model","input":[{"role":"user","content":[{"type":"input_text","text":"tell me about routers"}]}],"instructions":"be brief","max_output_tokens":12,"ignore_eos":true,"stream":%t}`, stream)
				code, _, ob := post(t, ctx, f.unified.URL()+"/v1/responses", body)
				if code != 200 {
					t.Fatalf("oracle: %d %s", code, ob)
				}
				code, _, rb := post(t, ctx, f.r.Base+"/v1/responses", body)
				if code != 200 {
					t.Fatalf("/v1/responses (stream=%t) through the PD router: %d %s", stream, code, rb)
				}
				if got, want := responsesText(t, rb, stream), responsesText(t, ob, stream); got != want || got == "" {
					t.Fatalf("/v1/responses (stream=%t): router output %q differs from the unified worker's %q", stream, got, want)
				}
			}
			f.assertClean(t)
			before := f.p[0].Stats(t).Requests.Completions + f.d[0].Stats(t).Requests.Completions
			code, _, body := post(t, ctx, f.r.Base+"/v1/completions", `{"model":"sim-model","prompt":["first prompt","second prompt"],"max_tokens":4,"ignore_eos":true}`)
			if code != 400 {
				t.Fatalf("batched completion in PD mode: %d %s, want 400 (one kv_transfer_params cannot serve several prompts)", code, body)
			}
			if after := f.p[0].Stats(t).Requests.Completions + f.d[0].Stats(t).Requests.Completions; after != before {
				t.Errorf("the rejected batched completion reached the workers (%d -> %d completions)", before, after)
			}
			f.assertClean(t)
		})
	}
}

// warmups is how many pair warm-ups the router has sent.
func warmups(t *testing.T, r *router) int64 {
	t.Helper()
	mfs, _ := scrape(t, r.Metrics)
	var n float64
	if mf := mfs["vllm_router_pd_warmups_total"]; mf != nil {
		for _, m := range mf.GetMetric() {
			n += m.GetCounter().GetValue()
		}
	}
	return int64(n)
}

// TestPDWarmupTakesTheHandshake: a new P/D pair's first request pays the
// engines' first-contact KV handshake (1.5 s here) unless the router has
// already warmed the pair up.
func TestPDWarmupTakesTheHandshake(t *testing.T) {
	const hs = 1500 * time.Millisecond
	for _, tc := range []struct {
		name string
		args []string
	}{{"warm-up", nil}, {"no warm-up", []string{"--pd-warmup=false"}}} {
		t.Run(tc.name, func(t *testing.T) {
			f := startDiscoveredFleetWith(t, "moriio", "WRITE", []string{"--handshake-time", hs.String()}, tc.args...)
			if tc.args == nil {
				waitFor(t, 10*time.Second, "the pair warmed up", func() bool { return warmups(t, f.r) == 1 })
			} else {
				time.Sleep(300 * time.Millisecond) // time a warm-up would have had
			}
			ctx := ctxT(t, 30*time.Second)
			start := time.Now()
			code, _, body := post(t, ctx, f.r.Base+"/v1/completions",
				`{"model":"sim-model","prompt":"first request","max_tokens":4,"stream":true,"ignore_eos":true}`)
			ttft := time.Since(start)
			if code != 200 {
				t.Fatalf("%d %s", code, body)
			}
			harness.SSEText(t, body)
			t.Logf("%s: first request took %v", tc.name, ttft)
			if tc.args == nil && ttft >= hs {
				t.Fatalf("warmed pair: the first request took %v, it still paid the %v handshake", ttft, hs)
			}
			if tc.args != nil && ttft < hs {
				t.Fatalf("--pd-warmup=false: the first request took only %v, no %v handshake: is warm-up still on?", ttft, hs)
			}
			if n := warmups(t, f.r); (n == 0) != (tc.args != nil) {
				t.Fatalf("warm-ups %d", n)
			}
			var workers struct {
				PD struct {
					Connector string `json:"connector"`
					Warmup    *struct {
						OK   int `json:"ok_total"`
						Warm int `json:"warm_pairs"`
					} `json:"warmup"`
				} `json:"pd"`
			}
			getJSON(t, f.r.Base+"/workers", &workers)
			if w := workers.PD.Warmup; workers.PD.Connector != "moriio" || (w == nil) != (tc.args != nil) || (w != nil && (w.OK != 1 || w.Warm != 1)) {
				t.Fatalf("/workers pd status %+v warmup %+v", workers.PD, workers.PD.Warmup)
			}
			f.assertClean(t)
		})
	}
}
