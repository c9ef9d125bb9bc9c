package kvevents

import (
	"encoding/binary"
	"math"
	"math/bits"
	"slices"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// Index maps prefix blocks to the workers that hold them, from the events
// each worker publishes. A block is keyed by a chained hash of token ids
// the router computes itself (BlockKeys), so a request's prompt tokens are
// looked up with no knowledge of the engine's own hash function; the
// engine's hashes only resolve a stored block's parent and a removal.
//
// Memory is bounded by MaxEntries (one entry per block per worker); stores
// past the bound are dropped and counted. Safe for concurrent use.
type Index struct {
	blockSize int
	seed      uint64
	root0     uint64 // root of the chain without LoRA
	max       int

	mu      sync.RWMutex
	loras   map[string]struct{} // LoRA names stored blocks were keyed with
	blocks  map[uint64]holders  // block key → ids of the workers holding it
	workers map[string]*workerBlocks
	byID    map[int32]string
	nextID  int32
	entries int
	stats   IndexStats
}

// IndexStats counts what the index did with the events it was given.
type IndexStats struct {
	Stored, Removed, Cleared uint64 // blocks stored, removed; clears
	Orphans                  uint64 // stored blocks whose parent was unknown
	BlockSizeMismatch        uint64 // stored events of another block size
	Full                     uint64 // stores dropped at MaxEntries
	// Unindexed: blocks stored in a KV cache group the index does not
	// follow (sliding-window, Mamba, ... groups of a hybrid model) or
	// whose hashes do not say which tokens they are for (Masked).
	Unindexed uint64
	// Restated: blocks a sequence's first-block store named again while
	// held (vLLM's reuse reports, kv_cache_report_mode "full"): not
	// counted as copies.
	Restated uint64
}

// holders are the ids (from 1) of the workers holding a block: the first
// inline (most blocks have one holder: no allocation per block), the
// others in a slice.
type holders struct {
	one  int32
	more []int32
}

func (h holders) has(id int32) bool { return h.one == id || slices.Contains(h.more, id) }

func (h holders) n() int {
	if h.one == 0 {
		return 0
	}
	return 1 + len(h.more)
}

func (h holders) at(i int) int32 {
	if i == 0 {
		return h.one
	}
	return h.more[i-1]
}

type workerBlocks struct {
	id     int32
	engine map[Hash]blockRef // engine hash → router key and media
	stored uint64            // blocks ever stored (a new entry each)
	// evicted: a BlockRemoved of a GPU copy arrived since the last clear
	// (Evicting).
	evicted bool
	// groups: what the index knows of the worker's KV cache groups, by
	// group_idx: followed (a prefix-complete kind) or not. nil until a
	// store names a group's kind.
	groups map[int]bool
}

// followed reports whether the index follows the blocks of KV cache group
// g, learning its kind from a store that names it. Only groups whose every
// block a prefix hit needs are followed (full attention, MLA, attention
// with sinks): a prompt's cached prefix on a hybrid model is what its
// full-attention groups hold (a sliding-window group needs only the blocks
// of its window before the hit, a Mamba group its state at one block, and
// they evict on their own, so their removals would wrongly cut the
// prefix). A group with no kind said is followed (an engine of one group,
// or one from before vLLM named kinds), unless a store showed the worker
// has groups the index does not follow.
func (w *workerBlocks) followed(g int, kind string) bool {
	if g < 0 {
		return true
	}
	if kind != "" {
		f := prefixKind(kind)
		if w.groups == nil {
			w.groups = map[int]bool{}
		}
		if len(w.groups) < maxGroups {
			w.groups[g] = f
		}
		return f
	}
	if f, ok := w.groups[g]; ok {
		return f
	}
	for _, f := range w.groups {
		if !f {
			return false // a hybrid model: an unnamed group may be any kind
		}
	}
	return true
}

// maxGroups bounds the groups remembered per worker (a model has a few).
const maxGroups = 64

// prefixKind reports whether a KV cache spec kind needs every block of a
// prefix for a hit.
func prefixKind(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

type blockRef struct {
	key   uint64
	media uint8 // bit per medium (GPU, CPU, STORAGE, other)
	// copies per medium (index = bit position): an engine can hold one
	// hash in several blocks (two requests computed the same prefix at
	// once), and vLLM reports each: a BlockStored per block cached, a
	// BlockRemoved per block evicted (vllm/v1/core/block_pool.py
	// cache_full_blocks, _maybe_evict_cached_block). The hash stays
	// cached until its last copy goes. Saturates at 255.
	copies [4]uint8
}

// add counts one more copy in the medium of bit.
func (r *blockRef) add(bit uint8) {
	i := bits.TrailingZeros8(bit)
	if r.copies[i] < math.MaxUint8 {
		r.copies[i]++
	}
	r.media |= bit
}

// sub counts one copy fewer in the medium of bit.
func (r *blockRef) sub(bit uint8) {
	i := bits.TrailingZeros8(bit)
	if r.copies[i] > 0 {
		r.copies[i]--
	}
	if r.copies[i] == 0 {
		r.media &^= bit
	}
}

// IndexOptions configures NewIndex.
type IndexOptions struct {
	BlockSize  int    // tokens per block; must match the engines' (16)
	Seed       uint64 // seed of the router's chained block hash (0)
	MaxEntries int    // blocks × workers kept at most (10,000,000)
}

// NewIndex returns an empty index.
func NewIndex(o IndexOptions) *Index {
	if o.BlockSize <= 0 {
		o.BlockSize = 16
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = 10_000_000
	}
	x := &Index{blockSize: o.BlockSize, seed: o.Seed, max: o.MaxEntries, loras: map[string]struct{}{},
		blocks: map[uint64]holders{}, workers: map[string]*workerBlocks{}, byID: map[int32]string{}}
	x.root0 = x.rootOf("", "")
	return x
}

// BlockSize is the tokens per block the index was built for.
func (x *Index) BlockSize() int { return x.blockSize }

// BlockKeys returns the chained key of every full block of tokens: key i
// hashes key i-1 (or the seed and the LoRA name for the first block) and
// the block's token ids.
func (x *Index) BlockKeys(tokens []uint32, lora string) []uint64 {
	return x.SaltedBlockKeys(tokens, lora, "")
}

// SaltedBlockKeys is BlockKeys for a request with a cache_salt, which
// vLLM mixes into its first block's hash (and so into every later one).
func (x *Index) SaltedBlockKeys(tokens []uint32, lora, salt string) []uint64 {
	n := len(tokens) / x.blockSize
	keys := make([]uint64, n)
	prev := x.root(lora, salt)
	buf := make([]byte, 8+4*x.blockSize)
	for i := range n {
		prev = x.chain(buf, prev, tokens[i*x.blockSize:(i+1)*x.blockSize])
		keys[i] = prev
	}
	return keys
}

func (x *Index) root(lora, salt string) uint64 {
	if lora == "" && salt == "" {
		return x.root0
	}
	return x.rootOf(lora, salt)
}

// rootOf hashes the seed, the LoRA name and, when there is one, 0xff (a
// byte no UTF-8 string holds, so no pair of names runs into another) and
// the salt.
func (x *Index) rootOf(lora, salt string) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], x.seed)
	d := xxhash.New()
	_, _ = d.Write(b[:])
	_, _ = d.WriteString(lora)
	if salt != "" {
		_, _ = d.Write([]byte{0xff})
		_, _ = d.WriteString(salt)
	}
	return d.Sum64()
}

