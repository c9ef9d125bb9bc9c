package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/kvaware"
)

// The tests below run kv_aware against vllm-sim's own KV event publisher
// and prefix cache (no stand-in): what the router learns is what the
// engines report.

const simKVBlock = 16

// kvSimEvents is the --kv-events-config of a sim publishing on free ports
// (read back from /sim/stats).
const kvSimEvents = `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}`

// kvSimStats is the prefix-cache and KV-event part of /sim/stats.
type kvSimStats struct {
	Engines []struct {
		PrefixCache struct {
			Queries      uint64 `json:"queries"`
			Hits         uint64 `json:"hits"`
			CachedBlocks int    `json:"cached_blocks"`
			Evictions    uint64 `json:"evictions"`
		} `json:"prefix_cache"`
		KVEvents *struct {
			Endpoint       string `json:"endpoint"`
			ReplayEndpoint string `json:"replay_endpoint"`
			Published      uint64 `json:"batches_published"`
		} `json:"kv_events"`
	} `json:"engines"`
}

func (s *sim) kvStats(t *testing.T) kvSimStats {
	t.Helper()
	var st kvSimStats
	if code := getJSON(t, s.URL()+"/sim/stats", &st); code != 200 || len(st.Engines) != 1 || st.Engines[0].KVEvents == nil {
		t.Fatalf("%s /sim/stats: %d %+v", s.URL(), code, st)
	}
	return st
}

// kvEndpoints is the --kv-events-endpoints entry of s.
func (s *sim) kvEndpoints(t *testing.T) string {
	ev := s.kvStats(t).Engines[0].KVEvents
	return s.URL() + "=" + ev.Endpoint + "," + ev.ReplayEndpoint
}

func startKVSim(t *testing.T, numBlocks int, args ...string) *sim {
	t.Helper()
	all := append([]string{"--kv-events-config", kvSimEvents, "--block-size", fmt.Sprint(simKVBlock),
		"--num-blocks", fmt.Sprint(numBlocks), "--max-model-len", fmt.Sprint(numBlocks * simKVBlock)}, args...)
	return startSim(t, all...)
}

// words is n distinct white-space tokens (the sim's tokenizer) tagged tag.
func words(tag string, n int) string {
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, "%s%d ", tag, i)
	}
	return strings.TrimSpace(b.String())
}

// direct sends a completion straight to s (no router), so s caches the
// prompt and publishes its blocks.
func direct(t *testing.T, s *sim, prompt string, maxTokens int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if st, _, b := post(t, ctx, s.URL()+"/v1/completions",
		fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":%d,"ignore_eos":true}`, prompt, maxTokens)); st != 200 {
		t.Fatalf("direct completion to %s: %d %s", s.URL(), st, b)
	}
}

// kvWorker is one worker's entry in the router's /workers kv_aware section.
type kvWorker struct {
	Blocks   int    `json:"blocks"`
	Events   bool   `json:"events"`
	RoutedBy string `json:"routed_by"`
}

func kvWorkers(t *testing.T, r *router) map[string]kvWorker {
	t.Helper()
	var ws struct {
		KV struct {
			Workers map[string]kvWorker `json:"workers"`
		} `json:"kv_aware"`
	}
	if getJSON(t, r.Base+"/workers", &ws) != 200 {
		t.Fatal("/workers")
	}
	return ws.KV.Workers
}

// kvWorkerOf finds s's entry (keyed by its URL, possibly with a rank).
func kvWorkerOf(t *testing.T, r *router, s *sim) (kvWorker, bool) {
	t.Helper()
	for k, w := range kvWorkers(t, r) {
		if strings.HasPrefix(k, s.URL()) {
			return w, true
		}
	}
	return kvWorker{}, false
}

