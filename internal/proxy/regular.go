package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/migrate"
	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// RegularOptions configures a Regular dispatcher.
type RegularOptions struct {
	Registry *worker.Registry
	// Role selects the workers: worker.RoleRegular, or worker.RolePrefill
	// for the pass-through routes of PD mode.
	Role   worker.Role
	Policy policy.Policy
	// Client supplies the shared upstream transport (NewTransport); its
	// Transport is used directly, so redirects are relayed, never followed.
	// It must have no Timeout: deadlines come from RequestTimeout.
	Client *http.Client
	// APIKey, when set, is sent upstream as "Authorization: Bearer <key>".
	APIKey string
	// ForwardClientAuth forwards the client's Authorization header when
	// APIKey is unset; otherwise it is dropped.
	ForwardClientAuth bool
	Retry             RetryConfig
	// RequestTimeout is the overall per-request deadline, measured from
	// Call.Start and covering retries, backoff and the streamed body
	// (0 = none).
	RequestTimeout time.Duration
	// HeaderTimeout bounds the wait for response headers of a streaming
	// request; when it passes the attempt is abandoned and retried
	// elsewhere (0 = none). Non-streaming generations send headers only
	// when done, so it never applies to them.
	HeaderTimeout time.Duration
	// StreamIdleTimeout aborts a streamed (SSE) response whose upstream
	// sends nothing for this long (0 = none).
	StreamIdleTimeout time.Duration
	// HashHeaders, when non-empty, are the only request headers shown to
	// the policy (policy.Request.Headers); otherwise it sees all of them.
	HashHeaders []string
	// Panic routes to the registered workers when none is available (nil =
	// off; worker.Panic).
	Panic   *worker.Panic
	Metrics *metrics.Metrics
	Logger  *slog.Logger
	// MaxMigrations is how many times an answer whose worker failed
	// mid-way may move to another worker (0 = off; migrate.go).
	MaxMigrations    int
	MigrationMetrics *migrate.Metrics
	// Steer, when set, narrows each pick first (flow control's prefill
	// rules); a pick it narrows to nothing is made without it.
	Steer Steerer
}

// Steerer returns the workers a pick should avoid for req (a superset of
// req.Exclude), or nil to pick without narrowing.
type Steerer interface {
	Steer(ws []*worker.Worker, req *policy.Request) map[string]bool
}

// Regular is the regular-mode dispatcher: it routes each generation request
// to one worker chosen by the policy, retrying on another worker before the
// first byte reaches the client. It also serves the transparent pass-through
// of every other route.
type Regular struct {
	o      RegularOptions
	rt     http.RoundTripper
	auth   []string // upstream Authorization value when APIKey is set
	budget *retryBudget
	rand   func() float64
	log    *slog.Logger
	m      *metrics.Metrics
	role   string
	// Hot-path metric children with fixed labels, looked up once.
	inflightRole prometheus.Gauge
	ttft         sync.Map // route -> prometheus.Observer (mode "regular")
}

var _ Dispatcher = (*Regular)(nil)

// NewRegular builds a Regular dispatcher.
func NewRegular(o RegularOptions) *Regular {
	if o.Retry.MaxAttempts < 1 {
		o.Retry.MaxAttempts = 1
	}
	p := &Regular{o: o, rand: defaultRand, m: o.Metrics, log: o.Logger, role: o.Role.String()}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if o.Client != nil && o.Client.Transport != nil {
		p.rt = o.Client.Transport
	} else {
		p.rt = http.DefaultTransport
	}
	if o.APIKey != "" {
		p.auth = []string{"Bearer " + o.APIKey}
	}
	p.budget = newRetryBudget(o.Retry, nil)
	if p.m != nil {
		p.inflightRole = p.m.WorkerInFlight.WithLabelValues(p.role)
		p.m.Tokens() // the series are exported from the start
	}
	return p
}

