package scenario

import (
	"container/heap"
	"strconv"
	"strings"
)

// The capacity bound: the most prefix-cache hits any routing and any
// eviction order could get from a fleet whose caches hold K blocks in
// all, for the requests in the order sent.
//
// It pools the fleet's caches into one cache of K blocks and plays it
// with perfect foresight. Pooling only helps: at every moment the union
// of the workers' caches is a set of at most K blocks that a single cache
// could hold, every hit of a worker is a hit of that union, and a block
// held by two workers counts once. A hit is counted block by block,
// without asking that the blocks before it hit too, which can only help
// further. So no fleet of that capacity beats the bound, whatever its
// routing and eviction; it assumes a request's blocks are stored the
// moment it is sent, which also only helps.
//
// The model: each request refers to its full blocks in order. A reference
// whose block lies within the prompt less its last token (what vLLM may
// serve from cache) is counted: a hit when the block is held. Every
// reference, counted or not, may store its block (the engine computes or
// receives it) and any block may be dropped at any time. Holding block x
// from one reference to the next earns one hit exactly when that next
// reference is counted; so the best play picks the most such intervals
// with at most K held at any time. Keeping, among the candidates, those
// that end first is optimal for that (the classic farthest-next-use
// argument, Belady's, with the option not to store); pooledHits does
// that in one sweep.

// blockRef is one reference to a block of the workload.
type blockRef struct {
	id      int
	counted bool // the block may be served from cache (within len−1 tokens)
}

// blockRefs lists prompts' full blocks in order, each block named by an
// id that is equal for two blocks exactly when their prefixes (the block
// and every token before it) are equal, and counts the distinct blocks.
func blockRefs(prompts [][]uint32, blockSize int) (refs []blockRef, distinct int) {
	ids := map[string]int{}
	var key strings.Builder
	for _, p := range prompts {
		parent := -1
		for k := 1; k*blockSize <= len(p); k++ {
			key.Reset()
			key.WriteString(strconv.Itoa(parent))
			for _, t := range p[(k-1)*blockSize : k*blockSize] {
				key.WriteByte(',')
				key.WriteString(strconv.FormatUint(uint64(t), 10))
			}
			id, ok := ids[key.String()]
			if !ok {
				id = len(ids)
				ids[key.String()] = id
			}
			refs = append(refs, blockRef{id: id, counted: k*blockSize <= len(p)-1})
			parent = id
		}
	}
	return refs, len(ids)
}

// pooledHits is the most counted references that can hit in one cache of
// capacity blocks with perfect foresight (see the model above).
func pooledHits(refs []blockRef, capacity int) int {
	next := make([]int, len(refs)) // the next reference to the same block, or −1
	last := map[int]int{}
	for i := len(refs) - 1; i >= 0; i-- {
		next[i] = -1
		if j, ok := last[refs[i].id]; ok {
			next[i] = j
		}
		last[refs[i].id] = i
	}
	held := map[int]int{} // block → the reference its interval ends at
	var ends endHeap      // the held intervals' ends, the latest on top
	hits := 0
	for i, r := range refs {
		if end, ok := held[r.id]; ok && end == i {
			// Every held interval ends at a counted reference.
			hits++
			delete(held, r.id)
		}
		n := next[i]
		if capacity <= 0 || n < 0 || !refs[n].counted {
			continue // nothing to earn by holding the block until then
		}
		if len(held) == capacity {
			top := ends.top(held)
			if top.end < n {
				continue // every held block is wanted sooner
			}
			delete(held, top.id)
			heap.Pop(&ends)
		}
		held[r.id] = n
		heap.Push(&ends, heldEnd{id: r.id, end: n})
	}
	return hits
}

// heldEnd is a held interval in endHeap.
type heldEnd struct{ id, end int }

// endHeap is a max-heap of interval ends; an entry whose block is no
// longer held until that end is stale and skipped by top.
type endHeap []heldEnd

func (h endHeap) Len() int           { return len(h) }
func (h endHeap) Less(i, j int) bool { return h[i].end > h[j].end }
func (h endHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *endHeap) Push(x any)        { *h = append(*h, x.(heldEnd)) }
func (h *endHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// top drops stale entries and returns the live one that ends last.
func (h *endHeap) top(held map[int]int) heldEnd {
	for {
		t := (*h)[0]
		if end, ok := held[t.id]; ok && end == t.end {
			return t
		}
		heap.Pop(h)
	}
}
