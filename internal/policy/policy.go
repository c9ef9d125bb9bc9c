// Package policy chooses a worker for a request.
//
// A Policy sees the full membership of one role (so hash rings stay stable
// when a worker is merely unhealthy) and must itself skip workers that are
// not Available() or that the request excludes (a retry never lands on the
// worker that just failed). Picks never block and never take a registry lock.
package policy

import (
	"context"
	"errors"
	"net/http"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// ErrNoWorker is returned when no candidate is available.
var ErrNoWorker = errors.New("no available worker")

// Candidates is the membership of one role at one registry generation. Gen
// changes only when membership changes, so policies may cache derived
// structures (rings) keyed by it.
type Candidates struct {
	Gen     uint64
	Workers []*worker.Worker
}

// Request is what a policy may look at. Body is the client's raw JSON (it may
// be invalid or not an object; policies must not fail on that).
type Request struct {
	Path    string
	Headers http.Header
	Body    []byte

	// Exclude lists worker keys a retry must avoid.
	Exclude map[string]bool

	// ValidJSON may be set by a caller that has already checked that Body
	// is valid JSON (e.g. rawjson.Parse succeeded), so RoutingText and
	// HashKey skip their own json.Valid pass (the larger part of their cost:
	// about 70 µs for a 32 KiB body). Leave it false when unsure; a wrong
	// true never panics but may yield a meaningless routing text.
	ValidJSON bool
	// Obj, when not nil, is Body already parsed (rawjson.Parse): it
	// implies ValidJSON, and a Preparer reads the fields it needs from it
	// instead of parsing Body again.
	Obj *rawjson.Object

	// Tokens are the prompt's token ids as the engine computes them, set
	// by a Preparer before Pick (nil: not tokenized). TokenErr says why
	// they are missing when tokenizing failed.
	Tokens   []uint32
	TokenErr error
	// Prepared is opaque state a Preparer leaves for its own Pick.
	Prepared any
	// Top: the request is in flow control's highest band (set only when a
	// flow-control pick rule needs it).
	Top bool

	// Lazily computed by RoutingText / HashKey (request.go); a Request is
	// used by one goroutine at a time, like *http.Request.
	text    *string // routing text
	hashKey *string // body part of the hash key (headers are checked per call)
}

// Excluded reports whether w must not be picked for this request.
func (r *Request) Excluded(w *worker.Worker) bool {
	return r.Exclude != nil && r.Exclude[w.Key()]
}

// Usable reports whether w may be picked: available and not excluded.
func (r *Request) Usable(w *worker.Worker) bool { return w.Available() && !r.Excluded(w) }

// Choice is a policy's answer with a short reason for the route receipt.
type Choice struct {
	Worker *worker.Worker
	Reason string // e.g. "cache match 0.82", "hash owner", "load 3<5"
}

// Policy picks one worker among candidates.
type Policy interface {
	Name() string
	Pick(req *Request, c Candidates) (Choice, error)
}

// Preparer is implemented by policies that need work done before Pick
// that may block, such as asking an engine to tokenize the prompt.
// Dispatchers call Prepare once per request, with the request's context,
// before the first Pick; Pick itself never blocks.
type Preparer interface {
	Prepare(ctx context.Context, req *Request, c Candidates)
}

// Prepare calls p's Prepare if it has one.
func Prepare(ctx context.Context, p Policy, req *Request, c Candidates) {
	if pp, ok := p.(Preparer); ok {
		pp.Prepare(ctx, req, c)
	}
}

// PairPolicy is implemented by policies that want to choose the prefill and
// decode workers of a PD request together (e.g. a session kept on the same P
// and D). The PD engine uses it when the prefill policy implements it.
type PairPolicy interface {
	PickPair(req *Request, prefill, decode Candidates) (p, d Choice, err error)
}