// ttftFor is the TTFT histogram of route (looked up once per route; the
// routes are the server's fixed set).
func (p *Regular) ttftFor(route string) prometheus.Observer {
	if o, ok := p.ttft.Load(route); ok {
		return o.(prometheus.Observer)
	}
	o := p.m.TTFT.WithLabelValues(route, "regular")
	p.ttft.Store(route, o)
	return o
}

// reqSpec is what an attempt sends upstream.
type reqSpec struct {
	method    string
	pathQuery string      // escaped path and "?query" if any
	header    http.Header // filtered client headers (shared by attempt 1)
	body      []byte      // replayable body (generation routes)
	stream    *streamBody // or the client's body streamed (pass-through)
	length    int64       // stream length, -1 unknown
	sse       bool        // the client asked for a stream
	gen       bool        // a generation route (Dispatch), not a pass-through
	route     string      // metrics label
	receipt   *Receipt
	start     time.Time
	preq      policy.Request
	moved     int       // whole-request retries after a failure without response (migrate.go)
	clv       [1]string // the response's Content-Length, as a header value

	// slot0: storage for the first attempt's slot, allocated with the
	// request (nil once taken; later attempts and migrations allocate
	// their own).
	slot0 *attemptSlot
}

// replayable reports whether the body can be sent again.
func (rs *reqSpec) replayable() bool { return rs.stream == nil || !rs.stream.used.Load() }

// Dispatch serves one generation request. c.Body is forwarded byte for byte.
func (p *Regular) Dispatch(w http.ResponseWriter, r *http.Request, c *Call) {
	box := new(struct { // the request and its first attempt's slot: one allocation
		rs   reqSpec
		slot attemptSlot
	})
	rs := &box.rs
	*rs = reqSpec{
		slot0:     &box.slot,
		method:    http.MethodPost,
		pathQuery: c.Path,
		header:    p.upstreamHeader(r.Header),
		body:      c.Body,
		sse:       c.Stream,
		gen:       true,
		route:     c.Route,
		receipt:   c.Receipt,
		start:     c.Start,
	}
	if r.URL.RawQuery != "" {
		rs.pathQuery += "?" + r.URL.RawQuery
	}
	if _, ok := rs.header["Content-Type"]; !ok {
		rs.header["Content-Type"] = []string{"application/json"}
	}
	rs.preq = policy.Request{Path: c.Path, Headers: p.policyHeaders(r.Header), Body: c.Body, Obj: c.Obj, Top: c.Top}
	if pp, ok := p.o.Policy.(policy.Preparer); ok {
		snap := p.o.Registry.Snapshot()
		pp.Prepare(r.Context(), &rs.preq, policy.Candidates{Gen: snap.Gen, Workers: snap.ByRole(p.o.Role)})
	}
	p.serve(r.Context(), w, rs)
}

// ServePassthrough forwards any other request (method, escaped path, query
// and headers minus hop-by-hop ones) to a worker chosen by the policy and
// relays the response. The body is streamed, never buffered (the server's
// size limit is already applied to r.Body); a retry happens only after a
// connect failure, which leaves the body unread.
func (p *Regular) ServePassthrough(w http.ResponseWriter, r *http.Request) {
	rs := &reqSpec{
		method:    r.Method,
		pathQuery: r.URL.EscapedPath(),
		header:    p.upstreamHeader(r.Header),
		route:     "fallback",
		start:     time.Now(),
	}
	if c := CallFrom(r.Context()); c != nil {
		rs.route, rs.receipt = c.Route, c.Receipt
		if !c.Start.IsZero() {
			rs.start = c.Start
		}
	}
	if r.URL.RawQuery != "" {
		rs.pathQuery += "?" + r.URL.RawQuery
	}
	if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 {
		rs.stream = &streamBody{r: r.Body}
		rs.length = r.ContentLength
	}
	rs.preq = policy.Request{Path: r.URL.Path, Headers: p.policyHeaders(r.Header)}
	p.serve(r.Context(), w, rs)
}

// streamBody hands the client's body to the upstream request without
// letting the transport close it, and records whether any byte was read.
type streamBody struct {
	r    io.Reader
	used atomic.Bool
}