// opaque is the key of a block whose hash mixes in keys the router cannot
// compute from a request (BlockExtra.Opaque): derived from the key its
// tokens would have, by a step no request's keys take.
func opaque(key uint64) uint64 {
	var b [9]byte
	binary.LittleEndian.PutUint64(b[:], key)
	b[8] = 0xff
	return xxhash.Sum64(b[:])
}

func (x *Index) chain(buf []byte, prev uint64, block []uint32) uint64 {
	binary.LittleEndian.PutUint64(buf, prev)
	for j, t := range block {
		binary.LittleEndian.PutUint32(buf[8+4*j:], t)
	}
	return xxhash.Sum64(buf[:8+4*len(block)])
}

// gpuBit is mediumBit of the engine's own (GPU) cache.
const gpuBit = 1

func mediumBit(m string) uint8 {
	switch m {
	case "", "GPU", "gpu":
		return gpuBit
	case "CPU", "cpu":
		return 2
	case "STORAGE", "storage":
		return 4
	}
	return 8
}

// Apply records one worker's events, in order.
func (x *Index) Apply(worker string, events []Event) {
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.workerLocked(worker)
	for _, e := range events {
		switch e := e.(type) {
		case BlockStored:
			x.storeLocked(w, e)
		case BlockRemoved:
			if !w.followed(e.Group, "") {
				continue
			}
			bit := mediumBit(e.Medium)
			for _, h := range e.BlockHashes {
				x.removeLocked(w, h, bit)
			}
		case AllBlocksCleared:
			x.stats.Cleared++
			x.clearLocked(w)
		}
	}
}

