package rawjson

import (
	"strconv"
	"strings"
	"testing"
)

// BenchmarkPrefillRewrite is the PD hot path: parse a client body and apply
// the prefill leg's edits (max_tokens, stream, stream_options, params).
//
//	go test -run='^$' -bench=. -benchmem ./internal/rawjson
func BenchmarkPrefillRewrite(b *testing.B) {
	for _, size := range []int{1 << 10, 32 << 10} {
		body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("word ", size/5) +
			`"}],"max_completion_tokens":128,"stream":true,"stream_options":{"include_usage":true},"temperature":0.7}`)
		params := []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":"tx-0"}`)
		b.Run(byteSize(size), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				o, err := Parse(body)
				if err != nil {
					b.Fatal(err)
				}
				_ = o.Apply(Set("max_completion_tokens", []byte("1")), Set("stream", []byte("false")),
					Delete("stream_options"), Set("kv_transfer_params", params))
			}
		})
	}
}

func byteSize(n int) string { return strconv.Itoa(n>>10) + "KiB" }

// BenchmarkParse is the server's validation of every generation body: a
// 1-token completion (wrk's request) and a typical chat request.
func BenchmarkParse(b *testing.B) {
	for _, tc := range []struct{ name, body string }{
		{"completion", `{"model":"sim-model","prompt":"hello","max_tokens":1}`},
		{"chat", `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Write a haiku about routers."}],"max_tokens":100,"temperature":0.7,"top_p":0.9,"stream":true,"stream_options":{"include_usage":true},"seed":7}`},
	} {
		body := []byte(tc.body)
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
