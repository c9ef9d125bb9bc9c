package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/tracing"
)

// reqState is the per-request record the middleware and handlers share.
type reqState struct {
	id      string
	idv     [1]string // id, as the response header's value (no allocation of its own)
	route   routeInfo
	start   time.Time
	call    *proxy.Call // generation requests only
	errType string      // set when the router itself produced an error
	logOnly int         // status for the log when nothing was written (499)
	span    trace.Span  // server span (nil when tracing is off or the path is excluded)
}

// The request's state is its context's proxy.CallCarrier: one context
// value serves stateFrom and proxy.CallFrom.
func stateFrom(ctx context.Context) *reqState {
	st, _ := proxy.CarrierFrom(ctx).(*reqState)
	return st
}

// ProxyCall implements proxy.CallCarrier.
func (st *reqState) ProxyCall() *proxy.Call { return st.call }

// RequestID returns the request id the middleware assigned (or "" outside
// the server's handler chain). Passthrough handlers may forward it.
func RequestID(ctx context.Context) string {
	if st := stateFrom(ctx); st != nil {
		return st.id
	}
	return ""
}

// serveHTTP is the whole middleware chain, in order: recover → request id →
// CORS → auth → access log/metrics → body limit → mux. Keeping it one
// function means one ResponseWriter wrapper and one context per request.
func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	st, rw := s.newRequestState(w, r)
	s.active.inc()
	defer s.active.dec()
	defer s.recoverPanic(rw, r)

	r, answered := s.beginRequest(w, r, st)
	if answered {
		return
	}

	defer func(r *http.Request) {
		v := recover()
		defer s.finish(rw, r) // also when onPanic re-panics to abort the connection
		if v != nil {
			s.onPanic(rw, r, v)
		}
	}(r)

	if !s.admitRequest(w, rw, r, st) {
		return
	}
	if st.route.kind == kindGenerate && r.URL.Path == st.route.label {
		// classify matched a generation route's pattern with the path as
		// it is (not one the mux redirects to its clean form): its handler
		// is this one, which the mux would look up a second time.
		s.handleGenerate(rw, r)
		return
	}
	s.mux.ServeHTTP(rw, r)
}

// newRequestState returns the request's state and its ResponseWriter
// wrapper, which live and die together: one allocation for both.
func (s *Server) newRequestState(w http.ResponseWriter, r *http.Request) (*reqState, *respWriter) {
	pair := &struct {
		st reqState
		rw respWriter
	}{st: reqState{start: time.Now(), route: s.classify(r)}}
	st, rw := &pair.st, &pair.rw
	*rw = respWriter{ResponseWriter: w, s: s, st: st}
	return st, rw
}

// beginRequest sets the request id, answers a CORS preflight (answered)
// and returns r with the request's context (its state, the server span).
// It and admitRequest are serveHTTP's steps in frames of their own: while
// a response is relayed only serveHTTP's stays on the stack, below the
// deep first flush (docs/BENCHMARKS.md, section 3).
func (s *Server) beginRequest(w http.ResponseWriter, r *http.Request, st *reqState) (_ *http.Request, answered bool) {
	// request id
	st.id = s.requestID(r)
	st.idv[0] = st.id
	w.Header()["X-Request-Id"] = st.idv[:1:1]

	// CORS (answers preflights itself)
	if s.cors.apply(w, r) {
		w.WriteHeader(http.StatusNoContent)
		return r, true
	}

	ctx := r.Context()
	if s.tr.Enabled() {
		ctx, st.span = s.tr.StartServer(r, st.route.spanRoute())
	}
	if cctx := proxy.WithCallCarrier(ctx, st); cctx != r.Context() {
		r = r.WithContext(cctx) // else the request's own context took it in place
	}

	// auth and everything after it are logged and measured (serveHTTP's
	// deferred finish)
	s.requestsTotalFor(st.route.label).Inc()
	s.inFlight.Inc()
	return r, false
}

