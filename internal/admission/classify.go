package admission

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// Header names. The objective and fairness headers are the ones llm-d's
// Endpoint Picker reads (llm-d.ai/docs/api-reference/epp-http-headers); the
// deadline header is the one Envoy's router sets on upstream requests.
const (
	DefaultObjectiveHeader = "x-gateway-inference-objective"
	DefaultFairnessHeader  = "x-gateway-inference-fairness-id"
	DefaultDeadlineHeader  = "x-envoy-expected-rq-timeout-ms"
)

// Fairness keys: where a request's flow id comes from.
const (
	FairnessHeader = "header"  // the fairness header
	FairnessAPIKey = "api-key" // the client's bearer token (hashed)
	FairnessUser   = "user"    // the OpenAI "user" body field
)

// ErrBadFlowRequest wraps a request whose flow-control headers are invalid
// (400).
var ErrBadFlowRequest = errors.New("invalid flow-control request")

// FlowConfig turns flow control on in a Limiter.
type FlowConfig struct {
	Bands           []Band
	DefaultBand     string // "" → "default" if such a band exists, else the lowest
	OrderByDeadline bool
	FairnessKey     string // FairnessHeader (default), FairnessAPIKey, FairnessUser
	ObjectiveHeader string // "" → DefaultObjectiveHeader
	FairnessHeader  string // "" → DefaultFairnessHeader
	DeadlineHeader  string // "" → DefaultDeadlineHeader
	Weights         map[string]float64
	Headroom        int // slots only the highest band may use (SchedulerConfig.Headroom)
	// EnginePriority carries a request's band to the engine as vLLM's
	// "priority" body field (-band priority) when the body has none
	// (--flow-engine-priority; for engines run with --scheduling-policy
	// priority, as an fcfs vLLM rejects a non-zero priority).
	EnginePriority bool
	// Saturation, when set, holds requests while the fleet is saturated.
	Saturation *SaturationConfig
}

// classifier maps a request to its band, flow and deadline.
type classifier struct {
	bands       []Band
	byName      map[string]int
	def         int
	key         string
	objective   string
	fairness    string
	deadlineHdr string
}

func newClassifier(c FlowConfig) (*classifier, error) {
	cl := &classifier{bands: c.Bands, byName: map[string]int{}, key: c.FairnessKey,
		objective: c.ObjectiveHeader, fairness: c.FairnessHeader, deadlineHdr: c.DeadlineHeader}
	if cl.objective == "" {
		cl.objective = DefaultObjectiveHeader
	}
	if cl.fairness == "" {
		cl.fairness = DefaultFairnessHeader
	}
	if cl.deadlineHdr == "" {
		cl.deadlineHdr = DefaultDeadlineHeader
	}
	// canonical once: Header.Get of a lower-case name allocates its
	// canonical form on every call
	cl.objective = http.CanonicalHeaderKey(cl.objective)
	cl.fairness = http.CanonicalHeaderKey(cl.fairness)
	cl.deadlineHdr = http.CanonicalHeaderKey(cl.deadlineHdr)
	switch cl.key {
	case "":
		cl.key = FairnessHeader
	case FairnessHeader, FairnessAPIKey, FairnessUser:
	default:
		return nil, fmt.Errorf("flow control: unknown fairness key %q (want header, api-key or user)", c.FairnessKey)
	}
	lowest := 0
	for i, b := range c.Bands {
		cl.byName[b.Name] = i
		if b.Priority < c.Bands[lowest].Priority {
			lowest = i
		}
	}
	cl.def = lowest
	name := c.DefaultBand
	if name == "" {
		name = "default"
	}
	if i, ok := cl.byName[name]; ok {
		cl.def = i
	} else if c.DefaultBand != "" {
		return nil, fmt.Errorf("flow control: default band %q is not one of the bands", c.DefaultBand)
	}
	return cl, nil
}

// byPriority returns the band of the highest priority <= p, else the lowest.
func (cl *classifier) byPriority(p int64) int {
	best, lowest := -1, 0
	for i, b := range cl.bands {
		if int64(b.Priority) <= p && (best < 0 || b.Priority > cl.bands[best].Priority) {
			best = i
		}
		if b.Priority < cl.bands[lowest].Priority {
			lowest = i
		}
	}
	if best < 0 {
		return lowest
	}
	return best
}

