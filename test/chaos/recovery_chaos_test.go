package chaos

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// Fast recovery under load (docs/RELIABILITY.md, "Fast recovery"): a
// static NIXL 2P2D fleet on pre-chosen ports behind a router with default
// health flags; engines that start after the router, or restart on their
// address, are served again within seconds of listening.

// recoveryBound is the assertion on the time from listening to traffic;
// the measured figure is logged on the FIGURES line.
const recoveryBound = 5 * time.Second

type staticFleet struct {
	r     *router
	ports map[string][]int // role → ports
	sims  map[string][]*sim
}

// newStaticFleet starts the router only: nP prefills and nD decodes are
// configured on free ports nothing listens on yet.
func newStaticFleet(t *testing.T, nP, nD int, routerArgs ...string) *staticFleet {
	t.Helper()
	f := &staticFleet{ports: map[string][]int{}, sims: map[string][]*sim{}}
	args := []string{"--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin"}
	for role, n := range map[string]int{"prefill": nP, "decode": nD} {
		for range n {
			p := harness.FreePort(t)
			f.ports[role] = append(f.ports[role], p)
			args = append(args, "--"+role, "http://127.0.0.1:"+strconv.Itoa(p))
		}
		f.sims[role] = make([]*sim, n)
	}
	f.r = startRouter(t, append(args, routerArgs...)...)
	return f
}

// start starts the engine role[i] on its port.
func (f *staticFleet) start(t *testing.T, role string, i int) {
	t.Helper()
	args := append([]string{"--role", role, "--kv-connector", "nixl", "--port", strconv.Itoa(f.ports[role][i])}, simTiming...)
	f.sims[role][i] = startSim(t, args...)
}

// startAll starts every engine and returns when the last one listens.
func (f *staticFleet) startAll(t *testing.T) time.Time {
	t.Helper()
	for _, role := range []string{"prefill", "decode"} {
		for i := range f.ports[role] {
			f.start(t, role, i)
		}
	}
	return time.Now()
}

