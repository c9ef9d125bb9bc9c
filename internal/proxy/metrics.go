package proxy

import (
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// BreakerMetricsHook returns a worker.BreakerConfig.OnTransition callback
// that keeps vllm_router_cb_state{worker} and
// vllm_router_cb_state_transitions_total{worker,from,to} up to date. The
// breaker calls it with its mutex held, so it only touches metrics. m may
// be nil.
func BreakerMetricsHook(m *metrics.Metrics, workerKey string) func(from, to worker.BreakerState) {
	if m == nil {
		return func(from, to worker.BreakerState) {}
	}
	return func(from, to worker.BreakerState) {
		m.CBState.WithLabelValues(workerKey).Set(float64(to))
		m.CBTransitions.WithLabelValues(workerKey, from.String(), to.String()).Inc()
	}
}
