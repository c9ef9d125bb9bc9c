// Package kvaware is the kv_aware policy: it routes a request to the
// worker whose prefix cache, as the engines report it through their KV
// events (internal/kvevents), already holds most of the prompt, blended
// with load. See docs/KV-ROUTING.md.
package kvaware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Name is the policy's name on the command line.
const Name = "kv_aware"

// Options configures a Policy.
type Options struct {
	Index     *kvevents.Index
	Tokenizer *Tokenizer
	// Metrics counts the decisions per worker (policy_decisions_total,
	// processed_requests_total), as every policy does; nil: none.
	Metrics *metrics.Metrics
	// Fallback routes what kv_aware cannot: prompts not tokenized, and
	// fleets none of whose candidates publishes events.
	Fallback policy.Policy
	// HasEvents reports whether a worker's event stream is followed (nil:
	// every worker with entries in the index).
	HasEvents func(key string) bool

	// Cost of a candidate, in tokens: OverlapWeight × prompt tokens it
	// would have to compute + LoadWeight × prompt tokens × its requests in
	// flight. The router's defaults are 1 and 0.02: a request already
	// running mostly decodes, which slows a new prefill far less than
	// computing the prompt (0.5 spread shared prefixes over the fleet and
	// lost a third of the hits at concurrency 32, 0.1 6-9 points, 0.02
	// none: docs/BENCHMARKS.md §5).
	OverlapWeight float64
	LoadWeight    float64
	// TieBand: costs within TieBand × prompt tokens of the lowest are
	// equal, and the worker holding fewer blocks is taken among them
	// (0 = exact ties only; the router uses DefaultTieBand).
	TieBand float64

	// Speculative records a routed prompt's blocks on the chosen worker
	// for SpeculativeTTL, so a burst of one prefix is not spread before the
	// engine's events arrive.
	Speculative    bool
	SpeculativeTTL time.Duration
	MaxSpeculative int // entries at most (1,000,000)

	LocalLoadOnly bool // ignore the load workers report
	Now           func() time.Time
}

// DefaultTieBand is the router's default --kv-tie-band: 10 % of the
// prompt, as much as 5 requests in flight at the default load weight. A new
// prefix is a lasting choice (its followers go where it went), so the
// cache room it finds weighs more than a moment's load: 5 % (2.5 requests)
// put a fifth group on one worker in 3 of 14 loaded runs of the shared-
// prefix benchmark, 10 % in none of 16 (docs/BENCHMARKS.md §5).
const DefaultTieBand = 0.1

// Stats counts decisions.
type Stats struct {
	Picks, Hits                        atomic.Uint64 // kv_aware decisions; with a cached prefix
	FallbackNoTokens, FallbackNoEvents atomic.Uint64
	MatchedTokens, PromptTokens        atomic.Uint64 // predicted cached tokens; prompt tokens routed
	TokenizeErrors                     atomic.Uint64
	Bypass                             atomic.Uint64 // PD requests sent to the decode alone
	// BypassDeferred: PD requests whose uncached tokens were below the
	// bypass threshold but were split, their decode busy computing the
	// prompts of other bypassed requests.
	BypassDeferred atomic.Uint64
}

// Policy is kv_aware. Build it with New.
type Policy struct {
	o    Options
	dec  policy.Decisions
	spec *speculative
	rr   atomic.Uint64 // tokenize target rotation
	S    Stats

	// pickMu makes a pick and its speculative insertion one step, so
	// the next pick sees where this one sent its new blocks.
	pickMu sync.Mutex
}

var (
	_ policy.Policy   = (*Policy)(nil)
	_ policy.Preparer = (*Policy)(nil)
)

