package tokenizer

import (
	"strings"
	"sync"

	"github.com/cespare/xxhash/v2"
)

// Multi-turn prompts resend their history: most of a new prompt is a
// prompt seen before. PrefixCache reuses the ids of that shared part and
// encodes only the rest, exactly.
//
// Exactness rests on cut points: a position p where the text has an ASCII
// letter at p-1, a space at p and an ASCII letter at p+1 ("x y"). At such
// a p the pipeline's output splits, Encode(a+b) = Encode(a) ++ Encode(b)
// (without the post-processor's tokens, with b starting at the space):
//
//   - the NFC normalizer: a space followed by a letter cannot compose with
//     what precedes it, nor reorder with it (both are starters);
//   - every split pattern and ByteLevel's GPT-2 split: the match holding
//     the letter at p-1 is a letter run or a contraction, which ends where
//     the letters do, at p; matching is a left-to-right walk in which a
//     match depends only on the text from its start, so the walk from p is
//     the same in a+b and in b;
//   - ByteLevel's add_prefix_space: it adds a space to a piece not
//     starting with one, and the piece at p starts with one;
//   - added tokens: none may contain a space (checked by cuttable), so no
//     match spans p, and a match ending at p ends with the letter at p-1,
//     so it must not rstrip (checked) and take the space; an lstrip token
//     after p takes whitespace back at most to p.
//
// The words between two matches are what the BPE model sees, so it too
// is unaffected. Tokenizers outside these conditions (an added token with a
// space, ByteLevel without use_regex and no Split, which makes a whole
// piece one word) are encoded whole, every time. The differential test and
// FuzzPrefixCache hold PrefixCache to Encode.
//
// The cut points of a text are the first at or after each multiple of
// cutStride bytes past the previous one, so two texts sharing a prefix
// share its cut points; the ids up to each are found by a hash of the text
// up to it and checked byte for byte against the stored text.

// cutStride is the distance between cut points a prompt is cached at.
const cutStride = 256

// PrefixCache encodes texts, reusing the ids of the longest prefix up to a
// cut point that an earlier text of the cache had. Safe for concurrent
// use.
type PrefixCache struct {
	t   *Tokenizer
	cut bool // the tokenizer allows cuts: else Encode is used whole

	mu    sync.Mutex
	m     map[uint64]cutRef
	q     []*prefixEntry // insertion order, for eviction
	head  int
	bytes int // of the entries in q[head:]
	max   int
	stats PrefixStats
	// density is ids per 1024 text bytes of the last text encoded: the
	// next text's ids are allocated at that size (with slack) so the
	// slice grows at most once, instead of doubling from a fixed guess
	// (a third of the bytes; the kv scenario's prompts have two thirds).
	density int
}

// PrefixStats counts what a PrefixCache did.
type PrefixStats struct {
	Encodes     uint64 // texts encoded
	Hits        uint64 // of those, with a cached prefix
	ReusedBytes uint64 // text bytes whose ids came from the cache
	TotalBytes  uint64 // text bytes encoded
	Evicted     uint64 // entries dropped for room
}

// prefixEntry is one encoded text: its ids (the post-processor's prefix
// included when add, its suffix not), its cut points and the number of ids
// before each.
type prefixEntry struct {
	text   string
	add    bool
	ids    []uint32
	cuts   []int
	counts []int
	keys   []uint64 // of its cut points, in the map while they point here
}

func (e *prefixEntry) size() int { return len(e.text) + 4*len(e.ids) + 32*len(e.keys) + 96 }

// cutRef is the i-th cut point of an entry.
type cutRef struct {
	e *prefixEntry
	i int
}

// NewPrefixCache returns a cache holding about maxBytes of texts and ids
// (0: 32 MiB).
func NewPrefixCache(t *Tokenizer, maxBytes int) *PrefixCache {
	if maxBytes <= 0 {
		maxBytes = 32 << 20
	}
	return &PrefixCache{t: t, cut: t.cuttable(), m: map[uint64]cutRef{}, max: maxBytes, density: 1024 / 3}
}

// Tokenizer is the tokenizer the cache encodes with.
func (c *PrefixCache) Tokenizer() *Tokenizer { return c.t }

// Stats returns the running totals.
func (c *PrefixCache) Stats() PrefixStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.stats
}

// cuttable reports whether the pipeline splits at every cut point.
func (t *Tokenizer) cuttable() bool {
	if t.split == nil && !t.regex {
		return false
	}
	for _, m := range []*matcher{&t.raw, &t.normed} {
		if m.byFirst == nil {
			continue
		}
		for _, l := range m.byFirst {
			for _, a := range l {
				last := a.content[len(a.content)-1]
				if strings.ContainsRune(a.content, ' ') || a.rstrip && isASCIILetter(last) {
					return false
				}
			}
		}
	}
	return true
}

