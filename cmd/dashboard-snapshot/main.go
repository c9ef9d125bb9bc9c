// Command dashboard-snapshot renders Switchyard's Grafana dashboard
// (internal/dashboard) as a PNG from real data, without Prometheus or
// Grafana: it scrapes a router's /metrics periodically and evaluates the
// dashboard's queries on the samples.
//
// By default it runs a benchmark itself: a router in front of a simulated
// MoRI-IO fleet (vllm-sim) that starts as 2P2D WRITE, gets a burst that
// fills the admission queue, loses a decode worker, and is rolled over to
// a 1P1D READ fleet, all under sybench load. With -metrics it only scrapes
// an existing router for -duration. With -write-dashboard it writes the
// Grafana JSON and exits.
//
//	make dashboard-snapshot    # bin/ binaries, docs/observability-dashboard.png
//	make dashboard-json        # deploy/grafana/switchyard.json
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image/png"
	"io"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/switchyard-llm/switchyard/internal/dashboard"
	"github.com/switchyard-llm/switchyard/internal/freeport"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "dashboard-snapshot:", err)
		os.Exit(1)
	}
}

type options struct {
	bin, out, writeDash, metricsURL string
	duration, interval              time.Duration
	rate                            float64
	window                          int
}

func run(ctx context.Context, args []string, logw io.Writer) error {
	var o options
	fs := flag.NewFlagSet("dashboard-snapshot", flag.ContinueOnError)
	fs.StringVar(&o.bin, "bin", "bin", "directory with the switchyard, vllm-sim and sybench binaries")
	fs.StringVar(&o.out, "out", "docs/observability-dashboard.png", "PNG to write")
	fs.StringVar(&o.writeDash, "write-dashboard", "", "write the Grafana dashboard JSON to this file and exit")
	fs.StringVar(&o.metricsURL, "metrics", "", "scrape this existing router /metrics URL for -duration instead of running a benchmark")
	fs.DurationVar(&o.duration, "duration", 80*time.Second, "benchmark (or scrape) duration")
	fs.DurationVar(&o.interval, "interval", time.Second, "scrape interval")
	fs.Float64Var(&o.rate, "rate", 14, "benchmark request rate (requests/s)")
	fs.IntVar(&o.window, "window", 5, "rate window, in scrape intervals")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if o.writeDash != "" {
		b, err := dashboard.Grafana()
		if err != nil {
			return err
		}
		return os.WriteFile(o.writeDash, b, 0o644)
	}
	log := func(format string, a ...any) { fmt.Fprintf(logw, format+"\n", a...) }

	var snaps []dashboard.Snapshot
	subtitle := ""
	if o.metricsURL != "" {
		sctx, cancel := context.WithTimeout(ctx, o.duration)
		snaps = scrapeLoop(sctx, o.metricsURL, o.interval, log)
		cancel()
		subtitle = fmt.Sprintf("%s scraped every %s for %s", o.metricsURL, o.interval, o.duration)
	} else {
		var err error
		snaps, subtitle, err = benchmark(ctx, o, log)
		if err != nil {
			return err
		}
	}
	if len(snaps) < 2 {
		return fmt.Errorf("only %d scrape(s): nothing to plot", len(snaps))
	}
	img := dashboard.Render(snaps, dashboard.RenderOptions{
		Title:         "Switchyard dashboard snapshot",
		Subtitle:      subtitle,
		Window:        o.window,
		OnlySnapshots: true,
	})
	if err := os.MkdirAll(filepath.Dir(o.out), 0o755); err != nil {
		return err
	}
	f, err := os.Create(o.out)
	if err != nil {
		return err
	}
	if err := png.Encode(f, img); err != nil {
		f.Close()
		return err
	}
	log("wrote %s (%d scrapes)", o.out, len(snaps))
	return f.Close()
}

// scrapeLoop scrapes url every interval until ctx ends.
func scrapeLoop(ctx context.Context, url string, interval time.Duration, log func(string, ...any)) []dashboard.Snapshot {
	var snaps []dashboard.Snapshot
	client := &http.Client{Timeout: interval}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if s, err := scrape(ctx, client, url); err == nil {
			snaps = append(snaps, s)
		} else if ctx.Err() == nil {
			log("scrape %s: %v", url, err)
		}
		select {
		case <-ctx.Done():
			return snaps
		case <-t.C:
		}
	}
}

