package engine

import (
	"crypto/sha256"
	"encoding/binary"
	"slices"
	"time"
)

// The prefix cache follows vLLM's V1 block pool (vllm/v1/core/block_pool.py):
//   - A full block of a request's tokens (prompt, then generated tokens as
//     they fill blocks) gets a hash chained on its parent's, and is
//     registered in the cache when the step that computes it is scheduled.
//   - A finished request's cached blocks stay in the pool as evictable
//     blocks, in LRU order (a request's blocks are freed tail first, so its
//     last blocks are evicted first). Uncached free blocks are reused
//     before any cached block is evicted.
//   - A new request reuses its longest cached prefix of full blocks, at
//     most num_tokens-1 tokens (the last token is always computed); those
//     tokens are not recomputed.
//   - Identical blocks computed concurrently are not de-duplicated: the
//     cache maps a hash to every block holding it, and evicting one of them
//     reports the hash removed (as vLLM does).

// BlockHash is a block's cache key: sha256 over the parent block's hash and
// the block's token ids (vLLM's default sha256 chain).
type BlockHash [32]byte

// noneHash is the parent of a sequence's first block: vLLM's NONE_HASH is
// derived from the fixed seed "vllm-none-hash" for cryptographic hashes.
var noneHash = BlockHash(sha256.Sum256([]byte("vllm-none-hash")))

// ChainHash is the hash of a block with these token ids after parent (nil:
// the first block of a sequence), without extra keys.
func ChainHash(parent *BlockHash, tokens []uint32) BlockHash {
	return blockHash(parent, tokens, "", "")
}

// FirstBlockHash is the hash of a sequence's first block under a request's
// cache_salt: vLLM adds ("cache_salt", salt) to the extra keys of the block
// at token 0 only, so the salt changes every hash of the chain. An empty
// salt is ChainHash(nil, tokens).
func FirstBlockHash(salt string, tokens []uint32) BlockHash {
	return blockHash(nil, tokens, salt, "")
}

// FirstLoRABlockHash is FirstBlockHash for a request of LoRA adapter lora:
// vLLM puts the adapter's name in the extra keys of every block of its
// requests, so their chains are apart from the base model's and from
// other adapters'. The chain carries it on; the sim keys the first block.
func FirstLoRABlockHash(lora, salt string, tokens []uint32) BlockHash {
	return blockHash(nil, tokens, salt, lora)
}

// saltKey and loraKey separate a block's token ids from its salt and its
// LoRA adapter's name.
const (
	saltKey = "\x00cache_salt\x00"
	loraKey = "\x00lora\x00"
)

func blockHash(parent *BlockHash, tokens []uint32, salt, lora string) BlockHash {
	p := noneHash
	if parent != nil {
		p = *parent
	}
	buf := make([]byte, len(p)+4*len(tokens), len(p)+4*len(tokens)+len(saltKey)+len(salt)+len(loraKey)+len(lora))
	copy(buf, p[:])
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(buf[len(p)+4*i:], t)
	}
	if lora != "" {
		buf = append(append(buf, loraKey...), lora...)
	}
	if salt != "" {
		buf = append(append(buf, saltKey...), salt...)
	}
	return sha256.Sum256(buf)
}

// KVEventKind is the type of a KV cache event.
type KVEventKind uint8

// KV cache event kinds (vllm/distributed/kv_events.py).
const (
	BlockStored KVEventKind = iota + 1
	BlockRemoved
	AllBlocksCleared
)

// KVEvent is one KV cache event of an engine.
type KVEvent struct {
	Kind   KVEventKind
	Hashes []BlockHash // BlockStored, BlockRemoved
	// Parent is the hash of the block before the first stored one (nil for
	// the first block of a sequence). BlockStored only.
	Parent *BlockHash
	// Tokens holds the token ids of every stored block, BlockSize each.
	Tokens []uint32
	// Salt is the cache_salt in the extra keys of the first stored block
	// ("" for none); only a block that starts a sequence (Parent nil) has
	// one. BlockStored only.
	Salt string
	// LoRA and LoRAID name the LoRA adapter whose request stored the blocks
	// ("" and 0 for the base model): vLLM's lora_name and lora_id, and the
	// name first in every block's extra keys. BlockStored only.
	LoRA   string
	LoRAID int
}

