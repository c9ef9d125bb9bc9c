package server

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// roleCount is the healthy/total count of one role.
type roleCount struct {
	Healthy int `json:"healthy"`
	Total   int `json:"total"`
}

func countRole(ws []*worker.Worker) roleCount {
	c := roleCount{Total: len(ws)}
	for _, w := range ws {
		if usable(w) {
			c.Healthy++
		}
	}
	return c
}

// ready applies Options.Ready or the default rule: ≥1 usable regular worker
// (regular mode), or ≥1 usable prefill and ≥1 usable decode worker (PD).
func (s *Server) ready(snap *worker.Snapshot) (bool, string) {
	if s.o.Ready != nil {
		return s.o.Ready()
	}
	if s.o.Mode == ModePD {
		var why []string
		if countRole(snap.Prefill).Healthy == 0 {
			why = append(why, "no healthy prefill workers")
		}
		if countRole(snap.Decode).Healthy == 0 {
			why = append(why, "no healthy decode workers")
		}
		return len(why) == 0, strings.Join(why, ", ")
	}
	if countRole(snap.Regular).Healthy == 0 {
		return false, "no healthy workers available"
	}
	return true, ""
}

func (s *Server) handleLiveness(w http.ResponseWriter, _ *http.Request) {
	writeText(w, http.StatusOK, "OK")
}

// handleReadiness keeps the Rust shapes with real counts per role.
func (s *Server) handleReadiness(w http.ResponseWriter, _ *http.Request) {
	snap := s.reg.Snapshot()
	ok, reason := s.ready(snap)
	if s.draining.Load() {
		ok, reason = false, "shutting down"
	}
	body := map[string]any{}
	if s.o.Mode == ModePD {
		body["prefill"] = countRole(snap.Prefill)
		body["decode"] = countRole(snap.Decode)
	} else {
		c := countRole(snap.Regular)
		body["healthy_workers"] = c.Healthy
		body["total_workers"] = c.Total
	}
	if ok {
		body["status"] = "ready"
		writeJSON(w, http.StatusOK, body)
		return
	}
	body["status"] = "not_ready"
	body["reason"] = reason
	writeJSON(w, http.StatusServiceUnavailable, body)
}

// handleHealth is 200 while the router can serve (≥1 healthy worker, or PD
// ready), naming unhealthy workers in the text; 503 otherwise.
func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	snap := s.reg.Snapshot()
	var bad []string
	for _, wk := range snap.All {
		if !usable(wk) {
			name := wk.Key()
			if s.o.Mode == ModePD {
				name = roleTitle(wk.Role) + ": " + name
			}
			bad = append(bad, name)
		}
	}
	ok, reason := s.ready(snap)
	if !ok {
		msg := "Unhealthy: " + reason
		if len(bad) > 0 {
			msg += "; unhealthy servers: [" + strings.Join(bad, ", ") + "]"
		}
		s.writeError(w, r, http.StatusServiceUnavailable, "unhealthy", msg)
		return
	}
	if len(bad) == 0 {
		writeText(w, http.StatusOK, "All servers healthy")
		return
	}
	writeText(w, http.StatusOK, fmt.Sprintf("Degraded: %d of %d servers unhealthy: [%s]",
		len(bad), len(snap.All), strings.Join(bad, ", ")))
}

func roleTitle(r worker.Role) string {
	switch r {
	case worker.RolePrefill:
		return "Prefill"
	case worker.RoleDecode:
		return "Decode"
	}
	return "Regular"
}

// firstAvailable returns the first worker of role a policy could pick now.
func firstAvailable(ws []*worker.Worker) *worker.Worker {
	for _, w := range ws {
		if w.Available() {
			return w
		}
	}
	return nil
}

