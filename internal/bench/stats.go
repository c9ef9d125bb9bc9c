package bench

import (
	"math"
	"slices"
)

// Stats summarises one latency metric in milliseconds, as vLLM reports it:
// mean, median and population standard deviation (numpy.mean, numpy.median,
// numpy.std with ddof=0) and the selected percentiles (numpy.percentile with
// the default "linear" method). An empty sample reports zeros, like vLLM's
// `np.mean(values or 0)`.
type Stats struct {
	Mean        float64
	Median      float64
	Std         float64
	Percentiles []Percentile
	// sorted holds the sample in ms, ascending, so further percentiles can be
	// computed after the run (see Result.Percentile).
	sorted []float64
}

// Percentile is one reported percentile: P in [0,100], Value in ms.
type Percentile struct {
	P     float64
	Value float64
}

// N is the number of samples the statistics were computed from.
func (s Stats) N() int { return len(s.sorted) }

// At returns the p-th percentile (0..100) of the sample with numpy's linear
// interpolation, or 0 for an empty sample.
func (s Stats) At(p float64) float64 { return percentileSorted(s.sorted, p) }

// PercentileSorted is the p-th percentile (0..100) of an ascending sample
// with numpy's linear interpolation (0 for an empty one), for samples
// gathered outside a Result.
func PercentileSorted(sorted []float64, p float64) float64 { return percentileSorted(sorted, p) }

// newStats computes Stats over values (in seconds) and converts to ms.
func newStats(valuesSec []float64, percentiles []float64) Stats {
	ms := make([]float64, len(valuesSec))
	for i, v := range valuesSec {
		ms[i] = v * 1000
	}
	slices.Sort(ms)
	st := Stats{sorted: ms}
	st.Mean = mean(ms)
	st.Median = median(ms)
	st.Std = stddev(ms, st.Mean)
	st.Percentiles = make([]Percentile, len(percentiles))
	for i, p := range percentiles {
		st.Percentiles[i] = Percentile{P: p, Value: percentileSorted(ms, p)}
	}
	return st
}

// median is numpy.median: the middle element, or the mean of the two middle
// elements for an even count.
func median(a []float64) float64 {
	n := len(a)
	switch {
	case n == 0:
		return 0
	case n%2 == 1:
		return a[n/2]
	}
	return (a[n/2-1] + a[n/2]) / 2
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// stddev is the population standard deviation (numpy ddof=0).
func stddev(v []float64, m float64) float64 {
	if len(v) == 0 {
		return 0
	}
	var s float64
	for _, x := range v {
		d := x - m
		s += d * d
	}
	return math.Sqrt(s / float64(len(v)))
}

// percentileSorted is numpy.percentile(a, p) for an ascending a with the
// default method="linear": virtual index p/100*(n-1), then numpy's _lerp,
// which interpolates from the upper neighbour when the fraction is >= 0.5 so
// results match numpy bit for bit in the common cases.
func percentileSorted(a []float64, p float64) float64 {
	n := len(a)
	switch {
	case n == 0:
		return 0
	case n == 1:
		return a[0]
	}
	q := p / 100
	idx := q * float64(n-1)
	lo := math.Floor(idx)
	if lo < 0 {
		lo = 0
	}
	if lo > float64(n-1) {
		lo = float64(n - 1)
	}
	hi := lo + 1
	if hi > float64(n-1) {
		hi = float64(n - 1)
	}
	t := idx - lo
	x, y := a[int(lo)], a[int(hi)]
	d := y - x
	if t >= 0.5 {
		return y - d*(1-t)
	}
	return x + d*t
}