// waitPublishing waits until the router has applied events of every sim.
func waitPublishing(t *testing.T, r *router, sims ...*sim) {
	t.Helper()
	for _, s := range sims {
		waitFor(t, 20*time.Second, "the router receives "+s.URL()+"'s events", func() bool {
			w, ok := kvWorkerOf(t, r, s)
			return ok && w.Events
		})
	}
}

// waitIndexed waits until the router has applied every batch the sims
// published (their counts settled first: a batch is queued before a
// response and sent just after it), then checks that its index holds
// exactly the blocks each sim reports cached.
func waitIndexed(t *testing.T, r *router, sims ...*sim) {
	t.Helper()
	pub := settledPublished(t, sims...)
	var total uint64
	for _, n := range pub {
		total += n
	}
	waitFor(t, 20*time.Second, "the router applies every published batch", func() bool {
		return metricValue(t, r, "vllm_router_kv_event_batches_total") == float64(total)
	})
	for _, s := range sims {
		w, _ := kvWorkerOf(t, r, s)
		if c := s.kvStats(t).Engines[0].PrefixCache.CachedBlocks; w.Blocks != c {
			t.Fatalf("router indexes %d blocks of %s, which caches %d", w.Blocks, s.URL(), c)
		}
	}
}

func whichSim(t *testing.T, receipt string, sims ...*sim) *sim {
	t.Helper()
	for _, s := range sims {
		if servedBy(receipt, s) {
			return s
		}
	}
	t.Fatalf("receipt %q names none of the sims", receipt)
	return nil
}

// TestKVAwareSimPrefixFollowsTheCache: three sims with small caches; a
// long prompt repeated through the router stays on the worker that cached
// it (hit counters rise there only; each repeat has it restate the prefix
// in a reuse report); once that worker evicts it (its own events report
// the removal), the prompt goes to the one other worker that still holds
// it.
func TestKVAwareSimPrefixFollowsTheCache(t *testing.T) {
	const numBlocks = 64 // 1024 tokens per worker
	sims := []*sim{startKVSim(t, numBlocks), startKVSim(t, numBlocks), startKVSim(t, numBlocks)}
	args := []string{"--policy", "kv_aware", "--route-receipt", "--kv-block-size", fmt.Sprint(simKVBlock),
		"--kv-speculative-indexing=false", "--worker-urls"}
	for _, s := range sims {
		args = append(args, s.URL())
	}
	args = append(args, "--kv-events-endpoints")
	for _, s := range sims {
		args = append(args, s.kvEndpoints(t))
	}
	r := startRouter(t, args...)
	r.WaitReady(t, 10*time.Second)
	for i, s := range sims {
		direct(t, s, words(fmt.Sprintf("warm%d-", i), 20), 1)
	}
	waitPublishing(t, r, sims...)

	prompt := words("sys", 200) // 12 full blocks
	first := routedTo(t, r, prompt)
	w := whichSim(t, first, sims...)
	waitIndexed(t, r, sims...)
	hits := func(s *sim) uint64 { return s.kvStats(t).Engines[0].PrefixCache.Hits }
	before := make([]uint64, len(sims))
	for i, s := range sims {
		before[i] = hits(s)
	}
	// The repeats ask for vLLM 0.32's reuse reports: the holder restates
	// the prefix each hits (a BlockStored of blocks it holds). Taken as
	// new copies, they would keep the blocks in the router's index after
	// the holder evicts them (waitIndexed compares the counts below).
	for range 5 {
		if got := routedWith(t, r, prompt, `,"vllm_xargs":{"kv_cache_report_mode":"full"}`); !servedBy(got, w) || !strings.Contains(got, "kv match 12/12 blocks") {
			t.Fatalf("repeat routed %q, want %s with kv match 12/12", got, w.URL())
		}
	}
	for i, s := range sims {
		d := hits(s) - before[i]
		if s == w && d < 5*192 {
			t.Fatalf("holder's prefix-cache hits rose by %d, want >= %d", d, 5*192)
		} else if s != w && d != 0 {
			t.Fatalf("%s got %d hits, want 0", s.URL(), d)
		}
	}

	// A second worker caches the prompt too (directly), then the first
	// evicts it under other prompts sent straight to it.
	var other *sim
	for _, s := range sims {
		if s != w {
			other = s
			break
		}
	}
	direct(t, other, prompt, 1)
	waitIndexed(t, r, sims...)
	for i := 0; w.kvStats(t).Engines[0].PrefixCache.Evictions < numBlocks; i++ {
		if i == 20 {
			t.Fatalf("no eviction of %d blocks after 20 fill prompts: %+v", numBlocks, w.kvStats(t))
		}
		direct(t, w, words(fmt.Sprintf("fill%d-", i), 400), 1)
	}
	waitIndexed(t, r, sims...)
	for range 5 {
		if got := routedTo(t, r, prompt); !servedBy(got, other) || !strings.Contains(got, "kv match 12/12 blocks") {
			t.Fatalf("after eviction routed %q, want %s with kv match 12/12", got, other.URL())
		}
	}
}

