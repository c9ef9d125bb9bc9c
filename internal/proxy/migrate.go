package proxy

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/migrate"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// migration is one streamed answer that may move to another worker.
type migration struct {
	req  *migrate.Request // set by continueStream
	tr   *migrate.Tracker
	w    *migrate.Writer
	done int // migrations so far
}

// startMigration returns the migration state of a streamed generation
// whose response can be continued elsewhere, or nil (migration off, not a
// 200 event stream).
func (p *Regular) startMigration(rs *reqSpec, w http.ResponseWriter, resp *http.Response) *migration {
	if p.o.MaxMigrations <= 0 || !rs.gen || resp.StatusCode != http.StatusOK || !isSSE(resp.Header) {
		return nil
	}
	tr := migrate.NewTracker()
	return &migration{tr: tr, w: migrate.NewWriter(w, tr)}
}

// finish ends a relayed leg and says why it did not end the answer (""
// when it did). The client saw whole events only, so res is marked at an
// event boundary (an error event written after it needs no separator).
func (m *migration) finish(res *RelayResult) string {
	c := MigrationCause(*res, m.w, m.tr)
	if c == "" && res.DownstreamOK && res.UpstreamErr == nil && !m.w.Ended() {
		m.w.Finish()
	}
	res.AtEventBoundary = true
	return c
}

// MigrationCause says why a relayed leg of a migratable stream did not end the
// answer: "" when it did, or when the client went away or the request
// deadline passed (nothing to continue for).
func MigrationCause(res RelayResult, w *migrate.Writer, tr *migrate.Tracker) string {
	switch {
	case !res.DownstreamOK && !w.Ended(), errors.Is(res.UpstreamErr, context.DeadlineExceeded), errors.Is(res.UpstreamErr, context.Canceled):
		return ""
	case w.Ended():
		return ""
	case errors.Is(res.UpstreamErr, ErrIdleTimeout):
		return migrate.CauseIdle
	case w.Held():
		return migrate.CauseEngineError
	case res.UpstreamErr != nil || !tr.Done():
		return migrate.CauseBroken
	}
	return ""
}

// continueStream carries on a streamed answer whose worker failed after
// the client got its first bytes: another worker generates the rest
// (prompt + answer so far), its events rewritten into the original's, up
// to --max-migrations times and never past the request deadline. It ends
// the client's stream in every case: completed, or with the SSE error
// event when the answer cannot be continued.
func (p *Regular) continueStream(ctx context.Context, w http.ResponseWriter, rs *reqSpec, failed *worker.Worker, m *migration, cause string, brokeErr error) {
	rec := rs.receipt
	if rec == nil {
		rec = &Receipt{}
	}
	m.req = migrate.NewRequest(rs.route, rs.body) // parsed only when needed
	for {
		rec.Migrated = append(rec.Migrated, failed.Key())
		p.exclude(&rs.preq, failed)
		result, next, leg := p.migrateOnce(ctx, w, rs, m, cause)
		p.o.MigrationMetrics.Count(rs.route, cause, result)
		switch result {
		case migrate.ResultContinued, migrate.ResultComplete:
			return
		case migrate.ResultFailed:
			failed, cause = next, leg
			continue
		}
		if result == "client_gone" {
			return
		}
		p.log.Warn("stream not continued", "route", rs.route, "worker", failed.Key(), "result", result, "err", brokeErr)
		status := http.StatusBadGateway
		if result == migrate.ResultTimeout {
			status = http.StatusGatewayTimeout
		}
		_ = WriteSSEError(w, RelayResult{AtEventBoundary: true}, status, "upstream stream broken ("+cause+"), not continued: "+result)
		return
	}
}

