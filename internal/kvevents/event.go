// Package kvevents decodes the KV-cache events a vLLM engine publishes
// with --kv-events-config (ZMQ PUB, msgpack KVEventBatch) and keeps an
// index of which worker holds which prefix block.
//
// Wire format (vllm/distributed/kv_events.py): every ZMQ message has three
// frames, (topic, 8-byte big-endian sequence number, payload). The payload
// is a msgspec-encoded KVEventBatch, an array [ts, events, dp_rank?]. Each
// event is tagged with its class name and comes in one of the two
// encodings vLLM has shipped:
//   - positional: an array whose first element is the tag, then the fields
//     in declaration order (array_like=True, trailing defaults omitted);
//   - named: a map with "type": tag and one entry per field (defaults
//     omitted), the encoding of vLLM PR #42892 and later.
//
// Block hashes are opaque to the router (sha256 bytes, or 64-bit ints with
// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the index keys blocks by a chained
// hash of their token ids that the router computes itself, and uses the
// engine's hashes only to resolve parents and removals.
package kvevents

import (
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/mpread"
)

// Hash is an engine block hash folded to 64 bits, so the index keys its
// maps by a machine word and decoding allocates nothing per hash: an
// integer hash (vLLM's default, the low 64 bits of its sha256) is its
// 64-bit value, a byte hash is the xxhash64 of its bytes (BytesHash). Zero
// stands for "no parent": a hash that folds to 0 is taken as 1. Two
// distinct hashes of one engine fold alike with a probability of about
// n²/2^65 for n cached blocks (3·10⁻⁸ at a million); the index would then
// misplace a block, never fail.
type Hash uint64

// BytesHash folds a byte hash (vLLM's sha256 block hashes when it
// publishes bytes) into a Hash.
func BytesHash(b []byte) Hash { return nonZero(xxhash.Sum64(b)) }

func nonZero(u uint64) Hash {
	if u == 0 {
		return 1
	}
	return Hash(u)
}

// Event is one of BlockStored, BlockRemoved, AllBlocksCleared.
type Event interface{ kind() string }

// BlockStored: the engine cached full blocks. TokenIDs holds the tokens of
// all of them, BlockSize per block; Parent is the hash of the block before
// the first one (0 for the first block of a sequence).
type BlockStored struct {
	BlockHashes []Hash
	Parent      Hash
	TokenIDs    []uint32
	BlockSize   int
	LoRAID      int64 // -1 when absent
	LoRAName    string
	Medium      string
	// Extra is what each block's hash mixes in beside its tokens (vLLM's
	// extra_keys, one entry per block): nil when no block has any.
	Extra []BlockExtra
	// Group is the KV cache group the blocks were cached in (vLLM's
	// group_idx; -1 when absent). A hybrid model (full attention beside
	// sliding-window or Mamba layers) caches every block once per group,
	// under the same hash.
	Group int
	// Kind is the group's cache spec (kv_cache_spec_kind:
	// "full_attention", "sliding_window", "mamba", ...; "" when absent).
	Kind string
}

// Masked reports whether the event does not say which tokens each of its
// hashes is for. A sliding-window or Mamba group stores only the blocks it
// can serve a hit from (vLLM's block_mask and null blocks in
// cache_full_blocks) while TokenIDs still spans the whole range; an
// offloading tier that lacks a block's metadata publishes a placeholder
// (one hash, no token ids, block size 0: the offloading connector's
// events.py _placeholder_stored).
func (e BlockStored) Masked() bool {
	return e.BlockSize == 0 || len(e.TokenIDs) != len(e.BlockHashes)*e.BlockSize
}

// BlockExtra is one block's extra hash keys as the router models them.
// vLLM publishes them untagged, in order: the LoRA name (when the event's
// lora_name is set), (mm_identifier, offset) pairs, the request's
// cache_salt (its first block only) and prompt-embeds digests
// (vllm/v1/core/kv_cache_utils.py to_event_extra_keys).
type BlockExtra struct {
	// Salt is the cache_salt the block's hash starts from ("" for none).
	Salt string
	// Opaque: keys the router cannot compute from a request (a multimodal
	// item, prompt embeddings, a shape it does not know), so no request's
	// key will ever equal the block's.
	Opaque bool
}

