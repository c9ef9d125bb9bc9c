// Package tracing is Switchyard's OpenTelemetry tracing: an OTLP/gRPC
// exporter behind a batch processor, a ParentBased(TraceIDRatio) sampler,
// W3C TraceContext + Baggage propagation, one server span per request and
// one client span per upstream leg (REFERENCE §7.3).
//
// Cost when tracing is off: nothing. A disabled *Tracer is nil; every
// method and helper here is nil-safe and returns at once without
// allocating, callers guard span work with Enabled() or a nil span, and
// the upstream transport is not wrapped at all. Inbound traceparent,
// tracestate and baggage headers then reach the workers verbatim (the
// regular proxy forwards client headers; the PD engine copies these three).
//
// When on, attributes are only built for spans that record
// (span.IsRecording()): a request sampled out costs a non-recording span
// and the propagation of its (unsampled) context.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// DefaultExcludedPaths are the paths without a server span when
// Config.ExcludedPaths is empty (probes would swamp the traces).
var DefaultExcludedPaths = []string{"/health", "/health_generate", "/liveness", "/readiness"}

// DefaultEndpoint is the collector when neither the flag nor
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT is set.
const DefaultEndpoint = "http://localhost:4317"

// Attribute keys beyond the HTTP semantic conventions.
const (
	AttrRequestID    = "request_id"         // the id echoed to the client (server span)
	AttrPhase        = "vllm.request_phase" // PhasePrefill, PhaseDecode or PhaseInference
	AttrWorker       = "vllm.worker"        // worker key (base URL, "@rank" for DP workers)
	AttrDPRank       = "vllm.dp_rank"       // data-parallel rank the leg is pinned to
	AttrConnector    = "vllm.kv_connector"  // nixl | mooncake | moriio | p2pnccl
	AttrTransferMode = "vllm.transfer_mode" // READ | WRITE (MoRI-IO workers)
	AttrOrder        = "vllm.pd_order"      // sequential | concurrent (the metrics' "mode" label)
	AttrTransferID   = "vllm.transfer_id"   // Mooncake / MoRI-IO transfer id
	AttrPDRequestID  = "vllm.pd_request_id" // X-Request-Id sent on both legs
	AttrAttempt      = "vllm.attempt"       // 1 for the first (P, D) pair, 2 after one failover, ...
	AttrErrorType    = "error.type"         // router error type or leg failure reason
)

// Phases (vllm.request_phase values).
const (
	PhasePrefill   = "prefill"
	PhaseDecode    = "decode"
	PhaseInference = "inference" // a regular (non-PD) upstream call
)

// EventFirstByte marks a decode leg's first body byte: the KV cache
// arrived and the first token was produced.
const EventFirstByte = "first_byte"

const (
	instrumentation  = "github.com/switchyard-llm/switchyard"
	batchTimeout     = 500 * time.Millisecond // REFERENCE §7.3
	maxExportBatch   = 64
	errorLogInterval = 30 * time.Second
)

// Config configures tracing.
type Config struct {
	// Endpoint is the OTLP/gRPC collector, host:port or a URL ("http://"
	// is prefixed when there is no scheme; https:// uses TLS). Empty →
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, then OTEL_EXPORTER_OTLP_ENDPOINT,
	// then DefaultEndpoint.
	Endpoint string
	// SamplingRatio is the root sampling probability in [0,1]; a sampled
	// or unsampled parent (inbound traceparent) is always followed.
	SamplingRatio float64
	// ExcludedPaths are exact request paths without a server span; nil or
	// empty → DefaultExcludedPaths.
	ExcludedPaths []string

	ServiceName    string // resource service.name (default "switchyard"; OTEL_SERVICE_NAME wins)
	ServiceVersion string
	Logger         *slog.Logger // exporter errors, rate-limited (nil = discard)
}

// Tracer creates Switchyard's spans. A nil *Tracer is a disabled tracer.
type Tracer struct {
	provider *sdktrace.TracerProvider
	tracer   trace.Tracer
	prop     propagation.TextMapPropagator
	excluded map[string]struct{}
}

// New starts tracing with an OTLP/gRPC exporter (it connects lazily: an
// unreachable collector costs dropped spans and a rate-limited warning,
// never a failed request). Shutdown flushes it.
func New(ctx context.Context, cfg Config) (*Tracer, error) {
	endpoint := ResolveEndpoint(cfg.Endpoint)
	exp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpointURL(endpoint))
	if err != nil {
		return nil, fmt.Errorf("otlp exporter for %s: %w", endpoint, err)
	}
	if cfg.Logger != nil {
		setErrorHandler(cfg.Logger)
	}
	return newTracer(ctx, cfg, sdktrace.WithBatcher(exp,
		sdktrace.WithBatchTimeout(batchTimeout), sdktrace.WithMaxExportBatchSize(maxExportBatch)))
}

