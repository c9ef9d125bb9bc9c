package engine

import (
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
)

func cacheParams(numBlocks int) Params {
	p := testParams()
	p.PrefixCaching = true
	p.NumBlocks = numBlocks
	return p
}

// seqTokens returns n token ids starting at base.
func seqTokens(base, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(base + i)
	}
	return out
}

// eventLog collects an engine's KV event batches.
type eventLog struct {
	mu      sync.Mutex
	batches []KVEventBatch
}

func (l *eventLog) sink(b KVEventBatch) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.batches = append(l.batches, b)
}

func (l *eventLog) take() []KVEvent {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []KVEvent
	for _, b := range l.batches {
		out = append(out, b.Events...)
	}
	l.batches = nil
	return out
}

// chain is the hash chain of tokens' full blocks of size bs.
func chain(tokens []uint32, bs int) []BlockHash { return saltedChain(tokens, bs, "") }

// saltedChain is chain for a request with a cache_salt.
func saltedChain(tokens []uint32, bs int, salt string) []BlockHash {
	var out []BlockHash
	for k := 0; (k+1)*bs <= len(tokens); k++ {
		if k == 0 {
			out = append(out, FirstBlockHash(salt, tokens[:bs]))
			continue
		}
		out = append(out, ChainHash(&out[k-1], tokens[k*bs:(k+1)*bs]))
	}
	return out
}

func withCacheEngine(t *testing.T, p Params, f func(t *testing.T, e *Engine, log *eventLog)) {
	t.Helper()
	withEngine(t, p, func(t *testing.T, e *Engine) {
		log := &eventLog{}
		e.SetKVEventSink(log.sink)
		f(t, e, log)
	})
}

// run submits a request for tokens and waits for it to finish; it returns
// the request's cached tokens and how long it took.
func run(t *testing.T, e *Engine, id string, tokens []uint32, maxTokens int, out func(int) uint32) (int, time.Duration) {
	t.Helper()
	start := time.Now()
	h := submit(t, e, &Request{ID: id, PromptTokens: len(tokens), Tokens: tokens, MaxTokens: maxTokens, OutputToken: out})
	end, p := waitFinished(h)
	if p.Reason != FinishLength {
		t.Fatalf("%s finished with %v", id, p.Reason)
	}
	return h.CachedTokens(), end.Sub(start)
}

func TestPrefixCacheHitSkipsCachedTokens(t *testing.T) {
	p := cacheParams(1000)
	withCacheEngine(t, p, func(t *testing.T, e *Engine, log *eventLog) {
		a := seqTokens(100, 48)
		cached, took := run(t, e, "a", a, 1, nil)
		if cached != 0 || took != p.PrefillTime(48) {
			t.Fatalf("first: cached %d in %v, want 0 in %v", cached, took, p.PrefillTime(48))
		}
		hs := chain(a, 16)
		want := []KVEvent{{Kind: BlockStored, Hashes: hs, Tokens: a}}
		if diff := cmp.Diff(want, log.take()); diff != "" {
			t.Fatalf("first request's events (-want +got):\n%s", diff)
		}
		// At most num_tokens-1 tokens can hit: 2 of the 3 blocks.
		cached, took = run(t, e, "b", a, 1, nil)
		if wantT := p.PrefillBase + 16*p.PrefillPerToken; cached != 32 || took != wantT {
			t.Fatalf("repeat: cached %d in %v, want 32 in %v", cached, took, wantT)
		}
		// The recomputed last block is stored again (vLLM does not
		// de-duplicate).
		want = []KVEvent{{Kind: BlockStored, Hashes: hs[2:], Parent: &hs[1], Tokens: a[32:]}}
		if diff := cmp.Diff(want, log.take()); diff != "" {
			t.Fatalf("repeat's events (-want +got):\n%s", diff)
		}
		st := e.PrefixCacheStats()
		if st.Queries != 96 || st.Hits != 32 {
			t.Fatalf("stats %+v, want 96 queries, 32 hits", st)
		}
	})
}

