package sim

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/switchyard-llm/switchyard/internal/freeport"
	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/sim/engine"
)

// tokenize returns the sim's /tokenize ids for a prompt.
func tokenize(t *testing.T, in *Instance, prompt string) []uint32 {
	t.Helper()
	r := postJSON(t, testCtx(t), in.url("/tokenize"), map[string]any{"prompt": prompt}, nil)
	if r.status != 200 {
		t.Fatalf("/tokenize: %d %s", r.status, r.raw)
	}
	var out []uint32
	for _, v := range r.body["tokens"].([]any) {
		out = append(out, uint32(v.(float64)))
	}
	return out
}

// complete sends a one-token completion and returns its usage.
func complete(t *testing.T, in *Instance, prompt string) map[string]any {
	t.Helper()
	r := postJSON(t, testCtx(t), in.url("/v1/completions"),
		map[string]any{"prompt": prompt, "max_tokens": 1, "ignore_eos": true}, nil)
	if r.status != 200 {
		t.Fatalf("completion: %d %s", r.status, r.raw)
	}
	return r.body["usage"].(map[string]any)
}

func cachedOf(usage map[string]any) float64 {
	d, _ := usage["prompt_tokens_details"].(map[string]any)
	v, _ := d["cached_tokens"].(float64)
	return v
}

// follower is a router-side subscriber (internal/kvevents) on one sim.
type follower struct {
	idx *kvevents.Index
	sub *kvevents.Subscriber
}

