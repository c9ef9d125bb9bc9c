package pd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// unsplitReason is the receipt reason of a request served by one prefill
// worker without a PD split.
const unsplitReason = "unsplit: /v1/responses served whole by one prefill worker (vLLM drops kv_transfer_params on that route before PR #37424; --pd-split-responses splits it)"

// passthrough serves a request unsplit: the client's body, untouched, goes
// to one prefill worker chosen by PrefillPolicy (prefill workers serve plain
// requests like any vLLM) and its response is relayed as is. A failure
// before any byte reached the client (connect error, 5xx/429/408) may fail
// over to another prefill worker, up to MaxFailovers times.
func (e *Engine) passthrough(ctx context.Context, w http.ResponseWriter, r *http.Request, c *proxy.Call, st *reqState) {
	rc := st.rc
	exclude := map[string]bool{}
	var last *failure
	for failovers := 0; ; {
		p, reason, f := e.pickPrefill(r, c, st, exclude)
		if f != nil {
			if last != nil {
				last.msg += fmt.Sprintf(" (no prefill worker left to fail over to after %d attempt(s): %s)", rc.Attempts, f.msg)
				f = last
			}
			e.writeFailure(w, st, f)
			return
		}
		rc.Attempts++
		st.attempt = rc.Attempts
		rc.Prefill, rc.Decode = p.Key(), ""
		rc.Reason = unsplitReason + "; prefill: " + reason
		pr := &Pair{P: p, PRank: e.rank(p), DRank: -1, RequestID: c.RequestID}
		if pr.RequestID == "" {
			pr.RequestID = hex32(asV4(e.o.NewID()))
		}
		f = e.plainAttempt(ctx, w, st, pr, "prefill", c.Body)
		if f == nil {
			return
		}
		last = f
		if f.reason != "client_disconnect" {
			e.log.Warn("pd unsplit request failed", "prefill", p.Key(), "reason", f.reason, "status", f.status, "err", f.msg, "retry", f.retry)
		}
		if !f.retry || failovers >= e.o.MaxFailovers || ctx.Err() != nil || f.w == nil {
			e.writeFailure(w, st, f)
			return
		}
		failovers++
		rc.Failovers = append(rc.Failovers, "prefill "+f.w.Key()+": "+f.reason)
		exclude[f.w.Key()] = true
		if e.m != nil {
			e.m.PDFailovers.WithLabelValues(f.reason).Inc()
		}
	}
}

// pickPrefill chooses one prefill worker with PrefillPolicy. Connector
// eligibility does not matter: no KV is transferred.
func (e *Engine) pickPrefill(r *http.Request, c *proxy.Call, st *reqState, exclude map[string]bool) (*worker.Worker, string, *failure) {
	snap := e.o.Registry.Snapshot()
	sel := func(msg string) *failure {
		return &failure{status: http.StatusServiceUnavailable, msg: msg, errType: "server_selection"}
	}
	if len(snap.Prefill) == 0 {
		return nil, "", sel("no prefill workers available (none registered)")
	}
	req := e.newPolicyRequest(st, e.policyHeaders(r), c, exclude)
	ch, err := e.o.PrefillPolicy.Pick(req, policy.Candidates{Gen: snap.Gen, Workers: snap.Prefill})
	if err != nil || ch.Worker == nil || !req.Usable(ch.Worker) || ch.Worker.Role != worker.RolePrefill {
		return nil, "", sel(describe("prefill", snap.Prefill, exclude, ""))
	}
	return ch.Worker, ch.Reason, nil
}

// plainAttempt sends the client's body to pr.P, a worker of role legName
// ("prefill", or "decode" for a prefill bypass), and relays the answer. It
// returns nil when a response was written to the client.
func (e *Engine) plainAttempt(ctx context.Context, w http.ResponseWriter, st *reqState, pr *Pair, legName string, body []byte) *failure {
	pl := plainLeg{e: e, st: st, pr: pr, name: legName, who: legName + " worker " + pr.P.Key()}
	l, ok := e.startLeg(ctx, legName, pr.P, st, pr)
	if !ok {
		return &failure{leg: legName, reason: "breaker_open", w: pr.P, status: http.StatusServiceUnavailable, retry: true,
			errType: "server_selection", msg: pl.who + " circuit breaker is open"}
	}
	pl.l = l
	resp, f := pl.send(ctx, body)
	if f != nil {
		return f
	}
	defer resp.Body.Close()
	tracing.SetStatus(l.span, resp.StatusCode)
	if s := resp.StatusCode; s >= 500 || s == http.StatusTooManyRequests || s == http.StatusRequestTimeout {
		return pl.retryable(resp)
	}
	// Commit: 2xx, or a client error relayed as is.
	res, sse := pl.relay(ctx, w, resp)
	pl.settle(ctx, w, res, sse)
	return nil
}

// plainLeg is the one leg of an unsplit request (plainAttempt).
type plainLeg struct {
	e    *Engine
	st   *reqState
	pr   *Pair
	l    *leg
	name string // "prefill" or "decode"
	who  string // "<name> worker <url>", for messages
}

