// Package server is Switchyard's HTTP front end: routes, middleware,
// admission, the admin/info endpoints and graceful shutdown. It does not
// route generations itself; it hands them to a proxy.Dispatcher (the regular
// proxy or the PD engine) and sends every other path to a Passthrough
// handler. Both are wired by the app.
//
// # Middleware
//
// Every request, the catch-all included (the Rust router's fallback escaped
// all of it, REFERENCE §10.4 #26), runs through one chain in this order:
//
//  1. recover: a panic becomes a 500 JSON error, or aborts the connection
//     when the status line was already sent.
//  2. request id (§6.9): the first valid value of RequestIDHeaders (default
//     x-request-id, x-correlation-id, x-trace-id, request-id), else a
//     generated chatcmpl-/cmpl-/gnt-/req- + 24 alphanumerics. Echoed as
//     x-request-id (re-stamped at WriteHeader so an upstream copy cannot
//     replace it) and stored in proxy.Call.RequestID; RequestID(ctx) gives it
//     to passthrough handlers.
//  3. CORS (§6.10): preflights are answered 204 here, before auth.
//  4. auth (§6.8): RouterAPIKeys (SHA-256 + constant-time compare) and/or
//     APIKeyValidationURLs (GET with the bearer token; 200 = valid), results
//     cached in a 1024-entry LRU for 5 min (valid) / 30 s (invalid); a
//     validator that cannot be reached gives 503 and is not cached. Tokens
//     are never logged or stored in clear. /health, /liveness and /readiness
//     are exempt because Kubernetes probes carry no token. Admin endpoints
//     (/add_worker, /remove_worker, POST and DELETE /workers, /flush_cache,
//     /start_profile, /stop_profile) accept only AdminAPIKey when it is set
//     (and that key also opens every other route); otherwise they fall under
//     the normal rule, so with no keys configured at all they are open, as
//     in the Rust router.
//  5. access log and metrics: one info line per request when the handler
//     returns (request id, method, route, status, duration, bytes, ttft for
//     streams, worker or prefill/decode from the route receipt); probes log
//     at debug. Nothing per chunk. RequestsTotal, HTTPRequests, InFlight,
//     RequestDuration (at the last body byte) and RequestErrors for the
//     errors the server itself produces (the dispatchers count theirs and
//     own the TTFT histogram).
//  6. body limit (§6.11): a Content-Length above MaxPayloadSize is refused
//     with 413 at once; every body is wrapped in http.MaxBytesReader.
//     Bodies the server reads (generation routes, POST /workers) and chunked
//     bodies headed for Passthrough are read in full within BodyReadTimeout,
//     so an oversized chunked body is a 413 from here, never an upstream
//     error. A body not received in time is a 408 (body_read_timeout) with
//     Connection: close; the connection is closed after a short linger.
//
// The chain uses a single ResponseWriter wrapper; it implements Flush,
// FlushError and Unwrap so http.ResponseController flushes SSE chunks and
// sets deadlines through it.
//
// # Generation routes
//
// POST /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/responses,
// /generate, /inference/v1/generate, /v1/rerank and /rerank: the body is
// read (413 over the limit), parsed with rawjson.Parse (400 naming the
// problem and its offset; 400 when not an object), an admission slot is
// taken, and a proxy.Call (Route = the pattern path, Stream from
// "stream": true, RequestID, Receipt) goes to Options.Generate. In PD mode
// /v1/embeddings, /v1/rerank and /rerank are not disaggregated (there is no
// decode phase to split off): they go to Passthrough, which the app points
// at the prefill workers.
//
// # Admission
//
// internal/admission: MaxConcurrent slots held until the dispatcher returns
// (the end of the stream), a FIFO queue of QueueSize waiting at most
// QueueTimeout (429 when full, 408 on timeout, nothing written when the
// client left), and an independent token-bucket RateLimitPerSecond (429).
// Only the generation routes are admission-controlled.
//
// # Route receipt
//
// With RouteReceipt, generation responses carry x-switchyard-route, e.g.
// "mode=pd; policy=consistent_hash; prefill=http://p:8000; decode=http://d:8000; attempts=1; reason=hash owner".
// Dispatchers fill Call.Receipt before writing headers; the wrapper renders
// it at WriteHeader.
//
// # Other routes
//
// See the route table in routes.go. Unknown paths go to Passthrough in
// regular mode; in PD mode an unknown GET/HEAD is a 404 JSON error and other
// methods go to Passthrough. A known path with the wrong method is 405 with
// an Allow header. GET /v1/models is the union (deduplicated by id) of every
// healthy instance's list, decode workers first in PD mode.
// /get_model_info is relayed from the first healthy worker (decode first in
// PD). /health_generate sends GET /health to the pair (or worker) a request
// would use; it never runs a generation on a decode worker.
//
// # Timeouts and shutdown
//
// The router's client listener is served by internal/h1server
// (--http-server builtin, the default; Options.BuiltinHTTP) or net/http's
// Server, with ReadHeaderTimeout, IdleTimeout and
// MaxHeaderBytes but no WriteTimeout or ReadTimeout, so streams of any
// length survive. Serve
// stops accepting when its context ends, rejects queued admissions (503),
// lets in-flight requests finish for ShutdownTimeout, then cancels their
// contexts (dispatchers end streams with an SSE error event), waits a short
// grace for the handlers and closes every connection.
package server