func follow(t *testing.T, in *Instance) *follower {
	t.Helper()
	pub, rep := in.KVEventEndpoints()
	idx := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 16})
	sub, err := kvevents.NewSubscriber(kvevents.Options{Index: idx, Logger: testLogger(), Redial: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	sub.Set([]kvevents.Source{{Worker: "w", Endpoint: pub[0], ReplayEndpoint: rep[0]}})
	return &follower{idx: idx, sub: sub}
}

// match is the router's matched prefix, in blocks, of tokens on the sim.
func (f *follower) match(tokens []uint32) int { return f.idx.Match(f.idx.BlockKeys(tokens, ""))["w"] }

func TestKVEventsReachRouterIndex(t *testing.T) {
	for _, tc := range []struct {
		encoding string
		int      bool
	}{{EncodingNamed, true}, {EncodingPositional, false}, {EncodingNamed, false}, {EncodingPositional, true}} {
		t.Run(fmt.Sprintf("%s/int=%v", tc.encoding, tc.int), func(t *testing.T) {
			in := startSim(t, "--kv-events-config",
				`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"}`,
				"--kv-events-encoding", tc.encoding, fmt.Sprintf("--kv-events-int-block-hashes=%v", tc.int),
				"--enable-prompt-tokens-details", "--num-blocks", "64", "--block-size", "16", "--max-model-len", "1024",
				"--prefill-per-token", "1ms")
			f := follow(t, in)
			warmUp(t, in, f)
			queries0 := in.engines[0].PrefixCacheStats().Queries

			// 100 tokens: 6 full blocks.
			a := words(100, "a")
			ta := tokenize(t, in, a)
			start := time.Now()
			if u := complete(t, in, a); u["prompt_tokens_details"] != nil {
				t.Fatalf("first request reports cached tokens: %v", u)
			}
			first := time.Since(start)
			waitFor(t, "index holds the prompt's 6 full blocks", func() bool { return f.match(ta) == 6 })

			// The repeat finds 96 tokens cached and computes only 4.
			before := in.engines[0].Snapshot().PrefillTokens
			start = time.Now()
			if u := complete(t, in, a); cachedOf(u) != 96 {
				t.Fatalf("repeat: usage %v, want 96 cached tokens", u)
			}
			second := time.Since(start)
			if got := in.engines[0].Snapshot().PrefillTokens - before; got != 4 || second >= first {
				t.Fatalf("repeat computed %d prompt tokens in %v (first took %v), want 4 and less time", got, second, first)
			}
			if got, want := statsOf(t, in).Engines[0].PrefillTokens, in.engines[0].Snapshot().PrefillTokens; got != want || got < 104 {
				t.Fatalf("/sim/stats prefill_tokens %d, engine %d (want >= 104: both requests' computed tokens)", got, want)
			}
			st := in.engines[0].PrefixCacheStats()
			if st.Queries-queries0 != 200 || st.Hits != 96 {
				t.Fatalf("prefix cache stats %+v: want 200 more queried tokens, 96 hits", st)
			}
			metrics := getText(t, in.url("/metrics"))
			for _, want := range []string{
				fmt.Sprintf(`vllm:prefix_cache_queries_total{engine="0",model_name="sim-model"} %d`, st.Queries),
				`vllm:prefix_cache_hits_total{engine="0",model_name="sim-model"} 96`,
			} {
				if !strings.Contains(metrics, want) {
					t.Errorf("/metrics lacks %q", want)
				}
			}

			// Other prompts fill the 64-block pool: a's blocks are evicted
			// and the router hears of it.
			for i := range 12 {
				complete(t, in, words(100, fmt.Sprintf("x%d", i)))
			}
			waitFor(t, "a's blocks leave the index", func() bool { return f.match(ta) == 0 })
			if f.idx.WorkerBlocks("w") == 0 || f.idx.WorkerBlocks("w") > 64 {
				t.Fatalf("index holds %d blocks of a 64-block pool", f.idx.WorkerBlocks("w"))
			}

			// Reset: AllBlocksCleared empties the worker's entries.
			resp, err := testClient.Post(in.url("/reset_prefix_cache"), "application/json", nil)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("/reset_prefix_cache: %d", resp.StatusCode)
			}
			waitFor(t, "index empty after reset", func() bool { return f.idx.WorkerBlocks("w") == 0 })

			b := words(40, "b")
			tb := tokenize(t, in, b)
			complete(t, in, b)
			waitFor(t, "b stored", func() bool { return f.match(tb) == 2 })

			// A chat request's blocks are those of /tokenize's ids for the
			// same messages (the chat template included).
			msgs := []any{map[string]any{"role": "system", "content": words(30, "s")}, map[string]any{"role": "user", "content": "hi"}}
			cr := postJSON(t, testCtx(t), in.url("/v1/chat/completions"), map[string]any{"messages": msgs, "max_tokens": 1}, nil)
			tr := postJSON(t, testCtx(t), in.url("/tokenize"), map[string]any{"messages": msgs}, nil)
			if cr.status != 200 || tr.status != 200 {
				t.Fatalf("chat %d %s, tokenize %d %s", cr.status, cr.raw, tr.status, tr.raw)
			}
			var tc []uint32
			for _, v := range tr.body["tokens"].([]any) {
				tc = append(tc, uint32(v.(float64)))
			}
			waitFor(t, "chat prompt's blocks stored", func() bool { return len(tc) >= 32 && f.match(tc) == len(tc)/16 })

			// A subscriber that joins now rebuilds the same state from the
			// replay endpoint.
			late := follow(t, in)
			waitFor(t, "late subscriber replays to the same index", func() bool {
				return late.match(tb) == 2 && late.idx.WorkerBlocks("w") == f.idx.WorkerBlocks("w")
			})
			if late.match(ta) != 0 {
				t.Fatalf("late subscriber still matches evicted a: %d", late.match(ta))
			}
			es := statsOf(t, in).Engines[0]
			if es.KVEvents == nil || es.KVEvents.Replays < 2 || es.KVEvents.Published == 0 || es.PrefixCache.Resets != 1 {
				t.Fatalf("stats: %+v %+v", es.KVEvents, es.PrefixCache)
			}
			if c := f.sub.C.Malformed.Load() + late.sub.C.Malformed.Load() + f.sub.C.Unknown.Load(); c != 0 {
				t.Fatalf("%d malformed or unknown batches", c)
			}
		})
	}
}

// warmUp sends distinct prompts until the follower has seen one: a batch
// published before the PUB has processed the new SUBSCRIBE is lost to it
// (ZMQ's slow joiner), and only the next batch reveals the gap, which the
// subscriber then repairs through the replay endpoint.
func warmUp(t *testing.T, in *Instance, f *follower) {
	t.Helper()
	for i := range 10 {
		p := words(32, fmt.Sprintf("warm%d", i))
		tp := tokenize(t, in, p)
		complete(t, in, p)
		for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if f.match(tp) > 0 {
				return
			}
		}
	}
	t.Fatal("the subscriber saw none of 10 warm-up requests")
}

