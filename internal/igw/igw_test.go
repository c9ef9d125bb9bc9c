package igw

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type modelWorker struct {
	*httptest.Server
	hits atomic.Int32
}

func newWorker(t *testing.T, name string) *modelWorker {
	mw := &modelWorker{}
	mw.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw.hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"served_by":"`+name+`"}`)
	}))
	t.Cleanup(mw.Close)
	return mw
}

type env struct {
	rt     *Router
	reg    *worker.Registry
	srv    *httptest.Server
	closed []policy.Policy
	prom   *prometheus.Registry
}

func newEnv(t *testing.T) *env { return newEnvWith(t, nil) }

func newEnvWith(t *testing.T, edit func(*Options)) *env {
	e := &env{reg: worker.NewRegistry(worker.BreakerConfig{})}
	tr := proxy.NewTransport(proxy.TransportOptions{})
	t.Cleanup(tr.CloseIdleConnections)
	e.prom = prometheus.NewRegistry()
	o := Options{
		Registerer: e.prom,
		Registry:   e.reg, DefaultPolicy: policy.NameRoundRobin,
		NewPolicy: func(name string) (policy.Policy, error) {
			p, err := policy.New(name, policy.DefaultOptions())
			if err == nil {
				e.closed = append(e.closed, p)
			}
			return p, err
		},
		Regular: proxy.RegularOptions{Client: &http.Client{Transport: tr}, Retry: proxy.RetryConfig{MaxAttempts: 2}, RequestTimeout: 10 * time.Second},
	}
	if edit != nil {
		edit(&o)
	}
	rt, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, p := range e.closed {
			_ = policy.Close(p)
		}
	})
	t.Cleanup(rt.Close)
	e.rt = rt
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			rt.ServePassthrough(w, r)
			return
		}
		b, _ := io.ReadAll(r.Body)
		obj, err := rawjson.Parse(b)
		if err != nil {
			http.Error(w, err.Error(), 400)
			return
		}
		rt.Dispatch(w, r, &proxy.Call{Route: r.URL.Path, Path: r.URL.Path, Body: b, Obj: obj, Start: time.Now(), Receipt: &proxy.Receipt{}})
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *env) add(t *testing.T, url, model string) *worker.Worker {
	ws, err := e.reg.Add(worker.Spec{URL: url, Role: worker.RoleRegular, DPRank: -1, ModelID: model})
	if err != nil {
		t.Fatal(err)
	}
	return ws[0]
}

func (e *env) post(t *testing.T, body string) (int, string) {
	return e.postTo(t, "/v1/completions", body)
}

func (e *env) postTo(t *testing.T, path, body string) (int, string) {
	resp, err := http.Post(e.srv.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestRouteByModel(t *testing.T) {
	e := newEnv(t)
	a1, a2, b1 := newWorker(t, "a1"), newWorker(t, "a2"), newWorker(t, "b1")
	e.add(t, a1.URL, "model-a")
	e.add(t, a2.URL, "model-a")
	bw := e.add(t, b1.URL, "org/model-b")

	for range 6 {
		if st, body := e.post(t, `{"model":"model-a","prompt":"x"}`); st != 200 || !strings.Contains(body, `"a`) {
			t.Fatalf("model-a: %d %s", st, body)
		}
	}
	if a1.hits.Load() != 3 || a2.hits.Load() != 3 || b1.hits.Load() != 0 {
		t.Fatalf("model-a spread a1=%d a2=%d b1=%d", a1.hits.Load(), a2.hits.Load(), b1.hits.Load())
	}
	if st, body := e.post(t, `{"model":"org/model-b","prompt":"x"}`); st != 200 || !strings.Contains(body, "b1") {
		t.Fatalf("model-b: %d %s", st, body)
	}

	cases := []struct {
		name   string
		body   string
		status int
		want   map[string]any
	}{
		{"unknown model", `{"model":"gpt-9","prompt":"x"}`, 404, map[string]any{"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": "model", "code": 404.0}},
		{"not a string", `{"model":7,"prompt":"x"}`, 400, map[string]any{"message": "model must be a string, got 7", "type": "BadRequestError", "param": "model", "code": 400.0}},
		{"missing with two models", `{"prompt":"x"}`, 400, map[string]any{"message": "model is required: this router serves several models (model-a, org/model-b)", "type": "BadRequestError", "param": "model", "code": 400.0}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st, body := e.post(t, tc.body)
			var got struct{ Error map[string]any }
			if st != tc.status || json.Unmarshal([]byte(body), &got) != nil {
				t.Fatalf("%d %s", st, body)
			}
			for k, v := range tc.want {
				if got.Error[k] != v {
					t.Fatalf("%s = %v, want %v (%s)", k, got.Error[k], v, body)
				}
			}
		})
	}

	// model-b's only worker goes down: 503 naming it; model-a still served.
	bw.SetHealthy(false)
	if st, body := e.post(t, `{"model":"org/model-b","prompt":"x"}`); st != 503 || !strings.Contains(body, `Model \"org/model-b\" has no live workers`) {
		t.Fatalf("model-b down: %d %s", st, body)
	}
	if st, _ := e.post(t, `{"model":"model-a","prompt":"x"}`); st != 200 {
		t.Fatalf("model-a with b down: %d", st)
	}
	// The per-model response counters are recorded after the response
	// was written: wait for the last one.
	waitCond(t, "the last response counted", func() bool {
		return testutil.ToFloat64(e.rt.responses.WithLabelValues("model-a", "2xx")) == 7
	})
	want := `
# HELP vllm_router_model_rejections_total --enable-igw: requests refused before a fleet was chosen, by reason (unknown_model: 404, bad_model, model_required: 400).
# TYPE vllm_router_model_rejections_total counter
vllm_router_model_rejections_total{reason="bad_model"} 1
vllm_router_model_rejections_total{reason="model_required"} 1
vllm_router_model_rejections_total{reason="unknown_model"} 1
# HELP vllm_router_model_requests_total --enable-igw: generation requests per served model, by outcome (routed to the model's fleet; no_live_workers: 503; limited: 429, the model's max_concurrent_requests reached).
# TYPE vllm_router_model_requests_total counter
vllm_router_model_requests_total{model="model-a",outcome="routed"} 7
vllm_router_model_requests_total{model="org/model-b",outcome="no_live_workers"} 1
vllm_router_model_requests_total{model="org/model-b",outcome="routed"} 1
# HELP vllm_router_model_responses_total --enable-igw: routed generation requests per served model, by the status class of their response (2xx, 4xx, 5xx).
# TYPE vllm_router_model_responses_total counter
vllm_router_model_responses_total{code="2xx",model="model-a"} 7
vllm_router_model_responses_total{code="2xx",model="org/model-b"} 1
`
	if err := testutil.GatherAndCompare(e.prom, strings.NewReader(want), "vllm_router_model_requests_total",
		"vllm_router_model_rejections_total", "vllm_router_model_responses_total"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(e.rt.duration, "vllm_router_model_request_duration_seconds"); n != 2 {
		t.Fatalf("duration series: %d, want one per routed model", n)
	}
	// One model left: "model" may be omitted.
	e.reg.Remove(bw.Key())
	if st, body := e.post(t, `{"prompt":"x"}`); st != 200 || !strings.Contains(body, `"a`) {
		t.Fatalf("single model, no model field: %d %s", st, body)
	}
}

