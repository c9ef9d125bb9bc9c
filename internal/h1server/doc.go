// Package h1server is the router's client-facing HTTP/1.1 server: it serves
// an http.Handler on a listener with one goroutine per connection and no
// per-connection buffers while a connection waits.
//
// # Why not net/http
//
// net/http's Server starts a "background read" goroutine per request to
// notice a client that goes away, and keeps a 4 KiB bufio.Reader and a 4 KiB
// bufio.Writer (plus 2 KiB per response) for each connection's whole life.
// With thousands of open LLM streams that is ~10 KiB and an extra goroutine
// per stream spent on waiting.
//
// # Fast path and fallback
//
// The connection's goroutine reads a request head itself and serves it on
// the fast path only when it is a plain request: "METHOD SP origin-form SP
// HTTP/1.x", CRLF line ends, token header names, values without control
// bytes, no obs-fold, a head within MaxHeaderBytes and within one 4 KiB read
// buffer, no body or exactly one Content-Length, no Transfer-Encoding,
// Expect or Upgrade (nor "Connection: upgrade"), one Host (required for
// HTTP/1.1, with a conservative character set), not CONNECT or PRI.
// Anything else, malformed input included, is handed at that request
// boundary, with the bytes already read, to an internal net/http.Server
// through an in-memory listener; net/http owns that connection from then
// on and answers as it always does (400, 431, 505, 100-continue, chunked
// bodies, ...). Responses follow net/http's rules (status line, Date,
// sniffed Content-Type, Content-Length when the whole body is buffered at
// the end, else chunking with net/http's 2 KiB chunk policy, HEAD, 1xx,
// 204/304, trailers, keep-alive and close decisions, discarding up to
// 256 KiB of an unread request body).
//
// # Disconnect detection
//
// Instead of a background read: once the request body has been read to its
// end, a timer fires after 10 ms (a request answered sooner costs nothing
// more). On Linux it then puts the connection's descriptor into an epoll set
// of the server's (EPOLLRDHUP, one-shot: the peer's close or reset, not its
// data), waited on by one goroutine per server (fdpoll), where it stays
// until the connection closes: the connection's later requests are watched
// with no timer and no system call. Elsewhere, and on a connection whose
// hangup was reported while no request was watched, the timer keeps peeking
// with doubling backoff capped at 200 ms (watch.go). Either way the verdict
// is a peek (recvfrom MSG_PEEK|MSG_DONTWAIT, never blocking): EOF or a
// connection error cancels the request's context (context.Canceled); a
// pipelined request stops the watch. Connections that are not syscall.Conn
// get no watch.
//
// # Request contexts
//
// A fast-path request's context is allocated with its response (reqctx.go)
// instead of net/http's cancelCtx per request. Besides context.Context it
// takes in place, without an allocation, what the router's request would
// otherwise add as children: one value (SetValue), the request's deadline
// (TightenDeadline, timed by one timer per connection) and one abort hook
// run when the context ends (HookAbort, the upstream connection's close).
// Children made with the context package follow it through its AfterFunc
// method; context.Cause of it is its Err, and a client that went away is
// context.Canceled, as the end of the handler is.
//
// # Buffers
//
// The 4 KiB read buffer comes from a sync.Pool only for a read that finds
// bytes (a waiting connection tries a non-blocking read into a pooled
// buffer, gives the buffer back when nothing has arrived and parks in the
// poller), and goes back whenever nothing is buffered: between requests and once a
// request body has been read. The write buffers (8 KiB framed output plus
// 2 KiB of unframed body, as net/http's response buffer) are taken by the
// first write and given back after each flush that leaves nothing pending,
// so a stream waiting between events holds neither.
//
// # Gaps
//
// ReadTimeout and WriteTimeout do not exist; IdleTimeout 0 means
// ReadHeaderTimeout (net/http falls back to ReadTimeout), on both paths. The
// ResponseWriter implements neither http.CloseNotifier nor io.ReaderFrom, and
// http.MaxBytesReader cannot mark the connection for closing (it is
// net/http's private interface): a body left unread past the limit is
// discarded or the connection closed by the usual 256 KiB rule. A
// connection without a file descriptor (not a syscall.Conn) keeps its read
// buffer while idle and gets no disconnect watch; as with net/http's
// background read, the watch starts only once the request body has been
// read to its end. A head handed off part way through restarts
// ReadHeaderTimeout in net/http, and its replayed bytes count against
// net/http's (approximate: MaxHeaderBytes plus 4 KiB of slack) head limit,
// so a pipelined head just over MaxHeaderBytes may get 431 where a direct
// net/http connection, having buffered part of it, would accept it. TLS is
// not handled.
package h1server