func getText(t *testing.T, url string) string {
	t.Helper()
	resp, err := testClient.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %d", url, resp.StatusCode)
	}
	return string(b)
}

func TestCachedTokensInUsage(t *testing.T) {
	ctx := testCtx(t)
	prompt := words(50, "u")
	for _, tc := range []struct {
		name string
		args []string
		want float64 // cached tokens reported by the repeat
	}{
		{"details", []string{"--enable-prompt-tokens-details"}, 48},
		{"no details flag", nil, 0},
		{"caching off", []string{"--enable-prompt-tokens-details", "--no-enable-prefix-caching"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := startSim(t, append([]string{"--profile-preset", "zero"}, tc.args...)...)
			complete(t, in, prompt)
			// Non-streaming.
			u := complete(t, in, prompt)
			if got := cachedOf(u); got != tc.want || (tc.want == 0) != (u["prompt_tokens_details"] == nil) {
				t.Fatalf("usage %v, want %v cached tokens", u, tc.want)
			}
			// Streaming chat usage chunk, and the Responses API (always
			// reports input_tokens_details).
			msgs := []any{map[string]any{"role": "user", "content": prompt}}
			for range 2 {
				res := doStream(t, ctx, in.url("/v1/chat/completions"), map[string]any{
					"messages": msgs, "max_tokens": 1, "stream": true, "stream_options": map[string]any{"include_usage": true},
				}, nil)
				u = res.usage
			}
			if got := cachedOf(u); got != tc.want {
				t.Fatalf("stream usage %v, want %v cached tokens", u, tc.want)
			}
			if _, present := u["prompt_tokens_details"]; present != (tc.want > 0) {
				t.Fatalf("stream usage %v: prompt_tokens_details must be omitted when null", u)
			}
		})
	}
}

func TestKVEventsConfigParsing(t *testing.T) {
	rep := "tcp://*:5558"
	for _, tc := range []struct {
		in      string
		want    *KVEventsConfig
		wantErr string
	}{
		{`{"enable_kv_cache_events": true}`, &KVEventsConfig{EnableKVCacheEvents: true, Publisher: "zmq", Endpoint: "tcp://*:5557",
			BufferSteps: 10000, HWM: 100000, MaxQueueSize: 100000}, ""},
		{`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:5558", "buffer_steps": 5, "hwm": 7, "topic": "t"}`,
			&KVEventsConfig{EnableKVCacheEvents: true, Publisher: "zmq", Endpoint: "tcp://*:6000", ReplayEndpoint: &rep,
				BufferSteps: 5, HWM: 7, MaxQueueSize: 100000, Topic: "t"}, ""},
		{`{"enable_kv_cache_events": false, "publisher": "zmq"}`, nil, ""},
		{`{"enable_kv_cache_events": true, "publisher": "null"}`, nil, ""},
		{`{"enable_kv_cache_events": true, "publisher": "kafka"}`, nil, "unknown event publisher"},
		{`{"enable_kv_cache_events": true, "endpont": "x"}`, nil, "unknown field"},
		{`{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/x"}`, nil, "only tcp://"},
		{`{"enable_kv_cache_events": true, "endpoint": "tcp://*:99999"}`, nil, "bad port"},
		{`{"enable_kv_cache_events": true, "buffer_steps": 0}`, nil, "buffer_steps must be >= 1"},
		{`[1]`, nil, "not a KVEventsConfig"},
		{`{"enable_kv_cache_events": true} {}`, nil, "trailing data"},
	} {
		got, err := ParseKVEventsConfig(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: err %v, want %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tc.in, err)
			continue
		}
		if diff := cmp.Diff(tc.want, got); diff != "" {
			t.Errorf("%s (-want +got):\n%s", tc.in, diff)
		}
	}
}

func TestCacheFlags(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		caching bool
		wantErr string
	}{
		{nil, true, ""},
		{[]string{"--no-enable-prefix-caching"}, false, ""},
		{[]string{"--enable-prefix-caching=false"}, false, ""},
		{[]string{"--kv-events-encoding", "json"}, true, "--kv-events-encoding"},
		{[]string{"--kv-events-config", "{"}, true, "--kv-events-config"},
	} {
		c, err := ParseArgs(tc.args, io.Discard)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%q: err %v, want %q", tc.args, err, tc.wantErr)
			}
			continue
		}
		if err != nil || c.Engine.PrefixCaching != tc.caching {
			t.Errorf("%q: caching %v, err %v; want %v", tc.args, c.Engine.PrefixCaching, err, tc.caching)
		}
	}
}

