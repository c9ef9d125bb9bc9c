package server

import (
	"math"
	"net/http"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/admission"
)

// BenchmarkServeGenerateFlow is BenchmarkServeGenerate with flow control
// off (the default: one nil check on the hot path), on with an empty queue,
// and on with the objective and fairness headers set plus a saturation
// detector (in-flight limits) as the gate:
//
//	go test -run '^$' -bench 'ServeGenerate(Flow)?$' -benchmem -count 5 ./internal/server
func BenchmarkServeGenerateFlow(b *testing.B) {
	bands, err := admission.ParseBands([]string{"high=10", "default=0", "low=-10"}, time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	for _, tc := range []struct {
		name    string
		flow    *admission.FlowConfig
		headers bool
	}{
		{name: "off"},
		{name: "on-empty", flow: &admission.FlowConfig{Bands: bands}},
		{name: "on-headers-gate", flow: &admission.FlowConfig{Bands: bands, Saturation: &admission.SaturationConfig{MaxInFlight: 8}}, headers: true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			s := benchServer(b, func(o *Options) { o.Flow = tc.flow; o.MaxConcurrent = 1024; o.QueueSize = 100 })
			body, req := newBenchRequest(b)
			if tc.headers {
				req.Header.Set(admission.DefaultObjectiveHeader, "high")
				req.Header.Set(admission.DefaultFairnessHeader, "tenant-a")
			}
			w := &nopWriter{h: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				runGenerate(s, body, w, req)
			}
		})
	}
}

// TestFlowControlAddsNoAllocations: flow control with an empty queue (and
// its objective and fairness headers set) allocates no more per request
// than the FIFO path.
func TestFlowControlAddsNoAllocations(t *testing.T) {
	if testing.Short() {
		t.Skip("allocation count")
	}
	bands, err := admission.ParseBands([]string{"high=10", "default=0", "low=-10"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	count := func(fc *admission.FlowConfig, headers bool) float64 {
		s := benchServer(t, func(o *Options) { o.Flow = fc; o.MaxConcurrent = 1024; o.QueueSize = 100 })
		body, req := newBenchRequest(t)
		if headers {
			req.Header.Set(admission.DefaultObjectiveHeader, "high")
			req.Header.Set(admission.DefaultFairnessHeader, "tenant-a")
		}
		w := &nopWriter{h: http.Header{}}
		runGenerate(s, body, w, req) // warm the metric series
		// AllocsPerRun counts the whole process's allocations: a goroutine
		// left by an earlier test of the package can add some to one run
		// (1 in 30 runs of the package on a busy machine). Such noise only
		// adds, so the least of several runs is the request's own count.
		least := math.Inf(1)
		for range 5 {
			least = min(least, testing.AllocsPerRun(200, func() { runGenerate(s, body, w, req) }))
		}
		return least
	}
	off := count(nil, false)
	on := count(&admission.FlowConfig{Bands: bands}, true)
	if on > off {
		t.Fatalf("flow control on: %v allocs/request, off: %v", on, off)
	}
}