// admitRequest authorizes the request and bounds its body; false when it
// answered the request.
func (s *Server) admitRequest(w http.ResponseWriter, rw *respWriter, r *http.Request, st *reqState) bool {
	if !s.authorize(rw, r, st.route.access) {
		return false
	}

	// body limit
	if r.ContentLength > s.o.MaxPayloadSize {
		s.writeError(rw, r, http.StatusRequestEntityTooLarge, "payload_too_large", tooLargeMessage(s.o.MaxPayloadSize))
		return false
	}
	// A body of declared length ends there (the server reads no further,
	// and the length was checked above): only one of unknown length needs
	// the limit on its reads.
	if r.Body != nil && r.Body != http.NoBody && r.ContentLength < 0 {
		r.Body = http.MaxBytesReader(w, r.Body, s.o.MaxPayloadSize)
	}
	return true
}

func tooLargeMessage(limit int64) string {
	return fmt.Sprintf("Request body is too large: the limit is %d bytes", limit)
}

// recoverPanic is the outermost recover, for panics before the access-log
// section of the chain.
func (s *Server) recoverPanic(rw *respWriter, r *http.Request) {
	if v := recover(); v != nil {
		s.onPanic(rw, r, v)
	}
}

// onPanic turns a handler panic into a 500 (when nothing was written yet)
// or an aborted connection. http.ErrAbortHandler passes through.
func (s *Server) onPanic(rw *respWriter, r *http.Request, v any) {
	if v == http.ErrAbortHandler { //nolint:errorlint // sentinel value, not a wrapped error
		panic(v)
	}
	s.log.Error("panic serving request", "request_id", rw.st.id, "method", r.Method, "path", r.URL.Path,
		"panic", fmt.Sprint(v), "stack", string(debug.Stack()))
	if rw.wroteHeader {
		panic(http.ErrAbortHandler)
	}
	rw.st.errType = "panic"
	openai.WriteError(rw, http.StatusInternalServerError, "internal server error")
}

// finish records the access log line and the end-of-request metrics. It
// runs when the handler returns, i.e. after the last body byte.
func (s *Server) finish(rw *respWriter, r *http.Request) {
	st := rw.st
	s.inFlight.Dec()
	status := rw.status
	switch {
	case !rw.wroteHeader && st.logOnly != 0:
		status = st.logOnly
	case !rw.wroteHeader:
		status = http.StatusOK // net/http sends 200 for an empty handler
	}
	dur := time.Since(st.start)
	rm := s.reqMetricsFor(st.route.label, methodLabel(r.Method), status)
	rm.requests.Inc()
	rm.duration.Observe(dur.Seconds())
	if st.errType != "" {
		s.m.RequestErrors.WithLabelValues(st.route.label, st.errType).Inc()
	}
	if st.span != nil {
		tracing.EndServer(st.span, status, st.id, st.errType)
	}
	ctx := r.Context()
	if st.call != nil && st.call.Receipt != nil && s.log.Enabled(ctx, slog.LevelDebug) {
		s.logReceipt(ctx, st, status)
	}

	level := slog.LevelInfo
	if st.route.kind == kindProbe {
		level = slog.LevelDebug // k8s probes every few seconds would drown the log
	}
	if !s.log.Enabled(ctx, level) {
		return
	}
	attrs := make([]slog.Attr, 0, 15)
	attrs = append(attrs,
		slog.String("request_id", st.id),
		slog.String("method", r.Method),
		slog.String("route", st.route.label),
		slog.String("path", r.URL.Path),
		slog.Int("status", status),
		slog.Float64("duration_ms", ms(dur)),
		slog.Int64("bytes", rw.bytes),
	)
	if c := st.call; c != nil {
		if c.Stream && !rw.firstByte.IsZero() {
			attrs = append(attrs, slog.Float64("ttft_ms", ms(rw.firstByte.Sub(st.start))))
		}
		if rc := c.Receipt; rc != nil {
			if rc.Worker != "" {
				attrs = append(attrs, slog.String("worker", rc.Worker))
			}
			if rc.Prefill != "" || rc.Decode != "" {
				attrs = append(attrs, slog.String("prefill", rc.Prefill), slog.String("decode", rc.Decode))
			}
			if rc.Attempts > 0 {
				attrs = append(attrs, slog.Int("attempts", rc.Attempts))
			}
			if len(rc.Migrated) > 0 { // workers that served earlier parts of the answer
				attrs = append(attrs, slog.Any("migrated_from", rc.Migrated))
			}
		}
	}
	if st.errType != "" {
		attrs = append(attrs, slog.String("error", st.errType))
	}
	if st.span != nil {
		if sc := st.span.SpanContext(); sc.HasTraceID() {
			attrs = append(attrs, slog.String("trace_id", sc.TraceID().String()))
		}
	}
	s.log.LogAttrs(ctx, level, "request", attrs...)
}

