package scenario

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// FlowConfig is the flow-control scenario (issue: "Flow control under
// overload"): an open-loop load at Overload × the fleet's measured
// capacity, through switchyard with and without --flow-control.
type FlowConfig struct {
	Sims        int           // unified vllm-sim workers
	MaxNumSeqs  int           // --max-num-seqs of each (its capacity)
	StepBase    time.Duration // --decode-step-base
	StepPerSeq  time.Duration // --decode-step-per-seq
	PrefillBase time.Duration // --prefill-base
	PrefillTok  time.Duration // --prefill-per-token
	Headroom    int           // --flow-headroom of the flow router
	// EnginePriority runs the sims with --scheduling-policy priority and
	// adds runs whose router sends the band as vLLM's "priority"
	// (--flow-engine-priority). Requests without the field are served in
	// arrival order by such an engine, so the other runs are unchanged.
	EnginePriority bool
	// PrefillRules adds a run whose flow router also applies the prefill
	// rules (--flow-avoid-prefill --flow-isolate-prefill, and
	// --flow-prefill-reserve PrefillReserve when > 0).
	PrefillRules   bool
	PrefillReserve int
	// IdleMatch adds a second idle run at IdleRate, long enough for at
	// least as many samples as the overload runs' high band is expected to
	// have (HighShare × Overload × capacity × Duration), so the idle and
	// loaded P99s are percentiles of samples of the same size.
	IdleMatch bool
	// QueueInFlight is --flow-worker-max-inflight of the run that lets
	// each engine queue (above MaxNumSeqs) for engine priority to order.
	QueueInFlight int
	// Only, when set, keeps the runs with these names (comparisons
	// repeated without the whole scenario).
	Only       []string
	InputWords int // prompt length (words = sim tokens)
	// UniquePrompts starts each request's prompt with a word of its own,
	// so no request reuses another's prefix-cache blocks and every one is
	// prefilled in full (the sims cache prefixes, as vLLM does by default;
	// with one prompt for all, every prefill after the first is ~1 token).
	UniquePrompts bool
	OutputLen     int           // max_tokens (ignore_eos)
	Overload      float64       // offered rate / measured capacity
	HighShare     float64       // fraction of requests in the high band
	HeavyRatio    float64       // heavy tenant's rate / light tenant's rate
	Duration      time.Duration // of each overload run
	Idle          time.Duration // of the idle (reference TTFT) run
	IdleRate      float64       // requests/s of the idle run
	QueueSize     int           // --queue-size of both routers
	QueueTimout   time.Duration // --queue-timeout-secs of both routers
	Seed          uint64
}

// DefaultFlowConfig is the benchmark: 2× capacity for 60 s, 20 %
// high band; two tenants at 10:1.
func DefaultFlowConfig() FlowConfig {
	return FlowConfig{
		Sims: 2, MaxNumSeqs: 16, StepBase: 20 * time.Millisecond, StepPerSeq: 250 * time.Microsecond,
		PrefillBase: 10 * time.Millisecond, PrefillTok: 40 * time.Microsecond, Headroom: 12,
		EnginePriority: true, QueueInFlight: 24, PrefillRules: true, IdleMatch: true,
		InputWords: 256, OutputLen: 48, UniquePrompts: true,
		Overload: 2, HighShare: 0.2, HeavyRatio: 10, Duration: 60 * time.Second,
		Idle: 15 * time.Second, IdleRate: 2, QueueSize: 512, QueueTimout: 20 * time.Second, Seed: 1234,
	}
}

// QuickFlowConfig is a smoke run.
func QuickFlowConfig() FlowConfig {
	c := DefaultFlowConfig()
	c.Duration, c.Idle = 8*time.Second, 4*time.Second
	c.QueueTimout = 5 * time.Second
	return c
}

// flowOutcome is one request's end.
type flowOutcome struct {
	class  string // "high"/"low" or "heavy"/"light"
	status int    // HTTP status; 0 = transport error
	ttft   time.Duration
	ok     bool   // 200 with a complete stream, or an error status with an OpenAI JSON error body
	reason string // why not ok
}

// FlowClass is the summary of one class of one run.
type FlowClass struct {
	Class                    string
	Sent, OK200, R429, R408  int
	Other, Lost              int
	TTFTP50, TTFTP99         float64 // ms, over the 200s
	TTFTP90, TTFTMax         float64 // ms, over the 200s
	CompletionShare, FairPct float64 // fairness runs: share of all 200s; its max-min fair share
	// RouterWait10ms is the share of the band's requests that waited
	// under 10 ms in the router's flow-control queue (flow priority runs).
	RouterWait10ms string
}

