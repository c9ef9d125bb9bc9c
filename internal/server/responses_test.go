package server

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// respWorker is a worker answering the Responses API retrieval routes with
// a fixed handler, recording what it was asked.
type respWorker struct {
	*httptest.Server
	mu        sync.Mutex
	seen      []string // method + request URI
	running   int      // handlers not yet returned
	cancelled int      // handlers that saw their request's context end
	conns     map[net.Conn]http.ConnState
}

func newRespWorker(t *testing.T, h func(w http.ResponseWriter, r *http.Request)) *respWorker {
	t.Helper()
	rw := &respWorker{conns: map[net.Conn]http.ConnState{}}
	rw.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rw.mu.Lock()
		rw.seen = append(rw.seen, r.Method+" "+r.RequestURI)
		rw.running++
		rw.mu.Unlock()
		h(w, r)
		rw.mu.Lock()
		rw.running--
		if r.Context().Err() != nil {
			rw.cancelled++
		}
		rw.mu.Unlock()
	}))
	rw.Config.ConnState = func(c net.Conn, s http.ConnState) {
		rw.mu.Lock()
		defer rw.mu.Unlock()
		if s == http.StateClosed || s == http.StateHijacked {
			delete(rw.conns, c)
			return
		}
		rw.conns[c] = s
	}
	rw.Start()
	t.Cleanup(rw.Close)
	return rw
}

// released reports whether every call the worker received has ended with
// its request cancelled and no connection to it is still serving a
// request: the router's call is cancelled or never arrived.
func (rw *respWorker) released() (ok bool, why string) {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	active := 0
	for _, s := range rw.conns {
		if s == http.StateActive {
			active++
		}
	}
	switch {
	case rw.running > 0:
		return false, fmt.Sprintf("%d call(s) still running", rw.running)
	case rw.cancelled != len(rw.seen):
		return false, fmt.Sprintf("%d call(s) of %d ended without cancellation", len(rw.seen)-rw.cancelled, len(rw.seen))
	case active > 0:
		return false, fmt.Sprintf("%d connection(s) still active", active)
	}
	return true, ""
}

func (rw *respWorker) requests() []string {
	rw.mu.Lock()
	defer rw.mu.Unlock()
	return append([]string(nil), rw.seen...)
}

func notFound(w http.ResponseWriter, r *http.Request) {
	openai.WriteError(w, http.StatusNotFound, "Response with id 'x' not found.")
}

const storedResp = `{"id":"resp_1","object":"response","status":"completed"}`

func found(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-From", "owner")
	_, _ = w.Write([]byte(storedResp))
}