func TestRetryStaysInModel(t *testing.T) {
	e := newEnv(t)
	dead := httptest.NewServer(http.NotFoundHandler())
	deadURL := dead.URL
	dead.Close()
	other := newWorker(t, "other")
	good := newWorker(t, "good")
	e.add(t, deadURL, "m")
	e.add(t, other.URL, "n")
	e.add(t, good.URL, "m")
	for range 4 {
		if st, body := e.post(t, `{"model":"m","prompt":"x"}`); st != 200 || !strings.Contains(body, "good") {
			t.Fatalf("%d %s", st, body)
		}
	}
	if other.hits.Load() != 0 {
		t.Fatalf("a retry left the model's fleet: %d hits on model n", other.hits.Load())
	}
}

func TestSetPolicy(t *testing.T) {
	e := newEnv(t)
	if err := e.rt.SetPolicy("m", "nope"); err == nil || !strings.Contains(err.Error(), `labels.policy "nope" is not a policy`) {
		t.Fatalf("unknown policy: %v", err)
	}
	if err := e.rt.SetPolicy("m", policy.NameRandom); err != nil {
		t.Fatal(err)
	}
	if err := e.rt.SetPolicy("m", policy.NameRandom); err != nil {
		t.Fatalf("same policy again: %v", err)
	}
	if err := e.rt.SetPolicy("m", policy.NameCacheAware); err == nil || !strings.Contains(err.Error(), `already routes with policy "random"`) {
		t.Fatalf("conflict: %v", err)
	}
	w := newWorker(t, "w")
	e.add(t, w.URL, "m")
	if st, _ := e.post(t, `{"model":"m","prompt":"x"}`); st != 200 {
		t.Fatalf("%d", st)
	}
	if got := e.rt.Policy("m"); got != policy.NameRandom {
		t.Fatalf("fleet policy %q", got)
	}
	if got := e.rt.Policy("other"); got != policy.NameRoundRobin {
		t.Fatalf("default policy %q", got)
	}
}

