package server

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// LoRA adapters loaded at run time. vLLM serves POST /v1/load_lora_adapter
// and /v1/unload_lora_adapter when started with
// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (vllm/entrypoints/serve/lora,
// vLLM 0.32). Relayed to one worker, as any other path, a load would reach
// one engine of the fleet, and requests naming the adapter would fail on
// the others; in PD mode both legs of a request need it. So the router
// sends both calls to every worker of every role, and remembers what was
// loaded: a worker that joins later, or comes back healthy (a restarted
// engine has lost its run-time adapters), is given them again before it
// is routed (PrepareLoRA, from the health checker; the app holds a joining
// worker until then), and every worker is checked at each reconcile
// interval (RunLoRASync).

const (
	loraLoadPath   = "/v1/load_lora_adapter"
	loraUnloadPath = "/v1/unload_lora_adapter"
	loraAnswerMax  = 64 << 10 // a worker's answer kept for the client
	// loraListTimeout bounds a sync's /v1/models call (a load is bounded
	// by the upstream timeout: an engine may take seconds to read one).
	loraListTimeout = 10 * time.Second
)

// loraAnswer is one worker's answer to a load or unload.
type loraAnswer struct {
	url    string
	status int    // 0: no answer
	ctype  string // its Content-Type
	body   []byte
	err    error
}

func (a loraAnswer) ok() bool { return a.err == nil && a.status >= 200 && a.status < 300 }

// describe is the answer in a line: the status and the engine's message.
func (a loraAnswer) describe() string {
	if a.err != nil {
		return a.url + ": " + a.err.Error()
	}
	msg := strings.TrimSpace(string(a.body))
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
		Detail any `json:"detail"` // FastAPI's own errors (a route vLLM did not attach)
	}
	if json.Unmarshal(a.body, &e) == nil {
		if d, ok := e.Detail.(string); ok && d != "" {
			msg = d
		}
		if e.Error.Message != "" {
			msg = e.Error.Message
		}
	}
	return a.url + ": " + strconv.Itoa(a.status) + " " + msg
}

// loraSet is the adapters loaded through the router: name → the load
// request's body, as the client sent it, and the models of the workers
// that took it.
type loraSet struct {
	mu     sync.Mutex
	bodies map[string][]byte
	models map[string][]string
	order  []string // load order
}

func newLoRASet() *loraSet {
	return &loraSet{bodies: map[string][]byte{}, models: map[string][]string{}}
}

func (l *loraSet) remember(name string, body []byte, models []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.bodies[name]; !ok {
		l.order = append(l.order, name)
	}
	l.bodies[name] = bytes.Clone(body)
	l.models[name] = models
}

func (l *loraSet) forget(name string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.bodies, name)
	delete(l.models, name)
	for i, n := range l.order {
		if n == name {
			l.order = append(l.order[:i:i], l.order[i+1:]...)
			break
		}
	}
}

// any reports whether an adapter is remembered.
func (l *loraSet) any() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.order) > 0
}

// adapters returns the remembered adapters' names and bodies, in load
// order: all of them, or with model != "" those that workers of model took.
func (l *loraSet) adapters(model string) (names []string, bodies [][]byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, n := range l.order {
		if model == "" || slices.Contains(l.models[n], model) {
			names = append(names, n)
			bodies = append(bodies, l.bodies[n])
		}
	}
	return names, bodies
}

// loraStatus is a remembered adapter as /workers shows it.
type loraStatus struct {
	Name   string   `json:"name"`
	Models []string `json:"models"` // of the workers that took it
}

// status lists the remembered adapters, in load order.
func (l *loraSet) status() []loraStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]loraStatus, 0, len(l.order))
	for _, n := range l.order {
		out = append(out, loraStatus{Name: n, Models: l.models[n]})
	}
	return out
}

// loraName is the lora_name of a load or unload body ("" if none).
func loraName(body []byte) string {
	var v struct {
		Name string `json:"lora_name"`
	}
	_ = json.Unmarshal(body, &v)
	return v.Name
}

// handleLoRA serves a load (or an unload) by sending it to every worker.
func (s *Server) handleLoRA(path string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, ok := s.readBody(w, r)
		if !ok {
			return
		}
		urls := s.allInstances()
		if len(urls) == 0 {
			s.writeError(w, r, http.StatusServiceUnavailable, "no_available_workers", "No workers available")
			return
		}
		// Not cancelled with the client: a load half done would leave the
		// fleet split (each call is bounded by the upstream timeout).
		ctx := context.WithoutCancel(r.Context())
		answers := make([]loraAnswer, len(urls))
		eachWorker(urls, func(i int, u string) { answers[i] = s.postLoRA(ctx, r, u, path, body) })
		s.noteLoRA(path, loraName(body), body, answers)
		s.writeLoRA(w, r, path, answers)
	}
}

