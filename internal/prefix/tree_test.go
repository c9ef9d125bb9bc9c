package prefix

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
	"unsafe"
)

// check verifies the package invariants and returns the first violation.
func (t *Tree) check() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	sizes := make([]int, len(t.tenants))
	var walk func(n *node, depth int) error
	walk = func(n *node, depth int) error {
		if n != t.root {
			if n.text == "" {
				return fmt.Errorf("empty non-root node at depth %d", depth)
			}
			if len(n.tenants) == 0 {
				return fmt.Errorf("tenantless node %q", n.text)
			}
			if n.runes != utf8.RuneCountInString(n.text) {
				return fmt.Errorf("node %q: runes %d want %d", n.text, n.runes, utf8.RuneCountInString(n.text))
			}
			if h, _ := headOf(n.text); h != n.head {
				return fmt.Errorf("node %q: stale head", n.text)
			}
			for _, e := range n.tenants {
				if !n.parent.has(e.id) {
					return fmt.Errorf("node %q: tenant %d missing on parent", n.text, e.id)
				}
				sizes[e.id] += n.runes
			}
		}
		seen := map[uint32]bool{}
		for _, c := range n.children {
			if c.parent != n {
				return fmt.Errorf("node %q: bad parent link", c.text)
			}
			if seen[c.head] {
				return fmt.Errorf("node %q: two children start with %x", n.text, c.head)
			}
			seen[c.head] = true
			if err := walk(c, depth+1); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(t.root, 0); err != nil {
		return err
	}
	for id, x := range t.tenants {
		if sizes[id] != x.chars {
			return fmt.Errorf("tenant %q: size %d, nodes hold %d", x.key, x.chars, sizes[id])
		}
	}
	return nil
}

func mustCheck(t testing.TB, tr *Tree) {
	t.Helper()
	if err := tr.check(); err != nil {
		t.Fatal(err)
	}
}

func TestMatchLongestThenMostRecent(t *testing.T) {
	tr := New()
	a, b, c := tr.Tenant("a"), tr.Tenant("b"), tr.Tenant("c")
	tr.Insert("hello world", a)
	tr.Insert("hello there", b)
	tr.Insert("hello", c)
	mustCheck(t, tr)

	tests := []struct {
		name    string
		text    string
		accept  func(TenantID) bool
		want    TenantID
		matched int
	}{
		{"longest wins", "hello world!", nil, a, 11},
		{"other branch", "hello there, friend", nil, b, 11},
		{"shared prefix, most recent", "hello", nil, c, 5},
		{"partial node match", "hello wo", nil, a, 8},
		{"diverges inside shared node", "help", nil, c, 3},
		{"filter drops the longest", "hello world", func(id TenantID) bool { return id != a }, b, 6},
		{"no match", "xyz", nil, c, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := tr.Match(tt.text, tt.accept)
			if !m.Found || m.Tenant != tt.want || m.Matched != tt.matched {
				t.Fatalf("Match(%q) = %+v, want tenant %d matched %d", tt.text, m, tt.want, tt.matched)
			}
			if m.Total != utf8.RuneCountInString(tt.text) {
				t.Fatalf("Total %d", m.Total)
			}
		})
	}
}

func TestMatchCountsCharactersNotBytes(t *testing.T) {
	tr := New()
	id := tr.Tenant("w")
	tr.Insert("héllo wörld", id)
	m := tr.Match("héllo wörld, again", nil)
	if m.Matched != 11 || m.Total != 18 {
		t.Fatalf("got %+v", m)
	}
	if got := tr.Size(id); got != 11 {
		t.Fatalf("size %d want 11", got)
	}
	// A multi-byte character that differs only in its last byte must not
	// count as a partial match.
	tr.Insert("é", id)
	m = tr.Match("è", nil)
	if m.Matched != 0 {
		t.Fatalf("é vs è matched %d", m.Matched)
	}
	mustCheck(t, tr)
}

func TestInsertDoesNotAliasCallerString(t *testing.T) {
	tr := New()
	id := tr.Tenant("w")
	big := strings.Repeat("x", 1<<20)
	tr.Insert(big[:10], id)
	tr.mu.Lock()
	leaf := tr.root.children[0]
	tr.mu.Unlock()
	if leaf.text != big[:10] {
		t.Fatal("wrong text")
	}
	if sameData(leaf.text, big) {
		t.Fatal("leaf text aliases the inserted string")
	}
}

// sameData reports whether a's bytes lie inside b's.
func sameData(a, b string) bool {
	pa, pb := uintptr(unsafe.Pointer(unsafe.StringData(a))), uintptr(unsafe.Pointer(unsafe.StringData(b)))
	return pa >= pb && pa < pb+uintptr(len(b))
}

