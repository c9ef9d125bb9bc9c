package scenario

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

// RelayConfig is the per-event relay scenario: paced token streams whose
// events carry the time the worker wrote them, so the client measures each
// event's delivery latency directly, and the same streams through
// switchyard regular mode, so the difference is what the router adds per
// relayed event.
type RelayConfig struct {
	Concurrency []int
	Events      int           // token events per stream
	Interval    time.Duration // between two events of a stream
	Streams     float64       // streams per point = ceil(this × C)
	Repeats     int
	Policy      string
	// Router flags added to switchyard's (e.g. --max-migrations 0).
	RouterArgs []string
	// VLLMRouter, when set, is the vllm-router executable measured as a
	// third target with the same flags (scripts/install-peers.sh).
	VLLMRouter string
	// GoProxy adds Go's standard reverse proxy (sybench floor-proxy --mode
	// stdlib, from the bin dir) as a target: what Go's HTTP stack alone
	// adds to each event.
	GoProxy bool
	// Nginx adds nginx (one worker process, the head-to-head table's
	// configuration: keep-alive upstream, no buffering) as a target: what
	// an event loop written in C adds to each event on this machine.
	Nginx bool
}

// TargetGoProxy names the relay scenario's standard-library proxy.
const TargetGoProxy = "go-reverseproxy"

// DefaultRelayConfig: 100 events 10 ms apart (a 100 tokens/s decode), at
// C = 64 and 256.
func DefaultRelayConfig() RelayConfig {
	return RelayConfig{Concurrency: []int{64, 256}, Events: 100, Interval: 10 * time.Millisecond,
		Streams: 3, Repeats: 3, Policy: "round_robin"}
}

// QuickRelayConfig is a smoke run.
func QuickRelayConfig() RelayConfig {
	c := DefaultRelayConfig()
	c.Concurrency, c.Events, c.Streams, c.Repeats = []int{16}, 20, 1, 1
	return c
}

// RelayRow is one measured run of a (concurrency, target) pair.
type RelayRow struct {
	Target      string
	Concurrency int
	Rep         int
	Streams     int
	Failed      int
	Events      int
	// Latency percentiles of event delivery (written by the worker →
	// parsed by the client), in µs.
	P50, P90, P99 float64
	RouterCPU     time.Duration
}

// CPUPerEvent is the router's CPU per relayed event in µs.
func (r RelayRow) CPUPerEvent() float64 {
	if r.Events == 0 {
		return math.NaN()
	}
	return float64(r.RouterCPU.Microseconds()) / float64(r.Events)
}

// RelayReport is the result of RunRelay.
type RelayReport struct {
	Config  RelayConfig
	Options Options
	Machine string
	Rows    []RelayRow
	Notes   []string
	Elapsed time.Duration
}

// RunRelay measures what switchyard adds to each relayed SSE event.
func RunRelay(ctx context.Context, o Options, c RelayConfig) (*RelayReport, error) {
	return runScenario(ctx, o, scenarioSpec[*RelayReport]{
		name: "relay", defMax: 10 * time.Minute, skipped: "points",
		report: func(e *env) *RelayReport { return &RelayReport{Config: c, Options: e.o, Machine: e.m.String()} },
		run:    func(ctx context.Context, e *env, rep *RelayReport) error { return e.runRelay(ctx, c, rep) },
		files:  []scenarioFile[*RelayReport]{{"relay.md", (*RelayReport).WriteMarkdown}},
	})
}

