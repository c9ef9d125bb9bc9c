// Package scenario drives the benchmark scenarios of docs/BENCHMARKS.md:
// it starts switchyard and vllm-sim from prebuilt binaries as child
// processes on free loopback ports (parsing vllm-sim's ready line, waiting
// for the router's /readiness), runs internal/bench in-process against
// them, and writes Markdown (and PNG) results.
//
// Exposed as "sybench scenario pd|overhead|ceiling|kv|flow|compare" and the
// Makefile's bench-pd, bench-overhead, bench-ceiling, bench-kv, bench-flow
// and bench-compare targets. compare also starts the peer routers
// scripts/install-peers.sh installs (vllm-router, sglang-router, nginx,
// vLLM's NIXL toy proxy) and drives wrk as a child process.
//
// Invariants:
//   - Every child runs in its own process group with Pdeathsig=SIGKILL and
//     is stopped (SIGTERM, then SIGKILL after 5 s) before Run* returns,
//     on success, error, context cancellation (SIGINT) or panic unwinding.
//   - Every benchmark point is bounded (sybench's MaxDuration) and the whole
//     scenario by Options.MaxDuration plus a shutdown reserve.
//   - RLIMIT_NOFILE is raised to the hard limit before children start, and
//     the children inherit it.
package scenario