// handleHealthGenerate checks a pair (PD) or a worker (regular) the router
// would route to with GET /health. It never runs a generation: a stray
// request on a decode worker would block waiting for KV that never comes.
func (s *Server) handleHealthGenerate(w http.ResponseWriter, r *http.Request) {
	snap := s.reg.Snapshot()
	if s.o.Mode == ModePD {
		p, d := firstAvailable(snap.Prefill), firstAvailable(snap.Decode)
		if p == nil || d == nil {
			var why []string
			if p == nil {
				why = append(why, "no available prefill worker")
			}
			if d == nil {
				why = append(why, "no available decode worker")
			}
			s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers",
				"No healthy worker pair available: "+strings.Join(why, ", "))
			return
		}
		res := s.fanOut(r.Context(), r, http.MethodGet, "/health", []string{p.URL, d.URL})
		var errs []string
		for i, x := range res {
			if !x.ok() {
				errs = append(errs, []string{"prefill ", "decode "}[i]+x.Worker+": "+x.Error)
			}
		}
		if len(errs) > 0 {
			s.writeError(w, r, http.StatusServiceUnavailable, "health_generate_failed",
				"Health generate failed: ["+strings.Join(errs, "; ")+"]")
			return
		}
		writeText(w, http.StatusOK, fmt.Sprintf("Health generate passed on selected pair: prefill=%s, decode=%s", p.Key(), d.Key()))
		return
	}
	wk := firstAvailable(snap.Regular)
	if wk == nil {
		s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", "No healthy workers available")
		return
	}
	res := s.callOne(r.Context(), r, http.MethodGet, wk.URL, "/health")
	if !res.ok() {
		s.writeError(w, r, http.StatusServiceUnavailable, "health_generate_failed",
			"Health generate failed: ["+res.Worker+": "+res.Error+"]")
		return
	}
	writeText(w, http.StatusOK, "Health generate passed on worker: "+wk.Key())
}

// modelList is the OpenAI /v1/models shape; entries are kept verbatim.
type modelList struct {
	Object string            `json:"object"`
	Data   []json.RawMessage `json:"data"`
}

// handleModels returns the union (deduplicated by id, first seen wins) of
// the /v1/models answers of every healthy instance, asked concurrently.
// Decode workers come first in PD mode. If no worker answers 200 but one
// answered with an HTTP error (e.g. 401), that answer's status is returned.
// Options.ExtraModels (the upstream models of --enable-igw) come last, and
// are the answer when no worker is registered or none answers.
func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	var extra []json.RawMessage
	if s.o.ExtraModels != nil {
		extra = s.o.ExtraModels()
	}
	only := modelList{Object: "list", Data: append([]json.RawMessage{}, extra...)}
	snap := s.reg.Snapshot()
	var urls []string
	noWorkers := "No workers available"
	if len(snap.All) > 0 {
		urls = instanceURLs(snap, true, s.infoRoles()...)
		noWorkers = "No healthy workers available"
	}
	if len(urls) == 0 {
		if len(extra) > 0 {
			writeJSON(w, http.StatusOK, only)
			return
		}
		s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", noWorkers)
		return
	}
	m := mergeModels(urls, s.fetchModelLists(r, urls), extra)
	if m.answered > 0 {
		if len(m.errs) > 0 {
			s.log.Warn("/v1/models: some workers did not answer", "request_id", RequestID(r.Context()), "errors", m.errs)
		}
		writeJSON(w, http.StatusOK, m.list)
		return
	}
	switch {
	case r.Context().Err() != nil:
		stateFrom(r.Context()).logOnly = 499
	case len(extra) > 0:
		s.log.Warn("/v1/models: no worker answered; listing the upstream models only", "request_id", RequestID(r.Context()), "errors", m.errs)
		writeJSON(w, http.StatusOK, only)
	default:
		status := http.StatusBadGateway
		if m.failStatus >= 400 && m.failStatus < 500 {
			status = m.failStatus
		}
		s.writeError(w, r, status, "upstream_error", "No worker answered /v1/models: "+strings.Join(m.errs, "; "))
	}
}

// modelAnswer is one worker's answer to GET /v1/models.
type modelAnswer struct {
	list   modelList
	status int
	err    error
}

// fetchModelLists asks every url for its /v1/models, fanOutParallel at a
// time, within UpstreamTimeout; answers are in urls' order.
func (s *Server) fetchModelLists(r *http.Request, urls []string) []modelAnswer {
	answers := make([]modelAnswer, len(urls))
	ctx, cancel := context.WithTimeout(r.Context(), s.o.UpstreamTimeout)
	defer cancel()
	sem := make(chan struct{}, fanOutParallel)
	var wg sync.WaitGroup
	for i, u := range urls {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			a := &answers[i]
			a.status, a.err = s.getJSON(ctx, r, u+"/v1/models", &a.list)
		})
	}
	wg.Wait()
	return answers
}

// mergedModels is the union of the workers' lists and how they answered.
type mergedModels struct {
	list       modelList
	answered   int      // workers that answered 200
	failStatus int      // the first HTTP error status a worker answered
	errs       []string // "url: error" per worker that did not answer
}

