package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// Fast recovery (docs/RELIABILITY.md, "Fast recovery"): with default
// flags, workers that start after the router, or restart on their address,
// are served within a couple of seconds of listening.

// recoveryBound is the CI assertion on the time from a worker listening to
// the first 200 through the router; the real figures are logged.
const recoveryBound = 5 * time.Second

// loadLoop sends one small completion at a time to the router, from its
// start to the end of the test, and records when each 200 completed.
type loadLoop struct {
	mu      sync.Mutex
	oks     []time.Time
	errs    map[int]int // non-200 statuses (0 = transport error)
	slowest time.Duration
	stop    func()
}

func startLoad(t *testing.T, base string) *loadLoop {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	l := &loadLoop{errs: map[int]int{}}
	var wg sync.WaitGroup
	l.stop = func() { cancel(); wg.Wait() }
	t.Cleanup(l.stop)
	c := &http.Client{Transport: &http.Transport{}}
	wg.Go(func() {
		defer c.CloseIdleConnections()
		for ctx.Err() == nil {
			start := time.Now()
			status := l.once(ctx, c, base)
			if ctx.Err() != nil {
				return
			}
			l.mu.Lock()
			if status == http.StatusOK {
				l.oks = append(l.oks, time.Now())
			} else {
				l.errs[status]++
				l.slowest = max(l.slowest, time.Since(start))
			}
			l.mu.Unlock()
			if status != http.StatusOK {
				select {
				case <-ctx.Done():
				case <-time.After(10 * time.Millisecond):
				}
			}
		}
	})
	return l
}

func (l *loadLoop) once(ctx context.Context, c *http.Client, base string) int {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions",
		strings.NewReader(`{"prompt":"recovery","max_tokens":4,"temperature":0}`))
	if err != nil {
		return 0
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || (resp.StatusCode == http.StatusOK && !strings.Contains(string(b), `"choices"`)) {
		return 0
	}
	if resp.StatusCode != http.StatusOK && !strings.Contains(string(b), `"error"`) {
		return -resp.StatusCode // an error without a JSON error body
	}
	return resp.StatusCode
}

// firstOK waits (up to recoveryBound + 10 s) for a 200 completed after t0
// and returns how long after t0 it came.
func (l *loadLoop) firstOK(t *testing.T, t0 time.Time) time.Duration {
	t.Helper()
	var d time.Duration
	harness.WaitFor(t, recoveryBound+10*time.Second, 5*time.Millisecond, "a 200 through the router", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		i, _ := slices.BinarySearchFunc(l.oks, t0, func(a, b time.Time) int { return a.Compare(b) })
		if i < len(l.oks) {
			d = l.oks[i].Sub(t0)
			return true
		}
		return false
	})
	return d
}

// waitFailing waits until a request completed after t0 failed (the router
// has seen the worker gone).
func (l *loadLoop) waitFailing(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	n := 0
	for _, v := range l.errs {
		n += v
	}
	l.mu.Unlock()
	harness.WaitFor(t, 20*time.Second, 5*time.Millisecond, "a failed request", func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		m := 0
		for _, v := range l.errs {
			m += v
		}
		return m > n
	})
}

func (l *loadLoop) check(t *testing.T) {
	t.Helper()
	l.stop()
	l.mu.Lock()
	defer l.mu.Unlock()
	for s, n := range l.errs {
		if s <= 0 {
			t.Errorf("%d requests ended without a status and a JSON error body (code %d)", n, s)
		}
	}
	if l.slowest > 10*time.Second {
		t.Errorf("a failed request took %v: a down fleet must fail fast", l.slowest)
	}
	t.Logf("load: %d ok, errors by status %v, slowest error %v", len(l.oks), l.errs, l.slowest.Round(time.Millisecond))
}

// recoveryFleet is a router with pre-chosen worker ports, started before
// the workers.
type recoveryFleet struct {
	pd    bool
	spare string         // the role of a second worker ("spare"), "" = none
	ports map[string]int // role → port
	sims  map[string]*sim
	r     *router
}

