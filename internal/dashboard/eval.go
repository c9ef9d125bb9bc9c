package dashboard

import (
	"io"
	"math"
	"sort"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Snapshot is one scrape of /metrics.
type Snapshot struct {
	At       time.Time
	Families map[string]*dto.MetricFamily
}

// Parse reads a text exposition taken at at.
func Parse(r io.Reader, at time.Time) (Snapshot, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	return Snapshot{At: at, Families: fams}, err
}

// Line is one evaluated series: Y[i] at X[i] seconds after the first
// snapshot; NaN where there is no value (Grafana's gap).
type Line struct {
	Name string
	X, Y []float64
}

// Eval evaluates q at every snapshot. Rates and quantiles use the samples
// `window` snapshots back (like a range of window scrape intervals);
// points without enough history, or with no events in the window, are NaN.
func Eval(q Query, snaps []Snapshot, window int) []Line {
	if len(snaps) == 0 {
		return nil
	}
	window = max(window, 1)
	t0 := snaps[0].At
	series := map[string]*Line{}
	var order []string
	put := func(i int, key string, v float64) {
		l, ok := series[key]
		if !ok {
			l = &Line{Name: key, X: make([]float64, len(snaps)), Y: make([]float64, len(snaps))}
			for k := range snaps {
				l.X[k] = snaps[k].At.Sub(t0).Seconds()
				l.Y[k] = math.NaN()
			}
			series[key] = l
			order = append(order, key)
		}
		l.Y[i] = v
	}
	for i, s := range snaps {
		switch q.Kind {
		case Gauge:
			for k, v := range q.sumBy(s, scalar) {
				put(i, k, v)
			}
		case Rate, Mean, Quantile:
			if i < window {
				continue
			}
			prev := snaps[i-window]
			dt := s.At.Sub(prev.At).Seconds()
			if dt <= 0 {
				continue
			}
			switch q.Kind {
			case Rate:
				cur, old := q.sumBy(s, scalar), q.sumBy(prev, scalar)
				for k, v := range cur {
					put(i, k, increase(v, old[k])/dt)
				}
			case Mean:
				cs, os := q.sumBy(s, histSum), q.sumBy(prev, histSum)
				cc, oc := q.sumBy(s, histCount), q.sumBy(prev, histCount)
				for k := range cc {
					if n := increase(cc[k], oc[k]); n > 0 {
						put(i, k, increase(cs[k], os[k])/n)
					}
				}
			case Quantile:
				cur, old := q.buckets(s), q.buckets(prev)
				for k, b := range cur {
					if v, ok := quantile(q.Q, b, old[k]); ok {
						put(i, k, v)
					}
				}
			}
		}
	}
	sort.Strings(order)
	out := make([]Line, 0, len(order))
	for _, k := range order {
		l := *series[k]
		l.Name = q.legendFor(k)
		out = append(out, l)
	}
	return out
}

// increase is a counter's increase between two samples (a reset restarts
// from zero, as in PromQL).
func increase(cur, old float64) float64 {
	if cur < old {
		return cur
	}
	return cur - old
}

func scalar(m *dto.Metric) float64 {
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Untyped != nil:
		return m.Untyped.GetValue()
	}
	return math.NaN()
}

func histSum(m *dto.Metric) float64   { return m.GetHistogram().GetSampleSum() }
func histCount(m *dto.Metric) float64 { return float64(m.GetHistogram().GetSampleCount()) }

// matches applies the equality matchers.
func (q Query) matches(m *dto.Metric) bool {
	if len(q.Match) == 0 {
		return true
	}
	n := 0
	for _, l := range m.GetLabel() {
		if v, ok := q.Match[l.GetName()]; ok {
			if v != l.GetValue() {
				return false
			}
			n++
		}
	}
	return n == len(q.Match)
}

// groupKey is the values of the By labels, joined by "\x00".
func (q Query) groupKey(m *dto.Metric) string {
	if len(q.By) == 0 {
		return ""
	}
	vals := make([]string, len(q.By))
	for _, l := range m.GetLabel() {
		for i, b := range q.By {
			if l.GetName() == b {
				vals[i] = l.GetValue()
			}
		}
	}
	return strings.Join(vals, "\x00")
}

func (q Query) sumBy(s Snapshot, val func(*dto.Metric) float64) map[string]float64 {
	out := map[string]float64{}
	mf := s.Families[q.Metric]
	if mf == nil {
		return out
	}
	for _, m := range mf.GetMetric() {
		if !q.matches(m) {
			continue
		}
		if v := val(m); !math.IsNaN(v) {
			out[q.groupKey(m)] += v
		}
	}
	return out
}

// bucket is a cumulative histogram bucket.
type bucket struct {
	le    float64
	count float64
}

// buckets sums the cumulative buckets (+Inf included) per group.
func (q Query) buckets(s Snapshot) map[string][]bucket {
	out := map[string][]bucket{}
	mf := s.Families[q.Metric]
	if mf == nil {
		return out
	}
	for _, m := range mf.GetMetric() {
		h := m.GetHistogram()
		if h == nil || !q.matches(m) {
			continue
		}
		k := q.groupKey(m)
		bs := out[k]
		src := h.GetBucket()
		if bs == nil {
			bs = make([]bucket, len(src)+1)
			for i, b := range src {
				bs[i].le = b.GetUpperBound()
			}
			bs[len(src)].le = math.Inf(1)
		}
		if len(bs) != len(src)+1 {
			continue // bucket layouts differ: cannot add
		}
		for i, b := range src {
			bs[i].count += float64(b.GetCumulativeCount())
		}
		bs[len(src)].count += float64(h.GetSampleCount())
		out[k] = bs
	}
	return out
}

// quantile is PromQL's histogram_quantile over the bucket increases
// between old and cur: linear interpolation inside the bucket holding the
// rank; the highest finite bound when the rank falls in +Inf.
func quantile(q float64, cur, old []bucket) (float64, bool) {
	if len(cur) == 0 {
		return 0, false
	}
	inc := make([]float64, len(cur))
	for i := range cur {
		o := 0.0
		if len(old) == len(cur) {
			o = old[i].count
		}
		inc[i] = increase(cur[i].count, o)
	}
	total := inc[len(inc)-1]
	if total <= 0 {
		return 0, false
	}
	rank := q * total
	for i := range cur {
		if inc[i] < rank {
			continue
		}
		if math.IsInf(cur[i].le, 1) {
			if i == 0 {
				return 0, false
			}
			return cur[i-1].le, true
		}
		lo, below := 0.0, 0.0
		if i > 0 {
			lo, below = cur[i-1].le, inc[i-1]
		}
		in := inc[i] - below
		if in <= 0 {
			return cur[i].le, true
		}
		return lo + (cur[i].le-lo)*(rank-below)/in, true
	}
	return cur[len(cur)-1].le, true
}

// legendFor fills the Grafana legendFormat with a group's label values
// (the group key from groupKey).
func (q Query) legendFor(key string) string {
	vals := strings.Split(key, "\x00")
	if q.Legend == "" {
		return strings.Join(vals, " ")
	}
	out := q.Legend
	for i, b := range q.By {
		if i < len(vals) {
			out = strings.ReplaceAll(out, "{{"+b+"}}", vals[i])
		}
	}
	return strings.TrimSpace(out)
}
