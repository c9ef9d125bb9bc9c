package server

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/history"
	"github.com/switchyard-llm/switchyard/internal/proxy"
)

// responsesRoute is the Responses API creation route.
const responsesRoute = "/v1/responses"

// A stored Responses API object lives on the one worker that generated it,
// so GET /v1/responses/{id} and POST /v1/responses/{id}/cancel ask every
// worker (regular, and in PD mode decode and prefill alike) concurrently;
// the first 2xx answer is relayed as it arrives (a resumed stream, GET with
// ?stream=true, is relayed chunk by chunk) and the other calls are
// cancelled. Without a 2xx the answer is the most telling one:
//
//   - a 4xx other than 404 (e.g. "cannot cancel a completed response") from
//     the worker that has the response;
//   - 404 when every worker answered 404;
//   - 502 naming the failed workers when some could not answer: the
//     response may live on one of them, so a 404 would be a lie.
//
// With a history store (--history-backend memory) the router learns the id
// of every response it relays from /v1/responses and which worker produced
// it; GET and cancel of a known id go to that worker alone and its answer,
// whatever it is, is relayed (502 if it cannot answer). An unknown id, or
// one whose worker has left the fleet, is fanned out as above.
//
// DELETE /v1/responses/{id} and GET /v1/responses/{id}/input are answered
// 501: vLLM serves neither.

// fanAnswer is one worker's answer to a fan-out call.
type fanAnswer struct {
	i      int
	url    string
	resp   *http.Response
	err    error
	body   []byte // a non-2xx body, read (bounded) and closed
	status int
}

func (s *Server) handleResponseFanOut(w http.ResponseWriter, r *http.Request) {
	urls := instanceURLs(s.reg.Snapshot(), false, s.infoRoles()...)
	if len(urls) == 0 {
		s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", "No available workers")
		return
	}
	path := r.URL.EscapedPath()
	if q := r.URL.RawQuery; q != "" {
		path += "?" + q
	}
	if h := s.o.History; h != nil {
		op := history.OpRetrieve
		if r.Method == http.MethodPost {
			op = history.OpCancel
		}
		owner, ok := h.Peek(r.PathValue("id"))
		ok = ok && slices.Contains(urls, owner)
		h.Count(op, ok)
		if ok {
			s.serveFromOwner(w, r, owner, path)
			return
		}
	}
	answers := make(chan fanAnswer, len(urls))
	cancels := make([]context.CancelFunc, len(urls))
	sem := make(chan struct{}, fanOutParallel)
	for i, u := range urls {
		ctx, cancel := context.WithCancel(r.Context())
		cancels[i] = cancel
		go func() {
			a := fanAnswer{i: i, url: u}
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				a.err = ctx.Err()
				answers <- a
				return
			}
			a.resp, a.err = s.callResponse(ctx, cancel, r, u+path)
			<-sem
			if a.err == nil && (a.resp.StatusCode < 200 || a.resp.StatusCode >= 300) {
				a.status = a.resp.StatusCode
				a.body, _ = io.ReadAll(io.LimitReader(a.resp.Body, maxInfoBody))
				_ = a.resp.Body.Close()
			}
			answers <- a
		}()
	}
	// Every call is cancelled and every answer collected (and its body
	// closed) before the handler returns: no call outlives the request.
	got := make([]fanAnswer, 0, len(urls))
	defer func() {
		for _, c := range cancels {
			c()
		}
		for len(got) < len(urls) {
			a := <-answers
			got = append(got, a)
			if a.err == nil && a.status == 0 {
				_ = a.resp.Body.Close()
			}
		}
	}()
	for len(got) < len(urls) {
		a := <-answers
		got = append(got, a)
		if a.err != nil || a.status != 0 {
			continue
		}
		for j, c := range cancels {
			if j != a.i {
				c()
			}
		}
		s.log.Debug("responses fan-out: answered", "path", r.URL.Path, "worker", a.url, "status", a.resp.StatusCode)
		proxy.CopyResponseHeaders(w.Header(), a.resp.Header)
		w.WriteHeader(a.resp.StatusCode)
		proxy.Relay(r.Context(), w, a.resp.Body, proxy.RelayOptions{})
		_ = a.resp.Body.Close()
		return
	}
	if r.Context().Err() != nil {
		stateFrom(r.Context()).logOnly = 499
		return
	}
	s.writeFanOutMiss(w, r, got, len(urls))
}

