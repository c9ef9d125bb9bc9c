package pd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/legctx"
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

// firstReadSize bounds D's first read, taken once D sent something and
// sized to what arrived (proxy.AwaitBody): one SSE event of vLLM's fits;
// the relay reads the rest.
const firstReadSize = 1 << 10

// The causes with which the attempt interrupts the decode's wait for its
// first byte (context.Cause of the decode's context).
var (
	errKVWait        = errors.New("pd: KV-wait timeout")
	errPrefillEnded  = errors.New("pd: the concurrent prefill failed")
	errPrefillDown   = errors.New("pd: the prefill went away")
	errPrefillUnsent = errors.New("pd: the concurrent prefill could not be sent")
)

// attempt runs one (P, D) pair. It returns nil when a response was written
// to the client, or the failure when nothing was.
//
// The attempt is a fixed sequence of steps, each a method of attemptRun:
//
//	prefillFirst   sequential connectors: the prefill completes (and yields
//	               the decode's kv_transfer_params) before the decode is sent
//	send           the decode leg and the KV-wait timer are prepared
//	waitFirstByte  D's request goes out on this goroutine (a concurrent
//	               connector's prefill follows on its own once D's request is
//	               written: launchPrefill, watchPrefill) and D's status and
//	               first body byte are awaited; the KV-wait timer, a failed
//	               or dead prefill and the client interrupt the wait
//	               (onInterrupt), and can still fail over to another pair
//	commit         the KV arrived: the pair and a finished prefill are fine
//	relay          D's response goes to the client (streamed, or merged with
//	               the prefill's prompt logprobs)
//	settle         cancel and drain what still runs (a concurrent prefill
//	               that has not answered yet is left to answer: handOff),
//	               record the legs' outcomes
func (e *Engine) attempt(ctx context.Context, w http.ResponseWriter, st *reqState, pr *Pair) *failure {
	a := e.newAttemptRun(ctx, w, st, pr)
	defer a.close()
	dParams, answered, f := a.prefillFirst()
	if f != nil || answered {
		return f
	}
	if f := a.send(dParams); f != nil {
		return f
	}
	if f := a.waitFirstByte(); f != nil {
		return f
	}
	a.commit()
	defer a.settle()
	return a.relay()
}

// attemptRun is the state of one attempt: its legs and what the decode
// has produced so far. The decode leg runs on the request's goroutine; a
// concurrent connector's prefill runs on one more, which interrupts the
// decode's wait (interrupt) when it fails or its worker goes away.
type attemptRun struct {
	e   *Engine
	ctx context.Context // client and overall deadline
	w   http.ResponseWriter
	st  *reqState
	pr  *Pair

	order  Order
	labels [2]string // connector, order: PD timing metric labels
	pBody  rawjson.Spliced

	// pctx is the prefill's context: PrefillTimeout, or cancelled when
	// the sibling failed; it follows ctx, until handOff unfollows a
	// concurrent prefill's (handedOff: its answer is awaited after the
	// attempt). dctx is the decode's; its cause says which interrupt ended
	// the wait. Both live here (legctx: no allocation per leg).
	pctx      legctx.Ctx
	handedOff bool
	dctx      decodeCtx
	prof      *profiler
	kvTimer   *time.Timer // KVWaitTimeout for D's first byte (nil = none)
	dreq      *http.Request

	// waiting: D's first byte is awaited, so interrupts cancel dctx;
	// waitDone is closed when the wait ends.
	mu       sync.Mutex
	waiting  bool
	waitDone chan struct{}

	// A concurrent prefill is launched once (launchOnce) by the trace
	// callback of D's request write, or after D's answer if that came
	// first; the request's goroutine reads pl and launchFail only after
	// passing launchOnce itself.
	launchOnce sync.Once
	launchFail *failure

	pl, dl   *leg
	hdrs     legHeaders      // the legs' header map, when they can share one
	pRes     *prefillOut     // the prefill's answer once received
	pWatch   chan prefillOut // a concurrent prefill's answer, not received yet (nil = none)
	pDone    atomic.Bool     // the concurrent prefill answered with success
	dResp    *http.Response  // D's response once its status is known
	first    []byte          // D's first chunk
	clv      [1]string       // the Content-Length value writeHead sets
	usage    proxy.Usage     // D's token usage (the prefill's 1-token leg is never counted)
	dBody    firstThenBody   // what relay reads: first, then D's body
	firstEOF bool            // D's body ended with the first read
}

