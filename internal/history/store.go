// Package history remembers which worker stored each Responses API object
// the router relayed (--history-backend memory), so that retrieving it
// (GET /v1/responses/{id}), cancelling it, or continuing the conversation
// (a new /v1/responses with previous_response_id) goes straight to that
// worker instead of asking every worker.
//
// The store is bounded (MaxEntries, oldest evicted first) and every entry
// expires TTL after it was learned. An unknown id is a miss: callers fall
// back to asking every worker, so forgetting an id costs a fan-out, never a
// wrong answer.
package history

import (
	"container/list"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Defaults for the zero Options fields.
const (
	DefaultMaxEntries = 100_000
	DefaultTTL        = 24 * time.Hour
)

// Lookup kinds (the "op" label of the lookup metric).
const (
	OpRetrieve = "retrieve"          // GET /v1/responses/{id}
	OpCancel   = "cancel"            // POST /v1/responses/{id}/cancel
	OpPrevious = "previous_response" // POST /v1/responses with previous_response_id
)

// Options configures a Store.
type Options struct {
	MaxEntries int           // <= 0 → DefaultMaxEntries
	TTL        time.Duration // <= 0 → DefaultTTL
	// Registerer receives the store's metrics (nil = not exported).
	Registerer prometheus.Registerer
	Now        func() time.Time // nil → time.Now (tests)
}

// Store maps response ids to the base URL of the worker that stored them.
// It is safe for concurrent use.
type Store struct {
	max int
	ttl time.Duration
	now func() time.Time

	mu    sync.Mutex
	m     map[string]*list.Element // id → element of order
	order *list.List               // of *entry, oldest learned at the front

	lookups *prometheus.CounterVec // op, result: hit|miss
	learned prometheus.Counter
	evicted *prometheus.CounterVec // reason: capacity|expired|worker_removed
	entries prometheus.Gauge
}

type entry struct {
	id      string
	url     string
	expires time.Time
}

// New builds a Store and registers its metrics on o.Registerer.
func New(o Options) (*Store, error) {
	s := &Store{max: o.MaxEntries, ttl: o.TTL, now: o.Now, m: map[string]*list.Element{}, order: list.New()}
	if s.max <= 0 {
		s.max = DefaultMaxEntries
	}
	if s.ttl <= 0 {
		s.ttl = DefaultTTL
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.lookups = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_history_lookups_total",
		Help: "Responses API id lookups in the history store, by op (retrieve, cancel, previous_response) and result (hit: sent to the owner only; miss: asked every worker or routed by the policy).",
	}, []string{"op", "result"})
	s.learned = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "vllm_router_history_learned_total",
		Help: "Responses API ids learned from relayed /v1/responses answers.",
	})
	s.evicted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm_router_history_evicted_total",
		Help: "History entries dropped, by reason (capacity, expired, worker_removed).",
	}, []string{"reason"})
	s.entries = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm_router_history_entries",
		Help: "Response ids currently remembered by the history store.",
	})
	if o.Registerer != nil {
		for _, c := range []prometheus.Collector{s.lookups, s.learned, s.evicted, s.entries} {
			if err := o.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return s, nil
}

// Put remembers that the worker at url stored the response id. Learning an
// id again moves it to the newest position with a fresh TTL.
func (s *Store) Put(id, url string) {
	if id == "" || url == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.expireLocked(now)
	if e, ok := s.m[id]; ok {
		en := e.Value.(*entry)
		en.url, en.expires = url, now.Add(s.ttl)
		s.order.MoveToBack(e)
	} else {
		s.m[id] = s.order.PushBack(&entry{id: id, url: url, expires: now.Add(s.ttl)})
	}
	for s.order.Len() > s.max {
		s.removeLocked(s.order.Front(), "capacity")
	}
	s.learned.Inc()
	s.entries.Set(float64(s.order.Len()))
}

// Owner returns the base URL of the worker that stored id, and counts a hit
// or a miss for op.
func (s *Store) Owner(op, id string) (string, bool) {
	url, ok := s.Peek(id)
	s.Count(op, ok)
	return url, ok
}

// Count records one lookup for op: a hit (the request went to the owner
// only) or a miss.
func (s *Store) Count(op string, hit bool) {
	res := "miss"
	if hit {
		res = "hit"
	}
	s.lookups.WithLabelValues(op, res).Inc()
}

// Peek is Owner without counting the lookup.
func (s *Store) Peek(id string) (string, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	s.expireLocked(now)
	e, ok := s.m[id]
	if !ok {
		return "", false
	}
	return e.Value.(*entry).url, true
}

// ForgetWorker drops every id stored on the worker at url (it left the
// fleet: its responses are gone with it, or will be found by a fan-out if
// it comes back).
func (s *Store) ForgetWorker(url string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for e := s.order.Front(); e != nil; {
		next := e.Next()
		if e.Value.(*entry).url == url {
			s.removeLocked(e, "worker_removed")
		}
		e = next
	}
	s.entries.Set(float64(s.order.Len()))
}

// Len is the number of live entries.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.expireLocked(s.now())
	return s.order.Len()
}

// expireLocked drops expired entries. Every entry has the same TTL, so the
// oldest learned expires first and the scan stops at the first live one.
func (s *Store) expireLocked(now time.Time) {
	n := s.order.Len()
	for e := s.order.Front(); e != nil && !now.Before(e.Value.(*entry).expires); e = s.order.Front() {
		s.removeLocked(e, "expired")
	}
	if s.order.Len() != n {
		s.entries.Set(float64(s.order.Len()))
	}
}

func (s *Store) removeLocked(e *list.Element, reason string) {
	en := s.order.Remove(e).(*entry)
	delete(s.m, en.id)
	s.evicted.WithLabelValues(reason).Inc()
}
