package migrate

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Causes: why an answer had to move (the reason label).
const (
	CauseBroken      = "upstream_broken" // connection reset or closed before [DONE]
	CauseIdle        = "idle_timeout"    // --stream-idle-timeout passed
	CauseEngineError = "engine_error"    // the engine sent an SSE error event
	CauseNoResponse  = "no_response"     // the worker failed before its response headers
)

// Results (the result label). A refusal is "refused_<reason>" with one of
// the Refuse* reasons.
const (
	ResultContinued = "continued" // the continuation finished the answer
	ResultRetried   = "retried"   // nothing was delivered: the whole request went to another worker
	ResultFailed    = "failed"    // the continuation leg failed too (another migration may follow)
	ResultExhausted = "exhausted" // --max-migrations reached
	ResultNoWorker  = "no_worker" // no other worker to continue on
	ResultTimeout   = "timeout"   // --request-timeout-secs passed
	ResultComplete  = "complete"  // the token budget was spent: the router ended the stream itself
)

// Metrics are the migration series, registered on the router's registry.
type Metrics struct {
	Total *prometheus.CounterVec // route, reason, result
	Stall prometheus.Histogram
}

// NewMetrics registers vllm_router_migrations_total and
// vllm_router_migration_stall_seconds on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Total: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vllm_router_migrations_total",
			Help: "Answers whose worker failed mid-way, by route, cause (reason) and what the router did (result).",
		}, []string{"route", "reason", "result"}),
		Stall: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vllm_router_migration_stall_seconds",
			Help:    "Gap the client saw at a migration: from the last event of the failed leg to the first of the continuation.",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.75, 1, 2.5, 5, 10, 30},
		}),
	}
	reg.MustRegister(m.Total, m.Stall)
	return m
}

// Count adds one migration outcome (nil-safe).
func (m *Metrics) Count(route, reason, result string) {
	if m != nil {
		m.Total.WithLabelValues(route, reason, result).Inc()
	}
}

// ObserveStall records the client's gap at a cut (nil-safe).
func (m *Metrics) ObserveStall(d time.Duration) {
	if m != nil {
		m.Stall.Observe(d.Seconds())
	}
}
