package health

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeVLLM serves /health (status settable, optional hang) and /load, and
// records every request so tests can check nothing else is ever called.
type fakeVLLM struct {
	srv    *httptest.Server
	status atomic.Int32
	hang   atomic.Bool
	load   atomic.Int64
	health atomic.Int64
	delay  time.Duration

	mu    sync.Mutex
	other []string
}

func newFakeVLLM(t *testing.T) *fakeVLLM {
	t.Helper()
	f := &fakeVLLM{}
	f.status.Store(http.StatusOK)
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/health":
			f.health.Add(1)
			if f.delay > 0 {
				time.Sleep(f.delay)
			}
			if f.hang.Load() {
				select {
				case <-r.Context().Done():
				case <-time.After(10 * time.Second):
				}
				return
			}
			w.WriteHeader(int(f.status.Load()))
		case r.Method == http.MethodGet && r.URL.Path == "/load":
			fmt.Fprintf(w, `{"server_load": %d}`, f.load.Load())
		default:
			f.mu.Lock()
			f.other = append(f.other, r.Method+" "+r.URL.Path)
			f.mu.Unlock()
			w.WriteHeader(http.StatusTeapot)
		}
	}))
	t.Cleanup(func() {
		f.srv.Close()
		f.mu.Lock()
		defer f.mu.Unlock()
		if len(f.other) > 0 {
			t.Errorf("health checker sent other requests: %v", f.other)
		}
	})
	return f
}

func newRegistry(t *testing.T) *worker.Registry {
	return worker.NewRegistry(worker.BreakerConfig{})
}

func add(t *testing.T, reg *worker.Registry, url string, role worker.Role, dp int) []*worker.Worker {
	t.Helper()
	ws, err := reg.Add(worker.ExpandDP(worker.Spec{URL: url, Role: role, DPRank: -1}, dp)...)
	if err != nil {
		t.Fatal(err)
	}
	return ws
}

func newChecker(t *testing.T, o Options) *Checker {
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	o.Client = &http.Client{Transport: tr}
	return NewChecker(o)
}

// round runs one probe round and waits for it.
func round(c *Checker) {
	c.probeAll(context.Background())
	c.wg.Wait()
}

// runChecker starts Run and stops it at cleanup.
func runChecker(t *testing.T, c *Checker) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func gauge(t *testing.T, m *metrics.Metrics, key string) float64 {
	var d dto.Metric
	if err := m.WorkerHealth.WithLabelValues(key).Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.Gauge.GetValue()
}

func TestThresholds(t *testing.T) {
	f := newFakeVLLM(t)
	reg := newRegistry(t)
	w := add(t, reg, f.srv.URL, worker.RoleDecode, 1)[0]
	m := metrics.NewForTest()
	c := newChecker(t, Options{Registry: reg, FailureThreshold: 3, SuccessThreshold: 2, Timeout: time.Second, Metrics: m})

	round(c)
	if !w.Healthy() || gauge(t, m, w.Key()) != 1 {
		t.Fatal("healthy worker")
	}
	f.status.Store(http.StatusServiceUnavailable)
	for i := 1; i <= 3; i++ {
		round(c)
		if want := i < 3; w.Healthy() != want {
			t.Fatalf("after %d failures healthy=%v", i, w.Healthy())
		}
	}
	if gauge(t, m, w.Key()) != 0 {
		t.Error("health gauge not 0")
	}
	f.status.Store(http.StatusOK)
	round(c)
	if w.Healthy() {
		t.Fatal("one success must not be enough")
	}
	f.status.Store(http.StatusInternalServerError)
	round(c) // a failure resets the success run
	f.status.Store(http.StatusOK)
	round(c)
	if w.Healthy() {
		t.Fatal("successes must be consecutive")
	}
	round(c)
	if !w.Healthy() || gauge(t, m, w.Key()) != 1 {
		t.Fatal("healthy again after 2 consecutive successes")
	}
	if f.health.Load() != 8 {
		t.Errorf("%d probes for 8 rounds", f.health.Load())
	}
}

func TestPassiveMarkRestartsCount(t *testing.T) {
	f := newFakeVLLM(t)
	reg := newRegistry(t)
	w := add(t, reg, f.srv.URL, worker.RoleRegular, 1)[0]
	c := newChecker(t, Options{Registry: reg, FailureThreshold: 3, SuccessThreshold: 2})
	for range 3 {
		round(c) // a long run of successes
	}
	w.SetHealthy(false) // the proxy saw a connect failure
	round(c)
	if w.Healthy() {
		t.Fatal("restored after one probe: the success run must restart")
	}
	round(c)
	if !w.Healthy() {
		t.Fatal("not restored after SuccessThreshold probes")
	}
}

func TestNewWorkerFirstPassingProbeRestores(t *testing.T) {
	f := newFakeVLLM(t)
	reg := newRegistry(t)
	w := add(t, reg, f.srv.URL, worker.RoleRegular, 1)[0]
	w.SetHealthy(false) // added by the admin API, not verified yet
	c := newChecker(t, Options{Registry: reg, SuccessThreshold: 3})
	round(c)
	if !w.Healthy() {
		t.Fatal("a new worker's first passing probe should make it routable")
	}
}

