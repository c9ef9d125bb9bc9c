package admission

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// SaturationConfig configures a Detector.
type SaturationConfig struct {
	Registry *worker.Registry
	// PD selects the fleets: prefill and decode judged separately (PD), or
	// the regular workers.
	PD bool
	// MaxInFlight is the per-worker limit on the router's own in-flight
	// requests (0 = no limit).
	MaxInFlight int
	// MaxWaiting saturates a worker whose vllm:num_requests_waiting reaches
	// it (0 = not used).
	MaxWaiting float64
	// MaxKVUsage saturates a worker whose vllm:kv_cache_usage_perc reaches
	// it (0 = not used).
	MaxKVUsage float64
	// PollInterval is how often every worker's /metrics is polled (when
	// MaxWaiting or MaxKVUsage is set) and the gate re-evaluated; 0 → 1 s.
	PollInterval time.Duration
	// Timeout bounds one poll; 0 → min(PollInterval, 2 s).
	Timeout time.Duration
	// AvoidPrefill and IsolatePrefill are the prefill rules (steer.go;
	// regular mode only): the highest band's pick prefers workers with the
	// fewest requests awaiting their first byte; lower bands are held off a
	// worker while a highest-band request there awaits its first byte.
	AvoidPrefill, IsolatePrefill bool
	// PrefillReserve keeps that many workers free of lower-band prefills
	// for the highest band: while no more are free, a lower-band request
	// joins a worker already prefilling (steer.go; a pick rule only).
	PrefillReserve int
	Client         *http.Client
	Metrics        *metrics.Metrics
	Logger         *slog.Logger
}

// Detector judges whether the fleet is saturated: the flow-control gate.
//
// A worker is saturated when the router's in-flight count reaches
// MaxInFlight, or its last polled vllm:num_requests_waiting reaches
// MaxWaiting, or its vllm:kv_cache_usage_perc reaches MaxKVUsage. Polled
// values older than three intervals, or from a failed poll, are ignored
// (fail open). Between polls, a worker that reported a queue counts the
// requests the router sent it since as queued too. A fleet (regular, or prefill and decode separately in PD
// mode) is saturated when every available worker of it is. Besides, with
// MaxInFlight set, the slots in use may not exceed the in-flight capacity
// of the regular (decode) fleet, so requests granted but not yet on a
// worker are counted too. A fleet with no available worker never holds
// requests: the dispatcher answers them at once (503).
type Detector struct {
	c   SaturationConfig
	log *slog.Logger

	mu     sync.Mutex
	polled map[string]*polledState // by base URL

	satPrefill, satMain atomic.Bool
}

type polledState struct {
	waiting, kv float64
	at          time.Time
	err         error
	sat         atomic.Bool
	// loadAt is the router's in-flight count on the URL when the poll
	// answered; ranks the number of workers (DP ranks) of the URL.
	loadAt int64
	ranks  int
}

// WorkerSaturation is one worker's saturation inputs, as /workers shows them.
type WorkerSaturation struct {
	Saturated   bool     `json:"saturated"`
	InFlight    int64    `json:"in_flight"`
	MaxInFlight int      `json:"max_in_flight,omitempty"`
	Waiting     *float64 `json:"num_requests_waiting,omitempty"`
	KVUsage     *float64 `json:"kv_cache_usage_perc,omitempty"`
	PolledAt    string   `json:"polled_at,omitempty"`
	PollError   string   `json:"poll_error,omitempty"`
	// With a prefill rule on (regular mode): the router's requests on the
	// worker not yet past their first byte, and those of the highest band.
	AwaitingFirstByte    *int64 `json:"awaiting_first_byte,omitempty"`
	AwaitingFirstByteTop *int64 `json:"awaiting_first_byte_top,omitempty"`
}

// NewDetector builds a Detector; Run polls.
func NewDetector(c SaturationConfig) *Detector {
	if c.PollInterval <= 0 {
		c.PollInterval = time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = min(c.PollInterval, 2*time.Second)
	}
	if c.Client == nil {
		c.Client = http.DefaultClient
	}
	d := &Detector{c: c, log: c.Logger, polled: map[string]*polledState{}}
	if d.log == nil {
		d.log = slog.New(slog.DiscardHandler)
	}
	return d
}

func (d *Detector) polls() bool { return d.c.MaxWaiting > 0 || d.c.MaxKVUsage > 0 }