func (x *Index) workerLocked(worker string) *workerBlocks {
	w := x.workers[worker]
	if w == nil {
		x.nextID++
		w = &workerBlocks{id: x.nextID, engine: map[Hash]blockRef{}}
		x.workers[worker] = w
		x.byID[w.id] = worker
	}
	return w
}

func (x *Index) storeLocked(w *workerBlocks, e BlockStored) {
	if !w.followed(e.Group, e.Kind) || e.Masked() {
		x.stats.Unindexed += uint64(len(e.BlockHashes))
		return
	}
	if e.BlockSize != x.blockSize {
		x.stats.BlockSizeMismatch += uint64(len(e.BlockHashes))
		return
	}
	x.noteLoRALocked(e.LoRAName)
	prev := x.root(e.LoRAName, "")
	if len(e.Extra) > 0 && e.Parent == 0 {
		prev = x.root(e.LoRAName, e.Extra[0].Salt)
	}
	if e.Parent != 0 {
		p, ok := w.engine[e.Parent]
		if !ok {
			x.stats.Orphans += uint64(len(e.BlockHashes))
			return
		}
		prev = p.key
	}
	bit := mediumBit(e.Medium)
	buf := make([]byte, 8+4*x.blockSize)
	for i, h := range e.BlockHashes {
		prev = x.chain(buf, prev, e.TokenIDs[i*x.blockSize:(i+1)*x.blockSize])
		if len(e.Extra) > 0 && e.Extra[i].Opaque {
			prev = opaque(prev)
		}
		ref, had := w.engine[h]
		if had && ref.key == prev && e.Parent == 0 && ref.media&bit != 0 {
			// A sequence restated from its first block while held: vLLM's
			// reuse report (emit_cached_block_events: the prefix a request
			// hit, no new block), or the same prompt computed twice at once
			// (a new copy). Taken as the report: counting it as a copy
			// would keep the block here after its only eviction, for good;
			// not counting a copy forgets the block at its first eviction,
			// until it is stored again.
			x.stats.Restated++
			continue
		}
		if had && ref.key == prev {
			ref.add(bit)
			w.engine[h] = ref
			continue
		}
		if had { // the engine reused a hash for other tokens: replace it
			x.dropLocked(w, ref.key)
		}
		if x.entries >= x.max {
			x.stats.Full += uint64(len(e.BlockHashes) - i)
			return
		}
		ref = blockRef{key: prev}
		ref.add(bit)
		w.engine[h] = ref
		h := x.blocks[prev]
		if h.one == 0 {
			h.one = w.id
		} else {
			h.more = append(h.more, w.id)
		}
		x.blocks[prev] = h
		x.entries++
		x.stats.Stored++
		w.stored++
	}
}

func (x *Index) removeLocked(w *workerBlocks, h Hash, bit uint8) {
	ref, ok := w.engine[h]
	if !ok {
		return
	}
	if bit == gpuBit && ref.copies[0] > 0 {
		w.evicted = true
	}
	ref.sub(bit)
	if ref.media != 0 {
		w.engine[h] = ref
		return
	}
	delete(w.engine, h)
	x.dropLocked(w, ref.key)
	x.stats.Removed++
}

// dropLocked removes w from the holders of key.
func (x *Index) dropLocked(w *workerBlocks, key uint64) {
	h, ok := x.blocks[key]
	switch {
	case !ok || !h.has(w.id):
		return
	case h.one == w.id && len(h.more) == 0:
		delete(x.blocks, key)
		x.entries--
		return
	case h.one == w.id:
		h.one = h.more[len(h.more)-1]
		h.more = h.more[:len(h.more)-1]
	default:
		i := slices.Index(h.more, w.id)
		h.more[i] = h.more[len(h.more)-1]
		h.more = h.more[:len(h.more)-1]
	}
	if len(h.more) == 0 {
		h.more = nil
	}
	x.blocks[key] = h
	x.entries--
}