// postSalted sends a completion with a cache_salt ("" for none) to base
// and returns the route receipt.
func postSalted(t *testing.T, base, prompt, salt string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	body := fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":1`, prompt)
	if salt != "" {
		body += fmt.Sprintf(`,"cache_salt":%q`, salt)
	}
	st, h, b := post(t, ctx, base+"/v1/completions", body+"}")
	if st != 200 {
		t.Fatalf("completion to %s (salt %q): %d %s", base, salt, st, b)
	}
	return h.Get("X-Switchyard-Route")
}

// TestKVAwareSimCacheSalt: one sim caches a prompt plain, the other the
// same prompt under a cache_salt (each sent to it directly). The router
// indexes both as the sims report them (distinct blocks), then sends the
// plain prompt to the first, the salted one to the second, and finds
// nothing for the prompt under another salt; the sims' prefix-cache hits
// say the engines agree.
func TestKVAwareSimCacheSalt(t *testing.T) {
	a, b := startKVSim(t, 256), startKVSim(t, 256)
	r := startRouter(t, "--policy", "kv_aware", "--route-receipt", "--kv-block-size", fmt.Sprint(simKVBlock),
		"--kv-speculative-indexing=false", "--worker-urls", a.URL(), b.URL(),
		"--kv-events-endpoints", a.kvEndpoints(t), b.kvEndpoints(t))
	r.WaitReady(t, 10*time.Second)
	for i, s := range []*sim{a, b} {
		direct(t, s, words(fmt.Sprintf("warm%d-", i), 20), 1)
	}
	waitPublishing(t, r, a, b)

	prompt := words("tenant-sys", 200) // 12 full blocks
	postSalted(t, a.URL(), prompt, "")
	postSalted(t, b.URL(), prompt, "t1")
	waitIndexed(t, r, a, b)
	hits := func(s *sim) uint64 { return s.kvStats(t).Engines[0].PrefixCache.Hits }
	for _, tc := range []struct {
		salt  string
		to    *sim
		match string
	}{
		{"", a, "kv match 12/12 blocks"},
		{"t1", b, "kv match 12/12 blocks"},
		{"t2", nil, "kv match 0/12 blocks"},
	} {
		ha, hb := hits(a), hits(b)
		got := postSalted(t, r.Base, prompt, tc.salt)
		if !strings.Contains(got, tc.match) || (tc.to != nil && !servedBy(got, tc.to)) {
			t.Fatalf("salt %q routed %q, want %q", tc.salt, got, tc.match)
		}
		if tc.to == nil {
			continue
		}
		if d := hits(tc.to) - map[*sim]uint64{a: ha, b: hb}[tc.to]; d < 192 {
			t.Fatalf("salt %q: the holder's prefix-cache hits rose by %d, want >= 192", tc.salt, d)
		}
	}
}