// FlowRun is one run (one router, one load).
type FlowRun struct {
	Name     string
	Router   string // its flags
	Offered  float64
	Wall     time.Duration
	Classes  []FlowClass
	Failures []string // up to 5 reasons of lost requests
}

// FlowReport is the result of RunFlow.
type FlowReport struct {
	Config      FlowConfig
	Options     Options
	Machine     string
	CapacityRPS float64
	IdleP99     float64 // ms, high band on the idle fleet (flow control on)
	IdleN       int     // its samples
	// IdleMatchP99 is the same over the longer idle run (IdleMatch), with
	// IdleMatchN samples over IdleMatchDur; 0 when not run.
	IdleMatchP99 float64
	IdleMatchN   int
	IdleMatchDur time.Duration
	Runs         []FlowRun
	Notes        []string
	Elapsed      time.Duration
}

func (r *FlowReport) head() (*time.Duration, *[]string) { return &r.Elapsed, &r.Notes }

// RunFlow runs the flow-control scenario.
func RunFlow(ctx context.Context, o Options, c FlowConfig) (*FlowReport, error) {
	return runScenario(ctx, o, scenarioSpec[*FlowReport]{
		name: "flow", defMax: 20 * time.Minute, skipped: "runs",
		report: func(e *env) *FlowReport { return &FlowReport{Config: c, Options: e.o, Machine: e.m.String()} },
		run:    func(ctx context.Context, e *env, rep *FlowReport) error { return runFlow(ctx, e, c, rep) },
		files:  []scenarioFile[*FlowReport]{{name: "flow.md", write: (*FlowReport).WriteMarkdown}},
	})
}

func (c FlowConfig) simArgs() []string {
	a := []string{"--role", "unified", "--max-num-seqs", strconv.Itoa(c.MaxNumSeqs),
		"--decode-step-base", c.StepBase.String(), "--decode-step-per-seq", c.StepPerSeq.String(),
		"--prefill-base", c.PrefillBase.String(), "--prefill-per-token", c.PrefillTok.String()}
	if c.EnginePriority {
		a = append(a, "--scheduling-policy", "priority")
	}
	return a
}

// enginePriorityFlags are the extra router flags of the engine-priority
// runs: with headroom, the band sent as "priority"; without, also an
// in-flight limit above the engines' slots, so engines queue and order.
func (c FlowConfig) enginePriorityFlags(queue bool) []string {
	f := []string{"--flow-engine-priority"}
	if queue {
		f = append(f, "--flow-worker-max-inflight", strconv.Itoa(c.QueueInFlight))
	}
	return f
}

// prefillRuleFlags are the extra router flags of the prefill-rules run.
func (c FlowConfig) prefillRuleFlags() []string {
	f := []string{"--flow-avoid-prefill", "--flow-isolate-prefill"}
	if c.PrefillReserve > 0 {
		f = append(f, "--flow-prefill-reserve", strconv.Itoa(c.PrefillReserve))
	}
	return f
}

// routerFlags: the FIFO baseline (admission at the fleet's capacity) and
// flow control (router-side queue while every worker has MaxNumSeqs in
// flight). Both have the same queue bound and timeout.
func (c FlowConfig) routerFlags(flow bool, headroom int, extra ...string) []string {
	q := []string{"--policy", "power_of_two", "--queue-size", strconv.Itoa(c.QueueSize),
		"--queue-timeout-secs", strconv.Itoa(int(c.QueueTimout.Seconds()))}
	if !flow {
		return append(q, "--max-concurrent-requests", strconv.Itoa(c.Sims*c.MaxNumSeqs))
	}
	q = append(q, "--flow-control", "--flow-worker-max-inflight", strconv.Itoa(c.MaxNumSeqs),
		"--flow-headroom", strconv.Itoa(headroom), "--flow-poll-interval-secs", "0.1")
	return append(q, extra...) // a later flag wins
}

