package tokenizer

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync"
)

// byteRunes is GPT-2's byte-to-unicode table (HuggingFace ByteLevel): the
// printable bytes map to themselves, the others to U+0100 onwards.
var byteRunes = func() [256]rune {
	var t [256]rune
	n := 0
	for b := 0; b < 256; b++ {
		if b >= '!' && b <= '~' || b >= 0xA1 && b <= 0xAC || b >= 0xAE {
			t[b] = rune(b)
		} else {
			t[b] = rune(256 + n)
			n++
		}
	}
	return t
}()

// unByteLevel turns a vocabulary token back into the bytes it stands for;
// ok is false for a token with a rune outside the table.
func unByteLevel(tok string, inv map[rune]byte) (string, bool) {
	var b strings.Builder
	for _, r := range tok {
		c, ok := inv[r]
		if !ok {
			return "", false
		}
		b.WriteByte(c)
	}
	return b.String(), true
}

const noID = ^uint32(0)

type merge struct {
	rank int32
	id   uint32
}

// bpe is a merge-rank byte-level BPE model. It works on raw bytes: the
// vocabulary is keyed by the bytes a token stands for, so a word never has
// to be mapped to GPT-2's runes.
type bpe struct {
	vocab        map[string]uint32 // raw bytes -> id
	byteID       [256]uint32       // the single-byte tokens (noID when absent)
	merges       map[uint64]merge  // (left id, right id) -> rank, merged id
	unk          uint32            // noID when there is no unk_token
	ignoreMerges bool
	byteFallback bool

	mu    sync.RWMutex
	cache map[string][]uint32
}

// cacheMax bounds the per-word cache; words longer than cacheWordMax are
// not cached.
const (
	cacheMax     = 1 << 16
	cacheWordMax = 64
)

type bpeJSON struct {
	Type                    string            `json:"type"`
	Dropout                 *float64          `json:"dropout"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	FuseUnk                 bool              `json:"fuse_unk"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  []mergeJSON       `json:"merges"`
}

// mergeJSON is a merge in either form tokenizers has written: "a b" or
// ["a", "b"].
type mergeJSON [2]string

func (m *mergeJSON) UnmarshalJSON(b []byte) error {
	var pair []string
	if err := json.Unmarshal(b, &pair); err == nil {
		if len(pair) != 2 {
			return fmt.Errorf("merge %s: want two tokens", b)
		}
		m[0], m[1] = pair[0], pair[1]
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("merge %s: want \"a b\" or [\"a\",\"b\"]", b)
	}
	a, c, ok := strings.Cut(s, " ")
	if !ok || strings.Contains(c, " ") {
		return fmt.Errorf("merge %q: want two space-separated tokens", s)
	}
	m[0], m[1] = a, c
	return nil
}

func newBPE(j *bpeJSON) (*bpe, error) {
	switch {
	case j.Type != "" && j.Type != "BPE":
		return nil, unsupported("model", j.Type)
	case j.Dropout != nil && *j.Dropout != 0:
		return nil, unsupported("model", "BPE with dropout")
	case j.ContinuingSubwordPrefix != nil && *j.ContinuingSubwordPrefix != "":
		return nil, unsupported("model", "BPE with continuing_subword_prefix")
	case j.EndOfWordSuffix != nil && *j.EndOfWordSuffix != "":
		return nil, unsupported("model", "BPE with end_of_word_suffix")
	case j.FuseUnk:
		return nil, unsupported("model", "BPE with fuse_unk")
	}
	inv := make(map[rune]byte, 256)
	for b, r := range byteRunes {
		inv[r] = byte(b)
	}
	m := &bpe{vocab: make(map[string]uint32, len(j.Vocab)), merges: make(map[uint64]merge, len(j.Merges)),
		unk: noID, ignoreMerges: j.IgnoreMerges, byteFallback: j.ByteFallback, cache: map[string][]uint32{}}
	for i := range m.byteID {
		m.byteID[i] = noID
	}
	for tok, id := range j.Vocab {
		if raw, ok := unByteLevel(tok, inv); ok {
			m.vocab[raw] = id
			if len(raw) == 1 {
				m.byteID[raw[0]] = id
			}
		}
	}
	if j.ByteFallback {
		// byte_fallback only acts on a symbol missing from the
		// vocabulary; with every byte's token present it never does.
		for _, id := range m.byteID {
			if id == noID {
				return nil, unsupported("model", "BPE with byte_fallback and byte tokens missing from the vocabulary")
			}
		}
	}
	if j.UnkToken != nil {
		id, ok := j.Vocab[*j.UnkToken]
		if !ok {
			return nil, fmt.Errorf("model: unk_token %q not in the vocabulary", *j.UnkToken)
		}
		m.unk = id
	}
	for rank, mg := range j.Merges {
		a, okA := j.Vocab[mg[0]]
		b, okB := j.Vocab[mg[1]]
		id, okN := j.Vocab[mg[0]+mg[1]]
		if !okA || !okB || !okN {
			return nil, fmt.Errorf("model: merge %q %q: token not in the vocabulary", mg[0], mg[1])
		}
		k := uint64(a)<<32 | uint64(b)
		if _, dup := m.merges[k]; !dup {
			m.merges[k] = merge{rank: int32(rank), id: id}
		}
	}
	return m, nil
}

