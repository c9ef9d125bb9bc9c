package server

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// fleetHooks implements AddWorker/RemoveWorker on a registry the way the
// lead's wiring will: normalise, DP-expand, register; remove by key or by
// base URL (every rank).
func fleetHooks(reg *worker.Registry) (func(context.Context, string) ([]*worker.Worker, error), func(string) []*worker.Worker) {
	add := func(ctx context.Context, raw string) ([]*worker.Worker, error) {
		if strings.Contains(raw, "slow") { // a health wait that times out
			ctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
			defer cancel()
			<-ctx.Done()
			return nil, fmt.Errorf("waiting for %s to become healthy: %w", raw, ctx.Err())
		}
		base, rank, err := worker.NormalizeURL(raw)
		if err != nil {
			return nil, err
		}
		return reg.Add(worker.Spec{URL: base, DPRank: rank, ModelID: "m"})
	}
	remove := func(raw string) []*worker.Worker {
		if w := reg.Get(raw); w != nil {
			return reg.Remove(raw)
		}
		base, _, _ := worker.NormalizeURL(raw)
		return reg.RemoveWhere(func(w *worker.Worker) bool { return w.URL == base })
	}
	return add, remove
}

func TestAddRemoveWorker(t *testing.T) {
	e := newEnv(t, func(o *Options) {
		o.AddWorker, o.RemoveWorker = fleetHooks(o.Registry)
	})
	for _, tc := range []struct {
		method, path, body string
		status             int
		want               string // substring of the body
	}{
		{"POST", "/add_worker", "", 400, "Missing required query parameter: url"},
		{"POST", "/add_worker?url=ftp://x", "", 400, "http://"},
		{"POST", "/add_worker?url=http://h1:8000", "", 200, "Successfully added worker: http://h1:8000"},
		{"POST", "/add_worker?url=http://h1:8000", "", 409, "already exists"},
		{"POST", "/add_worker?url=http://h1:8000&worker_type=prefill", "", 400, "not supported"},
		{"POST", "/add_worker?url=http://h1:8000&worker_type=bogus", "", 400, "unknown worker role"},
		{"GET", "/list_workers", "", 200, `{"urls":["http://h1:8000"]}`},
		{"POST", "/remove_worker?url=http://h2:8000", "", 404, "not found"},
		{"POST", "/remove_worker", "", 400, "Missing"},
		{"POST", "/remove_worker?url=http://h1:8000", "", 200, "Successfully removed worker: http://h1:8000"},
		{"POST", "/workers", `{"url":"http://h3:9000","priority":50,"labels":{"a":"b"}}`, 200, `"success":true`},
		{"POST", "/workers", `{"url":"http://h3:9000"}`, 409, `"code":"WORKER_EXISTS"`},
		{"POST", "/workers", `{"url":"nope"}`, 400, `"code":"INVALID_URL"`},
		{"POST", "/workers", `{"priority":1}`, 400, `"code":"ADD_WORKER_FAILED"`},
		{"POST", "/workers", `{"url":`, 400, `"code":"ADD_WORKER_FAILED"`},
		{"POST", "/workers", `{"url":"http://h4:1","worker_type":"decode"}`, 400, "not supported"},
		{"POST", "/workers", `{"url":"http://slow:1"}`, 504, `"code":"ADD_WORKER_TIMEOUT"`},
		{"GET", "/workers/" + url.PathEscape("http://h3:9000"), "", 200, `"source":"static"`},
		{"DELETE", "/workers/" + url.PathEscape("http://h3:9000"), "", 200, `"removed":["http://h3:9000"]`},
		{"DELETE", "/workers/" + url.PathEscape("http://h3:9000"), "", 404, `"code":"WORKER_NOT_FOUND"`},
		{"DELETE", "/workers/" + url.PathEscape("not a url"), "", 400, `"code":"INVALID_URL"`},
	} {
		t.Run(tc.method+" "+tc.path+" "+tc.body, func(t *testing.T) {
			r := e.do(tc.method, tc.path, tc.body)
			if r.status != tc.status || !strings.Contains(string(r.body), tc.want) {
				t.Fatalf("%d %s; want %d containing %q", r.status, r.body, tc.status, tc.want)
			}
		})
	}
}

func TestAddWorkerSpec(t *testing.T) {
	var got AddWorkerRequest
	e := newEnv(t, func(o *Options) {
		o.Mode = ModePD
		o.AddWorkerSpec = func(_ context.Context, req AddWorkerRequest) ([]*worker.Worker, error) {
			got = req
			specs := worker.ExpandDP(worker.Spec{URL: req.URL, Role: req.Role, DPRank: -1, ModelID: req.ModelID}, req.DPSize)
			return o.Registry.Add(specs...)
		}
	})
	r := e.do("POST", "/workers", `{"url":"http://p1:8000","worker_type":"prefill","model_id":"llama","bootstrap_port":8998,"dp_size":2}`)
	if r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if got.URL != "http://p1:8000" || got.Role != worker.RolePrefill || got.ModelID != "llama" || *got.BootstrapPort != 8998 || got.DPSize != 2 {
		t.Fatalf("request %+v", got)
	}
	ws := r.json(t)["workers"].([]any)
	if len(ws) != 2 || ws[1].(map[string]any)["key"] != "http://p1:8000@1" || ws[0].(map[string]any)["worker_type"] != "prefill" {
		t.Fatalf("workers %v", ws)
	}
	if r := e.do("POST", "/add_worker?url=http://d1:8000&worker_type=decode", ""); r.status != 200 || got.Role != worker.RoleDecode {
		t.Fatalf("%d %s (%+v)", r.status, r.body, got)
	}
	// No hooks at all: 501.
	e2 := newEnv(t, nil)
	if r := e2.do("POST", "/workers", `{"url":"http://x:1"}`); r.status != 501 || r.json(t)["code"] != "NOT_SUPPORTED" {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if r := e2.do("POST", "/remove_worker?url=http://x:1", ""); r.status != 501 {
		t.Fatalf("%d %s", r.status, r.body)
	}
}
