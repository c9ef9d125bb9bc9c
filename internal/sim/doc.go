// Package sim is vllm-sim: a simulated vLLM OpenAI server that behaves like
// a prefill (P), decode (D) or unified worker of a PD-disaggregated
// deployment, down to the wire (PROTOCOL.md §2, §4, §5, §9).
//
// What is real: the HTTP surface (OpenAI completions and chat, SSE, errors),
// the ZMQ registration heartbeat (msgpack over a go-zeromq DEALER), the P↔D
// side channel (notify and handshake ROUTER sockets, remote_blocks,
// write_done, release, get_meta_msg), the X-Request-Id address parsing with
// vLLM's regexes, and the Mooncake bootstrap HTTP server. What is simulated:
// the model (package oracle), the engine's timing and capacity (package
// engine) and the bulk KV bytes, which are replaced by a prompt digest that
// travels over the side channel.
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