// logReceipt is the per-request debug line of the route receipt: which
// worker (or prefill/decode pair) served the request, the policy and its
// reason, attempts and failovers. The caller checks the debug level.
func (s *Server) logReceipt(ctx context.Context, st *reqState, status int) {
	rc := st.call.Receipt
	attrs := make([]slog.Attr, 0, 12)
	attrs = append(attrs,
		slog.String("request_id", st.id),
		slog.String("route", st.route.label),
		slog.Int("status", status),
		slog.String("mode", rc.Mode),
		slog.String("policy", rc.Policy),
	)
	if rc.Worker != "" {
		attrs = append(attrs, slog.String("worker", rc.Worker))
	}
	if rc.Prefill != "" || rc.Decode != "" {
		attrs = append(attrs, slog.String("prefill", rc.Prefill), slog.String("decode", rc.Decode))
	}
	attrs = append(attrs,
		slog.String("reason", rc.Reason),
		slog.Int("attempts", rc.Attempts),
		slog.Int("failovers", len(rc.Failovers)),
	)
	if len(rc.Failovers) > 0 {
		attrs = append(attrs, slog.Any("failed", rc.Failovers))
	}
	if len(rc.Migrated) > 0 { // served earlier parts of the answer
		attrs = append(attrs, slog.Any("migrated_from", rc.Migrated))
	}
	s.log.LogAttrs(ctx, slog.LevelDebug, "route receipt", attrs...)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// methodLabel bounds the method label to the standard methods.
// requestsTotalFor is RequestsTotal's child for a route label.
func (s *Server) requestsTotalFor(route string) prometheus.Counter {
	if c, ok := s.requestsTotal.Load(route); ok {
		return c.(prometheus.Counter)
	}
	c := s.m.RequestsTotal.WithLabelValues(route)
	s.requestsTotal.Store(route, c)
	return c
}

// reqMetricsKey is one (route, method, status) of finished requests: a
// bounded set (fixed routes, methodLabel's ten methods, HTTP status codes).
type reqMetricsKey struct {
	route, method string
	status        int
}

// reqMetrics are HTTPRequests' and RequestDuration's children of one key.
type reqMetrics struct {
	requests prometheus.Counter
	duration prometheus.Observer
}

// reqMetricsFor returns the end-of-request metrics of a key, resolving the
// labels (and formatting the status code) only the first time.
func (s *Server) reqMetricsFor(route, method string, status int) reqMetrics {
	k := reqMetricsKey{route, method, status}
	if v, ok := s.reqMetrics.Load(k); ok {
		return v.(reqMetrics)
	}
	code, mode := metrics.Status(status), s.o.Mode
	v := reqMetrics{
		requests: s.m.HTTPRequests.WithLabelValues(route, method, code, mode),
		duration: s.m.RequestDuration.WithLabelValues(route, code, mode),
	}
	s.reqMetrics.Store(k, v)
	return v
}

func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return m
	}
	return "OTHER"
}

// writeError writes an OpenAI-style error and records the error type.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, status int, errType, msg string) {
	if st := stateFrom(r.Context()); st != nil {
		st.errType = errType
	}
	openai.WriteError(w, status, msg)
}

// bodyTimeoutLinger is how long a connection whose body read timed out is
// still drained after the 408 is sent, so that closing it does not reset
// the connection (TCP RST) before the client has read the response.
const bodyTimeoutLinger = 500 * time.Millisecond