func isASCIILetter(c byte) bool { return c|0x20 >= 'a' && c|0x20 <= 'z' }

// isCut: text[p-1:p+2] is letter, space, letter.
func isCut(text string, p int) bool {
	return p >= 1 && p+1 < len(text) && text[p] == ' ' && isASCIILetter(text[p-1]) && isASCIILetter(text[p+1])
}

// appendCuts appends the cut points of text.
func appendCuts(dst []int, text string) []int {
	for p := cutStride; p+1 < len(text); {
		i := strings.IndexByte(text[p:], ' ')
		if i < 0 {
			break
		}
		p += i
		if isCut(text, p) {
			dst = append(dst, p)
			p += cutStride
		} else {
			p++
		}
	}
	return dst
}

// Encode returns what Tokenizer.Encode returns, in a slice the cache
// keeps: the caller must not modify it.
func (c *PrefixCache) Encode(text string, addSpecial bool) []uint32 {
	t := c.t
	if !c.cut || len(text) < 2*cutStride {
		return t.Encode(text, addSpecial)
	}
	cuts := appendCuts(make([]int, 0, len(text)/cutStride), text)
	if len(cuts) == 0 {
		return t.Encode(text, addSpecial)
	}
	keys := make([]uint64, len(cuts))
	d := xxhash.New()
	if addSpecial {
		_, _ = d.WriteString("\x01")
	} else {
		_, _ = d.WriteString("\x00")
	}
	prev := 0
	for i, p := range cuts {
		_, _ = d.WriteString(text[prev:p])
		keys[i], prev = d.Sum64(), p
	}

	// The longest cached prefix. Texts agreeing up to a cut point have
	// the same cut points up to it, in the same order.
	from := 0
	var reuse *prefixEntry
	c.mu.Lock()
	density := c.density
	for i := len(cuts) - 1; i >= 0; i-- {
		r, ok := c.m[keys[i]]
		if ok && r.i == i && r.e.cuts[i] == cuts[i] && r.e.add == addSpecial && r.e.text[:cuts[i]] == text[:cuts[i]] {
			from, reuse = i+1, r.e
			break
		}
	}
	c.mu.Unlock()

	ids := make([]uint32, 0, idsCap(text, density)+len(t.pre)+len(t.suf))
	counts := make([]int, len(cuts))
	start := 0
	if reuse != nil {
		copy(counts, reuse.counts[:from])
		ids = append(ids, reuse.ids[:counts[from-1]]...)
		start = cuts[from-1]
	} else if addSpecial {
		ids = append(ids, t.pre...)
	}
	sc := scratchPool.Get().(*scratch)
	for i := from; i < len(cuts); i++ {
		ids = t.appendBody(ids, text[start:cuts[i]], sc)
		counts[i], start = len(ids), cuts[i]
	}
	ids = t.appendBody(ids, text[start:], sc)
	if cap(sc.ids) <= 1<<16 {
		scratchPool.Put(sc)
	}
	body := len(ids)
	if addSpecial {
		ids = append(ids, t.suf...)
	}
	reused := 0
	if reuse != nil {
		reused = cuts[from-1]
	}
	e := &prefixEntry{text: text, add: addSpecial, ids: ids[:body:body], cuts: cuts, counts: counts, keys: keys}
	c.store(e, reused)
	return ids
}

// idsCap is the capacity to allocate for text's ids at density ids per
// 1024 bytes: that, 1/32 more, and a little.
func idsCap(text string, density int) int {
	n := len(text) * density / 1024
	return n + n/32 + 8
}

// store records an encoded text under each of its cut points.
func (c *PrefixCache) store(e *prefixEntry, reused int) {
	size := e.size()
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(e.text) > 0 {
		c.density = int(min(int64(len(e.ids))*1024/int64(len(e.text)), 4096))
	}
	c.stats.Encodes++
	c.stats.TotalBytes += uint64(len(e.text))
	if reused > 0 {
		c.stats.Hits++
		c.stats.ReusedBytes += uint64(reused)
	}
	if size > c.max {
		return
	}
	for c.bytes+size > c.max && c.head < len(c.q) {
		c.evictHead()
	}
	for i, k := range e.keys {
		c.m[k] = cutRef{e: e, i: i}
	}
	if c.head > len(c.q)/2 {
		n := copy(c.q, c.q[c.head:])
		clear(c.q[n:])
		c.q, c.head = c.q[:n], 0
	}
	c.q = append(c.q, e)
	c.bytes += size
}

func (c *PrefixCache) evictHead() {
	e := c.q[c.head]
	c.q[c.head] = nil
	c.head++
	c.bytes -= e.size()
	c.stats.Evicted++
	for _, k := range e.keys {
		if r, ok := c.m[k]; ok && r.e == e {
			delete(c.m, k)
		}
	}
}