func runFlow(ctx context.Context, e *env, c FlowConfig, rep *FlowReport) error {
	var sims []*sim
	var urls []string
	for i := range c.Sims {
		s, err := e.g.startSim(ctx, fmt.Sprintf("sim-%d", i), c.simArgs()...)
		if err != nil {
			return err
		}
		sims = append(sims, s)
		urls = append(urls, s.URL())
	}
	metricsURL := map[*router]string{}
	start := func(name string, flow bool, headroom int, flags ...string) (*router, error) {
		r, extra, err := e.g.startRouter(ctx, name, func(extra int) []string {
			// the extra free port serves /metrics (the later flag wins)
			return append(append(append([]string{"--worker-urls"}, urls...), c.routerFlags(flow, headroom, flags...)...), "--prometheus-port", strconv.Itoa(extra))
		})
		if err != nil {
			return nil, err
		}
		metricsURL[r] = fmt.Sprintf("http://127.0.0.1:%d/metrics", extra)
		return r, r.waitReady(ctx)
	}
	flowR, err := start("switchyard-flow", true, c.Headroom)
	if err != nil {
		return err
	}
	fifoR, err := start("switchyard-fifo", false, 0)
	if err != nil {
		return err
	}
	var flow0R *router // flow control without headroom (when Headroom > 0)
	if c.Headroom > 0 {
		if flow0R, err = start("switchyard-flow-0", true, 0); err != nil {
			return err
		}
	}
	var preR *router // flow control with the prefill rules
	if c.PrefillRules {
		if preR, err = start("switchyard-flow-prefill", true, c.Headroom, c.prefillRuleFlags()...); err != nil {
			return err
		}
	}
	var prioR, prio0R *router // engine priority, with headroom and without
	if c.EnginePriority {
		if prioR, err = start("switchyard-flow-prio", true, c.Headroom, c.enginePriorityFlags(false)...); err != nil {
			return err
		}
		if prio0R, err = start("switchyard-flow-prio-0", true, 0, c.enginePriorityFlags(true)...); err != nil {
			return err
		}
	}
	cl := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096, MaxConnsPerHost: 0, DisableCompression: true}}
	defer cl.CloseIdleConnections()
	body := c.body()

	// Capacity: a closed loop at exactly the fleet's slots, through the
	// flow router.
	capRPS, err := measureCapacity(ctx, cl, flowR.base, body, c.Sims*c.MaxNumSeqs, c.Idle)
	if err != nil {
		return err
	}
	rep.CapacityRPS = capRPS
	e.printf("capacity %.2f req/s\n", capRPS)

	idle := openLoop(ctx, cl, flowR.base, body, c.IdleRate, c.Idle, c.Seed, func(*rand.Rand) (string, []string) {
		return "high", []string{"x-gateway-inference-objective", "high"}
	})
	rep.IdleP99 = percentile(ttfts(idle, "high"), 99)
	rep.IdleN = len(ttfts(idle, "high"))
	e.printf("idle high-band TTFT P99 %.1f ms (%d samples)\n", rep.IdleP99, rep.IdleN)
	if c.IdleMatch && c.IdleRate > 0 {
		want := c.HighShare * c.Overload * capRPS * c.Duration.Seconds() * 1.05
		d := max(c.Idle, time.Duration(math.Ceil(want/c.IdleRate))*time.Second)
		if _, err := e.budget(d+time.Minute, d+10*time.Second); err != nil {
			return err
		}
		long := openLoop(ctx, cl, flowR.base, body, c.IdleRate, d, c.Seed+7, func(*rand.Rand) (string, []string) {
			return "high", []string{"x-gateway-inference-objective", "high"}
		})
		t := ttfts(long, "high")
		rep.IdleMatchP99, rep.IdleMatchN, rep.IdleMatchDur = percentile(t, 99), len(t), d
		e.printf("idle high-band TTFT P99 %.1f ms over %v (%d samples)\n", rep.IdleMatchP99, d, len(t))
	}

	rate := c.Overload * capRPS
	prio := func(r *rand.Rand) (string, []string) {
		if r.Float64() < c.HighShare {
			return "high", []string{"x-gateway-inference-objective", "high"}
		}
		return "low", []string{"x-gateway-inference-objective", "low"}
	}
	heavyP := c.HeavyRatio / (c.HeavyRatio + 1)
	tenants := func(r *rand.Rand) (string, []string) {
		if r.Float64() < heavyP {
			return "heavy", []string{"x-gateway-inference-fairness-id", "heavy"}
		}
		return "light", []string{"x-gateway-inference-fairness-id", "light"}
	}
	type flowRunSpec struct {
		name     string
		r        *router
		flow     bool
		headroom int
		extra    []string
		pick     func(*rand.Rand) (string, []string)
		fair     bool
		cls      []string
	}
	runs := []flowRunSpec{
		{"priority, flow control", flowR, true, c.Headroom, nil, prio, false, []string{"high", "low"}},
		{"priority, FIFO (no flow control)", fifoR, false, 0, nil, prio, false, []string{"high", "low"}},
		{"tenants 10:1, flow control", flowR, true, c.Headroom, nil, tenants, true, []string{"heavy", "light"}},
		{"tenants 10:1, FIFO (no flow control)", fifoR, false, 0, nil, tenants, true, []string{"heavy", "light"}},
	}
	if flow0R != nil {
		runs = slices.Insert(runs, 1, flowRunSpec{"priority, flow control without headroom", flow0R, true, 0, nil, prio, false, []string{"high", "low"}})
	}
	if prioR != nil {
		runs = slices.Insert(runs, 1,
			flowRunSpec{"priority, flow control, engine priority", prioR, true, c.Headroom, c.enginePriorityFlags(false), prio, false, []string{"high", "low"}},
			flowRunSpec{"priority, flow control without headroom, engines queue, engine priority", prio0R, true, 0, c.enginePriorityFlags(true), prio, false, []string{"high", "low"}})
	}
	if preR != nil {
		runs = slices.Insert(runs, 1, flowRunSpec{"priority, flow control, prefill rules", preR, true, c.Headroom, c.prefillRuleFlags(), prio, false, []string{"high", "low"}})
	}
	if len(c.Only) > 0 {
		runs = slices.DeleteFunc(runs, func(r flowRunSpec) bool { return !slices.Contains(c.Only, r.name) })
	}
	for _, run := range runs {
		if _, err := e.budget(c.Duration+c.QueueTimout+time.Minute, c.Duration+c.QueueTimout+10*time.Second); err != nil {
			return err
		}
		e.printf("run %q: %.2f req/s for %v\n", run.name, rate, c.Duration)
		before := routerWaits(ctx, metricsURL[run.r], run.cls)
		t0 := time.Now()
		outs := openLoop(ctx, cl, run.r.base, body, rate, c.Duration, c.Seed+1, run.pick)
		fr := FlowRun{Name: run.name, Router: strings.Join(c.routerFlags(run.flow, run.headroom, run.extra...), " "), Offered: rate, Wall: time.Since(t0)}
		fr.Classes, fr.Failures = summarize(outs, run.cls, run.fair)
		if run.flow && !run.fair {
			after := routerWaits(ctx, metricsURL[run.r], run.cls)
			for i := range fr.Classes {
				k := &fr.Classes[i]
				b, a := before[k.Class], after[k.Class]
				if n := a[1] - b[1]; n > 0 {
					k.RouterWait10ms = fmt.Sprintf("%.1f %%", 100*(a[0]-b[0])/n)
				}
			}
		}
		rep.Runs = append(rep.Runs, fr)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if err := dead(append([]*proc{run.r.proc}, procsOf(sims)...)...); err != nil {
			return err
		}
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("Load average at the end: %s.", loadAvg()))
	return nil
}

