package admission

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/metrics"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func mustAcquire(t *testing.T, l *Limiter) func() {
	t.Helper()
	rel, err := l.Acquire(t.Context())
	if err != nil {
		t.Fatalf("Acquire: %v", err)
	}
	return rel
}

func TestFIFOHandoff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := New(Config{MaxConcurrent: 1, QueueSize: 3, QueueTimeout: time.Minute})
		first := mustAcquire(t, l)
		var mu sync.Mutex
		var order []int
		rels := make(chan func(), 3)
		for i := 1; i <= 3; i++ {
			go func() {
				rel, err := l.Acquire(context.Background())
				if err != nil {
					t.Errorf("waiter %d: %v", i, err)
					return
				}
				mu.Lock()
				order = append(order, i)
				mu.Unlock()
				rels <- rel
			}()
			synctest.Wait() // waiter i is queued before i+1 starts
		}
		if got := l.Queued(); got != 3 {
			t.Fatalf("queued = %d, want 3", got)
		}
		// A newcomer must not overtake the queue, even right after a release.
		if _, err := l.Acquire(context.Background()); !errors.Is(err, ErrQueueFull) {
			t.Fatalf("newcomer err = %v, want ErrQueueFull", err)
		}
		first()
		for range 3 {
			rel := <-rels
			synctest.Wait()
			if l.InUse() != 1 {
				t.Fatalf("in use = %d, want 1", l.InUse())
			}
			rel()
			rel() // idempotent
		}
		synctest.Wait()
		if want := []int{1, 2, 3}; !equal(order, want) {
			t.Fatalf("order = %v, want %v", order, want)
		}
		if l.InUse() != 0 || l.Queued() != 0 {
			t.Fatalf("in use %d queued %d, want 0 0", l.InUse(), l.Queued())
		}
	})
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestQueueFullAndNoQueue(t *testing.T) {
	m := metrics.NewForTest()
	l := New(Config{MaxConcurrent: 2, QueueSize: 0, Metrics: m})
	r1, r2 := mustAcquire(t, l), mustAcquire(t, l)
	_, err := l.Acquire(t.Context())
	if !errors.Is(err, ErrQueueFull) || Status(err) != 429 {
		t.Fatalf("err = %v (status %d), want ErrQueueFull/429", err, Status(err))
	}
	if got := value(m.AdmissionReject.WithLabelValues("queue_full")); got != 1 {
		t.Fatalf("queue_full rejections = %v, want 1", got)
	}
	r1()
	r1()
	r3 := mustAcquire(t, l) // exactly one slot came back
	if _, err := l.Acquire(t.Context()); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("double release freed two slots: err = %v", err)
	}
	r2()
	r3()
	if l.InUse() != 0 {
		t.Fatalf("in use = %d", l.InUse())
	}
}

func TestQueueTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := metrics.NewForTest()
		l := New(Config{MaxConcurrent: 1, QueueSize: 4, QueueTimeout: 3 * time.Second, Metrics: m})
		rel := mustAcquire(t, l)
		start := time.Now()
		_, err := l.Acquire(context.Background())
		if !errors.Is(err, ErrQueueTimeout) || Status(err) != 408 {
			t.Fatalf("err = %v, want ErrQueueTimeout/408", err)
		}
		if waited := time.Since(start); waited != 3*time.Second {
			t.Fatalf("waited %v, want 3s", waited)
		}
		if l.Queued() != 0 {
			t.Fatalf("timed-out waiter still queued")
		}
		if got := value(m.AdmissionReject.WithLabelValues("queue_timeout")); got != 1 {
			t.Fatalf("queue_timeout rejections = %v", got)
		}
		if got := value(m.QueueDepth); got != 0 {
			t.Fatalf("queue depth = %v", got)
		}
		rel()
		if l.InUse() != 0 {
			t.Fatalf("in use = %d", l.InUse())
		}
	})
}

func TestClientGoneWhileQueued(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := New(Config{MaxConcurrent: 1, QueueSize: 4})
		rel := mustAcquire(t, l)
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := l.Acquire(ctx)
			errc <- err
		}()
		synctest.Wait()
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) || Status(err) != 499 {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
		if l.Queued() != 0 {
			t.Fatalf("cancelled waiter still queued")
		}
		rel()
		if l.InUse() != 0 {
			t.Fatalf("slot leaked: in use = %d", l.InUse())
		}
	})
}

