// Command sybench is a vllm bench serve compatible benchmark client for
// OpenAI-style streaming completion servers (vLLM, vllm-sim, switchyard).
// "sybench scenario pd|overhead|ceiling|kv|flow" runs the benchmark scenarios of
// docs/BENCHMARKS.md (package internal/bench/scenario).
// See internal/bench/README.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/switchyard-llm/switchyard/internal/bench"
	"github.com/switchyard-llm/switchyard/internal/bench/scenario"
)

func main() {
	bench.RegisterSubcommand("scenario", scenario.Main)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "sybench:", err)
		os.Exit(1)
	}
}
