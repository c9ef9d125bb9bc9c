// Package pd is the prefill/decode (PD) disaggregation engine: it splits
// each generation request into a prefill leg (P computes the prompt's KV
// cache and one throw-away token) and a decode leg (D receives the KV cache
// through the configured KV connector and streams the answer), following
// the vLLM wire contract of PROTOCOL.md §8 for NIXL, Mooncake, MoRI-IO (READ
// and WRITE) and P2P-NCCL.
//
// Lifecycle invariants (the same for every connector):
//   - Both legs run under the client's request context: a client
//     disconnect cancels both (their connections are closed, so vLLM aborts
//     the requests and frees the KV blocks).
//   - Sequential connectors never call D unless P answered 2xx with the
//     kv_transfer_params D needs.
//   - Concurrent connectors send D no later than P and keep watching P; a P
//     failure before D's first body byte cancels D at once, and so does P
//     being seen dead after it answered (its KV may never come).
//   - Nothing is committed to the client before D's status is known and D
//     produced its first body byte (or ended its body): a failure before
//     that, KV-wait timeouts included, may fail over to another pair; a
//     failure after that ends a stream with an SSE error event.
//   - A KV-wait timeout is a failure of the (P, D) pair, not of D: it is
//     recorded in the pair health, and on a worker's circuit breaker only
//     once the same worker failed transfers with two distinct partners.
//   - Request bodies are patched byte-faithfully through rawjson.
package pd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/migrate"
	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Options configures an Engine. Zero durations disable the deadline.
type Options struct {
	Registry      *worker.Registry
	PrefillPolicy policy.Policy // picks P; if it implements policy.PairPolicy, PickPair picks both
	DecodePolicy  policy.Policy // picks D among the decodes compatible with P
	Connector     string        // nixl (default) | mooncake | moriio | p2pnccl

	// Client is the shared upstream client (proxy.NewTransport, no client
	// Timeout: deadlines come from contexts). Nil = a client on a fresh
	// proxy.NewTransport.
	Client *http.Client

	// APIKey, when set, is sent as "Authorization: Bearer <key>" on both
	// legs. Otherwise the client's Authorization header is forwarded when
	// ForwardClientAuth is true.
	APIKey            string
	ForwardClientAuth bool

	// OutputLength is the decode-leg output-length policy: "exact" (default,
	// body unchanged) or "toy-proxy" (limit decremented by one, never below 1).
	OutputLength string

	PrefillTimeout    time.Duration // P leg, from send to its complete response
	KVWaitTimeout     time.Duration // streaming D: from send to its first body byte
	RequestTimeout    time.Duration // whole request, both legs and the relay
	StreamIdleTimeout time.Duration // D stream: max silence between chunks
	MaxFailovers      int           // re-picks after a failure before any byte reached the client
	MaxMigrations     int           // continuations of a stream whose decode failed after its first byte (migrate.go)
	MigrationMetrics  *migrate.Metrics

	// Profile enables per-request /start_profile and /stop_profile calls
	// around each leg (REFERENCE §7.4; debugging only: concurrent requests
	// toggle the same profiler). ProfileTimeout bounds each call (10 s).
	Profile        bool
	ProfileTimeout time.Duration

	// Mooncake bootstrap servers: GET http://<P host>:<port>/query, port =
	// the worker's BootstrapPort or MooncakeBootstrapPort (8998). Queries
	// run in the background: first retry after BootstrapBackoff (1 s),
	// doubling up to BootstrapMaxBackoff (10 s); answers refreshed every
	// BootstrapRefresh (60 s); each query bounded by BootstrapTimeout (5 s).
	MooncakeBootstrapPort int
	BootstrapBackoff      time.Duration
	BootstrapMaxBackoff   time.Duration
	BootstrapRefresh      time.Duration
	BootstrapTimeout      time.Duration

	Metrics *metrics.Metrics // nil = no metrics
	Logger  *slog.Logger     // nil = discard
	// Tracer gives each leg a client span under the request's server span
	// and injects its trace context (nil = tracing off: the client's
	// traceparent/tracestate/baggage are copied to both legs verbatim).
	Tracer *tracing.Tracer

	Now   func() time.Time // nil = time.Now
	NewID func() [16]byte  // random 16 bytes (nil = crypto/rand); v4 bits are set by the engine

	// PairFailureThreshold consecutive KV-wait timeouts between one P and
	// one D make the pair suspect for PairCooldown (defaults 3 and 30 s):
	// avoided while a non-suspect pair exists, and a P suspect with every
	// usable decode is passed over. The same window is the one in which a
	// worker that failed transfers with two distinct partners is blamed
	// (the timeout then counts on its circuit breaker).
	PairFailureThreshold int
	PairCooldown         time.Duration

	// HashHeaders names the client headers policies may see (for header-based
	// hashing); empty = every client header.
	HashHeaders []string

	// SplitResponses PD-splits /v1/responses. Off by default: most vLLM
	// versions drop kv_transfer_params on that route (ResponsesRequest has
	// the field only since vLLM PR #37424), so a WRITE decode would wait
	// forever and a READ decode would run without the KV. Unsplit, the
	// request is passed as is to one prefill worker (picked by
	// PrefillPolicy), which serves it like any vLLM.
	SplitResponses bool
	// Warmup sends one 1-token request through every new prefill/decode
	// instance pair, so its first-contact KV handshake happens before real
	// traffic (warmup.go).
	Warmup bool
	// Panic routes to registered workers when a role has none available
	// (nil = off; worker.Panic).
	Panic *worker.Panic
	// BypassThreshold: with a KV-aware policy, a request whose prompt has
	// fewer than this many tokens uncached on the chosen decode (or is
	// shorter than it) is served by the decode alone (bypass.go). 0 = off.
	BypassThreshold int
}

