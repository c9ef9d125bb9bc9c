package pd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

const (
	maxPrefillBody = 64 << 20 // P's JSON (prompt_logprobs can be large)
	maxErrorBody   = 64 << 10 // upstream error bodies kept for the client
	maxMergeBody   = 256 << 20
)

// failure is why an attempt ended before anything reached the client.
type failure struct {
	leg     string // "prefill" | "decode" | ""
	reason  string // metric label: connect, timeout, status, bad_response, no_params, kv_wait_timeout, ...
	w       *worker.Worker
	status  int
	msg     string
	retry   bool // another pair may succeed
	errType string
	relay   *buffered // upstream error response to relay instead of msg

	// pair: the KV transfer between P and D failed (KV-wait timeout); the
	// fault is the pair's unless blameP/blameD name a side (pairHealth.failed).
	pair, blameP, blameD bool
}

// buffered is a small upstream response kept in memory.
type buffered struct {
	status int
	header http.Header
	body   []byte
}

// leg tracks one upstream call: breaker outcome, in-flight slot (and its
// gauges) and the leg's client span.
type leg struct {
	name    string
	w       *worker.Worker
	done    func(worker.Outcome)
	release func()
	sent    time.Time
	once    sync.Once // slot, gauges, span
	outOnce sync.Once // breaker outcome
	// holdOK: a success passed to finish/end is not recorded; settle records
	// the outcome later. The prefill of a concurrent connector has done its
	// job only once its KV reached the decode (D's first byte).
	holdOK bool
	warmup bool // a pair warm-up's leg: its connect failure is no health verdict

	running, inflight prometheus.Gauge       // per-worker and per-role in-flight gauges (nil without metrics)
	outcomes          *prometheus.CounterVec // circuit-breaker outcomes (nil without metrics)
	span              trace.Span             // nil when tracing is off
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
		l.release()
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
		l.done(o)
		if l.outcomes != nil && o != worker.OutcomeNeutral {
			l.outcomes.WithLabelValues(l.w.Key(), o.String()).Inc()
		}
	})
}