func TestForModelFilterCache(t *testing.T) {
	mk := func(url, model string) *worker.Worker {
		return worker.New(worker.Spec{URL: url, DPRank: -1, ModelID: model}, worker.BreakerConfig{})
	}
	ws := []*worker.Worker{mk("http://a", "x"), mk("http://b", "y"), mk("http://c", "x")}
	inner, _ := policy.New(policy.NameRoundRobin, policy.DefaultOptions())
	p := ForModel(inner, "x").(*modelPolicy)
	seen := map[string]int{}
	for range 4 {
		ch, err := p.Pick(&policy.Request{}, policy.Candidates{Gen: 1, Workers: ws})
		if err != nil {
			t.Fatal(err)
		}
		seen[ch.Worker.URL]++
	}
	if seen["http://a"] != 2 || seen["http://c"] != 2 || seen["http://b"] != 0 {
		t.Fatalf("picks %v", seen)
	}
	ws2 := ws[:1]
	if got := p.filter(policy.Candidates{Gen: 1, Workers: ws2}); len(got) != 1 {
		t.Fatalf("a different candidate slice at the same generation reused the cache: %d", len(got))
	}
	if got := p.filter(policy.Candidates{Gen: 2, Workers: nil}); len(got) != 0 {
		t.Fatalf("empty: %d", len(got))
	}
}

// fakePD stands in for a model's pd.Engine: it answers with its model and
// what its policies picked among the full candidate lists, so the test
// sees that both only ever see the model's workers.
type fakePD struct {
	model  string
	pp, dp policy.Policy
	reg    *worker.Registry
	closed atomic.Bool
}

func (f *fakePD) Dispatch(w http.ResponseWriter, _ *http.Request, _ *proxy.Call) {
	snap := f.reg.Snapshot()
	p, perr := f.pp.Pick(&policy.Request{}, policy.Candidates{Gen: snap.Gen, Workers: snap.Prefill})
	d, derr := f.dp.Pick(&policy.Request{}, policy.Candidates{Gen: snap.Gen, Workers: snap.Decode})
	if perr != nil || derr != nil {
		http.Error(w, fmt.Sprint(perr, derr), 503)
		return
	}
	_, _ = fmt.Fprintf(w, `{"pd":%q,"p":%q,"d":%q}`, f.model, p.Worker.ModelID, d.Worker.ModelID)
}

func (f *fakePD) Close() { f.closed.Store(true) }

func (e *env) addRole(t *testing.T, url, model string, role worker.Role) *worker.Worker {
	t.Helper()
	ws, err := e.reg.Add(worker.Spec{URL: url, Role: role, DPRank: -1, ModelID: model})
	if err != nil {
		t.Fatal(err)
	}
	return ws[0]
}

