package policy

import (
	"context"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/prefix"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// CacheAware sends a request to the worker that has most likely kept its
// prompt prefix in the KV cache, unless the fleet is imbalanced
// (REFERENCE §3.5, with §10.3's weaknesses fixed):
//
//  1. Loads (see base.load) are taken over usable workers only. The fleet is
//     imbalanced iff max-min > BalanceAbsThreshold and max > min *
//     BalanceRelThreshold; then the least-loaded usable worker wins.
//  2. Otherwise the routing text is matched against one radix tree whose
//     tenants are workers (characters, not tokens). Among usable
//     candidates, the tenant with the longest match wins, the most recently
//     used on ties; if its match ratio exceeds CacheThreshold it is chosen,
//     else the least-loaded usable worker is.
//  3. The text is recorded under the chosen worker.
//
// Least-load ties are broken at random, so diverse prompts spread over idle
// workers instead of all landing on the first. A goroutine owned by the
// policy trims every worker's share of the tree to MaxTreeSize characters
// each EvictionInterval; Close stops it.
type CacheAware struct {
	base
	tree  *prefix.Tree
	views viewCache[*tenantView]

	removedMu sync.Mutex
	removed   map[string]struct{} // left the fleet; no tree-size gauge until seen again

	cancel    context.CancelFunc
	done      chan struct{}
	unsub     func()
	closeOnce sync.Once
	lastEvict atomic.Int64 // unix nanos
}

var (
	_ Policy        = (*CacheAware)(nil)
	_ WorkerRemover = (*CacheAware)(nil)
)

// tenantView maps one membership's workers to tree tenants and back.
type tenantView struct {
	ids      []prefix.TenantID // worker index → tenant
	byTenant []int32           // tenant → worker index, -1 if not a candidate
}

func newCacheAware(o Options) *CacheAware {
	p := &CacheAware{base: base{name: NameCacheAware, o: o}, tree: prefix.New(), done: make(chan struct{}), removed: map[string]struct{}{}}
	p.views.build = p.buildView
	ctx, cancel := context.WithCancel(o.Context)
	p.cancel = cancel
	if o.EvictionInterval > 0 {
		go p.evictLoop(ctx, o.EvictionInterval)
	} else {
		close(p.done)
	}
	if o.Registry != nil {
		p.unsub = o.Registry.Subscribe(func(ch worker.Change) {
			for _, w := range ch.Removed {
				p.RemoveWorker(w.Key())
			}
		})
	}
	return p
}

func (p *CacheAware) buildView(ws []*worker.Worker) *tenantView {
	v := &tenantView{ids: make([]prefix.TenantID, len(ws))}
	p.removedMu.Lock()
	for _, w := range ws {
		delete(p.removed, w.Key())
	}
	p.removedMu.Unlock()
	top := -1
	for i, w := range ws {
		v.ids[i] = p.tree.Tenant(w.Key())
		top = max(top, int(v.ids[i]))
	}
	v.byTenant = make([]int32, top+1)
	for i := range v.byTenant {
		v.byTenant[i] = -1
	}
	for i, id := range v.ids {
		v.byTenant[id] = int32(i)
	}
	return v
}

func (p *CacheAware) evictLoop(ctx context.Context, every time.Duration) {
	defer close(p.done)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.Evict()
		}
	}
}

// Evict trims every worker's share of the tree to MaxTreeSize characters now
// and returns the number of characters removed. The eviction goroutine calls
// it every EvictionInterval.
func (p *CacheAware) Evict() int {
	n := p.tree.EvictTo(p.o.MaxTreeSize)
	p.lastEvict.Store(p.o.Now().UnixNano())
	var views []*view[*tenantView]
	if vs := p.views.cur.Load(); vs != nil {
		views = *vs
	}
	p.removedMu.Lock()
	defer p.removedMu.Unlock()
	if m := p.o.Metrics; m != nil {
		for _, v := range views {
			for i, w := range v.workers {
				if _, gone := p.removed[w.Key()]; !gone {
					m.TreeSize.WithLabelValues(w.Key()).Set(float64(p.tree.Size(v.v.ids[i])))
				}
			}
		}
	}
	// Forget removals no cached view refers to any more.
	for key := range p.removed {
		cached := false
		for _, v := range views {
			if slices.ContainsFunc(v.workers, func(w *worker.Worker) bool { return w.Key() == key }) {
				cached = true
				break
			}
		}
		if !cached {
			delete(p.removed, key)
		}
	}
	return n
}