func TestDPRanksProbedOnce(t *testing.T) {
	f := newFakeVLLM(t)
	reg := newRegistry(t)
	ws := add(t, reg, f.srv.URL, worker.RolePrefill, 4)
	c := newChecker(t, Options{Registry: reg, FailureThreshold: 1})
	round(c)
	if f.health.Load() != 1 {
		t.Fatalf("%d probes for one 4-rank instance", f.health.Load())
	}
	f.status.Store(http.StatusServiceUnavailable)
	round(c)
	for _, w := range ws {
		if w.Healthy() {
			t.Errorf("rank %s still healthy", w.Key())
		}
	}
}

func TestHangingWorkerDoesNotDelayOthers(t *testing.T) {
	reg := newRegistry(t)
	hung := newFakeVLLM(t)
	hung.hang.Store(true)
	add(t, reg, hung.srv.URL, worker.RoleDecode, 1)
	var others []*fakeVLLM
	for range 3 {
		f := newFakeVLLM(t)
		add(t, reg, f.srv.URL, worker.RoleDecode, 1)[0].SetHealthy(false)
		others = append(others, f)
	}
	c := newChecker(t, Options{Registry: reg, Interval: 20 * time.Millisecond, Timeout: 30 * time.Second})
	runChecker(t, c)
	// rounds keep coming every interval while one probe hangs (bounded by
	// Timeout, and the fake's 10 s hang, both longer than this wait)
	eventually(t, 5*time.Second, "three rounds on every other worker", func() bool {
		for _, f := range others {
			if f.health.Load() < 3 {
				return false
			}
		}
		return true
	})
	for _, w := range reg.Snapshot().All {
		if w.URL != hung.srv.URL && !w.Healthy() {
			t.Errorf("%s not restored", w.Key())
		}
	}
	if n := hung.health.Load(); n != 1 {
		t.Errorf("hanging worker probed %d times: a probe still running must not be repeated", n)
	}
}

