package server

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Bounds on the router's own worker calls.
const (
	maxInfoBody    = 4 << 20 // a worker's JSON answer we parse
	fanOutParallel = 16      // concurrent worker calls per fan-out
	proxyFirstTry  = 3       // workers tried by a single-worker GET before giving up
)

// usable is the health view the info endpoints use: health-checked and not
// held aside. The breaker is left out on purpose: an open circuit is a
// transient routing decision, not a reason to hide a worker from probes.
func usable(w *worker.Worker) bool { return w.Healthy() && w.Routable() }

// instanceURLs returns the distinct base URLs of the workers of the given
// roles, in role order then registry order (DP ranks of one instance share
// an engine and are called once).
func instanceURLs(snap *worker.Snapshot, onlyUsable bool, roles ...worker.Role) []string {
	seen := map[string]bool{}
	var out []string
	for _, role := range roles {
		for _, w := range snap.ByRole(role) {
			if (onlyUsable && !usable(w)) || seen[w.URL] {
				continue
			}
			seen[w.URL] = true
			out = append(out, w.URL)
		}
	}
	return out
}

// infoRoles is the preference order for "ask one worker" endpoints: decode
// workers first in PD mode (they run the model the client talks to), then
// prefill; regular workers in regular mode.
func (s *Server) infoRoles() []worker.Role {
	if s.o.Mode == ModePD {
		return []worker.Role{worker.RoleDecode, worker.RolePrefill, worker.RoleRegular}
	}
	return []worker.Role{worker.RoleRegular, worker.RoleDecode, worker.RolePrefill}
}

// newUpstreamRequest builds a router-originated request to a worker. The
// upstream API key (or, when allowed, the client's Authorization) and the
// request id are forwarded.
func (s *Server) newUpstreamRequest(ctx context.Context, in *http.Request, method, url string, body io.Reader) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		return nil, err
	}
	switch {
	case s.o.APIKey != "":
		req.Header.Set("Authorization", "Bearer "+s.o.APIKey)
	case s.o.ForwardClientAuthorization && in != nil:
		if v := in.Header.Get("Authorization"); v != "" {
			req.Header.Set("Authorization", v)
		}
	}
	if in != nil {
		if id := RequestID(in.Context()); id != "" {
			req.Header.Set("X-Request-Id", id)
		}
	}
	req.Header.Set("Accept", "application/json")
	return req, nil
}

// getJSON GETs url+path and decodes a 200 JSON answer into v.
func (s *Server) getJSON(ctx context.Context, in *http.Request, url string, v any) (status int, err error) {
	req, err := s.newUpstreamRequest(ctx, in, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxInfoBody+1))
	if err != nil {
		return resp.StatusCode, err
	}
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, fmt.Errorf("status %d", resp.StatusCode)
	}
	if len(b) > maxInfoBody {
		return resp.StatusCode, fmt.Errorf("response larger than %d bytes", maxInfoBody)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return resp.StatusCode, fmt.Errorf("invalid JSON: %w", err)
	}
	return resp.StatusCode, nil
}

// fanResult is one worker's answer to a fan-out.
type fanResult struct {
	Worker string `json:"worker"`
	Status int    `json:"status,omitempty"`
	Error  string `json:"error,omitempty"`
}

func (f fanResult) ok() bool { return f.Error == "" && f.Status >= 200 && f.Status < 300 }

// fanOut sends method path to every URL concurrently (bounded) and returns
// the results in the order of urls.
func (s *Server) fanOut(ctx context.Context, in *http.Request, method, path string, urls []string) []fanResult {
	out := make([]fanResult, len(urls))
	eachWorker(urls, func(i int, u string) { out[i] = s.callOne(ctx, in, method, u, path) })
	return out
}

// eachWorker calls f for every URL, fanOutParallel at a time, and returns
// when every call has.
func eachWorker(urls []string, f func(i int, url string)) {
	sem := make(chan struct{}, fanOutParallel)
	var wg sync.WaitGroup
	for i, u := range urls {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			f(i, u)
		})
	}
	wg.Wait()
}

func (s *Server) callOne(ctx context.Context, in *http.Request, method, base, path string) fanResult {
	res := fanResult{Worker: base}
	ctx, cancel := context.WithTimeout(ctx, s.o.UpstreamTimeout)
	defer cancel()
	req, err := s.newUpstreamRequest(ctx, in, method, base+path, nil)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	resp, err := s.client.Do(req)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxInfoBody))
	_ = resp.Body.Close()
	res.Status = resp.StatusCode
	if !res.ok() {
		res.Error = "status " + strconv.Itoa(resp.StatusCode)
	}
	return res
}

// proxyFirst relays GET path from the first usable worker that answers
// (in infoRoles order), trying up to proxyFirstTry workers on a transport
// error or 5xx. Status, headers and body are passed through.
func (s *Server) proxyFirst(w http.ResponseWriter, r *http.Request, path string) {
	urls := instanceURLs(s.reg.Snapshot(), true, s.infoRoles()...)
	if len(urls) == 0 {
		s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", "No healthy workers available")
		return
	}
	urls = urls[:min(len(urls), proxyFirstTry)]
	var lastErr error
	for i, u := range urls {
		ctx, cancel := context.WithTimeout(r.Context(), s.o.UpstreamTimeout)
		req, err := s.newUpstreamRequest(ctx, r, http.MethodGet, u+path, nil)
		if err != nil {
			cancel()
			lastErr = err
			continue
		}
		if q := r.URL.RawQuery; q != "" {
			req.URL.RawQuery = q
		}
		resp, err := s.client.Do(req)
		if err != nil {
			cancel()
			lastErr = err
			continue
		}
		if resp.StatusCode >= 500 && i < len(urls)-1 {
			_ = resp.Body.Close()
			cancel()
			lastErr = fmt.Errorf("%s: status %d", u, resp.StatusCode)
			continue
		}
		copyResponse(w, resp)
		_ = resp.Body.Close()
		cancel()
		return
	}
	if r.Context().Err() != nil {
		stateFrom(r.Context()).logOnly = 499
		return
	}
	s.writeError(w, r, http.StatusBadGateway, "upstream_error", fmt.Sprintf("No worker answered %s: %v", path, lastErr))
}

// copyResponse relays an upstream response (headers minus hop-by-hop).
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	proxy.CopyResponseHeaders(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	_, _ = io.Copy(w, resp.Body)
}

// writeJSON writes v as a JSON response.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		openai.WriteError(w, http.StatusInternalServerError, "encode response: "+err.Error())
		return
	}
	b = append(b, '\n')
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// writeText writes a plain-text response (the Rust router's success bodies).
func writeText(w http.ResponseWriter, status int, msg string) {
	h := w.Header()
	h.Set("Content-Type", "text/plain; charset=utf-8")
	h.Set("Content-Length", strconv.Itoa(len(msg)))
	w.WriteHeader(status)
	_, _ = io.WriteString(w, msg)
}