// routerWaits reads, per band, the flow-control queue wait histogram's
// le="0.01" bucket and count from a router's /metrics (zeros on error).
func routerWaits(ctx context.Context, url string, bands []string) map[string][2]float64 {
	out := map[string][2]float64{}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return out
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return out
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	for _, band := range bands {
		var v [2]float64
		for _, l := range strings.Split(string(b), "\n") {
			val := func() float64 {
				f, _ := strconv.ParseFloat(l[strings.LastIndexByte(l, ' ')+1:], 64)
				return f
			}
			switch {
			case strings.HasPrefix(l, `vllm_router_flow_queue_wait_seconds_bucket{band="`+band+`",le="0.01"}`):
				v[0] = val()
			case strings.HasPrefix(l, `vllm_router_flow_queue_wait_seconds_count{band="`+band+`"}`):
				v[1] = val()
			}
		}
		out[band] = v
	}
	return out
}

func procsOf(ss []*sim) []*proc {
	out := make([]*proc, len(ss))
	for i, s := range ss {
		out[i] = s.proc
	}
	return out
}

// body returns the request body maker: the same prompt for every request,
// or (UniquePrompts) one whose first word is the request's own number.
func (c FlowConfig) body() func() []byte {
	words := make([]string, c.InputWords)
	for i := range words {
		words[i] = "flow"
	}
	mk := func() []byte {
		b, _ := json.Marshal(map[string]any{"model": simModel, "prompt": strings.Join(words, " "), "max_tokens": c.OutputLen,
			"ignore_eos": true, "stream": true})
		return b
	}
	if !c.UniquePrompts {
		b := mk()
		return func() []byte { return b }
	}
	var mu sync.Mutex
	n := 0
	return func() []byte {
		mu.Lock()
		defer mu.Unlock()
		n++
		words[0] = "u" + strconv.Itoa(n)
		return mk()
	}
}

