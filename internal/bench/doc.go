// Package bench is sybench: a load generator that reproduces vllm bench
// serve (vllm/benchmarks/serve.py) for OpenAI-compatible streaming servers.
//
// It sends the same payloads and headers, measures each request the same
// way (TTFT, inter-token latencies, end-to-end latency from the SSE token
// events), computes the same aggregates (numpy-compatible mean, median,
// std and linear-interpolated percentiles; goodput; peak token throughput
// and concurrency) and prints the same "Serving Benchmark Result" table and
// JSON keys, so numbers are comparable with published vLLM results.
//
// Library use:
//
//	cfg := bench.DefaultConfig()
//	cfg.BaseURL = "http://127.0.0.1:30000"
//	cfg.MaxConcurrency = 64
//	res, err := bench.Run(ctx, cfg)
//	...
//	res.WriteReport(os.Stdout)
//
// See README.md for the command line and the deviations from vLLM.
package bench
