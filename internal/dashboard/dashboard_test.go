package dashboard

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/switchyard-llm/switchyard/internal/metrics"
)

const dashboardFile = "../../deploy/grafana/switchyard.json"

// TestGrafanaJSONUpToDate: the checked-in dashboard is what Rows()
// generates. Regenerate with `make dashboard-json`.
func TestGrafanaJSONUpToDate(t *testing.T) {
	got, err := Grafana()
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := json.Unmarshal(got, &v); err != nil {
		t.Fatalf("generated dashboard is not JSON: %v", err)
	}
	want, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s is stale: run `make dashboard-json`", dashboardFile)
	}
}

// declaredNames are the family names registered by metrics.New.
func declaredNames(t *testing.T) map[string]bool {
	t.Helper()
	m := metrics.NewForTest()
	names := map[string]bool{}
	re := regexp.MustCompile(`fqName: "([^"]+)"`)
	v := reflect.ValueOf(m).Elem()
	for i := range v.NumField() {
		if !v.Type().Field(i).IsExported() {
			continue // bookkeeping, not a collector
		}
		c, ok := v.Field(i).Interface().(prometheus.Collector)
		if !ok {
			continue
		}
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			if sm := re.FindStringSubmatch(d.String()); sm != nil {
				names[sm[1]] = true
			}
		}
	}
	return names
}

// TestQueriesUseDeclaredMetrics: every panel queries metrics that exist,
// with the right kind of query for their type.
func TestQueriesUseDeclaredMetrics(t *testing.T) {
	names := declaredNames(t)
	for _, r := range Rows() {
		for _, p := range r.Panels {
			if len(p.Queries) == 0 || p.Unit == "" {
				t.Errorf("panel %q has no queries or unit", p.Title)
			}
			for _, q := range p.Queries {
				if !names[q.Metric] {
					t.Errorf("panel %q queries undeclared metric %s", p.Title, q.Metric)
				}
				counter := strings.HasSuffix(q.Metric, "_total")
				switch q.Kind {
				case Rate:
					if !counter {
						t.Errorf("panel %q: rate of non-counter %s", p.Title, q.Metric)
					}
				case Gauge:
					if counter {
						t.Errorf("panel %q: counter %s used as a gauge", p.Title, q.Metric)
					}
				}
			}
		}
	}
}

func TestPromQL(t *testing.T) {
	for _, tc := range []struct {
		q    Query
		want string
	}{
		{Query{Kind: Rate, Metric: "vllm_router_http_requests_total", By: []string{"status"}},
			`sum by (status) (rate(vllm_router_http_requests_total{job=~"$job"}[$__rate_interval]))`},
		{Query{Kind: Quantile, Metric: "vllm_router_pd_kv_wait_seconds", By: []string{"connector", "mode"}, Q: 0.99},
			`histogram_quantile(0.99, sum by (le, connector, mode) (rate(vllm_router_pd_kv_wait_seconds_bucket{job=~"$job"}[$__rate_interval])))`},
		{Query{Kind: Mean, Metric: "x_seconds", Match: map[string]string{"mode": "pd"}},
			`sum (rate(x_seconds_sum{job=~"$job",mode="pd"}[$__rate_interval])) / sum (rate(x_seconds_count{job=~"$job",mode="pd"}[$__rate_interval]))`},
		{Query{Kind: Gauge, Metric: "vllm_router_queue_depth"}, `sum (vllm_router_queue_depth{job=~"$job"})`},
	} {
		if got := tc.q.PromQL(); got != tc.want {
			t.Errorf("PromQL:\n got %s\nwant %s", got, tc.want)
		}
	}
}

