package pd

import (
	"context"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/migrate"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// pdMigration is a streamed PD answer that may move to another pair when
// its decode fails after the first byte: a new prefill of the prompt plus
// the answer so far, then a decode, relayed through the stitcher.
type pdMigration struct {
	r     *http.Request
	c     *proxy.Call
	route string
	req   *migrate.Request // parsed by continueAnswer, only when needed
	tr    *migrate.Tracker // with w
	w     *migrate.Writer  // nil until the first decode relay
	cli   http.ResponseWriter
	n     int // migrations so far

	// Set while a continuation attempt runs: the leg's outcome, read by
	// continueAnswer once the attempt returns.
	active  bool
	legDone bool
	cause   string
	failed  *worker.Worker
}

// startMigration prepares the migration state of a streamed completion or
// chat request (nil: migration off or not applicable).
func (e *Engine) startMigration(r *http.Request, c *proxy.Call, st *reqState) *pdMigration {
	if e.o.MaxMigrations <= 0 || !st.stream || st.warmup || (st.kind != routeCompletions && st.kind != routeChat) {
		return nil
	}
	route := "/v1/completions"
	if st.kind == routeChat {
		route = "/v1/chat/completions"
	}
	return &pdMigration{r: r, c: c, route: route}
}

// migWriter is the writer the decode is relayed to: the migration's
// tracking writer for a 200 event stream of a migratable request (created
// on the first leg), else w.
func (e *Engine) migWriter(st *reqState, w http.ResponseWriter, resp *http.Response) http.ResponseWriter {
	m := st.mig
	if m == nil || resp.StatusCode != http.StatusOK || !isEventStream(resp.Header) {
		return w
	}
	if m.w == nil { // the tracker too: a stream waiting for its KV holds none
		m.cli = w
		m.tr = migrate.NewTracker()
		m.w = migrate.NewWriter(w, m.tr)
	}
	return m.w
}

func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return len(ct) >= len("text/event-stream") && ct[:len("text/event-stream")] == "text/event-stream"
}

// migrateAfterRelay handles a decode relay of a migratable stream that did
// not end the answer: the decode's breaker sees the failure and the answer
// continues on another pair. It returns true when it took over the end of
// the response (the attempt then returns nil).
func (e *Engine) migrateAfterRelay(ctx context.Context, res *proxy.RelayResult, st *reqState, pr *Pair, dl *leg) bool {
	m := st.mig
	if m == nil || m.w == nil {
		return false
	}
	cause := proxy.MigrationCause(*res, m.w, m.tr)
	if cause == "" && res.DownstreamOK && res.UpstreamErr == nil && !m.w.Ended() {
		m.w.Finish()
	}
	// The client saw whole events only.
	res.AtEventBoundary = true
	if m.active { // a continuation leg: continueAnswer decides
		m.legDone, m.cause, m.failed = true, cause, pr.D
		if cause != "" {
			e.legFailed(dl, "stream", res.UpstreamErr)
		} else {
			dl.finish(true)
		}
		return true
	}
	if cause == "" {
		return false
	}
	e.legFailed(dl, "stream", res.UpstreamErr)
	e.log.Warn("pd decode failed mid-stream; continuing on another pair", "decode", pr.D.Key(), "cause", cause, "err", res.UpstreamErr)
	e.continueAnswer(ctx, st, pr.D, cause)
	return true
}

// continueAnswer runs continuation attempts until the answer is complete,
// cannot be continued (the SSE error event, as without migration), the
// --max-migrations budget is spent or the request deadline passes.
func (e *Engine) continueAnswer(ctx context.Context, st *reqState, failed *worker.Worker, cause string) {
	m := st.mig
	if m.req == nil {
		m.req = migrate.NewRequest(m.route, st.obj.Source())
	}
	exclude := map[string]bool{}
	for {
		e.excludeInstance(exclude, failed)
		st.rc.Migrated = append(st.rc.Migrated, failed.Key())
		result, next, nextCause := e.migrateOnce(ctx, st, exclude, cause)
		e.o.MigrationMetrics.Count(st.route, cause, result)
		switch result {
		case migrate.ResultContinued, migrate.ResultComplete, "client_gone":
			return
		case migrate.ResultFailed:
			failed, cause = next, nextCause
			continue
		}
		e.log.Warn("pd stream not continued", "route", st.route, "decode", failed.Key(), "result", result)
		status := http.StatusBadGateway
		if result == migrate.ResultTimeout {
			status = http.StatusGatewayTimeout
		}
		e.countErr("stream")
		_ = proxy.WriteSSEError(m.cli, proxy.RelayResult{AtEventBoundary: true}, status, "decode stream broken ("+cause+"), not continued: "+result)
		return
	}
}

