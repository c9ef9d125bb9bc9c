// Package dashboard is the single definition of Switchyard's Grafana
// dashboard: the panels and their queries are Go values, rendered to
// Grafana JSON (deploy/grafana/switchyard.json, checked by a golden test)
// and evaluated directly against scraped /metrics samples to draw a PNG
// snapshot without Prometheus or Grafana (cmd/dashboard-snapshot). The
// evaluator implements exactly the PromQL shapes the queries use: sum by
// of a gauge, rate of a counter, the mean of a histogram and
// histogram_quantile over bucket rates.
package dashboard

import (
	"fmt"
	"sort"
	"strings"
)

// Kind is the shape of a query.
type Kind uint8

// Query kinds.
const (
	Gauge    Kind = iota // sum by (By) (metric)
	Rate                 // sum by (By) (rate(metric[$__rate_interval]))
	Quantile             // histogram_quantile(Q, sum by (le, By) (rate(metric_bucket[...])))
	Mean                 // sum by (By) (rate(metric_sum[...])) / sum by (By) (rate(metric_count[...]))
)

// Query is one Grafana target.
type Query struct {
	Kind   Kind
	Metric string            // family name (a histogram's base name)
	By     []string          // grouping labels
	Match  map[string]string // equality matchers
	Q      float64           // quantile, for Quantile
	Legend string            // Grafana legendFormat, e.g. "p99 {{connector}}/{{mode}}"
}

// Panel is one dashboard panel.
type Panel struct {
	Title       string
	Description string
	Unit        string // Grafana unit: s, reqps, ops, short
	Stat        bool   // a stat panel (value + sparkline) instead of a time series
	Width       int    // grid columns out of 24 (default 8)
	Snapshot    bool   // drawn in the PNG snapshot
	Queries     []Query
}

// Row is a titled group of panels.
type Row struct {
	Title  string
	Panels []Panel
}

// rateWindow is the range of every rate in the Grafana queries.
const rateWindow = "$__rate_interval"

// selector renders metric{job=~"$job",k="v",...}.
func (q Query) selector(suffix string) string {
	ms := []string{`job=~"$job"`}
	keys := make([]string, 0, len(q.Match))
	for k := range q.Match {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		ms = append(ms, fmt.Sprintf("%s=%q", k, q.Match[k]))
	}
	return q.Metric + suffix + "{" + strings.Join(ms, ",") + "}"
}

func by(labels ...string) string {
	if len(labels) == 0 {
		return "sum"
	}
	return "sum by (" + strings.Join(labels, ", ") + ")"
}

// PromQL renders the query for Prometheus/Grafana.
func (q Query) PromQL() string {
	rate := func(suffix string) string { return "rate(" + q.selector(suffix) + "[" + rateWindow + "])" }
	switch q.Kind {
	case Rate:
		return by(q.By...) + " (" + rate("") + ")"
	case Quantile:
		return fmt.Sprintf("histogram_quantile(%g, %s (%s))", q.Q, by(append([]string{"le"}, q.By...)...), rate("_bucket"))
	case Mean:
		return by(q.By...) + " (" + rate("_sum") + ") / " + by(q.By...) + " (" + rate("_count") + ")"
	default:
		return by(q.By...) + " (" + q.selector("") + ")"
	}
}

func quantiles(metric string, by []string, legend string, qs ...float64) []Query {
	out := make([]Query, 0, len(qs))
	for _, q := range qs {
		out = append(out, Query{Kind: Quantile, Metric: metric, By: by, Q: q, Legend: fmt.Sprintf("p%g%s", q*100, legend)})
	}
	return out
}

