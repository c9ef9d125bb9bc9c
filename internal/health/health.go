// Package health runs the active health checks of every worker, whatever
// found it (static flags, the admin API, ZMQ or Kubernetes discovery), with
// one configuration, and optionally polls each worker's self-reported load.
//
// Invariants:
//   - Probes are GET <base URL><Endpoint> only (default /health): a health
//     check never runs a generation, on a decode worker or anywhere else.
//   - All workers are probed concurrently each interval, at most
//     Concurrency probes at a time, each bounded by Timeout, so a hanging
//     worker never delays the others; a worker whose previous probe is
//     still running is skipped, never probed twice at once.
//   - One probe per base URL: the data-parallel ranks of an instance share
//     one vLLM server, so the result applies to all of them.
//   - Health changes only after FailureThreshold consecutive failures or
//     SuccessThreshold consecutive successes, counted per base URL. A
//     change made by someone else (the proxy's passive marking after a
//     connect failure, an admin add) restarts the count. Each transition is
//     logged once. Exceptions: a worker that has never passed a probe is
//     healthy after its first passing probe and unhealthy after its first
//     failing one (nothing vouches for it); a worker whose last probe could
//     not connect (no process listened: a restart) is healthy after its
//     first passing probe, like a new one; and a failing probe of a worker
//     with an unconfirmed connect failure (worker.Suspect) confirms it at
//     once.
//   - Newly added workers, and workers whose connect failed
//     (Change.Probe), are probed at once, not after an interval. The
//     checker never blocks startup: Run is started after the listener.
//   - Healthy workers whose last probe passed are probed every Interval.
//     The others (unhealthy, never passed a probe, or whose last probe
//     failed) are probed on a fast schedule:
//     UnhealthyInterval after a failure, doubling up to
//     UnhealthyMaxInterval, jittered down by up to 20 %, and
//     UnhealthyInterval after a passing probe that did not reach
//     SuccessThreshold yet; so a worker that starts listening is routed
//     within about UnhealthyMaxInterval, not Interval.
package health

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Options configures a Checker. Zero values take the defaults noted.
type Options struct {
	Registry *worker.Registry
	// Client performs the probes (the shared upstream client is fine: each
	// probe carries its own Timeout).
	Client           *http.Client
	Interval         time.Duration // between probe rounds (60 s)
	Timeout          time.Duration // per probe (5 s)
	Endpoint         string        // probe path ("/health")
	FailureThreshold int           // consecutive failures → unhealthy (3)
	SuccessThreshold int           // consecutive successes → healthy (2)
	Metrics          *metrics.Metrics
	Logger           *slog.Logger
	// LoadPollInterval polls GET <base>/load ({"server_load": N}) and
	// records the per-rank share with Worker.SetPolledLoad (0 = off).
	LoadPollInterval time.Duration
	LoadEndpoint     string // ("/load")
	Concurrency      int    // probes in flight at most (64)
	// UnhealthyInterval is the first re-probe delay of an unhealthy or
	// never-probed worker (0.5 s), doubled after each failure up to
	// UnhealthyMaxInterval (1 s); both are at most Interval.
	UnhealthyInterval    time.Duration
	UnhealthyMaxInterval time.Duration
	// BeforeHealthy, if set, runs after a passing probe of a worker that is
	// not healthy, before the result is applied (which may make it
	// healthy), in that probe's goroutine: what a returning engine needs
	// before it is given traffic (its LoRA adapters). It must return; no
	// other probe of the URL runs meanwhile.
	BeforeHealthy func(ctx context.Context, url string)
	// WhileHealthy, if set, runs after a passing probe of a worker that is
	// healthy, in that probe's goroutine: what may change on an engine that
	// keeps running (its LoRA adapters, loaded or unloaded on it
	// directly). It must return.
	WhileHealthy func(ctx context.Context, url string)
	// HoldNew, if set and true when workers join, holds them out of
	// routing (unhealthy) until their first passing probe, which then runs
	// BeforeHealthy first.
	HoldNew func() bool
}

// Checker probes workers. Build it with NewChecker and start Run once.
type Checker struct {
	o   Options
	log *slog.Logger
	sem chan struct{}

	kick    chan struct{}
	resched chan struct{} // a fast probe was scheduled
	wg      sync.WaitGroup

	mu      sync.Mutex
	state   map[string]*urlState // by base URL
	pending map[string]bool      // base URLs to probe now (new workers)
}

// urlState is the threshold state of one base URL (all its ranks).
type urlState struct {
	probing, polling bool
	known            bool // a probe result was applied
	applied          bool // health set by the last applied result
	okRun, failRun   int
	refused          bool // the last failing probe could not connect
	// fast schedule (unhealthy or never-probed workers): the next probe
	// is due at due (zero = not scheduled), the next failure waits delay.
	due   time.Time
	delay time.Duration
}

