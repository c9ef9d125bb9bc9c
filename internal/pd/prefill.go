package pd

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
)

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
func (e *Engine) runPrefill(ctx, pctx context.Context, st *reqState, pr *Pair, l *leg, body rawjson.Spliced, hs *legHeaders) prefillOut {
	req, f := e.prefillRequest(pctx, st, pr, l, body, hs)
	if f != nil {
		return prefillOut{fail: f, dur: e.o.Now().Sub(l.sent)}
	}
	resp, err := e.do(req)
	return e.prefillResult(ctx, pctx, pr, l, resp, err)
}

// prefillRequest builds the prefill leg's request.
func (e *Engine) prefillRequest(pctx context.Context, st *reqState, pr *Pair, l *leg, body rawjson.Spliced, hs *legHeaders) (*http.Request, *failure) {
	req, err := e.newLegRequest(pctx, st, pr, l, pr.PRank, body, hs)
	if err != nil {
		e.legFailed(l, "error", err)
		return nil, &failure{leg: "prefill", reason: "error", w: pr.P, status: http.StatusBadGateway, retry: true, errType: "prefill", msg: "prefill worker " + pr.P.Key() + ": " + err.Error()}
	}
	return req, nil
}

// prefillResult reads P's answer to the prefill (resp and err as the
// client returned them) and checks it.
func (e *Engine) prefillResult(ctx, pctx context.Context, pr *Pair, l *leg, resp *http.Response, err error) (out prefillOut) {
	who := func() string { return "prefill worker " + pr.P.Key() } // for failures only
	defer func() { out.dur = e.o.Now().Sub(l.sent) }()
	classify := func(err error, during string) *failure {
		switch {
		case ctx.Err() != nil || (pctx.Err() == context.Canceled):
			// the client left, the request deadline passed, or the
			// sibling leg failed: not this worker's fault
			l.finish(true)
			return &failure{leg: "prefill", reason: "canceled", w: pr.P, status: proxy.StatusClientClosed, msg: who() + ": canceled"}
		case pctx.Err() == context.DeadlineExceeded:
			e.legFailed(l, "timeout", err)
			return &failure{leg: "prefill", reason: "timeout", w: pr.P, status: http.StatusGatewayTimeout, retry: true,
				errType: "prefill_timeout", msg: fmt.Sprintf("%s did not complete the prefill within %s", who(), e.o.PrefillTimeout)}
		case proxy.IsDialError(err):
			e.legFailed(l, "connect", err)
			return &failure{leg: "prefill", reason: "connect", w: pr.P, status: http.StatusBadGateway, retry: true,
				errType: "prefill", msg: fmt.Sprintf("%s unreachable: %v", who(), unwrapURL(err))}
		}
		e.legFailed(l, "error", err)
		return &failure{leg: "prefill", reason: "error", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s failed %s: %v", who(), during, unwrapURL(err))}
	}
	if err != nil {
		return prefillOut{fail: classify(err, "before answering")}
	}
	tracing.SetStatus(l.span, resp.StatusCode)
	data, err := readPrefillBody(resp)
	resp.Body.Close()
	if err != nil {
		return prefillOut{fail: classify(err, "while sending its response")}
	}
	if resp.StatusCode/100 != 2 {
		if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusRequestTimeout {
			e.legFailed(l, "status", nil)
			return prefillOut{fail: &failure{leg: "prefill", reason: "status", w: pr.P, status: http.StatusBadGateway, retry: true,
				errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d: %s", who(), resp.StatusCode, snippet(data))}}
		}
		// a client error (bad request, prompt too long): relay it as is
		l.finish(true)
		if e.m != nil {
			e.m.PDLegErrors.WithLabelValues("prefill", "status_4xx").Inc()
		}
		return prefillOut{fail: &failure{leg: "prefill", reason: "status_4xx", w: pr.P, status: resp.StatusCode,
			errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d: %s", who(), resp.StatusCode, snippet(data)),
			relay: &buffered{status: resp.StatusCode, header: resp.Header, body: limit(data, maxErrorBody)}}}
	}
	if len(data) > maxPrefillBody {
		e.legFailed(l, "bad_response", nil)
		return prefillOut{fail: &failure{leg: "prefill", reason: "bad_response", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s returned a response larger than %d bytes", who(), maxPrefillBody)}}
	}
	params, err := rawjson.Lookup(data, "kv_transfer_params")
	if err != nil {
		e.legFailed(l, "bad_response", nil)
		return prefillOut{fail: &failure{leg: "prefill", reason: "bad_response", w: pr.P, status: http.StatusBadGateway, retry: true,
			errType: "prefill", msg: fmt.Sprintf("%s returned HTTP %d with a body that is not a JSON object (%v): %s; the decode was not sent",
				who(), resp.StatusCode, err, snippet(data))}}
	}
	l.finish(true)
	return prefillOut{body: data, params: params}
}

// readPrefillBody reads P's answer, at most maxPrefillBody+1 bytes: one
// buffer of the declared length when there is one (P's answer is a small
// JSON object; io.ReadAll grows from 512 bytes in steps).
func readPrefillBody(resp *http.Response) ([]byte, error) {
	if n := resp.ContentLength; n >= 0 && n <= maxPrefillBody {
		data := make([]byte, n)
		k, err := io.ReadFull(resp.Body, data)
		if err == io.EOF {
			err = io.ErrUnexpectedEOF // declared bytes that never came
		}
		return data[:k], err
	}
	return io.ReadAll(io.LimitReader(resp.Body, maxPrefillBody+1))
}
