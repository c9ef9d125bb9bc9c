package bench

import (
	"bytes"
	"context"
	"io"
	"testing"
)

// BenchmarkRunZeroLatency measures how many requests/s the client drives
// against the in-process zero-latency SSE server (client and server share
// the CPUs, so this is a lower bound of the client's own capacity):
//
//	go test -run '^$' -bench RunZeroLatency -benchtime 5000x ./internal/bench
func BenchmarkRunZeroLatency(b *testing.B) {
	z, err := startZeroServer()
	if err != nil {
		b.Fatal(err)
	}
	defer z.Close()
	for _, conc := range []int{64, 512} {
		b.Run("c"+itoa(conc), func(b *testing.B) {
			cfg := DefaultConfig()
			cfg.BaseURL, cfg.Model = z.URL, selfTestModel
			cfg.NumPrompts, cfg.MaxConcurrency = max(b.N, 1), conc
			cfg.InputLen, cfg.OutputLen = 256, 32
			cfg.DiscardText = true
			b.ReportAllocs()
			b.ResetTimer()
			res, err := Run(context.Background(), cfg)
			if err != nil {
				b.Fatal(err)
			}
			if res.Metrics.Failed > 0 {
				b.Fatalf("%d failed: %s", res.Metrics.Failed, res.Outputs[0].Error)
			}
			b.ReportMetric(float64(res.Metrics.Completed)/res.Duration.Seconds(), "req/s")
			b.ReportMetric(float64(res.Metrics.TotalOutput)/res.Duration.Seconds(), "events/s")
		})
	}
}

var benchChunk = []byte(`{"id":"cmpl-bench-1a2b3c4d-17","object":"text_completion","created":1700000000,"model":"deepseek-ai/DeepSeek-R1-0528","choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null,"stop_reason":null}]}`)

func BenchmarkScanChunk(b *testing.B) {
	text := make([]byte, 0, 1<<20)
	b.SetBytes(int64(len(benchChunk)))
	b.ReportAllocs()
	for b.Loop() {
		if len(text) > 1<<19 {
			text = text[:0]
		}
		if _, err := scanChunk(benchChunk, &text); err != nil {
			b.Fatal(err)
		}
	}
}

type repeatReader struct {
	ev, rest []byte
	n        int
}

// Read returns one copy of ev per call (r.n calls), resuming a copy that
// did not fit.
func (r *repeatReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		return 0, io.EOF
	}
	r.n--
	if len(r.rest) == 0 {
		r.rest = r.ev
	}
	n := copy(p, r.rest)
	r.rest = r.rest[n:]
	return n, nil
}

func BenchmarkSSEParser(b *testing.B) {
	ev := append(append([]byte("data: "), benchChunk...), "\n\n"...)
	p := newSSEParser(nil, DefaultMaxEventBytes, true)
	b.SetBytes(int64(len(ev)))
	b.ReportAllocs()
	r := &repeatReader{ev: ev}
	for b.Loop() {
		for {
			r.n = 1
			if _, err := p.readFrom(r); err != nil {
				b.Fatal(err)
			}
			d, ok, err := p.next()
			if err != nil {
				b.Fatal(err)
			}
			if ok {
				if !bytes.HasPrefix(d, []byte("{")) {
					b.Fatalf("bad event %q", d)
				}
				break
			}
		}
	}
}