// TestKVAwareSimPDBypassThreshold: nixl PD sims publishing events; with
// --pd-uncached-token-threshold N a request bypasses the prefill exactly
// when its uncached part (on the decode) is shorter than N tokens.
func TestKVAwareSimPDBypassThreshold(t *testing.T) {
	const n = 20
	p := startKVSim(t, 256, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startKVSim(t, 256, "--role", "decode", "--kv-connector", "nixl", "--strict")
	r := startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", d.URL(),
		"--prefill-policy", "kv_aware", "--decode-policy", "kv_aware", "--route-receipt",
		"--kv-block-size", fmt.Sprint(simKVBlock), "--pd-uncached-token-threshold", fmt.Sprint(n),
		"--kv-events-endpoints", p.kvEndpoints(t), d.kvEndpoints(t))
	r.WaitReady(t, 10*time.Second)
	direct(t, p, words("warmp", 20), 1)
	direct(t, d, words("warmd", 20), 1)
	waitPublishing(t, r, p, d)

	receipt := func(prompt string) string { return completionReceipt(t, r, prompt) }
	bypassed := func(rc string) bool {
		by := strings.Contains(rc, "reason=bypass")
		if by && (strings.Contains(rc, "prefill=") || !strings.Contains(rc, "decode=http://"+d.Info.HTTPAddress)) {
			t.Fatalf("bypass receipt %q", rc)
		}
		if !by && !strings.Contains(rc, "prefill=http://"+p.Info.HTTPAddress) {
			t.Fatalf("split receipt %q", rc)
		}
		return by
	}
	ntok := func(prompt string) int { return len(tokenize(t, d, prompt)) }

	// Uncached prompts: shorter than N bypasses, N does not.
	short, atN := words("s", n), words("e", n)
	for len(tokenize(t, d, short)) >= n {
		short = short[:strings.LastIndexByte(short, ' ')]
	}
	for ntok(atN) > n {
		atN = atN[:strings.LastIndexByte(atN, ' ')]
	}
	if ntok(short) != n-1 || ntok(atN) != n {
		t.Fatalf("prompt sizes %d and %d tokens, want %d and %d", ntok(short), ntok(atN), n-1, n)
	}
	if !bypassed(receipt(short)) {
		t.Fatalf("a %d-token prompt was split", n-1)
	}
	if bypassed(receipt(atN)) {
		t.Fatalf("an uncached %d-token prompt bypassed", n)
	}

	// The decode holds a 64-token prefix (4 blocks): 64 + (N−1) new tokens
	// bypass, 64 + N are split.
	base := words("base", 64)
	if ntok(base) != 64 {
		t.Fatalf("base prefix is %d tokens", ntok(base))
	}
	direct(t, d, base, 1)
	waitIndexed(t, r, p, d)
	before := d.Stats(t).Requests
	if rc := receipt(base + " " + words("x", n-1)); !bypassed(rc) {
		t.Fatalf("%d uncached tokens on the decode: split (%q)", n-1, rc)
	}
	after := d.Stats(t).Requests
	if after.Plain != before.Plain+1 || after.DecodeLeg != before.DecodeLeg {
		t.Fatalf("bypass: decode plain %d→%d, decode legs %d→%d", before.Plain, after.Plain, before.DecodeLeg, after.DecodeLeg)
	}
	if rc := receipt(base + " " + words("y", n)); bypassed(rc) {
		t.Fatalf("%d uncached tokens on the decode: bypassed (%q)", n, rc)
	}
	if got := metricValue(t, r, "vllm_router_kv_pd_bypass_total"); got != 2 {
		t.Fatalf("vllm_router_kv_pd_bypass_total = %v, want 2", got)
	}
	p.assertClean(t)
	d.assertClean(t)
}

