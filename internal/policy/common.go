package policy

import (
	"math/bits"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// base carries what every policy shares.
type base struct {
	name string
	o    Options
	dec  Decisions
}

// Name returns the policy's name (as accepted by New).
func (b *base) Name() string { return b.name }

// record counts one decision for w.
func (b *base) record(w *worker.Worker) { b.dec.Record(b.o.Metrics, b.name, w) }

// Decisions counts a policy's decisions per chosen worker
// (vllm_router_policy_decisions_total and
// vllm_router_processed_requests_total), resolving each worker's counters
// once instead of a label lookup per pick. The zero value is ready; it
// must not be copied after first use.
type Decisions struct {
	counters sync.Map      // *worker.Worker → *decisionCounters
	gen      atomic.Uint64 // the metrics' worker generation counters holds
}

// decisionCounters are one worker's children of PolicyDecisions and
// Processed, valid while the metrics' worker generation is gen.
type decisionCounters struct {
	gen                 uint64
	decisions, routedTo prometheus.Counter
}

// Record counts one decision of the policy named policy for w in m (nil:
// nothing). Counters resolved before m deleted a worker's series
// (metrics.Metrics.WorkerGeneration moved) are resolved again.
func (d *Decisions) Record(m *metrics.Metrics, policy string, w *worker.Worker) {
	if m == nil {
		return
	}
	gen := m.WorkerGeneration()
	if v, ok := d.counters.Load(w); ok {
		if c := v.(*decisionCounters); c.gen == gen {
			c.decisions.Inc()
			c.routedTo.Inc()
			return
		}
	}
	if d.gen.Swap(gen) != gen {
		d.counters.Clear() // departed workers' entries (and children deleted since)
	}
	k := w.Key()
	c := &decisionCounters{gen: gen, decisions: m.PolicyDecisions.WithLabelValues(policy, k), routedTo: m.Processed.WithLabelValues(k)}
	d.counters.Store(w, c)
	c.decisions.Inc()
	c.routedTo.Inc()
}

// load is the load power_of_two and cache_aware compare: the router's own
// in-flight count, or the worker's self-reported load (vLLM GET /load
// "server_load", set by the poller through SetPolledLoad) when that is
// higher. The poll is stale but also counts requests from other routers and
// clients; the local count is exact for this router. Taking the maximum
// keeps the freshest lower bound of both.
func (b *base) load(w *worker.Worker) int64 {
	l := w.Load()
	if !b.o.LocalLoadOnly {
		if p := w.PolledLoad(); p > l {
			l = p
		}
	}
	return l
}

func (b *base) choice(w *worker.Worker, reason string) Choice {
	b.record(w)
	return Choice{Worker: w, Reason: reason}
}

// orEmpty lets policies accept a nil request.
func orEmpty(r *Request) *Request {
	if r == nil {
		return &Request{}
	}
	return r
}

// randN returns a uniform int in [0, n) (n > 0) from a 64-bit source.
func randN(rnd func() uint64, n int) int {
	hi, _ := bits.Mul64(rnd(), uint64(n))
	return int(hi)
}

// sampleTries is how many random draws sample makes before scanning.
const sampleTries = 8

// sample returns the index of a uniformly chosen usable worker other than
// skip (-1 for none), or -1 when there is none. It draws at random first
// (O(1) when most workers are usable; a rejected draw is redrawn, which keeps
// the choice uniform) and falls back to one reservoir-sampling scan.
func sample(req *Request, ws []*worker.Worker, rnd func() uint64, skip int) int {
	n := len(ws)
	if n == 0 {
		return -1
	}
	for range min(sampleTries, 2*n) {
		if i := randN(rnd, n); i != skip && req.Usable(ws[i]) {
			return i
		}
	}
	chosen, seen := -1, 0
	for i, w := range ws {
		if i == skip || !req.Usable(w) {
			continue
		}
		seen++
		if randN(rnd, seen) == 0 {
			chosen = i
		}
	}
	return chosen
}

// viewCache caches a structure derived from one role's membership (a hash
// ring, tenant IDs) so it is built once per membership, never per request.
// Lookups are lock-free; builds are serialised.
//
// The fast path trusts the Candidates contract: the same Gen (and the same
// length, first and last worker, which tells prefill from decode candidates
// of one generation) means the same membership. On a Gen miss the cached
// views are compared worker by worker, so a Gen bump caused by another role
// re-tags the view instead of rebuilding it.
type viewCache[T any] struct {
	build  func(ws []*worker.Worker) T
	mu     sync.Mutex
	cur    atomic.Pointer[[]*view[T]]
	builds atomic.Int64 // for tests and stats
}

type view[T any] struct {
	gen     uint64
	workers []*worker.Worker
	v       T
}

// viewCacheSize is how many memberships are kept (prefill, decode, regular,
// and one being replaced).
const viewCacheSize = 4

func (c *viewCache[T]) get(cands Candidates) T {
	if p := c.cur.Load(); p != nil {
		for _, e := range *p {
			if e.gen == cands.Gen && sameHead(e.workers, cands.Workers) {
				return e.v
			}
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var old []*view[T]
	if p := c.cur.Load(); p != nil {
		old = *p
	}
	for _, e := range old {
		if e.gen == cands.Gen && sameHead(e.workers, cands.Workers) {
			return e.v
		}
	}
	var nv *view[T]
	for _, e := range old {
		if slices.Equal(e.workers, cands.Workers) {
			nv = &view[T]{gen: cands.Gen, workers: e.workers, v: e.v}
			break
		}
	}
	if nv == nil {
		ws := slices.Clone(cands.Workers)
		nv = &view[T]{gen: cands.Gen, workers: ws, v: c.build(ws)}
		c.builds.Add(1)
	}
	next := make([]*view[T], 0, viewCacheSize)
	next = append(next, nv)
	for _, e := range old {
		if len(next) == viewCacheSize {
			break
		}
		if slices.Equal(e.workers, nv.workers) {
			continue
		}
		next = append(next, e)
	}
	c.cur.Store(&next)
	return nv.v
}

func sameHead(a, b []*worker.Worker) bool {
	return len(a) == len(b) && (len(a) == 0 || a[0] == b[0] && a[len(a)-1] == b[len(b)-1])
}

// bitset marks worker indices; small fleets stay on the stack.
type bitset struct {
	small [4]uint64
	big   []uint64
}

func newBitset(n int) bitset {
	var s bitset
	if n > 256 {
		s.big = make([]uint64, (n+63)/64)
	}
	return s
}

func (s *bitset) words() []uint64 {
	if s.big != nil {
		return s.big
	}
	return s.small[:]
}

// testAndSet sets bit i and reports whether it was already set.
func (s *bitset) testAndSet(i int) bool {
	w := s.words()
	m := uint64(1) << (i & 63)
	was := w[i>>6]&m != 0
	w[i>>6] |= m
	return was
}

func appendInt(b []byte, n int64) []byte { return strconv.AppendInt(b, n, 10) }

// reasonN builds "<prefix><n>" (e.g. "least load 3").
func reasonN(prefix string, n int64) string {
	var buf [48]byte
	return string(appendInt(append(buf[:0], prefix...), n))
}