func TestOffsetEndpointPort(t *testing.T) {
	for _, tc := range []struct {
		ep   string
		rank int
		want string
	}{
		{"tcp://*:5557", 0, "tcp://*:5557"},
		{"tcp://*:5557", 3, "tcp://*:5560"},
		{"tcp://10.0.0.1:5557", 1, "tcp://10.0.0.1:5558"},
		{"tcp://*:0", 2, "tcp://*:0"},
		{"", 1, ""},
	} {
		if got := OffsetEndpointPort(tc.ep, tc.rank); got != tc.want {
			t.Errorf("OffsetEndpointPort(%q, %d) = %q, want %q", tc.ep, tc.rank, got, tc.want)
		}
	}
}

// TestEventEncoding decodes the publisher's payloads with the router's
// decoder and checks each encoding's wire shape.
func TestEventEncoding(t *testing.T) {
	h0 := engine.ChainHash(nil, []uint32{1, 2})
	h1 := engine.ChainHash(&h0, []uint32{3, 4})
	batch := engine.KVEventBatch{TS: time.Unix(1700000000, 500_000_000), Events: []engine.KVEvent{
		{Kind: engine.BlockStored, Hashes: []engine.BlockHash{h1}, Parent: &h0, Tokens: []uint32{3, 4}},
		{Kind: engine.BlockRemoved, Hashes: []engine.BlockHash{h0}},
		{Kind: engine.AllBlocksCleared},
	}}
	for _, tc := range []struct {
		named, ints bool
	}{{true, true}, {true, false}, {false, true}, {false, false}} {
		p := &kvPublisher{rank: 1, named: tc.named, intHashes: tc.ints, blockSize: 2}
		payload := p.encode(batch)
		got, skipped, err := kvevents.DecodeBatch(payload)
		if err != nil || skipped != 0 {
			t.Fatalf("%+v: decode: %v (%d skipped)", tc, err, skipped)
		}
		hash := func(h engine.BlockHash) kvevents.Hash {
			if tc.ints {
				var v uint64
				for _, b := range h[24:] {
					v = v<<8 | uint64(b)
				}
				return kvevents.Hash(v)
			}
			return kvevents.BytesHash(h[:])
		}
		want := kvevents.Batch{TS: 1700000000.5, DPRank: 1, Events: []kvevents.Event{
			kvevents.BlockStored{BlockHashes: []kvevents.Hash{hash(h1)}, Parent: hash(h0), TokenIDs: []uint32{3, 4},
				BlockSize: 2, LoRAID: -1, Medium: "GPU", Group: 0, Kind: "full_attention"},
			kvevents.BlockRemoved{BlockHashes: []kvevents.Hash{hash(h0)}, Medium: "GPU", Group: 0},
			kvevents.AllBlocksCleared{},
		}}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%+v (-want +got):\n%s", tc, diff)
		}
		var raw []any
		if err := msgpack.Unmarshal(payload, &raw); err != nil || len(raw) != 3 {
			t.Fatalf("batch is not a 3-element array: %v %v", raw, err)
		}
		first := raw[1].([]any)[0]
		if tc.named {
			m, ok := first.(map[string]any)
			if !ok || m["type"] != "BlockStored" || m["medium"] != "GPU" {
				t.Errorf("named event %#v", first)
			}
		} else if a, ok := first.([]any); !ok || len(a) != 11 || a[0] != "BlockStored" { // + extra_keys, group_idx, kv_cache_spec_kind
			t.Errorf("positional event %#v", first)
		}
	}
}