// mergeModels unions the answers (deduplicated by id, first seen wins)
// and appends extra. The extras come last, but their ids win: a worker
// listing an upstream model's id does not serve it.
func mergeModels(urls []string, answers []modelAnswer, extra []json.RawMessage) mergedModels {
	m := mergedModels{list: modelList{Object: "list", Data: []json.RawMessage{}}}
	seen := map[string]bool{}
	for _, e := range extra {
		seen[modelID(e)] = true
	}
	for i, a := range answers {
		if a.err != nil {
			m.errs = append(m.errs, urls[i]+": "+a.err.Error())
			if a.status >= 400 && m.failStatus == 0 {
				m.failStatus = a.status
			}
			continue
		}
		m.answered++
		for _, e := range a.list.Data {
			id := modelID(e)
			if id == "" || seen[id] {
				continue
			}
			seen[id] = true
			m.list.Data = append(m.list.Data, e)
		}
	}
	m.list.Data = append(m.list.Data, extra...)
	return m
}

// modelID is a /v1/models entry's id ("" when it has none).
func modelID(m json.RawMessage) string {
	var id struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(m, &id) != nil {
		return ""
	}
	return id.ID
}

// handleModelInfo relays /get_model_info from the first healthy worker.
func (s *Server) handleModelInfo(w http.ResponseWriter, r *http.Request) {
	s.proxyFirst(w, r, "/get_model_info")
}

// handleServerInfo describes the router itself and, when the first healthy
// worker answers /get_server_info with JSON, includes that as worker_info.
func (s *Server) handleServerInfo(w http.ResponseWriter, r *http.Request) {
	snap := s.reg.Snapshot()
	workers := map[string]any{
		"total":   len(snap.All),
		"regular": countRole(snap.Regular),
		"prefill": countRole(snap.Prefill),
		"decode":  countRole(snap.Decode),
	}
	body := map[string]any{
		"router":         "switchyard",
		"version":        s.o.Version,
		"mode":           s.o.Mode,
		"policies":       s.o.Policies,
		"uptime_seconds": int64(time.Since(s.started).Seconds()),
		"workers":        workers,
		"admission": map[string]any{
			"max_concurrent": s.limiter.MaxConcurrent(),
			"in_use":         s.limiter.InUse(),
			"queued":         s.limiter.Queued(),
			"queue_size":     s.o.QueueSize,
			"queue_timeout":  s.o.QueueTimeout.Seconds(),
			"rate_limit":     s.o.RateLimitPerSecond,
		},
		"max_payload_size": s.o.MaxPayloadSize,
	}
	if s.o.DiscoveryStatus != nil {
		body["discovery"] = s.o.DiscoveryStatus()
	}
	if s.o.PDStatus != nil {
		body["pd"] = s.o.PDStatus()
	}
	for name, f := range s.o.Sections {
		body[name] = f()
	}
	if urls := instanceURLs(snap, true, s.infoRoles()...); len(urls) > 0 {
		ctx, cancel := context.WithTimeout(r.Context(), s.o.UpstreamTimeout)
		var info map[string]any
		if _, err := s.getJSON(ctx, r, urls[0]+"/get_server_info", &info); err == nil {
			body["worker_info"] = info
			body["worker_info_source"] = urls[0]
		}
		cancel()
	}
	writeJSON(w, http.StatusOK, body)
}

// loadEntry is one worker in /get_loads.
type loadEntry struct {
	Worker     string `json:"worker"`
	Role       string `json:"role"`
	Load       int64  `json:"load"`        // router in-flight (released at body end)
	PolledLoad int64  `json:"polled_load"` // as last reported by the worker, -1 unknown
	Healthy    bool   `json:"is_healthy"`
}

// handleLoads reports every worker's router in-flight count and its last
// polled load, keyed by worker key (URL@rank for DP ranks, never a mangled
// URL). PD mode also gives the Rust "loads" map {"prefill_<key>": n, ...}.
func (s *Server) handleLoads(w http.ResponseWriter, _ *http.Request) {
	snap := s.reg.Snapshot()
	entries := make([]loadEntry, 0, len(snap.All))
	for _, role := range s.infoRoles() {
		for _, wk := range snap.ByRole(role) {
			entries = append(entries, loadEntry{
				Worker: wk.Key(), Role: wk.Role.String(), Load: wk.Load(),
				PolledLoad: wk.PolledLoad(), Healthy: usable(wk),
			})
		}
	}
	body := map[string]any{"workers": entries}
	if s.o.Mode == ModePD {
		loads := map[string]int64{}
		polled := map[string]int64{}
		for _, e := range entries {
			if e.Role == "regular" {
				continue
			}
			loads[e.Role+"_"+e.Worker] = e.Load
			polled[e.Role+"_"+e.Worker] = e.PolledLoad
		}
		body["loads"] = loads
		body["polled_loads"] = polled
	}
	writeJSON(w, http.StatusOK, body)
}