// newRecoveryFleet configures one worker per role (unified, or prefill and
// decode) plus, when spare is a role, a second worker of that role.
func newRecoveryFleet(t *testing.T, pd bool, spare string, extra ...string) *recoveryFleet {
	f := &recoveryFleet{pd: pd, spare: spare, ports: map[string]int{}, sims: map[string]*sim{}}
	url := func(role string) string {
		f.ports[role] = harness.FreePort(t)
		return fmt.Sprintf("http://127.0.0.1:%d", f.ports[role])
	}
	var args []string
	if pd {
		args = []string{"--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", url("prefill"), "--decode", url("decode")}
		if spare != "" {
			args = append(args, "--"+spare, url("spare"))
		}
	} else {
		args = []string{"--worker-urls", url("unified")}
		if spare != "" {
			args = append(args, url("spare"))
		}
	}
	f.r = startRouter(t, append(args, extra...)...)
	return f
}

func (f *recoveryFleet) roles() []string {
	rs := []string{"unified"}
	if f.pd {
		rs = []string{"prefill", "decode"}
	}
	if f.spare != "" {
		rs = append(rs, "spare")
	}
	return rs
}

// start starts the workers of roles on their ports and returns when the
// last one listens.
func (f *recoveryFleet) start(t *testing.T, roles ...string) time.Time {
	t.Helper()
	for _, role := range roles {
		r := role
		if role == "spare" {
			r = f.spare
		}
		args := []string{"--port", strconv.Itoa(f.ports[role]), "--role", r}
		if f.pd {
			args = append(args, "--kv-connector", "nixl")
		}
		f.sims[role] = startSim(t, args...)
	}
	return time.Now()
}

func (f *recoveryFleet) kill(roles ...string) {
	for _, role := range roles {
		f.sims[role].Kill()
	}
}

// TestRecoveryWorkersStartAfterRouter: the scenario, with default
// flags, in regular and PD mode: the router first, the engines 2 s later.
func TestRecoveryWorkersStartAfterRouter(t *testing.T) {
	for _, pd := range []bool{false, true} {
		t.Run(map[bool]string{false: "regular", true: "pd-nixl"}[pd], func(t *testing.T) {
			f := newRecoveryFleet(t, pd, "")
			l := startLoad(t, f.r.Base)
			time.Sleep(2 * time.Second) // the scenario: engines come up 2 s after the router
			t0 := f.start(t, f.roles()...)
			d := l.firstOK(t, t0)
			t.Logf("FIGURES first 200 %v after the workers listened", d.Round(time.Millisecond))
			if d > recoveryBound {
				t.Errorf("first 200 %v after listening, want <= %v", d, recoveryBound)
			}
			l.check(t)
			if strings.Contains(f.r.Logs.String(), "pd pair warm-up failed") {
				t.Error("a warm-up was sent to an engine still starting")
			}
		})
	}
}

// TestRecoveryRestartOnSameAddress: a served worker is killed, stays down
// a second, and restarts on its address.
func TestRecoveryRestartOnSameAddress(t *testing.T) {
	for _, tc := range []struct {
		name  string
		pd    bool
		role  string
		extra []string
	}{
		{"regular", false, "unified", nil}, {"pd-prefill", true, "prefill", nil}, {"pd-decode", true, "decode", nil},
		// without panic routing only the prober brings the worker back
		{"pd-prefill-no-panic", true, "prefill", []string{"--panic-routing=false"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newRecoveryFleet(t, tc.pd, "", tc.extra...)
			t0 := f.start(t, f.roles()...)
			l := startLoad(t, f.r.Base)
			l.firstOK(t, t0)
			f.kill(tc.role)
			l.waitFailing(t)
			time.Sleep(time.Second) // down for a while: the router's probes back off
			t1 := f.start(t, tc.role)
			d := l.firstOK(t, t1)
			t.Logf("FIGURES first 200 %v after the restarted %s listened", d.Round(time.Millisecond), tc.role)
			if d > recoveryBound {
				t.Errorf("first 200 %v after listening, want <= %v", d, recoveryBound)
			}
			l.check(t)
		})
	}
}

