package scenario

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Router names of the compare scenario.
const (
	PeerDirect       = "direct"
	PeerSwitchyard   = "switchyard"
	PeerVLLMRouter   = "vllm-router"
	PeerSGLangRouter = "sglang-router"
	PeerNginx        = "nginx"
	PeerNIXLToyProxy = "nixl-toy-proxy"
	PeerMoRIToyProxy = "moriio-toy-proxy"
)

// Paths under the peers directory (scripts/install-peers.sh).
const (
	peerVLLMRouterBin   = "bin/vllm-router"
	peerSGLangRouterBin = "bin/sglang-router"
	peerPython          = "bin/python"
	peerNIXLToyProxy    = "src/vllm-0.33.0/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
	peerMoRIToyProxy    = "src/vllm-0.33.0/examples/disaggregated/disaggregated_serving/moriio_toy_proxy_server.py"
)

// completionBody is the 1-token request wrk sends and the readiness probe
// of every router.
const completionBody = `{"model":"` + simModel + `","prompt":"hello","max_tokens":1}`

// fleetURLs are the workers a router fronts: one unified worker (regular)
// or one prefill and one decode (PD).
type fleetURLs struct {
	worker          string
	prefill, decode string
	// discovery is the ZMQ address MoRI-IO workers register on (PD with
	// --vllm-discovery-address instead of static URLs).
	discovery string
	// policy, when set, replaces the scenario's --policy.
	policy string
}

// peer is one router of the compare scenario.
type peer struct {
	name string
	// exe is the absolute executable ("" for direct).
	exe string
	// args returns the command line for the fleet on port (and a metrics
	// port), or why this router cannot run the fleet's mode.
	args func(f fleetURLs, port, metricsPort int, dir string) ([]string, error)
	// prepare, if set, writes files the router needs under dir.
	prepare func(f fleetURLs, port int, dir string) error
	// env, if set, is the router's environment (else sybench's own).
	env []string
}

// errUnsupported marks a router that cannot run a scenario's mode.
var errUnsupported = errors.New("unsupported")

// vllmRouterArgs is the command line both switchyard and vllm-router get:
// the drop-in claim is that the same flags start either. The log level is
// the Python launcher's spelling ("warning"; the Rust binary's "warn" is
// rejected by the launcher's argparse).
func vllmRouterArgs(f fleetURLs, port, metricsPort int, policy string) []string {
	if f.policy != "" {
		policy = f.policy
	}
	a := []string{"--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(metricsPort),
		"--log-level", "warning", "--policy", policy}
	switch {
	case f.worker != "":
		return append(a, "--worker-urls", f.worker)
	case f.discovery != "":
		return append(a, "--vllm-pd-disaggregation", "--kv-connector", "moriio", "--vllm-discovery-address", f.discovery)
	}
	return append(a, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
		"--prefill", f.prefill, "--decode", f.decode)
}

