package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// loraEngine is an engine's LoRA surface as vLLM 0.32 serves it with
// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vllm/entrypoints/openai/models/
// serving.py): load and unload, /v1/models listing the adapters, and
// /health, which restart makes fail for a while and empties the adapters
// (a restarted engine has lost its run-time ones).
type loraEngine struct {
	*httptest.Server
	mu       sync.Mutex
	adapters map[string]string
	down     bool
}

func newLoRAEngine(t *testing.T) *loraEngine {
	e := &loraEngine{adapters: map[string]string{}}
	e.Server = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.Close)
	return e
}

func (e *loraEngine) serve(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var req struct {
		Name string `json:"lora_name"`
		Path string `json:"lora_path"`
	}
	if e.down { // restarting: nothing is served yet
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	switch r.URL.Path {
	case "/health":
	case "/v1/models":
		data := []map[string]any{{"id": "base", "object": "model"}}
		for n := range e.adapters {
			data = append(data, map[string]any{"id": n, "object": "model", "parent": "base"})
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
	case "/v1/completions":
		var c struct {
			Model string `json:"model"`
		}
		_ = json.NewDecoder(r.Body).Decode(&c)
		if c.Model != "base" && e.adapters[c.Model] == "" {
			w.WriteHeader(http.StatusNotFound)
			fmt.Fprintf(w, `{"error":{"message":"The model `+"`%s`"+` does not exist.","type":"NotFoundError","param":"model","code":404}}`, c.Model)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"model":%q,"choices":[{"index":0,"text":"ok","finish_reason":"length"}]}`, c.Model)
	case "/v1/load_lora_adapter":
		_ = json.NewDecoder(r.Body).Decode(&req)
		if e.adapters[req.Name] != "" {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprintf(w, `{"error":{"message":"The lora adapter '%s' has already been loaded.","type":"BadRequestError","param":null,"code":400}}`, req.Name)
			return
		}
		e.adapters[req.Name] = req.Path
		fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
	default:
		http.NotFound(w, r)
	}
}

func (e *loraEngine) has(name string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.adapters[name] != ""
}

func (e *loraEngine) setDown(down bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.down = down
	if down {
		e.adapters = map[string]string{}
	}
}

// A LoRA adapter loaded through the router reaches every worker; a worker
// added later is given it without a call, and an engine that restarts is
// given it before the router routes to it again.
func TestLoRAAdaptersFollowTheFleet(t *testing.T) {
	a, b, c := newLoRAEngine(t), newLoRAEngine(t), newLoRAEngine(t)
	r := startRouter(t, "--worker-urls", a.URL, b.URL, "--policy", "round_robin",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-success-threshold", "1")
	ctx := ctxT(t, 60*time.Second)

	st, _, body := post(t, ctx, r.Base+"/v1/load_lora_adapter", `{"lora_name": "sql", "lora_path": "/adapters/sql"}`)
	if st != 200 || string(body) != "Success: LoRA adapter 'sql' added successfully." {
		t.Fatalf("load: %d %s", st, body)
	}
	if !a.has("sql") || !b.has("sql") {
		t.Fatalf("adapter on a=%v b=%v, want both", a.has("sql"), b.has("sql"))
	}

	st, _, body = post(t, ctx, r.Base+"/add_worker?url="+c.URL, "")
	if st/100 != 2 {
		t.Fatalf("add_worker: %d %s", st, body)
	}
	// A new worker is routed at once; its adapter follows (queued).
	took := waitFor(t, 10*time.Second, "the added worker's adapter", func() bool { return c.has("sql") })
	t.Logf("added worker given the adapter after %v", took)

	b.setDown(true) // the engine restarts: unhealthy, its adapters gone
	waitFor(t, 20*time.Second, "the router to see the engine down", func() bool { return !healthy(t, r.Base, b.URL) })
	if b.has("sql") {
		t.Fatal("given back while down")
	}
	b.setDown(false)
	took = waitFor(t, 10*time.Second, "the restarted engine routed again", func() bool { return healthy(t, r.Base, b.URL) })
	if !b.has("sql") {
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
	a, b := newLoRAEngine(t), newLoRAEngine(t)
	r := startRouter(t, "--enable-igw", "--worker-urls", a.URL, b.URL, "--policy", "round_robin")
	ctx := ctxT(t, 60*time.Second)
	waitFor(t, 15*time.Second, "both workers in the model's fleet", func() bool {
		var v struct {
			Data []struct{ ID string } `json:"data"`
		}
		return getJSON(t, r.Base+"/v1/models", &v) == 200 && len(v.Data) == 1 && v.Data[0].ID == "base" && healthy(t, r.Base, a.URL) && healthy(t, r.Base, b.URL)
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
}
