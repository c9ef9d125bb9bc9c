// Package otlptest is a minimal in-process OTLP/gRPC trace collector for
// tests: it accepts ExportTraceServiceRequest calls and keeps the spans.
package otlptest

import (
	"context"
	"encoding/hex"
	"net"
	"strconv"
	"sync"
	"time"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/grpc"
)

// Span is the part of an exported span the tests look at.
type Span struct {
	Service  string
	Name     string
	Kind     int32 // OTLP enum: 2 server, 3 client
	TraceID  string
	SpanID   string
	ParentID string
	Status   int32 // OTLP enum: 0 unset, 1 ok, 2 error
	Attrs    map[string]string
	Events   []string
	Start    time.Time
	End      time.Time
}

// Collector is a running fake collector.
type Collector struct {
	coltrace.UnimplementedTraceServiceServer
	srv  *grpc.Server
	ln   net.Listener
	mu   sync.Mutex
	got  []Span
	done chan struct{}
}

// Start listens on 127.0.0.1 (a free port) and serves until Stop.
func Start() (*Collector, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	c := &Collector{srv: grpc.NewServer(), ln: ln, done: make(chan struct{})}
	coltrace.RegisterTraceServiceServer(c.srv, c)
	go func() {
		defer close(c.done)
		_ = c.srv.Serve(ln)
	}()
	return c, nil
}

// Addr is the collector's host:port.
func (c *Collector) Addr() string { return c.ln.Addr().String() }

// Stop stops the server and waits for it.
func (c *Collector) Stop() {
	c.srv.Stop()
	<-c.done
}

// Spans returns every span received so far.
func (c *Collector) Spans() []Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]Span(nil), c.got...)
}

// Export implements the OTLP trace service.
func (c *Collector) Export(_ context.Context, req *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	var spans []Span
	for _, rs := range req.GetResourceSpans() {
		service := attrMap(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				sp := Span{
					Service: service, Name: s.GetName(), Kind: int32(s.GetKind()),
					TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					ParentID: hex.EncodeToString(s.GetParentSpanId()), Status: int32(s.GetStatus().GetCode()),
					Attrs: attrMap(s.GetAttributes()),
					Start: time.Unix(0, int64(s.GetStartTimeUnixNano())), End: time.Unix(0, int64(s.GetEndTimeUnixNano())),
				}
				for _, e := range s.GetEvents() {
					sp.Events = append(sp.Events, e.GetName())
				}
				spans = append(spans, sp)
			}
		}
	}
	c.mu.Lock()
	c.got = append(c.got, spans...)
	c.mu.Unlock()
	return &coltrace.ExportTraceServiceResponse{}, nil
}

// attrMap renders attribute values as strings (ints in decimal).
func attrMap(kvs []*commonpb.KeyValue) map[string]string {
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		v := kv.GetValue()
		switch x := v.GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = x.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = strconv.FormatInt(x.IntValue, 10)
		case *commonpb.AnyValue_BoolValue:
			if x.BoolValue {
				m[kv.GetKey()] = "true"
			} else {
				m[kv.GetKey()] = "false"
			}
		default:
			m[kv.GetKey()] = v.String()
		}
	}
	return m
}