// BlockRemoved: the engine evicted these blocks from Medium, in KV cache
// group Group (-1 when absent).
type BlockRemoved struct {
	BlockHashes []Hash
	Medium      string
	Group       int
}

// AllBlocksCleared: the engine dropped its whole prefix cache.
type AllBlocksCleared struct{}

func (BlockStored) kind() string      { return "BlockStored" }
func (BlockRemoved) kind() string     { return "BlockRemoved" }
func (AllBlocksCleared) kind() string { return "AllBlocksCleared" }

// Kind names an event's type ("BlockStored", ...).
func Kind(e Event) string { return e.kind() }

// Batch is one KVEventBatch.
type Batch struct {
	TS     float64
	Events []Event
	DPRank int // -1 when the publisher did not say
}

// Limits on what one batch may carry, beyond the input-size bound every
// length already has (mpread checks each against the bytes left), and on
// the nesting of a value the decoder skips.
const (
	maxEventsPerBatch = 1 << 16
	maxBlockSize      = 1 << 16
	maxDepth          = 16
	maxExtraPerBlock  = 64
	maxGroup          = 1 << 16
)

// ErrUnknownEvent marks an event whose tag this decoder does not know; the
// batch's other events are still returned.
var ErrUnknownEvent = errors.New("kvevents: unknown event type")

// DecodeBatch decodes a KVEventBatch payload. Events of an unknown type
// are skipped (counted by the caller through the returned skipped count);
// any malformed structure is an error and the whole batch is dropped.
func DecodeBatch(payload []byte) (b Batch, skipped int, err error) {
	r := mpread.NewReader(payload)
	n, err := r.ArrayLen()
	if err != nil {
		return Batch{}, 0, fmt.Errorf("kvevents: batch: %w", err)
	}
	if n < 2 {
		return Batch{}, 0, fmt.Errorf("kvevents: batch has %d fields, want at least 2", n)
	}
	b.DPRank = -1
	if b.TS, err = float(r); err != nil {
		return Batch{}, 0, fmt.Errorf("kvevents: batch ts: %w", err)
	}
	ne, err := r.ArrayLen()
	if err != nil {
		return Batch{}, 0, fmt.Errorf("kvevents: batch events: %w", err)
	}
	if ne > maxEventsPerBatch {
		return Batch{}, 0, fmt.Errorf("kvevents: %d events in one batch (max %d)", ne, maxEventsPerBatch)
	}
	b.Events = make([]Event, 0, ne)
	for i := range ne {
		e, err := decodeEvent(r)
		if errors.Is(err, ErrUnknownEvent) {
			skipped++
			continue
		}
		if err != nil {
			return Batch{}, 0, fmt.Errorf("kvevents: event %d: %w", i, err)
		}
		b.Events = append(b.Events, e)
	}
	if n >= 3 {
		if !r.Nil() {
			rank, err := r.Int64()
			if err != nil || rank < 0 || rank > 1<<16 {
				return Batch{}, 0, fmt.Errorf("kvevents: batch data_parallel_rank: bad value (%v)", err)
			}
			b.DPRank = int(rank)
		}
		for range n - 3 {
			if err := r.Skip(maxDepth); err != nil {
				return Batch{}, 0, fmt.Errorf("kvevents: batch: %w", err)
			}
		}
	}
	if r.Remaining() != 0 {
		return Batch{}, 0, fmt.Errorf("kvevents: %d trailing bytes after the batch", r.Remaining())
	}
	return b, skipped, nil
}

// decodeEvent reads one event in either encoding.
func decodeEvent(r *mpread.Reader) (Event, error) {
	c, err := r.Peek()
	if err != nil {
		return nil, err
	}
	if mpread.FamilyOf(c) == mpread.Map {
		return decodeNamed(r)
	}
	return decodePositional(r)
}