func TestPDModelBesideRegular(t *testing.T) {
	var mu sync.Mutex
	engines := map[string][]*fakePD{}
	e := newEnvWith(t, func(o *Options) {
		o.PrefillPolicy, o.DecodePolicy = policy.NameRandom, policy.NameRoundRobin
		o.NewPD = func(model string, pp, dp policy.Policy) (PDFleet, error) {
			f := &fakePD{model: model, pp: pp, dp: dp, reg: o.Registry}
			mu.Lock()
			engines[model] = append(engines[model], f)
			mu.Unlock()
			return f, nil
		}
	})
	engine := func(m string) (*fakePD, int) {
		mu.Lock()
		defer mu.Unlock()
		n := len(engines[m])
		if n == 0 {
			return nil, 0
		}
		return engines[m][n-1], n
	}
	reg := newWorker(t, "r")
	e.add(t, reg.URL, "chat")
	// Two PD models, so a policy that saw every prefill/decode would pick
	// the other model's workers half of the time.
	e.addRole(t, "http://127.0.0.1:1", "big", worker.RolePrefill)
	e.addRole(t, "http://127.0.0.1:2", "big", worker.RoleDecode)
	e.addRole(t, "http://127.0.0.1:3", "other", worker.RolePrefill)
	od := e.addRole(t, "http://127.0.0.1:4", "other", worker.RoleDecode)
	if f, n := engine("big"); n != 1 || f == nil {
		t.Fatalf("the PD engine of big was not built when its workers joined: %d", n)
	}

	for range 4 {
		if st, body := e.post(t, `{"model":"big","prompt":"x"}`); st != 200 || body != `{"pd":"big","p":"big","d":"big"}` {
			t.Fatalf("big: %d %s", st, body)
		}
		if st, body := e.post(t, `{"model":"other","prompt":"x"}`); st != 200 || body != `{"pd":"other","p":"other","d":"other"}` {
			t.Fatalf("other: %d %s", st, body)
		}
	}
	if st, body := e.post(t, `{"model":"chat","prompt":"x"}`); st != 200 || !strings.Contains(body, `"r"`) {
		t.Fatalf("regular model: %d %s", st, body)
	}
	if _, n := engine("big"); n != 1 {
		t.Fatalf("engines of big: %d, want one reused", n)
	}

	st := e.rt.Status()
	if b := st["big"]; b.Kind != KindPD || b.PrefillPolicy != policy.NameRandom || b.DecodePolicy != policy.NameRoundRobin ||
		b.Prefill != 1 || b.Decode != 1 || b.Total != 2 || b.Policy != "" {
		t.Fatalf("status of big: %+v", b)
	}
	if c := st["chat"]; c.Kind != KindRegular || c.Policy != policy.NameRoundRobin || c.Total != 1 {
		t.Fatalf("status of chat: %+v", c)
	}

	// One role missing or down: a 503 saying which.
	e.addRole(t, "http://127.0.0.1:5", "half", worker.RolePrefill)
	od.SetHealthy(false)
	for _, tc := range []struct{ model, want string }{
		{"half", `Model \"half\" has no decode workers (1 prefill registered): a PD model needs both roles`},
		{"other", `Model \"other\" has no live decode workers (1 registered, all unhealthy or being drained)`},
	} {
		if st, body := e.post(t, `{"model":"`+tc.model+`","prompt":"x"}`); st != 503 || !strings.Contains(body, tc.want) {
			t.Fatalf("%s: %d %s, want 503 with %s", tc.model, st, body, tc.want)
		}
	}

	// big's last worker leaves: its engine is closed and the model is gone.
	f, _ := engine("big")
	e.reg.RemoveWhere(func(w *worker.Worker) bool { return w.ModelID == "big" })
	waitCond(t, "the PD engine of a model with no workers left closed", f.closed.Load)
	if st, body := e.post(t, `{"model":"big","prompt":"x"}`); st != 404 {
		t.Fatalf("big after its workers left: %d %s", st, body)
	}
	e.rt.Close()
	if f, _ := engine("other"); !f.closed.Load() {
		t.Fatal("Close left a PD engine running")
	}
}

func TestPDModelWithoutEngine(t *testing.T) {
	e := newEnv(t)
	e.addRole(t, "http://127.0.0.1:1", "big", worker.RolePrefill)
	e.addRole(t, "http://127.0.0.1:2", "big", worker.RoleDecode)
	if st, body := e.post(t, `{"model":"big","prompt":"x"}`); st != 503 || !strings.Contains(body, "serves no PD fleets") {
		t.Fatalf("%d %s", st, body)
	}
}

func TestModelStateUnavailable(t *testing.T) {
	for _, tc := range []struct {
		st   ModelState
		want string
	}{
		{ModelState{Regular: 2, LiveRegular: 1}, ""},
		{ModelState{Regular: 2}, `Model "m" has no live workers (all its workers are unhealthy or being drained)`},
		{ModelState{Prefill: 1, Decode: 2, LivePrefill: 1, LiveDecode: 1}, ""},
		{ModelState{Prefill: 1, Decode: 2}, `Model "m" has no live workers (prefill: 1 registered, decode: 2 registered, none healthy)`},
		{ModelState{Decode: 2, LiveDecode: 2}, `Model "m" has no prefill workers (2 decode registered): a PD model needs both roles`},
		{ModelState{Prefill: 3, LivePrefill: 1}, `Model "m" has no decode workers (3 prefill registered): a PD model needs both roles`},
		{ModelState{Prefill: 3, Decode: 1, LiveDecode: 1}, `Model "m" has no live prefill workers (3 registered, all unhealthy or being drained)`},
		{ModelState{Prefill: 3, Decode: 1, LivePrefill: 1}, `Model "m" has no live decode workers (1 registered, all unhealthy or being drained)`},
	} {
		if got := tc.st.Unavailable("m"); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.st, got, tc.want)
		}
	}
}

