package pd

import (
	"maps"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// The PD timing histograms and the per-route counters a request updates
// are resolved once per label set and kept in Engine.series: their labels
// (connector and order, route) come from small fixed sets, and a label
// lookup per use hashes the labels and takes the vector's lock.

// seriesKey is one child: its vector and label values (b empty for a
// vector of one label).
type seriesKey struct {
	vec  any // *prometheus.HistogramVec or *prometheus.CounterVec
	a, b string
}

// seriesCache holds the children resolved so far. A lookup reads an
// immutable map through one atomic load (no lock, no hashing of an
// interface key as sync.Map does); a new child, rare since label sets are
// few, copies the map under mu.
type seriesCache struct {
	mu       sync.Mutex
	observer atomic.Pointer[map[seriesKey]prometheus.Observer]
	counter  atomic.Pointer[map[seriesKey]prometheus.Counter]
}

// cached returns m's child for k, resolving it with resolve (under mu) the
// first time.
func cached[V any](mu *sync.Mutex, m *atomic.Pointer[map[seriesKey]V], k seriesKey, resolve func() V) V {
	if cur := m.Load(); cur != nil {
		if v, ok := (*cur)[k]; ok {
			return v
		}
	}
	mu.Lock()
	defer mu.Unlock()
	cur := m.Load()
	if cur != nil {
		if v, ok := (*cur)[k]; ok {
			return v
		}
	}
	next := map[seriesKey]V{}
	if cur != nil {
		next = maps.Clone(*cur)
	}
	v := resolve()
	next[k] = v
	m.Store(&next)
	return v
}

// observe records v in vec's child of labels a (and b, for a vector of two
// labels).
func (e *Engine) observe(vec *prometheus.HistogramVec, v float64, a string, b ...string) {
	k := seriesKey{vec: vec, a: a}
	if len(b) > 0 {
		k.b = b[0]
	}
	o := cached(&e.series.mu, &e.series.observer, k, func() prometheus.Observer {
		if len(b) > 0 {
			return vec.WithLabelValues(a, b[0])
		}
		return vec.WithLabelValues(a)
	})
	o.Observe(v)
}

// inc adds one to vec's child of label a.
func (e *Engine) inc(vec *prometheus.CounterVec, a string) {
	c := cached(&e.series.mu, &e.series.counter, seriesKey{vec: vec, a: a}, func() prometheus.Counter {
		return vec.WithLabelValues(a)
	})
	c.Inc()
}