func TestResponsesFanOut(t *testing.T) {
	hang := func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()

	slow := newRespWorker(t, hang)
	cases := []struct {
		name     string
		method   string
		path     string
		handlers []func(http.ResponseWriter, *http.Request)
		extra    []string // more worker URLs (e.g. unreachable)
		status   int
		check    func(t *testing.T, r resp, ws []*respWorker)
	}{
		{"owner answers, the rest are cancelled", "GET", "/v1/responses/resp_1",
			[]func(http.ResponseWriter, *http.Request){notFound, found}, []string{slow.URL}, 200,
			func(t *testing.T, r resp, ws []*respWorker) {
				if string(r.body) != storedResp || r.header.Get("X-From") != "owner" {
					t.Fatalf("body %s header %v", r.body, r.header)
				}
				// The call to the hanging worker is cancelled, or was never
				// sent (the owner answered first): either way nothing of it
				// stays open. Checked with a deadline, not at one instant.
				deadline := time.Now().Add(10 * time.Second)
				for {
					ok, why := slow.released()
					if ok {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("the hanging worker's call was not released: %s", why)
					}
					time.Sleep(10 * time.Millisecond)
				}
			}},
		{"query string forwarded", "GET", "/v1/responses/resp_1?stream=true&starting_after=3",
			[]func(http.ResponseWriter, *http.Request){found}, nil, 200,
			func(t *testing.T, r resp, ws []*respWorker) {
				if got := ws[0].requests(); len(got) != 1 || got[0] != "GET /v1/responses/resp_1?stream=true&starting_after=3" {
					t.Fatalf("worker saw %v", got)
				}
			}},
		{"all 404", "GET", "/v1/responses/nope",
			[]func(http.ResponseWriter, *http.Request){notFound, notFound}, nil, 404,
			func(t *testing.T, r resp, ws []*respWorker) {
				if msg := r.errMsg(t); !strings.Contains(msg, "not found") {
					t.Fatalf("msg %q", msg)
				}
			}},
		{"cancel refused by the owner", "POST", "/v1/responses/resp_1/cancel",
			[]func(http.ResponseWriter, *http.Request){notFound, func(w http.ResponseWriter, r *http.Request) {
				openai.WriteError(w, http.StatusBadRequest, "Cannot cancel a synchronous response.")
			}}, nil, 400,
			func(t *testing.T, r resp, ws []*respWorker) {
				if msg := r.errMsg(t); msg != "Cannot cancel a synchronous response." {
					t.Fatalf("msg %q", msg)
				}
				for _, w := range ws {
					if got := w.requests(); len(got) != 1 || got[0] != "POST /v1/responses/resp_1/cancel" {
						t.Fatalf("worker saw %v", got)
					}
				}
			}},
		{"cancel succeeds", "POST", "/v1/responses/resp_1/cancel",
			[]func(http.ResponseWriter, *http.Request){notFound, found}, nil, 200, nil},
		{"404s and an unreachable worker: not a 404", "GET", "/v1/responses/resp_1",
			[]func(http.ResponseWriter, *http.Request){notFound}, []string{deadURL}, 502,
			func(t *testing.T, r resp, ws []*respWorker) {
				if msg := r.errMsg(t); !strings.Contains(msg, deadURL) || !strings.Contains(msg, "1 of 2 workers") {
					t.Fatalf("msg %q", msg)
				}
			}},
		{"a 5xx and a 404", "GET", "/v1/responses/resp_1",
			[]func(http.ResponseWriter, *http.Request){notFound, func(w http.ResponseWriter, r *http.Request) {
				openai.WriteError(w, 500, "boom")
			}}, nil, 502, nil},
		{"a resumed stream is relayed", "GET", "/v1/responses/resp_1?stream=true",
			[]func(http.ResponseWriter, *http.Request){notFound, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "text/event-stream")
				for i := range 3 {
					fmt.Fprintf(w, "event: response.output_text.delta\ndata: {\"sequence_number\":%d}\n\n", i)
					http.NewResponseController(w).Flush()
				}
			}}, nil, 200,
			func(t *testing.T, r resp, ws []*respWorker) {
				if r.header.Get("Content-Type") != "text/event-stream" || strings.Count(string(r.body), "sequence_number") != 3 {
					t.Fatalf("%v %q", r.header, r.body)
				}
			}},
		{"delete is not served by vLLM", "DELETE", "/v1/responses/resp_1", nil, nil, 501, nil},
		{"input items are not served by vLLM", "GET", "/v1/responses/resp_1/input", nil, nil, 501, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.UpstreamTimeout = 5 * time.Second })
			var ws []*respWorker
			for _, h := range tc.handlers {
				w := newRespWorker(t, h)
				ws = append(ws, w)
				e.add(w.URL, worker.RoleRegular, -1, 0)
			}
			for _, u := range tc.extra {
				e.add(u, worker.RoleRegular, -1, 0)
			}
			if len(tc.handlers)+len(tc.extra) == 0 {
				e.add(newRespWorker(t, found).URL, worker.RoleRegular, -1, 0)
			}
			start := time.Now()
			r := e.do(tc.method, tc.path, "")
			if r.status != tc.status {
				t.Fatalf("status %d want %d: %s", r.status, tc.status, r.body)
			}
			if el := time.Since(start); el > 3*time.Second {
				t.Fatalf("took %v: the fan-out waited for a hanging worker", el)
			}
			if r.status >= 400 {
				r.errMsg(t)
			}
			if tc.check != nil {
				tc.check(t, r, ws)
			}
		})
	}
}

func TestResponsesFanOutPDAndEmpty(t *testing.T) {
	e := newEnv(t, nil)
	if r := e.do("GET", "/v1/responses/resp_1", ""); r.status != 503 || r.errMsg(t) != "No available workers" {
		t.Fatalf("no workers: %d %s", r.status, r.body)
	}
	pd := newEnv(t, func(o *Options) { o.Mode = ModePD })
	p := newRespWorker(t, notFound)
	d := newRespWorker(t, found)
	pd.add(p.URL, worker.RolePrefill, -1, 0)
	pd.add(d.URL, worker.RoleDecode, -1, 0)
	if r := pd.do("GET", "/v1/responses/resp_1", ""); r.status != 200 || string(r.body) != storedResp {
		t.Fatalf("PD: %d %s", r.status, r.body)
	}
}

// TestStatusHooksInWorkersAndServerInfo: the discovery and PD status hooks
// appear under "discovery" and "pd" in /workers and /get_server_info.
func TestStatusHooksInWorkersAndServerInfo(t *testing.T) {
	e := newEnv(t, func(o *Options) {
		o.Mode = ModePD
		o.DiscoveryStatus = func() any { return map[string]any{"address": "127.0.0.1:1"} }
		o.PDStatus = func() any { return map[string]any{"connector": "moriio", "troubled_pairs": []any{}} }
	})
	e.add(newRespWorker(t, found).URL, worker.RolePrefill, -1, 0)
	for _, path := range []string{"/workers", "/get_server_info"} {
		r := e.do("GET", path, "")
		m := r.json(t)
		pd, _ := m["pd"].(map[string]any)
		disc, _ := m["discovery"].(map[string]any)
		if r.status != 200 || pd["connector"] != "moriio" || disc["address"] != "127.0.0.1:1" {
			t.Fatalf("%s: %d %s", path, r.status, r.body)
		}
	}
}
