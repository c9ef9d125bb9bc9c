package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Result is a finished benchmark run.
type Result struct {
	// Config is the normalised configuration the run used.
	Config Config
	// ModelID is the model's id (data[0].root when discovered, else Model);
	// ModelName is what was sent as "model".
	ModelID, ModelName string
	// Date is when the run finished.
	Date time.Time
	// Duration is the wall time of the measured run (warm-ups excluded).
	Duration time.Duration
	// Outputs holds one measurement per dataset request, in dataset order.
	Outputs []RequestOutput
	// Metrics are the aggregates computed from Outputs.
	Metrics Metrics
	// Stopped is set when --max-duration cut the run short.
	Stopped bool
}

// Run executes one benchmark as vllm bench serve does: optional model
// discovery, warm-ups, then the measured run, and computes its metrics.
//
// If ctx is cancelled the in-flight requests are aborted and Run returns the
// partial result together with ctx's error. When MaxDuration expires the
// partial result is returned with a nil error and Result.Stopped set.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	if cfg.RequestIDPrefix == "" {
		cfg.RequestIDPrefix = DefaultRequestIDPrefix()
	}
	runCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if cfg.MaxDuration > 0 {
		var cancelT context.CancelFunc
		runCtx, cancelT = context.WithTimeoutCause(runCtx, cfg.MaxDuration, errMaxDuration)
		defer cancelT()
	}
	logf := func(format string, a ...any) {
		if cfg.Log != nil {
			fmt.Fprintf(cfg.Log, format+"\n", a...)
		}
	}

	inflight := cfg.NumPrompts
	if cfg.MaxConcurrency > 0 {
		inflight = min(inflight, cfg.MaxConcurrency)
	}
	rt := cfg.Transport
	if rt == nil {
		t := newTransport(&cfg, inflight)
		defer t.CloseIdleConnections()
		rt = t
	}
	client := &http.Client{Transport: rt}

	header := http.Header{}
	header.Set("Content-Type", "application/json")
	if cfg.APIKey != "" {
		header.Set("Authorization", "Bearer "+cfg.APIKey)
	}
	for k, vs := range cfg.Header {
		header[http.CanonicalHeaderKey(k)] = append([]string(nil), vs...)
	}

	res := &Result{Config: cfg}
	modelName := cfg.ServedModelName
	res.ModelID = cfg.Model
	if cfg.Model == "" {
		logf("Model not specified, fetching first model from server...")
		id, root, err := discoverModel(runCtx, client, cfg.BaseURL, header)
		if err != nil {
			return nil, err
		}
		logf("First model name: %s, first model id: %s", id, root)
		res.ModelID = root
		if modelName == "" {
			modelName = id
		}
	}
	if modelName == "" {
		modelName = res.ModelID
	}
	res.ModelName = modelName

	samples, err := buildSamples(&cfg)
	if err != nil {
		return nil, err
	}
	pb, err := newPayloadBuilder(&cfg, modelName)
	if err != nil {
		return nil, err
	}
	rq := &requester{
		cfg:      &cfg,
		client:   client,
		urls:     cfg.apiURLs(),
		pb:       pb,
		header:   header,
		runCtx:   runCtx,
		keepText: !cfg.DiscardText,
	}

	var sem chan struct{}
	if cfg.MaxConcurrency > 0 {
		sem = make(chan struct{}, cfg.MaxConcurrency)
	}

	if cfg.NumWarmups > 0 {
		logf("Warming up with %d requests...", cfg.NumWarmups)
		rq.benchStart = time.Now()
		var wg sync.WaitGroup
		for range cfg.NumWarmups {
			if !acquire(runCtx, sem) {
				break
			}
			wg.Go(func() {
				defer release(sem)
				var out RequestOutput
				rq.do(runCtx, samples[0], "", &out)
			})
		}
		wg.Wait()
		logf("Warmup run completed.")
	}
	if err := runCtx.Err(); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, context.Cause(runCtx)
	}

	logf("Starting main benchmark run...")
	distribution := "Poisson process"
	if cfg.Burstiness != 1 {
		distribution = "Gamma distribution"
	}
	logf("Traffic request rate: %s", pyFloat(cfg.RequestRate))
	logf("Burstiness factor: %s (%s)", pyFloat(cfg.Burstiness), distribution)
	if cfg.MaxConcurrency > 0 {
		logf("Maximum request concurrency: %d", cfg.MaxConcurrency)
	} else {
		logf("Maximum request concurrency: None")
	}

	offsets := arrivalOffsets(len(samples), cfg.RequestRate, cfg.Burstiness, cfg.Seed)
	outputs := make([]RequestOutput, len(samples))
	var done atomic.Int64
	stopProgress := startProgress(cfg.Progress, len(samples), &done)

	start := time.Now()
	rq.benchStart = start
	var wg sync.WaitGroup
	var timer *time.Timer
	sent := 0