func TestEvictLRU(t *testing.T) {
	tr := New()
	a, b := tr.Tenant("a"), tr.Tenant("b")
	tr.Insert("aaaa-old", a)
	tr.Insert("aaaa-new", a)
	tr.Insert("bbbb", b)
	if got := tr.Size(a); got != 11 { // "aaaa-" + "old" + "new"
		t.Fatalf("size a = %d", got)
	}
	removed := tr.EvictTo(9)
	mustCheck(t, tr)
	if removed != 3 || tr.Size(a) != 8 || tr.Size(b) != 4 {
		t.Fatalf("removed %d, a %d, b %d", removed, tr.Size(a), tr.Size(b))
	}
	if m := tr.Match("aaaa-new", nil); m.Matched != 8 {
		t.Fatalf("recent prefix evicted: %+v", m)
	}
	if m := tr.Match("aaaa-old", nil); m.Matched != 5 {
		t.Fatalf("old prefix kept: %+v", m)
	}
	tr.EvictTo(0)
	mustCheck(t, tr)
	if tr.Size(a) != 0 || tr.Size(b) != 0 || tr.Len() != 1 {
		t.Fatalf("evict to 0 left a=%d b=%d nodes=%d", tr.Size(a), tr.Size(b), tr.Len())
	}
}

func TestEvictKeepsSharedNodesForOtherTenants(t *testing.T) {
	tr := New()
	a, b := tr.Tenant("a"), tr.Tenant("b")
	tr.Insert("shared prefix then a", a)
	tr.Insert("shared prefix then b", b)
	tr.EvictTo(0)
	mustCheck(t, tr)
	tr.Insert("shared prefix then b", b)
	tr.EvictTo(100) // no-op
	if m := tr.Match("shared prefix then b", nil); m.Tenant != b || m.Matched != 20 {
		t.Fatalf("got %+v", m)
	}
}

func TestRemoveTenant(t *testing.T) {
	tr := New()
	a, b := tr.Tenant("a"), tr.Tenant("b")
	tr.Insert("common start, a", a)
	tr.Insert("common start, b", b)
	tr.RemoveTenant("a")
	tr.RemoveTenant("missing")
	mustCheck(t, tr)
	if tr.Size(a) != 0 {
		t.Fatalf("size a = %d", tr.Size(a))
	}
	if m := tr.Match("common start, a", nil); m.Tenant != b || m.Matched != 14 {
		t.Fatalf("got %+v", m)
	}
	if tr.Tenant("a") != a || tr.Key(a) != "a" {
		t.Fatal("tenant ID not stable across removal")
	}
	tr.Insert("again", a)
	mustCheck(t, tr)
	if tr.Size(a) != 5 {
		t.Fatalf("size after re-insert %d", tr.Size(a))
	}
}

func TestCommonPrefix(t *testing.T) {
	tests := []struct {
		a, b string
		want int
	}{
		{"", "", 0},
		{"abc", "abd", 2},
		{"abc", "abc", 3},
		{"abc", "abcdef", 3},
		{"é", "è", 0},                   // C3 A9 vs C3 A8
		{"a€", "a\xe2\x82X", 1},         // valid 3-byte vs truncated
		{"\xe2\x82", "\xe2\x82\xac", 0}, // truncated vs valid
		{"\xff\xfe", "\xff\xfd", 1},     // invalid bytes are characters
		{strings.Repeat("z", 200) + "1", strings.Repeat("z", 200) + "2", 200},
	}
	for _, tt := range tests {
		if got := commonPrefix(tt.a, tt.b); got != tt.want {
			t.Errorf("commonPrefix(%q, %q) = %d want %d", tt.a, tt.b, got, tt.want)
		}
		if got := commonPrefix(tt.b, tt.a); got != tt.want {
			t.Errorf("commonPrefix(%q, %q) = %d want %d", tt.b, tt.a, got, tt.want)
		}
	}
}

func TestRandomOpsKeepInvariants(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tr := New()
	alpha := []string{"a", "b", "é", "€", "\xff", " "}
	var ids []TenantID
	for i := range 5 {
		ids = append(ids, tr.Tenant(fmt.Sprint("w", i)))
	}
	for range 3000 {
		var sb strings.Builder
		for range r.IntN(12) {
			sb.WriteString(alpha[r.IntN(len(alpha))])
		}
		s := sb.String()
		switch op := r.IntN(10); {
		case op < 6:
			tr.Insert(s, ids[r.IntN(len(ids))])
		case op < 8:
			m := tr.Match(s, nil)
			if m.Matched > m.Total {
				t.Fatalf("matched %d > total %d", m.Matched, m.Total)
			}
		case op < 9:
			max := r.IntN(20)
			tr.EvictTo(max)
			for _, id := range ids {
				if tr.Size(id) > max {
					t.Fatalf("tenant %d size %d > %d after eviction", id, tr.Size(id), max)
				}
			}
		default:
			tr.RemoveTenant(fmt.Sprint("w", r.IntN(len(ids))))
		}
		mustCheck(t, tr)
	}
}