// TestRecoveryFigures measures P50/P99 of the time from listening to the
// first 200 over SWITCHYARD_RECOVERY_TRIALS trials per scenario (docs/
// RELIABILITY.md quotes them). Workers start 2 s + U(0, 1 s) after the
// router, or stay down U(1 s, 3 s) before restarting, so the router's
// re-probe schedule is sampled at every phase. The "no panic" cases turn
// panic routing off, so the time is the prober's alone (with panic routing
// a single-worker role is tried by every request and recovers as soon as
// it listens).
func TestRecoveryFigures(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("SWITCHYARD_RECOVERY_TRIALS"))
	if n <= 0 {
		t.Skip("set SWITCHYARD_RECOVERY_TRIALS=20 to measure")
	}
	jitter := func(base, spread time.Duration) time.Duration {
		return base + time.Duration(rand.Int64N(int64(spread)))
	}
	noPanic := []string{"--panic-routing=false"}
	for _, tc := range []struct {
		name   string
		pd     bool
		role   string // "" = start late
		extra  []string
		rejoin bool // two workers of the role: the time until the restarted one serves
	}{
		{"regular late start", false, "", nil, false}, {"pd late start", true, "", nil, false},
		{"regular restart", false, "unified", nil, false}, {"pd prefill restart", true, "prefill", nil, false},
		{"pd decode restart", true, "decode", nil, false},
		{"regular late start, no panic", false, "", noPanic, false}, {"pd late start, no panic", true, "", noPanic, false},
		{"regular restart, no panic", false, "unified", noPanic, false},
		{"pd prefill restart, no panic", true, "prefill", noPanic, false},
		{"pd decode restart, no panic", true, "decode", noPanic, false},
		{"regular restart, 2 workers", false, "unified", nil, true},
		{"pd prefill restart, 2 prefills", true, "prefill", nil, true},
		{"pd decode restart, 2 decodes", true, "decode", nil, true},
	} {
		var ds []time.Duration
		for range n {
			t.Run(tc.name, func(t *testing.T) {
				if tc.rejoin {
					ds = append(ds, rejoin(t, tc.pd, tc.role, jitter(time.Second, 2*time.Second)))
					return
				}
				f := newRecoveryFleet(t, tc.pd, "", tc.extra...)
				l := startLoad(t, f.r.Base)
				var t0 time.Time
				if tc.role == "" {
					time.Sleep(jitter(2*time.Second, time.Second))
					t0 = f.start(t, f.roles()...)
				} else {
					l.firstOK(t, f.start(t, f.roles()...))
					f.kill(tc.role)
					l.waitFailing(t)
					time.Sleep(jitter(time.Second, 2*time.Second))
					t0 = f.start(t, tc.role)
				}
				ds = append(ds, l.firstOK(t, t0))
				l.check(t)
			})
		}
		slices.Sort(ds)
		if len(ds) == 0 {
			continue
		}
		p := func(q float64) time.Duration { return ds[min(len(ds)-1, int(q*float64(len(ds))))] }
		t.Logf("FIGURES %s: n=%d P50 %v P99 %v max %v", tc.name, len(ds), p(0.5).Round(time.Millisecond),
			p(0.99).Round(time.Millisecond), ds[len(ds)-1].Round(time.Millisecond))
	}
}

// rejoin: a fleet with two workers of role takes load; one of them is
// killed, stays down for down and restarts on its address. It returns the
// time from its listening to its first request (the other worker served
// meanwhile, so no panic routing is involved: this is the prober's time).
func rejoin(t *testing.T, pd bool, role string, down time.Duration) time.Duration {
	t.Helper()
	// round robin: cache_aware (the default) would keep every identical
	// prompt on the worker that has its prefix cached
	f := newRecoveryFleet(t, pd, role, "--policy", "round_robin")
	l := startLoad(t, f.r.Base)
	l.firstOK(t, f.start(t, f.roles()...))
	url := f.sims[role].URL()
	f.kill(role)
	harness.WaitFor(t, 20*time.Second, 5*time.Millisecond, url+" marked unhealthy", func() bool {
		var ws struct {
			Workers []struct {
				URL     string `json:"url"`
				Healthy bool   `json:"is_healthy"`
			} `json:"workers"`
		}
		getJSON(t, f.r.Base+"/workers", &ws)
		for _, w := range ws.Workers {
			if w.URL == url {
				return !w.Healthy
			}
		}
		return false
	})
	time.Sleep(down)
	t0 := f.start(t, role)
	back := f.sims[role]
	var d time.Duration
	harness.WaitFor(t, recoveryBound+10*time.Second, 5*time.Millisecond, "the restarted "+role+" serves", func() bool {
		st := back.Stats(t).Requests
		if st.Completions+st.PrefillLeg+st.DecodeLeg > 0 {
			d = time.Since(t0)
			return true
		}
		return false
	})
	l.check(t)
	return d
}