dispatch:
	for i := range samples {
		offset := time.Duration(offsets[i] * float64(time.Second))
		if wait := time.Until(start.Add(offset)); wait > 0 {
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			select {
			case <-timer.C:
			case <-runCtx.Done():
				break dispatch
			}
		}
		if !acquire(runCtx, sem) {
			break
		}
		if runCtx.Err() != nil {
			release(sem)
			break
		}
		sent++
		wg.Go(func() {
			defer release(sem)
			out := &outputs[i]
			rq.do(runCtx, samples[i], cfg.RequestIDPrefix+itoa(samples[i].Index), out)
			out.QueueTime = max(out.Start-offset, 0)
			done.Add(1)
		})
	}
	if timer != nil {
		timer.Stop()
	}
	stopReason := ""
	if sent < len(samples) {
		if errors.Is(context.Cause(runCtx), errMaxDuration) {
			stopReason = "not sent: " + errMaxDuration.Error()
		} else {
			stopReason = "not sent: benchmark cancelled"
		}
		for i := sent; i < len(samples); i++ {
			outputs[i] = RequestOutput{
				Index:     samples[i].Index,
				RequestID: cfg.RequestIDPrefix + itoa(samples[i].Index),
				PromptLen: samples[i].PromptLen,
				Error:     stopReason,
			}
		}
	}
	wg.Wait()
	res.Duration = time.Since(start)
	stopProgress()

	res.Date = time.Now()
	res.Outputs = outputs
	res.Metrics = computeMetrics(outputs, res.Duration, cfg.MetricPercentiles, cfg.Goodput)
	if errors.Is(context.Cause(runCtx), errMaxDuration) {
		res.Stopped = true
		logf("Max duration %v reached: the run was stopped (%d of %d requests sent).", cfg.MaxDuration, sent, len(samples))
	}
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, nil
}

func acquire(ctx context.Context, sem chan struct{}) bool {
	if sem == nil {
		return ctx.Err() == nil
	}
	select {
	case sem <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func release(sem chan struct{}) {
	if sem != nil {
		<-sem
	}
}

// DefaultRequestIDPrefix returns vLLM's default "bench-<8 hex>-".
func DefaultRequestIDPrefix() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return "bench-" + hex.EncodeToString(b[:]) + "-"
}

func itoa(i int) string { return strconv.Itoa(i) }

// pyFloat formats f as Python's str(float) does for ordinary values.
func pyFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "inf"
	case math.IsInf(f, -1):
		return "-inf"
	case math.IsNaN(f):
		return "nan"
	case f == math.Trunc(f) && math.Abs(f) < 1e16:
		return fmt.Sprintf("%.1f", f)
	}
	return fmt.Sprint(f)
}

// startProgress draws a progress bar on w until the returned func is called.
func startProgress(w io.Writer, total int, done *atomic.Int64) (stop func()) {
	if w == nil {
		return func() {}
	}
	quit := make(chan struct{})
	finished := make(chan struct{})
	begin := time.Now()
	draw := func() {
		n := int(done.Load())
		const width = 30
		filled := 0
		if total > 0 {
			filled = n * width / total
		}
		bar := make([]byte, width)
		for i := range bar {
			if i < filled {
				bar[i] = '#'
			} else {
				bar[i] = ' '
			}
		}
		el := time.Since(begin).Seconds()
		rate := 0.0
		if el > 0 {
			rate = float64(n) / el
		}
		fmt.Fprintf(w, "\r%3d%%|%s| %d/%d [%.0fs, %.2f req/s]", pct(n, total), bar, n, total, el, rate)
	}
	go func() {
		defer close(finished)
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				draw()
			case <-quit:
				draw()
				fmt.Fprintln(w)
				return
			}
		}
	}()
	return func() {
		close(quit)
		<-finished
	}
}

func pct(n, total int) int {
	if total == 0 {
		return 100
	}
	return n * 100 / total
}