// NewChecker builds a checker; it does nothing until Run.
func NewChecker(o Options) *Checker {
	if o.Interval <= 0 {
		o.Interval = 60 * time.Second
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.Endpoint == "" {
		o.Endpoint = "/health"
	}
	if o.LoadEndpoint == "" {
		o.LoadEndpoint = "/load"
	}
	if o.FailureThreshold <= 0 {
		o.FailureThreshold = 3
	}
	if o.SuccessThreshold <= 0 {
		o.SuccessThreshold = 2
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 64
	}
	if o.Client == nil {
		o.Client = http.DefaultClient
	}
	if o.UnhealthyInterval <= 0 {
		o.UnhealthyInterval = 500 * time.Millisecond
	}
	if o.UnhealthyMaxInterval <= 0 {
		o.UnhealthyMaxInterval = time.Second
	}
	o.UnhealthyMaxInterval = min(o.UnhealthyMaxInterval, o.Interval)
	o.UnhealthyInterval = min(o.UnhealthyInterval, o.UnhealthyMaxInterval)
	c := &Checker{
		o:       o,
		log:     o.Logger,
		sem:     make(chan struct{}, o.Concurrency),
		kick:    make(chan struct{}, 1),
		resched: make(chan struct{}, 1),
		state:   map[string]*urlState{},
		pending: map[string]bool{},
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	return c
}

// Run probes every worker now and then every Interval (and polls loads
// every LoadPollInterval) until ctx ends; it returns once every probe it
// started has finished.
func (c *Checker) Run(ctx context.Context) {
	unsubscribe := c.o.Registry.Subscribe(c.onChange)
	defer unsubscribe()
	defer c.wg.Wait()
	tick := time.NewTicker(c.o.Interval)
	defer tick.Stop()
	var loadC <-chan time.Time
	if c.o.LoadPollInterval > 0 {
		lt := time.NewTicker(c.o.LoadPollInterval)
		defer lt.Stop()
		loadC = lt.C
		c.pollLoads(ctx)
	}
	fast := time.NewTimer(time.Hour)
	defer fast.Stop()
	c.probeAll(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
			c.probeAll(ctx)
		case <-loadC:
			c.pollLoads(ctx)
		case <-c.kick:
			c.probePending(ctx)
		case <-fast.C:
			c.probeDue(ctx)
		case <-c.resched:
		}
		c.resetFast(fast)
	}
}

// probeDue starts the fast-schedule probes that are due.
func (c *Checker) probeDue(ctx context.Context) {
	now := time.Now()
	var urls []string
	c.mu.Lock()
	for u, st := range c.state {
		if !st.due.IsZero() && !st.due.After(now) {
			st.due = time.Time{}
			urls = append(urls, u)
		}
	}
	c.mu.Unlock()
	for _, u := range urls {
		c.launchProbe(ctx, u)
	}
}

// resetFast sets t to fire when the earliest fast-schedule probe is due.
func (c *Checker) resetFast(t *time.Timer) {
	var next time.Time
	c.mu.Lock()
	for _, st := range c.state {
		if !st.due.IsZero() && (next.IsZero() || st.due.Before(next)) {
			next = st.due
		}
	}
	c.mu.Unlock()
	if next.IsZero() {
		t.Stop()
		return
	}
	t.Reset(max(time.Until(next), 0))
}

// schedule sets the fast schedule of st after a probe result; the caller
// holds mu. passed: the probe passed; settled: the worker is healthy and
// has passed a probe (back to the Interval rounds).
func (c *Checker) schedule(st *urlState, passed, settled bool) {
	if settled {
		st.due, st.delay = time.Time{}, 0
		return
	}
	d := c.o.UnhealthyInterval
	if passed {
		st.delay = 0
	} else {
		if st.delay > 0 {
			d = st.delay
		}
		st.delay = min(2*d, c.o.UnhealthyMaxInterval)
	}
	d = time.Duration(float64(d) * (0.8 + 0.2*rand.Float64()))
	st.due = time.Now().Add(d)
	select {
	case c.resched <- struct{}{}:
	default:
	}
}

// onChange queues added workers for an immediate probe and forgets the
// state of base URLs that left. It runs on the registry writer's goroutine
// and never blocks.
func (c *Checker) onChange(ch worker.Change) {
	if len(ch.Added) > 0 && c.o.HoldNew != nil && c.o.HoldNew() {
		for _, w := range ch.Added {
			w.SetHealthy(false) // before the probe this change starts
		}
	}
	c.mu.Lock()
	for _, w := range ch.Added {
		c.pending[w.URL] = true
		if st := c.state[w.URL]; st != nil {
			st.delay = 0 // a new registration starts the fast schedule afresh
		}
	}
	for _, w := range ch.Probe {
		c.pending[w.URL] = true
	}
	if len(ch.Removed) > 0 {
		live := groupByURL(ch.Snap.All)
		for _, w := range ch.Removed {
			if st, ok := c.state[w.URL]; ok && live[w.URL] == nil && !st.probing && !st.polling {
				delete(c.state, w.URL)
			}
		}
	}
	c.mu.Unlock()
	if len(ch.Added) > 0 || len(ch.Probe) > 0 {
		select {
		case c.kick <- struct{}{}:
		default:
		}
	}
}

func groupByURL(ws []*worker.Worker) map[string][]*worker.Worker {
	g := make(map[string][]*worker.Worker, len(ws))
	for _, w := range ws {
		g[w.URL] = append(g[w.URL], w)
	}
	return g
}

// probeAll starts one probe per base URL in the registry.
func (c *Checker) probeAll(ctx context.Context) {
	groups := groupByURL(c.o.Registry.Snapshot().All)
	c.mu.Lock()
	for u := range c.state { // drop state of URLs that left
		if groups[u] == nil && !c.state[u].probing && !c.state[u].polling {
			delete(c.state, u)
		}
	}
	clear(c.pending)
	c.mu.Unlock()
	for u := range groups {
		c.launchProbe(ctx, u)
	}
}

func (c *Checker) probePending(ctx context.Context) {
	c.mu.Lock()
	urls := make([]string, 0, len(c.pending))
	for u := range c.pending {
		urls = append(urls, u)
	}
	clear(c.pending)
	c.mu.Unlock()
	for _, u := range urls {
		c.launchProbe(ctx, u)
	}
}

// stateFor returns the state of u; the caller holds mu.
func (c *Checker) stateFor(u string) *urlState {
	st := c.state[u]
	if st == nil {
		st = &urlState{}
		c.state[u] = st
	}
	return st
}

func (c *Checker) launchProbe(ctx context.Context, u string) {
	c.mu.Lock()
	st := c.stateFor(u)
	if st.probing {
		c.mu.Unlock()
		return
	}
	st.probing = true
	c.mu.Unlock()
	c.wg.Go(func() {
		err := c.withSlot(ctx, func() error { return c.probe(ctx, u) })
		if err == nil {
			c.afterPass(ctx, u)
		}
		if ctx.Err() != nil { // shutting down: not the worker's fault
			c.mu.Lock()
			st.probing = false
			c.mu.Unlock()
			return
		}
		c.apply(u, st, err)
	})
}

// afterPass runs BeforeHealthy or WhileHealthy after a passing probe of u.
func (c *Checker) afterPass(ctx context.Context, u string) {
	if c.o.BeforeHealthy == nil && c.o.WhileHealthy == nil {
		return
	}
	switch healthy := c.anyHealthy(u); {
	case !healthy && c.o.BeforeHealthy != nil:
		c.o.BeforeHealthy(ctx, u)
	case healthy && c.o.WhileHealthy != nil:
		c.o.WhileHealthy(ctx, u)
	}
}

// anyHealthy reports whether a worker of base URL u is healthy.
func (c *Checker) anyHealthy(u string) bool {
	for _, w := range c.o.Registry.Snapshot().All {
		if w.URL == u && w.Healthy() {
			return true
		}
	}
	return false
}

// withSlot runs fn holding one of the Concurrency slots.
func (c *Checker) withSlot(ctx context.Context, fn func() error) error {
	select {
	case c.sem <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-c.sem }()
	return fn()
}

// isDialError reports whether err is a failed TCP connect (nothing
// listens, or the host is unreachable).
func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// probe sends one health request to base URL u.
func (c *Checker) probe(ctx context.Context, u string) error {
	ctx, cancel := context.WithTimeout(ctx, c.o.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u+c.o.Endpoint, nil)
	if err != nil {
		return err
	}
	resp, err := c.o.Client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("GET %s: status %d", c.o.Endpoint, resp.StatusCode)
	}
	return nil
}