// TestKVAwareSimLateRouterReplays: engines cache prompts before the router
// starts; the router learns them from the replay endpoints alone (no new
// event is published) and routes the cached prompt to its holder.
func TestKVAwareSimLateRouterReplays(t *testing.T) {
	a, b := startKVSim(t, 256), startKVSim(t, 256)
	prompt := words("late", 100) // 6 full blocks
	direct(t, a, prompt, 1)
	direct(t, b, words("other", 100), 1)
	// A batch is queued before the response and sent just after it: wait
	// until each sim's count holds still, so that everything is sent before
	// the router subscribes.
	pub := settledPublished(t, a, b)
	pubA, pubB := pub[0], pub[1]
	if pubA == 0 || pubB == 0 {
		t.Fatalf("sims published %d and %d batches", pubA, pubB)
	}
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "kv_aware", "--route-receipt",
		"--kv-block-size", fmt.Sprint(simKVBlock), "--kv-speculative-indexing=false",
		"--kv-events-endpoints", a.kvEndpoints(t), b.kvEndpoints(t))
	r.WaitReady(t, 10*time.Second)
	waitIndexed(t, r, a, b)
	if a.kvStats(t).Engines[0].KVEvents.Published != pubA || b.kvStats(t).Engines[0].KVEvents.Published != pubB {
		t.Fatal("the sims published while the router caught up; the test would not show the replay")
	}
	if got := metricValue(t, r, "vllm_router_kv_replayed_batches_total"); got < float64(pubA+pubB) {
		t.Fatalf("replayed %v batches, want >= %d", got, pubA+pubB)
	}
	for range 5 {
		if got := routedTo(t, r, prompt); !servedBy(got, a) || !strings.Contains(got, "kv match 6/6 blocks") {
			t.Fatalf("routed %q, want %s with kv match 6/6", got, a.URL())
		}
	}
}

// settledPublished waits until every sim's count of published batches has
// not moved for 500 ms, and returns them.
func settledPublished(t *testing.T, sims ...*sim) []uint64 {
	t.Helper()
	last := make([]uint64, len(sims))
	var since time.Time
	waitFor(t, 20*time.Second, "the sims' KV event batches are sent", func() bool {
		moved := since.IsZero()
		for i, s := range sims {
			if n := s.kvStats(t).Engines[0].KVEvents.Published; n != last[i] {
				last[i], moved = n, true
			}
		}
		if moved {
			since = time.Now()
		}
		return time.Since(since) >= 500*time.Millisecond
	})
	return last
}

// metricValue is the value of an unlabelled metric on r's /metrics.
func metricValue(t *testing.T, r *router, name string) float64 {
	t.Helper()
	mfs, _ := scrape(t, r.Metrics)
	mf := mfs[name]
	if mf == nil || len(mf.Metric) == 0 {
		t.Fatalf("%s missing from /metrics", name)
	}
	m := mf.Metric[0]
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return m.GetUntyped().GetValue()
}

