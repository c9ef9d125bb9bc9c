package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/admission"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// REST error codes of the /workers endpoints (flat {"error","code"} shape,
// as the Rust router's).
const (
	codeAddFailed    = "ADD_WORKER_FAILED"
	codeExists       = "WORKER_EXISTS"
	codeNotFound     = "WORKER_NOT_FOUND"
	codeInvalidURL   = "INVALID_URL"
	codeNotSupported = "NOT_SUPPORTED"
	codeTimeout      = "ADD_WORKER_TIMEOUT"
)

type restError struct {
	Error string `json:"error"`
	Code  string `json:"code"`
}

func (s *Server) writeRESTError(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	if st := stateFrom(r.Context()); st != nil {
		st.errType = strings.ToLower(code)
	}
	writeJSON(w, status, restError{Error: msg, Code: code})
}

// workerJSON is one worker as the /workers endpoints show it: live values
// read from the worker, nothing hard-coded.
type workerJSON struct {
	URL            string `json:"url"`
	Key            string `json:"key"`
	ModelID        string `json:"model_id"`
	WorkerType     string `json:"worker_type"`
	IsHealthy      bool   `json:"is_healthy"`
	Routable       bool   `json:"routable"`
	Note           string `json:"note"` // why a worker is held aside, etc.
	Load           int64  `json:"load"`
	PolledLoad     int64  `json:"polled_load"`
	TotalRequests  uint64 `json:"total_requests"`
	Source         string `json:"source"`
	DPRank         *int   `json:"dp_rank"`
	DPSize         int    `json:"dp_size"`
	TPSize         int    `json:"tp_size"`
	TransferMode   string `json:"transfer_mode"`
	ZMQAddress     string `json:"zmq_address"`
	BootstrapPort  int    `json:"bootstrap_port,omitempty"`
	Format         string `json:"registration_format,omitempty"`
	CircuitBreaker string `json:"circuit_breaker"`
	ConnectionMode string `json:"connection_mode"`
	LastSeen       string `json:"last_seen"`
	// Saturation is what flow control judges the worker by (absent
	// without a saturation detector).
	Saturation *admission.WorkerSaturation `json:"saturation,omitempty"`
}

func (s *Server) toJSON(w *worker.Worker) workerJSON {
	j := workerJSON{
		URL: w.URL, Key: w.Key(), ModelID: w.ModelID, WorkerType: w.Role.String(),
		IsHealthy: w.Healthy(), Routable: w.Routable(), Note: w.Note(),
		Load: w.Load(), PolledLoad: w.PolledLoad(), TotalRequests: w.TotalRequests(),
		Source: w.Source.String(), DPSize: w.DPSize, TPSize: w.TPSize,
		TransferMode: w.TransferMode, ZMQAddress: w.ZMQAddress, BootstrapPort: w.BootstrapPort,
		Format: w.Format, CircuitBreaker: w.Breaker().State().String(), ConnectionMode: "Http",
		LastSeen: w.LastSeen().UTC().Format(time.RFC3339Nano),
	}
	j.Saturation = s.limiter.Saturation(w)
	if j.ModelID == "" {
		j.ModelID = "unknown" // the Rust router's value for "not reported"
	}
	if w.DPRank >= 0 {
		rank := w.DPRank
		j.DPRank = &rank
	}
	return j
}

func (s *Server) toJSONs(ws []*worker.Worker) []workerJSON {
	out := make([]workerJSON, len(ws))
	for i, w := range ws {
		out[i] = s.toJSON(w)
	}
	return out
}

func keys(ws []*worker.Worker) []string {
	out := make([]string, len(ws))
	for i, w := range ws {
		out[i] = w.Key()
	}
	return out
}

// addWorker calls the lead's add hook. A worker_type (or other spec field)
// needs AddWorkerSpec.
func (s *Server) addWorker(ctx context.Context, req AddWorkerRequest, typed bool) ([]*worker.Worker, int, string, error) {
	switch {
	case s.o.AddWorkerSpec != nil:
		ws, err := s.o.AddWorkerSpec(ctx, req)
		return ws, addStatus(err), addCode(err), err
	case s.o.AddWorker != nil && typed:
		return nil, http.StatusBadRequest, codeAddFailed,
			errors.New("worker_type, model_id, bootstrap_port and dp_size are not supported by this router; send only url")
	case s.o.AddWorker != nil:
		ws, err := s.o.AddWorker(ctx, req.URL)
		return ws, addStatus(err), addCode(err), err
	}
	return nil, http.StatusNotImplemented, codeNotSupported, errors.New("adding workers is not supported by this router")
}