// field decoders shared by both encodings, by field name.
type fieldSet struct {
	hashes    []Hash
	parent    Hash
	tokens    []uint32
	blockSize int
	loraID    int64
	loraName  string
	medium    string
	extra     []rawExtra
	group     int // -1: absent
	kind      string
}

// rawExtra is one block's extra_keys entry as read, before the LoRA name
// (which decides how to read the strings) is known: in the named encoding
// lora_name may come after extra_keys.
type rawExtra struct {
	present bool
	strs    int    // string items
	first   string // the first two string items
	second  string
	opaque  bool // an item that is not a string
}

// read decodes the field called name (a string conversion in a switch
// allocates nothing).
func (f *fieldSet) read(r *mpread.Reader, name []byte) error {
	var err error
	switch string(name) {
	case "block_hashes":
		f.hashes, err = readHashes(r)
	case "parent_block_hash":
		f.parent, err = readOptHash(r)
	case "token_ids":
		f.tokens, err = readTokens(r)
	case "block_size":
		var v int64
		v, err = r.Int64()
		if err == nil && (v < 0 || v > maxBlockSize) {
			err = fmt.Errorf("block_size %d out of range", v)
		}
		f.blockSize = int(v)
	case "lora_id":
		f.loraID = -1
		if !r.Nil() {
			f.loraID, err = r.Int64()
		}
	case "lora_name":
		f.loraName, err = readOptStr(r)
	case "medium":
		f.medium, err = readMedium(r)
	case "extra_keys":
		f.extra, err = readExtraKeys(r)
	case "group_idx":
		f.group = -1
		if !r.Nil() {
			var v int64
			v, err = r.Int64()
			if err == nil && (v < 0 || v > maxGroup) {
				err = fmt.Errorf("group_idx %d out of range", v)
			}
			f.group = int(v)
		}
	case "kv_cache_spec_kind":
		f.kind, err = readKind(r)
	default:
		err = r.Skip(maxDepth)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// Field order of the positional encoding (vLLM's declaration order).
var (
	storedFields = fieldNames("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
		"extra_keys", "group_idx", "kv_cache_spec_kind")
	removedFields = fieldNames("block_hashes", "medium", "group_idx")
)

func fieldNames(names ...string) [][]byte {
	out := make([][]byte, len(names))
	for i, n := range names {
		out[i] = []byte(n)
	}
	return out
}

func decodePositional(r *mpread.Reader) (Event, error) {
	n, err := r.ArrayLen()
	if err != nil {
		return nil, err
	}
	if n < 1 {
		return nil, errors.New("empty event array")
	}
	tagb, err := r.Str()
	if err != nil {
		return nil, fmt.Errorf("event tag: %w", err)
	}
	f := fieldSet{loraID: -1, group: -1}
	var names [][]byte
	var tag string
	switch string(tagb) {
	case "BlockStored":
		names, tag = storedFields, "BlockStored"
	case "BlockRemoved":
		names, tag = removedFields, "BlockRemoved"
	case "AllBlocksCleared":
		tag = "AllBlocksCleared"
	default:
		for range n - 1 {
			if err := r.Skip(maxDepth); err != nil {
				return nil, err
			}
		}
		return nil, fmt.Errorf("%w %q", ErrUnknownEvent, tagb)
	}
	for i := 1; i < n; i++ {
		var name []byte
		if i-1 < len(names) {
			name = names[i-1]
		}
		if err := f.read(r, name); err != nil {
			return nil, err
		}
	}
	return f.event(tag, n-1)
}

func decodeNamed(r *mpread.Reader) (Event, error) {
	n, err := r.MapLen()
	if err != nil {
		return nil, err
	}
	f := fieldSet{loraID: -1, group: -1}
	var tag []byte
	seen := 0
	for range n {
		k, err := r.Str()
		if err != nil {
			return nil, fmt.Errorf("event key: %w", err)
		}
		if string(k) == "type" {
			if tag, err = r.Str(); err != nil {
				return nil, fmt.Errorf("event type: %w", err)
			}
			continue
		}
		if err := f.read(r, k); err != nil {
			return nil, err
		}
		switch string(k) {
		case "block_hashes", "token_ids", "block_size":
			seen++
		}
	}
	switch string(tag) {
	case "BlockStored":
		if seen < 3 {
			return nil, errors.New("BlockStored without block_hashes, token_ids or block_size")
		}
		return f.event("BlockStored", len(storedFields))
	case "BlockRemoved":
		return f.event("BlockRemoved", len(removedFields))
	case "AllBlocksCleared":
		return f.event("AllBlocksCleared", len(removedFields))
	case "":
		return nil, errors.New("event map without a type")
	}
	return nil, fmt.Errorf("%w %q", ErrUnknownEvent, tag)
}

// event builds and validates the tagged event from its fields; nfields is
// how many positional fields were present.
func (f *fieldSet) event(tag string, nfields int) (Event, error) {
	switch tag {
	case "BlockStored":
		if nfields < 4 {
			return nil, fmt.Errorf("BlockStored has %d fields, want at least 4", nfields)
		}
		if len(f.hashes) == 0 {
			return nil, errors.New("BlockStored without block hashes")
		}
		// A masked store (Masked) has fewer hashes than blocks of tokens; a
		// placeholder has no tokens and block size 0.
		if f.blockSize == 0 && len(f.tokens) != 0 || f.blockSize != 0 && (len(f.tokens)%f.blockSize != 0 || len(f.tokens) < len(f.hashes)*f.blockSize) {
			return nil, fmt.Errorf("BlockStored: %d token ids for %d blocks of %d", len(f.tokens), len(f.hashes), f.blockSize)
		}
		extra, err := f.blockExtra()
		if err != nil {
			return nil, err
		}
		return BlockStored{BlockHashes: f.hashes, Parent: f.parent, TokenIDs: f.tokens, BlockSize: f.blockSize,
			LoRAID: f.loraID, LoRAName: f.loraName, Medium: f.medium, Extra: extra, Group: f.group, Kind: f.kind}, nil
	case "BlockRemoved":
		return BlockRemoved{BlockHashes: f.hashes, Medium: f.medium, Group: f.group}, nil
	}
	return AllBlocksCleared{}, nil
}

func readHash(r *mpread.Reader) (Hash, error) {
	c, err := r.Peek()
	if err != nil {
		return 0, err
	}
	if f := mpread.FamilyOf(c); f == mpread.Int || f == mpread.Uint {
		// A negative integer is its two's-complement bit pattern.
		u, _, err := r.Integer()
		if err != nil {
			return 0, err
		}
		return nonZero(u), nil
	}
	s, _, err := r.StrOrBin()
	if err != nil {
		return 0, err
	}
	if len(s) == 0 {
		return 0, errors.New("empty block hash")
	}
	return BytesHash(s), nil
}

func readOptHash(r *mpread.Reader) (Hash, error) {
	if r.Nil() {
		return 0, nil
	}
	return readHash(r)
}

func readHashes(r *mpread.Reader) ([]Hash, error) {
	n, err := r.ArrayLen()
	if err != nil {
		return nil, err
	}
	hs := make([]Hash, n)
	for i := range hs {
		if hs[i], err = readHash(r); err != nil {
			return nil, err
		}
	}
	return hs, nil
}

func readTokens(r *mpread.Reader) ([]uint32, error) {
	n, err := r.ArrayLen()
	if err != nil {
		return nil, err
	}
	ts := make([]uint32, n)
	for i := range ts {
		u, neg, err := r.Integer()
		if err != nil {
			return nil, err
		}
		if neg || u > 1<<32-1 {
			return nil, errors.New("token id out of range")
		}
		ts[i] = uint32(u)
	}
	return ts, nil
}

func readOptStr(r *mpread.Reader) (string, error) {
	if r.Nil() {
		return "", nil
	}
	return str(r)
}

func str(r *mpread.Reader) (string, error) {
	s, err := r.Str()
	return string(s), err
}

// readMedium reads an optional medium; vLLM's own names ("GPU", "CPU")
// come without a copy of their own: one comes with every event.
func readMedium(r *mpread.Reader) (string, error) {
	if r.Nil() {
		return "", nil
	}
	b, err := r.Str()
	switch {
	case err != nil:
		return "", err
	case string(b) == "GPU":
		return "GPU", nil
	case string(b) == "CPU":
		return "CPU", nil
	}
	return string(b), nil
}

// readKind reads an optional kv_cache_spec_kind; vLLM's own names come
// without a copy of their own (one comes with every store).
func readKind(r *mpread.Reader) (string, error) {
	if r.Nil() {
		return "", nil
	}
	b, err := r.Str()
	if err != nil {
		return "", err
	}
	for _, k := range specKinds {
		if string(b) == k {
			return k, nil
		}
	}
	return string(b), nil
}

// specKinds are vLLM 0.32's KVCacheSpecKind values
// (vllm/v1/kv_cache_interface.py).
var specKinds = [...]string{"full_attention", "mla_attention", "sliding_window", "sliding_window_mla", "mamba",
	"chunked_local_attention", "sink_full_attention", "encoder_only_attention", "cross_attention", "unknown"}

// float reads a float, or an integer as one: msgspec writes integral
// floats as floats, but be lenient.
func float(r *mpread.Reader) (float64, error) {
	if c, err := r.Peek(); err == nil && mpread.FamilyOf(c) == mpread.Float {
		return r.Float()
	}
	v, err := r.Int64()
	return float64(v), err
}

// readExtraKeys reads extra_keys: null, or an array with one entry per
// block, each null or an array of untagged keys.
func readExtraKeys(r *mpread.Reader) ([]rawExtra, error) {
	if r.Nil() {
		return nil, nil
	}
	n, err := r.ArrayLen()
	if err != nil {
		return nil, err
	}
	var out []rawExtra
	for i := range n {
		if r.Nil() {
			continue
		}
		if out == nil {
			out = make([]rawExtra, n)
		}
		if out[i], err = readExtraEntry(r); err != nil {
			return nil, fmt.Errorf("block %d: %w", i, err)
		}
	}
	return out, nil
}

func readExtraEntry(r *mpread.Reader) (rawExtra, error) {
	m, err := r.ArrayLen()
	if err != nil {
		return rawExtra{}, err
	}
	if m > maxExtraPerBlock {
		return rawExtra{}, fmt.Errorf("%d extra keys (max %d)", m, maxExtraPerBlock)
	}
	e := rawExtra{present: true}
	for range m {
		c, err := r.Peek()
		if err != nil {
			return rawExtra{}, err
		}
		if mpread.FamilyOf(c) != mpread.Str {
			e.opaque = true // an (mm_identifier, offset) pair, a digest
			if err := r.Skip(maxDepth); err != nil {
				return rawExtra{}, err
			}
			continue
		}
		s, err := r.Str()
		if err != nil {
			return rawExtra{}, err
		}
		switch e.strs {
		case 0:
			e.first = string(s)
		case 1:
			e.second = string(s)
		}
		e.strs++
	}
	return e, nil
}

// blockExtra interprets the extra keys read, one per block: a string item
// is the LoRA name when the event names one (first), then the salt; a
// salt may only start a sequence (vLLM adds it to the block at token 0).
func (f *fieldSet) blockExtra() ([]BlockExtra, error) {
	if f.extra == nil {
		return nil, nil
	}
	if len(f.extra) != len(f.hashes) {
		return nil, fmt.Errorf("BlockStored: %d extra_keys entries for %d blocks", len(f.extra), len(f.hashes))
	}
	out := make([]BlockExtra, len(f.extra))
	for i, e := range f.extra {
		if !e.present {
			continue
		}
		strs, first := e.strs, e.first
		if f.loraName != "" && strs > 0 && first == f.loraName {
			strs, first = strs-1, e.second
		}
		out[i].Opaque = e.opaque || strs > 1 || (strs == 1 && (i > 0 || f.parent != 0))
		if strs == 1 && !out[i].Opaque {
			out[i].Salt = first
		}
	}
	return out, nil
}