// LastEviction returns when Evict last ran (zero if never).
func (p *CacheAware) LastEviction() time.Time {
	if n := p.lastEvict.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// Size returns the characters held for the worker with key.
func (p *CacheAware) Size(key string) int {
	id, ok := p.tree.Lookup(key)
	if !ok {
		return 0
	}
	return p.tree.Size(id)
}

// RemoveWorker forgets everything cached for the worker with key (it left
// the fleet). It is called for every removed worker when Options.Registry is
// set; otherwise the app calls it (policy.RemoveWorker) on registry changes.
func (p *CacheAware) RemoveWorker(key string) {
	p.removedMu.Lock()
	p.removed[key] = struct{}{}
	p.removedMu.Unlock()
	p.tree.RemoveTenant(key)
	if m := p.o.Metrics; m != nil {
		m.TreeSize.DeleteLabelValues(key)
	}
}

// Close stops the eviction goroutine and the registry subscription. It is
// idempotent.
func (p *CacheAware) Close() error {
	p.closeOnce.Do(func() {
		if p.unsub != nil {
			p.unsub()
		}
		p.cancel()
		<-p.done
	})
	return nil
}

// stackWorkers is the fleet size whose per-pick scratch stays on the stack.
const stackWorkers = 256

// Pick implements Policy.
func (p *CacheAware) Pick(req *Request, c Candidates) (Choice, error) {
	req = orEmpty(req)
	ws := c.Workers
	n := len(ws)
	if n == 0 {
		return Choice{}, ErrNoWorker
	}
	var ubuf [stackWorkers]bool
	var lbuf [stackWorkers]int64
	usable, loads := ubuf[:0], lbuf[:0]
	if n <= stackWorkers {
		usable, loads = ubuf[:n], lbuf[:n]
	} else {
		usable, loads = make([]bool, n), make([]int64, n)
	}
	count := 0
	var minL, maxL int64
	for i, w := range ws {
		if !req.Usable(w) {
			continue
		}
		l := p.load(w)
		usable[i], loads[i] = true, l
		if count == 0 || l < minL {
			minL = l
		}
		if count == 0 || l > maxL {
			maxL = l
		}
		count++
	}
	if count == 0 {
		return Choice{}, ErrNoWorker
	}

	view := p.views.get(c)
	text := req.RoutingText()
	m := p.o.Metrics
	var chosen int
	var reason string
	if maxL-minL > int64(p.o.BalanceAbsThreshold) && float64(maxL) > float64(minL)*p.o.BalanceRelThreshold {
		chosen = p.leastLoaded(usable, loads)
		reason = reasonN("imbalance, least load ", loads[chosen])
		if m != nil {
			m.LBEvents.Inc()
			m.MaxLoad.Set(float64(maxL))
			m.MinLoad.Set(float64(minL))
		}
	} else {
		match := p.tree.Match(text, func(id prefix.TenantID) bool {
			return int(id) < len(view.byTenant) && view.byTenant[id] >= 0 && usable[view.byTenant[id]]
		})
		ratio := match.Ratio()
		hit := match.Found && ratio > p.o.CacheThreshold
		if hit {
			chosen = int(view.byTenant[match.Tenant])
			var buf [32]byte
			reason = string(strconv.AppendFloat(append(buf[:0], "cache match "...), ratio, 'f', 2, 64))
		} else {
			chosen = p.leastLoaded(usable, loads)
			reason = reasonN("least load ", loads[chosen])
		}
		if m != nil {
			if hit {
				m.CacheHits.Inc()
			} else {
				m.CacheMisses.Inc()
			}
			m.CacheMatchRatio.Observe(ratio)
		}
	}
	size := p.tree.Insert(text, view.ids[chosen])
	if m != nil {
		m.TreeSize.WithLabelValues(ws[chosen].Key()).Set(float64(size))
	}
	return p.choice(ws[chosen], reason), nil
}

// leastLoaded returns a usable worker with the lowest load, chosen at random
// among ties.
func (p *CacheAware) leastLoaded(usable []bool, loads []int64) int {
	best, ties := -1, 0
	for i, ok := range usable {
		switch {
		case !ok:
		case best < 0 || loads[i] < loads[best]:
			best, ties = i, 1
		case loads[i] == loads[best]:
			ties++
			if randN(p.o.Rand, ties) == 0 {
				best = i
			}
		}
	}
	return best
}
