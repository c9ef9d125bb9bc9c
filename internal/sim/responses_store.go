package sim

import (
	"container/list"
	"fmt"
	"net/http"
	"sync"
)

// vLLM's Responses API store (VLLM_ENABLE_RESPONSES_API_STORE=1, here
// --responses-store): the final response object of every /v1/responses
// request whose "store" is true or absent is kept in memory under its id and
// served by GET /v1/responses/{response_id}. vLLM's store is an unbounded
// dict; the sim's holds at most --responses-store-max objects and evicts the
// oldest. Without the store vLLM silently ignores "store": nothing is kept
// and every lookup is a 404.
//
// The sim has no background mode, so every stored response is finished
// (completed or incomplete) and POST /v1/responses/{response_id}/cancel
// answers what vLLM answers for such a response: 400 "Cannot cancel a
// synchronous response." (404 for an unknown id).

// responseStore is a bounded, insertion-ordered map from response id to the
// exact JSON bytes of the final response object.
type responseStore struct {
	mu    sync.Mutex
	max   int
	m     map[string]*list.Element
	order *list.List // of *storedResponse, oldest at the front
}

type storedResponse struct {
	id   string
	body []byte
}

func newResponseStore(max int) *responseStore {
	return &responseStore{max: max, m: make(map[string]*list.Element), order: list.New()}
}

// put stores body under id. Storing an id again (a repeated X-Request-Id)
// replaces the object and makes it the newest; past max the oldest goes.
func (s *responseStore) put(id string, body []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.m[id]; ok {
		e.Value.(*storedResponse).body = body
		s.order.MoveToBack(e)
		return
	}
	s.m[id] = s.order.PushBack(&storedResponse{id: id, body: body})
	for s.order.Len() > s.max {
		old := s.order.Remove(s.order.Front()).(*storedResponse)
		delete(s.m, old.id)
	}
}

func (s *responseStore) get(id string) ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[id]
	if !ok {
		return nil, false
	}
	return e.Value.(*storedResponse).body, true
}

func (s *responseStore) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.order.Len()
}

// storeResponse keeps the final response object b of g when the store is on
// and the request asked for storage.
func (in *Instance) storeResponse(g *genReq, b []byte) {
	if in.respStore == nil || !g.store {
		return
	}
	in.respStore.put(g.respID, b)
}

// responseNotFound is vLLM's _make_not_found_error.
func responseNotFound(id string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
		message: fmt.Sprintf("Response with id '%s' not found.", id), param: "response_id"}
}

// lookupResponse returns the stored object of id (never found without the
// store, like vLLM's always-empty store).
func (in *Instance) lookupResponse(id string) ([]byte, bool) {
	if in.respStore == nil {
		return nil, false
	}
	return in.respStore.get(id)
}

// handleRetrieveResponse serves GET /v1/responses/{response_id}. vLLM's
// starting_after/stream query parameters only matter for background
// responses, which the sim does not have; they are ignored.
func (in *Instance) handleRetrieveResponse(w http.ResponseWriter, r *http.Request) {
	in.ctr.reqRetrieve.Add(1)
	id := r.PathValue("response_id")
	b, ok := in.lookupResponse(id)
	if !ok {
		in.writeError(w, responseNotFound(id))
		return
	}
	writeRawJSON(w, http.StatusOK, b)
}

// handleCancelResponse serves POST /v1/responses/{response_id}/cancel. Only
// a queued or in-progress background response can be cancelled in vLLM;
// every stored sim response is finished.
func (in *Instance) handleCancelResponse(w http.ResponseWriter, r *http.Request) {
	in.ctr.reqCancel.Add(1)
	id := r.PathValue("response_id")
	if _, ok := in.lookupResponse(id); !ok {
		in.writeError(w, responseNotFound(id))
		return
	}
	in.writeError(w, &apiError{status: http.StatusBadRequest, typ: "invalid_request_error",
		message: "Cannot cancel a synchronous response.", param: "response_id"})
}