// FuzzRadix drives a tree with arbitrary text and checks the invariants after
// every operation: match length never exceeds the text, sizes agree with the
// nodes, eviction bounds every tenant, an inserted text fully matches.
func FuzzRadix(f *testing.F) {
	f.Add("hello world", "hello there", "help", uint8(3), uint8(7))
	f.Add("é€\xff", "é€", "\xe2\x82", uint8(0), uint8(1))
	f.Add("", "a", "aa", uint8(1), uint8(0))
	f.Fuzz(func(t *testing.T, a, b, c string, max, sel uint8) {
		for _, s := range []string{a, b, c, a + b + c} {
			if countRunes(s) != utf8.RuneCountInString(s) {
				t.Fatalf("countRunes(%q) = %d, want %d", s, countRunes(s), utf8.RuneCountInString(s))
			}
		}
		tr := New()
		ids := []TenantID{tr.Tenant("x"), tr.Tenant("y")}
		texts := []string{a, b, c}
		for i, s := range texts {
			id := ids[(int(sel)>>i)&1]
			tr.Insert(s, id)
			mustCheck(t, tr)
			m := tr.Match(s, func(x TenantID) bool { return x == id })
			if !m.Found || m.Tenant != id || m.Matched != utf8.RuneCountInString(s) {
				t.Fatalf("inserted %q under %d, match = %+v", s, id, m)
			}
		}
		for _, s := range texts {
			s2 := s + a
			if m := tr.Match(s2, nil); m.Matched > m.Total || m.Total != utf8.RuneCountInString(s2) {
				t.Fatalf("match %q = %+v", s2, m)
			}
		}
		tr.EvictTo(int(max))
		mustCheck(t, tr)
		for _, id := range ids {
			if tr.Size(id) > int(max) {
				t.Fatalf("size %d > %d", tr.Size(id), max)
			}
		}
		if sel&1 == 1 {
			tr.RemoveTenant("x")
			mustCheck(t, tr)
			if tr.Size(ids[0]) != 0 {
				t.Fatal("removed tenant kept size")
			}
		}
	})
}

func promptSet(size, n int) []string {
	r := rand.New(rand.NewPCG(7, 7))
	system := strings.Repeat("You are a helpful assistant. ", size/2/29+1)[:size/2]
	out := make([]string, n)
	for i := range out {
		b := make([]byte, size-len(system))
		for j := range b {
			b[j] = byte('a' + r.IntN(26))
		}
		out[i] = system + string(b)
	}
	return out
}

func benchSizes() []int { return []int{1 << 10, 32 << 10} }

// go test -run='^$' -bench=. -benchmem ./internal/prefix | benchstat
func BenchmarkInsert(b *testing.B) {
	for _, size := range benchSizes() {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			prompts := promptSet(size, 64)
			tr := New()
			ids := []TenantID{tr.Tenant("a"), tr.Tenant("b"), tr.Tenant("c"), tr.Tenant("d")}
			b.ReportAllocs()
			b.SetBytes(int64(size))
			i := 0
			for b.Loop() {
				tr.Insert(prompts[i%len(prompts)], ids[i%len(ids)])
				i++
			}
		})
	}
}

// BenchmarkInsertNew inserts prompts the tree has not seen (a new leaf with
// half the prompt; the system-prompt half is shared). The tree is replaced
// every 256 inserts to bound memory.
func BenchmarkInsertNew(b *testing.B) {
	for _, size := range benchSizes() {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			prompts := promptSet(size, 256)
			var tr *Tree
			var id TenantID
			b.ReportAllocs()
			b.SetBytes(int64(size))
			i := 0
			for b.Loop() {
				if i%len(prompts) == 0 {
					tr = New()
					id = tr.Tenant("a")
				}
				tr.Insert(prompts[i%len(prompts)], id)
				i++
			}
		})
	}
}

func BenchmarkMatch(b *testing.B) {
	for _, size := range benchSizes() {
		b.Run(fmt.Sprintf("%dKiB", size>>10), func(b *testing.B) {
			prompts := promptSet(size, 64)
			tr := New()
			ids := []TenantID{tr.Tenant("a"), tr.Tenant("b"), tr.Tenant("c"), tr.Tenant("d")}
			for i, p := range prompts {
				tr.Insert(p, ids[i%len(ids)])
			}
			b.ReportAllocs()
			b.SetBytes(int64(size))
			i := 0
			for b.Loop() {
				if m := tr.Match(prompts[i%len(prompts)], nil); m.Matched == 0 {
					b.Fatal("no match")
				}
				i++
			}
		})
	}
}