// NewWithExporter is New with a caller-supplied exporter behind a
// synchronous processor (each span is exported when it ends), e.g.
// tracetest.NewInMemoryExporter() in tests.
func NewWithExporter(cfg Config, exp sdktrace.SpanExporter) (*Tracer, error) {
	return newTracer(context.Background(), cfg, sdktrace.WithSyncer(exp))
}

func newTracer(ctx context.Context, cfg Config, proc sdktrace.TracerProviderOption) (*Tracer, error) {
	if !(cfg.SamplingRatio >= 0 && cfg.SamplingRatio <= 1) {
		return nil, fmt.Errorf("sampling ratio %v is outside [0,1]", cfg.SamplingRatio)
	}
	name := cfg.ServiceName
	if name == "" {
		name = "switchyard"
	}
	attrs := []attribute.KeyValue{
		attribute.String("service.name", name),
		attribute.String("service.instance.id", instanceID()),
	}
	if cfg.ServiceVersion != "" {
		attrs = append(attrs, attribute.String("service.version", cfg.ServiceVersion))
	}
	// later detectors win: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
	// override the defaults above
	res, err := resource.New(ctx, resource.WithTelemetrySDK(), resource.WithAttributes(attrs...), resource.WithFromEnv())
	if err != nil && res == nil {
		return nil, fmt.Errorf("trace resource: %w", err)
	}
	tp := sdktrace.NewTracerProvider(
		proc,
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.SamplingRatio))),
	)
	paths := cfg.ExcludedPaths
	if len(paths) == 0 {
		paths = DefaultExcludedPaths
	}
	t := &Tracer{
		provider: tp,
		tracer:   tp.Tracer(instrumentation),
		prop:     propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}),
		excluded: make(map[string]struct{}, len(paths)),
	}
	for _, p := range paths {
		t.excluded[p] = struct{}{}
	}
	return t, nil
}

// ResolveEndpoint applies the endpoint fallbacks and the http:// default
// scheme.
func ResolveEndpoint(flag string) string {
	ep := strings.TrimSpace(flag)
	for _, env := range []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"} {
		if ep != "" {
			break
		}
		ep = strings.TrimSpace(os.Getenv(env))
	}
	if ep == "" {
		return DefaultEndpoint
	}
	if !strings.Contains(ep, "://") {
		ep = "http://" + ep
	}
	return ep
}

func instanceID() string {
	host := ""
	for _, k := range []string{"HOSTNAME", "HOST", "COMPUTERNAME"} {
		if host = os.Getenv(k); host != "" {
			break
		}
	}
	if host == "" {
		host, _ = os.Hostname()
	}
	if host == "" {
		host = "pid"
	}
	return host + "-" + strconv.Itoa(os.Getpid())
}

// lastExportError rate-limits exporter error logs (process-wide, like the
// OpenTelemetry error handler it feeds).
var lastExportError atomic.Int64

func setErrorHandler(log *slog.Logger) {
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		now := time.Now().UnixNano()
		last := lastExportError.Load()
		if now-last < int64(errorLogInterval) || !lastExportError.CompareAndSwap(last, now) {
			return
		}
		log.Warn("opentelemetry export error (further errors suppressed for 30s)", "err", err)
	}))
}

// Enabled reports whether t records anything. Callers use it to skip all
// span work on the hot path.
func (t *Tracer) Enabled() bool { return t != nil }

// Shutdown flushes pending spans and stops the exporter. Nil-safe.
func (t *Tracer) Shutdown(ctx context.Context) error {
	if t == nil {
		return nil
	}
	err := t.provider.ForceFlush(ctx)
	return errors.Join(err, t.provider.Shutdown(ctx))
}

// Excluded reports whether path gets no server span.
func (t *Tracer) Excluded(path string) bool {
	if t == nil {
		return true
	}
	_, ok := t.excluded[path]
	return ok
}

// StartServer starts the server span of r, child of the inbound
// traceparent (and carrying the inbound baggage), named "METHOD route"
// (just "METHOD" when no route matched). It returns r's context and a nil
// span when t is disabled or the path is excluded.
func (t *Tracer) StartServer(r *http.Request, route string) (context.Context, trace.Span) {
	ctx := r.Context()
	if t == nil || t.Excluded(r.URL.Path) {
		return ctx, nil
	}
	ctx = t.prop.Extract(ctx, propagation.HeaderCarrier(r.Header))
	name := r.Method
	if route != "" {
		name += " " + route
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer))
	if span.IsRecording() {
		attrs := make([]attribute.KeyValue, 0, 4)
		attrs = append(attrs,
			attribute.String("http.request.method", r.Method),
			attribute.String("url.path", r.URL.Path),
		)
		if route != "" {
			attrs = append(attrs, attribute.String("http.route", route))
		}
		if ua := r.UserAgent(); ua != "" {
			attrs = append(attrs, attribute.String("user_agent.original", ua))
		}
		span.SetAttributes(attrs...)
	}
	return ctx, span
}