func (e *env) runRelay(ctx context.Context, c RelayConfig, rep *RelayReport) error {
	up, err := startPacedWorker(c.Events, c.Interval)
	if err != nil {
		return err
	}
	defer up.close()
	r, _, err := e.g.startRouter(ctx, "switchyard-regular", func(int) []string {
		return append([]string{"--worker-urls", up.url, "--policy", c.Policy}, c.RouterArgs...)
	})
	if err != nil {
		return err
	}
	if err := r.waitReady(ctx); err != nil {
		return err
	}
	type target struct {
		name, base string
		router     *proc
	}
	targets := []target{{TargetDirect, up.url, nil}, {TargetRegular, r.base, r.proc}}
	if c.VLLMRouter != "" {
		vr, err := e.startVLLMRouter(ctx, c, up.url)
		if err != nil {
			return err
		}
		targets = append(targets, target{PeerVLLMRouter, vr.base, vr.proc})
	}
	if c.GoProxy {
		gp, err := e.startGoProxy(ctx, up.url)
		if err != nil {
			return err
		}
		targets = append(targets, target{TargetGoProxy, gp.base, gp.proc})
	}
	if c.Nginx {
		ng, err := e.startNginx(ctx, up.url)
		if err != nil {
			return err
		}
		targets = append(targets, target{PeerNginx, ng.base, ng.proc})
	}
	for _, conc := range c.Concurrency {
		for k := range max(c.Repeats, 1) {
			for _, t := range targets {
				n := int(math.Ceil(c.Streams * float64(conc)))
				cl := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: conc, MaxConnsPerHost: conc}}
				// Warm-up: one stream per connection, not measured.
				if _, err := runPaced(ctx, cl, t.base, conc, conc); err != nil {
					return fmt.Errorf("%s C=%d warm-up: %w", t.name, conc, err)
				}
				var r0 time.Duration
				if t.router != nil { // its process group: nginx's worker is a child
					r0 = groupCPU(t.router.Pid())
				}
				res, err := runPaced(ctx, cl, t.base, conc, n)
				row := RelayRow{Target: t.name, Concurrency: conc, Rep: k, Streams: n}
				if t.router != nil {
					row.RouterCPU = groupCPU(t.router.Pid()) - r0
				}
				cl.CloseIdleConnections()
				if err != nil {
					return fmt.Errorf("%s C=%d: %w", t.name, conc, err)
				}
				row.Failed, row.Events = res.failed, len(res.lat)
				slices.Sort(res.lat)
				row.P50, row.P90, row.P99 = bench.PercentileSorted(res.lat, 50), bench.PercentileSorted(res.lat, 90), bench.PercentileSorted(res.lat, 99)
				rep.Rows = append(rep.Rows, row)
				e.printf("#%d %-7s C=%-4d streams %d failed %d events %d: delivery P50/P90/P99 %.0f/%.0f/%.0f µs, router CPU %.1f µs/event\n",
					k+1, t.name, conc, n, row.Failed, row.Events, row.P50, row.P90, row.P99, row.CPUPerEvent())
				if t.router != nil {
					if derr := dead(t.router); derr != nil {
						return derr
					}
				}
			}
		}
	}
	return nil
}

// startVLLMRouter starts vllm-router in front of worker with the flags
// switchyard got and waits until a stream passes through it.
func (e *env) startVLLMRouter(ctx context.Context, c RelayConfig, worker string) (*router, error) {
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	p, err := e.g.start(PeerVLLMRouter, c.VLLMRouter, vllmRouterArgs(fleetURLs{worker: worker}, ports[0], ports[1], c.Policy)...)
	if err != nil {
		return nil, err
	}
	return e.streamReady(ctx, PeerVLLMRouter, p, ports[0])
}

// startGoProxy starts sybench's standard-library proxy in front of worker
// and waits until a stream passes through it.
func (e *env) startGoProxy(ctx context.Context, worker string) (*router, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	p, err := e.g.start(TargetGoProxy, "sybench", "floor-proxy", "--mode", "stdlib",
		"--upstream", strings.TrimPrefix(worker, "http://"), "--listen", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return nil, err
	}
	return e.streamReady(ctx, TargetGoProxy, p, port)
}