// Rows is the dashboard.
func Rows() []Row {
	cm := []string{"connector", "mode"}
	const cmLegend = " {{connector}}/{{mode}}"
	return []Row{
		{Title: "Fleet overview", Panels: []Panel{
			{Title: "Requests/s by status", Unit: "reqps", Snapshot: true,
				Description: "Answered requests per second by HTTP status, every route.",
				Queries:     []Query{{Kind: Rate, Metric: "vllm_router_http_requests_total", By: []string{"status"}, Legend: "{{status}}"}}},
			{Title: "Errors/s by type", Unit: "reqps", Snapshot: true,
				Description: "Requests that failed, by error type: router errors (request_errors) and PD errors.",
				Queries: []Query{
					{Kind: Rate, Metric: "vllm_router_request_errors_total", By: []string{"error_type"}, Legend: "{{error_type}}"},
					{Kind: Rate, Metric: "vllm_router_pd_errors_total", By: []string{"error_type"}, Legend: "pd {{error_type}}"},
				}},
			{Title: "Workers by role", Unit: "short", Snapshot: true,
				Description: "Workers in the registry by role, and how many are healthy.",
				Queries: []Query{
					{Kind: Gauge, Metric: "vllm_router_workers", By: []string{"role"}, Legend: "{{role}}"},
					{Kind: Gauge, Metric: "vllm_router_worker_health", Legend: "healthy"},
				}},
		}},
		{Title: "Latency", Panels: []Panel{
			{Title: "Router TTFT", Unit: "s", Width: 12, Snapshot: true,
				Description: "Time to first token seen by the router (streamed responses), from request arrival to the first body byte.",
				Queries:     quantiles("vllm_router_ttft_seconds", nil, "", 0.5, 0.9, 0.99)},
			{Title: "Request duration", Unit: "s", Width: 12, Snapshot: true,
				Description: "End-to-end duration until the last body byte.",
				Queries:     quantiles("vllm_router_request_duration_seconds", nil, "", 0.5, 0.9, 0.99)},
		}},
		{Title: "PD phases", Panels: []Panel{
			{Title: "Prefill leg", Unit: "s", Snapshot: true,
				Description: "Prefill leg latency, send to complete response, per KV connector and dispatch mode (sequential: NIXL, P2P-NCCL, MoRI READ; concurrent: MoRI WRITE, Mooncake).",
				Queries:     quantiles("vllm_router_pd_prefill_duration_seconds", cm, cmLegend, 0.5, 0.99)},
			{Title: "KV wait (decode send to first byte)", Unit: "s", Snapshot: true,
				Description: "Decode leg time to first byte: KV transfer wait plus the first decode step. In concurrent mode the decode is sent with the prefill, so this includes the prefill.",
				Queries:     quantiles("vllm_router_pd_kv_wait_seconds", cm, cmLegend, 0.5, 0.99)},
			{Title: "Decode leg", Unit: "s", Snapshot: true,
				Description: "Decode leg duration, send to last byte.",
				Queries:     quantiles("vllm_router_pd_decode_duration_seconds", cm, cmLegend, 0.5, 0.99)},
			{Title: "Mean phase time", Unit: "s", Width: 12,
				Description: "Mean prefill, KV wait and decode time per connector/mode.",
				Queries: []Query{
					{Kind: Mean, Metric: "vllm_router_pd_prefill_duration_seconds", By: cm, Legend: "prefill" + cmLegend},
					{Kind: Mean, Metric: "vllm_router_pd_kv_wait_seconds", By: cm, Legend: "kv wait" + cmLegend},
					{Kind: Mean, Metric: "vllm_router_pd_decode_duration_seconds", By: cm, Legend: "decode" + cmLegend},
				}},
			{Title: "PD leg errors and failovers", Unit: "ops", Width: 12,
				Description: "Failed legs by leg and reason, pairs re-picked before the first byte by reason, and the router's warm-ups of new prefill/decode pairs by result.",
				Queries: []Query{
					{Kind: Rate, Metric: "vllm_router_pd_leg_errors_total", By: []string{"leg", "reason"}, Legend: "{{leg}} {{reason}}"},
					{Kind: Rate, Metric: "vllm_router_pd_failovers_total", By: []string{"reason"}, Legend: "failover {{reason}}"},
					{Kind: Rate, Metric: "vllm_router_pd_warmups_total", By: []string{"result"}, Legend: "pair warm-up {{result}}"},
				}},
		}},
		{Title: "Load", Panels: []Panel{
			{Title: "In flight per worker", Unit: "short", Snapshot: true,
				Description: "Requests (legs in PD mode) in flight on each worker, released when the body ends.",
				Queries:     []Query{{Kind: Gauge, Metric: "vllm_router_running_requests", By: []string{"worker"}, Legend: "{{worker}}"}}},
			{Title: "In flight by role", Unit: "short",
				Description: "In-flight upstream requests summed by worker role, and client requests by router mode.",
				Queries: []Query{
					{Kind: Gauge, Metric: "vllm_router_worker_inflight_requests", By: []string{"role"}, Legend: "{{role}}"},
					{Kind: Gauge, Metric: "vllm_router_inflight_requests", By: []string{"mode"}, Legend: "clients ({{mode}})"},
				}},
			{Title: "Admission queue", Unit: "short", Snapshot: true,
				Description: "Requests waiting for an admission slot (--max-concurrent-requests) and rejections by reason.",
				Queries: []Query{
					{Kind: Gauge, Metric: "vllm_router_queue_depth", Legend: "queued"},
					{Kind: Rate, Metric: "vllm_router_admission_rejections_total", By: []string{"reason"}, Legend: "rejected/s {{reason}}"},
				}},
			{Title: "Queue wait", Unit: "s", Width: 12,
				Description: "Time spent waiting for an admission slot.",
				Queries:     quantiles("vllm_router_queue_wait_seconds", nil, "", 0.5, 0.99)},
			{Title: "Policy decisions/s", Unit: "ops", Width: 12,
				Description: "Picks per policy and worker.",
				Queries:     []Query{{Kind: Rate, Metric: "vllm_router_policy_decisions_total", By: []string{"policy", "worker"}, Legend: "{{policy}} {{worker}}"}}},
		}},
		{Title: "Reliability", Panels: []Panel{
			{Title: "Retries and failovers", Unit: "ops", Snapshot: true,
				Description: "Regular-mode retries and exhausted retry sequences; PD pair failovers.",
				Queries: []Query{
					{Kind: Rate, Metric: "vllm_router_retries_total", Legend: "retries"},
					{Kind: Rate, Metric: "vllm_router_retries_exhausted_total", Legend: "retries exhausted"},
					{Kind: Rate, Metric: "vllm_router_pd_failovers_total", Legend: "pd failovers"},
				}},
			{Title: "Breaker transitions", Unit: "ops",
				Description: "Circuit breaker state changes by target state.",
				Queries:     []Query{{Kind: Rate, Metric: "vllm_router_cb_state_transitions_total", By: []string{"to"}, Legend: "to {{to}}"}}},
			{Title: "Breaker state per worker", Unit: "short",
				Description: "0 closed, 1 open, 2 half-open.",
				Queries:     []Query{{Kind: Gauge, Metric: "vllm_router_cb_state", By: []string{"worker"}, Legend: "{{worker}}"}}},
		}},
		{Title: "Discovery", Panels: []Panel{
			{Title: "Discovered instances", Unit: "short", Snapshot: true,
				Description: "Live ZMQ-registered instances by role and MoRI-IO transfer mode, and instances held aside (mode differs from the live fleet's).",
				Queries: []Query{
					{Kind: Gauge, Metric: "vllm_router_discovery_instances", By: []string{"role", "mode"}, Legend: "{{role}} {{mode}}"},
					{Kind: Gauge, Metric: "vllm_router_discovery_held_instances", Legend: "held"},
				}},
			{Title: "Registrations and drops", Unit: "ops",
				Description: "Registration messages accepted by role/format, and messages dropped by reason.",
				Queries: []Query{
					{Kind: Rate, Metric: "vllm_router_discovery_registrations_total", By: []string{"role", "format"}, Legend: "{{role}} {{format}}"},
					{Kind: Rate, Metric: "vllm_router_discovery_dropped_total", By: []string{"reason"}, Legend: "dropped {{reason}}"},
				}},
			{Title: "Workers added/removed", Unit: "ops",
				Description: "Registry changes made by discovery.",
				Queries: []Query{
					{Kind: Rate, Metric: "vllm_router_discovery_workers_added_total", Legend: "added"},
					{Kind: Rate, Metric: "vllm_router_discovery_workers_removed_total", By: []string{"reason"}, Legend: "removed {{reason}}"},
				}},
		}},
	}
}
