package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/lorafake"
)

// A LoRA adapter loaded through the router reaches every worker; a worker
// added later, and an engine that restarts, are given it without a call,
// before the router routes to them.
func TestLoRAAdaptersFollowTheFleet(t *testing.T) {
	a, b, c := lorafake.New(t), lorafake.New(t), lorafake.New(t)
	r := startRouter(t, "--worker-urls", a.URL, b.URL, "--policy", "round_robin",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1")
	ctx := ctxT(t, 60*time.Second)

	st, _, body := post(t, ctx, r.Base+"/v1/load_lora_adapter", `{"lora_name": "sql", "lora_path": "/adapters/sql"}`)
	if st != 200 || string(body) != "Success: LoRA adapter 'sql' added successfully." {
		t.Fatalf("load: %d %s", st, body)
	}
	if !a.Has("sql") || !b.Has("sql") {
		t.Fatalf("adapter on a=%v b=%v, want both", a.Has("sql"), b.Has("sql"))
	}

	st, _, body = post(t, ctx, r.Base+"/add_worker?url="+c.URL, "")
	if st/100 != 2 {
		t.Fatalf("add_worker: %d %s", st, body)
	}
	took := waitFor(t, 10*time.Second, "the added worker routed", func() bool { return healthy(t, r.Base, c.URL) })
	if !c.Has("sql") {
		t.Fatal("the added worker was routed before it had the adapter")
	}
	t.Logf("added worker routed, with the adapter, after %v", took)

	b.Restart(true) // the engine restarts: unhealthy, its adapters gone
	waitFor(t, 20*time.Second, "the router to see the engine down", func() bool { return !healthy(t, r.Base, b.URL) })
	if b.Has("sql") {
		t.Fatal("given back while down")
	}
	b.SetDown(false)
	took = waitFor(t, 10*time.Second, "the restarted engine routed again", func() bool { return healthy(t, r.Base, b.URL) })
	if !b.Has("sql") {
		t.Fatal("the restarted engine was routed again before it had the adapter")
	}
	t.Logf("restarted engine routed again, with the adapter, %v after it answered", took)

	st, _, body = post(t, ctx, r.Base+"/v1/load_lora_adapter", `{"lora_name": "sql", "lora_path": "/adapters/sql"}`)
	if st != 400 || !strings.Contains(string(body), "has already been loaded") {
		t.Fatalf("second load: %d %s, want every engine's 400", st, body)
	}
}

// healthy reports what the router's /workers says of url's health.
func healthy(t *testing.T, base, url string) bool {
	var v struct {
		Workers []struct {
			URL       string `json:"url"`
			IsHealthy bool   `json:"is_healthy"`
		} `json:"workers"`
	}
	getJSON(t, base+"/workers", &v)
	for _, w := range v.Workers {
		if w.URL == url {
			return w.IsHealthy
		}
	}
	t.Fatalf("%s not in /workers", url)
	return false
}

// With --enable-igw a request naming an adapter loaded through the router
// goes to the fleet of the model whose workers took it; before the load
// the router does not know the name.
func TestLoRAAdapterRoutedByIGW(t *testing.T) {
	a, b := lorafake.New(t), lorafake.New(t)
	r := startRouter(t, "--enable-igw", "--worker-urls", a.URL, b.URL, "--policy", "round_robin",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1")
	ctx := ctxT(t, 60*time.Second)
	waitFor(t, 15*time.Second, "both workers in the model's fleet", func() bool {
		var v struct {
			Data []struct{ ID string } `json:"data"`
		}
		return getJSON(t, r.Base+"/v1/models", &v) == 200 && len(v.Data) == 1 && v.Data[0].ID == lorafake.Base && healthy(t, r.Base, a.URL) && healthy(t, r.Base, b.URL)
	})
	req := `{"model": "sql", "prompt": "x", "max_tokens": 1}`
	if st, _, body := post(t, ctx, r.Base+"/v1/completions", req); st != 404 || !strings.Contains(string(body), "The model `sql` does not exist.") {
		t.Fatalf("before the load: %d %s", st, body)
	}
	if st, _, body := post(t, ctx, r.Base+"/v1/load_lora_adapter", `{"lora_name": "sql", "lora_path": "/adapters/sql"}`); st != 200 {
		t.Fatalf("load: %d %s", st, body)
	}
	for range 4 { // round robin: both workers
		if st, _, body := post(t, ctx, r.Base+"/v1/completions", req); st != 200 || !strings.Contains(string(body), `"model":"sql"`) {
			t.Fatalf("after the load: %d %s", st, body)
		}
	}
	// A worker added with its model named, whose engine was started with
	// an adapter (vLLM's --lora-modules): its /v1/models is still read for
	// the adapters.
	c := lorafake.New(t)
	c.Preload("tuned", "/adapters/tuned")
	if st, _, body := post(t, ctx, r.Base+"/workers", fmt.Sprintf(`{"url":%q,"model_id":%q,"worker_type":"regular"}`, c.URL, lorafake.Base)); st != 200 {
		t.Fatalf("add_worker: %d %s", st, body)
	}
	waitFor(t, 10*time.Second, "the added worker routed", func() bool { return healthy(t, r.Base, c.URL) })
	for range 4 { // round robin over the model's three workers: only c holds it
		if st, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model": "tuned", "prompt": "x", "max_tokens": 1}`); st != 200 || !strings.Contains(string(body), `"model":"tuned"`) {
			t.Fatalf("the added worker's own adapter: %d %s", st, body)
		}
	}
	if !c.Has("sql") {
		t.Fatal("the added worker lacks the adapter loaded through the router")
	}
	// Its engine restarts with another adapter instead: read again before
	// it is routed.
	c.Restart(true)
	waitFor(t, 20*time.Second, "the router to see the engine down", func() bool { return !healthy(t, r.Base, c.URL) })
	c.Preload("other", "/adapters/other")
	c.SetDown(false)
	waitFor(t, 20*time.Second, "the engine routed again", func() bool { return healthy(t, r.Base, c.URL) })
	for range 3 {
		if st, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model": "other", "prompt": "x", "max_tokens": 1}`); st != 200 || !strings.Contains(string(body), `"model":"other"`) {
			t.Fatalf("the restarted worker's new adapter: %d %s", st, body)
		}
	}
	if st, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model": "tuned", "prompt": "x", "max_tokens": 1}`); st != 404 || !strings.Contains(string(body), "The model `tuned` does not exist.") {
		t.Fatalf("the adapter no worker lists any more: %d %s", st, body)
	}
	// An adapter loaded on an engine directly, not through the router, is
	// served from its first request (the workers' lists are read again
	// for a model the router does not know).
	direct := `{"model": "direct", "prompt": "x", "max_tokens": 1}`
	if st, _, body := post(t, ctx, c.URL+"/v1/load_lora_adapter", `{"lora_name": "direct", "lora_path": "/adapters/direct"}`); st != 200 {
		t.Fatalf("load on the engine: %d %s", st, body)
	}
	for range 3 {
		if st, _, body := post(t, ctx, r.Base+"/v1/completions", direct); st != 200 || !strings.Contains(string(body), `"model":"direct"`) {
			t.Fatalf("an adapter loaded on the engine directly: %d %s", st, body)
		}
	}
	// Moved to another engine directly: followed on the next health probe
	// of each (every second here), with no engine restarting.
	if st, _, body := post(t, ctx, c.URL+"/v1/unload_lora_adapter", `{"lora_name": "direct"}`); st != 200 {
		t.Fatalf("unload on the engine: %d %s", st, body)
	}
	if st, _, body := post(t, ctx, a.URL+"/v1/load_lora_adapter", `{"lora_name": "direct", "lora_path": "/adapters/direct"}`); st != 200 {
		t.Fatalf("load on the other engine: %d %s", st, body)
	}
	waitFor(t, 10*time.Second, "the adapter's requests to follow it", func() bool {
		for range 3 {
			if st, _, _ := post(t, ctx, r.Base+"/v1/completions", direct); st != 200 {
				return false
			}
		}
		return true
	})
}