func (b *streamBody) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	if n > 0 {
		b.used.Store(true)
	}
	return n, err
}

func (b *streamBody) Close() error { return nil } // the server owns r.Body

// upstreamHeader builds the headers sent upstream from the client's.
func (p *Regular) upstreamHeader(in http.Header) http.Header {
	h := forwardRequestHeaders(in)
	switch {
	case p.auth != nil:
		h["Authorization"] = p.auth
	case p.o.ForwardClientAuth:
		if v, ok := in["Authorization"]; ok {
			h["Authorization"] = v
		}
	}
	return h
}

func (p *Regular) policyHeaders(in http.Header) http.Header {
	if len(p.o.HashHeaders) == 0 {
		return in
	}
	h := make(http.Header, len(p.o.HashHeaders))
	for _, k := range p.o.HashHeaders {
		if v := in.Values(k); len(v) > 0 {
			h[http.CanonicalHeaderKey(k)] = v
		}
	}
	return h
}

// panicReason marks a panic pick (worker.Panic): its breaker may refuse it.
const panicReason = "panic: no worker healthy and closed-circuit"

// pick asks the policy for a worker among the role's current members.
// Workers with an unconfirmed connect failure are avoided while another
// one is available; when none is, panic routing may pick any registered
// worker the request has not failed on.
func (p *Regular) pick(req *policy.Request) (policy.Choice, error) {
	snap := p.o.Registry.Snapshot()
	cands := policy.Candidates{Gen: snap.Gen, Workers: snap.ByRole(p.o.Role)}
	if p.o.Steer != nil {
		if ex := p.o.Steer.Steer(cands.Workers, req); ex != nil {
			alt := *req
			alt.Exclude = ex
			if ch, err := p.o.Policy.Pick(&alt, cands); err == nil && ch.Worker != nil {
				p.o.Panic.Normal(p.o.Role)
				return ch, nil
			}
		}
	}
	if ex := worker.WithSuspects(cands.Workers, req.Exclude); ex != nil {
		alt := *req
		alt.Exclude = ex
		if ch, err := p.o.Policy.Pick(&alt, cands); err == nil && ch.Worker != nil {
			p.o.Panic.Normal(p.o.Role)
			return ch, nil
		}
	}
	ch, err := p.o.Policy.Pick(req, cands)
	if err == nil && ch.Worker == nil {
		err = policy.ErrNoWorker
	}
	if err == nil {
		p.o.Panic.Normal(p.o.Role)
	} else if w := p.o.Panic.Pick(p.o.Role, cands.Workers, req.Excluded); w != nil {
		return policy.Choice{Worker: w, Reason: panicReason}, nil
	}
	if err != nil && !errors.Is(err, policy.ErrNoWorker) {
		err = fmt.Errorf("%w: %w", policy.ErrNoWorker, err)
	}
	return ch, err
}

// exclude keeps later attempts of this request off w and its sibling DP
// ranks (one vLLM server).
func (p *Regular) exclude(req *policy.Request, w *worker.Worker) {
	if req.Exclude == nil {
		req.Exclude = make(map[string]bool, 4)
	}
	req.Exclude[w.Key()] = true
	if w.DPSize > 1 {
		for _, s := range p.o.Registry.Instance(w.Instance) {
			req.Exclude[s.Key()] = true
		}
	}
}

// markDown is passive health after a failed connect (all ranks of w): a
// first failure is a hint (w is avoided and probed at once), a second
// within worker.ConnectHintWindow marks it unhealthy; the prober restores it.
func (p *Regular) markDown(w *worker.Worker, err error) {
	down := p.o.Registry.ConnectFailed(w, time.Now())
	if len(down) == 0 {
		p.log.Debug("connect failed; worker avoided until a probe decides", "worker", w.Key(), "err", err)
	}
	for _, x := range down {
		p.log.Warn("worker marked unhealthy after a second connect failure", "worker", x.Key(), "err", err)
		if p.m != nil {
			p.m.WorkerHealth.WithLabelValues(x.Key()).Set(0)
		}
	}
}

