package health

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// probeLog is a /health endpoint that records when it was probed.
type probeLog struct {
	srv    *httptest.Server
	status atomic.Int32
	oks    atomic.Int64 // 2xx answers
	mu     sync.Mutex
	at     []time.Time
}

func newProbeLog(t *testing.T, status int) *probeLog {
	p := &probeLog{}
	p.status.Store(int32(status))
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		p.at = append(p.at, time.Now())
		p.mu.Unlock()
		st := int(p.status.Load())
		if st < 300 {
			p.oks.Add(1)
		}
		w.WriteHeader(st)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *probeLog) times() []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]time.Time(nil), p.at...)
}

func (p *probeLog) count() int { return len(p.times()) }

// fastOpts: a steady-state interval far longer than any test, a fast
// schedule of tens of milliseconds.
func fastOpts(reg *worker.Registry) Options {
	return Options{Registry: reg, Interval: time.Hour, Timeout: time.Second, FailureThreshold: 3, SuccessThreshold: 2,
		UnhealthyInterval: 10 * time.Millisecond, UnhealthyMaxInterval: 40 * time.Millisecond}
}

// A worker registered before its engine listens: its first failing probe
// marks it unhealthy (nothing ever vouched for it), it is re-probed on the
// fast schedule, and its first passing probe makes it healthy; then it is
// back on the steady-state interval.
func TestNeverProbedWorkerRecoversFast(t *testing.T) {
	p := newProbeLog(t, http.StatusServiceUnavailable)
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RolePrefill, 1)[0]
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "unhealthy after its first failing probe", func() bool { return !w.Healthy() })
	eventually(t, 10*time.Second, "re-probed on the fast schedule", func() bool { return p.count() >= 3 })
	p.status.Store(http.StatusOK)
	eventually(t, 10*time.Second, "healthy after one passing probe", func() bool { return w.Healthy() && w.Probed() })
	n := p.count()
	time.Sleep(200 * time.Millisecond) // five fast intervals: no probe may come
	if got := p.count(); got != n {
		t.Errorf("%d probes after the worker became healthy: it must be back on the 1 h interval", got-n)
	}
}

// The fast schedule doubles after each failure up to its maximum, jittered
// down by at most 20 %.
func TestFastScheduleBacksOff(t *testing.T) {
	p := newProbeLog(t, http.StatusServiceUnavailable)
	reg := newRegistry(t)
	add(t, reg, p.srv.URL, worker.RoleRegular, 1)
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "eight probes", func() bool { return p.count() >= 8 })
	at := p.times()
	want := []time.Duration{10, 20, 40, 40, 40, 40, 40} // ms, before jitter
	for i, d := range want {
		gap := at[i+1].Sub(at[i])
		if min := d * time.Millisecond * 8 / 10; gap < min {
			t.Errorf("gap %d: %v, want >= %v", i+1, gap, min)
		}
	}
}

// A worker that was healthy and went down (a restart on its address) gets
// a probe at once on its connect failure, is confirmed down by that failing
// probe, and once it listens again needs SuccessThreshold passing probes,
// which the fast schedule sends soon after each other.
func TestRestartedWorkerRecoversFast(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RoleDecode, 1)[0]
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "first probe passed", func() bool { return w.Probed() })
	p.status.Store(http.StatusServiceUnavailable) // the engine is restarting
	if down := reg.ConnectFailed(w, time.Now()); down != nil {
		t.Fatal("one connect failure must be a hint")
	}
	eventually(t, 10*time.Second, "the hint probed at once and confirmed by the failing probe", func() bool { return !w.Healthy() })
	if w.Suspect() {
		t.Error("a decided hint must be cleared")
	}
	before := p.oks.Load()
	p.status.Store(http.StatusOK)
	eventually(t, 10*time.Second, "healthy again", func() bool { return w.Healthy() })
	if n := p.oks.Load() - before; n < 2 {
		t.Errorf("healthy after %d passing probes, want SuccessThreshold (2)", n)
	}
}

// A passing probe after a connect failure clears the hint and leaves the
// worker healthy.
func TestHintClearedByPassingProbe(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RoleRegular, 1)[0]
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "first probe passed", func() bool { return w.Probed() })
	n := p.count()
	reg.ConnectFailed(w, time.Now())
	eventually(t, 10*time.Second, "probed at once", func() bool { return p.count() > n })
	eventually(t, 10*time.Second, "hint cleared", func() bool { return !w.Suspect() })
	if !w.Healthy() {
		t.Error("a passing probe must not mark the worker down")
	}
}

// Healthy probed workers keep the configured interval: the fast schedule
// is for the unhealthy and the never-probed only.
func TestHealthyWorkerNotFastProbed(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RoleRegular, 1)[0]
	c := newChecker(t, fastOpts(reg))
	round(c)
	if !w.Probed() || !w.Healthy() {
		t.Fatal("first probe")
	}
	c.mu.Lock()
	due := c.state[p.srv.URL].due
	c.mu.Unlock()
	if !due.IsZero() {
		t.Errorf("a healthy probed worker is on the fast schedule (due %v)", due)
	}
}