func TestModelSettingsAndLimit(t *testing.T) {
	e := newEnvWith(t, func(o *Options) {
		o.Models = map[string]ModelSettings{
			"m": {Policy: policy.NameRandom, MaxConcurrent: 2},
			"p": {PrefillPolicy: policy.NameRandom, DecodePolicy: policy.NameRoundRobin},
		}
	})
	if err := e.rt.SetPolicy("m", policy.NameCacheAware); err == nil || !strings.Contains(err.Error(), "takes its policies from the config file") {
		t.Fatalf("labels.policy against the config file: %v", err)
	}
	if err := e.rt.SetPolicy("m", policy.NameRandom); err != nil {
		t.Fatalf("labels.policy equal to the config file's: %v", err)
	}
	if err := e.rt.SetPolicy("p", policy.NameRandom); err == nil {
		t.Fatal("labels.policy accepted for a model whose config names its role policies")
	}
	if got := e.rt.Policy("m"); got != policy.NameRandom {
		t.Fatalf("policy of m: %q", got)
	}
	e.rt.mu.Lock()
	pp, dp := e.rt.pdPoliciesLocked("p")
	e.rt.mu.Unlock()
	if pp != policy.NameRandom || dp != policy.NameRoundRobin {
		t.Fatalf("PD policies of p: %s, %s", pp, dp)
	}

	release := make(chan struct{})
	var arrived atomic.Int32
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived.Add(1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
		_, _ = io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(slow.Close)
	t.Cleanup(func() { close(release) })
	e.add(t, slow.URL, "m")
	other := newWorker(t, "o")
	e.add(t, other.URL, "o")

	type result struct {
		st   int
		body string
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			st, body := e.post(t, `{"model":"m","prompt":"x"}`)
			results <- result{st, body}
		}()
	}
	waitCond(t, "the two requests at the worker", func() bool { return arrived.Load() == 2 })
	if st, body := e.post(t, `{"model":"m","prompt":"x"}`); st != 429 || !strings.Contains(body, `Model \"m\" is at its limit of 2 concurrent requests`) ||
		!strings.Contains(body, `"type":"RateLimitError"`) {
		t.Fatalf("third request: %d %s", st, body)
	}
	if st, _ := e.post(t, `{"model":"o","prompt":"x"}`); st != 200 {
		t.Fatalf("another model while m is full: %d", st)
	}
	if s := e.rt.Status()["m"]; s.InFlight != 2 || s.MaxConcurrent != 2 {
		t.Fatalf("status of m: %+v", s)
	}
	release <- struct{}{}
	release <- struct{}{}
	for range 2 {
		if r := <-results; r.st != 200 {
			t.Fatalf("held request: %d %s", r.st, r.body)
		}
	}
	// The slots are released after the responses were written.
	waitCond(t, "m's slots released", func() bool { return e.rt.Status()["m"].InFlight == 0 })
	if got := testutil.ToFloat64(e.rt.requests.WithLabelValues("m", "limited")); got != 1 {
		t.Fatalf("limited count %v", got)
	}
}