// KVEventBatch is the events of one engine step.
type KVEventBatch struct {
	TS     time.Time
	Events []KVEvent
}

// PrefixStats are an engine's prefix-cache counters. Queries and Hits are
// in tokens, counted when a request is first admitted (vLLM does not count
// the re-admission of a preempted request).
type PrefixStats struct {
	Enabled      bool   `json:"enabled"`
	Queries      uint64 `json:"queries"`
	Hits         uint64 `json:"hits"`
	CachedBlocks int    `json:"cached_blocks"`
	Evictions    uint64 `json:"evictions"`
	Resets       uint64 `json:"resets"`
	ResetsFailed uint64 `json:"resets_failed"`
	EventsQueued uint64 `json:"events"`
}

// engineCache is the engine's prefix-cache state beyond the pool.
type engineCache struct {
	sink                 func(KVEventBatch)
	queries, hits        uint64
	resets, resetsFailed uint64
	events               uint64
}

// handlePrefix is a request's prefix-cache state.
type handlePrefix struct {
	hashes    []BlockHash // chain of the request's full blocks known so far
	numCached int         // leading blocks of h.blocks registered in the cache
	hitTokens int         // tokens found cached at the latest admission
	counted   bool        // first admission done (stats, cachedTokens)
	cached    int         // tokens found cached at the first admission
}

// CachedTokens is the number of prompt tokens the request found in the
// prefix cache when it was first admitted (vLLM's num_cached_tokens).
func (h *Handle) CachedTokens() int {
	h.e.mu.Lock()
	defer h.e.mu.Unlock()
	return h.pc.cached
}

// SetKVEventSink makes the engine report its KV cache events, one batch
// per step that produced any (and one for a reset while idle). Call it
// before Run. f runs on the Run goroutine and must not block.
func (e *Engine) SetKVEventSink(f func(KVEventBatch)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.pc.sink = f
	e.pool.emit = f != nil
}

// PrefixCacheStats returns the prefix-cache counters.
func (e *Engine) PrefixCacheStats() PrefixStats {
	e.mu.Lock()
	defer e.mu.Unlock()
	return PrefixStats{
		Enabled: e.pool.caching, Queries: e.pc.queries, Hits: e.pc.hits,
		CachedBlocks: e.pool.cachedBlocks, Evictions: e.pool.evictions,
		Resets: e.pc.resets, ResetsFailed: e.pc.resetsFailed, EventsQueued: e.pc.events,
	}
}

// ResetPrefixCache drops every cached block (vLLM's reset_prefix_cache).
// Like vLLM it fails, changing nothing, while any block is in use.
func (e *Engine) ResetPrefixCache() bool {
	e.mu.Lock()
	ok := e.pool.reset()
	if ok {
		e.pc.resets++
	} else {
		e.pc.resetsFailed++
	}
	e.mu.Unlock()
	e.kick() // publish the AllBlocksCleared event
	return ok
}

// takeEvents returns the pending events as a batch (nil when none). Called
// with e.mu held.
func (e *Engine) takeEvents() (func(KVEventBatch), *KVEventBatch) {
	if len(e.pool.events) == 0 || e.pc.sink == nil {
		return nil, nil
	}
	b := &KVEventBatch{TS: time.Now(), Events: e.pool.events}
	e.pool.events = nil
	e.pc.events += uint64(len(b.Events))
	return e.pc.sink, b
}

func publish(sink func(KVEventBatch), b *KVEventBatch) {
	if sink != nil && b != nil {
		sink(*b)
	}
}