// failure is a failed attempt that may be retried: a transport error or a
// retryable status (with its bounded body, so the last one can be returned
// to the client when no retry follows).
type failure struct {
	err    error
	status int
	header http.Header
	body   []byte
}

const (
	errBodyLimit = 64 << 10        // bytes of a failed attempt's body kept
	drainTimeout = 2 * time.Second // to read them
)

// maxRefusals bounds re-picks after a breaker refused the chosen worker (a
// policy that ignores Request.Exclude must not loop forever).
const maxRefusals = 64

func (p *Regular) serve(parent context.Context, w http.ResponseWriter, rs *reqSpec) {
	if rs.start.IsZero() {
		rs.start = time.Now()
	}
	ctx := parent
	if p.o.RequestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = WithRequestDeadline(parent, rs.start.Add(p.o.RequestTimeout))
		defer cancel()
	}
	run := regularRun{p: p, w: w, rs: rs, ctx: ctx, rec: rs.receipt}
	if run.rec == nil {
		run.rec = &Receipt{}
	}
	run.rec.Mode, run.rec.Policy = "regular", p.o.Policy.Name()
	p.budget.request()

	var err error
	if run.choice, err = p.pick(&rs.preq); err != nil {
		p.fail(w, rs, run.rec, err)
		return
	}
	for attempt := 1; ; attempt++ {
		ticket, panicDone, ok := run.begin()
		if !ok { // lost a race with the breaker: not an attempt
			attempt--
			if run.repick() == stepDone {
				return
			}
			continue
		}
		wk := run.choice.Worker
		run.rec.Worker, run.rec.Reason, run.rec.Attempts = wk.Key(), run.choice.Reason, attempt
		slot := p.startSlot(wk, ticket, panicDone, rs)
		resp, actx, acancel, err := p.roundTrip(ctx, wk, rs, attempt)
		if err != nil {
			acancel()
			slot.release()
			if run.afterError(wk, slot, attempt, err) == stepDone {
				return
			}
			continue
		}
		if retryableStatus(resp.StatusCode) && rs.stream == nil {
			switch run.afterStatus(wk, slot, attempt, resp, acancel) {
			case stepDone:
				return
			case stepRetry:
				continue
			}
		}
		p.relay(actx, w, rs, wk, resp, slot)
		acancel()
		return
	}
}

// regularRun is one request on its way through serve's attempts.
type regularRun struct {
	p       *Regular
	w       http.ResponseWriter
	rs      *reqSpec
	rec     *Receipt
	ctx     context.Context
	choice  policy.Choice // the worker of the next attempt
	last    *failure      // the last failed attempt, answered when no worker is left
	refused int           // picks the breaker refused
}

// step is what serve does after a step of an attempt.
type step int

const (
	stepRetry step = iota // another attempt, on run.choice
	stepDone              // the request has been answered
	stepRelay             // relay the response in hand
)

// begin asks the chosen worker's breaker for an attempt: ok false when it
// refuses. A panic pick is let through; panicDone then reports its outcome.
func (r *regularRun) begin() (ticket worker.Ticket, panicDone func(bool), ok bool) {
	wk := r.choice.Worker
	ticket, ok = wk.Breaker().Begin()
	if ok || r.choice.Reason != panicReason {
		return ticket, nil, ok
	}
	po := wk.PanicOutcome() // panic routing overrides the breaker
	return ticket, func(success bool) {
		if success {
			po(worker.OutcomeSuccess)
		} else {
			po(worker.OutcomeFailure)
		}
	}, true
}

// repick replaces a worker whose breaker refused the attempt (at most
// maxRefusals times), answering with the last failure when none is left.
func (r *regularRun) repick() step {
	r.p.exclude(&r.rs.preq, r.choice.Worker)
	var err error
	if r.refused++; r.refused > maxRefusals {
		err = policy.ErrNoWorker
	} else {
		r.choice, err = r.p.pick(&r.rs.preq)
	}
	if err != nil {
		r.p.finishFailed(r.w, r.rs, r.rec, r.last, err)
		return stepDone
	}
	return stepRetry
}

