package chaos

import (
	"fmt"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// scale is the size of a run: the short form keeps the whole package under
// four minutes on two cores; CHAOS_LONG=1 runs bigger and longer.
type scale struct {
	conc     int           // closed-loop concurrency
	dur      time.Duration // load duration per scenario
	deadline time.Duration // client deadline per request ("hung" past it)
	long     bool
}

func scaleFor() scale {
	if longForm() {
		return scale{conc: 512, dur: 60 * time.Second, deadline: 60 * time.Second, long: true}
	}
	return scale{conc: 256, dur: 10 * time.Second, deadline: 30 * time.Second}
}

// at is a point in the load run, as a fraction of its duration.
func (s scale) at(frac float64) time.Duration { return time.Duration(float64(s.dur) * frac) }

// simTiming makes each request last ~0.5-1 s (24 tokens) so hundreds of
// streams are always in flight without saturating two cores.
var simTiming = []string{"--decode-step-base", "25ms", "--decode-step-per-seq", "20us", "--prefill-base", "10ms"}

// pdFleet is a router in MoRI-IO WRITE PD mode over ZMQ discovery in front
// of simulated prefill and decode workers.
type pdFleet struct {
	r       *router
	p, d    []*sim
	simArgs []string
}

// startPDFleet starts nP prefills and nD decodes (MoRI-IO WRITE) that
// register with the router's ZMQ discovery and waits until the router lists
// them all.
func startPDFleet(t *testing.T, nP, nD int, routerArgs []string, simExtra ...string) *pdFleet {
	t.Helper()
	zport := harness.FreePort(t)
	addr := fmt.Sprintf("127.0.0.1:%d", zport)
	args := append([]string{"--vllm-pd-disaggregation", "--kv-connector", "moriio", "--vllm-discovery-address", addr,
		"--policy", "round_robin", "--discovery-ttl-secs", "1.5"}, routerArgs...)
	f := &pdFleet{r: startRouter(t, args...)}
	f.r.zmqAddr = addr
	f.simArgs = append([]string{"--kv-connector", "moriio", "--transfer-mode", "WRITE", "--proxy-address", addr, "--heartbeat-interval", "200ms"}, simTiming...)
	f.simArgs = append(f.simArgs, simExtra...)
	for range nP {
		f.p = append(f.p, f.addSim(t, "prefill"))
	}
	for range nD {
		f.d = append(f.d, f.addSim(t, "decode"))
	}
	f.r.WaitReady(t, 10*time.Second)
	f.waitListed(t, nP+nD)
	warmUp(t, f.r.Base, 8)
	return f
}

func (f *pdFleet) addSim(t *testing.T, role string) *sim {
	t.Helper()
	return startSim(t, append([]string{"--role", role}, f.simArgs...)...)
}

// waitListed waits until the router lists n healthy routable workers.
func (f *pdFleet) waitListed(t *testing.T, n int) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%d routable workers", n), func() bool {
		ws := f.r.workers(t)
		live := 0
		for _, w := range ws.Workers {
			if w.Routable && w.Healthy {
				live++
			}
		}
		return live == n
	})
}

// regularFleet is a router in regular mode in front of unified workers.
type regularFleet struct {
	r *router
	w []*sim
}

func startRegularFleet(t *testing.T, n int, routerArgs []string, simExtra ...string) *regularFleet {
	t.Helper()
	f := &regularFleet{}
	var urls []string
	for range n {
		s := startSim(t, append(append([]string{"--role", "unified"}, simTiming...), simExtra...)...)
		f.w = append(f.w, s)
		urls = append(urls, s.URL())
	}
	args := append(append([]string{"--worker-urls"}, urls...), "--policy", "round_robin")
	f.r = startRouter(t, append(args, routerArgs...)...)
	f.r.WaitReady(t, 10*time.Second)
	warmUp(t, f.r.Base, 8)
	return f
}

// warmUp sends a few requests so first-contact costs (P↔D handshakes,
// connection setup) are paid before the baseline is taken.
func warmUp(t *testing.T, base string, n int) {
	t.Helper()
	l := startLoad(loadConfig{base: base, conc: n, deadline: 20 * time.Second})
	l.burst(n)
	res := l.wait()
	if c := res.all(); c.ok != c.sent {
		t.Fatalf("warm-up failed: %s %v %v", c, res.samples(kindHTTPErr, 3), res.samples(kindLost, 3))
	}
}

// figures logs the line docs/RELIABILITY.md quotes for a scenario.
func figures(t *testing.T, faults string, c counts) {
	t.Helper()
	t.Logf("FIGURES %s | faults: %s | sent %d | ok %d | explicit errors %d (http %d, sse %d) | hung %d | lost %d | statuses %v",
		t.Name(), faults, c.sent, c.ok, c.errors(), c.httpErr, c.sseErr, c.hung, c.lost, c.status)
}