// startLeg reserves the breaker slot and the in-flight count of w, and
// starts the leg's client span (child of the server span in ctx).
func (e *Engine) startLeg(ctx context.Context, name string, w *worker.Worker, st *reqState, pr *Pair) (*leg, bool) {
	done, ok := w.Breaker().StartOutcome()
	if !ok && st.panicked { // panic routing overrides the breaker
		done, ok = w.PanicOutcome(), true
	}
	if !ok {
		return nil, false
	}
	l := &leg{name: name, w: w, done: done, release: w.Acquire(), sent: e.o.Now(), warmup: st.warmup}
	if e.m != nil {
		key := w.Key()
		if name == "prefill" {
			e.m.PDPrefillReqs.WithLabelValues(key).Inc()
		} else {
			e.m.PDDecodeReqs.WithLabelValues(key).Inc()
		}
		l.running = e.m.RunningRequests.WithLabelValues(key)
		l.inflight = e.m.WorkerInFlight.WithLabelValues(name)
		l.outcomes = e.m.CBOutcomes
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
// when tracing is on.
func (e *Engine) newLegRequest(ctx context.Context, st *reqState, pr *Pair, l *leg, rank int, body []byte) (*http.Request, error) {
	w := l.w
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.Endpoint(st.path), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	h := req.Header
	h.Set("Content-Type", "application/json")
	h.Set("X-Request-Id", pr.RequestID)
	if rank >= 0 {
		h["X-data-parallel-rank"] = []string{strconv.Itoa(rank)}
	}
	if st.auth != "" {
		h.Set("Authorization", st.auth)
	}
	for _, k := range []string{"Traceparent", "Tracestate", "Baggage"} {
		if v := st.hdr.Values(k); len(v) > 0 {
			h[k] = append([]string(nil), v...)
		}
	}
	if l.span != nil {
		e.tr.Inject(ctx, l.span, h)
	}
	h.Set("User-Agent", "switchyard")
	return req, nil
}

// prefillOut is the outcome of the prefill leg.
type prefillOut struct {
	body   []byte
	params []byte // raw kv_transfer_params of P's response (nil = absent)
	fail   *failure
	dur    time.Duration
}

// runPrefill sends the prefill, reads its whole body and checks it. It
// records the leg's outcome. ctx is the attempt's context (client and
// overall deadline), pctx the prefill's own (PrefillTimeout, or cancelled
// when the sibling failed).
func (e *Engine) runPrefill(ctx, pctx context.Context, st *reqState, pr *Pair, l *leg, body []byte) (out prefillOut) {
	who := "prefill worker " + pr.P.Key()
	defer func() { out.dur = e.o.Now().Sub(l.sent) }()
	classify := func(err error, during string) *failure {
		switch {
		case ctx.Err() != nil || (pctx.Err() == context.Canceled):
			// the client left, the request deadline passed, or the
			// sibling leg failed: not this worker's fault
			l.finish(true)
			return &failure{leg: "prefill", reason: "canceled", w: pr.P, status: proxy.StatusClientClosed, msg: who + ": canceled"}
		case pctx.Err() == context.DeadlineExceeded:
			e.legFailed(l, "timeout", err)
			return &failure{leg: "prefill", reason: "timeout", w: pr.P, status: http.StatusGatewayTimeout, retry: true,
				errType: "prefill_timeout", msg: fmt.Sprintf("%s did not complete the prefill within %s", who, e.o.PrefillTimeout)}
		case proxy.IsDialError(err):
			e.legFailed(l, "connect", err)
			return &failure{leg: "prefill", reason: "connect", w: pr.P, status: http.StatusBadGateway, retry: true,
				errType: "prefill", msg: fmt.Sprintf("%s unreachable: %v", who, unwrapURL(err))}
		}
		e.legFailed(l, "error", err)
		return &failure{leg: "prefill", reason: "error", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s failed %s: %v", who, during, unwrapURL(err))}
	}
	req, err := e.newLegRequest(pctx, st, pr, l, pr.PRank, body)
	if err != nil {
		e.legFailed(l, "error", err)
		return prefillOut{fail: &failure{leg: "prefill", reason: "error", w: pr.P, status: http.StatusBadGateway, retry: true, errType: "prefill", msg: who + ": " + err.Error()}}
	}
	resp, err := e.o.Client.Do(req)
	if err != nil {
		return prefillOut{fail: classify(err, "before answering")}
	}
	tracing.SetStatus(l.span, resp.StatusCode)
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxPrefillBody+1))
	resp.Body.Close()
	if err != nil {
		return prefillOut{fail: classify(err, "while sending its response")}
	}
	if resp.StatusCode/100 != 2 {
		if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusRequestTimeout {
			e.legFailed(l, "status", nil)
			return prefillOut{fail: &failure{leg: "prefill", reason: "status", w: pr.P, status: http.StatusBadGateway, retry: true,
				errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d: %s", who, resp.StatusCode, snippet(data))}}
		}
		// a client error (bad request, prompt too long): relay it as is
		l.finish(true)
		if e.m != nil {
			e.m.PDLegErrors.WithLabelValues("prefill", "status_4xx").Inc()
		}
		return prefillOut{fail: &failure{leg: "prefill", reason: "status_4xx", w: pr.P, status: resp.StatusCode,
			errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d: %s", who, resp.StatusCode, snippet(data)),
			relay: &buffered{status: resp.StatusCode, header: resp.Header, body: limit(data, maxErrorBody)}}}
	}
	if len(data) > maxPrefillBody {
		e.legFailed(l, "bad_response", nil)
		return prefillOut{fail: &failure{leg: "prefill", reason: "bad_response", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s returned a response larger than %d bytes", who, maxPrefillBody)}}
	}
	o, err := rawjson.Parse(data)
	if err != nil {
		e.legFailed(l, "bad_response", nil)
		return prefillOut{fail: &failure{leg: "prefill", reason: "bad_response", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d with a body that is not a JSON object (%v): %s; the decode was not sent",
				who, resp.StatusCode, err, snippet(data))}}
	}
	l.finish(true)
	return prefillOut{body: data, params: o.Get("kv_transfer_params")}
}

// decodeOut is the decode leg's response headers (or error).
type decodeOut struct {
	resp *http.Response
	err  error
}

// firstRead is the decode body's first chunk.
type firstRead struct {
	b   []byte
	err error
}

// attempt runs one (P, D) pair. It returns nil when a response was written
// to the client, or the failure when nothing was.
func (e *Engine) attempt(ctx context.Context, w http.ResponseWriter, st *reqState, pr *Pair) *failure {
	order := e.conn.Order(pr.P)
	labels := []string{e.conn.Name(), order.String()}
	pBody := prefillBody(st.kind, st.obj, e.conn.PrefillParams(pr))
	e.log.Debug("pd attempt", "prefill", pr.P.Key(), "decode", pr.D.Key(), "order", order.String(),
		"request_id", pr.RequestID, "transfer_id", pr.TransferID)

	var pctx context.Context
	var pcancel context.CancelFunc
	if e.o.PrefillTimeout > 0 {
		pctx, pcancel = context.WithTimeout(ctx, e.o.PrefillTimeout)
	} else {
		pctx, pcancel = context.WithCancel(ctx)
	}
	defer pcancel()
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()

	prof := e.newProfiler(pr)
	defer prof.stopAll()

	var (
		pRes     *prefillOut
		pWatch   chan prefillOut
		pDown    <-chan struct{} // closed when P, which answered, is seen dead
		written  chan struct{}
		dch      chan decodeOut
		dResp    *http.Response
		firstCh  chan firstRead
		first    []byte
		firstEOF bool
		gotFirst bool
		kvTimer  <-chan time.Time
		dl       *leg
		pl       *leg
	)
	observeP := func(out prefillOut) {
		if e.m != nil && !st.warmup && out.fail == nil {
			e.m.PDPrefillSeconds.WithLabelValues(labels...).Observe(out.dur.Seconds())
		}
	}

	// The prefill's breaker outcome (holdOK) is a success only once its KV
	// reached the decode (D's first byte) or the attempt ended for another
	// reason than the transfer: settled here unless recorded before.
	defer func() {
		if pl != nil {
			pl.settle(worker.OutcomeSuccess)
		}
	}()

	// Sequential: the prefill completes first.
	var dParams []byte
	if order == Sequential {
		var ok bool
		if pl, ok = e.startLeg(ctx, "prefill", pr.P, st, pr); !ok {
			return &failure{leg: "prefill", reason: "breaker_open", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
				errType: "server_selection", msg: "prefill worker " + pr.P.Key() + " circuit breaker is open"}
		}
		pl.holdOK = true
		prof.start(pr.P)
		out := e.runPrefill(ctx, pctx, st, pr, pl, pBody)
		prof.stop(pr.P)
		if out.fail != nil {
			return e.ctxFailure(ctx, st, out.fail)
		}
		observeP(out)
		pRes = &out
		if e.conn.NeedsPrefillParams(pr) && string(out.params) == "null" && !st.stream && stoppedAtFirstToken(st.kind, st.obj, out.body) {
			// P's first token ended the generation (EOS or a stop string):
			// vLLM hands off no KV, and P's answer is the whole answer.
			e.writePrefillAnswer(w, st, out.body)
			return nil
		}
		var err error
		if e.conn.NeedsPrefillParams(pr) {
			err = requireObject(out.params)
		}
		if err == nil {
			dParams, err = e.conn.DecodeParams(pr, out.params)
		}
		if err != nil {
			if e.m != nil {
				e.m.PDLegErrors.WithLabelValues("prefill", "no_params").Inc()
			}
			return &failure{leg: "prefill", reason: "no_params", w: pr.P, status: http.StatusBadGateway, errType: "prefill_params",
				msg: fmt.Sprintf("prefill worker %s: %v; the decode was not sent", pr.P.Key(), err)}
		}
	} else {
		var err error
		if dParams, err = e.conn.DecodeParams(pr, nil); err != nil {
			return &failure{leg: "prefill", reason: "no_params", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
				errType: "server_selection", msg: err.Error()}
		}
	}
	dBody := decodeBody(st.kind, st.obj, dParams, e.o.OutputLength)

	var ok bool
	if dl, ok = e.startLeg(ctx, "decode", pr.D, st, pr); !ok {
		return &failure{leg: "decode", reason: "breaker_open", w: pr.D, status: http.StatusServiceUnavailable, retry: true,
			errType: "server_selection", msg: "decode worker " + pr.D.Key() + " circuit breaker is open"}
	}
	dreq, err := e.newLegRequest(dctx, st, pr, dl, pr.DRank, dBody)
	if err != nil {
		e.legFailed(dl, "error", err)
		return &failure{leg: "decode", reason: "error", w: pr.D, status: http.StatusBadGateway, retry: true, errType: "decode", msg: err.Error()}
	}
	prof.start(pr.D)
	if order == Concurrent {
		prof.start(pr.P)
		// P is sent once D's request is on the wire (D no later than P);
		// if D cannot even be reached, P is never sent.
		// The trace callback closes its own copy: the attempt may set
		// written to nil (D answered first) while the callback runs.
		wc := make(chan struct{})
		written = wc
		var once sync.Once
		dreq = dreq.WithContext(httptrace.WithClientTrace(dctx, &httptrace.ClientTrace{
			WroteRequest: func(i httptrace.WroteRequestInfo) {
				if i.Err == nil {
					once.Do(func() { close(wc) })
				}
			},
		}))
		dch = make(chan decodeOut, 1)
		go func() {
			resp, err := e.o.Client.Do(dreq)
			dch <- decodeOut{resp, err}
		}()
	} else {
		dch = make(chan decodeOut, 1)
		go func() {
			resp, err := e.o.Client.Do(dreq)
			dch <- decodeOut{resp, err}
		}()
	}
	if e.o.KVWaitTimeout > 0 && st.stream {
		t := time.NewTimer(e.o.KVWaitTimeout)
		defer t.Stop()
		kvTimer = t.C
	}

	// cleanup cancels what is still running and waits for every goroutine
	// this attempt started, closing any response it produced.
	cleanup := func(cancelP bool) {
		dcancel()
		if cancelP {
			pcancel()
		}
		if dch != nil {
			if d := <-dch; d.resp != nil {
				d.resp.Body.Close()
			}
			dch = nil
		}
		if dResp != nil {
			dResp.Body.Close()
		}
		if firstCh != nil {
			<-firstCh
			firstCh = nil
		}
		if pWatch != nil {
			pcancel()
			observeP(<-pWatch)
			pWatch = nil
		}
		dl.finish(true) // no-op when the outcome was already recorded
		if pl != nil {
			pl.finish(true)
			pl.settle(worker.OutcomeSuccess)
		}
	}
	decodeFail := func(reason string, status int, retry bool, err error, msg string) *failure {
		e.legFailed(dl, reason, err)
		return &failure{leg: "decode", reason: reason, w: pr.D, status: status, retry: retry, errType: "decode", msg: msg}
	}
	// kvTimeout: D produced no byte within KVWaitTimeout. The pair failed;
	// each side's breaker records a failure only if the pair health blames
	// it (it failed with two distinct partners), else nothing.
	kvTimeout := func() *failure {
		blameP, blameD := e.pairs.failed(pr.P.Key(), pr.D.Key())
		if e.m != nil {
			e.m.PDLegErrors.WithLabelValues("decode", "kv_wait_timeout").Inc()
		}
		tracing.Fail(dl.span, "kv_wait_timeout", nil)
		e.blame(dl, blameD)
		if pl != nil {
			e.blame(pl, blameP)
		}
		cleanup(true)
		return &failure{leg: "decode", reason: "kv_wait_timeout", w: pr.D, status: http.StatusGatewayTimeout, retry: true,
			errType: "kv_wait_timeout", pair: true, blameP: blameP, blameD: blameD,
			msg: fmt.Sprintf("decode worker %s produced no output within %s (KV cache from prefill worker %s never arrived?)",
				pr.D.Key(), e.o.KVWaitTimeout, pr.P.Key())}
	}
	startFirstRead := func() {
		firstCh = make(chan firstRead, 1)
		body := dResp.Body
		go func() {
			buf := make([]byte, 4<<10) // the first event(s); the relay reads the rest
			for {
				n, err := body.Read(buf)
				if n > 0 || err != nil {
					firstCh <- firstRead{buf[:n], err}
					return
				}
			}
		}()
	}
	onFirst := func(f firstRead) (fatal error) {
		firstCh = nil
		if len(f.b) > 0 || errors.Is(f.err, io.EOF) {
			gotFirst, first, firstEOF = true, f.b, errors.Is(f.err, io.EOF)
			tracing.Event(dl.span, tracing.EventFirstByte)
			if e.m != nil && !st.warmup {
				e.m.PDKVWaitSeconds.WithLabelValues(labels...).Observe(e.o.Now().Sub(dl.sent).Seconds())
			}
			return nil
		}
		return f.err
	}

	launchP := func() *failure {
		written = nil
		if pl, ok = e.startLeg(ctx, "prefill", pr.P, st, pr); !ok {
			cleanup(true)
			return &failure{leg: "prefill", reason: "breaker_open", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
				errType: "server_selection", msg: "prefill worker " + pr.P.Key() + " circuit breaker is open"}
		}
		pl.holdOK = true
		pWatch = make(chan prefillOut, 1)
		go func(l *leg, ch chan prefillOut) { ch <- e.runPrefill(ctx, pctx, st, pr, l, pBody) }(pl, pWatch)
		return nil
	}

	// Wait until D's status is known and D produced its first body byte (or
	// ended its body). Until then nothing reached the client, so a KV-wait
	// timeout or a dead prefill can still fail over to another pair.
	for !(dResp != nil && gotFirst) {
		select {
		case <-written:
			if f := launchP(); f != nil {
				return f
			}

		case out := <-pWatch:
			pWatch = nil
			prof.stop(pr.P)
			if out.fail != nil {
				// P failed before D's first byte: cancel D so vLLM frees its blocks.
				cleanup(true)
				return e.ctxFailure(ctx, st, out.fail)
			}
			observeP(out)
			pRes = &out
			// D still waits for the KV this P sends after answering: stop
			// waiting if P is seen dead meanwhile
			pDown = e.watchDown(pr.P)

		case d := <-dch:
			dch = nil
			prof.stop(pr.D)
			if d.err != nil {
				var f *failure
				switch {
				case ctx.Err() != nil:
					cleanup(true)
					return e.ctxFailure(ctx, st, nil)
				case proxy.IsDialError(d.err):
					f = decodeFail("connect", http.StatusBadGateway, true, d.err, fmt.Sprintf("decode worker %s unreachable: %v", pr.D.Key(), unwrapURL(d.err)))
				default:
					f = decodeFail("error", http.StatusBadGateway, true, d.err, fmt.Sprintf("decode worker %s failed before answering: %v", pr.D.Key(), unwrapURL(d.err)))
				}
				cleanup(true)
				return f
			}
			tracing.SetStatus(dl.span, d.resp.StatusCode)
			if d.resp.StatusCode/100 != 2 {
				data, _ := io.ReadAll(io.LimitReader(d.resp.Body, maxErrorBody))
				d.resp.Body.Close()
				b := &buffered{status: d.resp.StatusCode, header: d.resp.Header, body: data}
				var f *failure
				if d.resp.StatusCode >= 500 || d.resp.StatusCode == http.StatusTooManyRequests || d.resp.StatusCode == http.StatusRequestTimeout {
					f = decodeFail("status", d.resp.StatusCode, true, nil, fmt.Sprintf("decode worker %s returned HTTP %d: %s", pr.D.Key(), d.resp.StatusCode, snippet(data)))
				} else {
					dl.finish(true)
					if e.m != nil {
						e.m.PDLegErrors.WithLabelValues("decode", "status_4xx").Inc()
					}
					f = &failure{leg: "decode", reason: "status_4xx", w: pr.D, status: d.resp.StatusCode, errType: "decode",
						msg: fmt.Sprintf("decode worker %s returned HTTP %d", pr.D.Key(), d.resp.StatusCode)}
				}
				f.relay = b
				cleanup(true)
				return f
			}
			dResp = d.resp
			startFirstRead()
			if written != nil {
				// D answered before its request write was reported
				if f := launchP(); f != nil {
					return f
				}
			}

		case fr := <-firstCh:
			if err := onFirst(fr); err != nil {
				var f *failure
				if ctx.Err() != nil {
					cleanup(true)
					return e.ctxFailure(ctx, st, nil)
				}
				f = decodeFail("error", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s failed before its first byte: %v", pr.D.Key(), err))
				cleanup(true)
				return f
			}

		case <-kvTimer:
			kvTimer = nil
			return kvTimeout()

		case <-pDown:
			// P answered, then was seen dead (connect failure, left the
			// registry) before D produced a byte: its KV may never come.
			pDown = nil
			tracing.Fail(pl.span, "down", nil)
			pl.finish(false)
			if e.m != nil {
				e.m.PDPrefillErrors.WithLabelValues(pr.P.Key()).Inc()
				e.m.PDLegErrors.WithLabelValues("prefill", "down").Inc()
			}
			cleanup(true)
			return &failure{leg: "prefill", reason: "down", w: pr.P, status: http.StatusBadGateway, retry: true, errType: "prefill",
				msg: fmt.Sprintf("prefill worker %s went away (connect failure or left the registry) before decode worker %s received its KV cache",
					pr.P.Key(), pr.D.Key())}

		case <-ctx.Done():
			cleanup(true)
			return e.ctxFailure(ctx, st, nil)
		}
	}

	// Commit: D's status is known and D produced a byte (or ended its body).
	// The KV arrived: the pair is fine, and so is a prefill already done.
	e.pairs.succeeded(pr.P.Key(), pr.D.Key())
	if e.warm != nil {
		e.warm.used(pr.P, pr.D)
	}
	if pl != nil && pWatch == nil {
		pl.settle(worker.OutcomeSuccess)
	}
	if e.m != nil && !st.warmup {
		d := e.o.Now().Sub(st.start).Seconds()
		e.m.PDRequestDur.WithLabelValues(st.route).Observe(d)
		e.m.GenerateDur.Observe(d) // time to response headers, as on the regular path
	}
	finishP := func() {
		// D is done: a prefill still running has nothing left to give.
		if pWatch != nil {
			pcancel()
			observeP(<-pWatch)
			pWatch = nil
		}
		if pl != nil {
			pl.finish(true)
			pl.settle(worker.OutcomeSuccess) // no-op if P failed meanwhile
		}
	}
	defer func() {
		dcancel()
		dResp.Body.Close()
		if firstCh != nil {
			<-firstCh
		}
		finishP()
		dl.finish(true)
	}()

	if st.merge {
		return e.writeMerged(ctx, w, st, pr, dl, dResp, first, firstEOF, &pWatch, pRes, labels, decodeFail)
	}

	h := w.Header()
	proxy.CopyResponseHeaders(h, dResp.Header)
	if !st.stream && dResp.ContentLength >= 0 {
		// a short body then closes the connection instead of looking complete
		h.Set("Content-Length", strconv.FormatInt(dResp.ContentLength, 10))
	}
	w.WriteHeader(dResp.StatusCode)

	var body io.Reader = dResp.Body
	if firstEOF {
		body = http.NoBody
	}
	if len(first) > 0 {
		body = io.MultiReader(bytes.NewReader(first), body)
	}
	// token usage: the decode's own report (the prefill's 1-token leg is never counted)
	observeUsage, finishUsage := proxy.NewUsageObserver(e.m)
	res := proxy.Relay(ctx, e.migWriter(st, w, dResp), readCloser{body, dResp.Body}, proxy.RelayOptions{
		IdleTimeout: e.o.StreamIdleTimeout,
		Observe:     observeUsage,
		OnFirstByte: func() {
			if e.m != nil && !st.warmup && st.stream {
				e.m.TTFT.WithLabelValues(st.route, "pd").Observe(e.o.Now().Sub(st.start).Seconds())
			}
		},
	})
	finishUsage(res.UpstreamErr == nil && res.DownstreamOK && dResp.StatusCode < 300)
	if e.m != nil && !st.warmup {
		e.m.PDDecodeSeconds.WithLabelValues(labels...).Observe(e.o.Now().Sub(dl.sent).Seconds())
	}
	if e.migrateAfterRelay(ctx, &res, st, pr, dl) {
		return nil
	}
	switch {
	case res.UpstreamErr == nil && res.DownstreamOK:
		dl.finish(true)
	case st.cli.Err() != nil:
		// the client went away: both legs are cancelled by the deferred cleanup
		e.countErr("client_disconnect")
	default:
		err := res.UpstreamErr
		if err == nil {
			err = ctx.Err()
		}
		e.endAfterCommit(ctx, w, res, st, pr, dl, err)
	}
	return nil
}

// blame ends a leg of a pair whose KV transfer failed: a failure on its
// worker's breaker (and error metrics) when the pair health blames that
// worker, else a neutral outcome (the pair is at fault, not the worker).
func (e *Engine) blame(l *leg, blamed bool) {
	if !blamed {
		l.end(worker.OutcomeNeutral)
		return
	}
	tracing.Fail(l.span, "kv_wait_timeout", nil)
	l.finish(false)
	if e.m != nil {
		if l.name == "prefill" {
			e.m.PDPrefillErrors.WithLabelValues(l.w.Key()).Inc()
		} else {
			e.m.PDDecodeErrors.WithLabelValues(l.w.Key()).Inc()
		}
	}
}

// endAfterCommit ends a response whose status line was already sent: the
// stream gets an SSE error event (never a silent truncated 200).
func (e *Engine) endAfterCommit(ctx context.Context, w http.ResponseWriter, res proxy.RelayResult, st *reqState, pr *Pair, dl *leg, err error) {
	var msg, reason string
	status := http.StatusBadGateway
	switch {
	case st.cli.Err() != nil:
		e.countErr("client_disconnect")
		return
	case ctx.Err() == context.DeadlineExceeded:
		reason, status = "request_timeout", http.StatusGatewayTimeout
		msg = fmt.Sprintf("request timed out after %s while decode worker %s was streaming", e.o.RequestTimeout, pr.D.Key())
		dl.finish(true)
	case errors.Is(err, proxy.ErrIdleTimeout):
		reason, status = "idle_timeout", http.StatusGatewayTimeout
		msg = fmt.Sprintf("decode worker %s stream was idle for more than %s", pr.D.Key(), e.o.StreamIdleTimeout)
		e.legFailed(dl, reason, nil)
	default:
		reason = "stream"
		msg = fmt.Sprintf("decode worker %s stream failed: %v", pr.D.Key(), err)
		e.legFailed(dl, reason, err)
	}
	e.log.Warn("pd decode failed after commit", "decode", pr.D.Key(), "reason", reason, "err", err)
	e.countErr(reason)
	if e.m != nil {
		e.m.PDStreamErrors.WithLabelValues(pr.D.Key()).Inc()
	}
	if st.stream {
		_ = proxy.WriteSSEError(w, res, status, msg)
	}
	// non-streaming: the declared Content-Length is not met, so the server
	// closes the connection and the client sees the truncation.
}

// writeMerged buffers a non-streaming decode response, folds in the
// prefill's prompt logprobs and writes it with a correct Content-Length.
func (e *Engine) writeMerged(ctx context.Context, w http.ResponseWriter, st *reqState, pr *Pair, dl *leg, dResp *http.Response,
	first []byte, firstEOF bool, pWatch *chan prefillOut, pRes *prefillOut, labels []string,
	decodeFail func(string, int, bool, error, string) *failure) *failure {
	data := first
	if !firstEOF {
		rest, err := io.ReadAll(io.LimitReader(dResp.Body, maxMergeBody))
		if err != nil {
			if st.cli.Err() != nil || ctx.Err() != nil {
				return e.ctxFailure(ctx, st, nil)
			}
			return decodeFail("error", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s failed while sending its response: %v", pr.D.Key(), err))
		}
		data = append(append([]byte(nil), first...), rest...)
	}
	if *pWatch != nil {
		select {
		case out := <-*pWatch:
			*pWatch = nil
			if out.fail == nil {
				pRes = &out
			}
		case <-ctx.Done():
			return e.ctxFailure(ctx, st, nil)
		}
	}
	decoded := data // the decode's own usage is counted, never the prefill's
	if pRes != nil && dResp.StatusCode/100 == 2 {
		data, _ = mergeLogprobs(st.kind, pRes.body, data)
	}
	h := w.Header()
	proxy.CopyResponseHeaders(h, dResp.Header)
	h.Set("Content-Length", strconv.Itoa(len(data)))
	w.WriteHeader(dResp.StatusCode)
	_, _ = w.Write(data)
	if dResp.StatusCode < 300 {
		proxy.CountUsage(e.m, decoded)
	}
	dl.finish(true)
	if e.m != nil && !st.warmup {
		e.m.PDDecodeSeconds.WithLabelValues(labels...).Observe(e.o.Now().Sub(dl.sent).Seconds())
	}
	return nil
}

// ctxFailure turns a cancelled attempt into the right failure: the client
// left (nothing useful to write), the request deadline passed (504), or f.
func (e *Engine) ctxFailure(ctx context.Context, st *reqState, f *failure) *failure {
	switch {
	case st.cli.Err() != nil:
		return &failure{reason: "client_disconnect", status: proxy.StatusClientClosed, errType: "client_disconnect", msg: "client closed the request"}
	case ctx.Err() != nil:
		return &failure{reason: "request_timeout", status: http.StatusGatewayTimeout, errType: "request_timeout",
			msg: fmt.Sprintf("request timed out after %s", e.o.RequestTimeout)}
	}
	if f == nil {
		return &failure{reason: "canceled", status: http.StatusBadGateway, errType: "canceled", msg: "request canceled"}
	}
	return f
}

// writeFailure writes the error response for a request that failed before
// any byte reached the client.
func (e *Engine) writeFailure(w http.ResponseWriter, st *reqState, f *failure) {
	et := f.errType
	if et == "" {
		et = f.reason
	}
	e.countErr(et)
	if e.m != nil && !st.warmup {
		e.m.PDRequestDur.WithLabelValues(st.route).Observe(e.o.Now().Sub(st.start).Seconds())
	}
	if f.reason == "client_disconnect" {
		w.WriteHeader(proxy.StatusClientClosed)
		return
	}
	if f.relay != nil {
		h := w.Header()
		proxy.CopyResponseHeaders(h, f.relay.header)
		h.Set("Content-Length", strconv.Itoa(len(f.relay.body)))
		w.WriteHeader(f.relay.status)
		_, _ = w.Write(f.relay.body)
		return
	}
	openai.WriteError(w, f.status, f.msg)
}

// fail writes a request-level error (validation, routing).
func (e *Engine) fail(w http.ResponseWriter, st *reqState, errType string, status int, msg string) {
	e.countErr(errType)
	openai.WriteError(w, status, msg)
}

func (e *Engine) countErr(t string) {
	if e.m != nil && t != "" {
		e.m.PDErrors.WithLabelValues(t).Inc()
	}
}

func (e *Engine) countRoute(route string) {
	if e.m != nil {
		e.m.PDRequests.WithLabelValues(route).Inc()
	}
}

// readCloser lets Relay's idle timer close the upstream body.
type readCloser struct {
	io.Reader
	c io.Closer
}

func (r readCloser) Close() error { return r.c.Close() }

func snippet(b []byte) string {
	s := strings.TrimSpace(string(limit(b, 512)))
	if len(b) > 512 {
		s += "…"
	}
	return s
}

func limit(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// unwrapURL drops net/http's "Post \"url\": " wrapper.
func unwrapURL(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}