func (e *Engine) newAttemptRun(ctx context.Context, w http.ResponseWriter, st *reqState, pr *Pair) *attemptRun {
	order := e.conn.Order(pr.P)
	a := &attemptRun{e: e, ctx: ctx, w: w, st: st, pr: pr, order: order,
		labels: [2]string{e.conn.Name(), order.String()},
		pBody:  prefillBody(st.kind, st.obj, e.conn.PrefillParams(pr)),
		prof:   e.newProfiler(pr),
	}
	if e.log.Enabled(ctx, slog.LevelDebug) { // its arguments cost allocations even when dropped
		e.log.Debug("pd attempt", "prefill", pr.P.Key(), "decode", pr.D.Key(), "order", order.String(),
			"request_id", pr.RequestID, "transfer_id", pr.TransferID)
	}
	// A concurrent prefill may outlive the attempt by the moment its
	// answer takes (handOff): its context follows ctx only until then.
	a.pctx.Init(ctx, e.o.PrefillTimeout)
	a.dctx.Init(ctx, 0)
	a.waitDone = make(chan struct{})
	return a
}

func (a *attemptRun) dcancel() { a.dctx.Cancel(nil) }

func (a *attemptRun) pcancel() { a.pctx.Cancel(nil) }

// decodeCtx is the decode leg's context. With a concurrent connector (a
// set), D's request written launches the prefill: the transport tells the
// context itself (proxy.WroteRequester), or a trace does.
type decodeCtx struct {
	legctx.Ctx
	a *attemptRun
}

var _ proxy.WroteRequester = (*decodeCtx)(nil)

func (d *decodeCtx) WroteRequest() {
	if a := d.a; a != nil {
		a.launchOnce.Do(a.launchPrefill)
	}
}

// takePBody hands the prefill's body to its (only) leg: the attempt keeps
// no reference to its pieces.
func (a *attemptRun) takePBody() rawjson.Spliced {
	b := a.pBody
	a.pBody = rawjson.Spliced{}
	return b
}

// interrupt ends the decode's wait for its first byte with cause (a no-op
// once the wait is over: the response is the client's then).
func (a *attemptRun) interrupt(cause error) {
	a.mu.Lock()
	if a.waiting {
		a.dctx.Cancel(cause)
	}
	a.mu.Unlock()
}

// stopWaiting ends the wait (idempotent) and returns the interrupt that
// ended it, if any.
func (a *attemptRun) stopWaiting() error {
	a.mu.Lock()
	if a.waiting {
		a.waiting = false
		close(a.waitDone)
	}
	a.mu.Unlock()
	switch c := a.dctx.Cause(); c {
	case errKVWait, errPrefillEnded, errPrefillDown, errPrefillUnsent:
		return c
	}
	return nil
}

// close runs when the attempt returns, whatever the step. The prefill's
// breaker outcome (holdOK) is a success only once its KV reached the decode
// (D's first byte) or the attempt ended for another reason than the
// transfer: settled here unless recorded before.
func (a *attemptRun) close() {
	if a.kvTimer != nil {
		a.kvTimer.Stop()
	}
	a.stopWaiting()
	a.launchOnce.Do(func() {}) // a late write report launches nothing
	if a.pl != nil {
		a.pl.settle(worker.OutcomeSuccess)
	}
	a.prof.stopAll()
	a.dcancel()
	if !a.handedOff {
		a.pcancel()
	}
}

