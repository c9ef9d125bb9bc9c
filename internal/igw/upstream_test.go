package igw

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// fakeUpstream stands for an upstream.Backend.
type fakeUpstream struct{ hits atomic.Int32 }

func (f *fakeUpstream) Dispatch(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
	f.hits.Add(1)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"served_by":"upstream"}`)
}

func TestUpstreamModel(t *testing.T) {
	up := &fakeUpstream{}
	bc := worker.BreakerConfig{FailureThreshold: 1, OpenDuration: 3600e9, SuccessThreshold: 1}
	uw := worker.New(worker.Spec{URL: "https://api.example.com", DPRank: -1, ModelID: "gpt"}, bc)
	e := newEnvWith(t, func(o *Options) {
		o.Upstreams = map[string]Upstream{"gpt": {Dispatcher: up, Worker: uw}}
		o.Models = map[string]ModelSettings{"gpt": {MaxConcurrent: 4}}
	})

	// The only model: a request without "model" goes to it.
	if code, body := e.post(t, `{"prompt":"x"}`); code != 200 || !strings.Contains(body, "upstream") {
		t.Fatalf("no model, upstream only: %d %s", code, body)
	}
	a := newWorker(t, "a")
	e.add(t, a.URL, "llama")
	for _, tc := range []struct {
		body, want string
		code       int
	}{
		{`{"model":"gpt","prompt":"x"}`, "upstream", 200},
		{`{"model":"llama","prompt":"x"}`, `"served_by":"a"`, 200},
		{`{"prompt":"x"}`, "this router serves several models (gpt, llama)", 400},
		{`{"model":"nope","prompt":"x"}`, "The model `nope` does not exist.", 404},
	} {
		if code, body := e.post(t, tc.body); code != tc.code || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %s, want %d with %q", tc.body, code, body, tc.code, tc.want)
		}
	}
	if up.hits.Load() != 2 || a.hits.Load() != 1 {
		t.Fatalf("upstream hits %d (want 2), llama's worker %d (want 1)", up.hits.Load(), a.hits.Load())
	}
	if code, body := e.postTo(t, "/tokenize", `{"model":"gpt","prompt":"x"}`); code != 501 || !strings.Contains(body, `Model \"gpt\" is served by an OpenAI-compatible upstream, which has no /tokenize endpoint`) {
		t.Fatalf("/tokenize on the upstream model: %d %s", code, body)
	}

	st := e.rt.Status()["gpt"]
	if st.Kind != KindUpstream || st.Healthy != 1 || st.MaxConcurrent != 4 || len(st.Workers) != 1 || st.Workers[0] != uw.URL {
		t.Fatalf("Status gpt = %+v", st)
	}
	ids := func() []string {
		var out []string
		for _, m := range e.rt.ModelEntries() {
			var raw map[string]any
			if err := json.Unmarshal(m, &raw); err != nil {
				t.Fatal(err)
			}
			if raw["owned_by"] != "api.example.com" || raw["object"] != "model" {
				t.Fatalf("entry %s", m)
			}
			out = append(out, raw["id"].(string))
		}
		return out
	}
	if got := ids(); len(got) != 1 || got[0] != "gpt" {
		t.Fatalf("ModelEntries = %v", got)
	}
	// An open breaker takes the model off /v1/models and /workers' healthy.
	uw.Breaker().Record(false)
	if got := ids(); len(got) != 0 {
		t.Fatalf("ModelEntries with the breaker open = %v", got)
	}
	if st := e.rt.Status()["gpt"]; st.Healthy != 0 {
		t.Fatalf("Status with the breaker open = %+v", st)
	}
	// The upstream's model survives the registry's models coming and going.
	e.reg.Remove(a.URL)
	if code, body := e.post(t, `{"model":"gpt","prompt":"x"}`); code != 200 {
		t.Fatalf("after llama left: %d %s", code, body)
	}
}

func TestUpstreamNeedsDispatcherAndWorker(t *testing.T) {
	o := Options{Registry: worker.NewRegistry(worker.BreakerConfig{}), DefaultPolicy: "random",
		NewPolicy: func(string) (policy.Policy, error) { return nil, nil },
		Upstreams: map[string]Upstream{"gpt": {Dispatcher: &fakeUpstream{}}}}
	if _, err := New(o); err == nil || !strings.Contains(err.Error(), `upstream model "gpt" needs a Dispatcher and a Worker`) {
		t.Fatalf("New without the upstream's worker: %v", err)
	}
}

func TestReady(t *testing.T) {
	uw := worker.New(worker.Spec{URL: "https://api.example.com", DPRank: -1, ModelID: "gpt"}, worker.BreakerConfig{FailureThreshold: 1, OpenDuration: 3600e9, SuccessThreshold: 1})
	e := newEnv(t)
	if ok, why := e.rt.Ready(); ok || why != "no model is being served yet (no worker has registered)" {
		t.Fatalf("empty: %v %q", ok, why)
	}
	// A PD model alone, both roles live: ready (the server's regular-mode
	// readiness would count no regular worker).
	for _, role := range []worker.Role{worker.RolePrefill, worker.RoleDecode} {
		if _, err := e.reg.Add(worker.Spec{URL: "http://" + string(role) + ":1", Role: role, DPRank: -1, ModelID: "big"}); err != nil {
			t.Fatal(err)
		}
	}
	if ok, why := e.rt.Ready(); !ok {
		t.Fatalf("PD model with both roles: not ready: %q", why)
	}
	for _, w := range e.reg.Snapshot().All {
		if w.Role == worker.RoleDecode {
			w.SetHealthy(false)
		}
	}
	if ok, why := e.rt.Ready(); ok || !strings.Contains(why, `Model "big" has no live decode workers`) {
		t.Fatalf("PD model without a live decode: %v %q", ok, why)
	}
	// An upstream model: ready while its breaker is not open.
	e2 := newEnvWith(t, func(o *Options) { o.Upstreams = map[string]Upstream{"gpt": {Dispatcher: &fakeUpstream{}, Worker: uw}} })
	if ok, why := e2.rt.Ready(); !ok {
		t.Fatalf("upstream model: not ready: %q", why)
	}
	uw.Breaker().Record(false)
	if ok, why := e2.rt.Ready(); ok || !strings.Contains(why, `Model "gpt": its upstream https://api.example.com is failing (circuit breaker open)`) {
		t.Fatalf("upstream breaker open: %v %q", ok, why)
	}
}
