// Command sybench is a vllm bench serve compatible benchmark client for
// OpenAI-style streaming completion servers (vLLM, vllm-sim, switchyard).
// "sybench scenario pd|overhead|ceiling|kv|flow" runs the benchmark scenarios of
// docs/BENCHMARKS.md (package internal/bench/scenario); "sybench
// floor-proxy" runs the least an HTTP/1.1 proxy can do, the yardstick of
// the router's overhead (package internal/bench/floor).
// See internal/bench/README.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/switchyard-llm/switchyard/internal/bench"
	"github.com/switchyard-llm/switchyard/internal/bench/floor"
	"github.com/switchyard-llm/switchyard/internal/bench/scenario"
)

func main() {
	bench.RegisterSubcommand("scenario", scenario.Main)
	bench.RegisterSubcommand("floor-proxy", floor.Main)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "sybench:", err)
		os.Exit(1)
	}
}
