package e2e

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/kvevents/kvtest"
)

// stored is the BlockStored an engine publishes after caching the full
// blocks of tokens.
func stored(name string, tokens []int, bs int) map[string]any {
	var hs []any
	for i := range len(tokens) / bs {
		hs = append(hs, map[string]string{"bytes": hex.EncodeToString(fmt.Appendf(nil, "%s/%d", name, i))})
	}
	return map[string]any{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": nil,
		"token_ids": tokens[:len(hs)*bs], "block_size": bs, "lora_id": nil, "medium": "GPU", "lora_name": nil}
}

func tokenize(t *testing.T, s *sim, prompt string) []int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, _, b := post(t, ctx, s.URL()+"/tokenize", fmt.Sprintf(`{"prompt":%q}`, prompt))
	var out struct{ Tokens []int }
	if st != 200 || json.Unmarshal(b, &out) != nil {
		t.Fatalf("tokenize: %d %s", st, b)
	}
	return out.Tokens
}

// routedTo sends a completion through r and returns the worker the route
// receipt names.
func routedTo(t *testing.T, r *router, prompt string) string {
	t.Helper()
	return routedWith(t, r, prompt, "")
}

// routedWith is routedTo with more members in the body (",..." or "").
func routedWith(t *testing.T, r *router, prompt, more string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, h, b := post(t, ctx, r.Base+"/v1/completions", fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":2%s}`, prompt, more))
	if st != 200 {
		t.Fatalf("completion: %d %s", st, b)
	}
	return h.Get("X-Switchyard-Route")
}

// servedBy reports whether a route receipt names s as the worker.
func servedBy(receipt string, s *sim) bool {
	return strings.Contains(receipt+";", "worker=http://"+s.Info.HTTPAddress+";")
}

// TestKVAwareRoutesToTheWorkerHoldingThePrefix: two routers (replicas)
// follow the same two workers' KV events; a prompt whose blocks one worker
// reports stored goes to that worker from both routers; once it reports
// them cleared and the other stores them, traffic follows.
func TestKVAwareRoutesToTheWorkerHoldingThePrefix(t *testing.T) {
	a, b := startSim(t), startSim(t)
	pa, pb := kvtest.Start(t, ""), kvtest.Start(t, "")
	args := []string{"--worker-urls", a.URL(), b.URL(), "--policy", "kv_aware", "--route-receipt",
		"--kv-block-size", "4", "--kv-speculative-indexing=false",
		"--kv-events-endpoints", a.URL() + "=" + pa.Endpoints(), b.URL() + "=" + pb.Endpoints()}
	r1, r2 := startRouter(t, args...), startRouter(t, args...)
	r1.WaitReady(t, 10*time.Second)
	r2.WaitReady(t, 10*time.Second)

	prompt := strings.Repeat("the quick brown fox jumps over the lazy dog ", 4)
	toks := tokenize(t, a, prompt)
	if len(toks) < 16 {
		t.Fatalf("prompt tokenized to %d tokens", len(toks))
	}
	// An unrelated batch first, so each worker counts as publishing.
	pa.Publish(stored("a-other", []int{9, 9, 9, 9}, 4))
	pb.Publish(stored("b", toks, 4))
	for _, r := range []*router{r1, r2} {
		waitFor(t, 20*time.Second, "the router learns b's blocks", func() bool {
			return servedBy(routedTo(t, r, prompt), b)
		})
	}
	for range 5 {
		for _, r := range []*router{r1, r2} {
			if got := routedTo(t, r, prompt); !servedBy(got, b) || !strings.Contains(got, "kv match") {
				t.Fatalf("routed %q, want %s with a kv match", got, b.Info.HTTPAddress)
			}
		}
	}
	// b evicts everything, a caches the prompt: traffic moves to a.
	pb.Publish(map[string]any{"type": "AllBlocksCleared"})
	pa.Publish(stored("a", toks, 4))
	for _, r := range []*router{r1, r2} {
		waitFor(t, 20*time.Second, "traffic moves to a", func() bool {
			return servedBy(routedTo(t, r, prompt), a)
		})
	}
	var ws map[string]any
	if getJSON(t, r1.Base+"/workers", &ws) != 200 {
		t.Fatal("/workers")
	}
	kv, _ := ws["kv_aware"].(map[string]any)
	if kv == nil || kv["index_entries"].(float64) < float64(len(toks)/4) {
		t.Fatalf("/workers kv_aware section: %v", ws["kv_aware"])
	}
}

// TestKVAwarePDBypass: with --pd-uncached-token-threshold, a prompt the
// decode already holds (all but fewer than N tokens) is served by the
// decode alone; an uncached long prompt is split as usual.
func TestKVAwarePDBypass(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	pp, pd := kvtest.Start(t, ""), kvtest.Start(t, "")
	r := startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(),
		"--policy", "kv_aware", "--route-receipt", "--kv-block-size", "4", "--pd-uncached-token-threshold", "8",
		"--kv-events-endpoints", p.URL()+"="+pp.Endpoints(), d.URL()+"="+pd.Endpoints())
	r.WaitReady(t, 10*time.Second)

	cached := strings.Repeat("alpha beta gamma delta ", 6)
	toks := tokenize(t, p, cached)
	pp.Publish(stored("p-other", []int{7, 7, 7, 7}, 4))
	pd.Publish(stored("d", toks, 4))
	receipt := func(prompt string) string { return completionReceipt(t, r, prompt) }
	waitFor(t, 20*time.Second, "the cached prompt bypasses the prefill", func() bool {
		return strings.Contains(receipt(cached), "reason=bypass")
	})
	before := d.Stats(t).Requests
	rc := receipt(cached)
	after := d.Stats(t).Requests
	if !strings.Contains(rc, "decode=http://"+d.Info.HTTPAddress) || strings.Contains(rc, "prefill=") ||
		after.Plain != before.Plain+1 || after.DecodeLeg != before.DecodeLeg {
		t.Fatalf("bypass receipt %q; decode plain %d→%d, decode legs %d→%d", rc, before.Plain, after.Plain, before.DecodeLeg, after.DecodeLeg)
	}
	// A long prompt nobody holds is split.
	long := strings.Repeat("omega psi chi phi ", 8)
	if rc := receipt(long); strings.Contains(rc, "bypass") || !strings.Contains(rc, "prefill=http://"+p.Info.HTTPAddress) {
		t.Fatalf("uncached prompt receipt %q", rc)
	}
	// A short prompt (fewer tokens than the threshold) always bypasses.
	if rc := receipt("tiny"); !strings.Contains(rc, "reason=bypass") {
		t.Fatalf("short prompt receipt %q", rc)
	}
}

