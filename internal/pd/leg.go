package pd

import (
	"context"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// leg tracks one upstream call: breaker outcome, in-flight slot (and its
// gauges) and the leg's client span.
type leg struct {
	name    string
	w       *worker.Worker
	ticket  worker.Ticket        // the breaker's
	panicF  func(worker.Outcome) // instead of ticket: panic routing's outcome
	slot    worker.Slot          // the worker's in-flight count
	sent    time.Time
	once    sync.Once // slot, gauges, span
	outOnce sync.Once // breaker outcome
	// holdOK: a success passed to finish/end is not recorded; settle records
	// the outcome later. The prefill of a concurrent connector has done its
	// job only once its KV reached the decode (D's first byte).
	holdOK bool
	warmup bool // a pair warm-up's leg: its connect failure is no health verdict

	running, inflight prometheus.Gauge // per-worker and per-role in-flight gauges (nil without metrics)
	m                 *metrics.Metrics // circuit-breaker outcomes (nil without metrics)
	span              trace.Span       // nil when tracing is off
}

// finish records the leg's breaker outcome, releases its in-flight slot and
// ends its span; only the first call counts.
func (l *leg) finish(success bool) {
	if success {
		l.end(worker.OutcomeSuccess)
	} else {
		l.end(worker.OutcomeFailure)
	}
}

// end releases the leg's in-flight slot and ends its span (first call only)
// and records o on the breaker, unless o is a success held by holdOK.
func (l *leg) end(o worker.Outcome) {
	l.once.Do(func() {
		l.slot.Release()
		if l.running != nil {
			l.running.Dec()
			l.inflight.Dec()
		}
		if l.span != nil {
			l.span.End()
		}
	})
	if o == worker.OutcomeSuccess && l.holdOK {
		return
	}
	l.settle(o)
}

// settle records the leg's breaker outcome; only the first call counts.
// Neutral outcomes are not counted in the outcome metric (the breaker
// records nothing for them).
func (l *leg) settle(o worker.Outcome) {
	l.outOnce.Do(func() {
		if l.panicF != nil {
			l.panicF(o)
		} else {
			l.ticket.Finish(o)
		}
		if l.m != nil && o != worker.OutcomeNeutral {
			l.m.Outcome(l.w.Key(), o == worker.OutcomeSuccess).Inc()
		}
	})
}

// startLeg reserves the breaker slot and the in-flight count of w, and
// starts the leg's client span (child of the server span in ctx).
func (e *Engine) startLeg(ctx context.Context, name string, w *worker.Worker, st *reqState, pr *Pair) (*leg, bool) {
	ticket, ok := w.Breaker().Begin()
	var panicF func(worker.Outcome)
	if !ok && st.panicked { // panic routing overrides the breaker
		panicF, ok = w.PanicOutcome(), true
	}
	if !ok {
		return nil, false
	}
	l := &leg{name: name, w: w, ticket: ticket, panicF: panicF, sent: e.o.Now(), warmup: st.warmup}
	l.slot.Start(w, false)
	if e.m != nil {
		key := w.Key()
		e.m.PDLegRequests(key, name == "prefill").Inc()
		l.running = e.m.Running(key)
		l.inflight = e.inflightPrefill
		if name != "prefill" {
			l.inflight = e.inflightDecode
		}
		l.m = e.m
		l.running.Inc()
		l.inflight.Inc()
	}
	if e.tr.Enabled() {
		e.traceLeg(ctx, l, st, pr)
	}
	return l, true
}

// traceLeg starts l's client span with the PD attributes.
func (e *Engine) traceLeg(ctx context.Context, l *leg, st *reqState, pr *Pair) {
	rank := pr.PRank
	if l.w == pr.D {
		rank = pr.DRank
	}
	if rank < 0 && l.w.DPRank >= 0 {
		rank = l.w.DPRank
	}
	l.span = e.tr.StartClient(ctx, tracing.Leg{Phase: l.name, Method: http.MethodPost, URL: l.w.Endpoint(st.path),
		Route: st.route, Worker: l.w.Key(), DPRank: rank})
	if !l.span.IsRecording() {
		return
	}
	attrs := make([]attribute.KeyValue, 0, 6)
	attrs = append(attrs,
		attribute.String(tracing.AttrConnector, e.conn.Name()),
		attribute.String(tracing.AttrOrder, e.conn.Order(pr.P).String()),
		attribute.String(tracing.AttrPDRequestID, pr.RequestID),
		attribute.Int(tracing.AttrAttempt, st.attempt),
	)
	if m := pr.P.TransferMode; m != "" {
		attrs = append(attrs, attribute.String(tracing.AttrTransferMode, strings.ToUpper(m)))
	}
	if pr.TransferID != "" {
		attrs = append(attrs, attribute.String(tracing.AttrTransferID, pr.TransferID))
	}
	l.span.SetAttributes(attrs...)
}

// legFailed records a failed leg: breaker failure, passive health on
// connect errors, error metrics, span status. A first connect failure is a
// hint (the worker is avoided and probed at once), a second within
// worker.ConnectHintWindow marks it unhealthy (Registry.ConnectFailed); a
// warm-up's connect failure is neither.
func (e *Engine) legFailed(l *leg, reason string, err error) {
	tracing.Fail(l.span, reason, err)
	l.finish(false)
	if err != nil && proxy.IsDialError(err) {
		if !l.warmup {
			for _, x := range e.o.Registry.ConnectFailed(l.w, time.Now()) {
				e.log.Warn("worker unreachable (second connect failure), marked unhealthy", "worker", x.Key(), "err", err)
				if e.m != nil {
					e.m.WorkerHealth.WithLabelValues(x.Key()).Set(0)
				}
			}
		}
		e.markDown(l.w)
	}
	if e.m != nil {
		if l.name == "prefill" {
			e.m.PDPrefillErrors.WithLabelValues(l.w.Key()).Inc()
		} else {
			e.m.PDDecodeErrors.WithLabelValues(l.w.Key()).Inc()
		}
		e.m.PDLegErrors.WithLabelValues(l.name, reason).Inc()
	}
}

// newLegRequest builds one upstream POST with the PD headers. The client's
// own X-Request-Id is never forwarded. The client's traceparent, tracestate
// and baggage are copied verbatim, or replaced by the leg span's context
// when tracing is on. An attempt's two legs share one header map (hs)
// when they would build the same one: no span of their own, one rank.
func (e *Engine) newLegRequest(ctx context.Context, st *reqState, pr *Pair, l *leg, rank int, body rawjson.Spliced, hs *legHeaders) (*http.Request, error) {
	rt := e.directTransport()
	if rt == nil {
		hs = nil // http.Client.Do may write to a request's header (a cookie jar's cookies)
	}
	h := hs.get(l, rank)
	if h == nil {
		h = e.legHeader(ctx, st, pr, l, rank)
		hs.keep(l, rank, h)
	}
	lb := &legBody{s: body}
	req, err := proxy.NewUpstreamRequest(ctx, http.MethodPost, l.w, st.path, h, lb, int64(body.Len()))
	if err != nil {
		return nil, err
	}
	if body.Len() == 0 {
		req.Body = http.NoBody
	} else if rt == nil || proxy.RewindsBody(rt, req) {
		req.GetBody = lb.again // a redirect through Do, or net/http's resend
	}
	return req, nil
}

// legHeader builds a leg's header map.
func (e *Engine) legHeader(ctx context.Context, st *reqState, pr *Pair, l *leg, rank int) http.Header {
	h := make(http.Header, 8)
	// The single-valued headers share one array (capacity-capped slices:
	// an Add to one cannot reach the next).
	v := &[4]string{"application/json", pr.RequestID, "switchyard", st.auth}
	h["Content-Type"] = v[0:1:1]
	h["X-Request-Id"] = v[1:2:2]
	if rank >= 0 {
		h["X-data-parallel-rank"] = []string{strconv.Itoa(rank)}
	}
	if st.auth != "" {
		h["Authorization"] = v[3:4:4]
	}
	for _, k := range []string{"Traceparent", "Tracestate", "Baggage"} {
		if v := st.hdr.Values(k); len(v) > 0 {
			h[k] = append([]string(nil), v...)
		}
	}
	if l.span != nil {
		e.tr.Inject(ctx, l.span, h)
	}
	h["User-Agent"] = v[2:3:3]
	return h
}

// legHeaders is the header map an attempt's first leg built, for its
// second: a transport called directly only reads a request's header, so
// the two requests can hold one map. A nil *legHeaders shares nothing.
type legHeaders struct {
	h    http.Header
	rank int
}

// get returns the kept map when it is the one l would build (nil else).
func (hs *legHeaders) get(l *leg, rank int) http.Header {
	if hs == nil || hs.h == nil || l.span != nil || hs.rank != rank {
		return nil
	}
	return hs.h
}

// keep keeps the first leg's map unless it carries the leg's own span.
func (hs *legHeaders) keep(l *leg, rank int, h http.Header) {
	if hs != nil && hs.h == nil && l.span == nil {
		hs.h, hs.rank = h, rank
	}
}

// directTransport is the round tripper do sends legs to, or nil when they
// go through e.o.Client.Do (a client with a timeout, a cookie jar or a
// redirect policy).
func (e *Engine) directTransport() http.RoundTripper {
	c := e.o.Client
	if c.Timeout != 0 || c.Jar != nil || c.CheckRedirect != nil {
		return nil
	}
	if c.Transport == nil {
		return http.DefaultTransport
	}
	return c.Transport
}

// legBody is a leg's request body: the client's body with the leg's edits,
// as pieces (rawjson.Spliced) that alias the client's body, which the
// request holds anyway, and the edits' values. So a leg holds no copy of
// the prompt, however long it waits for its answer (a prefill queued
// behind others, a decode waiting for its KV cache; at thousands of open
// streams with long prompts such copies added up, docs/BENCHMARKS.md,
// section 3), and the transport copies the prompt once, into its write
// buffer. Each attempt and a continuation build their bodies anew.
type legBody struct {
	mu     sync.Mutex
	s      rawjson.Spliced
	part   int // the piece being read
	off    int // in it
	closed bool
}

func (lb *legBody) Read(p []byte) (int, error) {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	if lb.closed {
		return 0, io.EOF
	}
	n := 0
	for n < len(p) && lb.part < lb.s.NumParts() {
		piece := lb.s.Part(lb.part)
		c := copy(p[n:], piece[lb.off:])
		n += c
		if lb.off += c; lb.off == len(piece) {
			lb.part, lb.off = lb.part+1, 0
		}
	}
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

func (lb *legBody) Close() error {
	lb.mu.Lock()
	lb.closed = true
	lb.mu.Unlock()
	return nil
}

// Resendable makes legBody a proxy.ResendableBody: it can be resent while
// unread (its pieces stay; they cost no copy of the prompt).
func (lb *legBody) Resendable() bool {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	return !lb.closed && lb.part == 0 && lb.off == 0
}

// Reopen is the body again, unread, whether or not this one was closed.
func (lb *legBody) Reopen() io.ReadCloser { return &legBody{s: lb.s} }

// again is the request's GetBody.
func (lb *legBody) again() (io.ReadCloser, error) { return lb.Reopen(), nil }

// do sends a leg's request: e.o.Client.Do without the client's redirect
// bookkeeping (a copy of the header and the URL per request). A leg never
// follows a redirect (a worker's 3xx fails the leg like any other non-2xx
// answer); an error is wrapped as the client wraps it (*url.Error), so it
// reads the same. A client with a timeout, a cookie jar or a redirect
// policy goes through Do.
func (e *Engine) do(req *http.Request) (*http.Response, error) {
	rt := e.directTransport()
	if rt == nil {
		return e.o.Client.Do(req)
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		op := req.Method[:1] + strings.ToLower(req.Method[1:])
		return nil, &url.Error{Op: op, URL: req.URL.String(), Err: err}
	}
	return resp, nil
}
