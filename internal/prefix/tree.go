// Package prefix is the multi-tenant radix tree behind the cache_aware
// policy: it remembers which prompt prefixes each worker (tenant) has seen,
// so a request can be sent where its prefix is most likely still in the KV
// cache.
//
// Text is compared in characters, i.e. the units utf8.DecodeRuneInString
// yields (invalid bytes count as one character each), never in bytes, so
// sizes and match lengths mean the same thing for ASCII and non-ASCII text.
//
// Invariants (checked by the fuzz test):
//   - Every non-root node has non-empty text, at least one tenant, and the
//     children of a node start with distinct characters.
//   - A tenant present on a node is present on every ancestor, so the set of
//     tenants that matched at least k characters shrinks as a match descends.
//   - A tenant's size is the sum of the character counts of the nodes that
//     hold it; EvictTo(max) leaves every tenant at most max characters,
//     removing least-recently-used leaves first.
//   - Stored text never aliases the caller's string (a node keeps no
//     multi-megabyte request body alive).
//
// A Tree is safe for concurrent use; every method takes one mutex.
package prefix

import (
	"container/heap"
	"strings"
	"sync"
	"unicode/utf8"
)

// TenantID identifies a tenant within one Tree. IDs are never reused: a
// removed tenant keeps its ID (with no text) so callers may cache it.
type TenantID uint32

// Match is the result of Tree.Match.
type Match struct {
	Tenant  TenantID // best accepted tenant (valid when Found)
	Found   bool     // some accepted tenant is in the tree (it may have matched 0 characters)
	Matched int      // characters of the text Tenant has already seen
	Total   int      // characters in the text
}

// Ratio is Matched/Total, 0 for empty text.
func (m Match) Ratio() float64 {
	if m.Total == 0 {
		return 0
	}
	return float64(m.Matched) / float64(m.Total)
}

type entry struct {
	id    TenantID
	epoch uint64 // last access; larger is more recent
}

type node struct {
	text     string // fragment; "" only at the root
	head     uint32 // packed bytes of the first character of text
	runes    int    // characters in text
	parent   *node
	children []*node
	tenants  []entry
}

type tenant struct {
	key   string
	chars int
}

// Tree is a multi-tenant radix tree. The zero value is not usable; call New.
type Tree struct {
	mu      sync.Mutex
	root    *node
	epoch   uint64
	ids     map[string]TenantID
	tenants []tenant
}

// New returns an empty tree.
func New() *Tree {
	return &Tree{root: &node{}, ids: map[string]TenantID{}}
}

// Tenant returns the ID of the tenant named key, registering it if needed.
func (t *Tree) Tenant(key string) TenantID {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.tenantLocked(key)
}

func (t *Tree) tenantLocked(key string) TenantID {
	if id, ok := t.ids[key]; ok {
		return id
	}
	id := TenantID(len(t.tenants))
	t.tenants = append(t.tenants, tenant{key: key})
	t.ids[key] = id
	return id
}

// Lookup returns the ID of a registered tenant.
func (t *Tree) Lookup(key string) (TenantID, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	id, ok := t.ids[key]
	return id, ok
}

// Key returns the name of a tenant ("" for an unknown ID).
func (t *Tree) Key(id TenantID) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if int(id) >= len(t.tenants) {
		return ""
	}
	return t.tenants[id].key
}

// Size returns the number of characters held for a tenant.
func (t *Tree) Size(id TenantID) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if int(id) >= len(t.tenants) {
		return 0
	}
	return t.tenants[id].chars
}

// Sizes calls fn with every tenant's key and size.
func (t *Tree) Sizes(fn func(key string, chars int)) {
	t.mu.Lock()
	ts := make([]tenant, len(t.tenants))
	copy(ts, t.tenants)
	t.mu.Unlock()
	for _, x := range ts {
		fn(x.key, x.chars)
	}
}

// Insert records that tenant id has seen text and returns the tenant's new
// size. Every node on the path is marked as just used by the tenant.
func (t *Tree) Insert(text string, id TenantID) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if int(id) >= len(t.tenants) {
		return 0
	}
	t.epoch++
	ep := t.epoch
	n := t.root
	t.touch(n, id, ep)
	rest := text
	for rest != "" {
		head, _ := headOf(rest)
		c := n.child(head)
		if c == nil {
			s := strings.Clone(rest)
			leaf := &node{text: s, head: head, runes: countRunes(s), parent: n}
			n.children = append(n.children, leaf)
			t.touch(leaf, id, ep)
			return t.tenants[id].chars
		}
		l := commonPrefix(c.text, rest)
		if l < len(c.text) {
			c = t.split(c, l)
		}
		t.touch(c, id, ep)
		rest = rest[l:]
		n = c
	}
	return t.tenants[id].chars
}