func TestConcurrencyBound(t *testing.T) {
	reg := newRegistry(t)
	for range 6 {
		f := newFakeVLLM(t)
		f.delay = 30 * time.Millisecond
		add(t, reg, f.srv.URL, worker.RoleRegular, 1)
	}
	var peak atomic.Int64
	var cur atomic.Int64
	c := newChecker(t, Options{Registry: reg, Concurrency: 2})
	inner := c.o.Client.Transport
	c.o.Client = &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		n := cur.Add(1)
		defer cur.Add(-1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		return inner.RoundTrip(r)
	})}
	start := time.Now()
	round(c)
	if peak.Load() != 2 {
		t.Errorf("peak concurrency %d, want 2", peak.Load())
	}
	if el := time.Since(start); el < 80*time.Millisecond {
		t.Errorf("6 probes of 30 ms two at a time took only %v", el)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestNewWorkerProbedImmediately(t *testing.T) {
	reg := newRegistry(t)
	c := newChecker(t, Options{Registry: reg, Interval: time.Hour})
	runChecker(t, c)
	f := newFakeVLLM(t)
	time.Sleep(10 * time.Millisecond) // Run has subscribed
	add(t, reg, f.srv.URL, worker.RoleDecode, 2)
	eventually(t, 10*time.Second, "new worker probed", func() bool { return f.health.Load() >= 1 })
	time.Sleep(20 * time.Millisecond)
	if n := f.health.Load(); n != 1 {
		t.Errorf("two ranks added at once: %d probes", n)
	}
}

func TestLoadPolling(t *testing.T) {
	reg := newRegistry(t)
	f := newFakeVLLM(t)
	f.load.Store(9)
	ws := add(t, reg, f.srv.URL, worker.RoleRegular, 2)
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	d := add(t, reg, deadURL, worker.RoleRegular, 1)[0]
	d.SetPolledLoad(3)
	c := newChecker(t, Options{Registry: reg, Interval: time.Hour, LoadPollInterval: 10 * time.Millisecond, Timeout: time.Second})
	runChecker(t, c)
	eventually(t, 10*time.Second, "polled load set", func() bool { return ws[0].PolledLoad() == 5 && ws[1].PolledLoad() == 5 })
	eventually(t, 10*time.Second, "failed poll clears the load", func() bool { return d.PolledLoad() == -1 })
	f.load.Store(2)
	eventually(t, 10*time.Second, "polled load updated", func() bool { return ws[0].PolledLoad() == 1 })
}

func TestProbeNow(t *testing.T) {
	reg := newRegistry(t)
	f := newFakeVLLM(t)
	w := add(t, reg, f.srv.URL, worker.RoleRegular, 1)[0]
	c := newChecker(t, Options{Registry: reg, Interval: 20 * time.Millisecond, Timeout: time.Second})
	f.status.Store(http.StatusServiceUnavailable)
	go func() {
		time.Sleep(60 * time.Millisecond)
		f.status.Store(http.StatusOK)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := c.ProbeNow(ctx, w); err != nil {
		t.Fatalf("ProbeNow: %v", err)
	}
	if f.health.Load() < 2 {
		t.Errorf("ProbeNow succeeded after %d probes: it must wait for the worker", f.health.Load())
	}
	f.status.Store(http.StatusServiceUnavailable)
	ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	if err := c.ProbeNow(ctx2, w); err == nil {
		t.Fatal("ProbeNow on an unhealthy worker must fail when ctx ends")
	}
	if !w.Healthy() {
		t.Error("ProbeNow must not change health state")
	}
}

// BeforeHealthy runs after a passing probe of an unhealthy worker, with
// the instance's URL, before the worker is healthy again; not while it
// stays healthy, and not after a failing probe. WhileHealthy runs after
// each passing probe of a healthy worker, and only then.
func TestBeforeHealthyRunsBeforeTheReturn(t *testing.T) {
	f := newFakeVLLM(t)
	reg := newRegistry(t)
	ws := add(t, reg, f.srv.URL, worker.RoleRegular, 2)
	var mu sync.Mutex
	var got, while []string
	var healthyInside []bool
	c := newChecker(t, Options{Registry: reg, FailureThreshold: 1, SuccessThreshold: 1,
		BeforeHealthy: func(_ context.Context, url string) {
			mu.Lock()
			defer mu.Unlock()
			got = append(got, url)
			healthyInside = append(healthyInside, ws[0].Healthy() || ws[1].Healthy())
		},
		WhileHealthy: func(_ context.Context, url string) {
			mu.Lock()
			defer mu.Unlock()
			while = append(while, url)
		}})
	calls := func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), got...) }
	whileCalls := func() int { mu.Lock(); defer mu.Unlock(); return len(while) }
	round(c)
	round(c)
	if n := len(calls()); n != 0 {
		t.Fatalf("BeforeHealthy ran %d times for a worker that stayed healthy", n)
	}
	if n := whileCalls(); n != 2 {
		t.Fatalf("WhileHealthy ran %d times in two passing rounds of a healthy worker, want 2 (one per URL)", n)
	}
	f.status.Store(http.StatusServiceUnavailable)
	round(c)
	round(c)
	if n := len(calls()); n != 0 || ws[0].Healthy() || whileCalls() != 2 {
		t.Fatalf("BeforeHealthy ran %d times on failures (healthy %v), WhileHealthy %d (want 2)", n, ws[0].Healthy(), whileCalls())
	}
	f.status.Store(http.StatusOK)
	round(c)
	if g := calls(); len(g) != 1 || g[0] != f.srv.URL || healthyInside[0] {
		t.Fatalf("BeforeHealthy calls %v (worker healthy inside: %v), want one with %s before the return", g, healthyInside, f.srv.URL)
	}
	if !ws[0].Healthy() || !ws[1].Healthy() {
		t.Fatal("not healthy after the passing probe")
	}
	if n := whileCalls(); n != 2 {
		t.Fatalf("WhileHealthy ran on the probe that made the worker healthy (%d calls, want 2)", n)
	}
	round(c)
	mu.Lock()
	defer mu.Unlock()
	if len(while) != 3 || while[2] != f.srv.URL {
		t.Fatalf("WhileHealthy calls %v, want a third with %s", while, f.srv.URL)
	}
}

// With HoldNew true, a worker that joins is unhealthy (not routed) until
// its first passing probe, and BeforeHealthy runs before it is healthy;
// with HoldNew false it is routed at once and nothing runs.
func TestHoldNewUntilFirstProbe(t *testing.T) {
	for _, hold := range []bool{true, false} {
		t.Run(fmt.Sprint("hold=", hold), func(t *testing.T) {
			reg := newRegistry(t)
			f := newFakeVLLM(t)
			f.delay = 50 * time.Millisecond // the probe in flight while the test looks
			var prepared atomic.Int32
			var healthyInside atomic.Bool
			var ws []*worker.Worker
			var mu sync.Mutex
			c := newChecker(t, Options{Registry: reg, Interval: time.Hour, HoldNew: func() bool { return hold },
				BeforeHealthy: func(context.Context, string) {
					mu.Lock()
					healthyInside.Store(ws[0].Healthy())
					mu.Unlock()
					prepared.Add(1)
				}})
			runChecker(t, c)
			time.Sleep(10 * time.Millisecond) // Run has subscribed
			mu.Lock()
			ws = add(t, reg, f.srv.URL, worker.RoleRegular, 1)
			mu.Unlock()
			if ws[0].Healthy() == hold {
				t.Fatalf("right after joining healthy=%v, want %v", ws[0].Healthy(), !hold)
			}
			eventually(t, 10*time.Second, "healthy after the first probe", func() bool { return ws[0].Healthy() && f.health.Load() >= 1 })
			time.Sleep(20 * time.Millisecond)
			want := int32(0)
			if hold {
				want = 1
			}
			if prepared.Load() != want || healthyInside.Load() {
				t.Fatalf("BeforeHealthy ran %d times (worker healthy inside: %v), want %d", prepared.Load(), healthyInside.Load(), want)
			}
		})
	}
}