// peers lists the routers in measurement order, with their executables
// resolved (binDir for switchyard, peersDir for the others).
func peers(binDir, peersDir, policy string) []peer {
	abs := func(p string) string {
		if a, err := filepath.Abs(p); err == nil {
			return a
		}
		return p
	}
	sameFlags := func(f fleetURLs, port, mport int, _ string) ([]string, error) {
		return vllmRouterArgs(f, port, mport, policy), nil
	}
	nginxPath := nginxExe()
	return []peer{
		{name: PeerDirect},
		{name: PeerSwitchyard, exe: abs(filepath.Join(binDir, binRouter)), args: sameFlags},
		{name: PeerVLLMRouter, exe: abs(filepath.Join(peersDir, peerVLLMRouterBin)), args: sameFlags},
		{name: PeerSGLangRouter, exe: abs(filepath.Join(peersDir, peerSGLangRouterBin)),
			args: func(f fleetURLs, port, mport int, _ string) ([]string, error) {
				if f.worker == "" {
					return nil, fmt.Errorf("%w: sglang-router's PD mode speaks SGLang's bootstrap protocol, not vLLM's kv_transfer_params or ZMQ registration", errUnsupported)
				}
				return []string{"launch", "--host", "127.0.0.1", "--port", strconv.Itoa(port),
					"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(mport),
					"--log-level", "warn", "--policy", sglangPolicy(policy), "--worker-urls", f.worker}, nil
			}},
		{name: PeerNginx, exe: nginxPath,
			args: func(f fleetURLs, _, _ int, dir string) ([]string, error) {
				if f.worker == "" {
					return nil, fmt.Errorf("%w: a plain reverse proxy cannot run the two-leg PD protocol", errUnsupported)
				}
				return nginxArgs(dir), nil
			},
			prepare: func(f fleetURLs, port int, dir string) error {
				if f.worker == "" {
					return nil
				}
				return writeNginxConf(dir, f.worker, port)
			}},
		{name: PeerNIXLToyProxy, exe: abs(filepath.Join(peersDir, peerPython)),
			args: func(f fleetURLs, port, _ int, _ string) ([]string, error) {
				if f.worker != "" {
					return nil, fmt.Errorf("%w: PD only", errUnsupported)
				}
				if f.discovery != "" {
					return nil, fmt.Errorf("%w: NIXL static workers only (vLLM's MoRI-IO toy proxy is the moriio-toy-proxy row)", errUnsupported)
				}
				ph, pp, err := hostPort(f.prefill)
				if err != nil {
					return nil, err
				}
				dh, dp, err := hostPort(f.decode)
				if err != nil {
					return nil, err
				}
				return []string{abs(filepath.Join(peersDir, peerNIXLToyProxy)), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
					"--prefiller-host", ph, "--prefiller-port", pp, "--decoder-host", dh, "--decoder-port", dp}, nil
			}},
		moriToyProxy(abs(filepath.Join(peersDir, peerPython)), abs(filepath.Join(peersDir, peerMoRIToyProxy))),
	}
}

// moriToyProxy is vLLM's MoRI-IO toy proxy, run from the sdist with the
// peers venv's Python; it imports vLLM (and torch), which it finds in the
// real-engine tier's venv through PYTHONPATH. It binds 0.0.0.0.
func moriToyProxy(python, script string) peer {
	venv, _, _ := realEnv()
	site, _ := filepath.Glob(filepath.Join(venv, "lib", "python3*", "site-packages"))
	p := peer{name: PeerMoRIToyProxy, exe: python}
	if len(site) == 1 {
		p.env = append(os.Environ(), "PYTHONPATH="+site[0])
	}
	p.args = func(f fleetURLs, port, _ int, _ string) ([]string, error) {
		if f.discovery == "" {
			return nil, fmt.Errorf("%w: MoRI-IO with ZMQ discovery only", errUnsupported)
		}
		if len(site) != 1 {
			return nil, fmt.Errorf("%w: it imports vLLM and torch; none at %s (run scripts/install-interop.sh)", errUnsupported, venv)
		}
		zp := "0" // startPeer asks once before it picks the ZMQ port
		if f.discovery != "zmq" {
			var err error
			if _, zp, err = net.SplitHostPort(f.discovery); err != nil {
				return nil, fmt.Errorf("discovery address %q: %w", f.discovery, err)
			}
		}
		return []string{script, "--port", strconv.Itoa(port), "--service-discovery-port", zp}, nil
	}
	return p
}

// nginxExe is nginx on PATH, else Debian's /usr/sbin/nginx (not on a
// user's PATH).
func nginxExe() string {
	if p, err := exec.LookPath("nginx"); err == nil {
		return p
	}
	return "/usr/sbin/nginx"
}

// nginxArgs runs nginx with the configuration writeNginxConf wrote in dir.
func nginxArgs(dir string) []string {
	return []string{"-p", dir, "-c", filepath.Join(dir, "nginx.conf"), "-e", filepath.Join(dir, "error.log")}
}

// sglangPolicy maps a policy sglang-router lacks to round_robin.
func sglangPolicy(p string) string {
	switch p {
	case "random", "round_robin", "cache_aware", "power_of_two":
		return p
	}
	return "round_robin"
}

func hostPort(raw string) (string, string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" || u.Port() == "" {
		return "", "", fmt.Errorf("worker URL %q: want http://HOST:PORT", raw)
	}
	return u.Hostname(), u.Port(), nil
}