// cacheable reports whether h takes part in prefix caching.
func (e *Engine) cacheable(h *Handle) bool { return e.pool.caching && h.req.Tokens != nil }

// tokenAt returns the id of token i of h (prompt, then generated).
func (h *Handle) tokenAt(i int) uint32 {
	if i < len(h.req.Tokens) {
		return h.req.Tokens[i]
	}
	if h.req.OutputToken != nil {
		return h.req.OutputToken(i - len(h.req.Tokens))
	}
	return 0
}

func (h *Handle) tokenRange(from, to int) []uint32 {
	out := make([]uint32, to-from)
	for i := range out {
		out[i] = h.tokenAt(from + i)
	}
	return out
}

// extendHashes extends h's hash chain over the full blocks of its first n
// tokens.
func (e *Engine) extendHashes(h *Handle, n int) {
	bs := e.p.BlockSize
	for k := len(h.pc.hashes); (k+1)*bs <= n; k++ {
		tokens := h.tokenRange(k*bs, (k+1)*bs)
		if k == 0 {
			h.pc.hashes = append(h.pc.hashes, FirstLoRABlockHash(h.req.LoRA, h.req.CacheSalt, tokens))
			continue
		}
		h.pc.hashes = append(h.pc.hashes, ChainHash(&h.pc.hashes[k-1], tokens))
	}
}

// lookupPrefix returns the cached blocks of h's longest cached prefix, at
// most total-1 tokens long. Called with e.mu held.
func (e *Engine) lookupPrefix(h *Handle, total int) []int32 {
	if !e.cacheable(h) || total < 1 {
		return nil
	}
	maxBlocks := (total - 1) / e.p.BlockSize
	e.extendHashes(h, maxBlocks*e.p.BlockSize)
	var hits []int32
	for k := range maxBlocks {
		id, ok := e.pool.cachedBlock(h.pc.hashes[k])
		if !ok {
			break
		}
		hits = append(hits, id)
	}
	return hits
}

// admitBlocks gives a queued request its blocks: its cached prefix, then
// new ones. It reports false (changing nothing) when the pool cannot hold
// them. Called with e.mu held.
func (e *Engine) admitBlocks(h *Handle, total int) bool {
	var hits []int32
	if len(h.blocks) == 0 {
		hits = e.lookupPrefix(h, total)
		e.reportHits(h, len(hits))
	}
	need := e.p.BlocksFor(total) - len(h.blocks) - len(hits)
	if !e.pool.canAlloc(need, hits) {
		return false
	}
	e.pool.touch(hits)
	b, _ := e.pool.alloc(need)
	h.blocks = append(append(h.blocks, hits...), b...)
	hit := len(hits) * e.p.BlockSize
	h.pc.numCached = len(hits)
	h.pc.hitTokens = hit
	h.computed = max(h.computed, hit)
	if !h.pc.counted {
		h.pc.counted = true
		h.pc.cached = hit
		if e.pool.caching {
			e.pc.queries += uint64(total)
			e.pc.hits += uint64(hit)
		}
	}
	return true
}

// reportHits queues vLLM 0.32's reuse report for a lookup of h that found
// its first n blocks cached, when h asked for it (kv_cache_report_mode
// "full"; v1/core/kv_cache_manager.py get_computed_blocks, block_pool.py
// emit_cached_block_events): a BlockStored of those blocks, shaped as
// cacheBlocks' stores of a sequence's first blocks (parent nil, their
// tokens, the salt on block 0). No block state changes. Like vLLM it
// reports at every lookup: each scheduling attempt of a request at the
// head of the queue, including one that then finds no room and waits, and
// the re-admission of a preempted request. Called with e.mu held.
func (e *Engine) reportHits(h *Handle, n int) {
	if n == 0 || !h.req.ReportCachedBlocks || !e.pool.emit {
		return
	}
	e.pool.events = append(e.pool.events, KVEvent{Kind: BlockStored,
		Hashes: append([]BlockHash(nil), h.pc.hashes[:n]...),
		Tokens: h.tokenRange(0, n*e.p.BlockSize), Salt: h.req.CacheSalt, LoRA: h.req.LoRA, LoRAID: h.req.LoRAID})
}