// New returns the policy.
func New(o Options) (*Policy, error) {
	if o.Index == nil || o.Tokenizer == nil || o.Fallback == nil {
		return nil, errors.New("kv_aware: needs an index, a tokenizer and a fallback policy")
	}
	if o.OverlapWeight < 0 || o.LoadWeight < 0 {
		return nil, fmt.Errorf("kv_aware: weights must be >= 0 (overlap %v, load %v)", o.OverlapWeight, o.LoadWeight)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.SpeculativeTTL <= 0 {
		o.SpeculativeTTL = 2 * time.Second
	}
	if o.MaxSpeculative <= 0 {
		o.MaxSpeculative = 1_000_000
	}
	if o.HasEvents == nil {
		o.HasEvents = func(key string) bool { return o.Index.WorkerBlocks(key) > 0 }
	}
	return &Policy{o: o, spec: newSpeculative(o.MaxSpeculative)}, nil
}

// Name implements policy.Policy.
func (p *Policy) Name() string { return Name }

// Fallback is the policy used when kv_aware cannot decide.
func (p *Policy) Fallback() policy.Policy { return p.o.Fallback }

// prepared is what Prepare leaves on the request.
type prepared struct {
	keys []uint64
}

// Prepare tokenizes the prompt at one of the candidates (any engine of the
// model tokenizes alike; they are asked in turn, and an unreachable one is
// passed over) and computes its block keys, rooted as vLLM roots the
// prompt's block hashes: in the request's cache_salt, and in its model's
// name when that names a LoRA adapter the engines have stored blocks for.
func (p *Policy) Prepare(ctx context.Context, req *policy.Request, c policy.Candidates) {
	o, err := req.Obj, error(nil)
	if o == nil && (req.Tokens == nil || len(req.Body) > 0) {
		if o, err = rawjson.Parse(req.Body); err != nil {
			req.TokenErr = fmt.Errorf("%w: %w", ErrNotTokenizable, err)
			return
		}
	}
	salt, lora := "", ""
	if o != nil {
		var ok bool
		if salt, ok = CacheSalt(o); !ok {
			req.TokenErr = fmt.Errorf("%w: a cache_salt the engine refuses", ErrNotTokenizable)
			return
		}
		if m, _ := o.String("model"); p.o.Index.IsLoRA(m) {
			lora = m // vLLM serves a LoRA adapter under its name
		}
	}
	if req.Tokens != nil { // given with the request (no body: no salt)
		req.Prepared = &prepared{keys: p.o.Index.SaltedBlockKeys(req.Tokens, lora, salt)}
		return
	}
	for _, base := range p.tokenizeAt(req, c, 3) {
		var toks []uint32
		toks, err = p.o.Tokenizer.TokensOf(ctx, base, req.Path, o)
		if err == nil {
			req.Tokens = toks
			req.Prepared = &prepared{keys: p.o.Index.SaltedBlockKeys(toks, lora, salt)}
			return
		}
		if errors.Is(err, ErrNotTokenizable) || ctx.Err() != nil {
			break // the request itself, not the engine
		}
		p.S.TokenizeErrors.Add(1)
	}
	req.TokenErr = err
}

// tokenizeAt lists up to max usable candidates to tokenize at, starting
// at a rotating offset so /tokenize calls spread over the fleet instead of
// all landing on its first worker.
func (p *Policy) tokenizeAt(req *policy.Request, c policy.Candidates, max int) []string {
	n := len(c.Workers)
	if n == 0 {
		return nil
	}
	start := int(p.rr.Add(1) % uint64(n))
	var out []string
	for i := 0; i < n && len(out) < max; i++ {
		if w := c.Workers[(start+i)%n]; req.Usable(w) {
			out = append(out, w.URL)
		}
	}
	return out
}

// CachedBlocks returns, per worker key, how many leading blocks of the
// request's prompt the worker holds (events and speculative entries).
func (p *Policy) CachedBlocks(req *policy.Request) map[string]int {
	m, _ := p.cachedBlocks(req, p.o.Now())
	return m
}

// cachedBlocks is CachedBlocks, and the index's part of it alone.
func (p *Policy) cachedBlocks(req *policy.Request, now time.Time) (all, indexed map[string]int) {
	pr, _ := req.Prepared.(*prepared)
	if pr == nil || len(pr.keys) == 0 {
		return nil, nil
	}
	indexed = p.o.Index.Match(pr.keys)
	if !p.o.Speculative {
		return indexed, indexed
	}
	spec := p.spec.match(pr.keys, indexed, now)
	if len(spec) == 0 {
		return indexed, indexed
	}
	all = make(map[string]int, len(indexed)+len(spec))
	for k, d := range indexed {
		all[k] = d
	}
	for k, d := range spec {
		all[k] = max(all[k], d)
	}
	return all, indexed
}

// CountBypass counts a PD request served by the decode alone.
func (p *Policy) CountBypass() { p.S.Bypass.Add(1) }

// CountBypassDeferred counts a PD request split instead of bypassed
// because its decode was computing other bypassed requests' prompts.
func (p *Policy) CountBypassDeferred() { p.S.BypassDeferred.Add(1) }

// BlockSize is the tokens per block of the index.
func (p *Policy) BlockSize() int { return p.o.Index.BlockSize() }

// Pick implements policy.Policy.
func (p *Policy) Pick(req *policy.Request, c policy.Candidates) (policy.Choice, error) {
	if req == nil {
		req = &policy.Request{}
	}
	pr, _ := req.Prepared.(*prepared)
	if pr == nil {
		p.S.FallbackNoTokens.Add(1)
		return p.fallback(req, c, "not tokenized")
	}
	streams := 0
	for _, w := range c.Workers {
		if req.Usable(w) && p.o.HasEvents(w.Key()) {
			streams++
		}
	}
	if streams == 0 {
		p.S.FallbackNoEvents.Add(1)
		ch, err := p.fallback(req, c, "no candidate publishes KV events")
		if err == nil {
			// Recorded as kv_aware's own picks are: a fleet of fresh
			// engines publishes nothing before its first requests, and
			// once the events flow, the prompts routed before them must
			// still draw their followers to the same workers.
			p.pickMu.Lock()
			now := p.o.Now()
			cached, indexed := p.cachedBlocks(req, now)
			_, stored := p.o.Index.WorkerState(ch.Worker.Key())
			p.record(pr, ch.Worker.Key(), cached, indexed, stored, now)
			p.pickMu.Unlock()
		}
		return ch, err
	}
	n := len(req.Tokens)
	bs := p.o.Index.BlockSize()
	p.pickMu.Lock()
	now := p.o.Now()
	cached, indexed := p.cachedBlocks(req, now)
	best, bestLoad, stored := p.choose(req, c, cached, n, bs, now)
	if best < 0 {
		p.pickMu.Unlock()
		return policy.Choice{}, policy.ErrNoWorker
	}
	w := c.Workers[best]
	hit := cached[w.Key()]
	p.record(pr, w.Key(), cached, indexed, stored, now)
	p.pickMu.Unlock()
	p.dec.Record(p.o.Metrics, Name, w) // the fallback's picks count as its own
	p.S.Picks.Add(1)
	p.S.PromptTokens.Add(uint64(n))
	p.S.MatchedTokens.Add(uint64(hit * bs))
	if hit > 0 {
		p.S.Hits.Add(1)
	}
	reason := fmt.Sprintf("kv match %d/%d blocks, load %d", hit, len(pr.keys), bestLoad)
	return policy.Choice{Worker: w, Reason: reason + elsewhere(cached, w.Key())}, nil
}

// record keeps a routed prompt's blocks on worker as speculative entries
// for SpeculativeTTL, so that the next pick sees them before the engine's
// events do. The blocks the index already holds for worker need none:
// match continues from them. stored is the index's running count of
// blocks stored for worker. Call with pickMu held.
func (p *Policy) record(pr *prepared, worker string, cached, indexed map[string]int, stored uint64, now time.Time) {
	if d := indexed[worker]; p.o.Speculative && d < len(pr.keys) {
		p.spec.insert(pr.keys[d:], worker, now, p.o.SpeculativeTTL, len(pr.keys)-cached[worker], stored)
	}
}

// elsewhere lists, for the route receipt, the other workers holding part
// of the prompt: ", elsewhere URL=blocks ..." with the most blocks first,
// at most 4 ("" when none).
func elsewhere(cached map[string]int, chosen string) string {
	type held struct {
		key    string
		blocks int
	}
	var hs []held
	for k, n := range cached {
		if k != chosen && n > 0 {
			hs = append(hs, held{k, n})
		}
	}
	if len(hs) == 0 {
		return ""
	}
	slices.SortFunc(hs, func(a, b held) int {
		if a.blocks != b.blocks {
			return b.blocks - a.blocks
		}
		return strings.Compare(a.key, b.key)
	})
	var b strings.Builder
	b.WriteString(", elsewhere")
	for i, h := range hs {
		if i == 4 {
			fmt.Fprintf(&b, " (+%d more)", len(hs)-4)
			break
		}
		fmt.Fprintf(&b, " %s=%d", h.key, h.blocks)
	}
	return b.String()
}

// candidate is one usable worker's score.
type candidate struct {
	i      int
	cost   float64
	load   int64
	blocks int
	stored uint64
	// Tie-breaks: requests still in their prefill, requests ever sent.
	prefilling int64
	total      uint64
}

// compare ranks k against b in choose's order: fewer blocks, then lower
// cost, load, requests awaiting their first byte and requests sent so far
// (-1: k first, 1: b first, 0: equal).
func (k *candidate) compare(b *candidate) int {
	return cmp.Or(cmp.Compare(k.blocks, b.blocks), cmp.Compare(k.cost, b.cost), cmp.Compare(k.load, b.load),
		cmp.Compare(k.prefilling, b.prefilling), cmp.Compare(k.total, b.total))
}

// choose returns the index of the worker to route to (-1: none usable),
// its load and the index's running count of blocks stored for it. Costs
// within TieBand × prompt tokens of the lowest count as equal: among those
// the worker holding fewer blocks wins (a new prefix goes where it evicts
// least, as cache_aware's smallest tree), then the lower cost, then the
// less loaded, then the one with fewer requests awaiting their first byte,
// then the one sent fewer requests so far (round-robin's even spread where
// nothing else differs), then one at random. A worker's load is its
// requests in flight, those awaiting their first byte counted twice on a
// worker that is not a prefill. A worker whose engine has evicted
// (Index.Evicting) counts as holding more than any other: its cache is
// full, so it has no room to offer, and among full workers the cost and
// the load decide (with every cache full, the block counts would only be
// noise). A worker's blocks are those its events
// reported plus, with speculative entries, the new blocks of the prompts
// sent to it that its events have not yet confirmed: a burst of new
// prefixes is spread at once, not piled on the worker whose events lag
// (or whose in-flight count has not yet grown).
func (p *Policy) choose(req *policy.Request, c policy.Candidates, cached map[string]int, n, bs int, now time.Time) (int, int64, uint64) {
	var buf [16]candidate
	cs := buf[:0]
	minCost := math.Inf(1)
	for i, w := range c.Workers {
		if !req.Usable(w) {
			continue
		}
		load := p.load(w)
		if w.Role != worker.RolePrefill {
			// A request still awaiting its first byte is in the engine's
			// prefill, which a new prompt queues behind: it counts twice.
			// (Every request on a prefill worker is one; there it would only
			// double the weight.)
			load += w.Prefilling()
		}
		uncached := n - cached[w.Key()]*bs
		cost := p.o.OverlapWeight*float64(uncached) + p.o.LoadWeight*float64(n)*float64(load)
		cs = append(cs, candidate{i: i, cost: cost, load: load})
		minCost = min(minCost, cost)
	}
	limit := minCost + p.o.TieBand*float64(n)
	var best *candidate
	ties := 0
	for j := range cs {
		k := &cs[j]
		if k.cost > limit {
			continue
		}
		key := c.Workers[k.i].Key()
		k.blocks, k.stored = p.o.Index.WorkerState(key)
		if p.o.Speculative {
			k.blocks += p.spec.pending(key, k.stored, now)
		}
		if p.o.Index.Evicting(key) {
			// Full: no room to find there, and full workers are alike.
			k.blocks = math.MaxInt
		}
		w := c.Workers[k.i]
		k.prefilling, k.total = w.Prefilling(), w.TotalRequests()
		if best == nil {
			best, ties = k, 1
			continue
		}
		switch k.compare(best) {
		case -1:
			best, ties = k, 1
		case 0:
			ties++
			if rand.IntN(ties) == 0 {
				best = k
			}
		}
	}
	if best == nil {
		return -1, 0, 0
	}
	return best.i, best.load, best.stored
}

func (p *Policy) fallback(req *policy.Request, c policy.Candidates, why string) (policy.Choice, error) {
	ch, err := p.o.Fallback.Pick(req, c)
	if err == nil {
		ch.Reason = "kv_aware fallback (" + why + "): " + ch.Reason
	}
	return ch, err
}

func (p *Policy) load(w *worker.Worker) int64 {
	l := w.Load()
	if !p.o.LocalLoadOnly {
		if pl := w.PolledLoad(); pl > l {
			l = pl
		}
	}
	return l
}

// Close releases the fallback policy.
func (p *Policy) Close() error { return policy.Close(p.o.Fallback) }

// RemoveWorker forgets a worker's speculative entries and tells the
// fallback policy.
func (p *Policy) RemoveWorker(key string) {
	p.spec.removeWorker(key)
	policy.RemoveWorker(p.o.Fallback, key)
}

// speculative holds the blocks of recently routed prompts on the worker
// they were sent to, until a TTL: the engine's events confirm (or not)
// within that time.
type speculative struct {
	mu    sync.Mutex
	m     map[uint64]specOwners // block key → workers holding it speculatively
	q     []specBatch           // one per routed prompt, in insertion order
	head  int                   // q[:head] are gone
	count int                   // keys in q[head:]
	max   int

	// pend: per worker, the new blocks of the prompts routed to it within
	// the TTL, to be confirmed by its events.
	pend map[string]*pendingQ
}

// pendingQ is one worker's routed prompts awaiting their events, oldest
// first.
type pendingQ struct {
	items []pendingItem
	head  int
	sum   int // blocks of items[head:]
}

// pendingItem: blocks the worker did not hold when a prompt was routed to
// it, and the index's count of blocks stored for it then.
type pendingItem struct {
	exp    time.Time
	blocks int
	base   uint64
}

type specOwner struct {
	worker string
	exp    time.Time
}

// specOwners is a key's speculative holders: the first inline (most keys
// have one: no allocation per key), the others in a slice.
type specOwners struct {
	one  specOwner
	more []specOwner
}

func (os *specOwners) n() int { return 1 + len(os.more) }

func (os *specOwners) at(i int) *specOwner {
	if i == 0 {
		return &os.one
	}
	return &os.more[i-1]
}

// find returns the index of worker's entry, -1 when it has none.
func (os *specOwners) find(worker string) int {
	for i := range os.n() {
		if os.at(i).worker == worker {
			return i
		}
	}
	return -1
}

// del removes entry i; it reports whether none is left.
func (os *specOwners) del(i int) bool {
	if len(os.more) == 0 {
		return true
	}
	if i == 0 {
		os.one = os.more[0]
		i = 1
	}
	os.more = slices.Delete(os.more, i-1, i)
	return false
}

// specBatch is one routed prompt's keys (the request's own slice, never
// written after Prepare) on one worker.
type specBatch struct {
	keys   []uint64
	worker string
	exp    time.Time
}

func newSpeculative(max int) *speculative {
	return &speculative{m: map[uint64]specOwners{}, max: max, pend: map[string]*pendingQ{}}
}

// insert records keys on worker until now+ttl, newBlocks of them not held
// by the worker when the index had stored stored blocks for it. Entries
// expire in insertion order (one TTL for all), so pruning pops from the
// head.
func (s *speculative) insert(keys []uint64, worker string, now time.Time, ttl time.Duration, newBlocks int, stored uint64) {
	if len(keys) > s.max {
		keys = keys[:s.max]
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if newBlocks > 0 {
		q := s.pend[worker]
		if q == nil {
			q = &pendingQ{}
			s.pend[worker] = q
		}
		q.prune(now)
		q.items = append(q.items, pendingItem{exp: now.Add(ttl), blocks: newBlocks, base: stored})
		q.sum += newBlocks
	}
	for s.head < len(s.q) && (s.count+len(keys) > s.max || !s.q[s.head].exp.After(now)) {
		s.dropHead()
	}
	if s.head == len(s.q) || s.head > len(s.q)/2 {
		n := copy(s.q, s.q[s.head:])
		clear(s.q[n:])
		s.q, s.head = s.q[:n], 0
	}
	exp := now.Add(ttl)
	for _, k := range keys {
		os, ok := s.m[k]
		switch i := os.find(worker); {
		case !ok:
			os.one = specOwner{worker, exp}
		case i < 0:
			os.more = append(os.more, specOwner{worker, exp})
		default:
			os.at(i).exp = exp
		}
		s.m[k] = os
	}
	s.q = append(s.q, specBatch{keys, worker, exp})
	s.count += len(keys)
}

// dropHead forgets the oldest batch's entries that no later insertion
// renewed.
func (s *speculative) dropHead() {
	b := s.q[s.head]
	s.q[s.head] = specBatch{}
	s.head++
	s.count -= len(b.keys)
	for _, k := range b.keys {
		os, ok := s.m[k]
		i := os.find(b.worker)
		if !ok || i < 0 || !os.at(i).exp.Equal(b.exp) {
			continue
		}
		if os.del(i) {
			delete(s.m, k)
		} else {
			s.m[k] = os
		}
	}
}

// pending is how many of the new blocks routed to worker within the TTL
// its events have not yet confirmed, stored being the index's running
// count of blocks stored for it: the blocks stored since the oldest such
// prompt was routed count against them all.
func (s *speculative) pending(worker string, stored uint64, now time.Time) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.pend[worker]
	if q == nil {
		return 0
	}
	q.prune(now)
	if q.head == len(q.items) {
		return 0
	}
	var confirmed uint64
	if base := q.items[q.head].base; stored > base {
		confirmed = stored - base
	}
	if confirmed >= uint64(q.sum) {
		return 0
	}
	return q.sum - int(confirmed)
}

// prune drops the expired items.
func (q *pendingQ) prune(now time.Time) {
	for q.head < len(q.items) && !q.items[q.head].exp.After(now) {
		q.sum -= q.items[q.head].blocks
		q.head++
	}
	if q.head == len(q.items) || q.head > len(q.items)/2 {
		n := copy(q.items, q.items[q.head:])
		q.items, q.head = q.items[:n], 0
	}
}

// match returns, per worker, how many leading blocks of keys it holds by
// the index (from: its depth there) and its speculative entries after
// them; a worker absent from from starts at the first key.
func (s *speculative) match(keys []uint64, from map[string]int, now time.Time) map[string]int {
	if len(keys) == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	var depth map[string]int
	extend := func(worker string, d int) {
		e := d
		for e < len(keys) && s.holds(keys[e], worker, now) {
			e++
		}
		if e > d {
			if depth == nil {
				depth = map[string]int{}
			}
			depth[worker] = e
		}
	}
	for w, d := range from {
		extend(w, d)
	}
	if os, ok := s.m[keys[0]]; ok {
		for i := range os.n() {
			if o := os.at(i); o.exp.After(now) {
				if _, done := from[o.worker]; !done {
					extend(o.worker, 0)
				}
			}
		}
	}
	return depth
}

// holds reports whether worker has a live speculative entry for key.
func (s *speculative) holds(key uint64, worker string, now time.Time) bool {
	os, ok := s.m[key]
	if !ok {
		return false
	}
	i := os.find(worker)
	return i >= 0 && os.at(i).exp.After(now)
}

func (s *speculative) removeWorker(worker string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pend, worker)
	for k, os := range s.m {
		i := os.find(worker)
		switch {
		case i < 0:
		case os.del(i):
			delete(s.m, k)
		default:
			s.m[k] = os
		}
	}
}
