package proxy

// Run with:
//
//	go test -run='^$' -bench=. -benchmem -count=6 ./internal/proxy | tee new.txt
//	benchstat old.txt new.txt

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// discardWriter is a minimal flushable ResponseWriter (the server's cost is
// not what these benchmarks measure).
type discardWriter struct {
	h      http.Header
	status int
	n      int
}

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) WriteHeader(code int)        { d.status = code }
func (d *discardWriter) Write(b []byte) (int, error) { d.n += len(b); return len(b), nil }
func (d *discardWriter) Flush()                      {}

func (d *discardWriter) reset() {
	clear(d.h)
	d.status, d.n = 0, 0
}

const benchBody = `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Write a haiku about routers."}],"max_tokens":100,"temperature":0.7,"stream":%s}`

func sseBody(tokens int) string {
	var sb strings.Builder
	for i := range tokens {
		fmt.Fprintf(&sb, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok%d\"},\"finish_reason\":null}]}\n\n", i)
	}
	sb.WriteString("data: {\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"total_tokens\":120,\"completion_tokens\":100}}\n\ndata: [DONE]\n\n")
	return sb.String()
}

// BenchmarkRegularDispatch measures the router's hot path per request: the
// server's body parse (rawjson), the pick, header filtering, the upstream
// round trip over loopback to an in-process fake worker and the relay.
// The fake worker's own cost is included; the frontend server's is not.
func BenchmarkRegularDispatch(b *testing.B) {
	nonStream := `{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Packets drift like leaves"},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"total_tokens":27,"completion_tokens":7}}`
	sse := sseBody(100)
	for _, tc := range []struct {
		name   string
		stream bool
		mig    int // --max-migrations: the tracking writer is on the stream's path
	}{{"nonstream", false, 0}, {"sse100", true, 0}, {"sse100-migratable", true, 2}} {
		b.Run(tc.name, func(b *testing.B) {
			events := strings.SplitAfter(sse, "\n\n")
			wk := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				if !tc.stream {
					w.Header().Set("Content-Type", "application/json")
					w.Header().Set("Content-Length", fmt.Sprint(len(nonStream)))
					io.WriteString(w, nonStream)
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				rc := http.NewResponseController(w)
				for _, ev := range events { // one write + flush per token, as vLLM does
					io.WriteString(w, ev)
					rc.Flush()
				}
			}))
			defer wk.Close()
			reg := worker.NewRegistry(worker.BreakerConfig{})
			reg.Add(worker.Spec{URL: wk.URL, DPRank: -1})
			tr := NewTransport(TransportOptions{})
			defer tr.CloseIdleConnections()
			p := NewRegular(RegularOptions{Registry: reg, Policy: &rrPolicy{}, Client: &http.Client{Transport: tr},
				Retry: RetryConfig{MaxAttempts: 3, BudgetRatio: 0.2}, RequestTimeout: time.Minute, StreamIdleTimeout: time.Minute,
				Metrics: metrics.NewForTest(), MaxMigrations: tc.mig})
			body := []byte(fmt.Sprintf(benchBody, map[bool]string{true: "true", false: "false"}[tc.stream]))
			r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil).WithContext(context.Background())
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Authorization", "Bearer sk-x")
			r.Header.Set("X-Request-Id", "abc")
			w := &discardWriter{h: http.Header{}}
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				obj, err := rawjson.Parse(body)
				if err != nil {
					b.Fatal(err)
				}
				stream, _ := obj.Bool("stream")
				c := &Call{Route: "/v1/chat/completions", Path: "/v1/chat/completions", Body: body, Obj: obj,
					Stream: stream, Start: time.Now(), Receipt: &Receipt{}}
				w.reset()
				p.Dispatch(w, r, c)
				if w.status != 200 || w.n == 0 {
					b.Fatalf("status %d, %d bytes", w.status, w.n)
				}
			}
		})
	}
}

// BenchmarkRelay measures Relay alone on a 100-token SSE stream delivered one
// event per read.
func BenchmarkRelay(b *testing.B) {
	events := strings.SplitAfter(sseBody(100), "\n\n")
	w := &discardWriter{h: http.Header{}}
	var tail usageTail
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		w.reset()
		tail.reset()
		res := Relay(ctx, w, &chunkReader{chunks: events}, RelayOptions{Observe: tail.observe})
		if res.UpstreamErr != nil || !res.DownstreamOK {
			b.Fatal(res)
		}
	}
}
