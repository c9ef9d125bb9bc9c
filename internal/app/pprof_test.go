package app

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/metrics"
)

// --enable-pprof adds net/http/pprof to the metrics listener; without it
// the paths are 404 and /metrics is unaffected either way.
func TestMetricsMuxPprof(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		wantStatus int
	}{
		{nil, http.StatusNotFound},
		{[]string{"--enable-pprof"}, http.StatusOK},
	} {
		cfg, err := config.Parse(append([]string{"--worker-urls", "http://127.0.0.1:1"}, tc.args...))
		if err != nil {
			t.Fatal(err)
		}
		a := &app{cfg: cfg, m: metrics.New(prometheus.NewRegistry())}
		srv := httptest.NewServer(a.metricsMux())
		get := func(path string) (int, string) {
			t.Helper()
			resp, err := srv.Client().Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			return resp.StatusCode, string(b)
		}
		for _, path := range []string{"/debug/pprof/", "/debug/pprof/goroutine?debug=1", "/debug/pprof/heap?debug=1", "/debug/pprof/cmdline"} {
			status, body := get(path)
			if status != tc.wantStatus {
				t.Errorf("%v GET %s = %d, want %d", tc.args, path, status, tc.wantStatus)
			}
			if status == http.StatusOK && strings.Contains(path, "goroutine") && !strings.Contains(body, "goroutine profile:") {
				t.Errorf("GET %s body = %.200q, want a goroutine profile", path, body)
			}
		}
		if status, body := get("/metrics"); status != http.StatusOK || !strings.Contains(body, "# TYPE") {
			t.Errorf("%v GET /metrics = %d %.100q", tc.args, status, body)
		}
		srv.Close()
	}
}