func addStatus(err error) int {
	switch {
	case err == nil:
		return http.StatusOK
	case worker.IsExists(err):
		return http.StatusConflict
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	}
	return http.StatusBadRequest
}

func addCode(err error) string {
	switch addStatus(err) {
	case http.StatusConflict:
		return codeExists
	case http.StatusGatewayTimeout:
		return codeTimeout
	}
	return codeAddFailed
}

// handleAddWorkerQuery is POST /add_worker?url=U[&worker_type=prefill].
func (s *Server) handleAddWorkerQuery(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	raw := q.Get("url")
	if raw == "" {
		s.writeError(w, r, http.StatusBadRequest, "bad_request", "Missing required query parameter: url")
		return
	}
	if _, _, err := worker.NormalizeURL(raw); err != nil {
		s.writeError(w, r, http.StatusBadRequest, "invalid_url", "Invalid worker URL "+raw+": "+err.Error())
		return
	}
	req := AddWorkerRequest{URL: raw}
	typed := false
	if t := q.Get("worker_type"); t != "" {
		role, err := worker.ParseRole(t)
		if err != nil {
			s.writeError(w, r, http.StatusBadRequest, "bad_request", err.Error())
			return
		}
		req.Role, typed = role, true
	}
	ws, status, _, err := s.addWorker(r.Context(), req, typed)
	if err != nil {
		msg := err.Error()
		if status == http.StatusConflict {
			msg = "Worker " + raw + " already exists"
		}
		s.writeError(w, r, status, "add_worker_failed", msg)
		return
	}
	if len(ws) == 0 {
		s.writeError(w, r, http.StatusConflict, "add_worker_failed", "No worker added for "+raw)
		return
	}
	s.log.Info("worker added", "url", raw, "workers", keys(ws))
	writeText(w, http.StatusOK, "Successfully added worker: "+raw)
}

// handleRemoveWorkerQuery is POST /remove_worker?url=U: 404 when no worker
// matched (the Rust router always said 200).
func (s *Server) handleRemoveWorkerQuery(w http.ResponseWriter, r *http.Request) {
	raw := r.URL.Query().Get("url")
	if raw == "" {
		s.writeError(w, r, http.StatusBadRequest, "bad_request", "Missing required query parameter: url")
		return
	}
	if _, _, err := worker.NormalizeURL(raw); err != nil {
		s.writeError(w, r, http.StatusBadRequest, "invalid_url", "Invalid worker URL "+raw+": "+err.Error())
		return
	}
	if s.o.RemoveWorker == nil {
		s.writeError(w, r, http.StatusNotImplemented, "not_supported", "removing workers is not supported by this router")
		return
	}
	removed := s.o.RemoveWorker(raw)
	if len(removed) == 0 {
		s.writeError(w, r, http.StatusNotFound, "worker_not_found", "Worker "+raw+" not found")
		return
	}
	s.log.Info("worker removed", "url", raw, "workers", keys(removed))
	writeText(w, http.StatusOK, "Successfully removed worker: "+raw)
}

// handleListWorkers is GET /list_workers: {"urls":[key...]} (DP ranks as
// URL@rank, as in the Rust router).
func (s *Server) handleListWorkers(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"urls": keys(s.reg.Snapshot().All)})
}

// createWorkerBody is the POST /workers JSON. Unknown fields (priority,
// cost) are accepted and ignored; labels (string values) are passed to
// AddWorkerSpec (--enable-igw reads labels.policy) and ignored otherwise.
type createWorkerBody struct {
	URL           string            `json:"url"`
	WorkerType    string            `json:"worker_type"`
	ModelID       string            `json:"model_id"`
	BootstrapPort *int              `json:"bootstrap_port"`
	DPSize        int               `json:"dp_size"`
	Labels        map[string]string `json:"labels"`
}

