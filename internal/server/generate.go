package server

import (
	"errors"
	"net/http"
	"strconv"

	"github.com/switchyard-llm/switchyard/internal/admission"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// pdPassthroughRoutes are not disaggregated in PD mode: a prefill/decode
// split means nothing for embeddings or rerank (no decode phase), so they go
// to Passthrough, which the lead points at the prefill workers.
var pdPassthroughRoutes = map[string]bool{"/v1/embeddings": true, "/v1/rerank": true, "/rerank": true}

// handleGenerate reads and checks the JSON body, takes an admission slot,
// and hands the request to the dispatcher. The slot is released when the
// dispatcher returns, i.e. after the last byte of the (streamed) response.
//
// The checks are in admitGenerate, whose frame is gone from the stack
// while the response is relayed (the first flush of a response is deep,
// and a goroutine whose stack doubled once keeps the larger stack:
// docs/BENCHMARKS.md, section 3).
func (s *Server) handleGenerate(w http.ResponseWriter, r *http.Request) {
	c, slot, passthrough := s.admitGenerate(w, r)
	if c == nil {
		return
	}
	defer slot.Release()
	// r's context yields c (proxy.CallFrom): admitGenerate set st.call.
	if passthrough {
		// The Call in the context gives the passthrough its route label and
		// receipt; the body it streams is the one already read.
		setBody(r, c.Body)
		s.o.Passthrough.ServeHTTP(w, r)
		return
	}
	if c.Route == responsesRoute && s.o.History != nil {
		w = s.learnResponseID(w, c)
	}
	s.o.Generate.Dispatch(w, r, c)
}

// admitGenerate reads and checks the body and takes the admission slot:
// it returns the request's Call, its admission slot and whether the route
// is passed through, or a nil Call when it answered the request.
func (s *Server) admitGenerate(w http.ResponseWriter, r *http.Request) (*proxy.Call, admission.Slot, bool) {
	st := stateFrom(r.Context())
	route := st.route.label
	body, ok := s.readBody(w, r)
	if !ok {
		return nil, admission.Slot{}, false
	}
	if len(body) == 0 {
		s.writeError(w, r, http.StatusBadRequest, "invalid_json", "Request body is empty: expected a JSON object")
		return nil, admission.Slot{}, false
	}
	obj, err := rawjson.Parse(body)
	if err != nil {
		msg := "Invalid request body: " + err.Error() // names the problem and its byte offset
		if errors.Is(err, rawjson.ErrNotObject) {
			msg = "Invalid request body: expected a JSON object"
		}
		s.writeError(w, r, http.StatusBadRequest, "invalid_json", msg)
		return nil, admission.Slot{}, false
	}

	slot, top, err := s.limiter.Admit(r.Context(), r.Header, obj)
	if err != nil {
		s.rejectAdmission(w, r, err)
		return nil, slot, false
	}
	if p, ok := s.limiter.EnginePriority(r.Header, obj); ok {
		// --flow-engine-priority: the band travels to vLLM's scheduler.
		body = obj.Apply(rawjson.Set("priority", strconv.AppendInt(nil, p, 10)))
		if obj, err = rawjson.Parse(body); err != nil {
			s.writeError(w, r, http.StatusInternalServerError, "internal", "patching priority: "+err.Error())
			slot.Release()
			return nil, slot, false
		}
	}

	passthrough := s.o.Mode == ModePD && pdPassthroughRoutes[route]
	if passthrough && s.o.Passthrough == nil {
		s.writeError(w, r, http.StatusNotImplemented, "not_implemented", route+" is not available in PD mode")
		slot.Release()
		return nil, slot, false
	}

	stream, _ := obj.Bool("stream")
	// The Call and its Receipt in one allocation (same lifetime).
	box := &struct {
		c   proxy.Call
		rec proxy.Receipt
	}{rec: proxy.Receipt{Mode: s.o.Mode}}
	c := &box.c
	*c = proxy.Call{
		Route:     route,
		Path:      r.URL.Path,
		Body:      body,
		Obj:       obj,
		Stream:    stream,
		RequestID: st.id,
		Start:     st.start,
		Receipt:   &box.rec,
		Top:       top,
	}
	st.call = c
	return c, slot, passthrough
}

func (s *Server) rejectAdmission(w http.ResponseWriter, r *http.Request, err error) {
	status := admission.Status(err)
	switch status {
	case 499:
		stateFrom(r.Context()).logOnly = 499 // client gone: nobody to answer
	case http.StatusTooManyRequests:
		errType := "queue_full"
		switch {
		case errors.Is(err, admission.ErrRateLimited):
			errType = "rate_limited"
		case errors.Is(err, admission.ErrShed), errors.Is(err, admission.ErrShedFair):
			errType = "shed"
		}
		w.Header().Set("Retry-After", "1")
		s.writeError(w, r, status, errType, err.Error())
	case http.StatusServiceUnavailable:
		w.Header().Set("Connection", "close")
		s.writeError(w, r, status, "shutting_down", err.Error())
	case http.StatusRequestTimeout:
		s.writeError(w, r, status, "queue_timeout", err.Error())
	case http.StatusGatewayTimeout:
		s.writeError(w, r, status, "deadline_exceeded", err.Error())
	case http.StatusBadRequest:
		s.writeError(w, r, status, "invalid_flow_header", err.Error())
	default:
		s.writeError(w, r, status, "admission", err.Error())
	}
}