// measureCapacity runs n closed-loop streams for d and returns completed
// requests per second.
func measureCapacity(ctx context.Context, cl *http.Client, base string, body func() []byte, n int, d time.Duration) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, d+30*time.Second)
	defer cancel()
	end := time.Now().Add(d)
	var mu sync.Mutex
	done, failed := 0, 0
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for time.Now().Before(end) && ctx.Err() == nil {
				o := sendOne(ctx, cl, base, body(), "cap", nil)
				mu.Lock()
				if o.status == 200 && o.ok {
					done++
				} else {
					failed++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if failed > 0 || done == 0 {
		return 0, fmt.Errorf("capacity run: %d ok, %d failed", done, failed)
	}
	return float64(done) / d.Seconds(), nil
}

// openLoop sends Poisson arrivals at rate for d (classes chosen by pick)
// and waits for every request (each bounded by a 2-minute client timeout).
func openLoop(ctx context.Context, cl *http.Client, base string, body func() []byte, rate float64, d time.Duration, seed uint64, pick func(*rand.Rand) (string, []string)) []flowOutcome {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var mu sync.Mutex
	var outs []flowOutcome
	var wg sync.WaitGroup
	start := time.Now()
	next := time.Duration(0)
	for next < d && ctx.Err() == nil {
		if w := time.Until(start.Add(next)); w > 0 {
			t := time.NewTimer(w)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
		}
		class, hdr := pick(rng)
		b := body()
		wg.Go(func() {
			rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			defer cancel()
			o := sendOne(rctx, cl, base, b, class, hdr)
			mu.Lock()
			outs = append(outs, o)
			mu.Unlock()
		})
		next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
	}
	wg.Wait()
	return outs
}

// sendOne sends one streaming completion and judges its end.
func sendOne(ctx context.Context, cl *http.Client, base string, body []byte, class string, hdr []string) flowOutcome {
	o := flowOutcome{class: class}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		o.reason = err.Error()
		return o
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	t0 := time.Now()
	resp, err := cl.Do(req)
	if err != nil {
		o.reason = "transport: " + err.Error()
		return o
	}
	defer resp.Body.Close()
	o.status = resp.StatusCode
	if resp.StatusCode != 200 {
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
			o.ok = true
		} else {
			o.reason = fmt.Sprintf("status %d without a JSON error body: %.100s", resp.StatusCode, b)
		}
		return o
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			o.ok = o.ttft > 0
			if !o.ok {
				o.reason = "stream without a token"
			}
			return o
		}
		if strings.Contains(data, `"error"`) {
			o.reason = "error event: " + data
			return o
		}
		if o.ttft == 0 && strings.Contains(data, `"text"`) {
			o.ttft = time.Since(t0)
		}
	}
	o.reason = "stream ended without [DONE]"
	if err := sc.Err(); err != nil {
		o.reason += ": " + err.Error()
	}
	return o
}

func ttfts(outs []flowOutcome, class string) []float64 {
	var v []float64
	for _, o := range outs {
		if o.class == class && o.status == 200 && o.ok {
			v = append(v, float64(o.ttft)/float64(time.Millisecond))
		}
	}
	return v
}