// TestQuantileLikePromQL: histogram_quantile's interpolation, including
// the +Inf bucket and empty windows.
func TestQuantileLikePromQL(t *testing.T) {
	old := []bucket{{0.1, 5}, {0.25, 5}, {1, 5}, {math.Inf(1), 5}}
	cur := []bucket{{0.1, 15}, {0.25, 35}, {1, 35}, {math.Inf(1), 45}}
	for _, tc := range []struct{ q, want float64 }{
		{0.25, 0.1},  // rank 10: top of the first bucket
		{0.5, 0.175}, // rank 20: half way through (0.1, 0.25]
		{0.75, 0.25}, // rank 30: top of (0.1, 0.25]
		{0.99, 1},    // rank 39.6: in +Inf → highest finite bound
		{0.1, 0.04},  // rank 4: inside the first bucket, from 0
		{0.7, 0.235}, // rank 28: 0.1 + 0.15·18/20
	} {
		got, ok := quantile(tc.q, cur, old)
		if !ok || math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("q%v = %v (%v), want %v", tc.q, got, ok, tc.want)
		}
	}
	if _, ok := quantile(0.5, old, old); ok {
		t.Error("quantile of an empty window has a value")
	}
}

// snap gathers m as a scrape at t0+sec.
func snap(t *testing.T, m *metrics.Metrics, t0 time.Time, sec int) Snapshot {
	t.Helper()
	mfs, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Parse(&buf, t0.Add(time.Duration(sec)*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestEval(t *testing.T) {
	m := metrics.NewForTest()
	t0 := time.Unix(1000, 0)
	var snaps []Snapshot
	for sec := range 4 {
		// 10 req/s of 200s, 2 req/s of 503s; the queue grows by one a second
		m.HTTPRequests.WithLabelValues("/v1/completions", "POST", "200", "pd").Add(10)
		m.HTTPRequests.WithLabelValues("/v1/completions", "POST", "503", "pd").Add(2)
		m.QueueDepth.Set(float64(sec))
		for range 10 {
			m.PDPrefillSeconds.WithLabelValues("moriio", "concurrent").Observe(0.2)
		}
		snaps = append(snaps, snap(t, m, t0, sec))
	}
	rate := Eval(Query{Kind: Rate, Metric: "vllm_router_http_requests_total", By: []string{"status"}, Legend: "HTTP {{status}}"}, snaps, 2)
	if len(rate) != 2 || rate[0].Name != "HTTP 200" || rate[1].Name != "HTTP 503" {
		t.Fatalf("rate series %+v", rate)
	}
	if !math.IsNaN(rate[0].Y[1]) || rate[0].Y[2] != 10 || rate[1].Y[3] != 2 || rate[0].X[3] != 3 {
		t.Fatalf("rate values %v %v", rate[0].Y, rate[1].Y)
	}
	g := Eval(Query{Kind: Gauge, Metric: "vllm_router_queue_depth"}, snaps, 1)
	if len(g) != 1 || g[0].Y[3] != 3 {
		t.Fatalf("gauge %+v", g)
	}
	mean := Eval(Query{Kind: Mean, Metric: "vllm_router_pd_prefill_duration_seconds", By: []string{"connector", "mode"}, Legend: "{{connector}}/{{mode}}"}, snaps, 1)
	if len(mean) != 1 || mean[0].Name != "moriio/concurrent" || math.Abs(mean[0].Y[2]-0.2) > 1e-9 {
		t.Fatalf("mean %+v", mean)
	}
	q := Eval(Query{Kind: Quantile, Metric: "vllm_router_pd_prefill_duration_seconds", Q: 0.5}, snaps, 1)
	if len(q) != 1 || q[0].Y[3] <= 0.1 || q[0].Y[3] > 0.25 {
		t.Fatalf("quantile %+v", q)
	}
	if none := Eval(Query{Kind: Rate, Metric: "vllm_router_retries_total"}, snaps, 1); len(none) != 0 {
		t.Fatalf("series for a metric with no samples: %+v", none)
	}
	img := Render(snaps, RenderOptions{Title: "test", Subtitle: "sub", OnlySnapshots: true, Window: 1})
	if b := img.Bounds(); b.Dx() != 3*640 || b.Dy() < 4*400 {
		t.Fatalf("snapshot size %v", b)
	}
}