func (s *Server) handleCreateWorker(w http.ResponseWriter, r *http.Request) {
	b, ok := s.readBody(w, r)
	if !ok {
		return
	}
	var in createWorkerBody
	if err := json.Unmarshal(b, &in); err != nil {
		s.writeRESTError(w, r, http.StatusBadRequest, codeAddFailed, "Invalid JSON body: "+err.Error())
		return
	}
	if in.URL == "" {
		s.writeRESTError(w, r, http.StatusBadRequest, codeAddFailed, "Missing required field: url")
		return
	}
	if _, _, err := worker.NormalizeURL(in.URL); err != nil {
		s.writeRESTError(w, r, http.StatusBadRequest, codeInvalidURL, "Invalid worker URL "+in.URL+": "+err.Error())
		return
	}
	req := AddWorkerRequest{URL: in.URL, ModelID: in.ModelID, BootstrapPort: in.BootstrapPort, DPSize: in.DPSize, Labels: in.Labels}
	typed := in.ModelID != "" || in.BootstrapPort != nil || in.DPSize != 0
	if in.WorkerType != "" {
		role, err := worker.ParseRole(in.WorkerType)
		if err != nil {
			s.writeRESTError(w, r, http.StatusBadRequest, codeAddFailed, err.Error())
			return
		}
		req.Role = role
		typed = typed || role != worker.RoleRegular
	}
	if in.DPSize < 0 {
		s.writeRESTError(w, r, http.StatusBadRequest, codeAddFailed, "dp_size must be >= 1")
		return
	}
	ws, status, code, err := s.addWorker(r.Context(), req, typed)
	if err != nil {
		msg := err.Error()
		if status == http.StatusConflict {
			msg = "Worker " + in.URL + " already exists"
		}
		s.writeRESTError(w, r, status, code, msg)
		return
	}
	if len(ws) == 0 {
		s.writeRESTError(w, r, http.StatusConflict, codeExists, "No worker added for "+in.URL)
		return
	}
	s.log.Info("worker added", "url", in.URL, "workers", keys(ws))
	writeJSON(w, http.StatusOK, map[string]any{
		"success": true,
		"message": "Worker " + in.URL + " added successfully",
		"workers": s.toJSONs(ws),
	})
}

// handleWorkers is GET /workers with live per-worker fields.
func (s *Server) handleWorkers(w http.ResponseWriter, _ *http.Request) {
	snap := s.reg.Snapshot()
	healthy := 0
	for _, wk := range snap.All {
		if usable(wk) {
			healthy++
		}
	}
	body := map[string]any{
		"workers": s.toJSONs(snap.All),
		"total":   len(snap.All),
		"stats": map[string]any{
			"prefill_count": len(snap.Prefill),
			"decode_count":  len(snap.Decode),
			"regular_count": len(snap.Regular),
			"healthy_count": healthy,
			"prefill":       countRole(snap.Prefill),
			"decode":        countRole(snap.Decode),
			"regular":       countRole(snap.Regular),
		},
	}
	if s.o.DiscoveryStatus != nil {
		body["discovery"] = s.o.DiscoveryStatus()
	}
	if s.o.ModelsStatus != nil {
		body["models"] = s.o.ModelsStatus()
	}
	if s.o.PDStatus != nil {
		body["pd"] = s.o.PDStatus()
	}
	if s.lora.any() {
		body["lora_adapters"] = s.lora.status()
	}
	for name, f := range s.o.Sections {
		body[name] = f()
	}
	writeJSON(w, http.StatusOK, body)
}

// lookup finds the workers addressed by raw: an exact key (URL or URL@rank),
// else every rank of the normalised base URL.
func (s *Server) lookup(raw string) []*worker.Worker {
	if wk := s.reg.Get(raw); wk != nil {
		return []*worker.Worker{wk}
	}
	base, rank, err := worker.NormalizeURL(raw)
	if err != nil {
		return nil
	}
	if rank >= 0 {
		if wk := s.reg.Get(fmt.Sprintf("%s@%d", base, rank)); wk != nil {
			return []*worker.Worker{wk}
		}
		return nil
	}
	var out []*worker.Worker
	for _, wk := range s.reg.Snapshot().All {
		if wk.URL == base {
			out = append(out, wk)
		}
	}
	return out
}

