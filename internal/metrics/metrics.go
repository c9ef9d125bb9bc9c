// Package metrics declares every Prometheus metric Switchyard exports, on a
// registry passed in (no globals). Names keep the vllm_router_* names of the
// Rust router where they exist so existing dashboards keep working; new
// series follow the same prefix and carry base units in their names.
//
// Label cardinality is bounded: "worker" is a worker key (bounded by the
// fleet, and deleted when a worker leaves via ForgetWorker), "route" is a
// matched route pattern (never a raw path), every other label is an enum.
package metrics

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// DurationBuckets are the Rust router's buckets for *_duration_seconds.
var DurationBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 30, 45, 60, 90, 120, 180, 240}

// Metrics holds every collector.
type Metrics struct {
	Registry *prometheus.Registry

	tokens    atomic.Pointer[[2]prometheus.Counter] // TokensTotal's prompt and completion children (Tokens)
	workerGen atomic.Uint64                         // see WorkerGeneration
	workers   sync.Map                              // childKey → child (see workerChild)

	// HTTP surface
	RequestsTotal   *prometheus.CounterVec   // route
	HTTPRequests    *prometheus.CounterVec   // route, method, status, mode
	RequestErrors   *prometheus.CounterVec   // route, error_type
	RequestDuration *prometheus.HistogramVec // route, status, mode
	TTFT            *prometheus.HistogramVec // route, mode
	GenerateDur     prometheus.Histogram
	InFlight        *prometheus.GaugeVec   // mode
	TokensTotal     *prometheus.CounterVec // kind: prompt|completion

	// LoRA adapters loaded through the router (internal/server)
	LoRAAdapters prometheus.Gauge       // remembered
	LoRAGiven    *prometheus.CounterVec // outcome: loaded|failed

	// retries and admission
	Retries          *prometheus.CounterVec   // route
	RetryBackoff     *prometheus.HistogramVec // attempt
	RetriesExhausted *prometheus.CounterVec   // route
	QueueDepth       prometheus.Gauge
	QueueWait        prometheus.Histogram
	AdmissionReject  *prometheus.CounterVec // reason: queue_full|queue_timeout|rate_limited|shutting_down|shed|deadline

	// flow control (--flow-control)
	FlowQueueDepth   *prometheus.GaugeVec     // band
	FlowQueueWait    *prometheus.HistogramVec // band
	FlowFlowDepth    *prometheus.GaugeVec     // flow (bounded: first 32 ids, then "other")
	FlowFlowWait     *prometheus.HistogramVec // flow (bounded)
	FlowShed         *prometheus.CounterVec   // band, reason
	WorkerSaturated  *prometheus.GaugeVec     // worker
	WorkerWaiting    *prometheus.GaugeVec     // worker
	WorkerKVUsage    *prometheus.GaugeVec     // worker
	FleetSaturated   *prometheus.GaugeVec     // role
	SaturationPolled *prometheus.CounterVec   // result: ok|failed

	// workers and policies
	ActiveWorkers   prometheus.Gauge
	Workers         *prometheus.GaugeVec // role, source
	WorkerHealth    *prometheus.GaugeVec // worker
	RunningRequests *prometheus.GaugeVec // worker
	WorkerInFlight  *prometheus.GaugeVec // role
	Processed       *prometheus.CounterVec
	PolicyDecisions *prometheus.CounterVec // policy, worker
	LBEvents        prometheus.Counter
	MaxLoad         prometheus.Gauge
	MinLoad         prometheus.Gauge
	CacheHits       prometheus.Counter
	CacheMisses     prometheus.Counter
	CacheMatchRatio prometheus.Histogram
	TreeSize        *prometheus.GaugeVec // worker

	// circuit breaker
	CBState       *prometheus.GaugeVec   // worker
	CBTransitions *prometheus.CounterVec // worker, from, to
	CBOutcomes    *prometheus.CounterVec // worker, outcome

	// PD
	PDRequests       *prometheus.CounterVec   // route
	PDRequestDur     *prometheus.HistogramVec // route
	PDPrefillReqs    *prometheus.CounterVec   // worker
	PDDecodeReqs     *prometheus.CounterVec   // worker
	PDErrors         *prometheus.CounterVec   // error_type
	PDPrefillErrors  *prometheus.CounterVec   // worker
	PDDecodeErrors   *prometheus.CounterVec   // worker
	PDStreamErrors   *prometheus.CounterVec   // worker
	PDPrefillSeconds *prometheus.HistogramVec // connector, mode
	PDKVWaitSeconds  *prometheus.HistogramVec // connector, mode
	PDDecodeSeconds  *prometheus.HistogramVec // connector, mode
	PDLegErrors      *prometheus.CounterVec   // leg, reason
	PDFailovers      *prometheus.CounterVec   // reason
	PDWarmups        *prometheus.CounterVec   // result: ok | failed
	PanicRouted      *prometheus.CounterVec   // role: requests routed with every worker of the role down

	// discovery
	DiscoveryRegistrations *prometheus.CounterVec // role, format
	DiscoveryDropped       *prometheus.CounterVec // reason
	DiscoveryInstances     *prometheus.GaugeVec   // role, mode
	DiscoveryUpdates       prometheus.Counter
	DiscoveryAdded         prometheus.Counter
	DiscoveryRemoved       *prometheus.CounterVec // reason
	DiscoveryHeld          prometheus.Gauge
}