// classify reads the objective header (a band name, or an integer priority,
// higher = more important), else vLLM's "priority" body field (lower =
// earlier, as vLLM schedules it; -priority is matched against the bands);
// the flow id; and the deadline header (milliseconds from now).
func (cl *classifier) classify(h http.Header, obj *rawjson.Object, now time.Time) (FlowRequest, error) {
	r := FlowRequest{Band: cl.def}
	if v := strings.TrimSpace(header(h, cl.objective)); v != "" {
		if i, ok := cl.byName[v]; ok {
			r.Band = i
		} else if p, err := strconv.ParseInt(v, 10, 64); err == nil {
			r.Band = cl.byPriority(p)
		} else {
			return r, fmt.Errorf("%w: unknown inference objective %q in %s (want one of the band names or an integer priority)", ErrBadFlowRequest, v, cl.objective)
		}
	} else if obj != nil {
		if p, ok := obj.Int("priority"); ok && p != math.MinInt64 {
			r.Band = cl.byPriority(-p)
		}
	}
	switch cl.key {
	case FairnessHeader:
		r.Flow = header(h, cl.fairness)
	case FairnessAPIKey:
		if tok, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok && tok != "" {
			sum := sha256.Sum256([]byte(tok))
			r.Flow = "key-" + hex.EncodeToString(sum[:6]) // never the key itself
		}
	case FairnessUser:
		if obj != nil {
			r.Flow, _ = obj.String("user")
		}
	}
	if len(r.Flow) > 256 {
		return r, fmt.Errorf("%w: the flow id is longer than 256 bytes", ErrBadFlowRequest)
	}
	if r.Flow == "" {
		r.Flow = DefaultFlow
	}
	if v := strings.TrimSpace(header(h, cl.deadlineHdr)); v != "" {
		ms, err := strconv.ParseFloat(v, 64)
		if err != nil || !(ms >= 0) || math.IsInf(ms, 1) {
			return r, fmt.Errorf("%w: %s must be a number of milliseconds >= 0, got %q", ErrBadFlowRequest, cl.deadlineHdr, v)
		}
		if d := ms * float64(time.Millisecond); d < float64(100*365*24*time.Hour) {
			r.Deadline = now.Add(time.Duration(d)) // beyond a century: no deadline
		}
	}
	return r, nil
}

// header is h.Get for a name already in canonical form.
func header(h http.Header, canonical string) string {
	if v := h[canonical]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// ParseBands parses NAME=PRIORITY[:QUEUE_TIMEOUT_SECS[:ORDER]] items (ORDER
// arrival or deadline; an empty timeout is def); a band without a timeout
// gets def, without an order the global one.
func ParseBands(items []string, def time.Duration) ([]Band, error) {
	var out []Band
	seen := map[string]bool{}
	for _, it := range items {
		name, spec, ok := strings.Cut(it, "=")
		name = strings.TrimSpace(name)
		if !ok || name == "" {
			return nil, fmt.Errorf("flow band %q: want NAME=PRIORITY[:QUEUE_TIMEOUT_SECS[:ORDER]]", it)
		}
		if seen[name] {
			return nil, fmt.Errorf("flow band %q: name repeated", name)
		}
		seen[name] = true
		ps, ts, hasT := strings.Cut(spec, ":")
		p, err := strconv.Atoi(strings.TrimSpace(ps))
		if err != nil {
			return nil, fmt.Errorf("flow band %q: priority %q is not an integer", name, ps)
		}
		b := Band{Name: name, Priority: p, QueueTimeout: def}
		ts, order, _ := strings.Cut(ts, ":")
		if ts = strings.TrimSpace(ts); hasT && ts != "" {
			secs, err := strconv.ParseFloat(ts, 64)
			if err != nil || !(secs >= 0) || math.IsInf(secs, 1) {
				return nil, fmt.Errorf("flow band %q: queue timeout %q must be seconds >= 0", name, ts)
			}
			b.QueueTimeout = time.Duration(secs * float64(time.Second))
		}
		switch b.Order = strings.TrimSpace(order); b.Order {
		case "", OrderArrival, OrderDeadline:
		default:
			return nil, fmt.Errorf("flow band %q: order %q must be arrival or deadline", name, order)
		}
		out = append(out, b)
	}
	if len(out) == 0 {
		return nil, errors.New("flow control needs at least one band")
	}
	return out, nil
}

// ParseWeights parses FLOW=WEIGHT items (weights > 0).
func ParseWeights(items []string) (map[string]float64, error) {
	out := make(map[string]float64, len(items))
	for _, it := range items {
		k, v, ok := strings.Cut(it, "=")
		w, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if !ok || k == "" || err != nil || !(w > 0) || math.IsInf(w, 1) {
			return nil, fmt.Errorf("flow weight %q: want FLOW=WEIGHT with a weight > 0", it)
		}
		out[k] = w
	}
	return out, nil
}
