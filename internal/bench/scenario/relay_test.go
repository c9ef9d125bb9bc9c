package scenario

import (
	"bufio"
	"context"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestPacedStreamsSpreadTheirPhases: streams that start together do not
// send their events together. Each stream's phase within the interval is
// random, so 16 streams started at once have their first events spread over
// more than a quarter of the interval (all within one quarter by chance:
// about 4 × 4⁻¹⁶). Paced from their arrival instead, they would arrive
// within a few milliseconds of each other, as closely as the target under
// test forwarded them.
func TestPacedStreamsSpreadTheirPhases(t *testing.T) {
	const interval, n = 80 * time.Millisecond, 16
	w, err := startPacedWorker(1, interval)
	if err != nil {
		t.Fatal(err)
	}
	defer w.close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	defer cl.CloseIdleConnections()
	var mu sync.Mutex
	var firsts []time.Time
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, w.url+"/v1/completions", strings.NewReader("{}"))
			resp, err := cl.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "data: ") {
					mu.Lock()
					firsts = append(firsts, time.Now())
					mu.Unlock()
					return
				}
			}
			t.Errorf("no event: %v", sc.Err())
		})
	}
	wg.Wait()
	if len(firsts) != n {
		t.Fatalf("%d first events, want %d", len(firsts), n)
	}
	slices.SortFunc(firsts, func(a, b time.Time) int { return a.Compare(b) })
	if spread := firsts[n-1].Sub(firsts[0]); spread < interval/4 {
		t.Errorf("first events of %d streams started together spread over %v, want at least %v", n, spread, interval/4)
	}
}