func TestPrefixCacheLRUEvictsTailFirst(t *testing.T) {
	withCacheEngine(t, cacheParams(8), func(t *testing.T, e *Engine, log *eventLog) {
		a, b, c := seqTokens(0, 48), seqTokens(1000, 48), seqTokens(2000, 48)
		run(t, e, "a", a, 1, nil)
		run(t, e, "b", b, 1, nil)
		log.take()
		// 8 blocks: a and b hold 6 cached; c takes the 2 fresh ones and
		// evicts the least recently used: a's last block first.
		run(t, e, "c", c, 1, nil)
		ha := chain(a, 16)
		var removed []BlockHash
		for _, ev := range log.take() {
			if ev.Kind == BlockRemoved {
				removed = append(removed, ev.Hashes...)
			}
		}
		if diff := cmp.Diff([]BlockHash{ha[2]}, removed); diff != "" {
			t.Fatalf("evicted (-want +got):\n%s", diff)
		}
		if cached, _ := run(t, e, "a2", a, 1, nil); cached != 32 {
			t.Fatalf("a after one eviction: %d cached tokens, want 32", cached)
		}
		// Three new prompts push everything else out.
		for i := range 3 {
			run(t, e, "x", seqTokens(5000+100*i, 48), 1, nil)
		}
		if cached, _ := run(t, e, "b2", b, 1, nil); cached != 0 {
			t.Fatalf("b after eviction pressure: %d cached tokens, want 0", cached)
		}
		if st := e.PrefixCacheStats(); st.CachedBlocks > 8 || st.Evictions == 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestPrefixCacheGeneratedBlocks(t *testing.T) {
	withCacheEngine(t, cacheParams(1000), func(t *testing.T, e *Engine, log *eventLog) {
		prompt := seqTokens(0, 20)
		gen := func(i int) uint32 { return uint32(9000 + i) }
		run(t, e, "a", prompt, 30, gen)
		// KV exists for 20+30-1 tokens: 3 full blocks, the last two made
		// of generated tokens.
		all := append(append([]uint32(nil), prompt...), seqTokens(9000, 30)...)
		hs := chain(all[:48], 16)
		var stored []BlockHash
		for _, ev := range log.take() {
			if ev.Kind == BlockStored {
				stored = append(stored, ev.Hashes...)
			}
		}
		if diff := cmp.Diff(hs, stored); diff != "" {
			t.Fatalf("stored (-want +got):\n%s", diff)
		}
		// A follow-up turn that resends prompt and answer hits all three.
		if cached, _ := run(t, e, "b", all[:49], 1, nil); cached != 48 {
			t.Fatalf("follow-up: %d cached tokens, want 48", cached)
		}
	})
}

func TestPrefixCacheReset(t *testing.T) {
	withCacheEngine(t, cacheParams(1000), func(t *testing.T, e *Engine, log *eventLog) {
		a := seqTokens(0, 48)
		run(t, e, "a", a, 1, nil)
		log.take()
		// Refused while a request holds blocks.
		h := submit(t, e, &Request{ID: "busy", PromptTokens: 16, Tokens: seqTokens(500, 16), MaxTokens: 50})
		waitTokens(h, 1)
		if e.ResetPrefixCache() {
			t.Fatal("reset succeeded while a request runs")
		}
		waitFinished(h)
		if !e.ResetPrefixCache() {
			t.Fatal("reset failed on an idle engine")
		}
		synctest.Wait()
		evs := log.take()
		if len(evs) == 0 || evs[len(evs)-1].Kind != AllBlocksCleared {
			t.Fatalf("events after reset: %+v", evs)
		}
		if cached, _ := run(t, e, "a2", a, 1, nil); cached != 0 {
			t.Fatalf("after reset: %d cached tokens, want 0", cached)
		}
		if st := e.PrefixCacheStats(); st.Resets != 1 || st.ResetsFailed != 1 {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestPrefixCacheDisabled(t *testing.T) {
	p := testParams()
	withCacheEngine(t, p, func(t *testing.T, e *Engine, log *eventLog) {
		a := seqTokens(0, 48)
		run(t, e, "a", a, 1, nil)
		if cached, took := run(t, e, "b", a, 1, nil); cached != 0 || took != p.PrefillTime(48) {
			t.Fatalf("caching off: cached %d in %v", cached, took)
		}
		if evs := log.take(); len(evs) != 0 {
			t.Fatalf("events with caching off: %+v", evs)
		}
		if st := e.PrefixCacheStats(); st.Queries != 0 || st.Hits != 0 || st.Enabled {
			t.Fatalf("stats %+v", st)
		}
	})
}

func TestPrefixCacheConcurrentSharers(t *testing.T) {
	// Two running requests share cached blocks; the blocks stay until both
	// are done, and the pool's accounting balances.
	withCacheEngine(t, cacheParams(1000), func(t *testing.T, e *Engine, log *eventLog) {
		a := seqTokens(0, 64)
		run(t, e, "warm", a, 1, nil)
		h1 := submit(t, e, &Request{ID: "1", PromptTokens: 64, Tokens: a, MaxTokens: 20})
		h2 := submit(t, e, &Request{ID: "2", PromptTokens: 64, Tokens: a, MaxTokens: 5})
		waitFinished(h1)
		waitFinished(h2)
		if h1.CachedTokens() != 48 || h2.CachedTokens() != 48 {
			t.Fatalf("cached %d and %d, want 48", h1.CachedTokens(), h2.CachedTokens())
		}
		if s := e.Snapshot(); s.BlocksUsed != 0 {
			t.Fatalf("%d blocks still used", s.BlocksUsed)
		}
	})
}

func TestSubmitRejectsTokenCountMismatch(t *testing.T) {
	e := New(cacheParams(10))
	if _, err := e.Submit(&Request{ID: "x", PromptTokens: 3, Tokens: []uint32{1, 2}}); err == nil {
		t.Fatal("mismatched token ids accepted")
	}
}

func TestPrefixCachePreemptedRequestReusesItsBlocks(t *testing.T) {
	// 6 blocks for two requests that grow to 5 each: one is preempted and,
	// re-admitted, finds its own cached blocks, so it prefills less than
	// with caching off. vLLM counts only first admissions in the stats.
	scenario := func(p Params) (Snapshot, PrefixStats) {
		var s Snapshot
		var st PrefixStats
		withCacheEngine(t, p, func(t *testing.T, e *Engine, log *eventLog) {
			gen := func(i int) uint32 { return uint32(7000 + i) }
			h1 := submit(t, e, &Request{ID: "1", PromptTokens: 32, Tokens: seqTokens(0, 32), MaxTokens: 40, OutputToken: gen})
			h2 := submit(t, e, &Request{ID: "2", PromptTokens: 32, Tokens: seqTokens(100, 32), MaxTokens: 40, OutputToken: gen})
			_, p1 := waitFinished(h1)
			_, p2 := waitFinished(h2)
			if p1.Generated != 40 || p2.Generated != 40 {
				t.Fatalf("generated %d and %d, want 40", p1.Generated, p2.Generated)
			}
			s, st = e.Snapshot(), e.PrefixCacheStats()
		})
		return s, st
	}
	off := cacheParams(6)
	off.PrefixCaching = false
	sOff, _ := scenario(off)
	s, st := scenario(cacheParams(6))
	if s.Preemptions == 0 || sOff.Preemptions == 0 || s.BlocksUsed != 0 {
		t.Fatalf("snapshots %+v / %+v: want preemptions and no block left in use", s, sOff)
	}
	if st.Queries != 64 || st.Hits != 0 {
		t.Fatalf("stats %+v: want 64 queried tokens (first admissions only), 0 hits", st)
	}
	t.Logf("prefill tokens: %d with caching, %d without; preemptions %d / %d", s.PrefillTokens, sOff.PrefillTokens, s.Preemptions, sOff.Preemptions)
	if s.PrefillTokens >= sOff.PrefillTokens {
		t.Fatalf("prefill tokens %d with caching, %d without: the preempted request recomputed its cached blocks", s.PrefillTokens, sOff.PrefillTokens)
	}
}

func TestFirstBlockHashSalt(t *testing.T) {
	tokens := seqTokens(0, 16)
	plain := ChainHash(nil, tokens)
	if FirstBlockHash("", tokens) != plain {
		t.Fatal("an empty salt changes the first block's hash")
	}
	s1, s2 := FirstBlockHash("s1", tokens), FirstBlockHash("s2", tokens)
	if s1 == plain || s2 == plain || s1 == s2 {
		t.Fatalf("salted hashes collide: plain %x, s1 %x, s2 %x", plain, s1, s2)
	}
}

// TestCacheSaltSeparatesCachedBlocks: vLLM's cache_salt is an extra key of
// a request's first block, so requests share cached blocks only with
// requests of the same salt (no salt being a salt of its own), and a
// salted request's BlockStored carries the salt on the sequence's first
// block only.
func TestCacheSaltSeparatesCachedBlocks(t *testing.T) {
	a := seqTokens(100, 48) // 3 blocks; at most 2 can hit
	b := append(append([]uint32(nil), a[:16]...), seqTokens(900, 32)...)
	plain, s1, s2 := chain(a, 16), saltedChain(a, 16, "s1"), saltedChain(a, 16, "s2")
	s1b := saltedChain(b, 16, "s1")
	for _, h := range plain {
		if slices.Contains(s1, h) || slices.Contains(s2, h) {
			t.Fatal("a salted chain shares a hash with the unsalted one")
		}
	}
	steps := []struct {
		name, salt string
		tokens     []uint32
		cached     int
		events     []KVEvent
	}{
		{"unsalted", "", a, 0, []KVEvent{{Kind: BlockStored, Hashes: plain, Tokens: a}}},
		{"salted misses unsalted blocks", "s1", a, 0, []KVEvent{{Kind: BlockStored, Hashes: s1, Tokens: a, Salt: "s1"}}},
		{"same salt hits", "s1", a, 32, []KVEvent{{Kind: BlockStored, Hashes: s1[2:], Parent: &s1[1], Tokens: a[32:]}}},
		{"other salt misses", "s2", a, 0, []KVEvent{{Kind: BlockStored, Hashes: s2, Tokens: a, Salt: "s2"}}},
		{"unsalted hits its own", "", a, 32, []KVEvent{{Kind: BlockStored, Hashes: plain[2:], Parent: &plain[1], Tokens: a[32:]}}},
		{"same salt, first block shared", "s1", b, 16, []KVEvent{{Kind: BlockStored, Hashes: s1b[1:], Parent: &s1b[0], Tokens: b[16:]}}},
	}
	withCacheEngine(t, cacheParams(1000), func(t *testing.T, e *Engine, log *eventLog) {
		hits := 0
		for _, st := range steps {
			h := submit(t, e, &Request{ID: st.name, PromptTokens: len(st.tokens), Tokens: st.tokens, MaxTokens: 1, CacheSalt: st.salt})
			waitFinished(h)
			if got := h.CachedTokens(); got != st.cached {
				t.Errorf("%s: %d cached tokens, want %d", st.name, got, st.cached)
			}
			if diff := cmp.Diff(st.events, log.take()); diff != "" {
				t.Errorf("%s: events (-want +got):\n%s", st.name, diff)
			}
			hits += st.cached
		}
		if ps := e.PrefixCacheStats(); ps.Queries != 6*48 || ps.Hits != uint64(hits) {
			t.Fatalf("stats %+v, want %d queries, %d hits", ps, 6*48, hits)
		}
	})
}

// TestReuseReport: with vLLM 0.32's kv_cache_report_mode "full"
// (ReportCachedBlocks) a request whose lookup finds cached blocks
// publishes a BlockStored of exactly those blocks (block 0 on, parent nil,
// their tokens, the salt on block 0) ahead of its own new blocks' store;
// without it, or without hits, nothing is reported for hits.
func TestReuseReport(t *testing.T) {
	a := seqTokens(100, 48)                                           // 3 blocks, stored by the warm-up
	ext := append(append([]uint32(nil), a...), seqTokens(500, 20)...) // 68 tokens: a's 3 blocks hit
	fresh := seqTokens(3000, 40)
	plain, salted := chain(ext, 16), saltedChain(ext, 16, "s1")
	cases := []struct {
		name   string
		salt   string
		report bool
		tokens []uint32
		cached int
		events []KVEvent
	}{
		{"full mode reports the hit blocks", "", true, ext, 48, []KVEvent{
			{Kind: BlockStored, Hashes: plain[:3], Tokens: ext[:48]},
			{Kind: BlockStored, Hashes: plain[3:4], Parent: &plain[2], Tokens: ext[48:64]},
		}},
		{"incremental mode reports nothing for hits", "", false, ext, 48, []KVEvent{
			{Kind: BlockStored, Hashes: plain[3:4], Parent: &plain[2], Tokens: ext[48:64]},
		}},
		{"full mode, salted: the salt on block 0", "s1", true, ext, 48, []KVEvent{
			{Kind: BlockStored, Hashes: salted[:3], Tokens: ext[:48], Salt: "s1"},
			{Kind: BlockStored, Hashes: salted[3:4], Parent: &salted[2], Tokens: ext[48:64]},
		}},
		{"full mode without hits reports nothing", "", true, fresh, 0, []KVEvent{
			{Kind: BlockStored, Hashes: chain(fresh, 16), Tokens: fresh[:32]},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			withCacheEngine(t, cacheParams(1000), func(t *testing.T, e *Engine, log *eventLog) {
				warm := submit(t, e, &Request{ID: "warm", PromptTokens: len(a), Tokens: a, MaxTokens: 1, CacheSalt: tc.salt})
				waitFinished(warm)
				log.take()
				h := submit(t, e, &Request{ID: "r", PromptTokens: len(tc.tokens), Tokens: tc.tokens, MaxTokens: 1,
					CacheSalt: tc.salt, ReportCachedBlocks: tc.report})
				waitFinished(h)
				if got := h.CachedTokens(); got != tc.cached {
					t.Fatalf("%d cached tokens, want %d", got, tc.cached)
				}
				if diff := cmp.Diff(tc.events, log.take()); diff != "" {
					t.Fatalf("events (-want +got):\n%s", diff)
				}
			})
		})
	}
}

// TestReuseReportWithoutSink: with KV events off nothing is queued for a
// reuse report.
func TestReuseReportWithoutSink(t *testing.T) {
	withEngine(t, cacheParams(1000), func(t *testing.T, e *Engine) {
		a := seqTokens(0, 48)
		for _, id := range []string{"warm", "r"} {
			waitFinished(submit(t, e, &Request{ID: id, PromptTokens: len(a), Tokens: a, MaxTokens: 1, ReportCachedBlocks: true}))
		}
		e.mu.Lock()
		pending := len(e.pool.events)
		e.mu.Unlock()
		if st := e.PrefixCacheStats(); st.Hits != 32 || pending != 0 {
			t.Fatalf("stats %+v, %d pending events: want 32 hit tokens and no event", st, pending)
		}
	})
}

// TestReuseReportOnReadmission: the report comes with every lookup, as
// vLLM's get_computed_blocks runs whenever a request with no computed
// tokens is scheduled, so a preempted request re-admitted onto its own
// cached blocks reports them (its first admission found nothing cached).
// A report is a BlockStored of blocks the cache holds already: the run
// with the option has some, each a prefix of one request's sequence from
// its first block; the run without has none. (The two runs' events are not
// compared in order: when the engine steps relative to the submissions
// depends on the machine's load.)
func TestReuseReportOnReadmission(t *testing.T) {
	gen := func(i int) uint32 { return uint32(7000 + i) }
	p1, p2 := seqTokens(0, 32), seqTokens(100, 32)
	scenario := func(report bool) []KVEvent {
		var evs []KVEvent
		withCacheEngine(t, cacheParams(6), func(t *testing.T, e *Engine, log *eventLog) {
			h1 := submit(t, e, &Request{ID: "1", PromptTokens: 32, Tokens: p1, MaxTokens: 40, OutputToken: gen, ReportCachedBlocks: report})
			h2 := submit(t, e, &Request{ID: "2", PromptTokens: 32, Tokens: p2, MaxTokens: 40, OutputToken: gen, ReportCachedBlocks: report})
			waitFinished(h1)
			waitFinished(h2)
			if e.Snapshot().Preemptions == 0 {
				t.Fatal("no preemption")
			}
			evs = log.take()
		})
		return evs
	}
	if off := restores(scenario(false)); len(off) > 0 {
		t.Fatalf("without reports, %d BlockStored events of blocks already held: %+v", len(off), off[0])
	}
	reports := restores(scenario(true))
	if len(reports) == 0 {
		t.Fatal("no reuse report")
	}
	t.Logf("%d reuse reports (one per lookup: re-admission attempts of a preempted request)", len(reports))
	// Each request's sequence: its prompt, then its generated tokens.
	seqs := [][]uint32{append(slices.Clone(p1), seqTokens(7000, 40)...), append(slices.Clone(p2), seqTokens(7000, 40)...)}
	for _, ev := range reports {
		n := len(ev.Hashes)
		prefix := false
		for _, s := range seqs {
			prefix = prefix || (slices.Equal(ev.Tokens, s[:min(n*16, len(s))]) && slices.Equal(ev.Hashes, chain(s, 16)[:n]))
		}
		if ev.Parent != nil || !prefix {
			t.Fatalf("report %+v is not a prefix of either sequence from its first block", ev)
		}
	}
}

// restores returns the BlockStored events of evs whose blocks were all
// held already (stored before, not removed since): reuse reports.
func restores(evs []KVEvent) []KVEvent {
	held := map[BlockHash]bool{}
	var out []KVEvent
	for _, ev := range evs {
		switch ev.Kind {
		case BlockStored:
			all := len(ev.Hashes) > 0
			for _, h := range ev.Hashes {
				all = all && held[h]
			}
			if all {
				out = append(out, ev)
			}
			for _, h := range ev.Hashes {
				held[h] = true
			}
		case BlockRemoved:
			for _, h := range ev.Hashes {
				delete(held, h)
			}
		case AllBlocksCleared:
			clear(held)
		}
	}
	return out
}

// cycleDuplicate allocates one block (evicting the least recently used
// when the pool is full), caches it under h and releases it: what each of
// many finished requests with the same output does to one of its blocks.
func cycleDuplicate(t testing.TB, p *blockPool, h BlockHash) int32 {
	ids, ok := p.alloc(1)
	if !ok {
		t.Fatal("alloc failed")
	}
	p.insert(ids[0], h)
	p.release(ids)
	return ids[0]
}

// TestDuplicateHashEvictionKeepsOrder: blocks holding one hash stay in the
// order they were cached (a hit takes the oldest), whichever of them is
// evicted, and their list does not grow past the blocks that hold it.
func TestDuplicateHashEvictionKeepsOrder(t *testing.T) {
	const total = 8
	p := newBlockPool(total, true)
	h := BlockHash{1}
	var order []int32 // the blocks holding h, oldest first
	for range 100 * total {
		if len(order) == total {
			order = order[1:] // the LRU's head: the oldest
		}
		order = append(order, cycleDuplicate(t, &p, h))
		if diff := cmp.Diff(order, p.cache[h]); diff != "" {
			t.Fatalf("blocks holding the hash (-want +got):\n%s", diff)
		}
		if got, _ := p.cachedBlock(h); got != order[0] {
			t.Fatalf("a hit took block %d, want the oldest %d", got, order[0])
		}
	}
	if c := cap(p.cache[h]); c > 4*total {
		t.Fatalf("the list of %d blocks holding the hash has capacity %d", total, c)
	}
	// One from the middle: the others keep their order.
	mid := order[total/2]
	p.lruRemove(mid)
	p.evict(mid)
	want := slices.Delete(slices.Clone(order), total/2, total/2+1)
	if diff := cmp.Diff(want, p.cache[h]); diff != "" {
		t.Fatalf("after evicting block %d (-want +got):\n%s", mid, diff)
	}
	if p.cachedBlocks != total-1 {
		t.Fatalf("cachedBlocks %d, want %d", p.cachedBlocks, total-1)
	}
}

// BenchmarkEvictDuplicateHash: a full pool whose blocks all hold one hash,
// each operation evicting the oldest (a repeated prompt's output blocks).
//
//	go test -run '^$' -bench EvictDuplicateHash ./internal/sim/engine
func BenchmarkEvictDuplicateHash(b *testing.B) {
	const total = 16384
	p := newBlockPool(total, true)
	h := BlockHash{1}
	for range total {
		cycleDuplicate(b, &p, h)
	}
	for b.Loop() {
		cycleDuplicate(b, &p, h)
	}
}