// excludeInstance keeps the continuation off w and its DP siblings.
func (e *Engine) excludeInstance(ex map[string]bool, w *worker.Worker) {
	ex[w.Key()] = true
	if w.Instance != "" {
		for _, s := range e.o.Registry.Instance(w.Instance) {
			ex[s.Key()] = true
		}
	}
}

// migrateOnce runs one continuation: a full PD attempt (prefill of prompt
// + answer so far, then decode) whose decode stream goes through the
// stitcher into the client's stream.
func (e *Engine) migrateOnce(ctx context.Context, st *reqState, exclude map[string]bool, cause string) (string, *worker.Worker, string) {
	m := st.mig
	if why := m.req.Refusal(m.tr); why != "" {
		return "refused_" + why, nil, ""
	}
	if m.n >= e.o.MaxMigrations {
		return migrate.ResultExhausted, nil, ""
	}
	if ctx.Err() != nil {
		return migrate.ResultTimeout, nil, ""
	}
	if m.req.Complete(m.tr) {
		_, _ = m.cli.Write(m.req.Ending(m.tr))
		_ = http.NewResponseController(m.cli).Flush()
		return migrate.ResultComplete, nil, ""
	}
	body, err := m.req.Continue(m.tr)
	var obj *rawjson.Object
	if err == nil {
		obj, err = rawjson.Parse(body)
	}
	if err != nil {
		return "refused_" + migrate.RefuseBody, nil, ""
	}
	cst := *st
	cst.obj, cst.merge, cst.tokens, cst.prepared = obj, false, nil, nil
	pr, pf := e.pickPair(m.r, m.c, &cst, exclude)
	if pf != nil {
		return migrate.ResultNoWorker, nil, ""
	}
	m.n++
	st.rc.Attempts++
	cst.attempt = st.rc.Attempts
	st.rc.Prefill, st.rc.Decode, st.rc.Reason = pr.P.Key(), pr.D.Key(), "migration: "+cause

	sctx, span := trace.SpanFromContext(ctx).TracerProvider().Tracer("switchyard/migrate").Start(ctx, "migration",
		trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
			attribute.String("switchyard.migration.cause", cause),
			attribute.String("switchyard.migration.prefill", pr.P.Key()),
			attribute.String("switchyard.migration.decode", pr.D.Key()),
			attribute.Int("switchyard.migration.number", m.n),
			attribute.Int("switchyard.migration.tokens_before", m.tr.Tokens()),
			attribute.String("http.route", st.route)))
	defer span.End()
	_ = sctx

	cut := m.tr.LastWrite()
	m.w.StartLeg(migrate.NewStitcher(m.req, m.tr), func() { e.o.MigrationMetrics.ObserveStall(time.Since(cut)) })
	m.active, m.legDone, m.cause, m.failed = true, false, "", nil
	f := e.attempt(ctx, m.w, &cst, &pr.Pair)
	m.active = false
	switch {
	case f != nil: // failed before its first byte (prefill or decode)
		span.SetStatus(codes.Error, f.reason)
		if ctx.Err() != nil || st.cli.Err() != nil {
			return migrate.ResultTimeout, nil, ""
		}
		w := f.w
		if w == nil {
			w = pr.D
		}
		return migrate.ResultFailed, w, migrate.CauseNoResponse
	case st.cli.Err() != nil:
		return "client_gone", nil, ""
	case m.legDone && m.cause != "":
		span.SetStatus(codes.Error, m.cause)
		return migrate.ResultFailed, m.failed, m.cause
	case m.legDone:
		return migrate.ResultContinued, nil, ""
	}
	// the attempt ended without relaying a stream (the request deadline,
	// a non-SSE answer): nothing more can be written
	if ctx.Err() != nil {
		return migrate.ResultTimeout, nil, ""
	}
	return migrate.ResultContinued, nil, ""
}