// waitHealth waits until the router lists url with the given health.
func (f *staticFleet) waitHealth(t *testing.T, url string, healthy bool) {
	t.Helper()
	var last string
	deadline := time.Now().Add(20 * time.Second)
	for {
		ws := f.r.workers(t)
		last = fmt.Sprintf("%+v", ws.Workers)
		for _, w := range ws.Workers {
			if w.URL == url && w.Healthy == healthy {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not healthy=%v within 20 s: workers %s", url, healthy, last)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// firstOKAfter is how long after t0 the first request that ended after t0
// succeeded (-1 if none did).
func (r *loadResult) firstOKAfter(t0 time.Time) time.Duration {
	best := time.Duration(-1)
	for _, o := range r.out {
		if o.kind == kindOK && o.end.After(t0) && (best < 0 || o.end.Sub(t0) < best) {
			best = o.end.Sub(t0)
		}
	}
	return best
}

func recoveryScale() (conc int, after time.Duration) {
	if longForm() {
		return 512, 30 * time.Second
	}
	return 256, 4 * time.Second
}

func checkRecovered(t *testing.T, what string, d time.Duration) {
	t.Helper()
	if d < 0 || d > recoveryBound {
		t.Errorf("%s: first traffic %v after listening, want within %v", what, d, recoveryBound)
	}
}

// TestRecoveryEnginesAfterRouter: the router starts first and takes load at
// once; the engines start 2 s later (the order on Kubernetes or with a
// launch script). Until then every request gets an explicit error at once
// (panic routing to refused ports); then the fleet is served.
func TestRecoveryEnginesAfterRouter(t *testing.T) {
	conc, after := recoveryScale()
	f := newStaticFleet(t, 2, 2)
	f.r.markBaseline(t)
	l := startLoad(loadConfig{base: f.r.Base, conc: conc, dur: 2*time.Second + after, deadline: 30 * time.Second})
	time.Sleep(2 * time.Second) // the scenario: engines come up 2 s after the router
	t0 := f.startAll(t)
	res := l.wait()
	f.r.alive(t)
	c := res.checkEnded(t)
	d := res.firstOKAfter(t0)
	checkRecovered(t, "engines after the router", d)
	res.checkSuccessRate(t, "from 2 s after the engines listened", t0.Add(2*time.Second), time.Time{}, 0.99)
	if logs := f.r.Logs.String(); strings.Contains(logs, "pd pair warm-up failed") {
		t.Error("a pair warm-up was sent to an engine still starting")
	}
	t.Logf("time to first 200 after the engines listened: %v", d.Round(time.Millisecond))
	figures(t, fmt.Sprintf("router first, 2P2D 2 s later; first 200 %v after listening", d.Round(time.Millisecond)), c)
	f.r.checkNoLeak(t, 15*time.Second)
}

// restartOne kills one engine under load, waits until the router marked it
// unhealthy, keeps it down for a second and restarts it on its address;
// the time until it serves again is its first request seen by the new
// process (the other engine of its role kept the fleet up meanwhile).
func restartOne(t *testing.T, role string) {
	conc, after := recoveryScale()
	f := newStaticFleet(t, 2, 2)
	f.startAll(t)
	f.r.WaitReady(t, 10*time.Second)
	warmUp(t, f.r.Base, 8)
	f.r.markBaseline(t)
	l := startLoad(loadConfig{base: f.r.Base, conc: conc, dur: 3*time.Second + after, deadline: 30 * time.Second})
	time.Sleep(time.Second)
	victim := f.sims[role][0]
	url := victim.URL()
	inflight := victim.Stats(t).Requests.InFlight
	kill := time.Now()
	victim.Kill()
	f.waitHealth(t, url, false)
	time.Sleep(time.Second)
	f.start(t, role, 0)
	t0 := time.Now()
	back := f.sims[role][0]
	var d time.Duration
	waitFor(t, recoveryBound+10*time.Second, "the restarted "+role+" serves", func() bool {
		st := back.Stats(t).Requests
		if st.PrefillLeg+st.DecodeLeg > 0 {
			d = time.Since(t0)
			return true
		}
		return false
	})
	res := l.wait()
	f.r.alive(t)
	c := res.checkEnded(t)
	checkRecovered(t, "restarted "+role, d)
	res.checkServedThroughout(t)
	res.checkSuccessRate(t, "after the kill (+1 s)", kill.Add(time.Second), time.Time{}, 0.99)
	if max := int(inflight) + 16; c.errors() > max {
		t.Errorf("%d explicit errors after killing a %s with %d requests in flight", c.errors(), role, inflight)
	}
	t.Logf("restarted %s served %v after listening", role, d.Round(time.Millisecond))
	figures(t, fmt.Sprintf("kill -9 a %s, 1 s down, restart on its address; traffic %v after listening", role, d.Round(time.Millisecond)), c)
	f.r.checkNoLeak(t, 15*time.Second)
}

func TestRecoveryPrefillRestart(t *testing.T) { restartOne(t, "prefill") }

func TestRecoveryDecodeRestart(t *testing.T) { restartOne(t, "decode") }

// TestRecoveryAllRestart: every engine is killed at once, stays down a
// second and restarts on its address (a fleet-wide rollout, a node
// reboot). While the fleet is down requests fail at once with explicit
// errors; once it listens it is served.
func TestRecoveryAllRestart(t *testing.T) {
	conc, after := recoveryScale()
	f := newStaticFleet(t, 2, 2)
	f.startAll(t)
	f.r.WaitReady(t, 10*time.Second)
	warmUp(t, f.r.Base, 8)
	f.r.markBaseline(t)
	l := startLoad(loadConfig{base: f.r.Base, conc: conc, dur: 3*time.Second + after, deadline: 30 * time.Second})
	time.Sleep(time.Second)
	var urls []string
	for _, role := range []string{"prefill", "decode"} {
		for _, s := range f.sims[role] {
			urls = append(urls, s.URL())
			s.Kill()
		}
	}
	for _, u := range urls {
		f.waitHealth(t, u, false)
	}
	time.Sleep(time.Second)
	t0 := f.startAll(t)
	res := l.wait()
	f.r.alive(t)
	c := res.checkEnded(t)
	d := res.firstOKAfter(t0)
	checkRecovered(t, "whole fleet restarted", d)
	res.checkSuccessRate(t, "from 2 s after the fleet listened", t0.Add(2*time.Second), time.Time{}, 0.99)
	m := f.r.scrape(t)
	if metricSum(m, "vllm_router_panic_routed_total") == 0 {
		t.Error("no panic-routed request while the whole fleet was down")
	}
	var served []string
	for _, role := range []string{"prefill", "decode"} {
		for i, s := range f.sims[role] {
			if st := s.Stats(t).Requests; st.PrefillLeg+st.DecodeLeg > 0 {
				served = append(served, role+strconv.Itoa(i))
			}
		}
	}
	slices.Sort(served)
	if len(served) != 4 {
		t.Errorf("engines serving after the restart: %v, want all four", served)
	}
	t.Logf("time to first 200 after the fleet listened: %v; panic-routed picks %v", d.Round(time.Millisecond),
		metricSum(m, "vllm_router_panic_routed_total"))
	figures(t, fmt.Sprintf("kill -9 all of 2P2D, 1 s down, restart; first 200 %v after listening", d.Round(time.Millisecond)), c)
	f.r.checkNoLeak(t, 15*time.Second)
}
