package proxy

import (
	"context"
	"net/http"
	"time"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// Call is one generation request after the server's middleware has read the
// body (within the size limit) and checked that it is a JSON object.
type Call struct {
	Route     string          // matched route pattern, e.g. "/v1/chat/completions" (metrics label)
	Path      string          // request path to use upstream
	Body      []byte          // the client's raw JSON, never re-encoded
	Obj       *rawjson.Object // parsed view of Body
	Stream    bool            // body has "stream": true
	RequestID string          // the id echoed to the client in x-request-id
	Start     time.Time       // when the router received the request
	Receipt   *Receipt        // route receipt (never nil)
	Top       bool            // flow control's highest band (RegularOptions.Steer)
}

// Dispatcher serves generation requests: the regular proxy and the PD engine
// both implement it. It must write exactly one response to w, respect
// r.Context() (client disconnect), and never panic.
type Dispatcher interface {
	Dispatch(w http.ResponseWriter, r *http.Request, c *Call)
}

// Receipt records how a request was routed, for the x-switchyard-route
// header and the debug log line.
type Receipt struct {
	Mode      string // "regular" or "pd"
	Policy    string
	Worker    string // regular mode
	Prefill   string // PD mode
	Decode    string // PD mode
	Reason    string
	Attempts  int
	Failovers []string
	// Migrated lists, in order, the workers an answer moved off after its
	// first byte (mid-stream migration); Worker served its end.
	Migrated []string
}

type ctxKey struct{}

// WithCall stores c in ctx.
func WithCall(ctx context.Context, c *Call) context.Context {
	return context.WithValue(ctx, ctxKey{}, c)
}

// CallCarrier is a context value that holds a request's Call once it
// exists: the server stores its request state under the Call's key when the
// request begins, so that the Call needs no context (and request copy) of
// its own.
type CallCarrier interface {
	ProxyCall() *Call // nil until the Call exists
}

// WithCallCarrier stores v where CallFrom looks.
func WithCallCarrier(ctx context.Context, v CallCarrier) context.Context {
	return withValue(ctx, ctxKey{}, v)
}

// CarrierFrom returns the CallCarrier stored in ctx, if any.
func CarrierFrom(ctx context.Context) CallCarrier {
	v, _ := ctx.Value(ctxKey{}).(CallCarrier)
	return v
}

// CallFrom returns the Call stored in ctx, directly or by a CallCarrier, if
// any.
func CallFrom(ctx context.Context) *Call {
	switch v := ctx.Value(ctxKey{}).(type) {
	case *Call:
		return v
	case CallCarrier:
		return v.ProxyCall()
	}
	return nil
}
