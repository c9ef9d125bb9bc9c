package bench

import (
	"math"
	"testing"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

// Expected values are numpy.percentile(a, p) (method="linear"), worked by
// hand: index = p/100*(n-1), interpolate between the neighbours.
func TestPercentileMatchesNumpyLinear(t *testing.T) {
	cases := []struct {
		a    []float64
		p    float64
		want float64
	}{
		{nil, 99, 0},
		{[]float64{10}, 99, 10},
		{[]float64{1, 2, 3, 4}, 99, 3.97},         // index 2.97
		{[]float64{1, 2, 3, 4}, 50, 2.5},          // index 1.5
		{[]float64{1, 2, 3, 4}, 25, 1.75},         // index 0.75
		{[]float64{1, 2, 3, 4}, 0, 1},             // index 0
		{[]float64{1, 2, 3, 4}, 100, 4},           // index 3
		{[]float64{15, 20, 35, 40, 50}, 40, 29},   // index 1.6: 20 + 0.6*15
		{[]float64{15, 20, 35, 40, 50}, 99, 49.6}, // index 3.96: 50 - 0.04*10
		{[]float64{15, 20, 35, 40, 50}, 90, 46},   // index 3.6: 40 + 0.6*10
		{[]float64{5, 5, 5}, 99.9, 5},
	}
	for _, c := range cases {
		if got := percentileSorted(c.a, c.p); !near(got, c.want) {
			t.Errorf("percentile(%v, %v) = %v, want %v", c.a, c.p, got, c.want)
		}
	}
}

func TestStatsMeanMedianStd(t *testing.T) {
	// Seconds in, ms out.
	st := newStats([]float64{0.004, 0.001, 0.003, 0.002}, []float64{50, 99})
	if !near(st.Mean, 2.5) || !near(st.Median, 2.5) {
		t.Errorf("mean/median = %v/%v, want 2.5/2.5", st.Mean, st.Median)
	}
	// numpy.std([1,2,3,4]) = sqrt(1.25)
	if !near(st.Std, math.Sqrt(1.25)) {
		t.Errorf("std = %v, want %v", st.Std, math.Sqrt(1.25))
	}
	if !near(st.Percentiles[0].Value, 2.5) || !near(st.Percentiles[1].Value, 3.97) {
		t.Errorf("percentiles = %+v", st.Percentiles)
	}
	odd := newStats([]float64{0.003, 0.001, 0.010}, nil)
	if !near(odd.Median, 3) {
		t.Errorf("odd median = %v, want 3", odd.Median)
	}
	empty := newStats(nil, []float64{99})
	if empty.Mean != 0 || empty.Median != 0 || empty.Std != 0 || empty.Percentiles[0].Value != 0 {
		t.Errorf("empty stats = %+v, want zeros", empty)
	}
}