// TestKVAwarePDBypassCountsTheDecodesWork: a bypassed request's uncached
// tokens stay reserved on its decode until the first byte of its answer, so
// a second one arriving meanwhile is split when the two together reach the
// threshold, and the next one after the first answered bypasses again.
func TestKVAwarePDBypassCountsTheDecodesWork(t *testing.T) {
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict", "--stall-first-token", "1500ms")
	pp, pd := kvtest.Start(t, ""), kvtest.Start(t, "")
	const prompt = "one two three four five six"
	n := len(tokenize(t, p, prompt))
	r := startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(),
		"--policy", "kv_aware", "--route-receipt", "--kv-block-size", "4", "--pd-uncached-token-threshold", strconv.Itoa(n+1),
		"--kv-events-endpoints", p.URL()+"="+pp.Endpoints(), d.URL()+"="+pd.Endpoints())
	r.WaitReady(t, 10*time.Second)
	receipt := func(prompt string) string { return completionReceipt(t, r, prompt) }
	before := d.Stats(t).Requests.Plain
	first := make(chan string, 1)
	go func() { first <- receipt(prompt) }()
	waitFor(t, 10*time.Second, "the first request reaches the decode alone", func() bool {
		return d.Stats(t).Requests.Plain == before+1
	})
	// The decode has not answered the first (its first token is stalled):
	// n of its tokens are reserved there, and n more reach the threshold.
	if rc := receipt(prompt); strings.Contains(rc, "reason=bypass") || !strings.Contains(rc, "prefill=http://"+p.Info.HTTPAddress) ||
		!strings.Contains(rc, "not bypassed: decode http://"+d.Info.HTTPAddress+" is computing") {
		t.Errorf("second request while the first is computed: receipt %q, want a split saying why", rc)
	}
	if got := metricValue(t, r, "vllm_router_kv_pd_bypass_deferred_total"); got != 1 {
		t.Errorf("vllm_router_kv_pd_bypass_deferred_total = %v, want 1", got)
	}
	if rc := <-first; !strings.Contains(rc, "reason=bypass") {
		t.Fatalf("first request: receipt %q, want a bypass", rc)
	}
	if rc := receipt(prompt); !strings.Contains(rc, "reason=bypass") {
		t.Errorf("after the first was answered: receipt %q, want a bypass", rc)
	}
}

// completionReceipt posts a 3-token completion of prompt through r and
// returns its route receipt. It may run on any goroutine: a failure is
// reported with t.Errorf and gives "".
func completionReceipt(t *testing.T, r *router, prompt string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	body := fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":3}`, prompt)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.Base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		t.Errorf("completion request: %v", err)
		return ""
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Errorf("completion: %v", err)
		return ""
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	var v struct {
		Choices []struct{ Text string } `json:"choices"`
	}
	if err != nil || resp.StatusCode != 200 || json.Unmarshal(b, &v) != nil || len(v.Choices) == 0 || v.Choices[0].Text == "" {
		t.Errorf("completion: %d %s (%v)", resp.StatusCode, b, err)
		return ""
	}
	return resp.Header.Get("X-Switchyard-Route")
}