// cacheBlocks registers h's full blocks among its first n tokens (vLLM's
// cache_full_blocks) and queues their BlockStored event. Called with e.mu
// held.
func (e *Engine) cacheBlocks(h *Handle, n int) {
	if !e.cacheable(h) {
		return
	}
	bs := e.p.BlockSize
	full := min(n, len(h.blocks)*bs) / bs
	from := h.pc.numCached
	if full <= from {
		return
	}
	e.extendHashes(h, full*bs)
	for k := from; k < full; k++ {
		e.pool.insert(h.blocks[k], h.pc.hashes[k])
	}
	h.pc.numCached = full
	if !e.pool.emit {
		return
	}
	ev := KVEvent{Kind: BlockStored, Hashes: append([]BlockHash(nil), h.pc.hashes[from:full]...),
		Tokens: h.tokenRange(from*bs, full*bs), LoRA: h.req.LoRA, LoRAID: h.req.LoRAID}
	if from > 0 {
		p := h.pc.hashes[from-1]
		ev.Parent = &p
	} else {
		ev.Salt = h.req.CacheSalt
	}
	e.pool.events = append(e.pool.events, ev)
}

// forgetBlocks resets h's cache bookkeeping after its blocks were freed
// (preemption): its hash chain stays valid.
func (h *Handle) forgetBlocks() {
	h.pc.numCached = 0
	h.pc.hitTokens = 0
}

// blockPool hands out block ids. Uncached free ids are recycled LIFO and
// new ids are minted lazily, so memory follows peak use; with prefix
// caching on, cached blocks of finished requests stay until the pool needs
// room and are then evicted least recently used first.
type blockPool struct {
	total   int
	used    int // blocks with ref > 0
	caching bool
	emit    bool // queue KV events

	blocks []kvBlock // minted blocks, by id
	free   []int32   // uncached free blocks

	// Evictable cached blocks (ref 0), least recently used first.
	lruHead, lruTail int32
	cache            map[BlockHash][]int32 // hash → blocks holding it
	cachedBlocks     int                   // blocks with a hash
	evictions        uint64
	events           []KVEvent
}

type kvBlock struct {
	ref        int32
	hashed     bool
	inLRU      bool
	prev, next int32 // LRU links (-1: none)
	hash       BlockHash
}

func newBlockPool(total int, caching bool) blockPool {
	return blockPool{total: total, caching: caching, lruHead: -1, lruTail: -1, cache: map[BlockHash][]int32{}}
}

// cachedBlock returns a block holding hash.
func (p *blockPool) cachedBlock(h BlockHash) (int32, bool) {
	ids := p.cache[h]
	if len(ids) == 0 {
		return 0, false
	}
	return ids[0], true
}

// canAlloc reports whether n new blocks fit once hits (cached blocks about
// to be reused) are taken out of the free ones.
func (p *blockPool) canAlloc(n int, hits []int32) bool {
	free := p.total - p.used
	for _, id := range hits {
		if p.blocks[id].ref == 0 {
			free--
		}
	}
	return n <= free
}

// touch takes a reference on cached blocks, taking evictable ones off the
// LRU list.
func (p *blockPool) touch(ids []int32) {
	for _, id := range ids {
		b := &p.blocks[id]
		if b.ref == 0 {
			p.lruRemove(id)
			p.used++
		}
		b.ref++
	}
}