// waitCond polls cond until it holds, for at most 10 s.
func waitCond(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestPassthroughByModel: /tokenize and other non-generation paths go to
// the fleet of the model the body names (a PD model's prefill workers),
// with the body forwarded unchanged.
func TestPassthroughByModel(t *testing.T) {
	e := newEnvWith(t, func(o *Options) {
		o.NewPD = func(model string, pp, dp policy.Policy) (PDFleet, error) {
			return &fakePD{model: model, pp: pp, dp: dp, reg: o.Registry}, nil
		}
	})
	var gotBody atomic.Value
	echo := func(name string) *modelWorker {
		mw := &modelWorker{}
		mw.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mw.hits.Add(1)
			b, _ := io.ReadAll(r.Body)
			gotBody.Store(r.URL.Path + " " + string(b))
			_, _ = io.WriteString(w, `{"served_by":"`+name+`"}`)
		}))
		t.Cleanup(mw.Close)
		return mw
	}
	a, p, d := echo("a"), echo("p"), echo("d")
	e.add(t, a.URL, "chat")
	e.addRole(t, p.URL, "big", worker.RolePrefill)
	e.addRole(t, d.URL, "big", worker.RoleDecode)

	for _, tc := range []struct {
		path, body string
		status     int
		want       string
	}{
		{"/tokenize", `{"model":"chat", "prompt":"hi"}`, 200, `"a"`},
		{"/tokenize", `{"model":"big","prompt":"hi"}`, 200, `"p"`},
		{"/v1/score", `{"model":"big","text_1":"x"}`, 200, `"p"`},
		{"/tokenize", `{"prompt":"hi"}`, 400, "several models (big, chat)"},
		{"/tokenize", `not json`, 400, "model is required"},
		{"/tokenize", `{"model":"nope"}`, 404, "The model `nope` does not exist."},
	} {
		st, body := e.postTo(t, tc.path, tc.body)
		if st != tc.status || !strings.Contains(body, tc.want) {
			t.Errorf("%s %s: %d %s, want %d with %s", tc.path, tc.body, st, body, tc.status, tc.want)
		}
		if st == 200 {
			if got := gotBody.Load(); got != tc.path+" "+tc.body {
				t.Errorf("the worker got %q, want the body unchanged", got)
			}
		}
	}
	if d.hits.Load() != 0 {
		t.Fatalf("a PD model's passthrough reached its decode worker %d times", d.hits.Load())
	}
}

// A request naming a LoRA adapter goes to the fleet of the adapter's base
// model (SetAdapter), /tokenize too; once forgotten it is a 404 again.
func TestAdapterRoutesToItsBaseModel(t *testing.T) {
	e := newEnv(t)
	a, b := newWorker(t, "a"), newWorker(t, "b")
	e.add(t, a.URL, "model-a")
	e.add(t, b.URL, "model-b")
	e.rt.SetAdapter("sql", "model-b")
	for _, path := range []string{"/v1/completions", "/tokenize"} {
		if st, body := e.postTo(t, path, `{"model":"sql","prompt":"x"}`); st != 200 || !strings.Contains(body, `"b"`) {
			t.Fatalf("%s for the adapter: %d %s", path, st, body)
		}
	}
	if a.hits.Load() != 0 {
		t.Fatalf("model-a's worker got %d of the adapter's requests", a.hits.Load())
	}
	e.rt.SetAdapter("sql", "model-gone") // a base model no worker serves: as unknown
	if st, _ := e.post(t, `{"model":"sql","prompt":"x"}`); st != 404 {
		t.Fatalf("adapter of a model without workers: %d, want 404", st)
	}
	e.rt.SetAdapter("sql", "")
	if st, body := e.post(t, `{"model":"sql","prompt":"x"}`); st != 404 || !strings.Contains(body, "The model `sql` does not exist.") {
		t.Fatalf("forgotten adapter: %d %s", st, body)
	}
}