// Tokens returns TokensTotal's prompt and completion children, resolved
// on first use (so the series appear with the first usage counted).
func (m *Metrics) Tokens() (prompt, completion prometheus.Counter) {
	if t := m.tokens.Load(); t != nil {
		return t[0], t[1]
	}
	t := &[2]prometheus.Counter{m.TokensTotal.WithLabelValues("prompt"), m.TokensTotal.WithLabelValues("completion")}
	m.tokens.Store(t)
	return t[0], t[1]
}

// New creates and registers every metric on reg. It also registers the Go
// runtime and process collectors.
func New(reg *prometheus.Registry) *Metrics {
	f := factory{reg}
	m := &Metrics{Registry: reg}
	m.RequestsTotal = f.counterVec("vllm_router_requests_total", "Requests received, by route.", "route")
	m.HTTPRequests = f.counterVec("vllm_router_http_requests_total", "Requests answered, by route, method, status and mode.", "route", "method", "status", "mode")
	m.RequestErrors = f.counterVec("vllm_router_request_errors_total", "Requests that failed, by route and error type.", "route", "error_type")
	m.RequestDuration = f.histVec("vllm_router_request_duration_seconds", "End-to-end request duration seen by the router, until the last body byte.", DurationBuckets, "route", "status", "mode")
	m.TTFT = f.histVec("vllm_router_ttft_seconds", "Router-observed time to first token (first body byte of a streamed response).", DurationBuckets, "route", "mode")
	m.GenerateDur = f.hist("vllm_router_generate_duration_seconds", "Time from request to upstream response headers for generation routes.", DurationBuckets)
	m.InFlight = f.gaugeVec("vllm_router_inflight_requests", "Requests being served now, by mode.", "mode")
	m.TokensTotal = f.counterVec("vllm_router_tokens_total", "Tokens relayed, from upstream usage reports.", "kind")

	m.LoRAAdapters = f.gauge("vllm_router_lora_adapters", "LoRA adapters loaded through the router that it remembers (and gives to workers that lack them).")
	m.LoRAGiven = f.counterVec("vllm_router_lora_adapters_given_total", "Remembered LoRA adapters loaded on a worker that lacked them (a new or restarted engine), by outcome (loaded, failed).", "outcome")

	m.Retries = f.counterVec("vllm_router_retries_total", "Retry attempts, by route.", "route")
	m.RetryBackoff = f.histVec("vllm_router_retry_backoff_duration_seconds", "Backoff slept before a retry attempt.", DurationBuckets, "attempt")
	m.RetriesExhausted = f.counterVec("vllm_router_retries_exhausted_total", "Requests that used every retry attempt.", "route")
	m.QueueDepth = f.gauge("vllm_router_queue_depth", "Requests waiting for an admission slot.")
	m.QueueWait = f.hist("vllm_router_queue_wait_seconds", "Time a request waited for an admission slot.", DurationBuckets)
	m.AdmissionReject = f.counterVec("vllm_router_admission_rejections_total", "Requests rejected by admission control.", "reason")

	m.FlowQueueDepth = f.gaugeVec("vllm_router_flow_queue_depth", "Requests waiting in the flow-control queue, by priority band.", "band")
	m.FlowQueueWait = f.histVec("vllm_router_flow_queue_wait_seconds", "Time a request waited in the flow-control queue, by priority band.", DurationBuckets, "band")
	m.FlowFlowDepth = f.gaugeVec("vllm_router_flow_flow_queue_depth", "Requests waiting in the flow-control queue, by flow (first 32 flows seen, then other).", "flow")
	m.FlowFlowWait = f.histVec("vllm_router_flow_flow_queue_wait_seconds", "Time a request waited in the flow-control queue, by flow (first 32 flows seen, then other).", DurationBuckets, "flow")
	m.FlowShed = f.counterVec("vllm_router_flow_rejections_total", "Requests that left the flow-control queue without a slot, by band and reason (queue_full, shed, shed_fairness, queue_timeout, deadline, shutting_down, client_gone).", "band", "reason")
	m.WorkerSaturated = f.gaugeVec("vllm_router_worker_saturated", "Worker saturation as flow control sees it (1 saturated, 0 not).", "worker")
	m.WorkerWaiting = f.gaugeVec("vllm_router_worker_num_requests_waiting", "vllm:num_requests_waiting last polled from the worker's /metrics.", "worker")
	m.WorkerKVUsage = f.gaugeVec("vllm_router_worker_kv_cache_usage_perc", "vllm:kv_cache_usage_perc last polled from the worker's /metrics (1 = full).", "worker")
	m.FleetSaturated = f.gaugeVec("vllm_router_fleet_saturated", "1 while flow control holds requests because every candidate worker of the role is saturated.", "role")
	m.SaturationPolled = f.counterVec("vllm_router_saturation_polls_total", "Worker /metrics polls by the saturation detector, by result.", "result")

	m.ActiveWorkers = f.gauge("vllm_router_active_workers", "Workers in the registry.")
	m.Workers = f.gaugeVec("vllm_router_workers", "Workers in the registry by role and source.", "role", "source")
	m.WorkerHealth = f.gaugeVec("vllm_router_worker_health", "Worker health (1 healthy, 0 unhealthy).", "worker")
	m.RunningRequests = f.gaugeVec("vllm_router_running_requests", "In-flight requests per worker (released when the body ends).", "worker")
	m.WorkerInFlight = f.gaugeVec("vllm_router_worker_inflight_requests", "In-flight requests summed by worker role.", "role")
	m.Processed = f.counterVec("vllm_router_processed_requests_total", "Requests routed to each worker.", "worker")
	m.PolicyDecisions = f.counterVec("vllm_router_policy_decisions_total", "Policy decisions by policy and chosen worker.", "policy", "worker")
	m.LBEvents = f.counter("vllm_router_load_balancing_events_total", "cache_aware decisions taken for load balance instead of cache affinity.")
	m.MaxLoad = f.gauge("vllm_router_max_load", "Highest worker load seen at the last imbalance decision.")
	m.MinLoad = f.gauge("vllm_router_min_load", "Lowest worker load seen at the last imbalance decision.")
	m.CacheHits = f.counter("vllm_router_cache_hits_total", "cache_aware picks whose prefix match exceeded the threshold.")
	m.CacheMisses = f.counter("vllm_router_cache_misses_total", "cache_aware picks below the match threshold.")
	m.CacheMatchRatio = f.hist("vllm_router_cache_match_ratio", "cache_aware prefix match ratio per decision.", []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1})
	m.TreeSize = f.gaugeVec("vllm_router_tree_size", "cache_aware radix tree characters per worker.", "worker")

	m.CBState = f.gaugeVec("vllm_router_cb_state", "Circuit breaker state (0 closed, 1 open, 2 half-open).", "worker")
	m.CBTransitions = f.counterVec("vllm_router_cb_state_transitions_total", "Circuit breaker state transitions.", "worker", "from", "to")
	m.CBOutcomes = f.counterVec("vllm_router_cb_outcomes_total", "Outcomes recorded by circuit breakers.", "worker", "outcome")

	m.PDRequests = f.counterVec("vllm_router_pd_requests_total", "PD (two-leg) requests, by route.", "route")
	m.PDRequestDur = f.histVec("vllm_router_pd_request_duration_seconds", "PD request duration until the decode response headers.", DurationBuckets, "route")
	m.PDPrefillReqs = f.counterVec("vllm_router_pd_prefill_requests_total", "Prefill legs sent, by worker.", "worker")
	m.PDDecodeReqs = f.counterVec("vllm_router_pd_decode_requests_total", "Decode legs sent, by worker.", "worker")
	m.PDErrors = f.counterVec("vllm_router_pd_errors_total", "PD request errors by type.", "error_type")
	m.PDPrefillErrors = f.counterVec("vllm_router_pd_prefill_errors_total", "Failed prefill legs, by worker.", "worker")
	m.PDDecodeErrors = f.counterVec("vllm_router_pd_decode_errors_total", "Failed decode legs, by worker.", "worker")
	m.PDStreamErrors = f.counterVec("vllm_router_pd_stream_errors_total", "Decode streams that broke after the first byte.", "worker")
	m.PDPrefillSeconds = f.histVec("vllm_router_pd_prefill_duration_seconds", "Prefill leg latency (send to complete response).", DurationBuckets, "connector", "mode")
	m.PDKVWaitSeconds = f.histVec("vllm_router_pd_kv_wait_seconds", "Decode leg time to first token (KV transfer wait + first step), measured from the decode send.", DurationBuckets, "connector", "mode")
	m.PDDecodeSeconds = f.histVec("vllm_router_pd_decode_duration_seconds", "Decode leg duration from send to the last byte.", DurationBuckets, "connector", "mode")
	m.PDLegErrors = f.counterVec("vllm_router_pd_leg_errors_total", "PD leg failures by leg and reason.", "leg", "reason")
	m.PDFailovers = f.counterVec("vllm_router_pd_failovers_total", "PD pairs re-picked before the first byte, by reason.", "reason")
	m.PanicRouted = f.counterVec("vllm_router_panic_routed_total", "Picks made in panic mode (--panic-routing): every worker of the role was unhealthy or open-circuit, so a registered one was used anyway, by role.", "role")
	m.PDWarmups = f.counterVec("vllm_router_pd_warmups_total", "Warm-up requests sent through new prefill/decode pairs (--pd-warmup), by result.", "result")

	m.DiscoveryRegistrations = f.counterVec("vllm_router_discovery_registrations_total", "Registration messages accepted, by role and format.", "role", "format")
	m.DiscoveryDropped = f.counterVec("vllm_router_discovery_dropped_total", "Discovery messages dropped, by reason.", "reason")
	m.DiscoveryInstances = f.gaugeVec("vllm_router_discovery_instances", "Live discovered instances by role and transfer mode.", "role", "mode")
	m.DiscoveryUpdates = f.counter("vllm_router_discovery_updates_total", "Registry changes caused by discovery.")
	m.DiscoveryAdded = f.counter("vllm_router_discovery_workers_added_total", "Instances added by discovery.")
	m.DiscoveryRemoved = f.counterVec("vllm_router_discovery_workers_removed_total", "Instances removed by discovery, by reason.", "reason")
	m.DiscoveryHeld = f.gauge("vllm_router_discovery_held_instances", "Instances held aside (listed, not routed) because their transfer mode differs from the live fleet's.")

	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// NewForTest returns metrics on a fresh private registry.
