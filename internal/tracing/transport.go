package tracing

import (
	"io"
	"net/http"
	"strconv"
	"sync"

	"go.opentelemetry.io/otel/trace"
)

// TransportOptions configures Transport.
type TransportOptions struct {
	// Phase is the vllm.request_phase of every span (PhaseInference when
	// empty).
	Phase string
	// Route returns the matched route pattern of an upstream request (from
	// its context), or "" when unknown. nil = always unknown.
	Route func(*http.Request) string
	// RankHeader names the request header that carries the worker's
	// data-parallel rank (X-Data-Parallel-Rank when empty).
	RankHeader string
}

// Transport wraps base so that every upstream request gets a client span
// (child of the span in the request's context) and carries its W3C trace
// context. The span ends when the response body is closed or read to the
// end, so it covers a whole stream. With t disabled it returns base itself:
// no wrapper, no cost.
func (t *Tracer) Transport(base http.RoundTripper, o TransportOptions) http.RoundTripper {
	if t == nil {
		return base
	}
	if base == nil {
		base = http.DefaultTransport
	}
	if o.Phase == "" {
		o.Phase = PhaseInference
	}
	if o.RankHeader == "" {
		o.RankHeader = "X-Data-Parallel-Rank"
	}
	return &transport{t: t, base: base, o: o}
}

type transport struct {
	t    *Tracer
	base http.RoundTripper
	o    TransportOptions
}

func (x *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	leg := Leg{Phase: x.o.Phase, Method: req.Method, DPRank: -1}
	if x.o.Route != nil {
		leg.Route = x.o.Route(req)
	}
	span := x.t.StartClient(ctx, leg)
	if span.IsRecording() {
		u := *req.URL
		u.User = nil // never export credentials
		leg.URL = u.String()
		worker := req.URL.Scheme + "://" + req.URL.Host
		rank := -1
		if v := req.Header.Get(x.o.RankHeader); v != "" {
			if n, err := strconv.Atoi(v); err == nil {
				rank = n
				worker += "@" + v
			}
		}
		// StartClient ran before the URL was rendered (it costs a string
		// per request): add what it could not.
		setLegAttrs(span, leg.URL, worker, rank)
	}
	// RoundTrip must not modify req: inject into a copy of its headers.
	out := req.Clone(ctx)
	x.t.Inject(ctx, span, out.Header)
	resp, err := x.base.RoundTrip(out)
	if err != nil {
		Fail(span, "transport", err)
		span.End()
		return resp, err
	}
	SetStatus(span, resp.StatusCode)
	if resp.Body == nil || resp.Body == http.NoBody || resp.StatusCode == http.StatusSwitchingProtocols {
		span.End()
		return resp, nil
	}
	resp.Body = &spanBody{rc: resp.Body, span: span}
	return resp, nil
}

// spanBody ends its span at EOF, on a read error or on Close, whichever
// comes first.
type spanBody struct {
	rc   io.ReadCloser
	span trace.Span
	once sync.Once
}

func (b *spanBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil {
		if err != io.EOF {
			b.once.Do(func() {
				Fail(b.span, "body", err)
				b.span.End()
			})
		} else {
			b.end()
		}
	}
	return n, err
}

func (b *spanBody) Close() error {
	err := b.rc.Close()
	b.end()
	return err
}

func (b *spanBody) end() { b.once.Do(func() { b.span.End() }) }