// afterError settles an attempt that got no response: the client's end or
// the request deadline answers at once; a failure before the worker took
// the request is retried elsewhere; any other may continue elsewhere as a
// whole (retryWhole).
func (r *regularRun) afterError(wk *worker.Worker, slot *attemptSlot, attempt int, err error) step {
	p := r.p
	if r.ctx.Err() != nil { // client gone or request deadline
		err = r.ctx.Err()
		slot.outcome(!errors.Is(err, context.DeadlineExceeded))
		p.fail(r.w, r.rs, r.rec, err)
		return stepDone
	}
	slot.outcome(false)
	if IsDialError(err) {
		p.markDown(wk, err)
	}
	if !(IsDialError(err) || errors.Is(err, ErrHeaderTimeout)) || !r.rs.replayable() {
		next, ok := p.retryWhole(r.ctx, r.rs, wk, err)
		if !ok {
			p.fail(r.w, r.rs, r.rec, err)
			return stepDone
		}
		r.rec.Failovers = append(r.rec.Failovers, wk.Key())
		r.choice = next
		return stepRetry
	}
	next, delay, ok := p.nextAttempt(r.ctx, r.rs, wk, attempt)
	r.rec.Failovers = append(r.rec.Failovers, wk.Key())
	if !ok {
		p.fail(r.w, r.rs, r.rec, err)
		return stepDone
	}
	return r.retry(next, delay, attempt, &failure{err: err})
}

// afterStatus settles an attempt answered with a retryable status: retried
// elsewhere when another attempt may follow (its body kept as the answer of
// last resort), relayed to the client otherwise.
func (r *regularRun) afterStatus(wk *worker.Worker, slot *attemptSlot, attempt int, resp *http.Response, acancel context.CancelFunc) step {
	next, delay, ok := r.p.nextAttempt(r.ctx, r.rs, wk, attempt)
	if !ok {
		return stepRelay
	}
	f := r.p.drain(resp)
	acancel()
	slot.outcome(resp.StatusCode < 500)
	slot.release()
	r.rec.Failovers = append(r.rec.Failovers, wk.Key())
	return r.retry(next, delay, attempt, f)
}

// retry waits out the backoff before the attempt on next.
func (r *regularRun) retry(next policy.Choice, delay time.Duration, attempt int, f *failure) step {
	r.last = f
	if err := r.p.sleep(r.ctx, r.rs, attempt, delay); err != nil {
		r.p.fail(r.w, r.rs, r.rec, err)
		return stepDone
	}
	r.choice = next
	return stepRetry
}

// roundTrip sends one attempt. The returned context governs the response
// body; cancel must be called once the attempt is over.
func (p *Regular) roundTrip(ctx context.Context, wk *worker.Worker, rs *reqSpec, attempt int) (*http.Response, context.Context, context.CancelFunc, error) {
	actx, cancel := ctx, context.CancelFunc(noop)
	var timer *time.Timer
	if p.o.HeaderTimeout > 0 && rs.sse {
		var cc context.CancelCauseFunc
		actx, cc = context.WithCancelCause(ctx)
		cancel = func() { cc(context.Canceled) }
		timer = time.AfterFunc(p.o.HeaderTimeout, func() { cc(ErrHeaderTimeout) })
	}
	h := rs.header
	if attempt > 1 {
		h = h.Clone() // the previous attempt's request may still be being written
	}
	if wk.DPRank >= 0 {
		h[dpRankHeader] = []string{strconv.Itoa(wk.DPRank)}
	} else {
		delete(h, dpRankHeader)
	}
	var body io.ReadCloser
	var n int64
	var bb *bytesBody
	switch {
	case rs.stream != nil:
		body, n = rs.stream, rs.length
	case rs.body != nil:
		bb = newBytesBody(rs.body)
		body, n = bb, int64(len(rs.body))
	}
	req, err := NewUpstreamRequest(actx, rs.method, wk, rs.pathQuery, h, body, n)
	if err != nil {
		return nil, actx, cancel, err
	}
	if bb != nil && req.ContentLength > 0 && RewindsBody(p.rt, req) {
		req.GetBody = bb.again
	}
	resp, err := p.rt.RoundTrip(req)
	if timer != nil && !timer.Stop() { // fired: the attempt's context is canceled
		if resp != nil {
			resp.Body.Close()
			resp = nil
		}
		err = ErrHeaderTimeout
	}
	return resp, actx, cancel, err
}