// writeNginxConf writes a plain reverse proxy of one worker: one worker
// process, keep-alive to the upstream, no buffering (so SSE chunks pass as
// they come), no access log.
func writeNginxConf(dir, worker string, port int) error {
	h, p, err := hostPort(worker)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o755); err != nil {
		return err
	}
	conf := nginxConf(dir, h+":"+p, port)
	return os.WriteFile(filepath.Join(dir, "nginx.conf"), []byte(conf), 0o644)
}

func nginxConf(dir, upstream string, port int) string {
	return fmt.Sprintf(`worker_processes 1;
daemon off;
master_process on;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 16384; }
http {
  access_log off;
  client_body_temp_path %[1]s/tmp/body;
  proxy_temp_path %[1]s/tmp/proxy;
  fastcgi_temp_path %[1]s/tmp/fastcgi;
  uwsgi_temp_path %[1]s/tmp/uwsgi;
  scgi_temp_path %[1]s/tmp/scgi;
  client_max_body_size 64m;
  upstream worker { server %[2]s; keepalive 1024; }
  server {
    listen 127.0.0.1:%[3]d backlog=4096;
    location / {
      proxy_pass http://worker;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 600s;
    }
  }
}
`, dir, upstream, port)
}

// startPeer starts one router in front of f on free ports and waits until a
// 1-token completion through it succeeds. It returns the router (nil for
// direct), its base URL and its full command line.
//
// With f.discovery "zmq" the router gets a free ZMQ address and
// startWorkers(address) starts the workers that register on it, after the
// router and before the readiness check.
func (g *group) startPeer(ctx context.Context, p peer, f fleetURLs, dir string, startWorkers func(discovery string) error) (*router, string, error) {
	if p.name == PeerDirect {
		if f.worker == "" {
			return nil, "", fmt.Errorf("%w: a PD request needs a router", errUnsupported)
		}
		return nil, "", nil
	}
	if _, err := os.Stat(p.exe); err != nil {
		return nil, "", fmt.Errorf("%w: %s not installed (run scripts/install-peers.sh)", errUnsupported, p.exe)
	}
	var lastErr error
	zmqDiscovery := f.discovery == "zmq"
	for range startAttempts {
		// Every attempt takes fresh ports: the HTTP and metrics ports and,
		// with ZMQ discovery, the router's ZMQ listener.
		n := 2
		if zmqDiscovery {
			n = 3
		}
		ports, err := freePorts(n)
		if err != nil {
			return nil, "", err
		}
		if zmqDiscovery {
			f.discovery = fmt.Sprintf("127.0.0.1:%d", ports[2])
		}
		args, err := p.args(f, ports[0], ports[1], dir)
		if err != nil {
			return nil, "", err
		}
		if p.prepare != nil {
			if err := p.prepare(f, ports[0], dir); err != nil {
				return nil, "", err
			}
		}
		pr, err := g.startEnv(p.name, p.exe, p.env, args...)
		if err != nil {
			return nil, "", err
		}
		r := &router{proc: pr, base: fmt.Sprintf("http://127.0.0.1:%d", ports[0]), discovery: f.discovery}
		cmd := strings.Join(append([]string{p.exe}, args...), " ")
		if startWorkers != nil {
			if err := startWorkers(f.discovery); err != nil {
				g.stop(pr)
				return nil, "", err
			}
		}
		if err = waitCompletion(ctx, pr, r.base, peerReadyTimeout); err == nil {
			return r, cmd, nil
		}
		g.stop(pr)
		lastErr = err
		if ctx.Err() != nil {
			return nil, "", ctx.Err()
		}
	}
	return nil, "", lastErr
}

// peerReadyTimeout bounds a router's start-up (the Python launchers import
// their packages first; vllm-router waits for its workers' health).
const peerReadyTimeout = 60 * time.Second

// waitCompletion posts the 1-token completion to base until it answers
// 200, p exits, ctx ends or within passes.
func waitCompletion(ctx context.Context, p *proc, base string, within time.Duration) error {
	return poll200(ctx, p, within, 4*pollInterval, 5*time.Second, "no successful completion", func(ctx context.Context) *http.Request {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(completionBody))
		req.Header.Set("Content-Type", "application/json")
		return req
	})
}

// wrkResult is what one wrk run reports.
type wrkResult struct {
	Requests     int
	ReqPerS      float64
	P50, P99     float64 // latency, ms
	Non2xx       int
	SocketErrors int
}