// split cuts c after l bytes (a character boundary, 0 < l < len(c.text)) and
// returns the new upper node, which inherits c's tenants. Tenant sizes do not
// change: the two parts hold exactly c's characters.
func (t *Tree) split(c *node, l int) *node {
	up := &node{
		text:     c.text[:l],
		head:     c.head,
		parent:   c.parent,
		children: []*node{c},
		tenants:  append([]entry(nil), c.tenants...),
	}
	up.runes = countRunes(up.text)
	p := c.parent
	for i, x := range p.children {
		if x == c {
			p.children[i] = up
			break
		}
	}
	c.text = c.text[l:]
	c.head, _ = headOf(c.text)
	c.runes -= up.runes
	c.parent = up
	return up
}

// touch marks n as used by id at epoch ep, adding id (and its size) if new.
func (t *Tree) touch(n *node, id TenantID, ep uint64) {
	for i := range n.tenants {
		if n.tenants[i].id == id {
			n.tenants[i].epoch = ep
			return
		}
	}
	n.tenants = append(n.tenants, entry{id: id, epoch: ep})
	t.tenants[id].chars += n.runes
}

// Match finds, among the tenants accept allows (all when accept is nil), the
// one that has seen the longest prefix of text; ties go to the most recently
// used. accept is called with the tree locked and must not call the tree.
func (t *Tree) Match(text string, accept func(TenantID) bool) Match {
	var m Match
	t.mu.Lock()
	defer t.mu.Unlock()

	// Descend as far as the text matches, remembering each node and how many
	// characters had matched once it was reached.
	type step struct {
		n       *node
		matched int
	}
	var buf [32]step
	path := append(buf[:0], step{t.root, 0})
	n, rest, matched := t.root, text, 0
	for rest != "" {
		head, _ := headOf(rest)
		c := n.child(head)
		if c == nil {
			break
		}
		l := commonPrefix(c.text, rest)
		if l == 0 {
			break
		}
		if l < len(c.text) {
			matched += countRunes(c.text[:l])
			path = append(path, step{c, matched})
			rest = rest[l:]
			break
		}
		matched += c.runes
		path = append(path, step{c, matched})
		rest = rest[l:]
		n = c
	}
	// Node sizes are precomputed, so only the unmatched tail is counted.
	m.Total = matched + countRunes(rest)

	// Deepest node first: its accepted tenants matched the most.
	for i := len(path) - 1; i >= 0; i-- {
		best, found := entry{}, false
		for _, e := range path[i].n.tenants {
			if accept != nil && !accept(e.id) {
				continue
			}
			if !found || e.epoch > best.epoch {
				best, found = e, true
			}
		}
		if found {
			m.Tenant, m.Found, m.Matched = best.id, true, path[i].matched
			return m
		}
	}
	return m
}

// EvictTo trims every tenant to at most max characters, dropping its least
// recently used leaves first, and returns the number of characters removed.
func (t *Tree) EvictTo(max int) int {
	if max < 0 {
		max = 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()

	over := false
	for _, x := range t.tenants {
		if x.chars > max {
			over = true
			break
		}
	}
	if !over {
		return 0
	}

	var h leafHeap
	var walk func(n *node)
	walk = func(n *node) {
		for _, c := range n.children {
			walk(c)
		}
		if n == t.root {
			return
		}
		for _, e := range n.tenants {
			if t.tenants[e.id].chars > max && n.leafFor(e.id) {
				h = append(h, leaf{epoch: e.epoch, n: n, id: e.id})
			}
		}
	}
	walk(t.root)
	heap.Init(&h)

	removed := 0
	for h.Len() > 0 {
		lf := heap.Pop(&h).(leaf)
		if t.tenants[lf.id].chars <= max || lf.n.parent == nil || !lf.n.has(lf.id) || !lf.n.leafFor(lf.id) {
			continue
		}
		n := lf.n
		n.drop(lf.id)
		t.tenants[lf.id].chars -= n.runes
		removed += n.runes
		p := n.parent
		if len(n.tenants) == 0 { // then n has no children either
			p.unlink(n)
		}
		if p != t.root {
			if ep, ok := p.epochOf(lf.id); ok && p.leafFor(lf.id) {
				heap.Push(&h, leaf{epoch: ep, n: p, id: lf.id})
			}
		}
	}
	return removed
}

// RemoveTenant deletes everything tenant key has seen. Its ID stays valid.
func (t *Tree) RemoveTenant(key string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	id, ok := t.ids[key]
	if !ok {
		return
	}
	var walk func(n *node)
	walk = func(n *node) {
		if !n.has(id) {
			return // nor in any descendant
		}
		for i := len(n.children) - 1; i >= 0; i-- {
			walk(n.children[i])
		}
		n.drop(id)
		if n != t.root && len(n.tenants) == 0 {
			n.parent.unlink(n)
		}
	}
	walk(t.root)
	t.tenants[id].chars = 0
}

// Len returns the number of nodes, root included (for tests and stats).
func (t *Tree) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	var count func(n *node) int
	count = func(n *node) int {
		k := 1
		for _, c := range n.children {
			k += count(c)
		}
		return k
	}
	return count(t.root)
}