func noop() {}

// nextAttempt decides whether the failed attempt may be retried and picks
// the worker for it: attempts left, another usable worker, retry budget and
// a backoff that ends before the request deadline.
func (p *Regular) nextAttempt(ctx context.Context, rs *reqSpec, failed *worker.Worker, attempt int) (policy.Choice, time.Duration, bool) {
	if attempt >= p.o.Retry.MaxAttempts {
		if p.m != nil && p.o.Retry.MaxAttempts > 1 {
			p.m.RetriesExhausted.WithLabelValues(rs.route).Inc()
		}
		return policy.Choice{}, 0, false
	}
	p.exclude(&rs.preq, failed)
	next, err := p.pick(&rs.preq)
	if err != nil {
		return policy.Choice{}, 0, false // no other worker: fail now, no backoff
	}
	delay := p.o.Retry.backoff(attempt, p.rand)
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= delay {
		return policy.Choice{}, 0, false
	}
	if !p.budget.allow() {
		p.log.Debug("retry budget exhausted", "route", rs.route, "worker", failed.Key())
		return policy.Choice{}, 0, false
	}
	return next, delay, true
}

// sleep waits out the backoff before attempt+1, or until ctx ends.
func (p *Regular) sleep(ctx context.Context, rs *reqSpec, attempt int, d time.Duration) error {
	if p.m != nil {
		p.m.Retries.WithLabelValues(rs.route).Inc()
		p.m.RetryBackoff.WithLabelValues(strconv.Itoa(attempt + 1)).Observe(d.Seconds())
	}
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// drain reads a failed response's body (bounded) and closes it, keeping
// enough to return it if no retry follows.
func (p *Regular) drain(resp *http.Response) *failure {
	t := time.AfterFunc(drainTimeout, func() { resp.Body.Close() }) // a trickling error body
	b, err := io.ReadAll(io.LimitReader(resp.Body, errBodyLimit+1))
	t.Stop()
	resp.Body.Close()
	f := &failure{status: resp.StatusCode, header: resp.Header, body: b}
	if err != nil || len(b) > errBodyLimit {
		f.header = nil
		f.body = openai.MarshalError(resp.StatusCode, fmt.Sprintf("upstream returned status %d", resp.StatusCode))
	}
	return f
}

// finishFailed ends a request whose last attempt failed and no further
// worker could be picked: the last failure if there was one, else err.
func (p *Regular) finishFailed(w http.ResponseWriter, rs *reqSpec, rec *Receipt, last *failure, err error) {
	if last == nil {
		p.fail(w, rs, rec, err)
		return
	}
	if last.err != nil {
		p.fail(w, rs, rec, last.err)
		return
	}
	p.writeFailure(w, rs, last)
}

// writeFailure returns a buffered upstream error response.
func (p *Regular) writeFailure(w http.ResponseWriter, rs *reqSpec, f *failure) {
	h := w.Header()
	if f.header != nil {
		CopyResponseHeaders(h, f.header)
	} else {
		h.Set("Content-Type", "application/json")
	}
	h.Set("Content-Length", strconv.Itoa(len(f.body)))
	if p.m != nil {
		p.m.RequestErrors.WithLabelValues(rs.route, "upstream_status").Inc()
	}
	w.WriteHeader(f.status)
	_, _ = w.Write(f.body)
}

// fail writes the error response for err (nothing when the client is gone).
func (p *Regular) fail(w http.ResponseWriter, rs *reqSpec, rec *Receipt, err error) {
	status := StatusFor(err)
	if p.m != nil {
		p.m.RequestErrors.WithLabelValues(rs.route, errorType(err)).Inc()
	}
	if status == StatusClientClosed {
		p.log.Debug("client closed request", "route", rs.route, "worker", rec.Worker)
		return
	}
	if status != http.StatusServiceUnavailable || rec.Attempts > 0 {
		p.log.Warn("request failed", "route", rs.route, "worker", rec.Worker, "attempts", rec.Attempts, "status", status, "err", err)
	}
	openai.WriteError(w, status, messageFor(err))
}

// attemptSlot is one attempt's bookkeeping: the worker's in-flight count
// and gauges (until release) and the breaker outcome with its metric. One
// allocation per attempt instead of a closure (and a sync.Once) for each.
type attemptSlot struct {
	p         *Regular
	w         *worker.Worker
	ticket    worker.Ticket // the breaker's
	panicDone func(bool)    // instead of ticket: panic routing's outcome
	recorded  atomic.Bool   // the breaker was told (only the first outcome counts)
	ws        worker.Slot   // the worker's in-flight count
	running   prometheus.Gauge
	off       atomic.Bool // released
}

// startSlot counts the request in flight on w until release; its outcome
// goes to panicDone when set, else to the breaker's ticket.
func (p *Regular) startSlot(w *worker.Worker, t worker.Ticket, panicDone func(bool), rs *reqSpec) *attemptSlot {
	s := rs.slot0
	if s != nil {
		rs.slot0 = nil
	} else {
		s = new(attemptSlot)
	}
	s.p, s.w, s.ticket, s.panicDone = p, w, t, panicDone
	s.ws.Start(w, rs.preq.Top)
	if !rs.sse {
		s.ws.FirstByte() // its first byte is its last: not counted as in prefill
	}
	if p.m != nil {
		s.running = p.m.Running(w.Key())
		s.running.Inc()
		p.inflightRole.Inc()
	}
	return s
}

// release ends the in-flight accounting; later calls do nothing.
func (s *attemptSlot) release() {
	if !s.off.CompareAndSwap(false, true) {
		return
	}
	s.ws.Release()
	if s.running != nil {
		s.running.Dec()
		s.p.inflightRole.Dec()
	}
}

// outcome reports the attempt's result to the breaker and the metrics.
func (s *attemptSlot) outcome(ok bool) {
	if s.recorded.CompareAndSwap(false, true) {
		switch {
		case s.panicDone != nil:
			s.panicDone(ok)
		case ok:
			s.ticket.Finish(worker.OutcomeSuccess)
		default:
			s.ticket.Finish(worker.OutcomeFailure)
		}
	}
	if m := s.p.m; m != nil {
		m.Outcome(s.w.Key(), ok).Inc()
	}
}

// isSSE reports whether a response is an event stream.
func isSSE(h http.Header) bool {
	const sse = "text/event-stream"
	ct := h.Get("Content-Type")
	return len(ct) >= len(sse) && strings.EqualFold(ct[:len(sse)], sse) &&
		(len(ct) == len(sse) || ct[len(sse)] == ';' || ct[len(sse)] == ' ')
}

// relay writes the chosen response to the client and records its outcome.
func (p *Regular) relay(ctx context.Context, w http.ResponseWriter, rs *reqSpec, wk *worker.Worker, resp *http.Response, slot *attemptSlot) {
	defer slot.release()
	defer resp.Body.Close()
	sse, streaming := p.respondHead(w, rs, resp)
	// The options are made here, not in a helper: their closures stay on
	// this frame (a helper returning them would allocate both).
	var ro RelayOptions
	var usage Usage
	if rs.gen {
		usage.Start(p.m)
	}
	defer usage.Finish(false) // a no-op once counted below
	if usage.On() {
		ro.Observe = usage.Observe
	}
	if sse {
		ro.IdleTimeout = p.o.StreamIdleTimeout
	}
	ro.Stream = streaming
	if streaming && rs.gen {
		var ttft prometheus.Observer
		if p.m != nil {
			ttft = p.ttftFor(rs.route)
		}
		start := rs.start
		ro.OnFirstByte = func() {
			slot.ws.FirstByte()
			if ttft != nil {
				ttft.Observe(time.Since(start).Seconds())
			}
		}
	}
	var out http.ResponseWriter = w
	mig := p.startMigration(rs, w, resp)
	if mig != nil {
		out = mig.w
	}
	res := Relay(ctx, out, resp.Body, ro)
	if mig != nil {
		if cause := mig.finish(&res); cause != "" {
			slot.outcome(false)
			p.log.Warn("upstream response broke mid-way; continuing elsewhere", "route", rs.route, "worker", wk.Key(), "cause", cause, "err", res.UpstreamErr)
			p.continueStream(ctx, w, rs, wk, mig, cause, res.UpstreamErr)
			return
		}
	}
	switch {
	case res.UpstreamErr == nil:
		slot.outcome(resp.StatusCode < 500)
		usage.Finish(resp.StatusCode < 300)
	case !res.DownstreamOK: // the client went away: says nothing about the worker
		slot.outcome(true)
		if p.m != nil {
			p.m.RequestErrors.WithLabelValues(rs.route, "client_canceled").Inc()
		}
		p.log.Debug("client closed request mid-response", "route", rs.route, "worker", wk.Key(), "bytes", res.Bytes)
	default: // the upstream broke after the headers were sent
		slot.outcome(false)
		p.brokeMidway(w, rs, wk, resp, res, sse, streaming)
	}
}

// respondHead writes the response's status and header to the client (a
// stream's at once, before its first token, or with the first token when
// it came with them) and says whether the body is an event stream and
// whether it is relayed as it comes.
func (p *Regular) respondHead(w http.ResponseWriter, rs *reqSpec, resp *http.Response) (sse, streaming bool) {
	h := w.Header()
	CopyResponseHeaders(h, resp.Header)
	sse = isSSE(resp.Header)
	streaming = sse || (rs.sse && resp.ContentLength < 0)
	if !streaming && resp.ContentLength >= 0 && bodyAllowed(resp.StatusCode) {
		rs.clv[0] = strconv.FormatInt(resp.ContentLength, 10)
		h["Content-Length"] = rs.clv[:1:1]
	}
	if p.m != nil && rs.gen {
		p.m.GenerateDur.Observe(time.Since(rs.start).Seconds())
	}
	w.WriteHeader(resp.StatusCode)
	if streaming && !BodyArrived(resp.Body) {
		// Headers out before the first token. A first token that came with
		// them is read at once, and its flush carries them: one write less.
		_ = http.NewResponseController(w).Flush()
	}
	return sse, streaming
}

// brokeMidway ends a response whose upstream broke after its head went to
// the client: an SSE error event for a stream, a cut connection for a
// chunked body (a short Content-Length body is cut by the server).
func (p *Regular) brokeMidway(w http.ResponseWriter, rs *reqSpec, wk *worker.Worker, resp *http.Response, res RelayResult, sse, streaming bool) {
	err := res.UpstreamErr
	if p.m != nil {
		p.m.RequestErrors.WithLabelValues(rs.route, "stream_broken").Inc()
	}
	p.log.Warn("upstream response broke mid-way", "route", rs.route, "worker", wk.Key(), "bytes", res.Bytes, "err", err)
	status := StatusFor(err)
	if status == StatusClientClosed {
		status = http.StatusBadGateway
	}
	if sse {
		_ = WriteSSEError(w, res, status, "upstream stream broken: "+err.Error())
		return
	}
	if !streaming && resp.ContentLength >= 0 {
		return // short of the declared Content-Length: the server drops the connection
	}
	abortConn(w)
}

// bodyAllowed reports whether a response with this status may carry a
// body (and so a Content-Length).
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// abortConn cuts the client connection so a chunked body that broke
// upstream is not mistaken for a complete one.
func abortConn(w http.ResponseWriter) {
	if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
		_ = conn.Close()
	}
}
