package scenario

import (
	"math/bits"
	"math/rand/v2"
	"testing"
)

// refsOf builds references from a compact form: a letter a block, upper
// case a counted reference, lower case one that only stores the block.
func refsOf(s string) []blockRef {
	var out []blockRef
	for _, c := range s {
		if c >= 'a' {
			out = append(out, blockRef{id: int(c - 'a')})
		} else {
			out = append(out, blockRef{id: int(c - 'A'), counted: true})
		}
	}
	return out
}

func TestPooledHits(t *testing.T) {
	for _, tc := range []struct {
		refs     string
		capacity int
		want     int
	}{
		{"AA", 1, 1},
		{"AA", 0, 0},
		{"ABAB", 1, 1},
		{"ABAB", 2, 2},
		{"aA", 1, 1},   // an uncounted reference stores the block
		{"Aa", 1, 0},   // and never hits
		{"ABBA", 1, 1}, // one of A's and B's intervals overlap
		// With one block, holding A until its far reuse would cost the
		// three near reuses of B.
		{"ABBBBA", 1, 3},
		{"ABBBBA", 2, 4},
		// C's reuse is wanted sooner than A's, so C replaces A.
		{"ABCBCA", 2, 2},
		// A is referenced again, uncounted, before it is wanted: that
		// reference stores it, so holding it from the start earns
		// nothing; B's reuse and A's then overlap.
		{"ABaBA", 1, 1},
		{"ABaBA", 2, 2},
	} {
		if got := pooledHits(refsOf(tc.refs), tc.capacity); got != tc.want {
			t.Errorf("pooledHits(%s, %d) = %d, want %d", tc.refs, tc.capacity, got, tc.want)
		}
	}
}

// bestHits is pooledHits by exhaustive search: after each reference the
// cache may keep any set of at most capacity blocks among those it held
// and the one just referenced.
func bestHits(refs []blockRef, capacity int) int {
	memo := map[[2]int]int{}
	var best func(i, held int) int
	best = func(i, held int) int {
		if i == len(refs) {
			return 0
		}
		if v, ok := memo[[2]int{i, held}]; ok {
			return v
		}
		r := refs[i]
		hit := 0
		if r.counted && held&(1<<r.id) != 0 {
			hit = 1
		}
		can := held | 1<<r.id
		top := 0
		for keep := can; ; keep = (keep - 1) & can {
			if bits.OnesCount(uint(keep)) <= capacity {
				top = max(top, best(i+1, keep))
			}
			if keep == 0 {
				break
			}
		}
		memo[[2]int{i, held}] = hit + top
		return hit + top
	}
	return best(0, 0)
}

// TestPooledHitsOptimal: the sweep finds the optimum on random reference
// strings, checked by exhaustive search.
func TestPooledHitsOptimal(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		refs := make([]blockRef, 1+rng.IntN(14))
		for i := range refs {
			refs[i] = blockRef{id: rng.IntN(5), counted: rng.IntN(4) != 0}
		}
		capacity := rng.IntN(5)
		if got, want := pooledHits(refs, capacity), bestHits(refs, capacity); got != want {
			t.Fatalf("pooledHits(%+v, %d) = %d, exhaustive search %d", refs, capacity, got, want)
		}
	}
}

// TestKVBoundCapacity: with room for every block the capacity bound is the
// eviction-free bound; less room never gives more hits, and too little
// gives fewer.
func TestKVBoundCapacity(t *testing.T) {
	c := KVConfig{Groups: 4, PerGroup: 8, PrefixLen: 128, QuestionLen: 16, OutputLen: 8, Turns: 2, BlockSize: 16, Seed: 5, Unified: 4}
	prev := uint64(0)
	for _, n := range []int{0, 2, 8, 16, 32, 64, 1000} {
		c.NumBlocks = n
		b, err := c.Bound()
		if err != nil {
			t.Fatal(err)
		}
		got := b.Capped[cachesUnified]
		if got < prev || got > b.Hits || got%16 != 0 {
			t.Errorf("%d blocks: capped %d after %d, eviction-free %d", n, got, prev, b.Hits)
		}
		if full := 4*n >= b.Blocks; full != (got == b.Hits) {
			t.Errorf("%d blocks (room for %d of %d): capped %d, eviction-free %d", n, 4*n, b.Blocks, got, b.Hits)
		}
		if b.Capped[cachesPrefills] != got || b.Capped[cachesPD] < got {
			t.Errorf("%d blocks: prefills %d, all PD workers %d, unified %d", n, b.Capped[cachesPrefills], b.Capped[cachesPD], got)
		}
		prev = got
	}
	if prev == 0 {
		t.Fatal("no hits at all")
	}
}

func TestCachesOf(t *testing.T) {
	for _, tc := range []struct {
		pd   bool
		spec string
		want kvCaches
	}{
		{false, "kv_aware", cachesUnified},
		{false, "kv_aware+--pd-uncached-token-threshold=64", cachesUnified},
		{true, "kv_aware", cachesPrefills},
		{true, "kv_aware+--kv-load-weight=0.1", cachesPrefills},
		{true, "kv_aware+--pd-uncached-token-threshold=64", cachesPD},
	} {
		if got := cachesOf(tc.pd, tc.spec); got != tc.want {
			t.Errorf("cachesOf(%v, %q) = %d, want %d", tc.pd, tc.spec, got, tc.want)
		}
	}
}
