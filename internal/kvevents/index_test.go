package kvevents

import (
	"fmt"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// stored builds the BlockStored event an engine would publish for the
// full blocks tokens[from:to] of one sequence, with engine hashes of its
// own ("<name>/<block index>").
func stored(name string, tokens []uint32, bs, from, to int) BlockStored {
	e := BlockStored{BlockSize: bs, LoRAID: -1, TokenIDs: tokens[from*bs : to*bs]}
	for i := from; i < to; i++ {
		e.BlockHashes = append(e.BlockHashes, hashOf(fmt.Sprintf("%s/%d", name, i)))
	}
	if from > 0 {
		e.Parent = hashOf(fmt.Sprintf("%s/%d", name, from-1))
	}
	return e
}

func TestIndexMatch(t *testing.T) {
	const bs = 4
	prompt := u32(seq(1, 40))   // 10 blocks
	other := u32(seq(1000, 40)) // unrelated
	steps := []struct {
		name   string
		worker string
		events []Event
		query  []uint32
		want   map[string]int
	}{
		{"nothing indexed", "", nil, prompt, nil},
		{"A stores 6 blocks in two events (the second through its parent)", "A",
			[]Event{stored("a", prompt, bs, 0, 4), stored("a", prompt, bs, 4, 6)}, prompt, map[string]int{"A": 6}},
		{"B stores 3 blocks", "B", []Event{stored("b", prompt, bs, 0, 3)}, prompt, map[string]int{"A": 6, "B": 3}},
		{"a partial last block is not a block", "", nil, prompt[:7], map[string]int{"A": 1, "B": 1}},
		{"other tokens match nothing", "", nil, other, nil},
		{"A evicts block 2: its prefix stops at 2", "A",
			[]Event{BlockRemoved{BlockHashes: []Hash{hashOf("a/2")}}}, prompt, map[string]int{"A": 2, "B": 3}},
		{"removal on another medium leaves the GPU copy", "B",
			[]Event{BlockRemoved{BlockHashes: []Hash{hashOf("b/0")}, Medium: "CPU"}}, prompt, map[string]int{"A": 2, "B": 3}},
		{"a store whose parent the index never saw is an orphan", "B",
			[]Event{BlockStored{BlockHashes: []Hash{hashOf("b/9")}, Parent: hashOf("b/8"), TokenIDs: prompt[36:40], BlockSize: bs, LoRAID: -1}},
			prompt, map[string]int{"A": 2, "B": 3}},
		{"another block size is not indexed", "B",
			[]Event{BlockStored{BlockHashes: []Hash{hashOf("z")}, TokenIDs: other[:8], BlockSize: 8, LoRAID: -1}}, other, nil},
		{"A clears its cache", "A", []Event{AllBlocksCleared{}}, prompt, map[string]int{"B": 3}},
	}
	x := NewIndex(IndexOptions{BlockSize: bs})
	for _, s := range steps {
		if s.events != nil {
			x.Apply(s.worker, s.events)
		}
		got := x.Match(x.BlockKeys(s.query, ""))
		if len(got) == 0 {
			got = nil
		}
		if d := cmp.Diff(s.want, got); d != "" {
			t.Fatalf("%s: match (-want +got):\n%s", s.name, d)
		}
	}
	st, n := x.Stats()
	if st.Orphans != 1 || st.BlockSizeMismatch != 1 || st.Cleared != 1 || n != 3 {
		t.Fatalf("stats %+v size %d", st, n)
	}
	x.RemoveWorker("B")
	if got := x.Match(x.BlockKeys(prompt, "")); len(got) != 0 {
		t.Fatalf("after removal: %v", got)
	}
	if _, n := x.Stats(); n != 0 {
		t.Fatalf("size %d after every worker left", n)
	}
}

func TestIndexLoRAAndSeedSeparate(t *testing.T) {
	prompt := u32(seq(1, 8))
	x := NewIndex(IndexOptions{BlockSize: 4})
	e := stored("a", prompt, 4, 0, 2)
	e.LoRAName = "sql-adapter"
	x.Apply("A", []Event{e})
	if got := x.Match(x.BlockKeys(prompt, "")); len(got) != 0 {
		t.Fatalf("base-model lookup matched LoRA blocks: %v", got)
	}
	if got := x.Match(x.BlockKeys(prompt, "sql-adapter")); got["A"] != 2 {
		t.Fatalf("LoRA lookup: %v", got)
	}
	if !x.IsLoRA("sql-adapter") || x.IsLoRA("other") || x.IsLoRA("") {
		t.Fatal("IsLoRA does not follow the stored events' LoRA names")
	}
	x.NoteLoRA("other") // learned before any block of it
	x.NoteLoRA("")
	if !x.IsLoRA("other") || x.IsLoRA("") {
		t.Fatal("IsLoRA does not follow NoteLoRA")
	}
	y := NewIndex(IndexOptions{BlockSize: 4, Seed: 7})
	if x.BlockKeys(prompt, "")[0] == y.BlockKeys(prompt, "")[0] {
		t.Fatal("the seed does not change block keys")
	}
}

// TestIndexExtraKeys: a salted sequence's blocks (the salt on its first
// block, as vLLM publishes it) match the same salt's keys only, their
// children too; a block with keys the router cannot compute (multimodal)
// and everything chained after it match nothing.
func TestIndexExtraKeys(t *testing.T) {
	const bs = 4
	prompt := u32(seq(1, 16)) // 4 blocks
	salted := func(name, lora, salt string) []Event {
		first := stored(name, prompt, bs, 0, 2)
		first.LoRAName = lora
		first.Extra = []BlockExtra{{Salt: salt}, {}}
		rest := stored(name, prompt, bs, 2, 4) // a later step: no extra keys
		rest.LoRAName = lora
		return []Event{first, rest}
	}
	x := NewIndex(IndexOptions{BlockSize: bs})
	x.Apply("A", salted("a", "", "tenant-a"))
	x.Apply("B", salted("b", "sql", "tenant-a"))
	x.Apply("C", []Event{stored("c", prompt, bs, 0, 4)})
	mm := stored("d", prompt, bs, 0, 4)
	mm.Extra = []BlockExtra{{}, {Opaque: true}, {}, {}}
	x.Apply("D", []Event{mm})
	for _, tc := range []struct {
		lora, salt string
		want       map[string]int
	}{
		{"", "", map[string]int{"C": 4, "D": 1}},
		{"", "tenant-a", map[string]int{"A": 4}},
		{"", "tenant-b", nil},
		{"sql", "tenant-a", map[string]int{"B": 4}},
		{"sql", "", nil},
	} {
		got := x.Match(x.SaltedBlockKeys(prompt, tc.lora, tc.salt))
		if len(got) == 0 {
			got = nil
		}
		if d := cmp.Diff(tc.want, got); d != "" {
			t.Errorf("lora %q salt %q (-want +got):\n%s", tc.lora, tc.salt, d)
		}
	}
	// A salt is not a LoRA name run into a prompt, nor the reverse.
	if x.SaltedBlockKeys(prompt, "ab", "")[0] == x.SaltedBlockKeys(prompt, "a", "b")[0] {
		t.Fatal("lora ab and lora a + salt b share a root")
	}
	if !slices.Equal(x.BlockKeys(prompt, "sql"), x.SaltedBlockKeys(prompt, "sql", "")) {
		t.Fatal("BlockKeys is not the unsalted SaltedBlockKeys")
	}
}

func TestIndexBounded(t *testing.T) {
	x := NewIndex(IndexOptions{BlockSize: 1, MaxEntries: 5})
	x.Apply("A", []Event{stored("a", u32(seq(0, 8)), 1, 0, 8)})
	st, n := x.Stats()
	if n != 5 || st.Full != 3 {
		t.Fatalf("size %d stats %+v", n, st)
	}
	// Evictions make room again.
	x.Apply("A", []Event{BlockRemoved{BlockHashes: []Hash{hashOf("a/4")}}})
	x.Apply("B", []Event{stored("b", u32(seq(0, 1)), 1, 0, 1)})
	if got := x.Match(x.BlockKeys(u32(seq(0, 1)), "")); got["A"] != 1 || got["B"] != 1 {
		t.Fatalf("match %v", got)
	}
}

func BenchmarkIndexMatch8k(b *testing.B) {
	const bs = 16
	prompt := u32(seq(0, 8192))
	x := NewIndex(IndexOptions{BlockSize: bs})
	for w := range 8 {
		x.Apply(fmt.Sprintf("w%d", w), []Event{stored(fmt.Sprintf("w%d", w), prompt, bs, 0, 64*(w+1))})
	}
	b.ReportAllocs()
	for b.Loop() {
		if m := x.Match(x.BlockKeys(prompt, "")); m["w7"] != 512 {
			b.Fatal(m)
		}
	}
}

// TestIndexSharedBlocks: a block held by three workers loses its holders
// in any order (the first recorded one included) and leaves no entry.
func TestIndexSharedBlocks(t *testing.T) {
	const bs = 4
	prompt := u32(seq(1, 8)) // 2 blocks
	x := NewIndex(IndexOptions{BlockSize: bs})
	for _, w := range []string{"A", "B", "C"} {
		x.Apply(w, []Event{stored(w, prompt, bs, 0, 2)})
	}
	keys := x.BlockKeys(prompt, "")
	check := func(step string, want map[string]int, entries int) {
		t.Helper()
		if got := x.Match(keys); !cmp.Equal(got, want, cmp.Comparer(func(a, b map[string]int) bool { return fmt.Sprint(a) == fmt.Sprint(b) })) {
			t.Errorf("%s: match %v, want %v", step, got, want)
		}
		if _, n := x.Stats(); n != entries {
			t.Errorf("%s: %d entries, want %d", step, n, entries)
		}
	}
	check("three holders", map[string]int{"A": 2, "B": 2, "C": 2}, 6)
	x.Apply("A", []Event{BlockRemoved{BlockHashes: []Hash{hashOf("A/1")}}})
	check("A lost its second block", map[string]int{"A": 1, "B": 2, "C": 2}, 5)
	x.Apply("A", []Event{BlockRemoved{BlockHashes: []Hash{hashOf("A/0")}}})
	x.Apply("C", []Event{BlockRemoved{BlockHashes: []Hash{hashOf("C/0")}}})
	check("A and C lost their first", map[string]int{"B": 2}, 3) // C's second block alone is no prefix
	x.RemoveWorker("B")
	x.RemoveWorker("C")
	check("B and C gone", nil, 0)
	if len(x.blocks) != 0 {
		t.Errorf("%d block keys left, want 0", len(x.blocks))
	}
}

// TestIndexCountsCopiesOfAHash: an engine that holds one hash in two
// blocks (two requests computed the same prefix at once) reports two
// BlockStored and, as each is evicted, two BlockRemoved. The hash stays
// cached, and a block stored after it is no orphan, until its last copy
// is removed; counting one copy lost the prefix at the first removal.
func TestIndexCountsCopiesOfAHash(t *testing.T) {
	const bs = 4
	x := NewIndex(IndexOptions{BlockSize: bs})
	prompt := u32(seq(1, 12))
	keys := x.BlockKeys(prompt, "")
	removed := func(h, medium string) Event { return BlockRemoved{BlockHashes: []Hash{hashOf(h)}, Medium: medium} }
	// Two requests computed block 1 at once, after the same cached block 0:
	// two copies, each evicted on its own.
	x.Apply("w", []Event{stored("a", prompt, bs, 0, 1), stored("a", prompt, bs, 1, 2), stored("a", prompt, bs, 1, 2)})
	x.Apply("w", []Event{removed("a/1", "GPU")})
	if got := x.Match(keys)["w"]; got != 2 {
		t.Fatalf("one of two copies removed: match %d, want 2", got)
	}
	x.Apply("w", []Event{stored("a", prompt, bs, 2, 3)})
	if st, _ := x.Stats(); x.Match(keys)["w"] != 3 || st.Orphans != 0 {
		got, o := x.Match(keys)["w"], st.Orphans
		t.Fatalf("a child of the remaining copy: match %d, orphans %d; want 3, 0", got, o)
	}
	x.Apply("w", []Event{removed("a/1", "GPU")})
	if got := x.Match(keys)["w"]; got != 1 {
		t.Fatalf("both copies removed: match %d, want 1", got)
	}
	// Copies count per medium: a CPU copy outlives both GPU ones.
	x.Apply("w", []Event{removed("a/0", "CPU")}) // none there: no effect
	y := stored("a", prompt, bs, 0, 1)
	y.Medium = "CPU"
	x.Apply("w", []Event{y, removed("a/0", "GPU"), removed("a/0", "GPU")})
	if got := x.Match(keys)["w"]; got != 1 {
		t.Fatalf("GPU copies removed, CPU copy kept: match %d, want 1", got)
	}
	x.Apply("w", []Event{removed("a/0", "CPU"), removed("a/2", "GPU")})
	if got, n := x.Match(keys), x.entries; len(got) != 0 || n != 0 {
		t.Fatalf("every copy removed: match %v, %d entries", got, n)
	}
}

// matchAfter applies events to a new index as worker "w"'s and returns
// how many blocks of prompt it then matches there, and its stats.
func matchAfter(bs int, prompt []uint32, events []Event) (int, IndexStats) {
	x := NewIndex(IndexOptions{BlockSize: bs})
	x.Apply("w", events)
	st, _ := x.Stats()
	return x.Match(x.BlockKeys(prompt, ""))["w"], st
}

// TestIndexReuseReports: with kv_cache_report_mode "full" vLLM 0.32
// publishes a BlockStored of the prefix a request hit (parent null, the
// blocks already cached, no new block: block_pool.py
// emit_cached_block_events). The index takes a held sequence restated from
// its first block as such a report, not as new copies: counted as copies,
// the blocks would stay in the index after their one eviction, for good.
func TestIndexReuseReports(t *testing.T) {
	const bs = 4
	prompt := u32(seq(1, 12))
	removed := func(h, medium string) Event { return BlockRemoved{BlockHashes: []Hash{hashOf(h)}, Medium: medium} }
	cases := []struct {
		name   string
		events []Event
		want   int // blocks of prompt matched on w afterwards
		stats  IndexStats
	}{
		{"a report, then the blocks' one eviction",
			[]Event{stored("a", prompt, bs, 0, 3), stored("a", prompt, bs, 0, 2), stored("a", prompt, bs, 0, 3),
				removed("a/2", "GPU"), removed("a/1", "GPU"), removed("a/0", "GPU")},
			0, IndexStats{Stored: 3, Removed: 3, Restated: 5}},
		{"a report naming a block not held stores it",
			[]Event{stored("a", prompt, bs, 0, 1), stored("a", prompt, bs, 0, 2)},
			2, IndexStats{Stored: 2, Restated: 1}},
		{"a report of the GPU copy leaves a CPU copy alone",
			[]Event{func() Event { e := stored("a", prompt, bs, 0, 1); e.Medium = "CPU"; return e }(), stored("a", prompt, bs, 0, 1),
				removed("a/0", "GPU")},
			1, IndexStats{Stored: 1}},
		{"a copy after a cached parent is a copy",
			[]Event{stored("a", prompt, bs, 0, 1), stored("a", prompt, bs, 1, 2), stored("a", prompt, bs, 1, 2), removed("a/1", "GPU")},
			2, IndexStats{Stored: 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, st := matchAfter(bs, prompt, tc.events)
			if got != tc.want {
				t.Errorf("match %d, want %d", got, tc.want)
			}
			if st != tc.stats {
				t.Errorf("stats %+v, want %+v", st, tc.stats)
			}
		})
	}
}

// TestIndexHybridGroups: a hybrid model caches every block once per KV
// cache group under one hash (vLLM 0.32, checked on a real engine with
// full-attention and sliding-window layers). The index follows the
// full-attention groups: a sliding-window group's stores (masked or not)
// and removals leave it alone, so a window's eviction does not cut a
// prefix the full-attention group still holds.
func TestIndexHybridGroups(t *testing.T) {
	const bs = 4
	prompt := u32(seq(1, 16))
	group := func(e BlockStored, g int, kind string) BlockStored { e.Group, e.Kind = g, kind; return e }
	removed := func(h string, g int) Event {
		return BlockRemoved{BlockHashes: []Hash{hashOf(h)}, Medium: "GPU", Group: g}
	}
	masked := func(e BlockStored) BlockStored { e.BlockHashes = e.BlockHashes[len(e.BlockHashes)-1:]; return e }
	full, swa := "full_attention", "sliding_window"
	cases := []struct {
		name   string
		events []Event
		want   int
		other  uint64
	}{
		{"both groups stored, the window's masked store skipped",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, full), group(masked(stored("a", prompt, bs, 0, 4)), 1, swa)},
			4, 1},
		{"the window group's removals do not cut the prefix",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, full), group(stored("a", prompt, bs, 0, 4), 1, swa),
				removed("a/0", 1), removed("a/1", 1)},
			4, 4},
		{"the full-attention group's removal does",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, full), group(stored("a", prompt, bs, 0, 4), 1, swa), removed("a/2", 0)},
			2, 4},
		{"a removal in a group never named, on a hybrid worker, is not followed",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, full), group(masked(stored("a", prompt, bs, 0, 4)), 1, swa), removed("a/1", 2)},
			4, 1},
		{"one group of no kind said (older vLLM) is followed",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, ""), removed("a/3", 0)},
			3, 0},
		{"a Mamba group is not followed; the attention group is",
			[]Event{group(stored("a", prompt, bs, 0, 4), 1, "mamba"), group(stored("a", prompt, bs, 0, 4), 0, "mla_attention")},
			4, 4},
		{"an offloading tier's placeholder is not indexed; its removal takes nothing",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, full),
				BlockStored{BlockHashes: []Hash{hashOf("a/1")}, TokenIDs: []uint32{}, Medium: "CPU", Group: 0},
				BlockRemoved{BlockHashes: []Hash{hashOf("a/1")}, Medium: "CPU", Group: 0}},
			4, 1},
		{"a model of sliding-window layers only: nothing to follow",
			[]Event{group(stored("a", prompt, bs, 0, 4), 0, swa)},
			0, 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, st := matchAfter(bs, prompt, tc.events)
			if got != tc.want {
				t.Errorf("match %d, want %d", got, tc.want)
			}
			if st.Unindexed != tc.other {
				t.Errorf("%d blocks of other groups, want %d", st.Unindexed, tc.other)
			}
		})
	}
	if e := masked(stored("a", prompt, bs, 0, 4)); !e.Masked() || stored("a", prompt, bs, 0, 4).Masked() {
		t.Error("Masked: want true for 1 hash over 4 blocks of tokens only")
	}
}

