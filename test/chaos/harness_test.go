// Package chaos runs the router against simulated vLLM workers (real
// processes, real sockets on 127.0.0.1) under continuous load and injects
// faults: worker crashes, stalls, lost KV notifications, expired
// registrations, error bursts, discovery floods, slow or stuck clients and
// admission overload. Every scenario checks that every request ended
// (success, an explicit HTTP error, or an SSE error event, never a hang or a
// silent truncation), that successes match the surviving capacity, that the
// router served throughout, and that its goroutines and file descriptors
// come back down afterwards.
//
// The short form (default) runs each scenario for ~10 s at concurrency 256;
// CHAOS_LONG=1 (make chaos) runs the long form with bigger numbers. Both
// skip under -short.
package chaos

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// bins starts the binaries TestMain built, quietly (--log-level warn), with
// the last 6000 bytes of each child's logs kept (4 MiB with CHAOS_LOGMAX
// set) and a 5 s timeout on the helpers' GETs.
var bins = &harness.Bins{
	LogMax:     6000,
	SimArgs:    []string{"--log-level", "warn"},
	RouterArgs: []string{"--log-level", "warn"},
	Client:     &http.Client{Timeout: 5 * time.Second},
}

func TestMain(m *testing.M) {
	// -short (make test-short) skips the whole package without building.
	for _, a := range os.Args[1:] {
		if a == "-test.short" || a == "-test.short=true" {
			fmt.Println("chaos: skipped in -short mode")
			os.Exit(0)
		}
	}
	if os.Getenv("CHAOS_LOGMAX") != "" {
		bins.LogMax = 4 << 20
	}
	// The router and the simulator are built without -race even when the
	// test binary is: the point is the router's behaviour under load, and
	// the race detector would multiply its CPU cost on a 2-core machine.
	dir, err := harness.Build("switchyard-chaos-", []string{"CGO_ENABLED=0"}, "../../cmd/switchyard", "../../cmd/vllm-sim")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.Dir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// longForm reports whether CHAOS_LONG=1 asks for the long form.
func longForm() bool { return os.Getenv("CHAOS_LONG") == "1" }

type sim = harness.Sim

func startSim(t *testing.T, args ...string) *sim {
	t.Helper()
	return bins.StartSim(t, args...)
}

type router struct {
	*harness.Router
	zmqAddr  string // discovery address, PD fleets
	pid      int
	baseline resources
}

// startRouter starts switchyard and waits until /liveness answers.
func startRouter(t *testing.T, args ...string) *router {
	t.Helper()
	r := bins.StartRouter(t, args...)
	return &router{Router: r, pid: r.Cmd.Process.Pid}
}

// alive fails the test if the router process has exited.
func (r *router) alive(t *testing.T) {
	t.Helper()
	select {
	case <-r.Done:
		t.Fatalf("switchyard exited during the scenario: %s", r.Logs.String())
	default:
	}
}

// scrape returns the router's Prometheus text.
func (r *router) scrape(t *testing.T) string {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(r.Metrics)
	if err != nil {
		t.Fatalf("scrape %s: %v", r.Metrics, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", r.Metrics, err)
	}
	return string(b)
}

// metricSum adds up the samples of metric name whose label set contains
// every one of labels (e.g. `to="open"`).
func metricSum(text, name string, labels ...string) float64 {
	var sum float64
	for _, line := range strings.Split(text, "\n") {
		if line == "" || line[0] == '#' || !strings.HasPrefix(line, name) {
			continue
		}
		rest := line[len(name):]
		if rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue // a longer metric name
		}
		i := strings.LastIndexByte(rest, ' ')
		if i < 0 {
			continue
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(rest[:i], l) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest[i+1:]), 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// histQuantile is the upper bound of the histogram bucket holding quantile
// q of metric name ("le" of the first bucket reaching it), e.g. "0.05".
func histQuantile(text, name string, q float64) string {
	total := metricSum(text, name+"_count")
	if total == 0 {
		return "n/a"
	}
	for _, line := range strings.Split(text, "\n") {
		rest, ok := strings.CutPrefix(line, name+`_bucket{le="`)
		if !ok {
			continue
		}
		le, after, _ := strings.Cut(rest, `"`)
		v, err := strconv.ParseFloat(strings.TrimSpace(after[strings.LastIndexByte(after, ' ')+1:]), 64)
		if err == nil && v >= q*total {
			return le + "s"
		}
	}
	return "n/a"
}

// resources is the router's goroutine and file-descriptor count.
type resources struct {
	goroutines int
	fds        int
}

func (r *router) resources(t *testing.T) resources {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", r.pid))
	if err != nil {
		t.Fatalf("router fds: %v", err)
	}
	return resources{goroutines: int(metricSum(r.scrape(t), "go_goroutines")), fds: len(ents)}
}

// markBaseline records the idle resource counts the leak check compares
// against.
// rssMB is the router's resident memory in MiB (0 if unknown).
func (r *router) rssMB() int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", r.pid))
	if err != nil {
		return 0
	}
	for _, ln := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(ln, "VmRSS:"); ok {
			kb, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			return kb >> 10
		}
	}
	return 0
}

func (r *router) markBaseline(t *testing.T) {
	t.Helper()
	r.baseline = r.resources(t)
	t.Logf("router baseline: %d goroutines, %d fds", r.baseline.goroutines, r.baseline.fds)
}

// Leak tolerances: the idle router's counts move a little with timers,
// health probes and the metrics scrape itself.
const (
	goroutineSlack = 25
	fdSlack        = 12
)

// checkNoLeak waits (up to within) for the router's goroutines and fds to
// come back to the baseline plus a tolerance once the load is gone. Idle
// upstream keep-alive connections close after 4 s, so that is the floor.
func (r *router) checkNoLeak(t *testing.T, within time.Duration) resources {
	t.Helper()
	deadline := time.Now().Add(within)
	var cur resources
	for {
		cur = r.resources(t)
		if cur.goroutines <= r.baseline.goroutines+goroutineSlack && cur.fds <= r.baseline.fds+fdSlack {
			t.Logf("router after the run: %d goroutines (baseline %d), %d fds (baseline %d)",
				cur.goroutines, r.baseline.goroutines, cur.fds, r.baseline.fds)
			return cur
		}
		if time.Now().After(deadline) {
			t.Errorf("router resources did not come back down within %v: %d goroutines (baseline %d + %d), %d fds (baseline %d + %d)",
				within, cur.goroutines, r.baseline.goroutines, goroutineSlack, cur.fds, r.baseline.fds, fdSlack)
			return cur
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	return harness.GetJSON(t, bins.Client, url, v)
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	return harness.WaitFor(t, d, 20*time.Millisecond, what, cond)
}

// sleepCtx sleeps d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// routerWorkers is GET /workers.
type routerWorkers struct {
	Total   int `json:"total"`
	Workers []struct {
		URL            string `json:"url"`
		Role           string `json:"worker_type"`
		Healthy        bool   `json:"is_healthy"`
		Routable       bool   `json:"routable"`
		CircuitBreaker string `json:"circuit_breaker"`
	} `json:"workers"`
}

func (r *router) workers(t *testing.T) routerWorkers {
	t.Helper()
	var ws routerWorkers
	if code := getJSON(t, r.Base+"/workers", &ws); code != 200 {
		t.Fatalf("/workers: %d", code)
	}
	return ws
}

func (ws routerWorkers) has(url string) bool {
	for _, w := range ws.Workers {
		if w.URL == url {
			return true
		}
	}
	return false
}