// postLoRA POSTs body to one worker's path and reads its answer.
func (s *Server) postLoRA(ctx context.Context, in *http.Request, base, path string, body []byte) loraAnswer {
	a := loraAnswer{url: base}
	ctx, cancel := context.WithTimeout(ctx, s.o.UpstreamTimeout)
	defer cancel()
	req, err := s.newUpstreamRequest(ctx, in, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		a.err = err
		return a
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.client.Do(req)
	if err != nil {
		a.err = err
		return a
	}
	defer resp.Body.Close()
	a.status, a.ctype = resp.StatusCode, resp.Header.Get("Content-Type")
	a.body, a.err = io.ReadAll(io.LimitReader(resp.Body, loraAnswerMax))
	return a
}

// noteLoRA updates the remembered adapters: a load that some worker took
// is remembered, with the models of the workers that took it (the others
// are given it when they come back or at the next reconcile); an unload
// that no worker refused is forgotten.
func (s *Server) noteLoRA(path, name string, body []byte, answers []loraAnswer) {
	if name == "" {
		return
	}
	switch path {
	case loraLoadPath:
		models := s.modelsOf(answers)
		if len(models) == 0 {
			return // no worker took it
		}
		s.lora.remember(name, body, models)
		s.countAdapters()
		s.log.Info("LoRA adapter loaded", "lora_name", name, "workers", len(answers), "models", models)
		if s.o.LoRAChanged != nil {
			s.o.LoRAChanged(name, models)
		}
	case loraUnloadPath:
		for _, a := range answers {
			if !a.ok() && a.status != http.StatusNotFound {
				return
			}
		}
		s.lora.forget(name)
		s.countAdapters()
		if s.o.LoRAChanged != nil {
			s.o.LoRAChanged(name, nil)
		}
	}
}

// modelsOf is the model ids (sorted, each once) of the workers that
// answered 2xx.
func (s *Server) modelsOf(answers []loraAnswer) []string {
	took := map[string]bool{}
	for _, a := range answers {
		if a.ok() {
			took[a.url] = true
		}
	}
	var models []string
	for _, w := range s.reg.Snapshot().All {
		if took[w.URL] && !slices.Contains(models, w.ModelID) {
			models = append(models, w.ModelID)
		}
	}
	slices.Sort(models)
	return models
}

// writeLoRA answers as one engine would when every worker succeeded or
// answered alike: the first one's status and body. Otherwise, with the first failure's status, an
// error naming every worker that did not succeed.
func (s *Server) writeLoRA(w http.ResponseWriter, r *http.Request, path string, answers []loraAnswer) {
	first := answers[0]
	same, allOK := first.err == nil, true
	for _, a := range answers {
		same = same && a.err == nil && a.status == first.status
		allOK = allOK && a.ok()
	}
	if same || allOK {
		if first.ctype != "" {
			w.Header().Set("Content-Type", first.ctype)
		}
		w.WriteHeader(first.status)
		_, _ = w.Write(first.body)
		return
	}
	var failed []string
	status := 0
	for _, a := range answers {
		if a.ok() {
			continue
		}
		failed = append(failed, a.describe())
		if status == 0 {
			status = a.status
		}
	}
	if status == 0 {
		status = http.StatusBadGateway // no answer from the failed workers
	}
	what := "load"
	if path == loraUnloadPath {
		what = "unload"
	}
	s.writeError(w, r, status, "lora_"+what+"_failed", "LoRA adapter "+what+" failed on "+strconv.Itoa(len(failed))+
		" of "+strconv.Itoa(len(answers))+" workers: ["+strings.Join(failed, "; ")+"]")
}

// HasLoRA reports whether adapters loaded through the router are
// remembered.
func (s *Server) HasLoRA() bool { return s.lora.any() }

// PrepareLoRA gives a worker the remembered adapters it lacks and returns
// when it has (or the loads failed): the health checker runs it before a
// returning worker is routed again.
func (s *Server) PrepareLoRA(ctx context.Context, url string) {
	if s.lora.any() {
		s.syncWorkerLoRA(ctx, url)
	}
}

// RunLoRASync gives every healthy worker the remembered adapters it
// lacks, every interval, until ctx ends (every <= 0: it only waits): an
// engine restarted between two health probes has lost its adapters
// without ever looking unhealthy.
func (s *Server) RunLoRASync(ctx context.Context, every time.Duration) {
	if every <= 0 {
		<-ctx.Done()
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !s.lora.any() {
			continue
		}
		// The healthy ones: a returning one is prepared before it is.
		for _, u := range instanceURLs(s.reg.Snapshot(), true, worker.RolePrefill, worker.RoleDecode, worker.RoleRegular) {
			if ctx.Err() != nil {
				return
			}
			s.syncWorkerLoRA(ctx, u)
		}
	}
}

// syncWorkerLoRA loads on one worker each remembered adapter its
// /v1/models does not list (with LoRAByModel, those of its model).
func (s *Server) syncWorkerLoRA(ctx context.Context, url string) {
	model := ""
	if s.o.LoRAByModel {
		ws := s.lookup(url)
		if len(ws) == 0 {
			return // gone
		}
		model = ws[0].ModelID
	}
	names, bodies := s.lora.adapters(model)
	if len(names) == 0 {
		return
	}
	var list modelList
	lctx, cancel := context.WithTimeout(ctx, min(s.o.UpstreamTimeout, loraListTimeout))
	_, err := s.getJSON(lctx, nil, url+"/v1/models", &list)
	cancel()
	if err != nil {
		s.log.Warn("LoRA adapter sync: cannot list the worker's models", "url", url, "err", err)
		return
	}
	have := map[string]bool{}
	for _, m := range list.Data {
		have[modelID(m)] = true
	}
	for i, name := range names {
		if have[name] {
			continue
		}
		a := s.postLoRA(ctx, nil, url, loraLoadPath, bodies[i])
		if !a.ok() {
			s.countGiven("failed")
			s.log.Warn("LoRA adapter sync: load failed", "lora_name", name, "answer", a.describe())
			continue
		}
		s.countGiven("loaded")
		s.log.Info("LoRA adapter loaded on a worker that lacked it", "lora_name", name, "url", url)
	}
}

func (s *Server) countGiven(outcome string) {
	if s.m != nil {
		s.m.LoRAGiven.WithLabelValues(outcome).Inc()
	}
}

func (s *Server) countAdapters() {
	if s.m != nil {
		names, _ := s.lora.adapters("")
		s.m.LoRAAdapters.Set(float64(len(names)))
	}
}