func (a *attemptRun) observeP(out prefillOut) {
	if a.e.m != nil && !a.st.warmup && out.fail == nil {
		a.e.observe(a.e.m.PDPrefillSeconds, out.dur.Seconds(), a.labels[0], a.labels[1])
	}
}

// prefillFirst is the first step. A sequential connector's prefill runs to
// completion here; answered reports that P's answer was the whole answer
// and was written. Both orders end with the decode's kv_transfer_params.
func (a *attemptRun) prefillFirst() (dParams []byte, answered bool, f *failure) {
	e, st, pr := a.e, a.st, a.pr
	if a.order != Sequential {
		dParams, err := e.conn.DecodeParams(pr, nil)
		if err != nil {
			return nil, false, &failure{leg: "prefill", reason: "no_params", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
				errType: "server_selection", msg: err.Error()}
		}
		return dParams, false, nil
	}
	var ok bool
	if a.pl, ok = e.startLeg(a.ctx, "prefill", pr.P, st, pr); !ok {
		return nil, false, &failure{leg: "prefill", reason: "breaker_open", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
			errType: "server_selection", msg: "prefill worker " + pr.P.Key() + " circuit breaker is open"}
	}
	a.pl.holdOK = true
	a.prof.start(pr.P)
	out := e.runPrefill(a.ctx, &a.pctx, st, pr, a.pl, a.takePBody(), &a.hdrs)
	a.prof.stop(pr.P)
	if out.fail != nil {
		return nil, false, e.ctxFailure(a.ctx, st, out.fail)
	}
	a.observeP(out)
	a.pRes = &out
	if e.conn.NeedsPrefillParams(pr) && string(out.params) == "null" && !st.stream && stoppedAtFirstToken(st.kind, st.obj, out.body) {
		// P's first token ended the generation (EOS or a stop string):
		// vLLM hands off no KV, and P's answer is the whole answer.
		e.writePrefillAnswer(a.w, st, out.body)
		return nil, true, nil
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
		return nil, false, &failure{leg: "prefill", reason: "no_params", w: pr.P, status: http.StatusBadGateway, errType: "prefill_params",
			msg: fmt.Sprintf("prefill worker %s: %v; the decode was not sent", pr.P.Key(), err)}
	}
	return dParams, false, nil
}

// send prepares the decode leg and starts the KV-wait timer; the request
// itself goes out in waitFirstByte. With a concurrent connector, P is sent
// once D's request is on the wire (D no later than P); if D cannot even be
// reached, P is never sent.
func (a *attemptRun) send(dParams []byte) *failure {
	e, st, pr := a.e, a.st, a.pr
	dBody := decodeBody(st.kind, st.obj, dParams, e.o.OutputLength)
	var ok bool
	if a.dl, ok = e.startLeg(a.ctx, "decode", pr.D, st, pr); !ok {
		return &failure{leg: "decode", reason: "breaker_open", w: pr.D, status: http.StatusServiceUnavailable, retry: true,
			errType: "server_selection", msg: "decode worker " + pr.D.Key() + " circuit breaker is open"}
	}
	var dctx context.Context = &a.dctx
	if a.order == Concurrent { // P is sent once D's request is written
		a.dctx.a = a
		if !proxy.TellsWroteRequest(e.directTransport()) { // other transports report it to a trace
			dctx = httptrace.WithClientTrace(dctx, &httptrace.ClientTrace{
				WroteRequest: func(i httptrace.WroteRequestInfo) {
					if i.Err == nil {
						a.dctx.WroteRequest()
					}
				},
			})
		}
	}
	dreq, err := e.newLegRequest(dctx, st, pr, a.dl, pr.DRank, dBody, &a.hdrs)
	if err != nil {
		e.legFailed(a.dl, "error", err)
		return &failure{leg: "decode", reason: "error", w: pr.D, status: http.StatusBadGateway, retry: true, errType: "decode", msg: err.Error()}
	}
	a.prof.start(pr.D)
	if a.order == Concurrent {
		a.prof.start(pr.P)
	}
	a.dreq = dreq
	a.waiting = true
	if e.o.KVWaitTimeout > 0 && st.stream {
		a.kvTimer = time.AfterFunc(e.o.KVWaitTimeout, func() { a.interrupt(errKVWait) })
	}
	return nil
}