// percentile is the nearest-rank percentile (NaN for no samples).
func percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// summarize counts each class's outcomes; for fairness runs it adds each
// class's share of the completions and its max-min fair share (a class
// offering less than an equal split gets all it asks; the rest goes to
// the other).
func summarize(outs []flowOutcome, classes []string, fair bool) ([]FlowClass, []string) {
	var failures []string
	by := map[string]*FlowClass{}
	var out []FlowClass
	for _, c := range classes {
		by[c] = &FlowClass{Class: c}
	}
	total := 0
	for _, o := range outs {
		fc := by[o.class]
		if fc == nil {
			continue
		}
		fc.Sent++
		switch {
		case !o.ok:
			fc.Lost++
			if len(failures) < 5 {
				failures = append(failures, o.class+": "+o.reason)
			}
		case o.status == 200:
			fc.OK200++
			total++
		case o.status == http.StatusTooManyRequests:
			fc.R429++
		case o.status == http.StatusRequestTimeout:
			fc.R408++
		default:
			fc.Other++
		}
	}
	for _, c := range classes {
		fc := by[c]
		t := ttfts(outs, c)
		fc.TTFTP50, fc.TTFTP99 = percentile(t, 50), percentile(t, 99)
		fc.TTFTP90, fc.TTFTMax = percentile(t, 90), percentile(t, 100)
		out = append(out, *fc)
	}
	if fair && total > 0 && len(out) == 2 {
		// max-min: the smaller demand is met up to half the completions
		a, b := &out[0], &out[1]
		small, big := a, b
		if b.Sent < a.Sent {
			small, big = b, a
		}
		fs := math.Min(float64(small.Sent), float64(total)/2)
		small.FairPct = 100 * fs / float64(total)
		big.FairPct = 100 - small.FairPct
		a.CompletionShare = 100 * float64(a.OK200) / float64(total)
		b.CompletionShare = 100 * float64(b.OK200) / float64(total)
	}
	return out, failures
}

