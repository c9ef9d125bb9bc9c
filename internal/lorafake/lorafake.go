// Package lorafake is a vLLM engine's run-time LoRA surface for tests: what
// vLLM 0.32 serves with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
// (vllm/entrypoints/openai/models/serving.py and serve/lora/api_router.py).
// POST /v1/load_lora_adapter answers 200 and a plain-text success line, 400
// for a missing field or an adapter already loaded; /v1/unload_lora_adapter
// 200, or 404 for an adapter it does not hold; /v1/models lists the base
// model and each adapter with it as parent; /v1/completions serves the base
// model and the loaded adapters (vLLM's 404 for another model). Without
// run-time updating (Disabled) the two routes do not exist: FastAPI's 404.
// A Down engine (restarting) answers 503 to everything.
package lorafake

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/openai"
)

// Base is the model the engine serves.
const Base = "base"

// Engine is one fake engine on a real loopback listener.
type Engine struct {
	*httptest.Server
	mu       sync.Mutex
	adapters map[string]string // name → path
	loads    int               // load calls received
	requests int               // every call received
	disabled bool
	down     bool
}

// New starts an engine, closed when t ends.
func New(t testing.TB) *Engine {
	t.Helper()
	e := &Engine{adapters: map[string]string{}}
	e.Server = httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(e.Close)
	return e
}

func (e *Engine) serve(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.requests++
	if e.down {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	var req struct {
		Name  string `json:"lora_name"`
		Path  string `json:"lora_path"`
		Model string `json:"model"`
	}
	switch r.URL.Path {
	case "/health":
	case "/v1/models":
		data := []map[string]any{{"id": Base, "object": "model", "parent": nil}}
		for n, p := range e.adapters {
			data = append(data, map[string]any{"id": n, "object": "model", "root": p, "parent": Base})
		}
		writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
	case "/v1/completions":
		_ = json.NewDecoder(r.Body).Decode(&req)
		if req.Model != Base && e.adapters[req.Model] == "" {
			writeError(w, http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", req.Model))
			return
		}
		writeJSON(w, http.StatusOK, map[string]any{"model": req.Model,
			"choices": []map[string]any{{"index": 0, "text": "ok", "finish_reason": "length"}}})
	case "/v1/load_lora_adapter", "/v1/unload_lora_adapter":
		if e.disabled {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			_, _ = io.WriteString(w, `{"detail":"Not Found"}`)
			return
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		if r.URL.Path == "/v1/load_lora_adapter" {
			e.load(w, req.Name, req.Path)
		} else {
			e.unload(w, req.Name)
		}
	default:
		http.NotFound(w, r)
	}
}

func (e *Engine) load(w http.ResponseWriter, name, path string) {
	e.loads++
	switch {
	case name == "" || path == "":
		writeError(w, http.StatusBadRequest, "Both 'lora_name' and 'lora_path' must be provided.")
	case e.adapters[name] != "":
		writeError(w, http.StatusBadRequest, fmt.Sprintf("The lora adapter '%s' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.", name))
	default:
		e.adapters[name] = path
		fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", name)
	}
}

func (e *Engine) unload(w http.ResponseWriter, name string) {
	if e.adapters[name] == "" {
		writeError(w, http.StatusNotFound, fmt.Sprintf("The lora adapter '%s' cannot be found.", name))
		return
	}
	delete(e.adapters, name)
	fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", name)
}

// writeError writes vLLM's error body.
func writeError(w http.ResponseWriter, status int, msg string) { openai.WriteError(w, status, msg) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// Has reports whether the engine holds adapter name.
func (e *Engine) Has(name string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.adapters[name] != ""
}

// Preload gives the engine an adapter, as its --lora-modules would.
func (e *Engine) Preload(name, path string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.adapters[name] = path
}

// Loads is the number of load calls received.
func (e *Engine) Loads() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.loads
}

// Requests is the number of calls received.
func (e *Engine) Requests() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.requests
}

// SetDisabled removes (or restores) the load and unload routes.
func (e *Engine) SetDisabled(off bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.disabled = off
}

// Restart forgets the run-time adapters, as a restarted engine has; down
// keeps it answering 503 until SetDown(false).
func (e *Engine) Restart(down bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.adapters = map[string]string{}
	e.down = down
}

// SetDown makes the engine answer 503 to everything (or serve again).
func (e *Engine) SetDown(down bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.down = down
}