func NewForTest() *Metrics { return New(prometheus.NewRegistry()) }

// Handler serves the registry in the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{Registry: m.Registry})
}

// WorkerGeneration changes whenever ForgetWorker deletes series: a
// per-worker child a caller resolved before may be deleted, and must be
// resolved again (WithLabelValues re-creates it).
func (m *Metrics) WorkerGeneration() uint64 { return m.workerGen.Load() }

// Per-worker children every request through a worker updates are
// resolved once per worker and kept (workers), instead of a label lookup
// (hashing the labels, a map lookup under a lock) per request; each is
// created at its first use, as WithLabelValues would. ForgetWorker drops
// a departed worker's; a child resolved before a ForgetWorker's deletes
// (the generation moved) is resolved again.
type childKind uint8

const (
	childRunning childKind = iota
	childSucceeded
	childFailed
	childPrefillReqs
	childDecodeReqs
	numChildKinds
)

type childKey struct {
	kind   childKind
	worker string
}

type child struct {
	gen uint64
	c   any // prometheus.Gauge or prometheus.Counter
}

func (m *Metrics) workerChild(kind childKind, key string) any {
	gen := m.workerGen.Load()
	k := childKey{kind, key}
	if v, ok := m.workers.Load(k); ok {
		if c := v.(child); c.gen == gen {
			return c.c
		}
	}
	var c any
	switch kind {
	case childRunning:
		c = m.RunningRequests.WithLabelValues(key)
	case childSucceeded:
		c = m.CBOutcomes.WithLabelValues(key, "success")
	case childFailed:
		c = m.CBOutcomes.WithLabelValues(key, "failure")
	case childPrefillReqs:
		c = m.PDPrefillReqs.WithLabelValues(key)
	case childDecodeReqs:
		c = m.PDDecodeReqs.WithLabelValues(key)
	}
	m.workers.Store(k, child{gen, c})
	return c
}