// Run polls every worker each interval (when thresholds on vLLM's metrics
// are set) and calls kick after each round and each registry change, until
// ctx ends; it returns once its polls have finished.
func (d *Detector) Run(ctx context.Context, kick func()) {
	var wg sync.WaitGroup
	defer wg.Wait()
	arm := d.armer(kick)
	unsubscribe := d.c.Registry.Subscribe(func(ch worker.Change) {
		arm(ch.Added)
		kick()
	})
	defer unsubscribe()
	defer d.armer(nil)(d.c.Registry.Snapshot().All)
	t := time.NewTicker(d.c.PollInterval)
	defer t.Stop()
	for {
		if d.polls() {
			d.pollAll(ctx, &wg)
		}
		kick()
		all := d.c.Registry.Snapshot().All
		arm(all)
		for _, w := range all {
			d.Worker(w) // publish the per-worker gauges
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// lowRules: a prefill rule may hold the lower bands (regular mode).
func (d *Detector) lowRules() bool { return d.c.IsolatePrefill && !d.c.PD }

// armer returns the function that makes a worker whose requests awaiting
// their first byte (all, or of the highest band) drop to none call kick:
// the lower bands held off it may go. A no-op without a rule that holds.
func (d *Detector) armer(kick func()) func([]*worker.Worker) {
	if !d.lowRules() {
		return func([]*worker.Worker) {}
	}
	var f *func()
	if kick != nil {
		f = &kick
	}
	return func(ws []*worker.Worker) {
		for _, w := range ws {
			w.OnPrefillDone(f)
		}
	}
}

// pollAll polls every base URL concurrently and waits for the round.
func (d *Detector) pollAll(ctx context.Context, wg *sync.WaitGroup) {
	snap := d.c.Registry.Snapshot()
	urls := map[string]bool{}
	for _, w := range snap.All {
		urls[w.URL] = true
	}
	d.mu.Lock()
	for u := range d.polled {
		if !urls[u] {
			delete(d.polled, u)
		}
	}
	d.mu.Unlock()
	var round sync.WaitGroup
	for u := range urls {
		round.Add(1)
		wg.Go(func() {
			defer round.Done()
			waiting, kv, err := d.poll(ctx, u)
			if ctx.Err() != nil {
				return
			}
			load, ranks := int64(0), 0
			for _, w := range d.c.Registry.Snapshot().All {
				if w.URL == u {
					load += w.Load()
					ranks++
				}
			}
			d.record(u, waiting, kv, load, ranks, err)
		})
	}
	round.Wait()
}

func (d *Detector) record(u string, waiting, kv float64, load int64, ranks int, err error) {
	if m := d.c.Metrics; m != nil {
		res := "ok"
		if err != nil {
			res = "failed"
		}
		m.SaturationPolled.WithLabelValues(res).Inc()
	}
	d.mu.Lock()
	st := d.polled[u]
	if st == nil {
		st = &polledState{}
		d.polled[u] = st
	}
	st.err = err
	if err == nil {
		st.waiting, st.kv, st.at, st.loadAt, st.ranks = waiting, kv, time.Now(), load, ranks
	} else {
		d.log.Debug("saturation poll failed", "url", u, "err", err)
	}
	st.sat.Store(d.metricSaturated(st))
	d.mu.Unlock()
}

// metricSaturated judges polled values; the caller holds mu.
func (d *Detector) metricSaturated(st *polledState) bool {
	if st.err != nil || st.at.IsZero() || time.Since(st.at) > 3*d.c.PollInterval {
		return false
	}
	return (d.c.MaxWaiting > 0 && st.waiting >= d.c.MaxWaiting) || (d.c.MaxKVUsage > 0 && st.kv >= d.c.MaxKVUsage)
}

// poll reads one worker's Prometheus text: the sum of
// vllm:num_requests_waiting and the highest vllm:kv_cache_usage_perc
// (vllm:gpu_cache_usage_perc on older vLLM) over its engines.
func (d *Detector) poll(ctx context.Context, u string) (waiting, kv float64, err error) {
	ctx, cancel := context.WithTimeout(ctx, d.c.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u+"/metrics", nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := d.c.Client.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		return 0, 0, fmt.Errorf("GET /metrics: status %d", resp.StatusCode)
	}
	return parseVLLMMetrics(io.LimitReader(resp.Body, 8<<20))
}

// parseVLLMMetrics scans Prometheus text for the two gauges.
func parseVLLMMetrics(r io.Reader) (waiting, kv float64, err error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	seenW, seenKV := false, false
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "vllm:") {
			continue
		}
		name, rest, _ := strings.Cut(line, " ")
		if i := strings.IndexByte(line, '{'); i >= 0 && i < len(name) {
			name = line[:i]
			if j := strings.LastIndexByte(line, '}'); j > i {
				rest = strings.TrimSpace(line[j+1:])
			}
		}
		val, _, _ := strings.Cut(strings.TrimSpace(rest), " ")
		v, perr := strconv.ParseFloat(val, 64)
		if perr != nil {
			continue
		}
		switch name {
		case "vllm:num_requests_waiting":
			waiting += v
			seenW = true
		case "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc":
			kv = max(kv, v)
			seenKV = true
		}
	}
	if err := sc.Err(); err != nil {
		return 0, 0, fmt.Errorf("GET /metrics: %w", err)
	}
	if !seenW && !seenKV {
		return 0, 0, fmt.Errorf("GET /metrics: no vllm:num_requests_waiting or vllm:kv_cache_usage_perc")
	}
	return waiting, kv, nil
}

// saturated reports whether worker w is saturated now.
func (d *Detector) saturated(w *worker.Worker) bool {
	if d.c.MaxInFlight > 0 && w.Load() >= int64(d.c.MaxInFlight) {
		return true
	}
	if !d.polls() {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	st := d.polled[w.URL]
	if st == nil {
		return false
	}
	if st.sat.Load() {
		return true
	}
	// Between polls, a worker that already had a queue is assumed to queue
	// what the router sent it since (one worker per URL only: DP ranks
	// share the URL's figure).
	if d.c.MaxWaiting > 0 && st.ranks == 1 && st.waiting > 0 && st.err == nil && time.Since(st.at) <= 3*d.c.PollInterval {
		return st.waiting+float64(max(0, w.Load()-st.loadAt)) >= d.c.MaxWaiting
	}
	return false
}

// Open is the Scheduler's gate: false while the fleet is saturated. top
// says whether the request to dispatch is of the highest band; with
// IsolatePrefill a lower band is also held while every available worker
// is saturated or has a highest-band request awaiting its first byte.
func (d *Detector) Open(inUse int, top bool) bool {
	snap := d.c.Registry.Snapshot()
	if d.c.PD {
		satP := d.fleetSaturated(snap.Prefill, -1, false) // a prefill leg is short: no capacity count
		satD := d.fleetSaturated(snap.Decode, inUse, false)
		d.setFleet(&d.satPrefill, "prefill", satP)
		d.setFleet(&d.satMain, "decode", satD)
		return !satP && !satD
	}
	sat := d.fleetSaturated(snap.Regular, inUse, false)
	d.setFleet(&d.satMain, "regular", sat)
	if !sat && d.lowRules() && !top {
		return !d.fleetSaturated(snap.Regular, inUse, true)
	}
	return !sat
}

// fleetSaturated: every available worker saturated (or, with held, has a
// highest-band request awaiting its first byte), or (inUse >= 0 and a per-worker
// limit) the slots in use reach the fleet's in-flight capacity.
func (d *Detector) fleetSaturated(ws []*worker.Worker, inUse int, held bool) bool {
	avail, capacity, all := 0, 0, true
	for _, w := range ws {
		if !w.Available() {
			capacity += int(w.Load()) // its streams still hold slots
			continue
		}
		avail++
		if d.saturated(w) {
			// its requests still hold slots, but a worker a policy sent
			// past the limit does not raise the fleet's capacity
			capacity += min(int(w.Load()), d.c.MaxInFlight)
			if d.c.MaxInFlight == 0 {
				capacity += int(w.Load())
			}
		} else {
			if !held || w.PrefillingTop() == 0 {
				all = false
			}
			capacity += d.c.MaxInFlight
		}
	}
	if avail == 0 {
		return false
	}
	if all {
		return true
	}
	return inUse >= 0 && d.c.MaxInFlight > 0 && inUse >= capacity
}

func (d *Detector) setFleet(b *atomic.Bool, role string, sat bool) {
	if b.Swap(sat) != sat && d.c.Metrics != nil {
		v := 0.0
		if sat {
			v = 1
		}
		d.c.Metrics.FleetSaturated.WithLabelValues(role).Set(v)
	}
}

// Worker returns w's saturation inputs (for /workers) and publishes them
// as metrics.
func (d *Detector) Worker(w *worker.Worker) WorkerSaturation {
	ws := WorkerSaturation{Saturated: d.saturated(w), InFlight: w.Load(), MaxInFlight: d.c.MaxInFlight}
	if (d.c.AvoidPrefill || d.c.IsolatePrefill || d.c.PrefillReserve > 0) && !d.c.PD {
		n, top := w.Prefilling(), w.PrefillingTop()
		ws.AwaitingFirstByte, ws.AwaitingFirstByteTop = &n, &top
	}
	d.mu.Lock()
	if st := d.polled[w.URL]; st != nil {
		if !st.at.IsZero() {
			wv, kv := st.waiting, st.kv
			ws.Waiting, ws.KVUsage = &wv, &kv
			ws.PolledAt = st.at.UTC().Format(time.RFC3339Nano)
		}
		if st.err != nil {
			ws.PollError = st.err.Error()
		}
	}
	d.mu.Unlock()
	if m := d.c.Metrics; m != nil {
		v := 0.0
		if ws.Saturated {
			v = 1
		}
		m.WorkerSaturated.WithLabelValues(w.Key()).Set(v)
		if ws.Waiting != nil {
			m.WorkerWaiting.WithLabelValues(w.Key()).Set(*ws.Waiting)
			m.WorkerKVUsage.WithLabelValues(w.Key()).Set(*ws.KVUsage)
		}
	}
	return ws
}
