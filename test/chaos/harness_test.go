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
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var binDir string

func TestMain(m *testing.M) {
	// -short (make test-short) skips the whole package without building.
	for _, a := range os.Args[1:] {
		if a == "-test.short" || a == "-test.short=true" {
			fmt.Println("chaos: skipped in -short mode")
			os.Exit(0)
		}
	}
	dir, err := os.MkdirTemp("", "switchyard-chaos-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	// The router and the simulator are built without -race even when the
	// test binary is: the point is the router's behaviour under load, and
	// the race detector would multiply its CPU cost on a 2-core machine.
	cmd := exec.Command("go", "build", "-o", dir+string(os.PathSeparator), "../../cmd/switchyard", "../../cmd/vllm-sim")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// longForm reports whether CHAOS_LONG=1 asks for the long form.
func longForm() bool { return os.Getenv("CHAOS_LONG") == "1" }

// proc is a started child process.
type proc struct {
	name string
	cmd  *exec.Cmd
	logs *tailBuffer
	done chan struct{}
}

// tailBuffer keeps the last max bytes written (process logs under load).
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (s *tailBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b = append(s.b, p...)
	if len(s.b) > 2*s.max {
		s.b = append(s.b[:0], s.b[len(s.b)-s.max:]...)
	}
	return len(p), nil
}

func (s *tailBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.b) > s.max {
		return "..." + string(s.b[len(s.b)-s.max:])
	}
	return string(s.b)
}

func start(t *testing.T, name string, args ...string) (*proc, io.Reader) {
	t.Helper()
	cmd := exec.Command(filepath.Join(binDir, name), args...)
	logs := &tailBuffer{max: 6000}
	if os.Getenv("CHAOS_LOGMAX") != "" {
		logs.max = 4 << 20
	}
	cmd.Stderr = logs
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{name: name, cmd: cmd, logs: logs, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("--- %s %v logs:\n%s", name, args, logs.String())
		}
	})
	return p, out
}

// stop sends SIGTERM, then SIGKILL after 5 s.
func (p *proc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// kill sends SIGKILL and waits for the exit.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

func (p *proc) signal(t *testing.T, s os.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(s); err != nil {
		t.Fatalf("signal %v to %s: %v", s, p.name, err)
	}
}

// simInfo is vllm-sim's ready line.
type simInfo struct {
	Event       string `json:"event"`
	HTTPAddress string `json:"http_address"`
	Role        string `json:"role"`
}

type sim struct {
	*proc
	info simInfo
}

func (s *sim) URL() string { return "http://" + s.info.HTTPAddress }

func startSim(t *testing.T, args ...string) *sim {
	t.Helper()
	p, out := start(t, "vllm-sim", append([]string{"--port", "0", "--log-level", "warn"}, args...)...)
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
	}()
	select {
	case l := <-lines:
		var info simInfo
		if err := json.Unmarshal([]byte(l), &info); err != nil || info.Event != "ready" {
			t.Fatalf("vllm-sim ready line %q: %v", l, err)
		}
		return &sim{proc: p, info: info}
	case <-p.done:
		t.Fatalf("vllm-sim exited: %s", p.logs.String())
	case <-time.After(15 * time.Second):
		t.Fatalf("vllm-sim not ready: %s", p.logs.String())
	}
	return nil
}

// simStats is the part of GET /sim/stats the scenarios read.
type simStats struct {
	Requests struct {
		Completions     int64 `json:"completions"`
		ChatCompletions int64 `json:"chat_completions"`
		PrefillLeg      int64 `json:"prefill_leg"`
		DecodeLeg       int64 `json:"decode_leg"`
		Plain           int64 `json:"plain"`
		Aborted         int64 `json:"aborted"`
		InFlight        int64 `json:"in_flight"`
	} `json:"requests"`
	WaitingRemote int `json:"waiting_for_remote_kv"`
	Transfers     struct {
		KVDigestMismatch int64 `json:"kv_digest_mismatch"`
		KVGarbage        int64 `json:"kv_garbage"`
	} `json:"transfers"`
}

func (s *sim) stats(t *testing.T) simStats {
	t.Helper()
	var st simStats
	if code := getJSON(t, s.URL()+"/sim/stats", &st); code != 200 {
		t.Fatalf("%s /sim/stats: %d", s.URL(), code)
	}
	return st
}

// setFaults posts a runtime fault change to the simulator.
func (s *sim) setFaults(t *testing.T, faults map[string]any) {
	t.Helper()
	b, _ := json.Marshal(faults)
	resp, err := http.Post(s.URL()+"/sim/faults", "application/json", strings.NewReader(string(b)))
	if err != nil {
		t.Fatalf("/sim/faults: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/sim/faults %s: %d %s", b, resp.StatusCode, body)
	}
}

type router struct {
	*proc
	base     string
	metrics  string
	zmqAddr  string // discovery address, PD fleets
	pid      int
	baseline resources
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startRouter starts switchyard and waits until /liveness answers.
func startRouter(t *testing.T, args ...string) *router {
	t.Helper()
	port, mport := freePort(t), freePort(t)
	all := append([]string{"--host", "127.0.0.1", "--port", fmt.Sprint(port), "--prometheus-port", fmt.Sprint(mport), "--log-level", "warn"}, args...)
	p, out := start(t, "switchyard", all...)
	go func() { _, _ = io.Copy(p.logs, out) }()
	r := &router{proc: p, base: fmt.Sprintf("http://127.0.0.1:%d", port), metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", mport), pid: p.cmd.Process.Pid}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			t.Fatalf("switchyard exited early: %s", p.logs.String())
		default:
		}
		resp, err := http.Get(r.base + "/liveness")
		if err == nil {
			resp.Body.Close()
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("switchyard not live: %s", p.logs.String())
	return nil
}

// waitReady polls /readiness until 200.
func (r *router) waitReady(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var last string
	for time.Now().Before(deadline) {
		resp, err := http.Get(r.base + "/readiness")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
			last = string(b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("router not ready within %v: %s", within, last)
}

// alive fails the test if the router process has exited.
func (r *router) alive(t *testing.T) {
	t.Helper()
	select {
	case <-r.done:
		t.Fatalf("switchyard exited during the scenario: %s", r.logs.String())
	default:
	}
}

// scrape returns the router's Prometheus text.
func (r *router) scrape(t *testing.T) string {
	t.Helper()
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(r.metrics)
	if err != nil {
		t.Fatalf("scrape %s: %v", r.metrics, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", r.metrics, err)
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
	c := &http.Client{Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v: %s", url, err, b)
		}
	}
	return resp.StatusCode
}

// waitFor polls cond every 20 ms until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if cond() {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
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
	if code := getJSON(t, r.base+"/workers", &ws); code != 200 {
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
