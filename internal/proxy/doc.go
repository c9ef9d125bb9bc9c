// Package proxy forwards requests to workers: the one shared upstream
// transport, the streaming relay, the error-to-status mapping and the
// regular-mode dispatcher with retries.
//
// Invariants:
//   - Bodies are forwarded byte for byte: a generation body is the client's
//     raw JSON (Call.Body), a pass-through body is streamed, never buffered.
//   - Relay writes and flushes every upstream read before the next one, in
//     order; it never drops, reorders or re-buffers a byte. A stream that
//     breaks after its headers were sent ends with an SSE error event (for
//     text/event-stream) or a cut connection, never as a silently truncated
//     200.
//   - A request is retried only before anything reached the client, only on
//     another worker (and another instance for DP ranks), only for a connect
//     failure, a response-header timeout or a 408/429/500/502/503/504, with
//     exponential backoff plus jitter bounded by the request deadline, and
//     within a retry budget so retries cannot multiply load in an outage.
//     "No worker" is answered at once with 503, without backoff.
//   - A connect failure marks the worker (all its DP ranks) unhealthy at
//     once; the active health checker brings it back.
//   - Every attempt records one circuit-breaker outcome (2xx/4xx success;
//     5xx, transport error, timeout or a mid-stream break failure; a client
//     that goes away is not held against the worker) and holds the worker's
//     in-flight count until the response body has been relayed.
//   - StatusFor is the only error-to-status mapping; every error response
//     is an OpenAI JSON error body, and the route receipt is filled before
//     the response headers are written.
//   - The upstream request's context derives from the client request's, so
//     a client disconnect cancels the upstream request at once.
package proxy