// wrkScript makes wrk POST the 1-token completion.
const wrkScript = `wrk.method = "POST"
wrk.body = '` + completionBody + `'
wrk.headers["Content-Type"] = "application/json"
`

// wrkArgs is wrk's command line for one run.
func wrkArgs(threads, conns int, d time.Duration, script, target string) []string {
	return []string{"-t" + strconv.Itoa(threads), "-c" + strconv.Itoa(conns), "-d" + strconv.Itoa(int(d.Seconds())) + "s",
		"--latency", "--timeout", "10s", "-s", script, target + "/v1/completions"}
}

// runWrk runs wrk (bounded by ctx and d plus a margin) and parses it.
func runWrk(ctx context.Context, args []string, d time.Duration) (wrkResult, error) {
	ctx, cancel := context.WithTimeout(ctx, d+30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "wrk", args...).CombinedOutput()
	if err != nil {
		return wrkResult{}, fmt.Errorf("wrk %s: %w: %s", strings.Join(args, " "), err, tailLines(out, 500))
	}
	return parseWrk(out)
}

// parseWrk reads wrk --latency output.
func parseWrk(out []byte) (wrkResult, error) {
	var r wrkResult
	var haveRPS, haveP50 bool
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) == 2 && f[0] == "Requests/sec:":
			v, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return r, fmt.Errorf("wrk: %q: %w", sc.Text(), err)
			}
			r.ReqPerS, haveRPS = v, true
		case len(f) == 2 && (f[0] == "50%" || f[0] == "99%"):
			v, err := parseWrkDuration(f[1])
			if err != nil {
				return r, err
			}
			if f[0] == "50%" {
				r.P50, haveP50 = v, true
			} else {
				r.P99 = v
			}
		case len(f) >= 3 && f[1] == "requests" && f[2] == "in":
			r.Requests, _ = strconv.Atoi(f[0])
		case len(f) >= 2 && f[0] == "Non-2xx": // Non-2xx or 3xx responses: N
			r.Non2xx, _ = strconv.Atoi(f[len(f)-1])
		case len(f) >= 2 && f[0] == "Socket" && f[1] == "errors:":
			// Socket errors: connect 0, read 0, write 0, timeout 0
			for i := 2; i+1 < len(f); i += 2 {
				n, _ := strconv.Atoi(strings.TrimSuffix(f[i+1], ","))
				r.SocketErrors += n
			}
		}
	}
	if !haveRPS || !haveP50 {
		return r, fmt.Errorf("wrk: no Requests/sec or 50%% latency in output: %s", tailLines(out, 500))
	}
	return r, nil
}

// parseWrkDuration parses wrk's "1.23ms", "850.00us", "1.02s", "2.00m" into
// milliseconds.
func parseWrkDuration(s string) (float64, error) {
	units := []struct {
		suffix string
		ms     float64
	}{{"us", 1e-3}, {"ms", 1}, {"s", 1e3}, {"m", 60e3}, {"h", 3600e3}}
	for _, u := range units {
		if v, ok := strings.CutSuffix(s, u.suffix); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				continue
			}
			return f * u.ms, nil
		}
	}
	return 0, fmt.Errorf("wrk: bad duration %q", s)
}

// groupCPU is the CPU time of every live process in process group pgid
// (nginx's master and worker; a Python launcher and its threads are one
// process).
func groupCPU(pgid int) time.Duration {
	return cpuTimes(groupPids(pgid)...)
}

// groupRSS is the summed VmRSS of process group pgid.
func groupRSS(pgid int) int64 {
	var sum int64
	for _, p := range groupPids(pgid) {
		sum += procRSS(p)
	}
	return sum
}

// groupPids lists the processes whose process group is pgid.
func groupPids(pgid int) []int {
	es, err := os.ReadDir("/proc")
	if err != nil {
		return []int{pgid}
	}
	var out []int
	for _, e := range es {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		if pg, ok := statPgrp(b); ok && pg == pgid {
			out = append(out, pid)
		}
	}
	return out
}

// statPgrp returns field 5 (pgrp) of /proc/<pid>/stat contents.
func statPgrp(b []byte) (int, bool) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 3 {
		return 0, false
	}
	pg, err := strconv.Atoi(f[2])
	return pg, err == nil
}
