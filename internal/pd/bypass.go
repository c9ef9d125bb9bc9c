package pd

import (
	"context"
	"fmt"
	"net/http"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Conditional disaggregation. With a KV-aware policy, the router knows how
// much of a prompt a decode worker already holds; when what is left to
// compute is small (fewer than BypassThreshold tokens), a prefill and a KV
// transfer cost more than the decode computing it itself, so the request
// goes to the decode alone as a plain request (vllm-router PR #130's
// --pd-uncached-token-threshold, Dynamo's conditional disaggregation).
// The prompts a decode is already computing for other bypassed requests
// count too (bypassload.go): a request waits behind them, so the decode's
// pending tokens plus this request's must stay below the threshold. Under
// load the decodes therefore take what they can compute quickly and the
// rest is split, instead of every decode queueing prefills behind its
// streams.

// cacheReporter is implemented by KV-aware policies (kvaware.Policy).
type cacheReporter interface {
	CachedBlocks(req *policy.Request) map[string]int
	BlockSize() int
	CountBypass()
	CountBypassDeferred()
}

// prepare runs the prefill policy's Prepare (tokenizing the prompt) once
// per request; the tokens serve every later pick of the request.
func (e *Engine) prepare(ctx context.Context, r *http.Request, c *proxy.Call, st *reqState) {
	if _, ok := e.o.PrefillPolicy.(policy.Preparer); !ok {
		if _, ok := e.o.DecodePolicy.(policy.Preparer); !ok {
			return
		}
	}
	snap := e.o.Registry.Snapshot()
	req := &policy.Request{Path: st.path, Headers: e.policyHeaders(r), Body: c.Body, Obj: c.Obj}
	policy.Prepare(ctx, e.o.PrefillPolicy, req, policy.Candidates{Gen: snap.Gen, Workers: snap.Prefill})
	if req.Prepared == nil {
		policy.Prepare(ctx, e.o.DecodePolicy, req, policy.Candidates{Gen: snap.Gen, Workers: snap.Decode})
	}
	st.tokens, st.prepared = req.Tokens, req.Prepared
}

// newPolicyRequest is a policy request for this request's picks.
func (e *Engine) newPolicyRequest(st *reqState, hdr http.Header, c *proxy.Call, exclude map[string]bool) *policy.Request {
	return &policy.Request{Path: st.path, Headers: hdr, Body: c.Body, Obj: c.Obj, Exclude: exclude, Tokens: st.tokens, Prepared: st.prepared}
}

// bypass serves the request on a decode worker alone when its prompt is
// (almost) all cached there. It reports whether a response was written;
// when the decode fails before answering, the caller splits as usual.
func (e *Engine) bypass(ctx context.Context, w http.ResponseWriter, r *http.Request, c *proxy.Call, st *reqState) bool {
	if e.o.BypassThreshold <= 0 || st.tokens == nil {
		return false
	}
	rep, ok := e.o.DecodePolicy.(cacheReporter)
	if !ok {
		if rep, ok = e.o.PrefillPolicy.(cacheReporter); !ok {
			return false
		}
	}
	snap := e.o.Registry.Snapshot()
	req := e.newPolicyRequest(st, e.policyHeaders(r), c, nil)
	// What the decodes hold before this request's own pick adds its
	// speculative entry.
	held := rep.CachedBlocks(req)
	d, err := e.o.DecodePolicy.Pick(req, policy.Candidates{Gen: snap.Gen, Workers: snap.Decode})
	if err != nil || d.Worker == nil || d.Worker.Role != worker.RoleDecode || !req.Usable(d.Worker) {
		return false
	}
	n := len(st.tokens)
	cached := held[d.Worker.Key()] * rep.BlockSize()
	uncached := n - cached
	pending, release, ok := e.bypassing.reserve(d.Worker.Key(), uncached, e.o.BypassThreshold)
	if !ok {
		if uncached < e.o.BypassThreshold {
			rep.CountBypassDeferred()
			st.deferred = fmt.Sprintf("not bypassed: decode %s is computing %d prompt tokens for other bypassed requests, with this one's %d uncached not below --pd-uncached-token-threshold %d",
				d.Worker.Key(), pending, uncached, e.o.BypassThreshold)
		}
		return false
	}
	defer release()
	st.firstByte = release
	defer func() { st.firstByte = nil }()
	rc := st.rc
	rc.Attempts++
	st.attempt = rc.Attempts
	rc.Prefill, rc.Decode = "", d.Worker.Key()
	rc.Reason = fmt.Sprintf("bypass: %d of %d prompt tokens uncached on the decode, %d more being computed there for other bypassed requests (< --pd-uncached-token-threshold %d together), served by the decode alone; decode: %s",
		uncached, n, pending, e.o.BypassThreshold, d.Reason)
	pr := &Pair{P: d.Worker, PRank: e.rank(d.Worker), DRank: -1, RequestID: c.RequestID}
	if pr.RequestID == "" {
		pr.RequestID = hex32(asV4(e.o.NewID()))
	}
	f := e.plainAttempt(ctx, w, st, pr, "decode", c.Body)
	if f == nil {
		rep.CountBypass()
		return true
	}
	e.log.Warn("pd bypass to the decode failed before answering, splitting", "decode", d.Worker.Key(), "reason", f.reason, "err", f.msg)
	rc.Failovers = append(rc.Failovers, "bypass decode "+d.Worker.Key()+": "+f.reason)
	return false
}
