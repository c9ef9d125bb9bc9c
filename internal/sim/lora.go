package sim

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
)

// LoRAModule is one --lora-modules entry: an adapter the engine serves
// from its start, under its name.
type LoRAModule struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// loraModulesFlag is --lora-modules: vLLM's "name=path" entries (several
// per occurrence, space-separated, or one JSON object {"name", "path"}),
// appended across occurrences.
type loraModulesFlag struct{ mods *[]LoRAModule }

func (f loraModulesFlag) String() string {
	if f.mods == nil {
		return ""
	}
	var parts []string
	for _, m := range *f.mods {
		parts = append(parts, m.Name+"="+m.Path)
	}
	return strings.Join(parts, " ")
}

func (f loraModulesFlag) Set(v string) error {
	v = strings.TrimSpace(v)
	if strings.HasPrefix(v, "{") {
		var m LoRAModule
		if err := json.Unmarshal([]byte(v), &m); err != nil || m.Name == "" || m.Path == "" {
			return fmt.Errorf("%q: a JSON entry needs \"name\" and \"path\"", v)
		}
		*f.mods = append(*f.mods, m)
		return nil
	}
	for e := range strings.FieldsSeq(v) {
		name, path, ok := strings.Cut(e, "=")
		if !ok || name == "" || path == "" {
			return fmt.Errorf("%q: want name=path", e)
		}
		*f.mods = append(*f.mods, LoRAModule{Name: name, Path: path})
	}
	return nil
}

// loraAdapter is one adapter the engine holds.
type loraAdapter struct {
	name, path string
	id         int // vLLM's lora_int_id: 1, 2, … in the order they were added
}

// loraSet is the engine's LoRA adapters: --lora-modules, then those loaded
// at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), as vLLM 0.32's
// OpenAIServingModels holds them (entrypoints/openai/models/serving.py).
type loraSet struct {
	mu     sync.RWMutex
	byName map[string]*loraAdapter
	order  []string // /v1/models lists them in the order they were added
	nextID int
}

func newLoRASet(mods []LoRAModule) *loraSet {
	s := &loraSet{byName: map[string]*loraAdapter{}}
	for _, m := range mods {
		s.add(m.Name, m.Path)
	}
	return s
}

// add holds a new adapter (the caller checked it is new).
func (s *loraSet) add(name, path string) {
	s.nextID++
	s.byName[name] = &loraAdapter{name: name, path: path, id: s.nextID}
	s.order = append(s.order, name)
}

// get returns the adapter named name.
func (s *loraSet) get(name string) (loraAdapter, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	a := s.byName[name]
	if a == nil {
		return loraAdapter{}, false
	}
	return *a, true
}

// list returns the adapters in the order they were added.
func (s *loraSet) list() []loraAdapter {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]loraAdapter, 0, len(s.order))
	for _, n := range s.order {
		out = append(out, *s.byName[n])
	}
	return out
}

// loraRequest is the body of /v1/load_lora_adapter and
// /v1/unload_lora_adapter (vLLM's LoadLoRAAdapterRequest).
type loraRequest struct {
	Name        string `json:"lora_name"`
	Path        string `json:"lora_path"`
	LoadInplace bool   `json:"load_inplace"`
}

// readLoRARequest reads a load or unload body; one that is not that
// object is a 400, as vLLM answers a request that fails validation.
func (in *Instance) readLoRARequest(w http.ResponseWriter, r *http.Request) (loraRequest, bool) {
	var req loraRequest
	b, err := io.ReadAll(io.LimitReader(r.Body, maxBodyBytes))
	if err == nil {
		err = json.Unmarshal(b, &req)
	}
	if err != nil {
		in.writeError(w, &apiError{status: http.StatusBadRequest, typ: "BadRequestError", message: "invalid LoRA adapter request: " + err.Error()})
		return req, false
	}
	return req, true
}

// handleLoadLoRA is vLLM 0.32's POST /v1/load_lora_adapter
// (OpenAIServingModels.load_lora_adapter and its request check): 200 and a
// plain-text line on success; 400 InvalidUserInput for a missing field, the
// base model's name, or an adapter already loaded (unless load_inplace:
// then the same id); 500 when the engine refuses it (one without
// --enable-lora: the model runner's RuntimeError).
func (in *Instance) handleLoadLoRA(w http.ResponseWriter, r *http.Request) {
	req, ok := in.readLoRARequest(w, r)
	if !ok {
		return
	}
	bad := func(msg string) {
		in.writeError(w, &apiError{status: http.StatusBadRequest, typ: "InvalidUserInput", message: msg})
	}
	if req.Name == "" || req.Path == "" {
		bad("Both 'lora_name' and 'lora_path' must be provided.")
		return
	}
	if req.Name == in.cfg.Model {
		bad(fmt.Sprintf("The lora adapter '%s' conflicts with a served base model.", req.Name))
		return
	}
	s := in.lora
	s.mu.Lock()
	a := s.byName[req.Name]
	if a != nil && !req.LoadInplace {
		s.mu.Unlock()
		bad(fmt.Sprintf("The lora adapter '%s' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.", req.Name))
		return
	}
	if !in.cfg.EnableLoRA {
		s.mu.Unlock()
		in.writeError(w, &apiError{status: http.StatusInternalServerError, typ: "InternalServerError",
			message: "LoRA is not enabled. Use --enable-lora to enable LoRA."})
		return
	}
	if a == nil {
		s.add(req.Name, req.Path)
	} else {
		a.path = req.Path // reloaded in place: same name and id
	}
	s.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", req.Name)
}

// handleUnloadLoRA is vLLM 0.32's POST /v1/unload_lora_adapter: 200 and a
// plain-text line, 400 InvalidUserInput without a name, 404 NotFoundError
// for an adapter it does not hold. The adapter's cached blocks stay until evicted, as vLLM's do.
func (in *Instance) handleUnloadLoRA(w http.ResponseWriter, r *http.Request) {
	req, ok := in.readLoRARequest(w, r)
	if !ok {
		return
	}
	if req.Name == "" {
		in.writeError(w, &apiError{status: http.StatusBadRequest, typ: "InvalidUserInput", message: "'lora_name' needs to be provided to unload a LoRA adapter."})
		return
	}
	s := in.lora
	s.mu.Lock()
	_, held := s.byName[req.Name]
	if held {
		delete(s.byName, req.Name)
		s.order = slices.DeleteFunc(s.order, func(n string) bool { return n == req.Name })
	}
	s.mu.Unlock()
	if !held {
		in.writeError(w, &apiError{status: http.StatusNotFound, typ: "NotFoundError", message: fmt.Sprintf("The lora adapter '%s' cannot be found.", req.Name)})
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", req.Name)
}
