// Package sim is vllm-sim: a simulated vLLM OpenAI server that behaves like
// a prefill (P), decode (D) or unified worker of a PD-disaggregated
// deployment, down to the wire (PROTOCOL.md §2, §4, §5, §9).
//
// What is real: the HTTP surface (OpenAI completions, chat and a minimal
// responses API, SSE, errors), the ZMQ registration heartbeat (msgpack over
// a go-zeromq DEALER), the P↔D side channel (notify and handshake ROUTER
// sockets, remote_blocks, write_done, release, get_meta_msg), the
// X-Request-Id address parsing with vLLM's regexes, and the Mooncake
// bootstrap HTTP server. What is simulated: the model (package oracle), the
// engine's timing and capacity (package engine) and the bulk KV bytes, which
// are replaced by a prompt digest that travels over the side channel.
//
// Where vLLM is lenient the simulator is too, and where vLLM breaks it
// breaks the same way (a READ of the wrong DP rank decodes garbage, a plain
// request on a MoRI-IO decode hangs): router bugs must show up as wrong
// output or hangs in end-to-end tests. Every PD contract violation is also
// counted (transfers.protocol_violations) and, with --strict, answered 400.
//
// Invariants:
//   - One scheduler goroutine per DP engine and one transfer Link goroutine
//     per DP engine; no goroutine per token. A request adds at most one
//     goroutine (a READ/NIXL read or a Mooncake pull) besides its handler.
//   - Generated text depends only on (prompt digest actually received,
//     seed, token index), so a decode's output equals a unified worker's
//     exactly when the KV handoff was correct.
//   - Every goroutine is tied to the Instance context and joined by Close.
package sim
