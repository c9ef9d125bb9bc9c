package pd

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestSeriesCache: observations and increments from several goroutines,
// over label sets first seen concurrently, land in the right children,
// none lost or misfiled (two vectors share the cache and label values).
func TestSeriesCache(t *testing.T) {
	e := &Engine{}
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h", Help: "h", Buckets: []float64{1}}, []string{"a", "b"})
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c", Help: "c"}, []string{"a"})
	const goroutines, each = 8, 300
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				a := fmt.Sprintf("x%d", (g+i)%3)
				e.observe(h, 0.5, a, "y")
				e.inc(c, a)
				if i%2 == 0 {
					e.inc(c, "x0")
				}
			}
		})
	}
	wg.Wait()
	n := map[string]int{}
	for g := range goroutines {
		for i := range each {
			n[fmt.Sprintf("x%d", (g+i)%3)]++
		}
	}
	var wantH, wantC strings.Builder
	wantH.WriteString("# HELP h h\n# TYPE h histogram\n")
	wantC.WriteString("# HELP c c\n# TYPE c counter\n")
	for _, a := range []string{"x0", "x1", "x2"} {
		k := n[a]
		fmt.Fprintf(&wantH, "h_bucket{a=%q,b=\"y\",le=\"1\"} %d\nh_bucket{a=%q,b=\"y\",le=\"+Inf\"} %d\nh_sum{a=%q,b=\"y\"} %g\nh_count{a=%q,b=\"y\"} %d\n",
			a, k, a, k, a, float64(k)/2, a, k)
		if a == "x0" {
			k += goroutines * each / 2
		}
		fmt.Fprintf(&wantC, "c{a=%q} %d\n", a, k)
	}
	if err := testutil.CollectAndCompare(h, strings.NewReader(wantH.String())); err != nil {
		t.Error(err)
	}
	if err := testutil.CollectAndCompare(c, strings.NewReader(wantC.String())); err != nil {
		t.Error(err)
	}
}