// readBody reads the (already size-limited) body within BodyReadTimeout.
// It writes the error response itself and returns ok=false on failure.
//
// The deadline is the connection's read deadline (http.ResponseController;
// the respWriter chain unwraps to net/http's response). Two net/http
// behaviours shape the failure path:
//   - any read error, our deadline included, cancels the request context
//     (connReader.handleReadError), so a timeout must be recognised before
//     the context check that means "client gone";
//   - after the handler returns, net/http reads up to 256 KiB of unread
//     body (finishRequest → body.Close, and before the status line unless
//     the response closes the connection), with whatever read deadline is
//     on the connection. Clearing the deadline on failure let a client
//     that trickles its body hold the connection and the handler
//     goroutine indefinitely, without ever getting the 408.
//
// So the deadline is cleared only after a complete read; a failed read
// answers with "Connection: close" and leaves a deadline (a short linger
// after a timeout) that bounds net/http's drain, after which the
// connection is closed.
// readAll reads a request body to its EOF. With a known Content-Length
// (within limit) it reads into one exactly-sized buffer: bytes.Buffer's
// ReadFrom wants 512 spare bytes and so regrew (and copied) even a buffer
// grown to the declared length. Reading on to EOF, not just n bytes, keeps
// net/http's end-of-body handling (its background read starts there).
func readAll(body io.Reader, n, limit int64) ([]byte, error) {
	if n <= 0 || n > limit {
		var buf bytes.Buffer
		_, err := buf.ReadFrom(body)
		return buf.Bytes(), err
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(body, b); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF // a Content-Length body that ended early
		}
		return nil, err
	}
	var one [1]byte
	switch m, err := body.Read(one[:]); {
	case m > 0:
		return nil, errors.New("request body longer than its Content-Length")
	case err == nil:
		// A reader may return (0, nil): read on, bounded by ReadFrom's own
		// loop over a tiny buffer.
		var rest bytes.Buffer
		if _, err := rest.ReadFrom(body); err != nil {
			return nil, err
		}
		if rest.Len() > 0 {
			return nil, errors.New("request body longer than its Content-Length")
		}
	case !errors.Is(err, io.EOF):
		return nil, err
	}
	return b, nil
}

func (s *Server) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	// A body that arrived with its head (h1server's, most requests) is
	// read from memory: no deadline to set and clear.
	deadline := s.o.BodyReadTimeout > 0 && !arrived(r.Body)
	var rc *http.ResponseController
	if deadline {
		rc = http.NewResponseController(w)
		if err := rc.SetReadDeadline(time.Now().Add(s.o.BodyReadTimeout)); err != nil {
			// Only a ResponseWriter chain that cannot reach the connection
			// gets here: the body read is then unbounded.
			deadline = false
			if !s.deadlineWarned.Swap(true) {
				s.log.Warn("cannot set the request body read deadline: body reads are not bounded by the body read timeout",
					"error", err.Error(), "route", stateFrom(r.Context()).route.label, "body_read_timeout", s.o.BodyReadTimeout)
			}
		}
	}
	body, err := readAll(r.Body, r.ContentLength, s.o.MaxPayloadSize)
	if err == nil {
		// Closed at its end, the body is done with for net/http: the
		// response's first write no longer tries to discard what is left
		// of it (an io.CopyN to io.Discard whose call chain, at the bottom
		// of a relay, doubled the request goroutine's stack for the rest of
		// a stream's life: docs/BENCHMARKS.md, section 3).
		_ = r.Body.Close()
		if deadline {
			// A deadline left on the connection would fire during a long
			// stream and cancel the request (net/http's background read,
			// started at the body's EOF, cleared it already; this is for
			// the case it has not started).
			_ = rc.SetReadDeadline(time.Time{})
		}
		return body, true
	}
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		// net/http closes the connection after the 413 (requestTooLarge).
		s.writeError(w, r, http.StatusRequestEntityTooLarge, "payload_too_large", tooLargeMessage(tooBig.Limit))
	case deadline && isTimeout(err):
		// Checked before the context: the timeout cancelled it too.
		_ = rc.SetReadDeadline(time.Now().Add(min(bodyTimeoutLinger, s.o.BodyReadTimeout)))
		w.Header().Set("Connection", "close")
		s.writeError(w, r, http.StatusRequestTimeout, "body_read_timeout",
			fmt.Sprintf("timed out reading the request body: it was not received within %v", s.o.BodyReadTimeout))
	case r.Context().Err() != nil:
		stateFrom(r.Context()).logOnly = 499 // the client went away
	default:
		w.Header().Set("Connection", "close") // the rest of the stream is not a request
		s.writeError(w, r, http.StatusBadRequest, "body_read_error", "failed to read the request body: "+err.Error())
	}
	return nil, false
}