func TestUnhealthyIntervalsClampedToInterval(t *testing.T) {
	tests := []struct {
		interval, base, max time.Duration
		wantBase, wantMax   time.Duration
	}{
		{time.Minute, 0, 0, 500 * time.Millisecond, time.Second},
		{time.Minute, 0, 3 * time.Second, 500 * time.Millisecond, 3 * time.Second},
		{time.Second, 0, 0, 500 * time.Millisecond, time.Second},
		{100 * time.Millisecond, 0, 0, 100 * time.Millisecond, 100 * time.Millisecond},
		{time.Minute, 3 * time.Second, time.Second, time.Second, time.Second},
	}
	for _, tt := range tests {
		c := NewChecker(Options{Registry: newRegistry(t), Interval: tt.interval, UnhealthyInterval: tt.base, UnhealthyMaxInterval: tt.max})
		if c.o.UnhealthyInterval != tt.wantBase || c.o.UnhealthyMaxInterval != tt.wantMax {
			t.Errorf("%+v: got %v/%v", tt, c.o.UnhealthyInterval, c.o.UnhealthyMaxInterval)
		}
	}
}

// A worker whose process went away (its probe could not connect) and came
// back on the same address is healthy after one passing probe: a fresh
// process, like a new worker, not a flapping one.
func TestRefusedThenListeningNeedsOneProbe(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	addr := p.srv.Listener.Addr().String()
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RolePrefill, 1)[0]
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "first probe passed", func() bool { return w.Probed() })
	p.srv.Close() // killed
	reg.ConnectFailed(w, time.Now())
	eventually(t, 10*time.Second, "confirmed down by a refused probe", func() bool { return !w.Healthy() })
	n := p.count() // nothing listens: no probe reaches the log until the restart
	var again *probeLog
	for deadline := time.Now().Add(10 * time.Second); again == nil; {
		l, err := net.Listen("tcp", addr) // restarted on its address
		if err != nil {
			if time.Now().After(deadline) {
				t.Fatalf("relisten on %s: %v", addr, err)
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		again = &probeLog{}
		again.srv = httptest.NewUnstartedServer(p.srv.Config.Handler)
		again.srv.Listener.Close()
		again.srv.Listener = l
		again.srv.Start()
		t.Cleanup(again.srv.Close)
	}
	eventually(t, 10*time.Second, "healthy again", func() bool { return w.Healthy() })
	if got := p.count() - n; got != 1 {
		t.Errorf("healthy after %d passing probes, want 1 for a restarted process", got)
	}
}

// A worker whose breaker opened (its streams broke when the process died)
// is probed at once; a probe that cannot connect confirms it down; when it
// listens again it is healthy after one probe and its breaker half-opens,
// so traffic tests it without waiting out the open timeout.
func TestOpenBreakerProbedAndHalfOpenedOnReturn(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	addr := p.srv.Listener.Addr().String()
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, OpenDuration: time.Hour, HalfOpenMax: 1})
	w := add(t, reg, p.srv.URL, worker.RoleDecode, 1)[0]
	runChecker(t, newChecker(t, fastOpts(reg)))
	eventually(t, 10*time.Second, "first probe passed", func() bool { return w.Probed() })
	p.srv.Close()
	w.Breaker().Record(false) // a broken stream opens it
	eventually(t, 10*time.Second, "the open breaker's worker confirmed down", func() bool { return !w.Healthy() })
	l, err := net.Listen("tcp", addr)
	for deadline := time.Now().Add(10 * time.Second); err != nil && time.Now().Before(deadline); l, err = net.Listen("tcp", addr) {
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("relisten on %s: %v", addr, err)
	}
	back := httptest.NewUnstartedServer(p.srv.Config.Handler)
	back.Listener.Close()
	back.Listener = l
	back.Start()
	t.Cleanup(back.Close)
	eventually(t, 10*time.Second, "healthy again", func() bool { return w.Healthy() })
	if s := w.Breaker().State(); s != worker.BreakerHalfOpen {
		t.Errorf("breaker %v after the worker came back, want half_open", s)
	}
}

// A healthy worker whose probe fails is re-probed on the fast schedule, so
// FailureThreshold failures take tens of milliseconds here, not three
// intervals (1 h).
func TestFailingHealthyWorkerReprobedFast(t *testing.T) {
	p := newProbeLog(t, http.StatusOK)
	reg := newRegistry(t)
	w := add(t, reg, p.srv.URL, worker.RoleRegular, 1)[0]
	c := newChecker(t, fastOpts(reg))
	round(c) // probed, healthy
	p.status.Store(http.StatusServiceUnavailable)
	runChecker(t, c) // its first round fails once
	eventually(t, 10*time.Second, "unhealthy after FailureThreshold fast probes", func() bool { return !w.Healthy() })
	if n := p.count(); n < 4 {
		t.Errorf("unhealthy after %d probes, want 1 pass + 3 failures", n)
	}
}