func (p *blockPool) alloc(n int) ([]int32, bool) {
	if n <= 0 {
		return nil, true
	}
	if p.total-p.used < n {
		return nil, false
	}
	out := make([]int32, 0, n)
	for len(out) < n {
		var id int32
		switch {
		case len(p.free) > 0:
			id = p.free[len(p.free)-1]
			p.free = p.free[:len(p.free)-1]
		case len(p.blocks) < p.total:
			id = int32(len(p.blocks))
			p.blocks = append(p.blocks, kvBlock{prev: -1, next: -1})
		default:
			id = p.lruHead
			p.lruRemove(id)
			p.evict(id)
		}
		p.blocks[id].ref = 1
		out = append(out, id)
	}
	p.used += n
	return out, true
}

// release drops one reference on each block. Uncached blocks go back to the
// free list; cached ones become evictable, the request's last block first.
func (p *blockPool) release(ids []int32) {
	for _, id := range ids {
		b := &p.blocks[id]
		if b.ref--; b.ref == 0 {
			p.used--
			if !b.hashed {
				p.free = append(p.free, id)
			}
		}
	}
	for i := len(ids) - 1; i >= 0; i-- {
		b := &p.blocks[ids[i]]
		if b.ref == 0 && b.hashed && !b.inLRU {
			p.lruAppend(ids[i])
		}
	}
}

// insert registers block id under hash.
func (p *blockPool) insert(id int32, h BlockHash) {
	b := &p.blocks[id]
	if b.hashed {
		return
	}
	b.hashed, b.hash = true, h
	p.cache[h] = append(p.cache[h], id)
	p.cachedBlocks++
}

// evict drops block id's hash from the cache and reports it removed.
func (p *blockPool) evict(id int32) {
	b := &p.blocks[id]
	if !b.hashed {
		return
	}
	ids := p.cache[b.hash]
	// Blocks holding one hash are kept in insertion order (cachedBlock
	// hits the oldest, as vLLM's dict of them does) and the LRU evicts
	// mostly the oldest: that one is dropped without copying the rest. A
	// hash many finished requests produced (one output to a repeated
	// prompt) can be held by thousands of blocks, and a copy per eviction
	// made a full cache several times slower (docs/BENCHMARKS.md §31).
	switch i := slices.Index(ids, id); {
	case i == 0:
		ids = ids[1:]
	case i > 0:
		ids = append(ids[:i], ids[i+1:]...)
	}
	if len(ids) == 0 {
		delete(p.cache, b.hash)
	} else {
		p.cache[b.hash] = ids
	}
	if p.emit {
		p.events = append(p.events, KVEvent{Kind: BlockRemoved, Hashes: []BlockHash{b.hash}})
	}
	b.hashed = false
	p.cachedBlocks--
	p.evictions++
}

// reset drops every cached block; it fails while any block is in use.
func (p *blockPool) reset() bool {
	if p.used > 0 {
		return false
	}
	for id := p.lruHead; id >= 0; {
		next := p.blocks[id].next
		b := &p.blocks[id]
		b.inLRU, b.prev, b.next, b.hashed = false, -1, -1, false
		p.free = append(p.free, id)
		id = next
	}
	p.lruHead, p.lruTail = -1, -1
	clear(p.cache)
	p.cachedBlocks = 0
	if p.emit {
		p.events = append(p.events, KVEvent{Kind: AllBlocksCleared})
	}
	return true
}

func (p *blockPool) lruAppend(id int32) {
	b := &p.blocks[id]
	b.inLRU, b.prev, b.next = true, p.lruTail, -1
	if p.lruTail >= 0 {
		p.blocks[p.lruTail].next = id
	} else {
		p.lruHead = id
	}
	p.lruTail = id
}

func (p *blockPool) lruRemove(id int32) {
	b := &p.blocks[id]
	if !b.inLRU {
		return
	}
	if b.prev >= 0 {
		p.blocks[b.prev].next = b.next
	} else {
		p.lruHead = b.next
	}
	if b.next >= 0 {
		p.blocks[b.next].prev = b.prev
	} else {
		p.lruTail = b.prev
	}
	b.inLRU, b.prev, b.next = false, -1, -1
}