// migrateOnce runs one continuation leg. It returns the result; for
// ResultFailed, the worker that failed and the new cause.
func (p *Regular) migrateOnce(ctx context.Context, w http.ResponseWriter, rs *reqSpec, m *migration, cause string) (string, *worker.Worker, string) {
	if why := m.req.Refusal(m.tr); why != "" {
		return "refused_" + why, nil, ""
	}
	if m.done >= p.o.MaxMigrations {
		return migrate.ResultExhausted, nil, ""
	}
	if ctx.Err() != nil {
		return migrate.ResultTimeout, nil, ""
	}
	if m.req.Complete(m.tr) {
		_, _ = w.Write(m.req.Ending(m.tr))
		_ = http.NewResponseController(w).Flush()
		return migrate.ResultComplete, nil, ""
	}
	body, err := m.req.Continue(m.tr)
	if err != nil {
		return "refused_" + migrate.RefuseBody, nil, ""
	}
	choice, err := p.pick(&rs.preq)
	if err != nil {
		return migrate.ResultNoWorker, nil, ""
	}
	wk := choice.Worker
	ticket, ok := wk.Breaker().Begin()
	if !ok {
		return migrate.ResultNoWorker, nil, ""
	}
	m.done++
	ctx, span := startMigrationSpan(ctx, rs, wk, cause, m)
	defer span.End()
	slot := p.startSlot(wk, ticket, nil, rs)
	defer slot.release()
	crs := *rs
	crs.body = body
	rec := rs.receipt
	attempt := 2
	if rec != nil {
		rec.Worker, rec.Reason = wk.Key(), "migration: "+cause
		rec.Attempts++
		attempt = max(2, rec.Attempts)
	}
	resp, actx, acancel, err := p.roundTrip(ctx, wk, &crs, attempt)
	defer acancel()
	if err != nil {
		slot.outcome(ctx.Err() != nil)
		if IsDialError(err) {
			p.markDown(wk, err)
		}
		span.SetStatus(codes.Error, err.Error())
		if ctx.Err() != nil {
			return migrate.ResultTimeout, nil, ""
		}
		return migrate.ResultFailed, wk, migrate.CauseNoResponse
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !isSSE(resp.Header) {
		f := p.drain(resp)
		slot.outcome(resp.StatusCode < 500)
		span.SetStatus(codes.Error, "status "+strconv.Itoa(f.status))
		return migrate.ResultFailed, wk, migrate.CauseNoResponse
	}
	cut := m.tr.LastWrite()
	m.w.StartLeg(migrate.NewStitcher(m.req, m.tr), func() { p.o.MigrationMetrics.ObserveStall(time.Since(cut)) })
	res := Relay(actx, m.w, resp.Body, RelayOptions{IdleTimeout: p.o.StreamIdleTimeout, Stream: true, OnFirstByte: slot.ws.FirstByte})
	next := m.finish(&res)
	switch {
	case m.w.Ended() || (next == "" && res.DownstreamOK):
		slot.outcome(true)
		return migrate.ResultContinued, nil, ""
	case !res.DownstreamOK:
		slot.outcome(true) // the client went away: says nothing about the worker
		return "client_gone", nil, ""
	case errors.Is(res.UpstreamErr, context.DeadlineExceeded):
		slot.outcome(false)
		return migrate.ResultTimeout, nil, ""
	}
	slot.outcome(false)
	span.SetStatus(codes.Error, next)
	return migrate.ResultFailed, wk, next
}

// startMigrationSpan starts a span for one migration under the request's
// span (a no-op span when tracing is off).
func startMigrationSpan(ctx context.Context, rs *reqSpec, wk *worker.Worker, cause string, m *migration) (context.Context, trace.Span) {
	tr := trace.SpanFromContext(ctx).TracerProvider().Tracer("switchyard/migrate")
	return tr.Start(ctx, "migration", trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(
		attribute.String("switchyard.migration.cause", cause),
		attribute.String("switchyard.migration.worker", wk.Key()),
		attribute.Int("switchyard.migration.number", m.done),
		attribute.Int("switchyard.migration.tokens_before", m.tr.Tokens()),
		attribute.String("http.route", rs.route),
	))
}

// retryWhole decides whether a generation whose worker failed before
// sending its response headers (a worker killed while computing a
// non-streaming answer, or before a stream's first byte) is sent again,
// whole, to another worker: nothing reached the client, so the retry is
// the exact answer. It counts against --max-migrations.
func (p *Regular) retryWhole(ctx context.Context, rs *reqSpec, failed *worker.Worker, err error) (policy.Choice, bool) {
	if p.o.MaxMigrations <= 0 || !rs.gen || !rs.replayable() || ctx.Err() != nil || rs.moved >= p.o.MaxMigrations {
		return policy.Choice{}, false
	}
	p.exclude(&rs.preq, failed)
	next, perr := p.pick(&rs.preq)
	if perr != nil {
		p.o.MigrationMetrics.Count(rs.route, migrate.CauseNoResponse, migrate.ResultNoWorker)
		return policy.Choice{}, false
	}
	rs.moved++
	p.o.MigrationMetrics.Count(rs.route, migrate.CauseNoResponse, migrate.ResultRetried)
	p.log.Info("worker failed before its response; retrying the whole request elsewhere", "route", rs.route, "worker", failed.Key(), "next", next.Worker.Key(), "err", err)
	return next, true
}
