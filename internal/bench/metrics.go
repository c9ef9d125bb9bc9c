package bench

import (
	"math"
	"slices"
	"time"
)

// Metrics are the aggregates of vLLM's calculate_metrics (§6.4). Latency
// statistics are in milliseconds.
type Metrics struct {
	Completed, Failed int
	// TotalInput is Σ prompt_len and TotalOutput Σ output_len over the
	// successful requests.
	TotalInput, TotalOutput int
	// GoodCompleted counts successful requests meeting every goodput SLO.
	GoodCompleted int

	RequestThroughput    float64 // completed / duration
	RequestGoodput       float64 // good / duration
	OutputThroughput     float64 // Σ output_len / duration
	TotalTokenThroughput float64 // (Σ prompt_len + Σ output_len) / duration

	TTFT, TPOT, ITL, E2EL Stats
	// Queue is the client-side wait for a concurrency slot and
	// E2ELInclQueue the latency including it (successful requests).
	Queue, E2ELInclQueue Stats

	// MaxOutputTokensPerS is the largest number of token events in one
	// 1-second bucket; MaxConcurrentRequests the exact peak number of
	// requests in flight (sweep line over [start, start+latency)).
	MaxOutputTokensPerS   float64
	MaxConcurrentRequests int

	// OutputLens is output_len per request (0 for failures).
	OutputLens []int
}

func secs(d time.Duration) float64 { return d.Seconds() }

// outputLen is usage.completion_tokens or, when the server did not report
// it, the number of token events. (vLLM would count the generated text with
// its tokenizer; sybench has none, and servers send one token per event.)
func outputLen(o *RequestOutput) int {
	if o.OutputTokens > 0 {
		return o.OutputTokens
	}
	return o.TokenEvents
}

// computeMetrics implements calculate_metrics for outputs of a run that
// lasted dur. goodput maps "ttft"/"tpot"/"e2el" to SLOs in ms.
func computeMetrics(outputs []RequestOutput, dur time.Duration, percentiles []float64, goodput map[string]float64) Metrics {
	var m Metrics
	m.OutputLens = make([]int, len(outputs))
	var ttfts, tpots, allTPOTs, itls, e2els, queues, e2elQ []float64
	for i := range outputs {
		o := &outputs[i]
		if !o.Success {
			m.Failed++
			continue
		}
		n := outputLen(o)
		m.OutputLens[i] = n
		m.TotalInput += o.PromptLen
		m.TotalOutput += n
		tpot := 0.0
		if n > 1 {
			tpot = secs(o.Latency-o.TTFT) / float64(n-1)
			tpots = append(tpots, tpot)
		}
		allTPOTs = append(allTPOTs, tpot)
		for _, d := range o.ITL {
			itls = append(itls, secs(d))
		}
		ttfts = append(ttfts, secs(o.TTFT))
		e2els = append(e2els, secs(o.Latency))
		queues = append(queues, secs(o.QueueTime))
		e2elQ = append(e2elQ, secs(o.Latency+o.QueueTime))
		m.Completed++
	}

	if len(goodput) > 0 {
		for i := range ttfts {
			good := true
			for k, slo := range goodput {
				s := slo / 1000
				var v float64
				switch k {
				case MetricTTFT:
					v = ttfts[i]
				case MetricTPOT:
					v = allTPOTs[i]
				case MetricE2EL:
					v = e2els[i]
				}
				if !(s >= v) {
					good = false
				}
			}
			if good {
				m.GoodCompleted++
			}
		}
	}

	m.MaxOutputTokensPerS, m.MaxConcurrentRequests = peaks(outputs)

	d := dur.Seconds()
	if d > 0 {
		m.RequestThroughput = float64(m.Completed) / d
		m.RequestGoodput = float64(m.GoodCompleted) / d
		m.OutputThroughput = float64(m.TotalOutput) / d
		m.TotalTokenThroughput = float64(m.TotalInput+m.TotalOutput) / d
	}
	m.TTFT = newStats(ttfts, percentiles)
	m.TPOT = newStats(tpots, percentiles)
	m.ITL = newStats(itls, percentiles)
	m.E2EL = newStats(e2els, percentiles)
	m.Queue = newStats(queues, percentiles)
	m.E2ELInclQueue = newStats(e2elQ, percentiles)
	return m
}

// peaks computes vLLM's peak output token throughput (token events per
// 1-second bucket measured from the earliest successful start) and the exact
// peak concurrency (sweep line, departures before arrivals at equal times).
func peaks(outputs []RequestOutput) (maxTokensPerS float64, maxConcurrent int) {
	minStart, maxEnd := math.Inf(1), math.Inf(-1)
	found := false
	for i := range outputs {
		o := &outputs[i]
		if !o.Success {
			continue
		}
		found = true
		s := secs(o.Start)
		minStart = min(minStart, s)
		maxEnd = max(maxEnd, s+secs(o.Latency))
	}
	if !found {
		return 0, 0
	}
	buckets := make([]float64, int(math.Ceil(maxEnd-minStart))+1)
	type event struct {
		t     float64
		delta int
	}
	events := make([]event, 0, 2*len(outputs))
	for i := range outputs {
		o := &outputs[i]
		if !o.Success {
			continue
		}
		s := secs(o.Start)
		t := s + secs(o.TTFT)
		for k := 0; k <= len(o.ITL); k++ {
			if k > 0 {
				t += secs(o.ITL[k-1])
			}
			if b := int(t - minStart); b >= 0 && b < len(buckets) {
				buckets[b]++
			}
		}
		events = append(events, event{s, 1}, event{s + secs(o.Latency), -1})
	}
	slices.SortFunc(events, func(a, b event) int {
		switch {
		case a.t < b.t:
			return -1
		case a.t > b.t:
			return 1
		}
		return a.delta - b.delta
	})
	cur := 0
	for _, e := range events {
		cur += e.delta
		maxConcurrent = max(maxConcurrent, cur)
	}
	return slices.Max(buckets), maxConcurrent
}