// startNginx starts nginx in front of worker with the head-to-head table's
// configuration (writeNginxConf) and waits until a stream passes through it.
func (e *env) startNginx(ctx context.Context, worker string) (*router, error) {
	exe := nginxExe()
	if _, err := os.Stat(exe); err != nil {
		return nil, fmt.Errorf("nginx: %w (run scripts/install-peers.sh)", err)
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(e.o.LogDir, "nginx-relay")
	if err := writeNginxConf(dir, worker, port); err != nil {
		return nil, err
	}
	p, err := e.g.start(PeerNginx, exe, nginxArgs(dir)...)
	if err != nil {
		return nil, err
	}
	return e.streamReady(ctx, PeerNginx, p, port)
}

// streamReady waits until a stream passes through the proxy p serves on
// port (stopping p if it never does).
func (e *env) streamReady(ctx context.Context, name string, p *proc, port int) (*router, error) {
	r := &router{proc: p, base: fmt.Sprintf("http://127.0.0.1:%d", port)}
	cl := &http.Client{Timeout: 5 * time.Second}
	defer cl.CloseIdleConnections()
	deadline := time.Now().Add(readyTimeout)
	for {
		if _, err := pacedOne(ctx, cl, r.base); err == nil {
			return r, nil
		} else if time.Now().After(deadline) || dead(p) != nil || ctx.Err() != nil {
			e.g.stop(p)
			return nil, fmt.Errorf("%s not ready: %w", name, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// pacedWorker is an OpenAI-compatible completions endpoint on loopback
// whose streams send one event per interval, each event's text the
// worker's clock (Unix ns) when it wrote it. It runs in the benchmark's
// process, like the client: both read the same clock.
type pacedWorker struct {
	url string
	srv *http.Server
	wg  sync.WaitGroup
}

func startPacedWorker(events int, interval time.Duration) (*pacedWorker, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	w := &pacedWorker{url: "http://" + ln.Addr().String()}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "application/json")
		io.WriteString(rw, `{"object":"list","data":[{"id":"`+simModel+`","object":"model","created":0,"owned_by":"vllm","max_model_len":4096}]}`)
	})
	mux.HandleFunc("POST /v1/completions", func(rw http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		pacedStream(rw, r.Context(), events, interval)
	})
	w.srv = &http.Server{Handler: mux}
	w.wg.Go(func() { _ = w.srv.Serve(ln) })
	return w, nil
}

func (w *pacedWorker) close() {
	_ = w.srv.Close()
	w.wg.Wait()
}

// pacedStream writes a vLLM-shaped completions stream: events token
// chunks interval apart, a finish chunk and [DONE]. The stream's phase
// within the interval is random: left to the requests' arrival, the
// streams' events would line up as closely as the target under test
// forwarded their starts, so a target that forwards C requests faster
// would be measured under a burstier load.
func pacedStream(rw http.ResponseWriter, ctx context.Context, events int, interval time.Duration) {
	rw.Header().Set("Content-Type", "text/event-stream")
	rc := http.NewResponseController(rw)
	phase := time.NewTimer(rand.N(interval))
	select {
	case <-ctx.Done():
		phase.Stop()
		return
	case <-phase.C:
	}
	const head = `data: {"id":"cmpl-relay","object":"text_completion","created":1,"model":"` + simModel + `","choices":[{"index":0,"text":"`
	const tail = `","logprobs":null,"finish_reason":null,"stop_reason":null}]}` + "\n\n"
	buf := make([]byte, 0, 256)
	t := time.NewTicker(interval)
	defer t.Stop()
	for range events {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		buf = append(strconv.AppendInt(append(buf[:0], head...), time.Now().UnixNano(), 10), tail...)
		if _, err := rw.Write(buf); err != nil || rc.Flush() != nil {
			return
		}
	}
	io.WriteString(rw, `data: {"id":"cmpl-relay","object":"text_completion","created":1,"model":"`+simModel+
		`","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length","stop_reason":null}]}`+"\n\ndata: [DONE]\n\n")
}

type pacedResult struct {
	lat    []float64 // µs per event
	failed int
}

// runPaced runs n streams, conc at a time, against base and collects each
// token event's delivery latency.
func runPaced(ctx context.Context, cl *http.Client, base string, conc, n int) (pacedResult, error) {
	var mu sync.Mutex
	var res pacedResult
	next := make(chan struct{}, n)
	for range n {
		next <- struct{}{}
	}
	close(next)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			var lat []float64
			failed := 0
			for range next {
				l, err := pacedOne(ctx, cl, base)
				if err != nil {
					failed++
					continue
				}
				lat = append(lat, l...)
			}
			mu.Lock()
			res.lat = append(res.lat, lat...)
			res.failed += failed
			mu.Unlock()
		})
	}
	wg.Wait()
	return res, ctx.Err()
}

var errNoDone = errors.New("stream ended without [DONE]")

