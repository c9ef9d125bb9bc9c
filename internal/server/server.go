package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/admission"
	"github.com/switchyard-llm/switchyard/internal/h1server"
	"github.com/switchyard-llm/switchyard/internal/history"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/tracing"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Modes.
const (
	ModeRegular = "regular"
	ModePD      = "pd"
)

// Defaults applied by New to zero Options fields.
const (
	DefaultMaxPayloadSize    = 512 << 20
	DefaultMaxHeaderBytes    = 1 << 20
	DefaultReadHeaderTimeout = 10 * time.Second
	DefaultIdleTimeout       = 120 * time.Second
	DefaultBodyReadTimeout   = 60 * time.Second
	DefaultShutdownTimeout   = 30 * time.Second
	DefaultUpstreamTimeout   = 10 * time.Second
	DefaultFlushCachePath    = "/flush_cache"
)

// AddWorkerRequest is a parsed POST /workers body (or /add_worker query).
type AddWorkerRequest struct {
	URL           string
	Role          worker.Role
	ModelID       string
	BootstrapPort *int
	DPSize        int               // 0 = not given
	Labels        map[string]string // e.g. {"policy": "round_robin"} (--enable-igw)
}

// Options configures a Server. Registry and Generate are required.
type Options struct {
	Mode     string           // ModeRegular (default) or ModePD
	Registry *worker.Registry // every worker, whatever found it

	// Generate serves the generation routes (regular proxy or PD engine).
	Generate proxy.Dispatcher
	// Passthrough serves /tokenize, /detokenize, the catch-all, and in PD
	// mode /v1/embeddings and the rerank routes. nil → 404.
	Passthrough http.Handler
	// Ready reports PD readiness with a reason. nil → at least one healthy
	// routable worker (regular) or prefill and decode (PD).
	Ready func() (bool, string)
	// Profile serves /start_profile and /stop_profile in PD mode (which is
	// "start_profile" or "stop_profile", as pd.Engine.ServeProfile takes).
	// nil in PD mode → 404. Regular mode fans out to every worker.
	Profile func(w http.ResponseWriter, r *http.Request, which string)
	// Upstream is the client for the router's own calls to workers
	// (/v1/models, info GETs, fan-outs) and to API-key validation URLs.
	// nil → a client on proxy.NewTransport owned (and closed) by Serve.
	Upstream *http.Client

	// AddWorker and RemoveWorker mutate the fleet (the lead implements them;
	// the server owns HTTP handling). AddWorkerSpec, when set, is used
	// instead of AddWorker so POST /workers can pass worker_type etc.
	AddWorker     func(ctx context.Context, rawURL string) ([]*worker.Worker, error)
	AddWorkerSpec func(ctx context.Context, req AddWorkerRequest) ([]*worker.Worker, error)
	RemoveWorker  func(rawURL string) []*worker.Worker
	// DiscoveryStatus is extra JSON-able detail for /get_server_info and
	// /workers (e.g. ZMQ listener address, live instances, MoRI mode).
	DiscoveryStatus func() any
	// History remembers which worker stored each relayed Responses API
	// object (--history-backend memory): retrieval and cancel go to that
	// worker only. nil → every worker is asked (--history-backend none).
	History *history.Store
	// LoRAChanged, if set, is told of a LoRA adapter loaded through the
	// router (the model ids of the workers that took it, sorted) or
	// unloaded (models nil): --enable-igw routes the adapter's requests
	// to its base model's fleet.
	LoRAChanged func(name string, models []string)
	// LoRAByModel gives a worker that lacks them only the adapters that
	// workers of its own model took (--enable-igw: another base model
	// cannot take them).
	LoRAByModel bool
	// ExtraModels are /v1/models entries the router serves without a
	// registered worker (--enable-igw's upstream models); nil = none.
	ExtraModels func() []json.RawMessage
	// ModelsStatus groups the workers by model for /workers (--enable-igw);
	// nil → no "models" key.
	ModelsStatus func() any
	// PDStatus is the PD engine's pair state (troubled pairs, warm-ups) for
	// /workers and /get_server_info; nil outside PD mode.
	PDStatus func() any
	// Sections are more named sections of /workers and /get_server_info
	// (e.g. "kv_aware": the KV index and each worker's event stream).
	Sections map[string]func() any

	Version  string            // router version for /get_server_info
	Policies map[string]string // e.g. {"policy":"cache_aware","prefill":"random","decode":"power_of_two"}

	MaxPayloadSize int64 // request body limit (413 above); 0 → 512 MiB
	MaxHeaderBytes int   // 0 → 1 MiB
	// BuiltinHTTP serves the client listener with internal/h1server instead
	// of net/http's Server (--http-server builtin).
	BuiltinHTTP        bool
	ReadHeaderTimeout  time.Duration
	IdleTimeout        time.Duration
	BodyReadTimeout    time.Duration // deadline for reading a buffered body; 0 → 60 s, < 0 → none
	RequestIDHeaders   []string      // inbound id headers, in order; nil → x-request-id, x-correlation-id, x-trace-id, request-id
	CORSAllowedOrigins []string      // empty → any origin

	APIKeyValidationURLs []string // inbound bearer tokens are valid when one of these answers 200
	RouterAPIKeys        []string // static inbound keys
	AdminAPIKey          string   // when set, the only key accepted on admin endpoints

	MaxConcurrent      int           // generation slots held until the body ends; <= 0 → unlimited
	QueueSize          int           // requests waiting for a slot
	QueueTimeout       time.Duration // max wait in the queue; <= 0 → until the client leaves
	RateLimitPerSecond float64       // token bucket, 0 = off
	RateLimitBurst     int           // 0 → ceil(rate)
	// Flow, when set, turns flow control on (priority bands, fair flows,
	// saturation-aware dispatch). Its Saturation's Registry, PD and Client
	// are filled in from these Options when unset.
	Flow *admission.FlowConfig

	RouteReceipt    bool          // set x-switchyard-route on generation responses
	ShutdownTimeout time.Duration // drain deadline; 0 → 30 s, < 0 → cancel at once
	UpstreamTimeout time.Duration // router's own worker calls; 0 → 10 s
	FlushCachePath  string        // worker path POSTed by /flush_cache; "" → /flush_cache

	Logger  *slog.Logger
	Metrics *metrics.Metrics
	// Tracer starts a server span per request (nil = tracing off: no
	// span work at all).
	Tracer *tracing.Tracer

	// APIKey is the upstream key sent as Bearer on the router's own worker
	// calls. When empty and ForwardClientAuthorization is set, the client's
	// Authorization header is forwarded instead.
	APIKey                     string
	ForwardClientAuthorization bool
}

