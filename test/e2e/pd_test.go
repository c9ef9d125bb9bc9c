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
		code, hdr, body := post(t, ctx, f.r.base+rq.path, rq.body, "x-request-id", "client-id-123")
		if code != 200 {
			t.Fatalf("%s: router %d %s", rq.name, code, body)
		}
		var got, want string
		if rq.stream {
			got, _ = sseText(t, body)
			want, _ = sseText(t, ob)
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
	for _, d := range f.d {
		st := d.stats(t)
		if st.Transfers.KVDigestMismatch != 0 || st.Transfers.KVGarbage != 0 {
			t.Fatalf("decode saw corrupted KV: %+v", st.Transfers)
		}
	}
}

func startDiscoveredFleet(t *testing.T, connector, mode string, routerArgs ...string) *fleet {
	t.Helper()
	zport := freePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", zport)
	args := append([]string{"--vllm-pd-disaggregation", "--kv-connector", connector, "--vllm-discovery-address", addr,
		"--policy", "round_robin", "--discovery-ttl-secs", "1.5"}, routerArgs...)
	f := &fleet{r: startRouter(t, args...)}
	simArgs := []string{"--kv-connector", connector, "--proxy-address", addr, "--heartbeat-interval", "200ms"}
	if mode != "" {
		simArgs = append(simArgs, "--transfer-mode", mode)
	}
	f.p = append(f.p, startSim(t, append([]string{"--role", "prefill"}, simArgs...)...))
	f.d = append(f.d, startSim(t, append([]string{"--role", "decode"}, simArgs...)...))
	f.unified = startSim(t, "--role", "unified")
	f.r.waitReady(t, 5*time.Second)
	return f
}

func TestPDMoRIIO(t *testing.T) {
	for _, mode := range []string{"WRITE", "READ"} {
		t.Run(mode, func(t *testing.T) {
			f := startDiscoveredFleet(t, "moriio", mode)
			f.checkOutputs(t)
			pst, dst := f.p[0].stats(t), f.d[0].stats(t)
			if pst.Requests.PrefillLeg != int64(len(pdRequests)) || dst.Requests.DecodeLeg != int64(len(pdRequests)) {
				t.Fatalf("legs: prefill %d decode %d, want %d each", pst.Requests.PrefillLeg, dst.Requests.DecodeLeg, len(pdRequests))
			}
			var workers struct {
				Total int `json:"total"`
			}
			if getJSON(t, f.r.base+"/workers", &workers); workers.Total != 2 {
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
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl")
	f := &fleet{p: []*sim{p}, d: []*sim{d}, unified: startSim(t, "--role", "unified")}
	f.r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(), "--policy", "round_robin")
	f.r.waitReady(t, 5*time.Second)
	f.checkOutputs(t)
}

func TestPDStaticMooncake(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "mooncake", "--bootstrap-port", "0")
	d := startSim(t, "--role", "decode", "--kv-connector", "mooncake")
	f := &fleet{p: []*sim{p}, d: []*sim{d}, unified: startSim(t, "--role", "unified")}
	f.r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
		"--prefill", p.URL(), fmt.Sprint(p.info.BootstrapPort), "--decode", d.URL(), "--policy", "round_robin")
	f.r.waitReady(t, 5*time.Second)
	// The bootstrap /query runs in the background; requests before it
	// completes get a clear 503, so wait for the first success.
	ctx := ctxT(t, 10*time.Second)
	waitFor(t, 5*time.Second, "mooncake bootstrap", func() bool {
		code, _, _ := post(t, ctx, f.r.base+"/v1/completions", `{"prompt":"warm up","max_tokens":2}`)
		return code == 200
	})
	f.checkOutputs(t)
}

// TestPDWritePrefillFailureFailsFast: in WRITE mode a failed prefill must
// cancel the decode that waits for KV (vLLM would wait forever) and the
// client must get an explicit error quickly.
func TestPDWritePrefillFailureFailsFast(t *testing.T) {
	f := startDiscoveredFleet(t, "moriio", "WRITE", "--pd-max-failovers", "0")
	f.p[0].setFaults(t, map[string]any{"fail_next": 1, "fail_status": 500})
	ctx := ctxT(t, 20*time.Second)
	start := time.Now()
	code, _, body := post(t, ctx, f.r.base+"/v1/completions", pdRequests[1].body)
	took := time.Since(start)
	if code < 500 || took > 2*time.Second {
		t.Fatalf("prefill failure: status %d after %v (%s), want a 5xx within 2s", code, took, body)
	}
	waitFor(t, 2*time.Second, "the decode to release the request", func() bool {
		st := f.d[0].stats(t)
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
	req, _ := http.NewRequestWithContext(ctx, "POST", f.r.base+"/v1/completions",
		strings.NewReader(`{"prompt":"a b c d","max_tokens":5000,"stream":true,"ignore_eos":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if st := f.d[0].stats(t); st.Requests.InFlight != 1 {
		t.Fatalf("decode in_flight %d, want 1", st.Requests.InFlight)
	}
	cancel()
	resp.Body.Close()
	took := waitFor(t, 2*time.Second, "decode to see the disconnect", func() bool { return f.d[0].stats(t).Requests.InFlight == 0 })
	t.Logf("client disconnect reached the decode in %v", took)
	if took > 150*time.Millisecond {
		t.Errorf("cancellation took %v, want <= 100 ms (+ polling slack)", took)
	}
}

// TestPDModeRollout: a READ fleet is replaced by a WRITE fleet without
// restarting the router; a WRITE instance is held while READ instances are
// live, and prefill/decode of different modes are never paired.
func TestPDModeRollout(t *testing.T) {
	f := startDiscoveredFleet(t, "moriio", "READ")
	f.checkOutputs(t)
	addr := ""
	for i, a := range f.r.cmd.Args {
		if a == "--vllm-discovery-address" {
			addr = f.r.cmd.Args[i+1]
		}
	}
	simArgs := []string{"--kv-connector", "moriio", "--proxy-address", addr, "--heartbeat-interval", "200ms", "--transfer-mode", "WRITE"}
	wp := startSim(t, append([]string{"--role", "prefill"}, simArgs...)...)
	wd := startSim(t, append([]string{"--role", "decode"}, simArgs...)...)
	var ws struct {
		Workers []struct {
			URL      string `json:"url"`
			Routable bool   `json:"routable"`
		} `json:"workers"`
	}
	waitFor(t, 3*time.Second, "WRITE instances listed", func() bool {
		getJSON(t, f.r.base+"/workers", &ws)
		return len(ws.Workers) == 4
	})
	for _, w := range ws.Workers {
		isWrite := w.URL == wp.URL() || w.URL == wd.URL()
		if isWrite == w.Routable {
			t.Fatalf("while READ is live, WRITE must be held and READ routable: %+v", ws.Workers)
		}
	}
	f.checkOutputs(t) // still served by READ
	f.p[0].kill()
	f.d[0].kill()
	f.p, f.d = []*sim{wp}, []*sim{wd}
	waitFor(t, 5*time.Second, "fleet switched to WRITE", func() bool {
		code, _, _ := post(t, ctxT(t, 5*time.Second), f.r.base+"/v1/completions", `{"prompt":"x","max_tokens":2}`)
		return code == 200 && wd.stats(t).Requests.DecodeLeg > 0
	})
	f.checkOutputs(t)
}