func pacedOne(ctx context.Context, cl *http.Client, base string) ([]float64, error) {
	body := `{"model":"` + simModel + `","prompt":"hello","max_tokens":100,"stream":true}`
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := cl.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("status %d", resp.StatusCode)
	}
	var lat []float64
	sc := bufio.NewScanner(resp.Body)
	key := []byte(`"text":"`)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.Equal(line, []byte("data: [DONE]")) {
			return lat, nil
		}
		i := bytes.Index(line, key)
		if i < 0 {
			continue
		}
		v := line[i+len(key):]
		if j := bytes.IndexByte(v, '"'); j > 0 {
			if sent, err := strconv.ParseInt(string(v[:j]), 10, 64); err == nil {
				lat = append(lat, float64(time.Now().UnixNano()-sent)/1e3)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return nil, errNoDone
}

// relayAgg is the median over the repetitions of one (target, C).
type relayAgg struct {
	runs, streams, failed, events int
	p50, p90, p99, cpu            float64
	p50Lo, p50Hi                  float64
}

func (r *RelayReport) agg(target string, c int) (relayAgg, bool) {
	var a relayAgg
	var p50, p90, p99, cpu []float64
	for _, x := range r.Rows {
		if x.Target != target || x.Concurrency != c {
			continue
		}
		a.runs++
		a.streams += x.Streams
		a.failed += x.Failed
		a.events += x.Events
		p50, p90, p99 = append(p50, x.P50), append(p90, x.P90), append(p99, x.P99)
		cpu = append(cpu, x.CPUPerEvent())
	}
	if a.runs == 0 {
		return a, false
	}
	a.p50, a.p90, a.p99, a.cpu = medianOf(p50), medianOf(p90), medianOf(p99), medianOf(cpu)
	a.p50Lo, a.p50Hi = slices.Min(p50), slices.Max(p50)
	return a, true
}

// WriteMarkdown writes the per-event table.
func (r *RelayReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	b.WriteString("# Per-event relay latency (paced token streams)\n\n")
	fmt.Fprintf(&b, "Generated by `%s`.\n\n", orDefault(r.Options.Command, "sybench scenario relay"))
	fmt.Fprintf(&b, "- Machine: %s.\n- Scenario wall time: %s.\n", r.Machine, sec(r.Elapsed))
	fmt.Fprintf(&b, "- Worker: an OpenAI-compatible completions stream in sybench's own process: %d token events %s apart, each stream at a random phase "+
		"within that interval (so the events' alignment does not depend on how fast the target forwarded the streams' starts), each event's text the "+
		"worker's clock (Unix ns) when it wrote it, then a finish event and `[DONE]`. The client (same process, same clock) takes each token "+
		"event's delivery latency: parsed − written. **direct** = client → worker; **regular** = client → `switchyard --worker-urls <worker> --policy %s%s` → worker%s.\n",
		c.Events, c.Interval, c.Policy, joinedArgs(c.RouterArgs), orDefault(map[bool]string{true: "; **vllm-router** = the same through vllm-router with the same flags"}[c.VLLMRouter != ""], "")+
			orDefault(map[bool]string{true: "; **" + TargetGoProxy + "** = the same through Go's standard reverse proxy (`sybench floor-proxy --mode stdlib`: net/http's server and Transport, httputil.ReverseProxy), what Go's HTTP stack alone adds"}[c.GoProxy], "")+
			orDefault(map[bool]string{true: "; **" + PeerNginx + "** = the same through nginx (one worker process, keep-alive upstream, `proxy_buffering off`), what an event loop in C adds; its CPU is its master's and worker's"}[c.Nginx], ""))
	fmt.Fprintf(&b, "- Per point: ceil(%g × C) streams, C at a time, after one unmeasured stream per connection; %d interleaved repetitions, medians (P50 min-max in brackets). "+
		"Router CPU: utime+stime from /proc around the measured run, over the token events it relayed (the streams' routing included).\n\n", c.Streams, max(c.Repeats, 1))
	b.WriteString("| C | Target | Streams | Failed | Events | Delivery P50 µs | P90 µs | P99 µs | Added P50 µs | Added P99 µs | Router CPU µs / event |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|\n")
	var seen []int
	for _, x := range r.Rows {
		if slices.Contains(seen, x.Concurrency) {
			continue
		}
		seen = append(seen, x.Concurrency)
		d, haveD := r.agg(TargetDirect, x.Concurrency)
		for _, t := range []string{TargetDirect, TargetRegular, PeerVLLMRouter, TargetGoProxy, PeerNginx} {
			a, ok := r.agg(t, x.Concurrency)
			if !ok {
				continue
			}
			added50, added99, cpu := "—", "—", "—"
			if t != TargetDirect {
				cpu = fmt.Sprintf("%.1f", a.cpu)
				if haveD {
					added50, added99 = fmt.Sprintf("%+.0f", a.p50-d.p50), fmt.Sprintf("%+.0f", a.p99-d.p99)
				}
			}
			fmt.Fprintf(&b, "| %d | %s | %d | %d | %d | %.0f (%.0f-%.0f) | %.0f | %.0f | %s | %s | %s |\n",
				x.Concurrency, t, a.streams, a.failed, a.events, a.p50, a.p50Lo, a.p50Hi, a.p90, a.p99, added50, added99, cpu)
		}
	}
	b.WriteString("\n")
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "- %s\n", n)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func joinedArgs(a []string) string {
	if len(a) == 0 {
		return ""
	}
	return " " + strings.Join(a, " ")
}