// Server is the router's HTTP front end.
type Server struct {
	o         Options
	log       *slog.Logger
	m         *metrics.Metrics
	tr        *tracing.Tracer
	reg       *worker.Registry
	limiter   *admission.Limiter
	auth      *authenticator
	cors      corsPolicy
	idHeaders []string
	client    *http.Client
	ownClient bool
	mux       *http.ServeMux
	handler   http.Handler
	allowed   map[string][]string  // route path → allowed methods (for 405)
	info      map[string]routeInfo // mux pattern → route facts
	started   time.Time
	lora      *loraSet // adapters loaded through the router

	// Hot-path metric children, looked up once (label hashing per request
	// showed in CPU profiles): the in-flight gauge of this server's mode,
	// RequestsTotal per route, and the end-of-request pair per
	// (route, method, status) (reqMetricsFor).
	inFlight      prometheus.Gauge
	requestsTotal sync.Map // route label -> prometheus.Counter
	reqMetrics    sync.Map // reqMetricsKey -> reqMetrics

	draining       atomic.Bool
	active         activeCounter
	deadlineWarned atomic.Bool // the body read deadline could not be set (logged once)
}

// New validates o and builds a Server.
func New(o Options) (*Server, error) {
	switch o.Mode {
	case "":
		o.Mode = ModeRegular
	case ModeRegular, ModePD:
	default:
		return nil, fmt.Errorf("server: unknown mode %q (want %q or %q)", o.Mode, ModeRegular, ModePD)
	}
	if o.Registry == nil {
		return nil, errors.New("server: Registry is required")
	}
	if o.Generate == nil {
		return nil, errors.New("server: Generate dispatcher is required")
	}
	if o.MaxPayloadSize <= 0 {
		o.MaxPayloadSize = DefaultMaxPayloadSize
	}
	if o.MaxHeaderBytes <= 0 {
		o.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if o.ReadHeaderTimeout <= 0 {
		o.ReadHeaderTimeout = DefaultReadHeaderTimeout
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
	if o.BodyReadTimeout == 0 {
		o.BodyReadTimeout = DefaultBodyReadTimeout
	}
	if o.ShutdownTimeout == 0 {
		o.ShutdownTimeout = DefaultShutdownTimeout
	}
	if o.UpstreamTimeout <= 0 {
		o.UpstreamTimeout = DefaultUpstreamTimeout
	}
	if o.FlushCachePath == "" {
		o.FlushCachePath = DefaultFlushCachePath
	}
	s := &Server{o: o, log: o.Logger, m: o.Metrics, tr: o.Tracer, reg: o.Registry, started: time.Now(), lora: newLoRASet()}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.m == nil {
		s.m = metrics.NewForTest()
	}
	s.inFlight = s.m.InFlight.WithLabelValues(o.Mode)
	s.client = o.Upstream
	if s.client == nil {
		s.client = &http.Client{Transport: proxy.NewH1Transport(proxy.TransportOptions{})}
		s.ownClient = true
	}
	var err error
	if s.idHeaders, err = requestIDHeaders(o.RequestIDHeaders); err != nil {
		return nil, err
	}
	if s.cors, err = newCORS(o.CORSAllowedOrigins); err != nil {
		return nil, err
	}
	s.auth = newAuthenticator(o.RouterAPIKeys, o.AdminAPIKey, o.APIKeyValidationURLs, s.client, s.log)
	if s.limiter, err = admission.NewWithFlow(admission.Config{
		MaxConcurrent:      o.MaxConcurrent,
		QueueSize:          o.QueueSize,
		QueueTimeout:       o.QueueTimeout,
		RateLimitPerSecond: o.RateLimitPerSecond,
		Burst:              o.RateLimitBurst,
		Metrics:            s.m,
		Flow:               s.flowConfig(),
	}); err != nil {
		return nil, fmt.Errorf("server: %w", err)
	}
	s.routes()
	s.handler = http.HandlerFunc(s.serveHTTP)
	return s, nil
}

// flowConfig completes o.Flow's saturation inputs from the Options.
func (s *Server) flowConfig() *admission.FlowConfig {
	if s.o.Flow == nil || s.o.Flow.Saturation == nil {
		return s.o.Flow
	}
	fc := *s.o.Flow
	sat := *fc.Saturation
	if sat.Registry == nil {
		sat.Registry = s.reg
	}
	sat.PD = sat.PD || s.o.Mode == ModePD
	if sat.Client == nil {
		sat.Client = s.client
	}
	if sat.Logger == nil {
		sat.Logger = s.log
	}
	fc.Saturation = &sat
	return &fc
}

// Handler returns the root handler: every route behind the full middleware
// chain (recover → request id → CORS → auth → access log/metrics → body
// limit), the catch-all included.
func (s *Server) Handler() http.Handler { return s.handler }

// Limiter exposes the admission limiter (for status pages and tests).
func (s *Server) Limiter() *admission.Limiter { return s.limiter }

// Serve serves HTTP on ln until ctx is cancelled, then shuts down
// gracefully: it stops accepting, rejects queued admissions, lets in-flight
// requests (streams included) finish for up to ShutdownTimeout, then cancels
// the contexts of those still running (dispatchers end their streams with an
// SSE error event), waits briefly for their handlers, closes every
// connection and returns. It returns nil after a ctx-initiated shutdown.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	base, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()
	hs := s.httpServer(base)
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	flowCtx, stopFlow := context.WithCancel(base)
	var flowWG sync.WaitGroup
	flowWG.Go(func() { s.limiter.Run(flowCtx) }) // the saturation detector, if any
	defer flowWG.Wait()
	defer stopFlow()
	if s.ownClient {
		defer s.closeClient()
	}

	select {
	case err := <-errc:
		s.limiter.Close()
		_ = hs.Close() // h1server's net/http fallback
		return err
	case <-ctx.Done():
	}
	s.draining.Store(true)
	s.limiter.Close()
	inflight := s.active.n()
	s.log.Info("shutting down", "in_flight", inflight, "deadline", s.o.ShutdownTimeout)

	drainCtx, cancelDrain := context.WithTimeout(context.Background(), max(s.o.ShutdownTimeout, 0))
	err := hs.Shutdown(drainCtx)
	cancelDrain()
	if err != nil {
		// Deadline passed with requests still running: cancel them so the
		// dispatchers end their streams cleanly, give the handlers a moment
		// to write the error event and return, then cut the connections.
		left := s.active.n()
		s.log.Warn("shutdown deadline reached, cancelling in-flight requests", "in_flight", left)
		cancelBase()
		// Shutdown again, not just a wait for the handlers: a handler that
		// returned has not necessarily had its response flushed yet, and
		// a connection only goes idle once it has.
		grace := min(max(s.o.ShutdownTimeout/4, time.Second), 5*time.Second)
		graceCtx, cancelGrace := context.WithTimeout(context.Background(), grace)
		if hs.Shutdown(graceCtx) != nil {
			s.log.Warn("handlers still running after cancel; closing connections", "in_flight", s.active.n())
		}
		cancelGrace()
		_ = hs.Close()
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		return serr
	}
	s.log.Info("server stopped")
	return nil
}

// httpServer is what Serve needs of an HTTP server: net/http's and
// h1server's.
type httpServer interface {
	Serve(net.Listener) error
	Shutdown(context.Context) error
	Close() error
}

// httpServer returns the client listener's server, its requests' contexts
// derived from base. No WriteTimeout/ReadTimeout: a generation stream may
// last many minutes; body reads get their own deadline (BodyReadTimeout).
func (s *Server) httpServer(base context.Context) httpServer {
	errLog := slog.NewLogLogger(s.log.Handler(), slog.LevelWarn)
	baseCtx := func(net.Listener) context.Context { return base }
	if !s.o.BuiltinHTTP {
		return &http.Server{
			Handler:           s.handler,
			ReadHeaderTimeout: s.o.ReadHeaderTimeout,
			IdleTimeout:       s.o.IdleTimeout,
			MaxHeaderBytes:    s.o.MaxHeaderBytes,
			BaseContext:       baseCtx,
			ErrorLog:          errLog,
		}
	}
	return &h1server.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: s.o.ReadHeaderTimeout,
		IdleTimeout:       s.o.IdleTimeout,
		MaxHeaderBytes:    s.o.MaxHeaderBytes,
		BaseContext:       baseCtx,
		ErrorLog:          errLog,
	}
}

// activeCounter counts running handlers (for the shutdown logs).
type activeCounter struct {
	mu    sync.Mutex
	count int
}

func (a *activeCounter) inc() {
	a.mu.Lock()
	a.count++
	a.mu.Unlock()
}

func (a *activeCounter) dec() {
	a.mu.Lock()
	a.count--
	a.mu.Unlock()
}

func (a *activeCounter) n() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.count
}

// closeClient closes the upstream client the server made for itself.
func (s *Server) closeClient() {
	if t, ok := s.client.Transport.(interface{ Close() }); ok {
		t.Close()
		return
	}
	s.client.CloseIdleConnections()
}
