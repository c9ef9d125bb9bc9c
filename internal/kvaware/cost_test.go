package kvaware

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

// scenarioBodies are the completions bodies of `sybench scenario kv`'s
// workload (internal/bench/scenario/kv.go: 16 groups × 16 requests, 512-word
// system prompts, 4-turn conversations resending their history), in the
// order they are sent. epoch, when not 0, is written before every prompt so
// each epoch's prompts are new to the tokenizer's caches while sharing
// among themselves what the workload shares.
func scenarioBodies(tb testing.TB, epoch int) [][]byte {
	tb.Helper()
	cfg := bench.DefaultConfig()
	cfg.BaseURL = "http://x"
	cfg.Backend = bench.BackendVLLM
	cfg.DatasetName = bench.DatasetSharedPrefix
	cfg.SharedPrefixGroups, cfg.SharedPrefixPromptsPerGroup, cfg.SharedPrefixLen = 16, 16, 512
	cfg.SharedPrefixTurns = 4
	cfg.InputLen, cfg.OutputLen, cfg.RangeRatio = 64, 16, 0
	cfg.NumPrompts, cfg.Seed = 256, 2026
	ss, err := bench.Samples(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	out := make([][]byte, len(ss))
	for i, s := range ss {
		p := string(s.AppendPrompt(nil))
		if epoch != 0 {
			p = fmt.Sprintf("epoch%d %s", epoch, p)
		}
		out[i], _ = json.Marshal(map[string]any{"model": "m", "prompt": p, "max_tokens": 16, "stream": true})
	}
	return out
}

// BenchmarkPolicyCost is the router's per-request work of cache_aware and
// kv_aware side by side on the kv scenario's prompts (2.7k tokens at the
// longest): a fresh Request per prompt, then for kv_aware the in-process
// tokenization (every prompt new to the whole-prompt cache, as in the
// scenario), block keys, the pick, and the index update the engine's
// BlockStored events for the prompt cause (the prompt's blocks on the
// chosen worker); for cache_aware the pick, which matches and inserts the
// text in its tree. Both get the request's body parsed, as the router
// does for every policy (policy.Request.Obj). Every 256 requests the
// prompts change (a new epoch) so nothing is served from a previous pass.
//
//	go test -run='^$' -bench=PolicyCost -benchmem ./internal/kvaware
func BenchmarkPolicyCost(b *testing.B) {
	lt, err := tokenizer.Load("../tokenizer/testdata/tiny-llama.json")
	if err != nil {
		b.Fatal(err)
	}
	ws := mkWorkers("http://a:1", "http://b:1", "http://c:1", "http://d:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	// request(i) is the i-th request, its body parsed as the router's
	// server parses every body before any policy sees it; a new epoch's
	// bodies are built and parsed with the timer stopped.
	var cur [][]byte
	var objs []*rawjson.Object
	request := func(b *testing.B, i int) *policy.Request {
		if i%256 == 0 {
			b.StopTimer()
			cur = scenarioBodies(b, i/256+1)
			objs = objs[:0]
			for _, body := range cur {
				o, err := rawjson.Parse(body)
				if err != nil {
					b.Fatal(err)
				}
				objs = append(objs, o)
			}
			b.StartTimer()
		}
		return &policy.Request{Path: "/v1/completions", Body: cur[i%256], Obj: objs[i%256]}
	}

	b.Run("cache_aware", func(b *testing.B) {
		o := policy.DefaultOptions()
		o.EvictionInterval = -1
		p, err := policy.New(policy.NameCacheAware, o)
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = policy.Close(p) }()
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			req := request(b, i)
			if _, err := p.Pick(req, c); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("kv_aware", func(b *testing.B) {
		x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 16})
		tok := NewTokenizer(http.DefaultClient, time.Second, 0)
		// Verified by a probe: local ids are used from the first prompt.
		tok.SetLocal(LocalOptions{Tokenizer: lt, Background: -1, SampleEvery: -1})
		defer tok.Close()
		tok.inline.Store(DefaultVerify)
		fb, err := policy.New(policy.NameCacheAware, policy.DefaultOptions())
		if err != nil {
			b.Fatal(err)
		}
		// The policy's clock moves 1/150 s a request, the kv scenario's
		// middle rate, so speculative entries expire after as many
		// requests as they would there (a 2 s TTL: 300), not after the
		// benchmark's own pace (tens of thousands a second), which would
		// keep a hundred times more of them.
		now := time.Unix(1e9, 0)
		clock := func() time.Time { return now }
		p, err := New(Options{Index: x, Tokenizer: tok, Fallback: fb, OverlapWeight: 1, LoadWeight: 0.02,
			TieBand: DefaultTieBand, Speculative: true, Now: clock})
		if err != nil {
			b.Fatal(err)
		}
		defer p.Close()
		// The engine's events: BlockStored for the blocks the chosen
		// worker did not hold, chained to the last one it did.
		held := map[string]map[uint64]bool{}
		hash := func(k uint64) kvevents.Hash { return kvevents.Hash(k + 1) }
		var hashes []kvevents.Hash
		b.ReportAllocs()
		for i := 0; b.Loop(); i++ {
			if i%256 == 0 {
				// A new epoch is a new run: the engines' caches start
				// empty (the scenario resets them), so does the index.
				for _, w := range ws {
					x.RemoveWorker(w.Key())
				}
				clear(held)
			}
			now = now.Add(time.Second / 150)
			req := request(b, i)
			policy.Prepare(b.Context(), p, req, c)
			ch, err := p.Pick(req, c)
			if err != nil {
				b.Fatal(err)
			}
			if req.TokenErr != nil {
				b.Fatal(req.TokenErr)
			}
			keys := req.Prepared.(*prepared).keys
			h := held[ch.Worker.Key()]
			if h == nil {
				h = map[uint64]bool{}
				held[ch.Worker.Key()] = h
			}
			j0 := 0
			for j0 < len(keys) && h[keys[j0]] {
				j0++
			}
			if j0 == len(keys) {
				continue
			}
			e := kvevents.BlockStored{BlockSize: 16, LoRAID: -1, TokenIDs: req.Tokens[j0*16 : len(keys)*16]}
			if j0 > 0 {
				e.Parent = hash(keys[j0-1])
			}
			hashes = hashes[:0]
			for _, k := range keys[j0:] {
				hashes = append(hashes, hash(k))
				h[k] = true
			}
			e.BlockHashes = hashes
			x.Apply(ch.Worker.Key(), []kvevents.Event{e})
		}
		b.ReportMetric(float64(p.S.Hits.Load())/float64(p.S.Picks.Load()), "hits/pick")
		if st := tok.PrefixStats(); st.TotalBytes > 0 {
			b.ReportMetric(float64(st.ReusedBytes)/float64(st.TotalBytes), "reused/byte")
		}
	})
}
