package scenario

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/switchyard-llm/switchyard/internal/freeport"
)

// Names of the binaries a scenario starts (built into Options.BinDir).
const (
	binRouter = "switchyard"
	binSim    = "vllm-sim"
)

// simModel is the model name every simulated worker serves.
const simModel = "sim-model"

const (
	readyTimeout   = 30 * time.Second
	startAttempts  = 3
	pollInterval   = 50 * time.Millisecond
	httpGetTimeout = 2 * time.Second
)

// readyLine is the JSON object vllm-sim prints on stdout once bound.
type readyLine struct {
	Event        string `json:"event"`
	HTTPAddress  string `json:"http_address"`
	ZMQAddress   string `json:"zmq_address"`
	Role         string `json:"role"`
	KVConnector  string `json:"kv_connector"`
	TransferMode string `json:"transfer_mode"`
}

// parseReadyLine checks and decodes vllm-sim's ready line.
func parseReadyLine(line string) (readyLine, error) {
	var r readyLine
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		return r, fmt.Errorf("vllm-sim ready line %q: %w", line, err)
	}
	if r.Event != "ready" || r.HTTPAddress == "" {
		return r, fmt.Errorf("vllm-sim ready line %q: no ready event with http_address", line)
	}
	if _, _, err := net.SplitHostPort(r.HTTPAddress); err != nil {
		return r, fmt.Errorf("vllm-sim ready line: http_address %q: %w", r.HTTPAddress, err)
	}
	return r, nil
}

// sim is a started vllm-sim.
type sim struct {
	*proc
	ready readyLine
}

// URL is the worker's base URL.
func (s *sim) URL() string { return "http://" + s.ready.HTTPAddress }

// startSim starts vllm-sim on a free port and waits for its ready line.
func (g *group) startSim(ctx context.Context, name string, args ...string) (*sim, error) {
	all := append([]string{"--host", "127.0.0.1", "--port", "0", "--model", simModel, "--log-level", "warn"}, args...)
	p, err := g.start(name, binSim, all...)
	if err != nil {
		return nil, err
	}
	t := time.NewTimer(readyTimeout)
	defer t.Stop()
	select {
	case line := <-p.firstLine:
		r, err := parseReadyLine(line)
		if err != nil {
			g.stop(p)
			return nil, err
		}
		return &sim{proc: p, ready: r}, nil
	case <-p.done:
		return nil, fmt.Errorf("vllm-sim %s did not start: %s", name, p.crashSummary())
	case <-t.C:
		g.stop(p)
		return nil, fmt.Errorf("vllm-sim %s: no ready line within %v; log:\n%s", name, readyTimeout, p.logTail(2000))
	case <-ctx.Done():
		g.stop(p)
		return nil, ctx.Err()
	}
}

// router is a started switchyard.
type router struct {
	*proc
	base      string // http://127.0.0.1:PORT
	metrics   string // its Prometheus endpoint, http://127.0.0.1:PORT/metrics
	discovery string // the ZMQ registration address, if any (compare)
}

// freePort returns a port that was free a moment ago on 127.0.0.1.
func freePort() (int, error) { return freeport.Pick() }

func freePorts(n int) ([]int, error) { return freeport.PickN(n) }

// routerArgs are the flags every scenario router gets: loopback, free
// ports, quiet logs (per-request INFO lines would cost CPU the benchmark
// measures) and a short graceful shutdown.
func routerBaseArgs(port, metricsPort int) []string {
	return []string{"--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(metricsPort),
		"--log-level", "warn", "--shutdown-timeout-secs", "2"}
}