// apply records one probe result of base URL u and sets the health of its
// workers when a threshold is reached.
func (c *Checker) apply(u string, st *urlState, err error) {
	ws := groupByURL(c.o.Registry.Snapshot().All)[u]
	cur, probed, suspect := false, false, false
	for _, w := range ws {
		cur = cur || w.Healthy()
		probed = probed || w.Probed()
		// an unconfirmed connect failure, or an open breaker, that a probe
		// unable to connect confirms: the process is gone
		suspect = suspect || w.Suspect() || (isDialError(err) && w.Breaker().State() != worker.BreakerClosed)
	}
	c.mu.Lock()
	st.probing = false
	if len(ws) == 0 {
		c.mu.Unlock()
		return
	}
	if st.known && cur != st.applied {
		st.okRun, st.failRun = 0, 0 // changed elsewhere: count afresh
	}
	target := cur
	if err == nil {
		st.okRun++
		st.failRun = 0
		if st.okRun >= c.o.SuccessThreshold || !st.known || !probed || st.refused {
			target = true // a new (or restarted) worker's first passing probe is enough
		}
		st.refused = false
	} else {
		st.failRun++
		st.okRun = 0
		st.refused = isDialError(err)
		// never vouched for, or a connect failure this probe confirms
		if st.failRun >= c.o.FailureThreshold || !probed || suspect {
			target = false
		}
	}
	st.applied, st.known = target, true
	fails, oks := st.failRun, st.okRun
	// any failure is re-probed soon (so FailureThreshold failures take
	// about a second, not three intervals); a pass that made or left the
	// worker healthy ends the fast schedule
	c.schedule(st, err == nil, err == nil && target)
	c.mu.Unlock()

	changed := false
	for _, w := range ws {
		if err == nil {
			w.MarkProbed()
		} else if !target {
			w.ClearHint() // decided: unhealthy
		}
		if w.SetHealthy(target) {
			changed = true
		}
		if c.o.Metrics != nil {
			v := 0.0
			if target {
				v = 1
			}
			c.o.Metrics.WorkerHealth.WithLabelValues(w.Key()).Set(v)
		}
	}
	switch {
	case changed && !target:
		c.log.Warn("worker unhealthy", "url", u, "ranks", len(ws), "consecutive_failures", fails, "err", err)
	case changed && target:
		c.log.Info("worker healthy", "url", u, "ranks", len(ws), "consecutive_successes", oks)
		for _, w := range ws {
			// the breaker's failures were the previous process's: let
			// traffic test the new one now rather than after the open timeout
			w.Breaker().HalfOpen()
		}
	}
}