// serveFromOwner relays the answer of the one worker that stored the
// response.
func (s *Server) serveFromOwner(w http.ResponseWriter, r *http.Request, owner, path string) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	resp, err := s.callResponse(ctx, cancel, r, owner+path)
	if err != nil {
		if r.Context().Err() != nil {
			stateFrom(r.Context()).logOnly = 499
			return
		}
		s.writeError(w, r, http.StatusBadGateway, "upstream_error", fmt.Sprintf(
			"%s %s: worker %s, which stored this response, could not answer: %v", r.Method, r.URL.Path, owner, err))
		return
	}
	defer resp.Body.Close()
	s.log.Debug("responses: answered by the owner", "path", r.URL.Path, "worker", owner, "status", resp.StatusCode)
	proxy.CopyResponseHeaders(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	proxy.Relay(ctx, w, resp.Body, proxy.RelayOptions{})
}

// learnResponseID wraps the writer of a /v1/responses relay so the id of
// the answer is remembered with the worker that produced it: the decode
// worker of a PD split, else the prefill worker (PD unsplit) or the
// regular worker.
func (s *Server) learnResponseID(w http.ResponseWriter, c *proxy.Call) http.ResponseWriter {
	return history.NewLearner(w, func(id string) {
		rc := c.Receipt
		key := cmp.Or(rc.Decode, rc.Prefill, rc.Worker)
		if key == "" {
			return
		}
		url := key
		if wk := s.reg.Get(key); wk != nil {
			url = wk.URL
		}
		s.o.History.Put(id, url)
	})
}

// callResponse sends the client's method to url. The worker has
// UpstreamTimeout to answer with headers; a relayed body may take as long
// as the client keeps the request.
func (s *Server) callResponse(ctx context.Context, cancel context.CancelFunc, in *http.Request, url string) (*http.Response, error) {
	req, err := s.newUpstreamRequest(ctx, in, in.Method, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Del("Accept") // a resumed stream is text/event-stream
	if v := in.Header.Get("Accept"); v != "" {
		req.Header.Set("Accept", v)
	}
	t := time.AfterFunc(s.o.UpstreamTimeout, cancel)
	resp, err := s.client.Do(req)
	if !t.Stop() {
		if err == nil { // headers just in time, but the context is gone
			_ = resp.Body.Close()
			resp = nil
		}
		return nil, fmt.Errorf("no answer within %s", s.o.UpstreamTimeout)
	}
	return resp, err
}

// writeFanOutMiss answers when no worker had a 2xx for the response.
func (s *Server) writeFanOutMiss(w http.ResponseWriter, r *http.Request, got []fanAnswer, n int) {
	var first4xx, first404 *fanAnswer
	var failed []string
	for i := range got {
		a := &got[i]
		switch {
		case a.err != nil:
			failed = append(failed, a.url+": "+a.err.Error())
		case a.status == http.StatusNotFound:
			if first404 == nil || a.i < first404.i {
				first404 = a
			}
		case a.status >= 400 && a.status < 500:
			if first4xx == nil || a.i < first4xx.i {
				first4xx = a
			}
		default:
			failed = append(failed, fmt.Sprintf("%s: status %d", a.url, a.status))
		}
	}
	relay := func(a *fanAnswer) {
		h := w.Header()
		if ct := a.resp.Header.Get("Content-Type"); ct != "" {
			h.Set("Content-Type", ct)
		}
		w.WriteHeader(a.status)
		_, _ = w.Write(a.body)
	}
	switch {
	case first4xx != nil:
		relay(first4xx)
	case len(failed) == 0 && first404 != nil:
		relay(first404)
	default:
		s.writeError(w, r, http.StatusBadGateway, "upstream_error", fmt.Sprintf(
			"%s %s: %d of %d workers could not answer, the response may live on one of them (the others answered 404): [%s]",
			r.Method, r.URL.Path, len(failed), n, strings.Join(failed, "; ")))
	}
}

// handleResponsesNotImplemented answers the Responses API routes vLLM does
// not serve.
func (s *Server) handleResponsesNotImplemented(what string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, http.StatusNotImplemented, "not_implemented",
			"Responses "+what+" endpoint not implemented: vLLM workers do not serve it")
	}
}