// TestKVEventsDPPortOffset: DP rank r publishes on the configured ports
// plus r, and its batches carry data_parallel_rank r.
func TestKVEventsDPPortOffset(t *testing.T) {
	var in *Instance
	var base int
	for attempt := 0; in == nil && attempt < 20; attempt++ {
		base = freePortRun(t, 4)
		cfg, err := ParseArgs([]string{"--port", "0", "--data-parallel-size", "2", "--kv-events-config",
			fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://*:%d", "replay_endpoint": "tcp://*:%d"}`, base, base+2)}, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if in, err = Start(t.Context(), cfg, Options{Logger: testLogger()}); err != nil {
			in = nil // a port of the run was taken meanwhile: try another
		}
	}
	if in == nil {
		t.Fatal("no free run of ports")
	}
	t.Cleanup(in.Close)
	pub, rep := in.KVEventEndpoints()
	want := func(p int) string { return fmt.Sprintf("tcp://127.0.0.1:%d", p) }
	if diff := cmp.Diff([]string{want(base), want(base + 1)}, pub); diff != "" {
		t.Fatalf("PUB endpoints (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{want(base + 2), want(base + 3)}, rep); diff != "" {
		t.Fatalf("replay endpoints (-want +got):\n%s", diff)
	}
	// Rank 1's replay answers batches of rank 1 only.
	r := postJSON(t, testCtx(t), in.url("/v1/completions"), map[string]any{"prompt": words(40, "dp"), "max_tokens": 1},
		map[string]string{"X-data-parallel-rank": "1"})
	if r.status != 200 {
		t.Fatalf("completion: %d %s", r.status, r.raw)
	}
	waitFor(t, "rank 1 publishes", func() bool { return in.kvPubs[1].published.Load() > 0 })
	in.kvPubs[1].mu.Lock()
	payload := in.kvPubs[1].buf[0].payload
	in.kvPubs[1].mu.Unlock()
	b, _, err := kvevents.DecodeBatch(payload)
	if err != nil || b.DPRank != 1 || len(b.Events) != 1 {
		t.Fatalf("rank 1 batch %+v, %v", b, err)
	}
	if n := in.kvPubs[0].published.Load(); n != 0 {
		t.Fatalf("rank 0 published %d batches for a request pinned to rank 1", n)
	}
}

// freePortRun returns a base port whose next n-1 ports are free too.
func freePortRun(t *testing.T, n int) int {
	t.Helper()
	base, err := freeport.Run(n)
	if err != nil {
		t.Fatal(err)
	}
	return base
}

// TestKVEventsPublisherConnects: an endpoint without a wildcard makes the
// PUB dial out to a subscriber that binds, as vLLM's publisher does.
func TestKVEventsPublisherConnects(t *testing.T) {
	ctx := testCtx(t)
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quietZMQLogger))
	t.Cleanup(func() { _ = sub.Close() }) // after the sim's Close: its PUB stops redialling first
	if err := sub.SetOption(zmq4.OptionSubscribe, "t"); err != nil {
		t.Fatal(err)
	}
	if err := sub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	ep := fmt.Sprintf("tcp://127.0.0.1:%d", sub.Addr().(*net.TCPAddr).Port)
	in := startSim(t, "--profile-preset", "zero", "--kv-events-config",
		fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": %q, "topic": "t"}`, ep))
	got := make(chan [][]byte, 1)
	go func() {
		msg, err := sub.Recv()
		if err == nil {
			got <- msg.Frames
		}
		close(got)
	}()
	// Batches sent before the connection is up are lost: send until one
	// arrives.
	for i := 0; ; i++ {
		complete(t, in, words(20, fmt.Sprintf("c%d", i)))
		select {
		case frames := <-got:
			if len(frames) != 3 || string(frames[0]) != "t" || len(frames[1]) != 8 {
				t.Fatalf("frames %q", frames)
			}
			if _, _, err := kvevents.DecodeBatch(frames[2]); err != nil {
				t.Fatal(err)
			}
			return
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			t.Fatal("no batch reached the binding subscriber")
		}
	}
}

// TestKVEventsQueueOverflowLeavesGap: batches dropped at max_queue_size
// keep their sequence numbers, so subscribers see the gap.
func TestKVEventsQueueOverflowLeavesGap(t *testing.T) {
	p := &kvPublisher{maxQueue: 2, notify: make(chan struct{}, 1)}
	for range 5 {
		p.enqueue(engine.KVEventBatch{})
	}
	if p.dropped.Load() != 3 || len(p.queue) != 2 || p.queue[0].seq != 3 || p.queue[1].seq != 4 {
		t.Fatalf("dropped %d, queue %+v", p.dropped.Load(), p.queue)
	}
}