func (n *node) child(head uint32) *node {
	for _, c := range n.children {
		if c.head == head {
			return c
		}
	}
	return nil
}

func (n *node) has(id TenantID) bool {
	_, ok := n.epochOf(id)
	return ok
}

func (n *node) epochOf(id TenantID) (uint64, bool) {
	for _, e := range n.tenants {
		if e.id == id {
			return e.epoch, true
		}
	}
	return 0, false
}

// leafFor reports whether n holds id and no child does.
func (n *node) leafFor(id TenantID) bool {
	for _, c := range n.children {
		if c.has(id) {
			return false
		}
	}
	return true
}

func (n *node) drop(id TenantID) {
	for i, e := range n.tenants {
		if e.id == id {
			last := len(n.tenants) - 1
			n.tenants[i] = n.tenants[last]
			n.tenants = n.tenants[:last]
			return
		}
	}
}

func (n *node) unlink(c *node) {
	for i, x := range n.children {
		if x == c {
			last := len(n.children) - 1
			n.children[i] = n.children[last]
			n.children[last] = nil
			n.children = n.children[:last]
			c.parent = nil
			return
		}
	}
}

type leaf struct {
	epoch uint64
	n     *node
	id    TenantID
}

type leafHeap []leaf

func (h leafHeap) Len() int           { return len(h) }
func (h leafHeap) Less(i, j int) bool { return h[i].epoch < h[j].epoch }
func (h leafHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)        { *h = append(*h, x.(leaf)) }
func (h *leafHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// headOf returns the first character of s packed into a uint32 (its bytes,
// big-endian), and its width. Distinct characters, including distinct invalid
// bytes, get distinct heads.
func headOf(s string) (uint32, int) {
	if s == "" {
		return 0, 0
	}
	if s[0] < utf8.RuneSelf {
		return uint32(s[0]), 1
	}
	_, w := utf8.DecodeRuneInString(s)
	var h uint32
	for i := range w {
		h = h<<8 | uint32(s[i])
	}
	return h, w
}

// commonPrefix returns the length in bytes of the longest common prefix of a
// and b that ends on a character boundary of both.
func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	i := 0
	if a[:n] != b[:n] {
		for i+64 <= n && a[i:i+64] == b[i:i+64] {
			i += 64
		}
		for i < n && a[i] == b[i] {
			i++
		}
	} else {
		i = n
	}
	if i == len(a) && i == len(b) {
		return i
	}
	// A byte that is not a UTF-8 continuation byte always starts a character
	// (a multi-byte character never swallows one), so back up to one a few
	// bytes before i and decode forward in both strings from there: the
	// decoder looks ahead up to 3 bytes, and near i those bytes can differ.
	s := max(i-4, 0)
	for s > 0 && !utf8.RuneStart(a[s]) {
		s--
	}
	for s < i {
		_, wa := utf8.DecodeRuneInString(a[s:])
		_, wb := utf8.DecodeRuneInString(b[s:])
		if wa != wb || s+wa > i {
			break
		}
		s += wa
	}
	return s
}

// countRunes is utf8.RuneCountInString (invalid bytes count one each) with
// an 8-bytes-at-a-time path for ASCII runs.
func countRunes(s string) int {
	n := 0
	for len(s) > 0 {
		if len(s) >= 8 {
			w := uint64(s[0]) | uint64(s[1])<<8 | uint64(s[2])<<16 | uint64(s[3])<<24 |
				uint64(s[4])<<32 | uint64(s[5])<<40 | uint64(s[6])<<48 | uint64(s[7])<<56
			if w&0x8080808080808080 == 0 {
				n += 8
				s = s[8:]
				continue
			}
		}
		if s[0] < utf8.RuneSelf {
			n++
			s = s[1:]
			continue
		}
		_, w := utf8.DecodeRuneInString(s)
		n++
		s = s[w:]
	}
	return n
}
