package policy

import (
	"cmp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// ConsistentHash maps the request's hash key onto a ring of VirtualNodes
// points per worker (xxhash64 of "<worker key>:<i>"). The ring holds every
// candidate, usable or not, so health changes never move keys; it is rebuilt
// only when membership changes. When the key's owner is not usable the walk
// continues clockwise to the next distinct usable worker, so a dead worker's
// keys spread over its ring successors instead of piling onto one worker.
type ConsistentHash struct {
	base
	keys  *KeyExtractor
	rings viewCache[*ring]
}

var (
	_ Policy     = (*ConsistentHash)(nil)
	_ PairPolicy = (*ConsistentHash)(nil)
)

type ring struct {
	pos []uint64 // sorted positions
	idx []int32  // worker index (in the view's order) of each position
}

func newConsistentHash(o Options) *ConsistentHash {
	p := &ConsistentHash{base: base{name: NameConsistentHash, o: o}, keys: NewKeyExtractor(o.HashHeaders)}
	vnodes := o.VirtualNodes
	p.rings.build = func(ws []*worker.Worker) *ring { return buildRing(ws, vnodes) }
	return p
}

// buildRing places vnodes points per worker. Positions depend only on worker
// keys (collisions are ordered by key), so every router replica, and every
// restart, builds the same ring for the same fleet whatever the slice order.
func buildRing(ws []*worker.Worker, vnodes int) *ring {
	type point struct {
		pos uint64
		i   int32
	}
	pts := make([]point, 0, len(ws)*vnodes)
	var buf []byte
	for i, w := range ws {
		buf = append(append(buf[:0], w.Key()...), ':')
		n := len(buf)
		for v := range vnodes {
			buf = strconv.AppendInt(buf[:n], int64(v), 10)
			pts = append(pts, point{xxhash.Sum64(buf), int32(i)})
		}
	}
	slices.SortFunc(pts, func(a, b point) int {
		if c := cmp.Compare(a.pos, b.pos); c != 0 {
			return c
		}
		if c := strings.Compare(ws[a.i].Key(), ws[b.i].Key()); c != 0 {
			return c
		}
		return cmp.Compare(a.i, b.i)
	})
	r := &ring{pos: make([]uint64, len(pts)), idx: make([]int32, len(pts))}
	for k, p := range pts {
		r.pos[k], r.idx[k] = p.pos, p.i
	}
	return r
}

// Pick implements Policy.
func (p *ConsistentHash) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	return p.pick(req, c, p.keys.Key(req))
}

// PickPair implements PairPolicy: prefill and decode are each looked up
// with the same key on their own ring, so a session keeps its P and its D.
func (p *ConsistentHash) PickPair(req *Request, prefill, decode Candidates) (Choice, Choice, error) {
	req = orEmpty(req)
	return pickPairByKey(p.pick, req, prefill, decode, p.keys.Key(req))
}

func (p *ConsistentHash) pick(req *Request, c Candidates, key string) (Choice, error) {
	ws := c.Workers
	if len(ws) == 0 {
		return Choice{}, ErrNoWorker
	}
	if key == "" {
		i := sample(req, ws, p.o.Rand, -1)
		if i < 0 {
			return Choice{}, ErrNoWorker
		}
		return p.choice(ws[i], "no key, random"), nil
	}
	r := p.rings.get(c)
	n := len(r.pos)
	h := xxhash.Sum64String(key)
	start := sort.Search(n, func(i int) bool { return r.pos[i] >= h })
	seen := newBitset(len(ws))
	skipped, distinct := 0, 0
	for k := 0; k < n && distinct < len(ws); k++ {
		wi := int(r.idx[(start+k)%n])
		if seen.testAndSet(wi) {
			continue
		}
		distinct++
		if req.Usable(ws[wi]) {
			if skipped == 0 {
				return p.choice(ws[wi], "hash owner"), nil
			}
			return p.choice(ws[wi], reasonN("ring walk +", int64(skipped))), nil
		}
		skipped++
	}
	return Choice{}, ErrNoWorker
}