// TestKVAwareSimTokenizerProbe: with --tokenizer-path the router probes
// an engine's /tokenize as soon as it knows the engine, so no request
// waits for a check: over vllm-sims tokenizing with the same tokenizer.json
// the probe passes before the first request and every prompt is tokenized
// in the router, its checks made in the background; over sims with
// another tokenizer the probe fails and the local tokenizer is off before
// any request used it.
func TestKVAwareSimTokenizerProbe(t *testing.T) {
	const tk = "../../internal/tokenizer/testdata/tiny-llama.json"
	probes := float64(kvaware.ProbeChecks(false))
	for _, tc := range []struct {
		name    string
		simArgs []string
		agrees  bool
	}{
		{"same tokenizer", []string{"--tokenizer", tk}, true},
		{"other tokenizer", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := startKVSim(t, 256, tc.simArgs...)
			r := startRouter(t, "--policy", "kv_aware", "--kv-block-size", fmt.Sprint(simKVBlock), "--tokenizer-path", tk,
				"--worker-urls", s.URL(), "--kv-events-endpoints", s.kvEndpoints(t))
			r.WaitReady(t, 10*time.Second)
			m := func(name string) float64 { return metricValue(t, r, "vllm_router_kv_tokenize_"+name) }
			if !tc.agrees {
				waitFor(t, 10*time.Second, "the probe switches the local tokenizer off", func() bool { return m("local_enabled") == 0 })
				if mm := m("verify_mismatches_total"); mm != 1 {
					t.Fatalf("mismatches %v, want 1", mm)
				}
				routedTo(t, r, "a prompt after the failed probe")
				if l := m("local_total"); l != 0 {
					t.Fatalf("local encodes %v after a failed probe, want 0", l)
				}
				return
			}
			waitFor(t, 10*time.Second, "the probe passes", func() bool { return m("verify_checks_total") == probes })
			const n = 5
			for i := range n {
				routedTo(t, r, fmt.Sprintf("prompt %d: the router tokenizes it in-process", i))
			}
			waitFor(t, 10*time.Second, "background checks of the prompts", func() bool { return m("verify_checks_total") == probes+n })
			if c, b, l, mm := m("verify_checks_total"), m("verify_background_total"), m("local_total"), m("verify_mismatches_total"); b != c || l != n || mm != 0 || m("local_enabled") != 1 {
				t.Fatalf("checks %v, of them in the background %v (want all), local encodes %v (want %d), mismatches %v (want 0)", c, b, l, n, mm)
			}
		})
	}
}

// TestKVAwareLoRAWithSims: with vllm-sim engines serving a LoRA adapter
// (--enable-lora --lora-modules), the adapter's blocks attract only the
// adapter's requests and the base model's only the base model's; an
// adapter loaded through the router is keyed with its name from its first
// request, so the base model's blocks of the same prompt do not draw it.
func TestKVAwareLoRAWithSims(t *testing.T) {
	t.Setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
	lora := []string{"--enable-lora", "--lora-modules", "sql=/adapters/sql"}
	a, b := startKVSim(t, 256, lora...), startKVSim(t, 256, lora...)
	r := startRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "kv_aware", "--route-receipt",
		"--kv-block-size", fmt.Sprint(simKVBlock), "--kv-speculative-indexing=false",
		"--kv-events-endpoints", a.kvEndpoints(t), b.kvEndpoints(t))
	r.WaitReady(t, 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	send := func(url, model, prompt string) (string, []byte) {
		t.Helper()
		st, h, body := post(t, ctx, url+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1,"ignore_eos":true}`, model, prompt))
		if st != 200 {
			t.Fatalf("%s for %s: %d %s", url, model, st, body)
		}
		return h.Get("X-Switchyard-Route"), body
	}
	direct(t, a, words("warm-a", 40), 1) // each worker counts as publishing
	direct(t, b, words("warm-b", 40), 1)
	waitPublishing(t, r, a, b)

	prompt := words("lora", 100)       // 6 full blocks
	send(a.URL(), "sim-model", prompt) // a: the base model's blocks
	send(b.URL(), "sql", prompt)       // b: the adapter's
	waitFor(t, 20*time.Second, "each request goes to the worker holding its own blocks", func() bool {
		ra, _ := send(r.Base, "sim-model", prompt)
		rb, _ := send(r.Base, "sql", prompt)
		return servedBy(ra, a) && strings.Contains(ra, "kv match") && servedBy(rb, b) && strings.Contains(rb, "kv match")
	})
	if st, _, body := post(t, ctx, r.Base+"/v1/load_lora_adapter", `{"lora_name":"fresh","lora_path":"/adapters/fresh"}`); st != 200 {
		t.Fatalf("load through the router: %d %s", st, body)
	}
	got, body := send(r.Base, "fresh", prompt)
	if !strings.Contains(got, "kv match 0/") || !strings.Contains(string(body), `"model":"fresh"`) {
		t.Fatalf("the new adapter's first request: receipt %q, body %s; want no blocks matched (the base model's do not count)", got, body)
	}
}