// TestAdapterOnSomeWorkers: an adapter listed by some workers of its model
// (engines started with --lora-modules) is routed to them while any is
// available, to the whole fleet otherwise, and to the whole fleet once it
// was loaded through the router (which gives it to every worker).
func TestAdapterOnSomeWorkers(t *testing.T) {
	e := newEnv(t)
	a, b, c := newWorker(t, "a"), newWorker(t, "b"), newWorker(t, "c")
	e.add(t, a.URL, "m")
	e.add(t, b.URL, "m")
	cw := e.add(t, c.URL, "m")
	send := func(model string, n int) (hits [3]int32) {
		t.Helper()
		before := [3]int32{a.hits.Load(), b.hits.Load(), c.hits.Load()}
		for range n {
			if st, body := e.post(t, `{"model":"`+model+`","prompt":"x"}`); st != 200 {
				t.Fatalf("%s: %d %s", model, st, body)
			}
		}
		return [3]int32{a.hits.Load() - before[0], b.hits.Load() - before[1], c.hits.Load() - before[2]}
	}
	e.rt.SetWorkerAdapters(c.URL, "m", []string{"tuned"})
	for _, step := range []struct {
		name  string
		do    func()
		model string
		want  [3]bool // which workers may get requests (all of them must, in 6)
	}{
		{"held by c", func() {}, "tuned", [3]bool{false, false, true}},
		{"the base model", func() {}, "m", [3]bool{true, true, true}},
		{"c unavailable", func() { cw.SetHealthy(false) }, "tuned", [3]bool{true, true, false}},
		{"c back, b lists it too", func() { cw.SetHealthy(true); e.rt.SetWorkerAdapters(b.URL, "m", []string{"tuned"}) }, "tuned", [3]bool{false, true, true}},
		{"loaded through the router", func() { e.rt.SetAdapter("tuned", "m") }, "tuned", [3]bool{true, true, true}},
		{"listed again after the load", func() { e.rt.SetWorkerAdapters(c.URL, "m", []string{"tuned"}) }, "tuned", [3]bool{true, true, true}},
		{"a second adapter on a", func() { e.rt.SetWorkerAdapters(a.URL, "m", []string{"solo"}) }, "solo", [3]bool{true, false, false}},
		{"b lists it instead of its others", func() { e.rt.SetWorkerAdapters(b.URL, "m", []string{"solo"}) }, "solo", [3]bool{true, true, false}},
		{"a no longer lists it", func() { e.rt.SetWorkerAdapters(a.URL, "m", nil) }, "solo", [3]bool{false, true, false}},
	} {
		step.do()
		got := send(step.model, 6)
		for i, may := range step.want {
			if may != (got[i] > 0) {
				t.Fatalf("%s: requests per worker %v, want on %v", step.name, got, step.want)
			}
		}
	}
	e.rt.SetWorkerAdapters(b.URL, "m", nil) // the last worker listing it
	if _, ok := e.rt.AdapterModel("solo"); ok {
		t.Fatal("an adapter no worker lists is still known")
	}
	if n := e.rt.narrowed.Load(); n != 0 {
		t.Fatalf("%d adapters counted as held by some workers only, want 0", n)
	}
	if _, ok := e.rt.AdapterModel("tuned"); !ok {
		t.Fatal("the adapter loaded through the router was forgotten with a worker's list")
	}
}

func TestAdapterGenApart(t *testing.T) {
	g := uint64(7)
	x, y := adapterGen(g, "x"), adapterGen(g, "y")
	if x == y || x == g || y == g || adapterGen(g+1, "x") == x || x>>63 != 1 {
		t.Fatalf("adapter generations %x %x (registry %d) are not apart", x, y, g)
	}
}

// TestUnknownModelLearnsAdapters: a request naming no known model has the
// workers' adapters read again (Options.LearnAdapters) before it is
// refused, so an adapter loaded on an engine directly is served from its
// first request; a name no worker lists is still a 404.
func TestUnknownModelLearnsAdapters(t *testing.T) {
	var e *env
	var bURL string
	var calls atomic.Int32
	var listed atomic.Value // the adapter "engine b" lists
	listed.Store("")
	e = newEnvWith(t, func(o *Options) {
		o.LearnAdapters = func(ctx context.Context) {
			calls.Add(1)
			if n := listed.Load().(string); n != "" {
				e.rt.SetWorkerAdapters(bURL, "m", []string{n})
			}
		}
	})
	a, b := newWorker(t, "a"), newWorker(t, "b")
	e.add(t, a.URL, "m")
	e.add(t, b.URL, "m")
	bURL = b.URL

	if st, _ := e.post(t, `{"model":"m","prompt":"x"}`); st != 200 || calls.Load() != 0 {
		t.Fatalf("base model: %d, %d adapter reads (want 200, none)", st, calls.Load())
	}
	st, body := e.post(t, `{"model":"direct","prompt":"x"}`)
	if st != 404 || !strings.Contains(body, "The model `direct` does not exist.") || calls.Load() != 1 {
		t.Fatalf("unlisted adapter: %d %s, %d adapter reads (want 404 after one)", st, body, calls.Load())
	}
	listed.Store("direct") // loaded on b's engine, not through the router
	before := b.hits.Load()
	for range 4 {
		if st, body := e.post(t, `{"model":"direct","prompt":"x"}`); st != 200 {
			t.Fatalf("adapter loaded on an engine directly: %d %s", st, body)
		}
	}
	if got := b.hits.Load() - before; got != 4 || calls.Load() != 2 {
		t.Fatalf("%d of 4 requests on the worker listing the adapter, %d adapter reads (want 4, 2)", got, calls.Load())
	}
}