// handleWorker is GET /workers/{url} ({url} percent-encoded). A DP instance
// addressed by its base URL answers with its first rank's fields plus
// "ranks" listing every rank.
func (s *Server) handleWorker(w http.ResponseWriter, r *http.Request) {
	raw := r.PathValue("url")
	ws := s.lookup(raw)
	if len(ws) == 0 {
		s.writeRESTError(w, r, http.StatusNotFound, codeNotFound, "Worker "+raw+" not found")
		return
	}
	if len(ws) == 1 {
		writeJSON(w, http.StatusOK, s.toJSON(ws[0]))
		return
	}
	writeJSON(w, http.StatusOK, struct {
		workerJSON
		Ranks []workerJSON `json:"ranks"`
	}{s.toJSON(ws[0]), s.toJSONs(ws)})
}

// handleDeleteWorker is DELETE /workers/{url}.
func (s *Server) handleDeleteWorker(w http.ResponseWriter, r *http.Request) {
	raw := r.PathValue("url")
	if _, _, err := worker.NormalizeURL(raw); err != nil {
		s.writeRESTError(w, r, http.StatusBadRequest, codeInvalidURL, "Invalid worker URL "+raw+": "+err.Error())
		return
	}
	if s.o.RemoveWorker == nil {
		s.writeRESTError(w, r, http.StatusNotImplemented, codeNotSupported, "removing workers is not supported by this router")
		return
	}
	removed := s.o.RemoveWorker(raw)
	if len(removed) == 0 {
		s.writeRESTError(w, r, http.StatusNotFound, codeNotFound, "Worker "+raw+" not found")
		return
	}
	s.log.Info("worker removed", "url", raw, "workers", keys(removed))
	writeJSON(w, http.StatusOK, map[string]any{
		"success": true,
		"message": "Worker " + raw + " removed successfully",
		"removed": keys(removed),
	})
}

// allInstances is every distinct instance URL, all roles, healthy or not.
func (s *Server) allInstances() []string {
	return instanceURLs(s.reg.Snapshot(), false, worker.RolePrefill, worker.RoleDecode, worker.RoleRegular)
}

// handleFlushCache POSTs FlushCachePath to every instance concurrently:
// 200 all flushed, 206 some, 500 none.
func (s *Server) handleFlushCache(w http.ResponseWriter, r *http.Request) {
	s.adminFanOut(w, r, s.o.FlushCachePath, "Cache flush")
}

// profileHandler serves /start_profile and /stop_profile: Options.Profile in
// PD mode, a fan-out to every instance in regular mode.
func (s *Server) profileHandler(which string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if s.o.Mode == ModePD {
			if s.o.Profile == nil {
				s.writeError(w, r, http.StatusNotFound, "not_found", "profiling is not enabled on this router")
				return
			}
			s.o.Profile(w, r, which+"_profile")
			return
		}
		s.adminFanOut(w, r, "/"+which+"_profile", strings.ToUpper(which[:1])+which[1:]+" profile")
	}
}

func (s *Server) adminFanOut(w http.ResponseWriter, r *http.Request, path, what string) {
	urls := s.allInstances()
	if len(urls) == 0 {
		writeJSON(w, http.StatusOK, map[string]any{"message": what + ": no workers", "results": []fanResult{}})
		return
	}
	res := s.fanOut(r.Context(), r, http.MethodPost, path, urls)
	var okRes, bad []fanResult
	for _, x := range res {
		if x.ok() {
			okRes = append(okRes, x)
		} else {
			bad = append(bad, x)
		}
	}
	switch {
	case len(bad) == 0:
		writeJSON(w, http.StatusOK, map[string]any{"message": what + " succeeded on all servers", "results": res})
	case len(okRes) > 0:
		if st := stateFrom(r.Context()); st != nil {
			st.errType = "partial_failure"
		}
		writeJSON(w, http.StatusPartialContent, map[string]any{
			"message": fmt.Sprintf("Partial success: %s succeeded on %d of %d servers", what, len(okRes), len(res)),
			"results": okRes,
			"errors":  bad,
		})
	default:
		parts := make([]string, len(bad))
		for i, b := range bad {
			parts[i] = b.Worker + ": " + b.Error
		}
		s.writeError(w, r, http.StatusInternalServerError, "fanout_failed",
			what+" failed on all servers: ["+strings.Join(parts, "; ")+"]")
	}
}