func (x *Index) clearLocked(w *workerBlocks) {
	for _, ref := range w.engine {
		x.dropLocked(w, ref.key)
	}
	w.engine = map[Hash]blockRef{}
	w.evicted = false
}

// Clear drops everything known of one worker (it restarted: its cache is
// empty and its next events describe a new one).
func (x *Index) Clear(worker string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if w := x.workers[worker]; w != nil {
		x.clearLocked(w)
	}
}

// MaxLoRANames bounds the LoRA names remembered (vLLM's --max-loras is
// per engine and usually single digits; a fleet's adapters are a list an
// operator manages).
const MaxLoRANames = 4096

// NoteLoRA records name as a LoRA adapter's before any engine stored
// blocks for it (the router learned it elsewhere: a load through it, an
// engine's /v1/models).
func (x *Index) NoteLoRA(name string) {
	if name == "" {
		return
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	x.noteLoRALocked(name)
}

// noteLoRALocked records a LoRA name, up to MaxLoRANames of them (x.mu
// held for writing).
func (x *Index) noteLoRALocked(name string) {
	if _, ok := x.loras[name]; !ok && name != "" && len(x.loras) < MaxLoRANames {
		x.loras[name] = struct{}{}
	}
}

// IsLoRA reports whether name is a LoRA adapter's: some engine stored
// blocks for it, or NoteLoRA was told. vLLM names an adapter's requests by
// it (the request's model) and keys their blocks with it, so a request for
// it needs the adapter's keys (BlockKeys's lora), not the base model's.
func (x *Index) IsLoRA(name string) bool {
	if name == "" {
		return false
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	_, ok := x.loras[name]
	return ok
}

// RemoveWorker forgets a worker that left the fleet.
func (x *Index) RemoveWorker(worker string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	w := x.workers[worker]
	if w == nil {
		return
	}
	x.clearLocked(w)
	w.groups = nil
	delete(x.workers, worker)
	delete(x.byID, w.id)
}

// Match returns, for every worker holding the first block of keys, how
// many leading blocks of keys it holds.
func (x *Index) Match(keys []uint64) map[string]int {
	if len(keys) == 0 {
		return nil
	}
	x.mu.RLock()
	defer x.mu.RUnlock()
	first := x.blocks[keys[0]]
	if first.n() == 0 {
		return nil
	}
	// Workers still matching, with their depth: a handful, kept on the
	// stack.
	type held struct {
		id    int32
		depth int
	}
	var buf [16]held
	all := buf[:0]
	for i := range first.n() {
		all = append(all, held{first.at(i), 1})
	}
	alive := len(all)
	for i := 1; i < len(keys) && alive > 0; i++ {
		hs := x.blocks[keys[i]]
		alive = 0
		for j := range all {
			if all[j].depth == i && hs.has(all[j].id) {
				all[j].depth = i + 1
				alive++
			}
		}
	}
	out := make(map[string]int, len(all))
	for _, h := range all {
		out[x.byID[h.id]] = h.depth
	}
	return out
}

// Stats returns the counters and the current size.
func (x *Index) Stats() (IndexStats, int) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.stats, x.entries
}

// WorkerState is how many blocks the index holds for one worker and how
// many it ever stored for it (a running count: the events that arrived
// since an earlier reading are the difference).
func (x *Index) WorkerState(worker string) (blocks int, stored uint64) {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if w := x.workers[worker]; w != nil {
		return len(w.engine), w.stored
	}
	return 0, 0
}

// Evicting reports whether the worker's engine has evicted a block it
// held in its own (GPU) cache since the index first heard of it or last
// saw its cache cleared; an offloading tier's evictions do not count. A
// vLLM engine evicts a cached block only when no free block is left, and
// keeps every freed block cached until it is reused
// (vllm/v1/core/block_pool.py), so from then on its cache stays full: a
// new prompt replaces blocks there, however many it holds.
func (x *Index) Evicting(worker string) bool {
	x.mu.RLock()
	defer x.mu.RUnlock()
	w := x.workers[worker]
	return w != nil && w.evicted
}

// WorkerBlocks is how many blocks the index holds for one worker.
func (x *Index) WorkerBlocks(worker string) int {
	x.mu.RLock()
	defer x.mu.RUnlock()
	if w := x.workers[worker]; w != nil {
		return len(w.engine)
	}
	return 0
}