// arrived reports whether the rest of body is in memory already (a read
// of it cannot wait on the client).
func arrived(body io.Reader) bool {
	a, ok := body.(interface{ Arrived() bool })
	return ok && a.Arrived()
}

func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}

// bufferUnsizedBody reads a chunked body (unknown length) into memory so the
// size limit is enforced here with a 413 rather than surfacing as an upstream
// error inside the proxy. Bodies with a Content-Length were checked already
// and stream through.
func (s *Server) bufferUnsizedBody(w http.ResponseWriter, r *http.Request) bool {
	if r.ContentLength >= 0 || r.Body == nil || r.Body == http.NoBody {
		return true
	}
	body, ok := s.readBody(w, r)
	if !ok {
		return false
	}
	setBody(r, body)
	return true
}

// setBody replaces r's body with b (replayable through GetBody).
func setBody(r *http.Request, b []byte) {
	r.Body = io.NopCloser(bytes.NewReader(b))
	r.ContentLength = int64(len(b))
	r.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	r.TransferEncoding = nil
	r.Header.Set("Content-Length", strconv.Itoa(len(b)))
}

// respWriter records status, bytes and first-byte time, and stamps the
// request id and route receipt headers when the status line is written.
// It implements Flush and Unwrap so http.ResponseController (SSE flushes,
// deadlines, hijack) reaches the real writer.
type respWriter struct {
	http.ResponseWriter
	s           *Server
	st          *reqState
	status      int
	wroteHeader bool
	bytes       int64
	firstByte   time.Time
}

func (w *respWriter) WriteHeader(code int) {
	if w.wroteHeader {
		return
	}
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		w.ResponseWriter.WriteHeader(code) // informational; the final status follows
		return
	}
	w.wroteHeader = true
	w.status = code
	h := w.ResponseWriter.Header()
	h["X-Request-Id"] = w.st.idv[:1:1] // upstream headers copied over ours must not win
	if c := w.st.call; c != nil && c.Receipt != nil && w.s.o.RouteReceipt {
		if v := receiptHeader(c.Receipt); v != "" {
			h.Set("X-Switchyard-Route", v)
		}
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *respWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(p)
	w.bytes += int64(n)
	if n > 0 && w.firstByte.IsZero() {
		w.firstByte = time.Now() // for the access log; the dispatchers own the TTFT metric
	}
	return n, err
}

// FlushError is what http.ResponseController.Flush calls.
func (w *respWriter) FlushError() error {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if f, ok := w.ResponseWriter.(interface{ FlushError() error }); ok {
		return f.FlushError() // directly: one frame less on the deep first flush
	}
	return proxy.FlushNext(w.ResponseWriter)
}

func (w *respWriter) Flush() { _ = w.FlushError() }

func (w *respWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// receiptHeader renders a compact x-switchyard-route value.
func receiptHeader(rc *proxy.Receipt) string {
	var b strings.Builder
	add := func(k, v string) {
		if v == "" {
			return
		}
		if b.Len() > 0 {
			b.WriteString("; ")
		}
		b.WriteString(k)
		b.WriteByte('=')
		b.WriteString(headerSafe(v))
	}
	add("mode", rc.Mode)
	add("policy", rc.Policy)
	add("worker", rc.Worker)
	add("prefill", rc.Prefill)
	add("decode", rc.Decode)
	if rc.Attempts > 0 {
		add("attempts", strconv.Itoa(rc.Attempts))
	}
	if len(rc.Failovers) > 0 {
		add("failovers", strings.Join(rc.Failovers, ","))
	}
	add("reason", rc.Reason)
	return b.String()
}

// headerSafe keeps a receipt value to printable ASCII without the ';'
// separator.
func headerSafe(v string) string {
	ok := true
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c > 0x7e || c == ';' {
			ok = false
			break
		}
	}
	if ok {
		return v
	}
	b := []byte(v)
	for i, c := range b {
		switch {
		case c == ';':
			b[i] = ','
		case c < 0x20 || c > 0x7e:
			b[i] = '?'
		}
	}
	return string(b)
}
