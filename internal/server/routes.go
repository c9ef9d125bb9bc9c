package server

import (
	"net/http"
	"slices"
	"strings"
)

// access says which auth rule a route falls under.
type access uint8

const (
	accessNormal access = iota // inbound API keys when configured
	accessProbe                // no auth: k8s probes carry no token
	accessAdmin                // AdminAPIKey when set, else accessNormal
)

// kind is a coarse route class used by the access log and metrics.
type kind uint8

const (
	kindOther kind = iota
	kindGenerate
	kindProbe
)

type route struct {
	method string
	path   string
	access access
	kind   kind
	h      http.HandlerFunc
}

// routeInfo is what the middleware knows about the matched route before the
// handler runs.
type routeInfo struct {
	label  string // metrics label: pattern path, or "other" for the catch-all
	access access
	kind   kind
}

const catchAllLabel = "other"

// spanRoute is the http.route of the server span: the pattern path, or ""
// for the catch-all (the span is then named by the method alone, keeping
// raw paths out of span names).
func (ri routeInfo) spanRoute() string {
	if ri.label == catchAllLabel {
		return ""
	}
	return ri.label
}

// generationPaths are the admission-controlled generation routes.
var generationPaths = []string{
	"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses",
	"/generate", "/inference/v1/generate", "/v1/rerank", "/rerank",
}

func (s *Server) routes() {
	var rs []route
	for _, p := range generationPaths {
		rs = append(rs, route{"POST", p, accessNormal, kindGenerate, s.handleGenerate})
	}
	rs = append(rs,
		route{"GET", "/v1/responses/{id}", accessNormal, kindOther, s.handleResponseFanOut},
		route{"POST", "/v1/responses/{id}/cancel", accessNormal, kindOther, s.handleResponseFanOut},
		route{"DELETE", "/v1/responses/{id}", accessNormal, kindOther, s.handleResponsesNotImplemented("delete")},
		route{"GET", "/v1/responses/{id}/input", accessNormal, kindOther, s.handleResponsesNotImplemented("list input items")},

		route{"POST", "/tokenize", accessNormal, kindOther, s.handlePassthrough},
		route{"POST", "/detokenize", accessNormal, kindOther, s.handlePassthrough},

		route{"GET", "/liveness", accessProbe, kindProbe, s.handleLiveness},
		route{"GET", "/readiness", accessProbe, kindProbe, s.handleReadiness},
		route{"GET", "/health", accessProbe, kindProbe, s.handleHealth},
		route{"GET", "/health_generate", accessNormal, kindOther, s.handleHealthGenerate},

		route{"GET", "/v1/models", accessNormal, kindOther, s.handleModels},
		route{"GET", "/get_model_info", accessNormal, kindOther, s.handleModelInfo},
		route{"GET", "/get_server_info", accessNormal, kindOther, s.handleServerInfo},
		route{"GET", "/get_loads", accessNormal, kindOther, s.handleLoads},

		route{"POST", "/flush_cache", accessAdmin, kindOther, s.handleFlushCache},
		route{"POST", loraLoadPath, accessAdmin, kindOther, s.handleLoRA(loraLoadPath)},
		route{"POST", loraUnloadPath, accessAdmin, kindOther, s.handleLoRA(loraUnloadPath)},
		route{"POST", "/start_profile", accessAdmin, kindOther, s.profileHandler("start")},
		route{"POST", "/stop_profile", accessAdmin, kindOther, s.profileHandler("stop")},

		route{"POST", "/add_worker", accessAdmin, kindOther, s.handleAddWorkerQuery},
		route{"POST", "/remove_worker", accessAdmin, kindOther, s.handleRemoveWorkerQuery},
		route{"GET", "/list_workers", accessNormal, kindOther, s.handleListWorkers},
		route{"POST", "/workers", accessAdmin, kindOther, s.handleCreateWorker},
		route{"GET", "/workers", accessNormal, kindOther, s.handleWorkers},
		route{"GET", "/workers/{url}", accessNormal, kindOther, s.handleWorker},
		route{"DELETE", "/workers/{url}", accessAdmin, kindOther, s.handleDeleteWorker},
	)

	s.mux = http.NewServeMux()
	s.allowed = map[string][]string{}
	s.info = map[string]routeInfo{}
	for _, r := range rs {
		pattern := r.method + " " + r.path
		s.mux.HandleFunc(pattern, r.h)
		s.info[pattern] = routeInfo{label: r.path, access: r.access, kind: r.kind}
		s.allowed[r.path] = append(s.allowed[r.path], r.method)
	}
	for p, ms := range s.allowed {
		if slices.Contains(ms, "GET") {
			ms = append(ms, "HEAD")
		}
		slices.Sort(ms)
		s.allowed[p] = ms
	}
	s.mux.HandleFunc("/", s.handleCatchAll)
	s.info["/"] = routeInfo{label: catchAllLabel, access: accessNormal, kind: kindOther}
}

// classify returns the route a request will reach.
func (s *Server) classify(r *http.Request) routeInfo {
	_, pattern := s.mux.Handler(r)
	if ri, ok := s.info[pattern]; ok {
		return ri
	}
	// Redirects to a cleaned path and the like.
	return routeInfo{label: catchAllLabel, access: accessNormal, kind: kindOther}
}

// allowedMethods returns the methods registered for path (nil when the path
// is not one of ours).
func (s *Server) allowedMethods(path string) []string {
	if ms, ok := s.allowed[path]; ok {
		return ms
	}
	if rest, ok := strings.CutPrefix(path, "/workers/"); ok && rest != "" && !strings.Contains(rest, "/") {
		return s.allowed["/workers/{url}"]
	}
	return nil
}

// handleCatchAll serves every request no route matched: a known path with
// the wrong method gets 405 with Allow; otherwise the request is proxied
// (regular mode), or in PD mode GET/HEAD get 404 and other methods go to
// Passthrough.
func (s *Server) handleCatchAll(w http.ResponseWriter, r *http.Request) {
	if ms := s.allowedMethods(r.URL.Path); ms != nil {
		w.Header().Set("Allow", strings.Join(ms, ", "))
		s.writeError(w, r, http.StatusMethodNotAllowed, "method_not_allowed",
			"Method "+r.Method+" is not allowed on "+r.URL.Path+"; allowed: "+strings.Join(ms, ", "))
		return
	}
	if s.o.Passthrough == nil || (s.o.Mode == ModePD && (r.Method == http.MethodGet || r.Method == http.MethodHead)) {
		s.writeError(w, r, http.StatusNotFound, "not_found", "Not found: "+r.Method+" "+r.URL.Path)
		return
	}
	if !s.bufferUnsizedBody(w, r) {
		return
	}
	s.o.Passthrough.ServeHTTP(w, r)
}

// handlePassthrough serves /tokenize and /detokenize.
func (s *Server) handlePassthrough(w http.ResponseWriter, r *http.Request) {
	if s.o.Passthrough == nil {
		s.writeError(w, r, http.StatusNotFound, "not_found", r.URL.Path+" is not available on this router")
		return
	}
	if !s.bufferUnsizedBody(w, r) {
		return
	}
	s.o.Passthrough.ServeHTTP(w, r)
}