// ProbeNow waits until w's base URL answers its health endpoint with 2xx,
// probing at once and then every second (or Interval if shorter), and
// returns nil, or the last probe error when ctx ends first. It is meant for
// /add_worker and does not change health state: the caller decides.
func (c *Checker) ProbeNow(ctx context.Context, w *worker.Worker) error {
	every := min(time.Second, c.o.Interval)
	t := time.NewTimer(0)
	defer t.Stop()
	var last error
	for {
		select {
		case <-ctx.Done():
			if last == nil {
				last = ctx.Err()
			}
			return fmt.Errorf("health check of %s: %w", w.URL, last)
		case <-t.C:
		}
		if last = c.probe(ctx, w.URL); last == nil {
			return nil
		}
		t.Reset(every)
	}
}

// pollLoads starts one load poll per base URL.
func (c *Checker) pollLoads(ctx context.Context) {
	groups := groupByURL(c.o.Registry.Snapshot().All)
	for u, ws := range groups {
		c.mu.Lock()
		st := c.stateFor(u)
		if st.polling {
			c.mu.Unlock()
			continue
		}
		st.polling = true
		c.mu.Unlock()
		c.wg.Go(func() {
			var n int64
			err := c.withSlot(ctx, func() (err error) {
				n, err = c.load(ctx, u)
				return err
			})
			c.mu.Lock()
			st.polling = false
			c.mu.Unlock()
			if ctx.Err() != nil {
				return
			}
			share := int64(-1) // unknown: policies fall back to the router's own count
			if err == nil {
				share = (n + int64(len(ws)) - 1) / int64(len(ws))
			} else {
				c.log.Debug("load poll failed", "url", u, "err", err)
			}
			for _, w := range ws {
				w.SetPolledLoad(share)
			}
		})
	}
}

var errNoLoad = errors.New("no server_load in response")

// load reads vLLM's GET /load ({"server_load": N}); SGLang-style
// {"load": N} is accepted too.
func (c *Checker) load(ctx context.Context, u string) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, c.o.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u+c.o.LoadEndpoint, nil)
	if err != nil {
		return 0, err
	}
	resp, err := c.o.Client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return 0, fmt.Errorf("GET %s: status %d", c.o.LoadEndpoint, resp.StatusCode)
	}
	var v struct {
		ServerLoad *int64 `json:"server_load"`
		Load       *int64 `json:"load"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&v); err != nil {
		return 0, fmt.Errorf("GET %s: %w", c.o.LoadEndpoint, err)
	}
	switch {
	case v.ServerLoad != nil && *v.ServerLoad >= 0:
		return *v.ServerLoad, nil
	case v.Load != nil && *v.Load >= 0:
		return *v.Load, nil
	}
	return 0, errNoLoad
}