// launchPrefill sends a concurrent connector's prefill on its own
// goroutine. It runs once, on whichever goroutine reports D's request
// written (or on the request's when D answered first).
func (a *attemptRun) launchPrefill() {
	e, pr := a.e, a.pr
	pl, ok := e.startLeg(a.ctx, "prefill", pr.P, a.st, pr)
	if !ok {
		a.launchFail = &failure{leg: "prefill", reason: "breaker_open", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
			errType: "server_selection", msg: "prefill worker " + pr.P.Key() + " circuit breaker is open"}
		a.interrupt(errPrefillUnsent)
		return
	}
	pl.holdOK = true
	a.pl = pl
	a.pWatch = make(chan prefillOut, 1)
	if at := e.asyncTransport(); at != nil {
		go a.sendPrefill(at, pl, a.pWatch)
		return
	}
	go a.watchPrefill(pl, a.pWatch)
}

// asyncTransport is the client's transport when it can await a response
// without a parked goroutine and legs go to it directly (the client adds
// nothing to it: no timeout, cookie jar or redirect policy).
func (e *Engine) asyncTransport() proxy.AsyncRoundTripper {
	at, _ := e.directTransport().(proxy.AsyncRoundTripper)
	return at
}

// watchPrefill runs the concurrent prefill and, once P answered, watches
// P until D's first byte (prefillAnswered).
func (a *attemptRun) watchPrefill(l *leg, ch chan<- prefillOut) {
	a.prefillAnswered(a.e.runPrefill(a.ctx, &a.pctx, a.st, a.pr, l, a.takePBody(), &a.hdrs), ch)
}

// sendPrefill is watchPrefill over a transport that awaits P's answer
// without this goroutine: it ends once P's request is written, and P's
// answer is read on a goroutine started when it arrives. With MoRI-IO
// WRITE, P answers only once D took the KV cache, so a stream queued at D
// holds no goroutine for its prefill.
func (a *attemptRun) sendPrefill(at proxy.AsyncRoundTripper, l *leg, ch chan<- prefillOut) {
	e := a.e
	req, f := e.prefillRequest(&a.pctx, a.st, a.pr, l, a.takePBody(), &a.hdrs)
	if f != nil {
		a.prefillAnswered(prefillOut{fail: f, dur: e.o.Now().Sub(l.sent)}, ch)
		return
	}
	at.RoundTripAsync(req, func(resp *http.Response, err error) {
		a.prefillAnswered(e.prefillResult(a.ctx, &a.pctx, a.pr, l, resp, err), ch)
	})
}

// prefillAnswered takes P's answer to the concurrent prefill and, when it
// succeeded, watches P until D's first byte: D still waits for the KV this
// P sends after answering, so P seen dead (connect failure, left the
// registry) or P failing ends the wait. It hands the answer over on ch.
func (a *attemptRun) prefillAnswered(out prefillOut, ch chan<- prefillOut) {
	a.prof.stop(a.pr.P)
	if out.fail != nil {
		a.interrupt(errPrefillEnded)
	} else {
		a.pDone.Store(true)
		select {
		case <-a.e.watchDown(a.pr.P):
			a.interrupt(errPrefillDown)
		case <-a.waitDone:
		}
	}
	ch <- out
}