// send sends the request; a failure before an answer is retryable.
func (pl *plainLeg) send(ctx context.Context, body []byte) (*http.Response, *failure) {
	e, pr := pl.e, pl.pr
	prof := e.newProfiler(pr)
	defer prof.stopAll()
	req, err := e.newLegRequest(ctx, pl.st, pr, pl.l, pr.PRank, rawjson.Whole(body), nil)
	if err != nil {
		e.legFailed(pl.l, "error", err)
		return nil, &failure{leg: pl.name, reason: "error", w: pr.P, status: http.StatusBadGateway, retry: true, errType: pl.name, msg: pl.who + ": " + err.Error()}
	}
	prof.start(pr.P)
	resp, err := e.o.Client.Do(req)
	prof.stop(pr.P)
	if err == nil {
		return resp, nil
	}
	if ctx.Err() != nil {
		pl.l.finish(true)
		return nil, e.ctxFailure(ctx, pl.st, nil)
	}
	reason := "error"
	if proxy.IsDialError(err) {
		reason = "connect"
	}
	e.legFailed(pl.l, reason, err)
	return nil, &failure{leg: pl.name, reason: reason, w: pr.P, status: http.StatusBadGateway, retry: true,
		errType: pl.name, msg: fmt.Sprintf("%s failed before answering: %v", pl.who, unwrapURL(err))}
}

// retryable turns a 5xx, 429 or 408 answer into a retryable failure that
// keeps the answer, relayed if no other worker takes the request.
func (pl *plainLeg) retryable(resp *http.Response) *failure {
	s := resp.StatusCode
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	pl.e.legFailed(pl.l, "status", nil)
	return &failure{leg: pl.name, reason: "status", w: pl.pr.P, status: s, retry: true, errType: pl.name,
		msg:   fmt.Sprintf("%s returned HTTP %d: %s", pl.who, s, snippet(data)),
		relay: &buffered{status: s, header: resp.Header, body: data}}
}

// relay writes the answer to the client, its usage counted as the whole
// generation's (nothing was split).
func (pl *plainLeg) relay(ctx context.Context, w http.ResponseWriter, resp *http.Response) (res proxy.RelayResult, sse bool) {
	e, st := pl.e, pl.st
	sse = strings.HasPrefix(strings.ToLower(resp.Header.Get("Content-Type")), "text/event-stream")
	if e.m != nil {
		e.observe(e.m.PDRequestDur, e.o.Now().Sub(st.start).Seconds(), st.route)
	}
	h := w.Header()
	proxy.CopyResponseHeaders(h, resp.Header)
	if !sse && resp.ContentLength >= 0 {
		h.Set("Content-Length", strconv.FormatInt(resp.ContentLength, 10))
	}
	w.WriteHeader(resp.StatusCode)
	_ = http.NewResponseController(w).Flush()
	observeUsage, finishUsage := proxy.NewUsageObserver(e.m)
	res = proxy.Relay(ctx, w, resp.Body, proxy.RelayOptions{
		IdleTimeout: e.o.StreamIdleTimeout,
		Stream:      sse,
		Observe:     observeUsage,
		OnFirstByte: func() {
			if st.firstByte != nil {
				st.firstByte()
			}
			if e.m != nil && sse {
				e.observe(e.m.TTFT, e.o.Now().Sub(st.start).Seconds(), st.route, "pd")
			}
		},
	})
	finishUsage(res.UpstreamErr == nil && res.DownstreamOK && resp.StatusCode < 300)
	return res, sse
}

// settle ends the leg after its answer was relayed, and a stream that
// broke after the commit with an SSE error event (a body short of its
// Content-Length makes the server close the connection instead).
func (pl *plainLeg) settle(ctx context.Context, w http.ResponseWriter, res proxy.RelayResult, sse bool) {
	e, l := pl.e, pl.l
	var reason, msg string
	status := http.StatusBadGateway
	switch {
	case res.UpstreamErr == nil && res.DownstreamOK:
		l.finish(true)
		return
	case pl.st.cli.Err() != nil:
		l.finish(true)
		e.countErr("client_disconnect")
		return
	case ctx.Err() == context.DeadlineExceeded:
		reason, status = "request_timeout", http.StatusGatewayTimeout
		msg = fmt.Sprintf("request timed out after %s while %s was answering", e.o.RequestTimeout, pl.who)
		l.finish(true)
	case errors.Is(res.UpstreamErr, proxy.ErrIdleTimeout):
		reason, status = "idle_timeout", http.StatusGatewayTimeout
		msg = fmt.Sprintf("%s stream was idle for more than %s", pl.who, e.o.StreamIdleTimeout)
		e.legFailed(l, reason, nil)
	default:
		reason = "stream"
		msg = fmt.Sprintf("%s response failed: %v", pl.who, res.UpstreamErr)
		e.legFailed(l, reason, res.UpstreamErr)
	}
	e.log.Warn("pd unsplit response failed after commit", pl.name, pl.pr.P.Key(), "reason", reason, "err", res.UpstreamErr)
	e.countErr(reason)
	if sse {
		_ = proxy.WriteSSEError(w, res, status, msg)
	}
}

// writePrefillAnswer answers a non-streaming request with P's own response
// when P's first token ended the generation (see stoppedAtFirstToken): no
// decode is sent, and the receipt says why.
func (e *Engine) writePrefillAnswer(w http.ResponseWriter, st *reqState, body []byte) {
	if rc := st.rc; rc != nil {
		rc.Decode = ""
		rc.Reason += "; answered by the prefill alone: its first token ended the generation (finish_reason stop, kv_transfer_params null), no decode needed"
	}
	if e.m != nil {
		e.observe(e.m.PDRequestDur, e.o.Now().Sub(st.start).Seconds(), st.route)
	}
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}