// TestIndexEvicting: a worker is evicting from the first GPU block it
// removes until its cache is cleared; an offloading tier's removals and
// removals of blocks it never reported do not count.
func TestIndexEvicting(t *testing.T) {
	const bs = 4
	x := NewIndex(IndexOptions{BlockSize: bs})
	prompt := u32(seq(1, 12))
	removed := func(h, medium string) Event { return BlockRemoved{BlockHashes: []Hash{hashOf(h)}, Medium: medium} }
	steps := []struct {
		name string
		ev   []Event
		want bool
	}{
		{"new worker", nil, false},
		{"stored", []Event{stored("a", prompt, bs, 0, 3)}, false},
		{"a block it never reported", []Event{removed("zz/0", "GPU")}, false},
		{"a CPU copy", []Event{func() Event { e := stored("a", prompt, bs, 0, 1); e.Medium = "CPU"; return e }(), removed("a/0", "CPU")}, false},
		{"a GPU block", []Event{removed("a/2", "")}, true},
		{"stored again", []Event{stored("a", prompt, bs, 2, 3)}, true},
		{"cleared", []Event{AllBlocksCleared{}}, false},
	}
	for _, s := range steps {
		x.Apply("w", s.ev)
		if got := x.Evicting("w"); got != s.want {
			t.Fatalf("%s: evicting %v, want %v", s.name, got, s.want)
		}
	}
	x.Apply("v", []Event{stored("b", prompt, bs, 0, 1), removed("b/0", "GPU")})
	if !x.Evicting("v") || x.Evicting("w") || x.Evicting("unknown") {
		t.Fatal("evicting is per worker")
	}
	x.Clear("v")
	if x.Evicting("v") {
		t.Fatal("Clear: still evicting")
	}
}

// hashOf is a test's engine hash named by s (a byte hash).
func hashOf(s string) Hash { return BytesHash([]byte(s)) }