// waitFirstByte sends D's request and waits, on the request's goroutine,
// until D's status is known and D produced its first body byte (or ended
// its body). Until then nothing reached the client, so a KV-wait timeout
// or a dead prefill can still fail over to another pair: they interrupt the
// wait by cancelling D's context with their cause (onInterrupt).
func (a *attemptRun) waitFirstByte() *failure {
	resp, err := a.e.do(a.dreq)
	a.prof.stop(a.pr.D)
	if a.order == Concurrent {
		if err == nil {
			a.launchOnce.Do(a.launchPrefill) // D answered before its request write was reported
		} else {
			a.launchOnce.Do(func() {}) // D failed: P is never sent
		}
	}
	if err != nil {
		if c := a.stopWaiting(); c != nil {
			return a.onInterrupt(c)
		}
		return a.onDecodeError(err, "before answering")
	}
	tracing.SetStatus(a.dl.span, resp.StatusCode)
	if resp.StatusCode/100 != 2 {
		a.stopWaiting()
		f := a.decodeStatus(resp)
		a.drain()
		return f
	}
	a.dResp = resp
	// The buffer is taken once D sent something, sized to what arrived.
	size := firstReadSize
	if n := proxy.AwaitBody(resp.Body); n > 0 && n < size {
		size = n
	}
	buf := make([]byte, size)
	var n int
	for n == 0 && err == nil {
		n, err = resp.Body.Read(buf)
	}
	if c := a.stopWaiting(); c != nil {
		return a.onInterrupt(c)
	}
	if n == 0 && !errors.Is(err, io.EOF) {
		return a.onDecodeError(err, "before its first byte")
	}
	a.first, a.firstEOF = buf[:n], errors.Is(err, io.EOF)
	tracing.Event(a.dl.span, tracing.EventFirstByte)
	if a.e.m != nil && !a.st.warmup {
		a.e.observe(a.e.m.PDKVWaitSeconds, a.e.o.Now().Sub(a.dl.sent).Seconds(), a.labels[0], a.labels[1])
	}
	return nil
}

// onInterrupt ends a wait that an interrupt (the cause c) cut short.
func (a *attemptRun) onInterrupt(c error) *failure {
	switch c {
	case errKVWait:
		return a.kvTimeout()
	case errPrefillDown:
		return a.onPrefillDown()
	case errPrefillUnsent:
		a.drain()
		return a.launchFail
	}
	// errPrefillEnded: P failed before D's first byte; D is cancelled so
	// that vLLM frees its blocks.
	out := <-a.pWatch
	a.pWatch = nil
	a.drain()
	return a.e.ctxFailure(a.ctx, a.st, out.fail)
}