// appendWord appends the ids of one pre-tokenized word (raw bytes). The
// caller holds m.mu for reading (see Tokenizer.appendBody); a word merged
// here is queued in sc for flush to cache.
func (m *bpe) appendWord(dst []uint32, word string, sc *scratch) []uint32 {
	if m.ignoreMerges {
		if id, ok := m.vocab[word]; ok {
			return append(dst, id)
		}
	}
	if len(word) <= cacheWordMax {
		if ids, ok := m.cache[word]; ok {
			return append(dst, ids...)
		}
	}
	if len(word) <= cacheWordMax {
		if i, ok := sc.merged[word]; ok {
			return append(dst, sc.pending[i].ids...)
		}
	}
	n := len(dst)
	dst = m.merge(dst, word, sc)
	if len(word) <= cacheWordMax && len(sc.pending) < cacheMax {
		if sc.merged == nil {
			sc.merged = map[string]int{}
		}
		word = strings.Clone(word)
		sc.merged[word] = len(sc.pending)
		// not a slice of the prompt: it would stay alive
		sc.pending = append(sc.pending, cachedWord{word, append([]uint32(nil), dst[n:]...)})
	}
	return dst
}

// flush adds the words merged during one encode to the cache.
func (m *bpe) flush(sc *scratch) {
	if len(sc.pending) == 0 {
		return
	}
	m.mu.Lock()
	for _, w := range sc.pending {
		if len(m.cache) >= cacheMax {
			break
		}
		m.cache[w.word] = w.ids
	}
	m.mu.Unlock()
	clear(sc.pending)
	sc.pending = sc.pending[:0]
	clear(sc.merged)
}

type cachedWord struct {
	word string
	ids  []uint32
}

// scratch is the per-call working memory of an encode.
type scratch struct {
	ids        []uint32
	prev, next []int32
	heap       mergeHeap
	pending    []cachedWord   // merged words not yet in the cache
	merged     map[string]int // word → index in pending
}

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

// merge runs BPE on word: each byte a symbol, then the lowest-ranked
// adjacent pair merged first, leftmost on ties (HuggingFace's order).
func (m *bpe) merge(dst []uint32, word string, sc *scratch) []uint32 {
	sc.ids, sc.prev, sc.next = sc.ids[:0], sc.prev[:0], sc.next[:0]
	for i := 0; i < len(word); i++ {
		id := m.byteID[word[i]]
		if id == noID {
			id = m.missing(word[i])
			if id == noID {
				continue // no unk token: HuggingFace drops the symbol
			}
		}
		sc.ids = append(sc.ids, id)
	}
	n := int32(len(sc.ids))
	for i := range n {
		sc.prev = append(sc.prev, i-1)
		sc.next = append(sc.next, i+1)
	}
	if n > 0 {
		sc.next[n-1] = -1
	}
	h := &sc.heap
	h.items = h.items[:0]
	for i := int32(0); i+1 < n; i++ {
		if mg, ok := m.merges[uint64(sc.ids[i])<<32|uint64(sc.ids[i+1])]; ok {
			h.push(heapItem{rank: mg.rank, pos: i, id: mg.id})
		}
	}
	for len(h.items) > 0 {
		top := h.pop()
		r := sc.next[top.pos]
		if sc.ids[top.pos] == noID || r < 0 {
			continue
		}
		mg, ok := m.merges[uint64(sc.ids[top.pos])<<32|uint64(sc.ids[r])]
		if !ok || mg.id != top.id {
			continue // stale: one side was merged since
		}
		sc.ids[top.pos] = top.id
		sc.ids[r] = noID
		nr := sc.next[r]
		sc.next[top.pos] = nr
		if nr >= 0 {
			sc.prev[nr] = top.pos
		}
		if p := sc.prev[top.pos]; p >= 0 {
			if mg, ok := m.merges[uint64(sc.ids[p])<<32|uint64(top.id)]; ok {
				h.push(heapItem{rank: mg.rank, pos: p, id: mg.id})
			}
		}
		if nr >= 0 {
			if mg, ok := m.merges[uint64(top.id)<<32|uint64(sc.ids[nr])]; ok {
				h.push(heapItem{rank: mg.rank, pos: top.pos, id: mg.id})
			}
		}
	}
	for i := int32(0); i >= 0 && i < n; i = sc.next[i] {
		dst = append(dst, sc.ids[i])
	}
	return dst
}

// missing is the id for a byte whose token is not in the vocabulary: the
// unk token, or noID (the symbol is dropped, as HuggingFace does).
func (m *bpe) missing(byte) uint32 { return m.unk }

type heapItem struct {
	rank, pos int32
	id        uint32
}

// mergeHeap is a binary min-heap on (rank, pos).
type mergeHeap struct{ items []heapItem }

func (a heapItem) less(b heapItem) bool {
	return a.rank < b.rank || a.rank == b.rank && a.pos < b.pos
}

func (h *mergeHeap) push(x heapItem) {
	h.items = append(h.items, x)
	i := len(h.items) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h.items[i].less(h.items[p]) {
			break
		}
		h.items[i], h.items[p] = h.items[p], h.items[i]
		i = p
	}
}

func (h *mergeHeap) pop() heapItem {
	top := h.items[0]
	last := len(h.items) - 1
	h.items[0] = h.items[last]
	h.items = h.items[:last]
	i := 0
	for {
		l, r, s := 2*i+1, 2*i+2, i
		if l < last && h.items[l].less(h.items[s]) {
			s = l
		}
		if r < last && h.items[r].less(h.items[s]) {
			s = r
		}
		if s == i {
			return top
		}
		h.items[i], h.items[s] = h.items[s], h.items[i]
		i = s
	}
}
