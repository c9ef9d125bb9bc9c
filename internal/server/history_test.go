package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/switchyard-llm/switchyard/internal/history"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// TestResponsesHistory: with a history store, the id of a relayed
// /v1/responses answer (JSON or SSE) is remembered with the worker that
// produced it, and retrieval and cancel go to that worker only; unknown
// ids still fan out.
func TestResponsesHistory(t *testing.T) {
	reg := prometheus.NewRegistry()
	h, err := history.New(history.Options{Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(o *Options) { o.History = h; o.UpstreamTimeout = 5 * time.Second })
	a := newRespWorker(t, found)
	b := newRespWorker(t, found)
	e.add(a.URL, worker.RoleRegular, -1, 0)
	bw := e.add(b.URL, worker.RoleRegular, 0, 2) // a DP rank: the owner is the server, b.URL
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	e.add(deadURL, worker.RoleRegular, -1, 0)

	e.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
		owner, id := bw.Key(), ""
		if strings.Contains(string(c.Body), "dead") {
			owner = deadURL
		}
		fmt.Sscanf(r.Header.Get("X-Want-Id"), "%s", &id)
		c.Receipt.Worker = owner
		if c.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(200)
			fmt.Fprintf(w, "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":%q}}\n\n", id)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q,"object":"response"}`, id)
	}
	for _, c := range []struct{ id, body string }{
		{"resp_json", `{"input":"x"}`},
		{"resp_sse", `{"input":"x","stream":true}`},
		{"resp_dead", `{"input":"dead"}`},
	} {
		if r := e.do("POST", "/v1/responses", c.body, "X-Want-Id", c.id); r.status != 200 || !strings.Contains(string(r.body), c.id) {
			t.Fatalf("create %s: %d %s", c.id, r.status, r.body)
		}
	}
	if _, ok := h.Peek("resp_json"); !ok {
		t.Fatal("resp_json not learned")
	}
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"GET", "/v1/responses/resp_json", 200},
		{"GET", "/v1/responses/resp_sse?stream=true", 200},
		{"POST", "/v1/responses/resp_json/cancel", 200},
	} {
		before := len(a.requests())
		r := e.do(c.method, c.path, "")
		if r.status != c.status || string(r.body) != storedResp {
			t.Fatalf("%s %s: %d %s", c.method, c.path, r.status, r.body)
		}
		if got := a.requests(); len(got) != before {
			t.Fatalf("%s %s: the non-owner was asked: %v", c.method, c.path, got)
		}
	}
	if got := b.requests(); len(got) != 3 || got[1] != "GET /v1/responses/resp_sse?stream=true" {
		t.Fatalf("owner saw %v", got)
	}
	// The owner is down: 502 naming it, no fan-out.
	r := e.do("GET", "/v1/responses/resp_dead", "")
	if r.status != 502 || !strings.Contains(r.errMsg(t), deadURL) || !strings.Contains(r.errMsg(t), "which stored this response") {
		t.Fatalf("owner down: %d %s", r.status, r.body)
	}
	// Unknown id, and an owner removed from the fleet: fan-out (misses).
	if r := e.do("GET", "/v1/responses/resp_unknown", ""); r.status != 200 {
		t.Fatalf("unknown id: %d %s", r.status, r.body)
	}
	e.reg.Remove(bw.Key())
	if r := e.do("GET", "/v1/responses/resp_json", ""); r.status != 200 {
		t.Fatalf("owner removed: %d %s", r.status, r.body)
	}
	want := `
# HELP vllm_router_history_lookups_total Responses API id lookups in the history store, by op (retrieve, cancel, previous_response) and result (hit: sent to the owner only; miss: asked every worker or routed by the policy).
# TYPE vllm_router_history_lookups_total counter
vllm_router_history_lookups_total{op="cancel",result="hit"} 1
vllm_router_history_lookups_total{op="retrieve",result="hit"} 3
vllm_router_history_lookups_total{op="retrieve",result="miss"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "vllm_router_history_lookups_total"); err != nil {
		t.Fatal(err)
	}
}

// TestResponsesHistoryPD: in PD mode the owner is the prefill worker of an
// unsplit request, or the decode worker of a split one.
func TestResponsesHistoryPD(t *testing.T) {
	h, err := history.New(history.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e := newEnv(t, func(o *Options) { o.Mode = ModePD; o.History = h; o.UpstreamTimeout = 5 * time.Second })
	p := newRespWorker(t, found)
	d := newRespWorker(t, found)
	pw := e.add(p.URL, worker.RolePrefill, -1, 0)
	dw := e.add(d.URL, worker.RoleDecode, -1, 0)
	e.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
		c.Receipt.Prefill = pw.Key()
		if strings.Contains(string(c.Body), "split") {
			c.Receipt.Decode = dw.Key()
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q}`, r.Header.Get("X-Want-Id"))
	}
	for _, c := range []struct{ id, body string }{{"resp_unsplit", `{"input":"x"}`}, {"resp_split", `{"input":"split"}`}} {
		if r := e.do("POST", "/v1/responses", c.body, "X-Want-Id", c.id); r.status != 200 {
			t.Fatalf("create: %d %s", r.status, r.body)
		}
	}
	for id, want := range map[string]*respWorker{"resp_unsplit": p, "resp_split": d} {
		other := p
		if want == p {
			other = d
		}
		n := len(other.requests())
		if r := e.do("GET", "/v1/responses/"+id, ""); r.status != 200 {
			t.Fatalf("GET %s: %d %s", id, r.status, r.body)
		}
		if got := want.requests(); len(got) == 0 || got[len(got)-1] != "GET /v1/responses/"+id {
			t.Fatalf("%s: owner saw %v", id, got)
		}
		if len(other.requests()) != n {
			t.Fatalf("%s: the other worker was asked", id)
		}
	}
}