// StartInternal starts a root span for work the router does on its own
// (a PD pair warm-up), so the legs it sends have a parent. It returns ctx
// and a nil span when t is disabled; end the span with End.
func (t *Tracer) StartInternal(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if t == nil {
		return ctx, nil
	}
	return t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal), trace.WithNewRoot(),
		trace.WithAttributes(attrs...))
}

// End ends span. Nil-safe.
func End(span trace.Span) {
	if span != nil {
		span.End()
	}
}

// EndServer records the response on a server span and ends it: status
// code, request id, error type; status Error on 5xx. Nil-safe.
func EndServer(span trace.Span, status int, requestID, errType string) {
	if span == nil {
		return
	}
	if span.IsRecording() {
		span.SetAttributes(
			attribute.Int("http.response.status_code", status),
			attribute.String(AttrRequestID, requestID),
		)
		if errType != "" {
			span.SetAttributes(attribute.String(AttrErrorType, errType))
		}
		if status >= 500 {
			span.SetStatus(codes.Error, http.StatusText(status))
		}
	}
	span.End()
}

// Leg describes one upstream call.
type Leg struct {
	Phase  string // PhasePrefill, PhaseDecode or PhaseInference
	Method string
	URL    string // full upstream URL
	Route  string // matched route pattern ("" = unknown)
	Worker string // worker key
	DPRank int    // < 0 = none
}

// StartClient starts a client span for an upstream call, child of the span
// in ctx, and returns it (nil when t is disabled). Further attributes
// belong under span.IsRecording().
func (t *Tracer) StartClient(ctx context.Context, leg Leg) trace.Span {
	if t == nil {
		return nil
	}
	name := leg.Method
	if leg.Route != "" {
		name += " " + leg.Route
	}
	_, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient))
	if span.IsRecording() {
		attrs := make([]attribute.KeyValue, 0, 3)
		attrs = append(attrs,
			attribute.String("http.request.method", leg.Method),
			attribute.String(AttrPhase, leg.Phase),
		)
		if leg.Route != "" {
			attrs = append(attrs, attribute.String("http.route", leg.Route))
		}
		span.SetAttributes(attrs...)
		setLegAttrs(span, leg.URL, leg.Worker, leg.DPRank)
	}
	return span
}

// setLegAttrs adds the upstream URL, server address and worker of a
// recording client span (empty values are skipped).
func setLegAttrs(span trace.Span, url, worker string, rank int) {
	attrs := make([]attribute.KeyValue, 0, 5)
	if url != "" {
		attrs = append(attrs, attribute.String("url.full", url))
		if host, port, ok := hostPort(url); ok {
			attrs = append(attrs, attribute.String("server.address", host))
			if port > 0 {
				attrs = append(attrs, attribute.Int("server.port", port))
			}
		}
	}
	if worker != "" {
		attrs = append(attrs, attribute.String(AttrWorker, worker))
	}
	if rank >= 0 {
		attrs = append(attrs, attribute.Int(AttrDPRank, rank))
	}
	span.SetAttributes(attrs...)
}

// hostPort splits the authority of a URL like http://host:port/path.
func hostPort(u string) (string, int, bool) {
	_, rest, ok := strings.Cut(u, "://")
	if !ok {
		return "", 0, false
	}
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		rest = rest[:i]
	}
	if i := strings.LastIndexByte(rest, '@'); i >= 0 {
		rest = rest[i+1:]
	}
	host, p, err := net.SplitHostPort(rest)
	if err != nil {
		return strings.Trim(rest, "[]"), 0, rest != ""
	}
	n, _ := strconv.Atoi(p)
	return host, n, true
}

// Inject writes the W3C traceparent/tracestate and baggage of span (and
// the baggage in ctx) into h, replacing any the client sent. Nil-safe: with
// a nil span h is left as is, so inbound headers copied into it pass
// through verbatim.
func (t *Tracer) Inject(ctx context.Context, span trace.Span, h http.Header) {
	if t == nil || span == nil {
		return
	}
	t.prop.Inject(trace.ContextWithSpan(ctx, span), propagation.HeaderCarrier(h))
}

// SetStatus records an upstream response status on a client span (Error on
// 5xx). Nil-safe.
func SetStatus(span trace.Span, status int) {
	if span == nil || !span.IsRecording() {
		return
	}
	span.SetAttributes(attribute.Int("http.response.status_code", status))
	if status >= 500 {
		span.SetStatus(codes.Error, http.StatusText(status))
	}
}

// Fail marks a client span failed with a reason (error.type) and an
// optional error. Nil-safe.
func Fail(span trace.Span, reason string, err error) {
	if span == nil || !span.IsRecording() {
		return
	}
	if reason != "" {
		span.SetAttributes(attribute.String(AttrErrorType, reason))
	}
	desc := reason
	if err != nil {
		span.RecordError(err)
		desc = err.Error()
	}
	span.SetStatus(codes.Error, desc)
}

// Event adds a named event to a recording span. Nil-safe.
func Event(span trace.Span, name string) {
	if span == nil || !span.IsRecording() {
		return
	}
	span.AddEvent(name)
}
