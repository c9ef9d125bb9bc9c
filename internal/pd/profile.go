package pd

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// profiler runs the per-request profiling hooks of one attempt
// (Options.Profile): start before a leg is sent, stop when its response
// arrives (or when the attempt ends). Debugging only.
type profiler struct {
	e       *Engine
	mu      sync.Mutex
	started map[*worker.Worker]bool
}

func (e *Engine) newProfiler(*Pair) *profiler {
	if !e.o.Profile {
		return nil
	}
	return &profiler{e: e, started: map[*worker.Worker]bool{}}
}

// start calls /start_profile synchronously (bounded by ProfileTimeout).
func (p *profiler) start(w *worker.Worker) {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.started[w] {
		p.mu.Unlock()
		return
	}
	p.started[w] = true
	p.mu.Unlock()
	p.e.profileCall(context.Background(), w, "start_profile")
}

// stop calls /stop_profile in the background.
func (p *profiler) stop(w *worker.Worker) {
	if p == nil {
		return
	}
	p.mu.Lock()
	if !p.started[w] {
		p.mu.Unlock()
		return
	}
	delete(p.started, w)
	p.mu.Unlock()
	p.e.bg.Add(1)
	go func() {
		defer p.e.bg.Done()
		p.e.profileCall(context.Background(), w, "stop_profile")
	}()
}

func (p *profiler) stopAll() {
	if p == nil {
		return
	}
	p.mu.Lock()
	var ws []*worker.Worker
	for w := range p.started {
		ws = append(ws, w)
	}
	p.mu.Unlock()
	for _, w := range ws {
		p.stop(w)
	}
}

func (e *Engine) profileCall(ctx context.Context, w *worker.Worker, action string) {
	ctx, cancel := context.WithTimeout(ctx, e.o.ProfileTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+"/"+action, nil)
	if err != nil {
		return
	}
	if e.o.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+e.o.APIKey)
	}
	resp, err := e.o.Client.Do(req)
	if err != nil {
		e.log.Warn("profile call failed", "worker", w.Key(), "action", action, "err", err)
		return
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		e.log.Warn("profile call failed", "worker", w.Key(), "action", action, "status", resp.StatusCode)
	}
}

// profileResult is one worker's answer in ServeProfile's aggregate.
type profileResult struct {
	Worker string `json:"worker"`
	Status int    `json:"status,omitempty"`
	Error  string `json:"error,omitempty"`

	body   []byte
	header http.Header
}

// ServeProfile fans action ("start_profile" or "stop_profile") out to every
// prefill and decode worker (once per base URL, in parallel, 60 s bound)
// with the client's body. It answers with the first successful JSON
// response in registry order, else an aggregate {"results": [...]} (200 if
// any worker succeeded, 502 if none did).
func (e *Engine) ServeProfile(w http.ResponseWriter, r *http.Request, action string) {
	if action != "start_profile" && action != "stop_profile" {
		openai.WriteError(w, http.StatusNotFound, "unknown profile action "+strconv.Quote(action))
		return
	}
	var body []byte
	if r.Body != nil {
		body, _ = io.ReadAll(io.LimitReader(r.Body, 1<<20))
	}
	urls := profileTargets(e.o.Registry.Snapshot())
	if len(urls) == 0 {
		openai.WriteError(w, http.StatusServiceUnavailable, "no prefill or decode workers registered")
		return
	}
	auth := ""
	switch {
	case e.o.APIKey != "":
		auth = "Bearer " + e.o.APIKey
	case e.o.ForwardClientAuth:
		auth = r.Header.Get("Authorization")
	}
	ctx, cancel := context.WithTimeout(r.Context(), 60*time.Second)
	defer cancel()
	results := make([]profileResult, len(urls))
	var wg sync.WaitGroup
	for i, u := range urls {
		wg.Go(func() { results[i] = e.profileOne(ctx, u, action, body, auth) })
	}
	wg.Wait()
	writeProfileAnswer(w, results)
}

// profileTargets are the prefill and decode workers' base URLs, once
// each, in registry order.
func profileTargets(snap *worker.Snapshot) []string {
	seen := map[string]bool{}
	var urls []string
	for _, ws := range [][]*worker.Worker{snap.Prefill, snap.Decode} {
		for _, wk := range ws {
			if !seen[wk.URL] {
				seen[wk.URL] = true
				urls = append(urls, wk.URL)
			}
		}
	}
	return urls
}

// profileOne posts action (with body, when there is one) to the worker at
// u.
func (e *Engine) profileOne(ctx context.Context, u, action string, body []byte, auth string) profileResult {
	res := profileResult{Worker: u}
	var rd io.Reader
	if len(body) > 0 {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u+"/"+action, rd)
	if err != nil {
		res.Error = err.Error()
		return res
	}
	if len(body) > 0 {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := e.o.Client.Do(req)
	if err != nil {
		res.Error = unwrapURL(err).Error()
		return res
	}
	res.body, _ = io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	res.Status, res.header = resp.StatusCode, resp.Header
	if resp.StatusCode/100 != 2 {
		res.Error = fmt.Sprintf("HTTP %d: %s", resp.StatusCode, snippet(res.body))
	}
	return res
}

// writeProfileAnswer answers with the first successful JSON response,
// else the aggregate of every result (200 when one succeeded, else 502).
func writeProfileAnswer(w http.ResponseWriter, results []profileResult) {
	okAny := false
	for _, res := range results {
		if res.Error != "" {
			continue
		}
		okAny = true
		if json.Valid(res.body) && len(bytes.TrimSpace(res.body)) > 0 {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Content-Length", strconv.Itoa(len(res.body)))
			w.WriteHeader(res.Status)
			_, _ = w.Write(res.body)
			return
		}
	}
	status := http.StatusOK
	if !okAny {
		status = http.StatusBadGateway
	}
	b, _ := json.Marshal(struct {
		Results []profileResult `json:"results"`
	}{results})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