// onDecodeError ends the attempt after D failed to answer or to send its
// first byte.
func (a *attemptRun) onDecodeError(err error, when string) *failure {
	pr := a.pr
	if a.ctx.Err() != nil {
		a.drain()
		return a.e.ctxFailure(a.ctx, a.st, nil)
	}
	var f *failure
	switch {
	case a.dResp == nil && proxy.IsDialError(err):
		f = a.decodeFail("connect", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s unreachable: %v", pr.D.Key(), unwrapURL(err)))
	case a.dResp == nil:
		f = a.decodeFail("error", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s failed %s: %v", pr.D.Key(), when, unwrapURL(err)))
	default:
		f = a.decodeFail("error", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s failed %s: %v", pr.D.Key(), when, err))
	}
	a.drain()
	return f
}

// onPrefillDown: P answered, then was seen dead (connect failure, left the
// registry) before D produced a byte: its KV may never come.
func (a *attemptRun) onPrefillDown() *failure {
	e, pr := a.e, a.pr
	tracing.Fail(a.pl.span, "down", nil)
	a.pl.finish(false)
	if e.m != nil {
		e.m.PDPrefillErrors.WithLabelValues(pr.P.Key()).Inc()
		e.m.PDLegErrors.WithLabelValues("prefill", "down").Inc()
	}
	a.drain()
	return &failure{leg: "prefill", reason: "down", w: pr.P, status: http.StatusBadGateway, retry: true, errType: "prefill",
		msg: fmt.Sprintf("prefill worker %s went away (connect failure or left the registry) before decode worker %s received its KV cache",
			pr.P.Key(), pr.D.Key())}
}

// decodeStatus is the failure for D's non-2xx answer, with D's response
// kept to relay.
func (a *attemptRun) decodeStatus(resp *http.Response) *failure {
	e, pr := a.e, a.pr
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	resp.Body.Close()
	b := &buffered{status: resp.StatusCode, header: resp.Header, body: data}
	var f *failure
	if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusRequestTimeout {
		f = a.decodeFail("status", resp.StatusCode, true, nil, fmt.Sprintf("decode worker %s returned HTTP %d: %s", pr.D.Key(), resp.StatusCode, snippet(data)))
	} else {
		a.dl.finish(true)
		if e.m != nil {
			e.m.PDLegErrors.WithLabelValues("decode", "status_4xx").Inc()
		}
		f = &failure{leg: "decode", reason: "status_4xx", w: pr.D, status: resp.StatusCode, errType: "decode",
			msg: fmt.Sprintf("decode worker %s returned HTTP %d", pr.D.Key(), resp.StatusCode)}
	}
	f.relay = b
	return f
}

// kvTimeout: D produced no byte within KVWaitTimeout. The pair failed;
// each side's breaker records a failure only if the pair health blames
// it (it failed with two distinct partners), else nothing.
func (a *attemptRun) kvTimeout() *failure {
	e, pr := a.e, a.pr
	blameP, blameD := e.pairs.failed(pr.P.Key(), pr.D.Key())
	if e.m != nil {
		e.m.PDLegErrors.WithLabelValues("decode", "kv_wait_timeout").Inc()
	}
	tracing.Fail(a.dl.span, "kv_wait_timeout", nil)
	e.blame(a.dl, blameD)
	if a.pl != nil {
		e.blame(a.pl, blameP)
	}
	a.drain()
	return &failure{leg: "decode", reason: "kv_wait_timeout", w: pr.D, status: http.StatusGatewayTimeout, retry: true,
		errType: "kv_wait_timeout", pair: true, blameP: blameP, blameD: blameD,
		msg: fmt.Sprintf("decode worker %s produced no output within %s (KV cache from prefill worker %s never arrived?)",
			pr.D.Key(), e.o.KVWaitTimeout, pr.P.Key())}
}

// decodeFail records a failed decode leg and returns its failure.
func (a *attemptRun) decodeFail(reason string, status int, retry bool, err error, msg string) *failure {
	a.e.legFailed(a.dl, reason, err)
	return &failure{leg: "decode", reason: reason, w: a.pr.D, status: status, retry: retry, errType: "decode", msg: msg}
}

// commit: D's status is known and D produced a byte (or ended its body).
// The KV arrived: the pair is fine, and so is a prefill already done.
func (a *attemptRun) commit() {
	e, st, pr := a.e, a.st, a.pr
	e.pairs.succeeded(pr.P.Key(), pr.D.Key())
	if e.warm != nil {
		e.warm.used(pr.P, pr.D)
	}
	if a.pWatch != nil && a.pDone.Load() {
		// P answered before D's first byte: its answer is on its way
		out := <-a.pWatch
		a.pWatch = nil
		a.observeP(out)
		a.pRes = &out
	}
	if a.pl != nil && a.pWatch == nil {
		a.pl.settle(worker.OutcomeSuccess)
	}
	if e.m != nil && !st.warmup {
		d := e.o.Now().Sub(st.start).Seconds()
		e.observe(e.m.PDRequestDur, d, st.route)
		e.m.GenerateDur.Observe(d) // time to response headers, as on the regular path
	}
}

// relay writes D's response to the client: streamed as it arrives, or
// merged with the prefill's prompt logprobs (st.merge). A failure after
// the status line was sent ends the stream with an SSE error event.
func (a *attemptRun) relay() *failure {
	if a.st.merge {
		return a.relayMerged()
	}
	e, st := a.e, a.st
	body := a.writeHead()
	// Token usage is the decode's own report. The options are made here,
	// so their hooks stay on this frame.
	ro := proxy.RelayOptions{IdleTimeout: e.o.StreamIdleTimeout, Stream: st.stream, OnFirstByte: a.onFirstByte}
	if a.usage.Start(e.m); a.usage.On() {
		ro.Observe = a.usage.Observe
	}
	res := proxy.Relay(a.ctx, e.migWriter(st, a.w, a.dResp), body, ro)
	a.usage.Finish(res.UpstreamErr == nil && res.DownstreamOK && a.dResp.StatusCode < 300)
	a.afterRelay(&res)
	return nil
}

// writeHead writes D's status and headers (not flushed yet) and returns
// D's body, its first chunk included; closing it closes D's body.
func (a *attemptRun) writeHead() io.ReadCloser {
	dResp := a.dResp
	h := a.w.Header()
	proxy.CopyResponseHeaders(h, dResp.Header)
	if !a.st.stream && dResp.ContentLength >= 0 {
		// a short body then closes the connection instead of looking complete
		a.clv[0] = strconv.FormatInt(dResp.ContentLength, 10)
		h["Content-Length"] = a.clv[:1:1]
	}
	a.w.WriteHeader(dResp.StatusCode)

	a.dBody = firstThenBody{first: a.first, rest: dResp.Body, c: dResp.Body}
	if a.firstEOF {
		a.dBody.rest = http.NoBody
	}
	return &a.dBody
}

// firstThenBody reads D's first chunk (read while the KV was awaited), then
// the rest of D's body; Close (Relay's idle timer) closes D's body. A
// field of the attempt, so relaying allocates no reader.
type firstThenBody struct {
	first []byte
	rest  io.Reader
	c     io.Closer
}

func (b *firstThenBody) Read(p []byte) (int, error) {
	if len(b.first) > 0 {
		n := copy(p, b.first)
		b.first = b.first[n:]
		return n, nil
	}
	return b.rest.Read(p)
}

func (b *firstThenBody) Close() error { return b.c.Close() }

// Buffered makes firstThenBody a proxy.BufferedBody: the first chunk is in
// memory, so what decides is D's body.
func (b *firstThenBody) Buffered() bool { return b.rest == http.NoBody || proxy.BodyBuffered(b.rest) }

// onFirstByte observes the time to the first token of a stream.
func (a *attemptRun) onFirstByte() {
	e, st := a.e, a.st
	if e.m != nil && !st.warmup && st.stream {
		e.observe(e.m.TTFT, e.o.Now().Sub(st.start).Seconds(), st.route, "pd")
	}
}

// afterRelay records how the relay ended: the decode leg's outcome, a
// continuation on another pair (migration), or the end of the stream.
func (a *attemptRun) afterRelay(res *proxy.RelayResult) {
	e, st, pr, dl := a.e, a.st, a.pr, a.dl
	if e.m != nil && !st.warmup {
		e.observe(e.m.PDDecodeSeconds, e.o.Now().Sub(dl.sent).Seconds(), a.labels[0], a.labels[1])
	}
	if e.migrateAfterRelay(a.ctx, res, st, pr, dl) {
		return
	}
	switch {
	case res.UpstreamErr == nil && res.DownstreamOK:
		dl.finish(true)
	case st.cli.Err() != nil:
		// the client went away: both legs are cancelled by settle
		e.countErr("client_disconnect")
	default:
		err := res.UpstreamErr
		if err == nil {
			err = a.ctx.Err()
		}
		e.endAfterCommit(a.ctx, a.w, *res, st, pr, dl, err)
	}
}

// settle ends a committed attempt: D's body is closed, a prefill still
// running is cancelled and awaited, or, unless the client is gone, left
// to answer (handOff), and both legs' outcomes are recorded (no-ops for
// outcomes recorded before).
func (a *attemptRun) settle() { a.end(a.ctx.Err() == nil) }

// drain cancels what is still running and waits for the prefill's
// goroutine, closing any response the attempt produced; it records a
// success for each leg whose outcome is not recorded yet. Every step that
// ends the attempt calls it, and settle after a commit.
func (a *attemptRun) drain() { a.end(false) }

func (a *attemptRun) end(served bool) {
	a.stopWaiting()
	a.dcancel()
	if a.dResp != nil {
		a.dResp.Body.Close()
	}
	if a.pWatch != nil {
		select {
		case out := <-a.pWatch:
			a.observeP(out)
		default:
			if !served || !a.handOff() {
				// D is done: a prefill still running has nothing left to give.
				a.pcancel()
				a.observeP(<-a.pWatch)
			}
		}
		a.pWatch = nil
	}
	if !a.handedOff {
		a.pcancel()
	}
	a.dl.finish(true)
	if a.pl != nil {
		a.pl.finish(true)
		a.pl.settle(worker.OutcomeSuccess) // no-op if P failed meanwhile
	}
}

// prefillHandOff bounds how long a concurrent prefill's answer is awaited
// after its decode's answer ended.
const prefillHandOff = 2 * time.Second

// handOff leaves a concurrent prefill that has not answered yet to answer
// after the attempt, instead of cancelling it: its KV reached D (D's
// answer was committed), and a cancelled request closes its connection, so
// the next request to P would open a new one (with MoRI-IO WRITE, P
// answers once D took the KV cache, often after a short answer ended: at
// 1,500 requests a second, hundreds of new connections a second and their
// TIME_WAIT sockets). A goroutine awaits the answer, at most
// prefillHandOff, then cancels the prefill. False when the request's
// context ended first (the prefill is cancelled with it).
func (a *attemptRun) handOff() bool {
	if a.order != Concurrent || !a.pctx.Unfollow() {
		return false
	}
	a.handedOff = true
	ch, pcancel := a.pWatch, a.pcancel
	go func() {
		t := time.NewTimer(prefillHandOff)
		defer t.Stop()
		var out prefillOut
		select {
		case out = <-ch:
		case <-t.C:
			pcancel()
			out = <-ch
		}
		pcancel()
		a.observeP(out)
	}()
	return true
}

// relayMerged buffers a non-streaming decode response, folds in the
// prefill's prompt logprobs and writes it with a correct Content-Length.
func (a *attemptRun) relayMerged() *failure {
	e, st, pr, dl, dResp := a.e, a.st, a.pr, a.dl, a.dResp
	data := a.first
	if !a.firstEOF {
		rest, err := io.ReadAll(io.LimitReader(dResp.Body, maxMergeBody))
		if err != nil {
			if st.cli.Err() != nil || a.ctx.Err() != nil {
				return e.ctxFailure(a.ctx, st, nil)
			}
			return a.decodeFail("error", http.StatusBadGateway, true, err, fmt.Sprintf("decode worker %s failed while sending its response: %v", pr.D.Key(), err))
		}
		data = append(append([]byte(nil), a.first...), rest...)
	}
	pRes := a.pRes
	if a.pWatch != nil {
		select {
		case out := <-a.pWatch:
			a.pWatch = nil
			if out.fail == nil {
				pRes = &out
			}
		case <-a.ctx.Done():
			return e.ctxFailure(a.ctx, st, nil)
		}
	}
	decoded := data // the decode's own usage is counted, never the prefill's
	if pRes != nil && dResp.StatusCode/100 == 2 {
		data, _ = mergeLogprobs(st.kind, pRes.body, data)
	}
	h := a.w.Header()
	proxy.CopyResponseHeaders(h, dResp.Header)
	h.Set("Content-Length", strconv.Itoa(len(data)))
	a.w.WriteHeader(dResp.StatusCode)
	_, _ = a.w.Write(data)
	if dResp.StatusCode < 300 {
		proxy.CountUsage(e.m, decoded)
	}
	dl.finish(true)
	if e.m != nil && !st.warmup {
		e.observe(e.m.PDDecodeSeconds, e.o.Now().Sub(dl.sent).Seconds(), a.labels[0], a.labels[1])
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
		e.observe(e.m.PDRequestDur, e.o.Now().Sub(st.start).Seconds(), st.route)
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
		e.inc(e.m.PDRequests, route)
	}
}

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