// WriteMarkdown writes the report.
func (r *FlowReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b strings.Builder
	fmt.Fprintf(&b, "## Flow control under overload\n\n")
	prompts := "the same prompt for all (a prefix-cache hit after the first)"
	if c.UniquePrompts {
		prompts = "each its own (its first word), so every prompt is prefilled in full"
	}
	fmt.Fprintf(&b, "`%s` — %s; %d × vllm-sim `%s`; prompts of %d words, %s; %d output tokens, streaming; open-loop Poisson arrivals at %.1f× the measured capacity for %v per run. Wall time %s.\n\n",
		r.Options.Command, r.Machine, c.Sims, strings.Join(c.simArgs(), " "), c.InputWords, prompts, c.OutputLen, c.Overload, c.Duration, sec(r.Elapsed))
	fmt.Fprintf(&b, "Capacity (closed loop at %d streams, %v): **%.2f req/s**. Idle fleet, high band only at %.1f req/s for %v: TTFT P99 **%s ms** over %d samples (target for the high band under overload: ≤ 1.5× = %s ms).",
		c.Sims*c.MaxNumSeqs, c.Idle, r.CapacityRPS, c.IdleRate, c.Idle, ms(r.IdleP99), r.IdleN, ms(1.5*r.IdleP99))
	if r.IdleMatchN > 0 {
		fmt.Fprintf(&b, " The same for %v, as many samples as the overload runs' high band: TTFT P99 **%s ms** over %d samples (≤ 1.5× = %s ms).",
			r.IdleMatchDur, ms(r.IdleMatchP99), r.IdleMatchN, ms(1.5*r.IdleMatchP99))
	}
	b.WriteString("\n\n")
	for _, run := range r.Runs {
		fmt.Fprintf(&b, "### %s\n\nswitchyard `%s`; offered %.2f req/s; run wall time %s (drain included).\n\n", run.Name, run.Router, run.Offered, sec(run.Wall))
		fmt.Fprintf(&b, "| class | sent | 200 | 429 | 408 | other | lost | TTFT P50 ms | TTFT P99 ms | router wait < 10 ms | share of 200s | max-min fair share |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, k := range run.Classes {
			share, fair := "", ""
			if k.FairPct > 0 {
				share, fair = fmt.Sprintf("%.1f %%", k.CompletionShare), fmt.Sprintf("%.1f %%", k.FairPct)
			}
			fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %d | %d | %s | %s | %s | %s | %s |\n", k.Class, k.Sent, k.OK200, k.R429, k.R408, k.Other, k.Lost, ms(k.TTFTP50), ms(k.TTFTP99), k.RouterWait10ms, share, fair)
		}
		for _, k := range run.Classes {
			if k.Class == "high" && r.IdleP99 > 0 && k.OK200 > 0 {
				fmt.Fprintf(&b, "\nHigh-band TTFT P90 %s ms, max %s ms. High-band TTFT P99 / idle P99: **%.2f×** (target ≤ 1.5×; %d idle samples)", ms(k.TTFTP90), ms(k.TTFTMax), k.TTFTP99/r.IdleP99, r.IdleN)
				if r.IdleMatchP99 > 0 {
					fmt.Fprintf(&b, "; over the %d-sample idle P99: **%.2f×**", r.IdleMatchN, k.TTFTP99/r.IdleMatchP99)
				}
				b.WriteString(".\n")
			}
		}
		if len(run.Failures) > 0 {
			fmt.Fprintf(&b, "\nLost: %s\n", strings.Join(run.Failures, "; "))
		}
		b.WriteString("\n")
	}
	for _, n := range r.Notes {
		fmt.Fprintf(&b, "%s\n", n)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func parseFlow(args []string, o *Options, stderr io.Writer) (FlowConfig, error) {
	c := configFor(args, DefaultFlowConfig, QuickFlowConfig)
	fs := newFlagSet("flow", stderr, "Open-loop overload (default 2× measured capacity) through switchyard with and without --flow-control: a 20 % high band, then two tenants at 10:1.")
	commonFlags(fs, o, 20*time.Minute)
	fs.IntVar(&c.Sims, "sims", c.Sims, "unified vllm-sim workers")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "vllm-sim --max-num-seqs (and --flow-worker-max-inflight)")
	fs.DurationVar(&c.StepBase, "decode-step", c.StepBase, "vllm-sim --decode-step-base")
	fs.IntVar(&c.OutputLen, "output-len", c.OutputLen, "max_tokens")
	fs.IntVar(&c.InputWords, "input-len", c.InputWords, "prompt words (vllm-sim tokens)")
	fs.BoolVar(&c.UniquePrompts, "unique-prompts", c.UniquePrompts, "start each prompt with a word of its own (no prefix-cache reuse between requests); false sends one prompt to all")
	fs.IntVar(&c.Headroom, "headroom", c.Headroom, "switchyard --flow-headroom of the flow-control router")
	fs.BoolVar(&c.EnginePriority, "engine-priority", c.EnginePriority, "vllm-sim --scheduling-policy priority, plus runs with switchyard --flow-engine-priority")
	fs.IntVar(&c.QueueInFlight, "queue-inflight", c.QueueInFlight, "--flow-worker-max-inflight of the engine-priority run without headroom (engines queue above --max-num-seqs)")
	fs.BoolVar(&c.PrefillRules, "prefill-rules", c.PrefillRules, "add a flow-control run with switchyard --flow-avoid-prefill --flow-isolate-prefill")
	fs.IntVar(&c.PrefillReserve, "prefill-reserve", c.PrefillReserve, "switchyard --flow-prefill-reserve of the prefill-rules run (0 = not set)")
	fs.BoolVar(&c.IdleMatch, "idle-match", c.IdleMatch, "add an idle run long enough for as many high-band samples as an overload run")
	fs.Func("only", "keep only the run with this name (repeatable), e.g. \"priority, flow control\"", func(s string) error {
		c.Only = append(c.Only, s)
		return nil
	})
	fs.Float64Var(&c.Overload, "overload", c.Overload, "offered rate / measured capacity")
	fs.Float64Var(&c.HighShare, "high-share", c.HighShare, "fraction of requests in the high band")
	fs.Float64Var(&c.HeavyRatio, "heavy-ratio", c.HeavyRatio, "heavy tenant rate / light tenant rate")
	fs.DurationVar(&c.Duration, "duration", c.Duration, "length of each overload run")
	fs.IntVar(&c.QueueSize, "queue-size", c.QueueSize, "switchyard --queue-size")
	fs.DurationVar(&c.QueueTimout, "queue-timeout", c.QueueTimout, "switchyard --queue-timeout-secs (whole seconds)")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	if c.Sims <= 0 || c.MaxNumSeqs <= 0 || c.Headroom < 0 || c.EnginePriority && c.QueueInFlight <= 0 || c.InputWords <= 0 || c.Overload <= 0 || c.Duration <= 0 || c.QueueTimout < time.Second ||
		!(c.HighShare >= 0 && c.HighShare <= 1) || !(c.HeavyRatio > 0) {
		return c, errors.New("flow: --sims, --max-num-seqs, --overload, --duration, --heavy-ratio must be positive, --queue-timeout >= 1s, --high-share in [0,1]")
	}
	return c, nil
}
