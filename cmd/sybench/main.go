// Command sybench is a vllm bench serve compatible benchmark client for
// OpenAI-style streaming completion servers (vLLM, vllm-sim, switchyard).
// See internal/bench/README.md.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := bench.Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "sybench:", err)
		os.Exit(1)
	}
}