func scrape(ctx context.Context, client *http.Client, url string) (dashboard.Snapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return dashboard.Snapshot{}, err
	}
	at := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return dashboard.Snapshot{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return dashboard.Snapshot{}, fmt.Errorf("status %d", resp.StatusCode)
	}
	return dashboard.Parse(resp.Body, at)
}

// child is a started process; done closes when it has exited.
type child struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // valid after done
}

func (c *child) wait() error {
	<-c.done
	return c.err
}

// procs tracks the child processes of a benchmark run.
type procs struct {
	bin, dir string
	mu       sync.Mutex
	all      []*child
}

func (p *procs) start(name string, args ...string) (*child, io.Reader, error) {
	cmd := exec.Command(filepath.Join(p.bin, name), args...)
	p.mu.Lock()
	n := len(p.all)
	p.mu.Unlock()
	logf, err := os.Create(filepath.Join(p.dir, fmt.Sprintf("%02d-%s.log", n, name)))
	if err != nil {
		return nil, nil, err
	}
	cmd.Stderr = logf
	out, err := cmd.StdoutPipe()
	if err != nil {
		logf.Close()
		return nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, nil, err
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	p.mu.Lock()
	p.all = append(p.all, c)
	p.mu.Unlock()
	return c, out, nil
}

// stopAll sends SIGTERM to every child still running, then SIGKILL after
// 5 s, and waits for all of them.
func (p *procs) stopAll() {
	p.mu.Lock()
	all := append([]*child(nil), p.all...)
	p.mu.Unlock()
	for _, c := range all {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
	}
	t := time.NewTimer(5 * time.Second)
	defer t.Stop()
	for _, c := range all {
		select {
		case <-c.done:
		case <-t.C:
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
}

func freePort() (int, error) { return freeport.Pick() }

// sim starts a vllm-sim and waits for its ready line.
func (p *procs) sim(args ...string) (*child, error) {
	c, out, err := p.start("vllm-sim", append([]string{"--port", "0"}, args...)...)
	if err != nil {
		return nil, err
	}
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		if !sc.Scan() {
			ready <- errors.New("vllm-sim exited before its ready line")
			return
		}
		var info struct{ Event string }
		if err := json.Unmarshal(sc.Bytes(), &info); err != nil || info.Event != "ready" {
			ready <- fmt.Errorf("vllm-sim ready line %q", sc.Text())
			return
		}
		ready <- nil
		_, _ = io.Copy(io.Discard, out)
	}()
	t := time.NewTimer(15 * time.Second)
	defer t.Stop()
	select {
	case err := <-ready:
		return c, err
	case <-t.C:
		return c, errors.New("vllm-sim not ready within 15s")
	}
}

// benchmark runs the scripted fleet scenario and returns the scrapes.
func benchmark(ctx context.Context, o options, log func(string, ...any)) ([]dashboard.Snapshot, string, error) {
	dir, err := os.MkdirTemp("", "dashboard-snapshot-")
	if err != nil {
		return nil, "", err
	}
	p := &procs{bin: o.bin, dir: dir}
	defer p.stopAll()
	log("child logs in %s", dir)

	port, err1 := freePort()
	mport, err2 := freePort()
	zport, err3 := freePort()
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, "", err
	}
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)
	zaddr := fmt.Sprintf("127.0.0.1:%d", zport)
	_, rout, err := p.start("switchyard", "--host", "127.0.0.1", "--port", fmt.Sprint(port),
		"--prometheus-port", fmt.Sprint(mport), "--vllm-pd-disaggregation", "--kv-connector", "moriio",
		"--vllm-discovery-address", zaddr, "--policy", "round_robin", "--discovery-ttl-secs", "2",
		"--max-concurrent-requests", "32", "--queue-size", "256", "--queue-timeout-secs", "60", "--route-receipt")
	if err != nil {
		return nil, "", err
	}
	go func() { _, _ = io.Copy(io.Discard, rout) }()

	simArgs := func(role, mode string) []string {
		return []string{"--role", role, "--kv-connector", "moriio", "--transfer-mode", mode, "--proxy-address", zaddr,
			"--heartbeat-interval", "500ms", "--prefill-base", "60ms", "--max-num-seqs", "64"}
	}
	var write []*child
	for _, role := range []string{"prefill", "prefill", "decode", "decode"} {
		c, err := p.sim(simArgs(role, "WRITE")...)
		if err != nil {
			return nil, "", err
		}
		write = append(write, c)
	}
	if err := waitReady(ctx, base, 20*time.Second); err != nil {
		return nil, "", err
	}
	log("router ready at %s; 2P2D WRITE fleet registered", base)

	sctx, stopScrape := context.WithCancel(ctx)
	defer stopScrape()
	var snaps []dashboard.Snapshot
	scraped := make(chan struct{})
	go func() {
		snaps = scrapeLoop(sctx, metricsURL, o.interval, log)
		close(scraped)
	}()

	bench := func(rate string, n int, conc int) *child {
		c, out, err := p.start("sybench", "--base-url", base, "--model", "sim-model", "--endpoint", "/v1/completions",
			"--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "48", "--random-range-ratio", "0.5",
			"--request-rate", rate, "--num-prompts", fmt.Sprint(n), "--max-concurrency", fmt.Sprint(conc),
			"--disable-tqdm", "--seed", "7", "--timeout", "60s")
		if err != nil {
			log("sybench: %v", err)
			return nil
		}
		go func() { _, _ = io.Copy(io.Discard, out) }()
		return c
	}
	d := o.duration
	main := bench(fmt.Sprint(o.rate), int(o.rate*d.Seconds()), 256)
	if main == nil {
		return nil, "", errors.New("cannot start sybench")
	}
	mainDone := make(chan error, 1)
	go func() { mainDone <- main.wait() }()

	// The scenario, at fractions of the run.
	events := []struct {
		at   float64
		what string
		do   func() error
	}{
		{0.20, "burst: 200 requests at once (admission queue fills)", func() error {
			bench("inf", 200, 200)
			return nil
		}},
		{0.45, "a decode worker dies (SIGKILL): failovers, breaker", func() error { return write[3].cmd.Process.Kill() }},
		{0.55, "1P1D READ fleet registers (held while WRITE is live)", func() error {
			for _, role := range []string{"prefill", "decode"} {
				if _, err := p.sim(simArgs(role, "READ")...); err != nil {
					return err
				}
			}
			return nil
		}},
		{0.65, "WRITE fleet stopped: READ takes over after the discovery TTL", func() error {
			for _, c := range write[:3] {
				_ = c.cmd.Process.Signal(syscall.SIGTERM)
			}
			return nil
		}},
	}
	start := time.Now()
	for _, ev := range events {
		wait := time.Until(start.Add(time.Duration(ev.at * float64(d))))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, "", ctx.Err()
		case err := <-mainDone:
			t.Stop()
			return nil, "", fmt.Errorf("sybench ended early: %v (logs in %s)", err, dir)
		case <-t.C:
		}
		log("t=%3.0fs %s", time.Since(start).Seconds(), ev.what)
		if err := ev.do(); err != nil {
			return nil, "", fmt.Errorf("%s: %w", ev.what, err)
		}
	}
	select {
	case err := <-mainDone:
		if err != nil {
			log("sybench: %v (logs in %s)", err, dir)
		}
	case <-ctx.Done():
		return nil, "", ctx.Err()
	}
	log("t=%3.0fs benchmark done", time.Since(start).Seconds())
	time.Sleep(3 * o.interval) // a few idle scrapes at the end
	stopScrape()
	<-scraped
	sub := fmt.Sprintf("real scrapes every %s of a router in front of vllm-sim (MoRI-IO, --prefill-base 60ms) under sybench at %g req/s; "+
		"burst at %.0fs, decode killed at %.0fs, WRITE->READ rollout at %.0fs-%.0fs. make dashboard-snapshot",
		o.interval, o.rate, 0.20*d.Seconds(), 0.45*d.Seconds(), 0.55*d.Seconds(), 0.65*d.Seconds())
	return snaps, sub, nil
}

func waitReady(ctx context.Context, base string, within time.Duration) error {
	deadline := time.Now().Add(within)
	var last string
	for time.Now().Before(deadline) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/readiness", nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			last = string(bytes.TrimSpace(b))
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("router not ready within %s: %s", within, last)
}
