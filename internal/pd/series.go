package pd

import "github.com/prometheus/client_golang/prometheus"

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

// observe records v in vec's child of labels a (and b, for a vector of two
// labels).
func (e *Engine) observe(vec *prometheus.HistogramVec, v float64, a string, b ...string) {
	k := seriesKey{vec: vec, a: a}
	if len(b) > 0 {
		k.b = b[0]
	}
	if o, ok := e.series.Load(k); ok {
		o.(prometheus.Observer).Observe(v)
		return
	}
	var o prometheus.Observer
	if len(b) > 0 {
		o = vec.WithLabelValues(a, b[0])
	} else {
		o = vec.WithLabelValues(a)
	}
	e.series.Store(k, o)
	o.Observe(v)
}

// inc adds one to vec's child of label a.
func (e *Engine) inc(vec *prometheus.CounterVec, a string) {
	k := seriesKey{vec: vec, a: a}
	if c, ok := e.series.Load(k); ok {
		c.(prometheus.Counter).Inc()
		return
	}
	c := vec.WithLabelValues(a)
	e.series.Store(k, c)
	c.Inc()
}