// A waiter whose timeout fires in the same instant its slot is granted must
// hand the slot on, not leak it.
func TestGrantTimeoutRace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for range 50 {
			l := New(Config{MaxConcurrent: 1, QueueSize: 2, QueueTimeout: time.Second})
			rel := mustAcquire(t, l)
			time.AfterFunc(time.Second, rel) // same fake instant as the timeout
			r2, err := l.Acquire(context.Background())
			if err == nil {
				r2()
			} else if !errors.Is(err, ErrQueueTimeout) {
				t.Fatalf("err = %v", err)
			}
			synctest.Wait()
			if l.InUse() != 0 || l.Queued() != 0 {
				t.Fatalf("in use %d queued %d after race, want 0 0", l.InUse(), l.Queued())
			}
		}
	})
}

func TestRateLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := metrics.NewForTest()
		l := New(Config{RateLimitPerSecond: 2, Metrics: m}) // burst 2, no concurrency cap
		r1, r2 := mustAcquire(t, l), mustAcquire(t, l)
		r1()
		r2()
		_, err := l.Acquire(context.Background())
		if !errors.Is(err, ErrRateLimited) || Status(err) != 429 {
			t.Fatalf("err = %v, want ErrRateLimited", err)
		}
		time.Sleep(500 * time.Millisecond) // one token refilled
		mustAcquire(t, l)()
		if _, err := l.Acquire(context.Background()); !errors.Is(err, ErrRateLimited) {
			t.Fatalf("second request after refill: err = %v", err)
		}
		time.Sleep(10 * time.Second) // refill caps at burst
		mustAcquire(t, l)()
		mustAcquire(t, l)()
		if _, err := l.Acquire(context.Background()); !errors.Is(err, ErrRateLimited) {
			t.Fatalf("burst exceeded: err = %v", err)
		}
		if got := value(m.AdmissionReject.WithLabelValues("rate_limited")); got != 3 {
			t.Fatalf("rate_limited rejections = %v, want 3", got)
		}
	})
}

func TestClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := New(Config{MaxConcurrent: 1, QueueSize: 4})
		rel := mustAcquire(t, l)
		errc := make(chan error, 2)
		for range 2 {
			go func() {
				_, err := l.Acquire(context.Background())
				errc <- err
			}()
		}
		synctest.Wait()
		l.Close()
		l.Close()
		for range 2 {
			if err := <-errc; !errors.Is(err, ErrClosed) || Status(err) != 503 {
				t.Fatalf("queued err = %v, want ErrClosed", err)
			}
		}
		if _, err := l.Acquire(context.Background()); !errors.Is(err, ErrClosed) {
			t.Fatalf("after close err = %v", err)
		}
		rel()
		if l.InUse() != 0 {
			t.Fatalf("in use = %d", l.InUse())
		}
	})
}

func TestConcurrencyBound(t *testing.T) {
	const limit = 4
	l := New(Config{MaxConcurrent: limit, QueueSize: 1000})
	var cur, peak atomic.Int64
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			rel, err := l.Acquire(t.Context())
			if err != nil {
				t.Errorf("Acquire: %v", err)
				return
			}
			n := cur.Add(1)
			for {
				p := peak.Load()
				if n <= p || peak.CompareAndSwap(p, n) {
					break
				}
			}
			time.Sleep(50 * time.Microsecond)
			cur.Add(-1)
			rel()
		})
	}
	wg.Wait()
	if p := peak.Load(); p > limit {
		t.Fatalf("peak concurrency %d > %d", p, limit)
	}
	if l.InUse() != 0 || l.Queued() != 0 {
		t.Fatalf("in use %d queued %d", l.InUse(), l.Queued())
	}
}

func TestStatusUnknown(t *testing.T) {
	if got := Status(errors.New("x")); got != 500 {
		t.Fatalf("Status = %d", got)
	}
}

// value reads a counter or gauge without prometheus/testutil (whose diff
// dependency is not in go.sum).
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return 0
}
