package server

import (
	"encoding/json"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestNewValidation(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	d := &fakeDispatcher{}
	for _, tc := range []struct {
		name string
		o    Options
		want string
	}{
		{"no registry", Options{Generate: d}, "Registry"},
		{"no dispatcher", Options{Registry: reg}, "Generate"},
		{"bad mode", Options{Registry: reg, Generate: d, Mode: "igw"}, "mode"},
		{"bad cors", Options{Registry: reg, Generate: d, CORSAllowedOrigins: []string{"not a url"}}, "CORS"},
		{"bad id header", Options{Registry: reg, Generate: d, RequestIDHeaders: []string{"x bad"}}, "request id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want mention of %q", err, tc.want)
			}
		})
	}
}

// regularFleet: two healthy workers (w1, w2 with overlapping models) and an
// unhealthy third.
func regularFleet(t *testing.T, mod func(*Options)) (*env, *fakeWorker, *fakeWorker, *fakeWorker) {
	e := newEnv(t, mod)
	w1, w2 := newFakeWorker(t), newFakeWorker(t)
	if w2.URL < w1.URL { // registry order is key order
		w1, w2 = w2, w1
	}
	w1.models = []string{"llama", "qwen"}
	w2.models = []string{"qwen", "mistral"}
	w3 := newFakeWorker(t, "never-listed")
	e.add(w1.URL, worker.RoleRegular, -1, 1)
	e.add(w2.URL, worker.RoleRegular, -1, 1)
	e.add(w3.URL, worker.RoleRegular, -1, 1).SetHealthy(false)
	return e, w1, w2, w3
}