// Running is RunningRequests' child of a worker.
func (m *Metrics) Running(key string) prometheus.Gauge {
	return m.workerChild(childRunning, key).(prometheus.Gauge)
}

// Outcome is CBOutcomes' child of a worker for a success or a failure.
func (m *Metrics) Outcome(key string, success bool) prometheus.Counter {
	if success {
		return m.workerChild(childSucceeded, key).(prometheus.Counter)
	}
	return m.workerChild(childFailed, key).(prometheus.Counter)
}

// PDLegRequests is PDPrefillReqs' (prefill) or PDDecodeReqs' child of a
// worker.
func (m *Metrics) PDLegRequests(key string, prefill bool) prometheus.Counter {
	if prefill {
		return m.workerChild(childPrefillReqs, key).(prometheus.Counter)
	}
	return m.workerChild(childDecodeReqs, key).(prometheus.Counter)
}

// ForgetWorker deletes every per-worker series of a worker that left.
func (m *Metrics) ForgetWorker(key string) {
	defer m.workerGen.Add(1) // after the deletes: a child resolved meanwhile is resolved again
	for k := range numChildKinds {
		m.workers.Delete(childKey{k, key})
	}
	l := prometheus.Labels{"worker": key}
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		m.WorkerHealth, m.RunningRequests, m.Processed, m.PolicyDecisions, m.TreeSize,
		m.CBState, m.CBTransitions, m.CBOutcomes, m.PDPrefillReqs, m.PDDecodeReqs,
		m.PDPrefillErrors, m.PDDecodeErrors, m.PDStreamErrors,
		m.WorkerSaturated, m.WorkerWaiting, m.WorkerKVUsage,
	} {
		v.DeletePartialMatch(l)
	}
}

// Status returns the status label for a code.
func Status(code int) string { return strconv.Itoa(code) }

type factory struct{ reg *prometheus.Registry }

func (f factory) counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	f.reg.MustRegister(c)
	return c
}

func (f factory) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	f.reg.MustRegister(c)
	return c
}

func (f factory) gaugeVec(name, help string, labels ...string) *prometheus.GaugeVec {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, labels)
	f.reg.MustRegister(g)
	return g
}

func (f factory) gauge(name, help string) prometheus.Gauge {
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	f.reg.MustRegister(g)
	return g
}

func (f factory) histVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
	f.reg.MustRegister(h)
	return h
}

func (f factory) hist(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets})
	f.reg.MustRegister(h)
	return h
}