// startRouter starts switchyard on free ports and waits until /liveness
// answers. args(extraPort) returns the mode flags; extraPort is one more
// free port (the ZMQ discovery address in PD discovery mode). A router that
// exits at once (a port taken in the meantime) is retried on new ports.
func (g *group) startRouter(ctx context.Context, name string, args func(extraPort int) []string) (*router, int, error) {
	var lastErr error
	for range startAttempts {
		ports, err := freePorts(3)
		if err != nil {
			return nil, 0, err
		}
		p, err := g.start(name, binRouter, append(routerBaseArgs(ports[0], ports[1]), args(ports[2])...)...)
		if err != nil {
			return nil, 0, err
		}
		r := &router{proc: p, base: fmt.Sprintf("http://127.0.0.1:%d", ports[0]),
			metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", ports[1])}
		err = waitHTTP(ctx, r.proc, r.base+"/liveness", readyTimeout)
		if err == nil {
			return r, ports[2], nil
		}
		g.stop(p)
		lastErr = err
		if ctx.Err() != nil {
			return nil, 0, ctx.Err()
		}
	}
	return nil, 0, lastErr
}

// waitHTTP polls url until it answers 200, p exits, ctx ends or within
// passes.
func waitHTTP(ctx context.Context, p *proc, url string, within time.Duration) error {
	return poll200(ctx, p, within, pollInterval, httpGetTimeout, url+" not ready", func(ctx context.Context) *http.Request {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		return req
	})
}

// poll200 sends the request newReq builds every interval until it answers
// 200, p exits, ctx ends or within passes; notYet names the failure
// ("URL not ready") in the timeout's error.
func poll200(ctx context.Context, p *proc, within, interval, callTimeout time.Duration, notYet string, newReq func(context.Context) *http.Request) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	client := &http.Client{Timeout: callTimeout}
	var last string
	for {
		resp, err := client.Do(newReq(ctx))
		if err == nil {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = fmt.Sprintf("HTTP %d %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		t := time.NewTimer(interval)
		select {
		case <-p.done:
			t.Stop()
			return errors.New(p.crashSummary())
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("%s: %s within %v (last: %s); log:\n%s", p.name, notYet, within, last, p.logTail(2000))
			}
			return ctx.Err()
		case <-t.C:
		}
	}
}

// waitReady waits for the router's /readiness (every role registered).
func (r *router) waitReady(ctx context.Context) error {
	return waitHTTP(ctx, r.proc, r.base+"/readiness", readyTimeout)
}

// fleet is a router and its workers.
type fleet struct {
	g       *group
	r       *router
	sims    []*sim
	desc    string
	restart func(ctx context.Context) (*fleet, error)
}

// procs lists the router and every worker.
func (f *fleet) procs() []*proc {
	ps := []*proc{}
	if f.r != nil {
		ps = append(ps, f.r.proc)
	}
	for _, s := range f.sims {
		ps = append(ps, s.proc)
	}
	return ps
}

// simPids are the workers' process ids.
func (f *fleet) simPids() []int {
	var out []int
	for _, s := range f.sims {
		out = append(out, s.Pid())
	}
	return out
}

// check returns an error when any member has exited.
func (f *fleet) check() error { return dead(f.procs()...) }

// stop stops the whole fleet.
func (f *fleet) stop() { f.g.stop(f.procs()...) }

// pdFleet starts switchyard in vLLM PD mode with ZMQ discovery and one
// prefill and one decode vllm-sim that register with it (MoRI-IO).
func (g *group) pdFleet(ctx context.Context, preset, mode, policy string, simExtra ...string) (*fleet, error) {
	f := &fleet{g: g, desc: fmt.Sprintf("1P1D MoRI-IO %s, preset %s, discovery", mode, preset)}
	f.restart = func(ctx context.Context) (*fleet, error) { return g.pdFleet(ctx, preset, mode, policy, simExtra...) }
	ok := false
	defer func() {
		if !ok {
			f.stop()
		}
	}()
	r, zport, err := g.startRouter(ctx, "switchyard-pd-"+mode, func(extra int) []string {
		return []string{"--vllm-pd-disaggregation", "--kv-connector", "moriio",
			"--vllm-discovery-address", fmt.Sprintf("127.0.0.1:%d", extra), "--policy", policy}
	})
	if err != nil {
		return nil, err
	}
	f.r = r
	for _, role := range []string{"prefill", "decode"} {
		args := append([]string{"--role", role, "--kv-connector", "moriio", "--transfer-mode", mode,
			"--proxy-address", fmt.Sprintf("127.0.0.1:%d", zport), "--profile-preset", preset,
			"--heartbeat-interval", "1s"}, simExtra...)
		s, err := g.startSim(ctx, "sim-"+role+"-"+mode, args...)
		if err != nil {
			return nil, err
		}
		f.sims = append(f.sims, s)
	}
	if err := r.waitReady(ctx); err != nil {
		return nil, err
	}
	ok = true
	return f, nil
}

// unifiedSim starts one unified (non-PD) vllm-sim.
func (g *group) unifiedSim(ctx context.Context, preset string) (*sim, error) {
	return g.startSim(ctx, "sim-unified", "--role", "unified", "--profile-preset", preset)
}

// regularFleet starts switchyard in regular mode in front of an already
// running unified worker.
func (g *group) regularRouter(ctx context.Context, worker *sim, policy string) (*router, error) {
	r, _, err := g.startRouter(ctx, "switchyard-regular", func(int) []string {
		return []string{"--worker-urls", worker.URL(), "--policy", policy}
	})
	if err != nil {
		return nil, err
	}
	if err := r.waitReady(ctx); err != nil {
		g.stop(r.proc)
		return nil, err
	}
	return r, nil
}