func TestRegularEndpoints(t *testing.T) {
	e, w1, w2, w3 := regularFleet(t, nil)
	w2.setStatus("/flush_cache", 500)
	for _, tc := range []struct {
		method, path, body string
		status             int
		check              func(t *testing.T, r resp)
	}{
		{"GET", "/liveness", "", 200, func(t *testing.T, r resp) {
			if string(r.body) != "OK" {
				t.Fatalf("body %q", r.body)
			}
		}},
		{"GET", "/readiness", "", 200, func(t *testing.T, r resp) {
			want := map[string]any{"status": "ready", "healthy_workers": 2.0, "total_workers": 3.0}
			if d := cmp.Diff(want, r.json(t)); d != "" {
				t.Fatal(d)
			}
		}},
		{"GET", "/health", "", 200, func(t *testing.T, r resp) {
			if !strings.Contains(string(r.body), w3.URL) || !strings.Contains(string(r.body), "1 of 3") {
				t.Fatalf("body %q does not name the unhealthy worker", r.body)
			}
		}},
		{"GET", "/health_generate", "", 200, func(t *testing.T, r resp) {
			if !strings.Contains(string(r.body), "passed") {
				t.Fatalf("body %q", r.body)
			}
		}},
		{"GET", "/v1/models", "", 200, func(t *testing.T, r resp) {
			var ml struct {
				Object string
				Data   []struct{ ID, Root string }
			}
			if err := json.Unmarshal(r.body, &ml); err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, m := range ml.Data {
				ids = append(ids, m.ID)
			}
			if want := []string{"llama", "qwen", "mistral"}; ml.Object != "list" || !slices.Equal(ids, want) {
				t.Fatalf("models %v (object %q), want %v", ids, ml.Object, want)
			}
			if ml.Data[1].Root != w1.URL {
				t.Fatalf("dedup kept the later entry: %+v", ml.Data[1])
			}
		}},
		{"GET", "/get_model_info", "", 200, func(t *testing.T, r resp) {
			if r.json(t)["worker"] != w1.URL || r.header.Get("X-Worker") != w1.URL {
				t.Fatalf("not relayed from the first healthy worker: %s", r.body)
			}
		}},
		{"GET", "/get_server_info", "", 200, func(t *testing.T, r resp) {
			m := r.json(t)
			if m["version"] != "test-1.2.3" || m["mode"] != "regular" || m["router"] != "switchyard" {
				t.Fatalf("router info: %s", r.body)
			}
			wk := m["workers"].(map[string]any)
			if wk["total"] != 3.0 || wk["regular"].(map[string]any)["healthy"] != 2.0 {
				t.Fatalf("worker counts: %v", wk)
			}
			if m["policies"].(map[string]any)["policy"] != "round_robin" {
				t.Fatalf("policies: %v", m["policies"])
			}
			if m["worker_info"].(map[string]any)["worker"] != w1.URL || m["worker_info_source"] != w1.URL {
				t.Fatalf("worker info: %v", m["worker_info"])
			}
		}},
		{"GET", "/get_loads", "", 200, func(t *testing.T, r resp) {
			ws := r.json(t)["workers"].([]any)
			if len(ws) != 3 {
				t.Fatalf("workers: %v", ws)
			}
			first := ws[0].(map[string]any)
			if first["load"] != 0.0 || first["polled_load"] != -1.0 || first["role"] != "regular" {
				t.Fatalf("entry: %v", first)
			}
		}},
		{"GET", "/list_workers", "", 200, func(t *testing.T, r resp) {
			urls := r.json(t)["urls"].([]any)
			if len(urls) != 3 {
				t.Fatalf("urls %v", urls)
			}
		}},
		{"GET", "/workers", "", 200, func(t *testing.T, r resp) {
			m := r.json(t)
			stats := m["stats"].(map[string]any)
			if m["total"] != 3.0 || stats["regular_count"] != 3.0 || stats["healthy_count"] != 2.0 {
				t.Fatalf("totals: %s", r.body)
			}
			for _, x := range m["workers"].([]any) {
				wk := x.(map[string]any)
				if wk["url"] == w3.URL && wk["is_healthy"] != false {
					t.Fatalf("unhealthy worker shown healthy: %v", wk)
				}
				for _, k := range []string{"key", "model_id", "worker_type", "load", "routable", "source", "dp_rank", "dp_size", "circuit_breaker", "total_requests"} {
					if _, ok := wk[k]; !ok {
						t.Fatalf("field %q missing: %v", k, wk)
					}
				}
			}
		}},
		{"GET", "/workers/" + url.PathEscape(w3.URL), "", 200, func(t *testing.T, r resp) {
			m := r.json(t)
			if m["url"] != w3.URL || m["is_healthy"] != false || m["model_id"] != "m1" || m["circuit_breaker"] != "closed" || m["dp_rank"] != nil {
				t.Fatalf("worker: %s", r.body)
			}
		}},
		{"GET", "/workers/" + url.PathEscape("http://nope:1"), "", 404, func(t *testing.T, r resp) {
			m := r.json(t)
			if m["code"] != "WORKER_NOT_FOUND" || !strings.Contains(m["error"].(string), "nope") {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"POST", "/flush_cache", "", 206, func(t *testing.T, r resp) {
			m := r.json(t)
			if len(m["results"].([]any)) != 2 || len(m["errors"].([]any)) != 1 {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"POST", "/start_profile", "", 206, nil}, // w2 fails /start_profile (set in the loop)
		{"GET", "/v1/chat/completions", "", 405, func(t *testing.T, r resp) {
			if r.header.Get("Allow") != "POST" {
				t.Fatalf("Allow %q", r.header.Get("Allow"))
			}
			r.errMsg(t)
		}},
		{"POST", "/health", "", 405, func(t *testing.T, r resp) {
			if r.header.Get("Allow") != "GET, HEAD" {
				t.Fatalf("Allow %q", r.header.Get("Allow"))
			}
		}},
		{"PUT", "/workers/x", "", 405, func(t *testing.T, r resp) {
			if r.header.Get("Allow") != "DELETE, GET, HEAD" {
				t.Fatalf("Allow %q", r.header.Get("Allow"))
			}
		}},
		{"GET", "/v1/files/abc?x=1", "", 200, func(t *testing.T, r resp) {
			m := r.json(t)
			if m["passthrough"] != true || m["path"] != "/v1/files/abc" || m["query"] != "x=1" {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"POST", "/tokenize", `{"prompt":"hi"}`, 200, func(t *testing.T, r resp) {
			if r.json(t)["body_len"] != 15.0 {
				t.Fatalf("body %s", r.body)
			}
		}},
	} {
		t.Run(tc.method+" "+tc.path, func(t *testing.T) {
			if tc.path == "/start_profile" {
				w2.setStatus("/start_profile", 503)
			}
			r := e.do(tc.method, tc.path, tc.body)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if r.header.Get("X-Request-Id") == "" {
				t.Fatal("no x-request-id")
			}
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
	if w3.hit("/v1/models") != 0 || w3.hit("/get_model_info") != 0 {
		t.Fatal("an unhealthy worker was asked for info")
	}
	if w1.hit("POST /flush_cache") != 1 || w3.hit("POST /flush_cache") != 1 {
		t.Fatal("flush_cache did not reach every worker")
	}
}

func TestRegularNoHealthyWorkers(t *testing.T) {
	e := newEnv(t, nil)
	for _, path := range []string{"/health", "/v1/models", "/get_model_info", "/health_generate"} {
		r := e.do("GET", path, "")
		if r.status != 503 {
			t.Fatalf("%s: status %d, want 503", path, r.status)
		}
		r.errMsg(t)
	}
	r := e.do("GET", "/readiness", "")
	want := map[string]any{"status": "not_ready", "reason": "no healthy workers available", "healthy_workers": 0.0, "total_workers": 0.0}
	if d := cmp.Diff(want, r.json(t)); r.status != 503 || d != "" {
		t.Fatalf("readiness %d: %s", r.status, d)
	}
	// An unhealthy worker only: /health names it.
	w := newFakeWorker(t, "m")
	e.add(w.URL, worker.RoleRegular, -1, 1).SetHealthy(false)
	r = e.do("GET", "/health", "")
	if r.status != 503 || !strings.Contains(r.errMsg(t), w.URL) {
		t.Fatalf("health %d %s", r.status, r.body)
	}
	// Flush with no workers is a no-op 200.
	e2 := newEnv(t, nil)
	if r := e2.do("POST", "/flush_cache", ""); r.status != 200 {
		t.Fatalf("flush with no workers: %d", r.status)
	}
}

func TestModelsAllFail(t *testing.T) {
	e := newEnv(t, nil)
	w := newFakeWorker(t, "m")
	w.setStatus("/v1/models", 401)
	e.add(w.URL, worker.RoleRegular, -1, 1)
	r := e.do("GET", "/v1/models", "")
	if r.status != 401 {
		t.Fatalf("status %d, want the workers' 401: %s", r.status, r.body)
	}
	w.setStatus("/v1/models", 500)
	r = e.do("GET", "/v1/models", "")
	if r.status != 502 {
		t.Fatalf("status %d, want 502", r.status)
	}
}

func TestFlushAllFail(t *testing.T) {
	e := newEnv(t, nil)
	w := newFakeWorker(t, "m")
	w.setStatus("/flush_cache", 500)
	e.add(w.URL, worker.RoleRegular, -1, 1)
	r := e.do("POST", "/flush_cache", "")
	if r.status != 500 || !strings.Contains(r.errMsg(t), w.URL) {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	w.setStatus("/flush_cache", 0)
	if r := e.do("POST", "/flush_cache", ""); r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
}

func TestUpstreamAuthOnInfoCalls(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.APIKey = "worker-secret" })
	w := newFakeWorker(t, "m")
	e.add(w.URL, worker.RoleRegular, -1, 1)
	e.do("GET", "/v1/models", "", "Authorization", "Bearer client")
	e2 := newEnv(t, func(o *Options) { o.ForwardClientAuthorization = true })
	e2.add(w.URL, worker.RoleRegular, -1, 1)
	e2.do("GET", "/v1/models", "", "Authorization", "Bearer client")
	e3 := newEnv(t, nil)
	e3.add(w.URL, worker.RoleRegular, -1, 1)
	e3.do("GET", "/v1/models", "", "Authorization", "Bearer client")
	w.mu.Lock()
	got := append([]string(nil), w.auth...)
	w.mu.Unlock()
	if want := []string{"Bearer worker-secret", "Bearer client", ""}; !slices.Equal(got, want) {
		t.Fatalf("upstream Authorization %q, want %q", got, want)
	}
}

func TestPDEndpoints(t *testing.T) {
	var profiled []string
	e := newEnv(t, func(o *Options) {
		o.Mode = ModePD
		o.Profile = func(w http.ResponseWriter, _ *http.Request, which string) {
			profiled = append(profiled, which)
			writeText(w, 200, which)
		}
	})
	p := newFakeWorker(t, "llama")
	d := newFakeWorker(t, "llama", "llama-lora")
	e.add(p.URL, worker.RolePrefill, -1, 1)
	for r := range 2 {
		e.add(d.URL, worker.RoleDecode, r, 2)
	}
	for _, tc := range []struct {
		method, path, body string
		status             int
		check              func(t *testing.T, r resp)
	}{
		{"GET", "/readiness", "", 200, func(t *testing.T, r resp) {
			want := map[string]any{"status": "ready",
				"prefill": map[string]any{"healthy": 1.0, "total": 1.0},
				"decode":  map[string]any{"healthy": 2.0, "total": 2.0}}
			if diff := cmp.Diff(want, r.json(t)); diff != "" {
				t.Fatal(diff)
			}
		}},
		{"GET", "/health", "", 200, nil},
		{"GET", "/health_generate", "", 200, func(t *testing.T, r resp) {
			if !strings.Contains(string(r.body), "prefill="+p.URL) || !strings.Contains(string(r.body), "decode="+d.URL+"@0") {
				t.Fatalf("body %q", r.body)
			}
		}},
		{"GET", "/v1/models", "", 200, func(t *testing.T, r resp) {
			var ml modelList
			_ = json.Unmarshal(r.body, &ml)
			if len(ml.Data) != 2 || !strings.Contains(string(ml.Data[0]), d.URL) {
				t.Fatalf("models %s (decode first, deduped)", r.body)
			}
		}},
		{"GET", "/get_model_info", "", 200, func(t *testing.T, r resp) {
			if r.json(t)["worker"] != d.URL {
				t.Fatalf("want decode first: %s", r.body)
			}
		}},
		{"GET", "/get_loads", "", 200, func(t *testing.T, r resp) {
			loads := r.json(t)["loads"].(map[string]any)
			want := map[string]any{"prefill_" + p.URL: 0.0, "decode_" + d.URL + "@0": 0.0, "decode_" + d.URL + "@1": 0.0}
			if diff := cmp.Diff(want, loads); diff != "" {
				t.Fatal(diff)
			}
		}},
		{"GET", "/workers/" + url.PathEscape(d.URL+"@1"), "", 200, func(t *testing.T, r resp) {
			m := r.json(t)
			if m["key"] != d.URL+"@1" || m["dp_rank"] != 1.0 || m["dp_size"] != 2.0 || m["worker_type"] != "decode" {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"GET", "/workers/" + url.PathEscape(d.URL), "", 200, func(t *testing.T, r resp) {
			if ranks := r.json(t)["ranks"].([]any); len(ranks) != 2 {
				t.Fatalf("ranks %v", ranks)
			}
		}},
		{"GET", "/v1/files/abc", "", 404, func(t *testing.T, r resp) { r.errMsg(t) }},
		// fanned out to every worker; each answers 404, relayed as is
		{"GET", "/v1/responses/abc", "", 404, func(t *testing.T, r resp) {
			if !strings.Contains(string(r.body), "404 page not found") {
				t.Fatalf("body %q", r.body)
			}
		}},
		{"POST", "/v1/audio/foo", `{}`, 200, func(t *testing.T, r resp) {
			if r.json(t)["passthrough"] != true {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"POST", "/v1/embeddings", `{"input":"x"}`, 200, func(t *testing.T, r resp) {
			if m := r.json(t); m["passthrough"] != true || m["body_len"] != 13.0 {
				t.Fatalf("embeddings not passed through: %s", r.body)
			}
		}},
		{"POST", "/rerank", `{"query":"x"}`, 200, func(t *testing.T, r resp) {
			if r.json(t)["passthrough"] != true {
				t.Fatalf("rerank not passed through: %s", r.body)
			}
		}},
		{"POST", "/v1/chat/completions", `{"messages":[]}`, 200, func(t *testing.T, r resp) {
			if r.json(t)["route"] != "/v1/chat/completions" {
				t.Fatalf("body %s", r.body)
			}
		}},
		{"POST", "/start_profile", "", 200, nil},
		{"POST", "/stop_profile", "", 200, nil},
	} {
		t.Run(tc.method+" "+tc.path, func(t *testing.T) {
			r := e.do(tc.method, tc.path, tc.body)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
	if !slices.Equal(profiled, []string{"start_profile", "stop_profile"}) {
		t.Fatalf("profile calls %v", profiled)
	}
	if d.hit("/health") != 1 || p.hit("/health") != 1 || d.hit("/v1/completions")+d.hit("/v1/chat/completions")+d.hit("/generate") != 0 {
		t.Fatal("health_generate must GET /health on the pair and never generate")
	}
	if e.gen.count() != 1 {
		t.Fatalf("dispatcher calls %d, want 1 (chat only)", e.gen.count())
	}
}

func TestPDNotReady(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Mode = ModePD })
	p := newFakeWorker(t, "m")
	e.add(p.URL, worker.RolePrefill, -1, 1)
	r := e.do("GET", "/readiness", "")
	m := r.json(t)
	if r.status != 503 || m["status"] != "not_ready" || m["reason"] != "no healthy decode workers" {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if r := e.do("GET", "/health_generate", ""); r.status != 503 || !strings.Contains(r.errMsg(t), "no available decode") {
		t.Fatalf("%d %s", r.status, r.body)
	}
	// Options.Ready overrides the default rule.
	e2 := newEnv(t, func(o *Options) {
		o.Mode = ModePD
		o.Ready = func() (bool, string) { return false, "waiting for MoRI mode" }
	})
	if r := e2.do("GET", "/readiness", ""); r.status != 503 || r.json(t)["reason"] != "waiting for MoRI mode" {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if r := e2.do("GET", "/health", ""); r.status != 503 || !strings.Contains(r.errMsg(t), "MoRI") {
		t.Fatalf("%d %s", r.status, r.body)
	}
	// PD profile without a hook → 404.
	if r := e2.do("POST", "/start_profile", ""); r.status != 404 {
		t.Fatalf("profile %d", r.status)
	}
}

func TestNoPassthrough(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.Passthrough = nil })
	for _, path := range []string{"/foo", "/tokenize"} {
		if r := e.do("POST", path, "{}"); r.status != 404 {
			t.Fatalf("%s: %d", path, r.status)
		}
	}
}

// TestModelsExtra: Options.ExtraModels (--enable-igw's upstream models)
// are listed after the workers' models, win over a worker listing the
// same id, and are the answer when no worker is registered or answers.
func TestModelsExtra(t *testing.T) {
	extra := []json.RawMessage{json.RawMessage(`{"id":"gpt","object":"model","owned_by":"api.example.com"}`)}
	e := newEnv(t, func(o *Options) { o.ExtraModels = func() []json.RawMessage { return extra } })
	ids := func(r resp) []string {
		t.Helper()
		var l struct {
			Data []struct {
				ID string
			}
		}
		if r.status != 200 {
			t.Fatalf("/v1/models: %d %s", r.status, r.body)
		}
		if err := json.Unmarshal([]byte(r.body), &l); err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, d := range l.Data {
			out = append(out, d.ID)
		}
		return out
	}
	if got := ids(e.do("GET", "/v1/models", "")); !slices.Equal(got, []string{"gpt"}) {
		t.Fatalf("no workers: %v", got)
	}
	w := newFakeWorker(t, "m")
	wk := e.add(w.URL, worker.RoleRegular, -1, 1)
	if got := ids(e.do("GET", "/v1/models", "")); !slices.Equal(got, []string{"m", "gpt"}) {
		t.Fatalf("a worker beside the upstream: %v", got)
	}
	w.setStatus("/v1/models", 500)
	if got := ids(e.do("GET", "/v1/models", "")); !slices.Equal(got, []string{"gpt"}) {
		t.Fatalf("the worker failing: %v", got)
	}
	wk.SetHealthy(false)
	if got := ids(e.do("GET", "/v1/models", "")); !slices.Equal(got, []string{"gpt"}) {
		t.Fatalf("the worker unhealthy: %v", got)
	}
}