// Engine is the PD dispatcher. It implements proxy.Dispatcher.
type Engine struct {
	o    Options
	conn Connector
	// policyName is the receipt's "prefill/decode" policy names (built once).
	policyName string
	boot       *bootstrapper
	// pairs avoids P/D pairs whose transfers keep timing out.
	pairs *pairHealth
	// warm warms new pairs up (nil when Options.Warmup is off).
	warm *warmer
	// down wakes attempts waiting for the KV of a prefill seen dead.
	downMu sync.Mutex
	down   map[*worker.Worker]chan struct{}
	unsub  func()
	log    *slog.Logger
	m      *metrics.Metrics
	tr     *tracing.Tracer
	// inflightPrefill and inflightDecode are WorkerInFlight's children of
	// the two legs (nil without metrics); series holds the other children
	// a request updates (series.go).
	inflightPrefill, inflightDecode prometheus.Gauge
	series                          seriesCache
	rr                              atomic.Uint64
	hash                            []string
	// bypassing is the prompt work of bypassed requests per decode.
	bypassing bypassLoad

	bg     sync.WaitGroup
	closed atomic.Bool
	own    *proxy.H1Transport // the client's transport when the engine made it
}

var _ proxy.Dispatcher = (*Engine)(nil)

// New validates o and returns an engine. With the Mooncake connector it
// starts background bootstrap queries; call Close to stop them.
func New(o Options) (*Engine, error) {
	if err := o.normalize(); err != nil {
		return nil, err
	}
	var own *proxy.H1Transport
	if o.Client == nil {
		own = proxy.NewH1Transport(proxy.TransportOptions{})
		o.Client = &http.Client{Transport: own}
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	e := &Engine{o: o, log: log.With("component", "pd"), m: o.Metrics, tr: o.Tracer, own: own,
		policyName: o.PrefillPolicy.Name() + "/" + o.DecodePolicy.Name()}
	probeTTL := time.Duration(0) // the cooldown, when no KV-wait bound exists
	if o.KVWaitTimeout > 0 {
		probeTTL = o.KVWaitTimeout + time.Second
	}
	if e.m != nil {
		e.inflightPrefill, e.inflightDecode = e.m.WorkerInFlight.WithLabelValues("prefill"), e.m.WorkerInFlight.WithLabelValues("decode")
	}
	e.pairs = newPairHealth(o.PairFailureThreshold, o.PairCooldown, probeTTL, o.Now)
	e.down = map[*worker.Worker]chan struct{}{}
	for _, h := range o.HashHeaders {
		e.hash = append(e.hash, http.CanonicalHeaderKey(strings.TrimSpace(h)))
	}
	if strings.EqualFold(o.Connector, ConnectorMooncake) {
		e.boot = newBootstrapper(&e.o, e.log)
	}
	conn, err := newConnector(o.Connector, e.boot)
	if err != nil {
		return nil, err
	}
	e.conn = conn
	if o.Warmup {
		e.warm = newWarmer(e)
	}
	e.unsub = o.Registry.Subscribe(e.registryChanged)
	if e.boot != nil {
		e.boot.start()
	}
	if e.warm != nil {
		e.warm.start()
	}
	return e, nil
}

// normalize checks the options New requires and fills in the defaults
// (the Client's aside: New owns the transport it makes).
func (o *Options) normalize() error {
	if o.Registry == nil {
		return errors.New("pd: Options.Registry is required")
	}
	if o.PrefillPolicy == nil || o.DecodePolicy == nil {
		return errors.New("pd: Options.PrefillPolicy and Options.DecodePolicy are required")
	}
	switch o.OutputLength {
	case "":
		o.OutputLength = OutputExact
	case OutputExact, OutputToyProxy:
	default:
		return fmt.Errorf("pd: unknown output length policy %q (want exact or toy-proxy)", o.OutputLength)
	}
	o.MaxFailovers = max(o.MaxFailovers, 0)
	if o.ProfileTimeout <= 0 {
		o.ProfileTimeout = 10 * time.Second
	}
	if o.MooncakeBootstrapPort <= 0 {
		o.MooncakeBootstrapPort = 8998
	}
	if o.BootstrapBackoff <= 0 {
		o.BootstrapBackoff = time.Second
	}
	if o.BootstrapMaxBackoff <= 0 {
		o.BootstrapMaxBackoff = 10 * time.Second
	}
	o.BootstrapMaxBackoff = max(o.BootstrapMaxBackoff, o.BootstrapBackoff)
	if o.BootstrapRefresh <= 0 {
		o.BootstrapRefresh = 60 * time.Second
	}
	if o.BootstrapTimeout <= 0 {
		o.BootstrapTimeout = 5 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.NewID == nil {
		o.NewID = randomUUID
	}
	return nil
}

// registryChanged follows the registry: the watchers of a removed worker
// are woken, and the warmer hears of every change.
func (e *Engine) registryChanged(c worker.Change) {
	for _, w := range c.Removed {
		e.markDown(w)
	}
	if e.warm != nil {
		e.warm.changed(c)
	}
}

// Connector returns the engine's KV connector.
func (e *Engine) Connector() Connector { return e.conn }

// Close stops background work (Mooncake bootstrap queries, profile stops)
// and waits for it. In-flight requests are not affected.
func (e *Engine) Close() {
	if e.closed.Swap(true) {
		return
	}
	e.unsub()
	if e.boot != nil {
		e.boot.close()
	}
	if e.warm != nil {
		e.warm.stop()
	}
	e.bg.Wait()
	if e.own != nil {
		e.own.Close()
	}
}

// Ready reports whether at least one routable prefill worker can be paired
// with a routable, compatible decode worker, and why not otherwise.
func (e *Engine) Ready() (bool, string) {
	snap := e.o.Registry.Snapshot()
	if len(snap.Prefill) == 0 {
		return false, "no prefill workers registered"
	}
	if len(snap.Decode) == 0 {
		return false, "no decode workers registered"
	}
	live := func(w *worker.Worker) bool { return w.Healthy() && w.Routable() }
	var ps, ds []*worker.Worker
	var pWhy, dWhy string
	for _, w := range snap.Prefill {
		if !live(w) {
			continue
		}
		if err := e.conn.Eligible(w); err != nil {
			if pWhy == "" {
				pWhy = err.Error()
			}
			continue
		}
		ps = append(ps, w)
	}
	for _, w := range snap.Decode {
		if !live(w) {
			continue
		}
		if err := e.conn.Eligible(w); err != nil {
			if dWhy == "" {
				dWhy = err.Error()
			}
			continue
		}
		ds = append(ds, w)
	}
	if len(ps) == 0 {
		if pWhy != "" {
			return false, "no usable prefill worker: " + pWhy
		}
		return false, fmt.Sprintf("no healthy routable prefill worker (%d registered)", len(snap.Prefill))
	}
	if len(ds) == 0 {
		if dWhy != "" {
			return false, "no usable decode worker: " + dWhy
		}
		return false, fmt.Sprintf("no healthy routable decode worker (%d registered)", len(snap.Decode))
	}
	for _, p := range ps {
		for _, d := range ds {
			if e.conn.Compatible(p, d) {
				return true, ""
			}
		}
	}
	return false, fmt.Sprintf("no decode worker compatible with the prefill workers' transfer modes (prefill: %s; decode: %s)",
		modes(ps), modes(ds))
}

func modes(ws []*worker.Worker) string {
	set := map[string]bool{}
	for _, w := range ws {
		m := strings.ToUpper(w.TransferMode)
		if m == "" {
			m = "none"
		}
		set[m] = true
	}
	var out []string
	for m := range set {
		out = append(out, m)
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

// reqState is what every attempt of one client request shares.
type reqState struct {
	kind   routeKind
	obj    *rawjson.Object
	stream bool
	merge  bool
	path   string // upstream path (with query)
	route  string // metrics label
	auth   string // Authorization value for both legs ("" = none)
	hdr    http.Header
	start  time.Time
	cli    context.Context // the client's own context (disconnect)

	// badPairs are the pairs whose KV transfer failed during this request
	// (never picked again for it); avoid holds their workers, avoided while
	// a pair without them exists.
	badPairs map[[2]string]bool
	avoid    map[string]bool
	attempt  int // 1-based number of the current (P, D) attempt
	rc       *proxy.Receipt
	warmup   bool // a pair warm-up (warmup.go): kept out of the request metrics
	panicked bool // the current pair is a panic pick (worker.Panic): breakers do not refuse it

	// The prompt's token ids and the KV-aware policy's state for them,
	// computed once by prepare (bypass.go); nil when no policy needs them.
	tokens   []uint32
	prepared any
	mig      *pdMigration // a stream that may continue on another pair (migrate.go)
	// deferred says why a request within the bypass threshold was split
	// (its decode's queue: bypass.go), for the receipt.
	deferred string
	// firstByte, when set, runs at the first byte of an unsplit attempt's
	// answer (a bypass gives its decode's reservation back: bypass.go).
	firstByte func()
}

// Dispatch serves one PD generation request.
//
// It is split into begin (the request's checks and state), failover (the
// attempts) and failedOver so that the frames on the request goroutine's
// stack while a response is relayed stay small: a goroutine whose stack
// once grew (doubling) keeps the larger stack until a collection finds at
// most a quarter of it used, and the first flush of a response (net/http's
// header writer) is deep. At thousands of open streams that is 8 KiB each
// (docs/BENCHMARKS.md, section 3).
func (e *Engine) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	tw := &trackingWriter{ResponseWriter: w}
	defer e.recoverDispatch(tw)
	if c == nil {
		c = &proxy.Call{Path: r.URL.Path}
	}
	st := e.begin(tw, r, c)
	if st == nil {
		return
	}
	ctx := r.Context()
	if e.o.RequestTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = proxy.WithRequestDeadline(ctx, time.Now().Add(e.o.RequestTimeout))
		defer cancel()
	}

	e.prepare(ctx, r, c, st)
	if st.kind == routeResponses && !e.o.SplitResponses {
		e.passthrough(ctx, tw, r, c, st)
		return
	}
	if e.bypass(ctx, tw, r, c, st) {
		return
	}
	st.mig = e.startMigration(r, c, st)
	e.failover(ctx, tw, r, c, st)
}

// recoverDispatch answers 500 for a panic in Dispatch (net/http's
// ErrAbortHandler goes on).
func (e *Engine) recoverDispatch(tw *trackingWriter) {
	if v := recover(); v != nil {
		if v == http.ErrAbortHandler {
			panic(v)
		}
		e.log.Error("pd dispatch panic", "panic", v, "stack", string(debug.Stack()))
		if !tw.wrote {
			openai.WriteError(tw, http.StatusInternalServerError, "internal error in the PD engine")
		}
	}
}

// begin checks the request and returns its state, or nil when it was
// answered (an error).
func (e *Engine) begin(tw *trackingWriter, r *http.Request, c *proxy.Call) *reqState {
	if c.Receipt == nil {
		c.Receipt = &proxy.Receipt{}
	}
	rc := c.Receipt
	rc.Mode = "pd"
	rc.Policy = e.policyName

	st := &reqState{start: c.Start, hdr: r.Header, cli: r.Context(), rc: rc}
	if st.start.IsZero() {
		st.start = e.o.Now()
	}
	st.path = c.Path
	if st.path == "" {
		st.path = r.URL.Path
	}
	st.route = c.Route
	if st.route == "" {
		st.route = st.path
	}
	if q := r.URL.RawQuery; q != "" && !strings.Contains(st.path, "?") {
		st.path += "?" + q
	}
	e.countRoute(st.route)

	if r.Method != http.MethodPost {
		e.fail(tw, st, "bad_request", http.StatusMethodNotAllowed, "only POST is supported on PD generation routes")
		return nil
	}
	st.kind = classify(st.path)
	if st.kind == routeNone {
		e.fail(tw, st, "bad_request", http.StatusNotFound, fmt.Sprintf("route %s is not served in PD mode (PD serves /v1/completions, /v1/chat/completions, /v1/responses, /generate and /inference/v1/generate)", st.path))
		return nil
	}
	st.obj = c.Obj
	if st.obj == nil {
		o, err := rawjson.Parse(c.Body)
		if err != nil {
			msg := err.Error()
			if errors.Is(err, rawjson.ErrNotObject) {
				msg = rawjson.ErrNotObject.Error()
			}
			e.fail(tw, st, "bad_request", http.StatusBadRequest, msg)
			return nil
		}
		st.obj = o
	}
	if msg := validate(st.kind, st.obj); msg != "" {
		e.fail(tw, st, "bad_request", http.StatusBadRequest, msg)
		return nil
	}
	if s, ok := st.obj.Bool("stream"); ok {
		st.stream = s
	} else {
		st.stream = c.Stream
	}
	st.merge = needsMerge(st.kind, st.obj, st.stream)
	switch {
	case e.o.APIKey != "":
		st.auth = "Bearer " + e.o.APIKey
	case e.o.ForwardClientAuth:
		st.auth = r.Header.Get("Authorization")
	}
	return st
}

// failover runs attempts on the pairs the policies pick until one answers
// the client, or writes the failure.
func (e *Engine) failover(ctx context.Context, tw *trackingWriter, r *http.Request, c *proxy.Call, st *reqState) {
	rc := st.rc
	var exclude map[string]bool // made by failedOver
	var last *failure
	for failovers := 0; ; failovers++ {
		pr, pf := e.pickPair(r, c, st, exclude)
		if pf != nil {
			e.noPairLeft(tw, st, last, pf)
			return
		}
		rc.Attempts++
		st.attempt = rc.Attempts
		rc.Prefill, rc.Decode = pr.P.Key(), pr.D.Key()
		rc.Reason = pr.reason
		if st.deferred != "" {
			rc.Reason += "; " + st.deferred
		}
		f := e.attempt(ctx, tw, st, &pr.Pair)
		if f == nil {
			return
		}
		last = f
		if !e.failedOver(ctx, tw, st, &pr.Pair, f, failovers, &exclude) {
			return
		}
	}
}

// noPairLeft writes the failure when no pair is left: the last attempt's
// (last, nil before the first) or the selection's (pf).
func (e *Engine) noPairLeft(tw *trackingWriter, st *reqState, last, pf *failure) {
	if last != nil {
		last.msg += fmt.Sprintf(" (no pair left to fail over to after %d attempt(s): %s)", st.rc.Attempts, pf.msg)
		e.writeFailure(tw, st, last)
		return
	}
	e.writeFailure(tw, st, pf)
}

// failedOver handles attempt f's failure on pr: it writes the failure and
// returns false when no other pair may be tried, else records what to
// avoid (*excludep, made here, and st's bad pairs) and returns true.
func (e *Engine) failedOver(ctx context.Context, tw *trackingWriter, st *reqState, pr *Pair, f *failure, failovers int, excludep *map[string]bool) bool {
	rc := st.rc
	if f.reason != "client_disconnect" {
		e.log.Warn("pd attempt failed", "prefill", pr.P.Key(), "decode", pr.D.Key(), "leg", f.leg,
			"reason", f.reason, "status", f.status, "err", f.msg, "retry", f.retry)
	}
	if !f.retry || failovers >= e.o.MaxFailovers || ctx.Err() != nil || f.w == nil {
		e.writeFailure(tw, st, f)
		return false
	}
	if *excludep == nil {
		*excludep = map[string]bool{}
	}
	exclude := *excludep
	if f.pair {
		// the transfer between P and D failed: never this pair again,
		// preferably neither of its workers, and a blamed one not at all
		pk, dk := pr.P.Key(), pr.D.Key()
		rc.Failovers = append(rc.Failovers, "pair "+pk+"+"+dk+": "+f.reason)
		if st.badPairs == nil {
			st.badPairs, st.avoid = map[[2]string]bool{}, map[string]bool{}
		}
		st.badPairs[[2]string{pk, dk}] = true
		st.avoid[pk], st.avoid[dk] = true, true
		if f.blameP {
			exclude[pk] = true
		}
		if f.blameD {
			exclude[dk] = true
		}
	} else {
		rc.Failovers = append(rc.Failovers, f.leg+" "+f.w.Key()+": "+f.reason)
		exclude[f.w.Key()] = true
	}
	if e.m != nil {
		e.m.PDFailovers.WithLabelValues(f.reason).Inc()
	}
	return true
}

// pickedPair is a Pair plus the policies' reason.
type pickedPair struct {
	Pair
	reason string
}

// pickPair chooses P, then D among the decodes compatible with P.
//
// Pairs whose transfers keep failing (pair health) and the pairs that
// failed during this request are avoided: a P all of whose usable decodes
// are suspect with it is the likely culprit, so the next P is tried; only
// when no other pair exists is the first such suspect pair used. After a
// failed transfer, a pair sharing no worker with it is preferred.
func (e *Engine) pickPair(r *http.Request, c *proxy.Call, st *reqState, exclude map[string]bool) (*pickedPair, *failure) {
	st.panicked = false
	snap := e.o.Registry.Snapshot()
	sel := func(msg string) *failure {
		return &failure{status: http.StatusServiceUnavailable, msg: msg, errType: "server_selection"}
	}
	if len(snap.Prefill) == 0 {
		return nil, sel("no prefill workers available (none registered)")
	}
	if len(snap.Decode) == 0 {
		return nil, sel("no decode workers available (none registered)")
	}
	ex, pWhy, dWhy := e.ineligible(snap, exclude)
	hdr := e.policyHeaders(r)
	avoid := st.avoid // and workers with an unconfirmed connect failure
	if sus := worker.WithSuspects(snap.All, st.avoid); sus != nil {
		avoid = sus
	}
	if len(avoid) > 0 {
		exA := make(map[string]bool, len(ex)+len(avoid))
		for k := range ex {
			exA[k] = true
		}
		for k := range avoid {
			exA[k] = true
		}
		req := e.newPolicyRequest(st, hdr, c, exA)
		if pr, _, _ := e.scanPairs(req, snap, st, exclude, dWhy, false); pr != nil {
			e.normalPick()
			return pr, nil
		}
	}
	req := e.newPolicyRequest(st, hdr, c, ex)
	pr, fallback, modeMsg := e.scanPairs(req, snap, st, exclude, dWhy, true)
	if pr != nil {
		e.normalPick()
		return pr, nil
	}
	if fallback != nil {
		e.normalPick()
		return fallback, nil
	}
	ex0, _, _ := e.ineligible(snap, exclude) // ex has the prefills scanPairs passed over
	if pr := e.panicPair(e.newPolicyRequest(st, hdr, c, ex0), snap, st); pr != nil {
		st.panicked = true
		return pr, nil
	}
	if modeMsg != "" {
		return nil, sel(modeMsg)
	}
	return nil, sel(describe("prefill", snap.Prefill, exclude, pWhy))
}

// ineligible returns exclude plus the workers the connector cannot use
// (a new map), and the first reason given for a prefill and a decode.
func (e *Engine) ineligible(snap *worker.Snapshot, exclude map[string]bool) (ex map[string]bool, pWhy, dWhy string) {
	ex = make(map[string]bool, len(exclude)+4)
	for k := range exclude {
		ex[k] = true
	}
	mark := func(ws []*worker.Worker, why *string) {
		for _, w := range ws {
			if err := e.conn.Eligible(w); err != nil {
				ex[w.Key()] = true
				if *why == "" {
					*why = err.Error()
				}
			}
		}
	}
	mark(snap.Prefill, &pWhy)
	mark(snap.Decode, &dWhy)
	return ex, pWhy, dWhy
}

// scanPairs looks for a pair none of whose workers req excludes and whose
// transfers are not suspect. Prefills with only suspect (or, in this
// request, failed) pairs are set aside; fallback is the first of them
// paired with a suspect decode (when wantFallback), for when nothing better
// exists. req.Exclude is modified.
func (e *Engine) scanPairs(req *policy.Request, snap *worker.Snapshot, st *reqState, exclude map[string]bool, dWhy string,
	wantFallback bool) (pr, fallback *pickedPair, modeMsg string) {
	ex := req.Exclude
	pc := policy.Candidates{Gen: snap.Gen, Workers: snap.Prefill}
	if pp, ok := e.o.PrefillPolicy.(policy.PairPolicy); ok {
		p, d, err := pp.PickPair(req, pc, policy.Candidates{Gen: snap.Gen, Workers: snap.Decode})
		if err == nil && p.Worker != nil && d.Worker != nil && req.Usable(p.Worker) && req.Usable(d.Worker) &&
			p.Worker.Role == worker.RolePrefill && d.Worker.Role == worker.RoleDecode && e.conn.Compatible(p.Worker, d.Worker) &&
			!st.badPairs[[2]string{p.Worker.Key(), d.Worker.Key()}] &&
			!e.pairs.suspects(p.Worker.Key(), []*worker.Worker{d.Worker})[d.Worker.Key()] &&
			!e.warm.cold(p.Worker, d.Worker) {
			return e.newPair(p, d), nil, ""
		}
	}
	var fbP policy.Choice
	var fbD policy.Candidates
	for range snap.Prefill {
		p, err := e.o.PrefillPolicy.Pick(req, pc)
		if err != nil || p.Worker == nil {
			break
		}
		pk := p.Worker.Key()
		dc, tag := e.compatibleDecodes(snap, p.Worker)
		if len(dc.Workers) == 0 {
			modeMsg = fmt.Sprintf("no decode worker compatible with transfer mode %s", strings.ToUpper(p.Worker.TransferMode))
			ex[pk] = true
			continue
		}
		// decodes usable with p at all (pairs failed in this request never are)
		usable := 0
		for _, d := range dc.Workers {
			if req.Usable(d) && !st.badPairs[[2]string{pk, d.Key()}] {
				usable++
			}
		}
		if usable == 0 {
			if tag != 0 {
				modeMsg = fmt.Sprintf("no decode worker available with transfer mode %s (%d compatible, all unhealthy, open-circuit or excluded)",
					strings.ToUpper(p.Worker.TransferMode), len(dc.Workers))
			} else {
				modeMsg = describe("decode", snap.Decode, e.withBadPairs(exclude, st, pk), dWhy)
			}
			ex[pk] = true
			continue
		}
		alt := *req
		alt.Exclude = e.decodeExclude(ex, st, p.Worker, dc.Workers)
		if d, err := e.o.DecodePolicy.Pick(&alt, dc); err == nil && d.Worker != nil {
			return e.newPair(p, d), nil, ""
		}
		// every usable decode is suspect with p: p is the likely culprit
		if fbP.Worker == nil {
			fbP, fbD = p, dc
		}
		ex[pk] = true
	}
	if wantFallback && fbP.Worker != nil {
		alt := *req
		alt.Exclude = e.withBadPairs(ex, st, fbP.Worker.Key())
		if d, err := e.o.DecodePolicy.Pick(&alt, fbD); err == nil && d.Worker != nil {
			fallback = e.newPair(fbP, d)
			if e.warm.cold(fbP.Worker, d.Worker) && !e.pairs.suspects(fbP.Worker.Key(), []*worker.Worker{d.Worker})[d.Worker.Key()] {
				fallback.reason += " (every pair suspect or still warming up)"
			} else {
				fallback.reason += " (every pair suspect: transfers keep timing out)"
			}
		}
	}
	return nil, fallback, modeMsg
}

// normalPick ends a panic period of both roles (worker.Panic).
func (e *Engine) normalPick() {
	e.o.Panic.Normal(worker.RolePrefill)
	e.o.Panic.Normal(worker.RoleDecode)
}

// panicPair is panic routing (worker.Panic) when no pair could be picked:
// a role with no available worker gets a registered one anyway, among
// those the request has not failed on. nil when panic routing is off or
// no such worker exists.
func (e *Engine) panicPair(req *policy.Request, snap *worker.Snapshot, st *reqState) *pickedPair {
	if e.o.Panic == nil || e.o.Panic.Disabled {
		return nil
	}
	p, err := e.o.PrefillPolicy.Pick(req, policy.Candidates{Gen: snap.Gen, Workers: snap.Prefill})
	if err != nil || p.Worker == nil {
		w := e.o.Panic.Pick(worker.RolePrefill, snap.Prefill, req.Excluded)
		if w == nil {
			return nil
		}
		p = choice(w, "panic: no prefill worker healthy and closed-circuit")
	}
	dc, _ := e.compatibleDecodes(snap, p.Worker)
	alt := *req
	alt.Exclude = e.withBadPairs(req.Exclude, st, p.Worker.Key())
	d, err := e.o.DecodePolicy.Pick(&alt, dc)
	if err != nil || d.Worker == nil {
		w := e.o.Panic.Pick(worker.RoleDecode, dc.Workers, alt.Excluded)
		if w == nil {
			return nil
		}
		d = choice(w, "panic: no decode worker healthy and closed-circuit")
	}
	return e.newPair(p, d)
}

// decodeExclude is what a decode pick with prefill p excludes: ex, the
// decodes whose pair with p failed during this request, is suspect
// (pair health) or still warming up. ex itself when that adds nothing
// (the common case: no map is made), else a copy with the additions.
func (e *Engine) decodeExclude(ex map[string]bool, st *reqState, p *worker.Worker, ds []*worker.Worker) map[string]bool {
	pk := p.Key()
	sus := e.pairs.suspects(pk, ds)
	cold := e.warm != nil && e.warm.nCold.Load() > 0
	if len(st.badPairs) == 0 && len(sus) == 0 && !cold {
		return ex
	}
	out := e.withBadPairs(ex, st, pk)
	for k := range sus {
		out[k] = true
	}
	if cold {
		for _, d := range ds {
			if e.warm.cold(p, d) {
				out[d.Key()] = true
			}
		}
	}
	return out
}

// withBadPairs returns a copy of ex plus the decodes whose pair with the
// prefill pk failed during this request.
func (e *Engine) withBadPairs(ex map[string]bool, st *reqState, pk string) map[string]bool {
	out := make(map[string]bool, len(ex)+len(st.badPairs))
	for k := range ex {
		out[k] = true
	}
	for k := range st.badPairs {
		if k[0] == pk {
			out[k[1]] = true
		}
	}
	return out
}

// watchDown returns a channel closed once the engine sees w dead: a
// connect failure on one of its legs, or its removal from the registry
// (e.g. its discovery registration expired). Already closed when w is
// unhealthy or no longer registered.
func (e *Engine) watchDown(w *worker.Worker) <-chan struct{} {
	e.downMu.Lock()
	defer e.downMu.Unlock()
	if !w.Healthy() || e.o.Registry.Get(w.Key()) != w {
		return closedCh
	}
	ch := e.down[w]
	if ch == nil {
		ch = make(chan struct{})
		e.down[w] = ch
	}
	return ch
}

// markDown wakes the watchers of w.
func (e *Engine) markDown(w *worker.Worker) {
	e.downMu.Lock()
	if ch := e.down[w]; ch != nil {
		close(ch)
		delete(e.down, w)
	}
	e.downMu.Unlock()
}

var closedCh = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// describe explains why no worker of a role could be picked.
func describe(role string, ws []*worker.Worker, exclude map[string]bool, why string) string {
	var unhealthy, open, excluded int
	for _, w := range ws {
		switch {
		case exclude[w.Key()]:
			excluded++
		case !w.Healthy() || !w.Routable():
			unhealthy++
		case !w.Breaker().Allow():
			open++
		}
	}
	msg := fmt.Sprintf("no %s workers available (%d registered", role, len(ws))
	if unhealthy > 0 {
		msg += fmt.Sprintf(", %d unhealthy or held", unhealthy)
	}
	if open > 0 {
		msg += fmt.Sprintf(", %d with an open circuit breaker", open)
	}
	if excluded > 0 {
		msg += fmt.Sprintf(", %d failed during this request", excluded)
	}
	msg += ")"
	if why != "" {
		msg += ": " + why
	}
	return msg
}

// compatibleDecodes returns the decode candidates compatible with p. When
// filtering removed workers, Gen is tagged (high bits) so policies caching
// per generation never confuse the subset with the full membership.
func (e *Engine) compatibleDecodes(snap *worker.Snapshot, p *worker.Worker) (policy.Candidates, uint64) {
	all := true
	for _, d := range snap.Decode {
		if !e.conn.Compatible(p, d) {
			all = false
			break
		}
	}
	if all {
		return policy.Candidates{Gen: snap.Gen, Workers: snap.Decode}, 0
	}
	out := make([]*worker.Worker, 0, len(snap.Decode))
	for _, d := range snap.Decode {
		if e.conn.Compatible(p, d) {
			out = append(out, d)
		}
	}
	var tag uint64 = 3
	switch strings.ToUpper(p.TransferMode) {
	case "READ":
		tag = 1
	case "WRITE":
		tag = 2
	}
	return policy.Candidates{Gen: 1<<63 | tag<<60 | snap.Gen, Workers: out}, tag
}

func (e *Engine) newPair(p, d policy.Choice) *pickedPair {
	pr := &pickedPair{Pair: Pair{P: p.Worker, D: d.Worker, PRank: e.rank(p.Worker), DRank: e.rank(d.Worker)}}
	if rc, ok := e.conn.(rankChooser); ok && pr.PRank < 0 {
		pr.PRank = rc.prefillRank(p.Worker)
	}
	pr.RequestID = requestID(zmqAddr(p.Worker), zmqAddr(d.Worker), asV4(e.o.NewID()))
	pr.TransferID = e.conn.TransferID(asV4(e.o.NewID()))
	pr.reason = "prefill: " + p.Reason + "; decode: " + d.Reason
	if e.pairs.claim(p.Worker.Key(), d.Worker.Key()) {
		pr.reason += " (half-open probe of a pair whose transfers timed out)"
	}
	return pr
}

// rank is the data-parallel rank to pin w's leg to (-1 = no header).
func (e *Engine) rank(w *worker.Worker) int {
	if w.DPSize <= 1 {
		return -1
	}
	if w.DPRank >= 0 && w.DPRank < w.DPSize {
		return w.DPRank
	}
	return int(e.rr.Add(1) % uint64(w.DPSize))
}

func (e *Engine) policyHeaders(r *http.Request) http.Header {
	if len(e.hash) == 0 {
		return r.Header
	}
	h := make(http.Header, len(e.hash))
	for _, k := range e.hash {
		if v := r.Header.Values(k); len(v) > 0 {
			h[k] = v
		}
	}
	return h
}

// trackingWriter remembers whether anything was written (for the panic
// guard) and keeps Flush/Unwrap reachable for http.ResponseController.
type trackingWriter struct {
	http.ResponseWriter
	wrote bool
}

func (t *trackingWriter) WriteHeader(code int) {
	t.wrote = true
	t.ResponseWriter.WriteHeader(code)
}

func (t *trackingWriter) Write(b []byte) (int, error) {
	t.wrote = true
	return t.ResponseWriter.Write(b)
}

func (t *trackingWriter) Flush() { _ = t.FlushError() }

// FlushError flushes the client directly through the next writer's
// FlushError (http.ResponseController's unwrapping adds a frame per
// wrapper to the response's deep first flush).
func (t *trackingWriter) FlushError() error {
	if f, ok := t.ResponseWriter.(interface{ FlushError() error }); ok {
		return f.FlushError()
	}
	return proxy.FlushNext(t.ResponseWriter)
}

func (t *trackingWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }
