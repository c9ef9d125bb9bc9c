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
		edits := []Edit{Set("max_completion_tokens", []byte("1")), Set("stream", []byte("false")),
			Delete("stream_options"), Set("kv_transfer_params", params)}
		b.Run(byteSize(size), func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				o, err := Parse(body)
				if err != nil {
					b.Fatal(err)
				}
				_ = o.Apply(edits...)
			}
		})
		// the leg body as pieces, then copied once where a transport
		// would write it (its pooled buffer)
		b.Run(byteSize(size)+"/splice", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			wbuf := make([]byte, 0, 2*len(body))
			for b.Loop() {
				o, err := Parse(body)
				if err != nil {
					b.Fatal(err)
				}
				wbuf = o.Splice(edits...).AppendTo(wbuf[:0])
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

// BenchmarkLookup finds kv_transfer_params in a prefill's answer, as a PD
// request does once per attempt.
func BenchmarkLookup(b *testing.B) {
	body := []byte(`{"id":"cmpl-___prefill_addr_10.0.0.1:8100___decode_addr_10.0.0.2:8200_4a28c8b0a787428787b7b9fb7e124107","object":"text_completion","created":1796477681,"model":"Qwen/Qwen3-8B","choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_logprobs":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":1000,"total_tokens":1001,"completion_tokens":1,"prompt_tokens_details":null},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63],"remote_engine_id":"b5f7c3a0-1d2e-4f5a-9b8c-7d6e5f4a3b2c","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1}}`)
	b.ReportAllocs()
	for b.Loop() {
		if v, err := Lookup(body, "kv_transfer_params"); err != nil || v == nil {
			b.Fatal(v, err)
		}
	}
}
