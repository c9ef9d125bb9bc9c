package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

const maxBodyBytes = 64 << 20

// route is one path with its allowed methods.
type route struct {
	methods map[string]http.HandlerFunc
}

func (in *Instance) routes() http.Handler {
	table := map[string]route{
		"/v1/completions":      {map[string]http.HandlerFunc{http.MethodPost: in.handleGenerate(apiCompletions)}},
		"/v1/chat/completions": {map[string]http.HandlerFunc{http.MethodPost: in.handleGenerate(apiChat)}},
		"/v1/responses":        {map[string]http.HandlerFunc{http.MethodPost: in.handleGenerate(apiResponses)}},
		"/v1/models":           {map[string]http.HandlerFunc{http.MethodGet: in.handleModels}},
		"/health":              {map[string]http.HandlerFunc{http.MethodGet: in.handleHealth}},
		"/load":                {map[string]http.HandlerFunc{http.MethodGet: in.handleLoad}},
		"/tokenize":            {map[string]http.HandlerFunc{http.MethodPost: in.handleTokenize}},
		"/detokenize":          {map[string]http.HandlerFunc{http.MethodPost: in.handleDetokenize}},
		"/start_profile":       {map[string]http.HandlerFunc{http.MethodPost: in.handleProfile(true)}},
		"/stop_profile":        {map[string]http.HandlerFunc{http.MethodPost: in.handleProfile(false)}},
		"/metrics":             {map[string]http.HandlerFunc{http.MethodGet: in.handleMetrics}},
		"/sim/stats":           {map[string]http.HandlerFunc{http.MethodGet: in.handleStats}},
		"/reset_prefix_cache":  {map[string]http.HandlerFunc{http.MethodPost: in.handleResetPrefixCache}},
		"/sim/faults":          {map[string]http.HandlerFunc{http.MethodGet: in.handleFaultsGet, http.MethodPost: in.handleFaultsPost}},
	}
	if in.cfg.RuntimeLoRA {
		table["/v1/load_lora_adapter"] = route{map[string]http.HandlerFunc{http.MethodPost: in.handleLoadLoRA}}
		table["/v1/unload_lora_adapter"] = route{map[string]http.HandlerFunc{http.MethodPost: in.handleUnloadLoRA}}
	}
	// Paths with parameters: a "{name}" segment matches one non-empty path
	// segment, like a FastAPI path parameter.
	params := []paramRoute{
		{splitPath("/v1/responses/{response_id}"), route{map[string]http.HandlerFunc{http.MethodGet: in.handleRetrieveResponse}}},
		{splitPath("/v1/responses/{response_id}/cancel"), route{map[string]http.HandlerFunc{http.MethodPost: in.handleCancelResponse}}},
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rt, ok := table[r.URL.Path]
		if !ok {
			rt, ok = matchParamRoute(params, r)
		}
		if !ok {
			in.writeError(w, &apiError{status: http.StatusNotFound, typ: "Not Found", message: "Not Found"})
			return
		}
		f, ok := rt.methods[r.Method]
		if !ok && r.Method == http.MethodHead {
			f, ok = rt.methods[http.MethodGet]
		}
		if !ok {
			allow := make([]string, 0, len(rt.methods))
			for m := range rt.methods {
				allow = append(allow, m)
			}
			w.Header().Set("Allow", strings.Join(allow, ", "))
			in.writeError(w, &apiError{status: http.StatusMethodNotAllowed, typ: "Method Not Allowed", message: "Method Not Allowed"})
			return
		}
		f(w, r)
	})
	return in.recoverMiddleware(in.checkAPIKey(h))
}

// paramRoute is a route whose path has "{name}" segments.
type paramRoute struct {
	segs []string
	route
}

func splitPath(p string) []string { return strings.Split(strings.TrimPrefix(p, "/"), "/") }

// matchParamRoute finds the parameterised route of r's path and sets its
// parameters as r's path values.
func matchParamRoute(params []paramRoute, r *http.Request) (route, bool) {
	segs := splitPath(r.URL.Path)
next:
	for _, pr := range params {
		if len(pr.segs) != len(segs) {
			continue
		}
		for i, s := range pr.segs {
			if !isParam(s) && s != segs[i] || isParam(s) && segs[i] == "" {
				continue next
			}
		}
		for i, s := range pr.segs {
			if isParam(s) {
				r.SetPathValue(s[1:len(s)-1], segs[i])
			}
		}
		return pr.route, true
	}
	return route{}, false
}

func isParam(seg string) bool {
	return len(seg) > 2 && seg[0] == '{' && seg[len(seg)-1] == '}'
}

// recoverMiddleware turns a handler panic into a 500 (or a cut stream).
func (in *Instance) recoverMiddleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rw := &statusWriter{ResponseWriter: w}
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				in.log.Error("handler panic", "path", r.URL.Path, "panic", v)
				if !rw.wrote {
					in.writeError(rw, &apiError{status: 500, message: fmt.Sprintf("internal error: %v", v)})
					return
				}
				panic(http.ErrAbortHandler)
			}
		}()
		next.ServeHTTP(rw, r)
	})
}

// statusWriter records whether headers went out. It implements Unwrap so
// http.ResponseController reaches the real writer.
type statusWriter struct {
	http.ResponseWriter
	wrote bool
}

func (s *statusWriter) WriteHeader(code int) {
	s.wrote = true
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	s.wrote = true
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

func (s *statusWriter) Flush() {
	s.wrote = true
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (in *Instance) writeError(w http.ResponseWriter, e *apiError) {
	switch {
	case e.status >= 500:
		in.ctr.status5xx.Add(1)
	case e.status >= 400:
		in.ctr.status4xx.Add(1)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_, _ = w.Write(errorBody(e))
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, err.Error(), 500)
		return
	}
	writeRawJSON(w, status, b)
}

// writeRawJSON writes an already encoded JSON body.
func writeRawJSON(w http.ResponseWriter, status int, b []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func readBody(w http.ResponseWriter, r *http.Request) ([]byte, *apiError) {
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, &apiError{status: http.StatusRequestEntityTooLarge, message: "request body too large"}
		}
		return nil, badRequest("could not read request body: %v", err)
	}
	return b, nil
}

func (in *Instance) handleHealth(w http.ResponseWriter, _ *http.Request) {
	w.WriteHeader(http.StatusOK)
}

func (in *Instance) handleLoad(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, map[string]int64{"server_load": in.ctr.inflight.Load()})
}

// handleModels lists the model, then its LoRA adapters in the order they
// were added, each with the model as parent, its path as root and no
// max_model_len (vLLM 0.32's show_available_models).
func (in *Instance) handleModels(w http.ResponseWriter, _ *http.Request) {
	entry := func(id, root string, parent any, maxLen any) map[string]any {
		return map[string]any{
			"id":            id,
			"object":        "model",
			"created":       in.created,
			"owned_by":      "vllm",
			"root":          root,
			"parent":        parent,
			"max_model_len": maxLen,
			"permission": []any{map[string]any{
				"id": "modelperm-" + in.permID, "object": "model_permission", "created": in.created,
				"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
				"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
				"organization": "*", "group": nil, "is_blocking": false,
			}},
		}
	}
	data := []any{entry(in.cfg.Model, in.cfg.Model, nil, in.cfg.MaxModelLen)}
	for _, a := range in.lora.list() {
		data = append(data, entry(a.name, a.path, in.cfg.Model, nil))
	}
	writeJSON(w, 200, map[string]any{"object": "list", "data": data})
}

func (in *Instance) handleProfile(start bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, maxBodyBytes))
		if start {
			in.ctr.profileStarts.Add(1)
		} else {
			in.ctr.profileStops.Add(1)
		}
		w.WriteHeader(http.StatusOK)
	}
}

func (in *Instance) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, aerr := readBody(w, r)
	if aerr != nil {
		in.writeError(w, aerr)
		return
	}
	var req struct {
		Model            *string         `json:"model"`
		Prompt           *string         `json:"prompt"`
		Messages         json.RawMessage `json:"messages"`
		AddSpecialTokens *bool           `json:"add_special_tokens"`
		AddGenPrompt     *bool           `json:"add_generation_prompt"`
		ContinueFinal    *bool           `json:"continue_final_message"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		in.writeError(w, badRequest("invalid JSON body: %v", err))
		return
	}
	var text string
	add := req.AddSpecialTokens == nil || *req.AddSpecialTokens // vLLM's default for a prompt
	switch {
	case req.Prompt != nil:
		text = *req.Prompt
	case len(req.Messages) > 0 && string(req.Messages) != "null":
		msgs, err := parseMessages(req.Messages)
		if err != nil {
			in.writeError(w, badRequest("%v", err))
			return
		}
		var aerr *apiError
		if text, aerr = renderChat(msgs, req.AddGenPrompt, req.ContinueFinal); aerr != nil {
			in.writeError(w, aerr)
			return
		}
		add = req.AddSpecialTokens != nil && *req.AddSpecialTokens // the template holds them
	default:
		in.writeError(w, badRequest("Field required: prompt or messages"))
		return
	}
	if in.tok != nil {
		ids := in.tokenize(text, add)
		writeJSON(w, 200, map[string]any{"count": len(ids), "max_model_len": in.cfg.MaxModelLen, "tokens": ids, "token_strs": nil})
		return
	}
	words := strings.Fields(text)
	ids := make([]uint32, len(words))
	for i, wd := range words {
		ids[i] = oracle.TokenID(wd)
		if ids[i] > oracle.EOS {
			in.rememberWord(ids[i], wd)
		}
	}
	writeJSON(w, 200, map[string]any{"count": len(ids), "max_model_len": in.cfg.MaxModelLen, "tokens": ids, "token_strs": nil})
}

func (in *Instance) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	body, aerr := readBody(w, r)
	if aerr != nil {
		in.writeError(w, aerr)
		return
	}
	var req struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		in.writeError(w, badRequest("invalid JSON body: %v", err))
		return
	}
	writeJSON(w, 200, map[string]any{"prompt": oracle.Detokenize(req.Tokens, in.lookupWord)})
}

const maxRememberedWords = 100000

func (in *Instance) rememberWord(id uint32, w string) {
	in.wordsMu.Lock()
	defer in.wordsMu.Unlock()
	if len(in.words) >= maxRememberedWords {
		clear(in.words)
	}
	in.words[id] = w
}

func (in *Instance) lookupWord(id uint32) (string, bool) {
	in.wordsMu.Lock()
	defer in.wordsMu.Unlock()
	w, ok := in.words[id]
	return w, ok
}

func (in *Instance) handleStats(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, in.stats())
}

func (in *Instance) handleFaultsGet(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, in.faults.snapshot(in.heartbeatOn.Load()))
}

func (in *Instance) handleFaultsPost(w http.ResponseWriter, r *http.Request) {
	body, aerr := readBody(w, r)
	if aerr != nil {
		in.writeError(w, aerr)
		return
	}
	var f FaultsJSON
	dec := json.NewDecoder(strings.NewReader(string(body)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		in.writeError(w, badRequest("invalid faults object: %v", err))
		return
	}
	if err := in.faults.validateAndApply(f); err != nil {
		in.writeError(w, badRequest("%v", err))
		return
	}
	if f.Heartbeat != nil {
		in.setHeartbeat(*f.Heartbeat)
	}
	if f.SlowFactor != nil || f.MaxWaiting != nil {
		in.applyEngineFaults()
	}
	in.log.Info("faults changed", "faults", in.faults.snapshot(in.heartbeatOn.Load()).String())
	writeJSON(w, 200, in.faults.snapshot(in.heartbeatOn.Load()))
}

func (in *Instance) handleMetrics(w http.ResponseWriter, _ *http.Request) {
	var b strings.Builder
	model := strconv.Quote(in.cfg.Model)
	gauge := func(name, help string, val func(s engine.Snapshot) float64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s gauge\n", name, help, name)
		for i, e := range in.engines {
			fmt.Fprintf(&b, "%s{engine=\"%d\",model_name=%s} %s\n", name, i, model, strconv.FormatFloat(val(e.Snapshot()), 'g', -1, 64))
		}
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", func(s engine.Snapshot) float64 { return float64(s.Running) })
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", func(s engine.Snapshot) float64 { return float64(s.Waiting + s.WaitingRemote) })
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(s engine.Snapshot) float64 {
		if s.BlocksTotal == 0 {
			return 0
		}
		return float64(s.BlocksUsed) / float64(s.BlocksTotal)
	})
	counter := func(name, help string, v int64) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s counter\n%s{model_name=%s} %d\n", name, help, name, name, model, v)
	}
	counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", in.ctr.promptTokens.Load())
	counter("vllm:generation_tokens_total", "Number of generation tokens processed.", in.ctr.generationTokens.Load())
	// vLLM 0.32 counts a request its client aborted in none of these
	// reasons ("abort" stays 0 then); a failed request is an "error".
	var length, stop, failed uint64
	for _, e := range in.engines {
		s := e.Snapshot()
		length += s.FinishedLength
		stop += s.FinishedStop
		failed += s.Failed
	}
	b.WriteString("# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n")
	for _, r := range []struct {
		reason string
		n      uint64
	}{{"stop", stop}, {"length", length}, {"abort", 0}, {"error", failed}, {"repetition", 0}} {
		fmt.Fprintf(&b, "vllm:request_success_total{finished_reason=%q,model_name=%s} %d\n", r.reason, model, r.n)
	}
	in.writePrefixCacheMetrics(&b, model)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = io.WriteString(w, b.String())
}

// rankHeader validates X-data-parallel-rank: the pinned rank, or -1 when
// the header is absent.
func (in *Instance) rankHeader(r *http.Request) (int, *apiError) {
	hv := r.Header.Get("X-data-parallel-rank")
	if hv == "" {
		return -1, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(hv))
	if err != nil {
		return 0, badRequest("X-data-parallel-rank must be an integer, got %q", hv)
	}
	if n < 0 || n >= len(in.engines) {
		return 0, badRequest("data_parallel_rank %d is out of range [0, %d).", n, len(in.engines))
	}
	return n, nil
}

// pickRank is vLLM's DP load balancer for an unpinned request: the engine
// with the lowest 4·waiting + running, ties spread round-robin (vLLM bumps
// its local count of the chosen engine, so back-to-back requests rotate
// between stats updates even when every engine is idle).
func (in *Instance) pickRank() int {
	n := len(in.engines)
	if n == 1 {
		return 0
	}
	start := int(in.rrNext.Add(1)-1) % n
	best, bestLoad := start, -1
	for k := range n {
		i := (start + k) % n
		s := in.engines[i].Snapshot()
		load := 4*(s.Waiting+s.WaitingRemote) + s.Running
		if bestLoad < 0 || load < bestLoad {
			best, bestLoad = i, load
		}
	}
	return best
}

func (in *Instance) handleGenerate(api apiKind) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		switch api {
		case apiChat:
			in.ctr.reqChat.Add(1)
		case apiResponses:
			in.ctr.reqResponses.Add(1)
		default:
			in.ctr.reqCompletions.Add(1)
		}
		n := in.ctr.started.Add(1)
		if lim := in.faults.crashLimit(); lim > 0 && n >= int64(lim) {
			in.log.Error("crash-after reached: exiting", "requests_started", n)
			in.exit(1)
			return
		}
		defer in.ctr.enter()()

		xrid := r.Header.Get("X-Request-Id")
		body, aerr := readBody(w, r)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		if aerr := in.openAIStrictCheck(api, body); aerr != nil {
			in.writeError(w, aerr)
			return
		}
		var g *genReq
		if api == apiResponses {
			g, aerr = in.parseResponses(body, xrid)
		} else {
			g, aerr = in.parseGen(body, api == apiChat, xrid)
		}
		g.endpoint = r.URL.Path
		in.ctr.noteRequest(g.endpoint, xrid, r.Header.Get("X-data-parallel-rank"), g.kvRaw)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		if status, ok := in.faults.takeFailure(); ok {
			in.ctr.faultsInjected.Add(1)
			in.writeError(w, &apiError{status: status, message: "vllm-sim: injected failure (fail_next)"})
			return
		}
		pinned, aerr := in.rankHeader(r)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		g.created = time.Now().Unix()
		jobs, aerr := in.newJobs(r, g, pinned)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		switch jobs[0].kind {
		case "prefill":
			in.ctr.reqPrefillLeg.Add(1)
		case "decode":
			in.ctr.reqDecodeLeg.Add(1)
		default:
			in.ctr.reqPlain.Add(1)
		}
		for k, j := range jobs {
			j.wrapCallbacks()
			h, err := j.eng.Submit(&j.req)
			if err != nil {
				for _, rest := range jobs[k:] {
					if rest.onAbort != nil {
						rest.onAbort(false)
					}
				}
				for _, prev := range jobs[:k] {
					prev.aborted()
				}
				switch {
				case errors.Is(err, engine.ErrQueueFull):
					in.ctr.rejected503.Add(1)
					in.writeError(w, &apiError{status: http.StatusServiceUnavailable, message: "vllm-sim: waiting queue is full (max_waiting)"})
				case errors.Is(err, engine.ErrTooLarge):
					in.writeError(w, badRequest("request needs more KV cache than the engine has"))
				default:
					in.writeError(w, &apiError{status: http.StatusServiceUnavailable, message: err.Error()})
				}
				return
			}
			j.hp.CompareAndSwap(nil, h)
			in.ctr.promptTokens.Add(int64(len(j.g.promptIDs)))
			j.armKVTimeout()
			if j.afterSubmit != nil {
				j.afterSubmit()
			}
		}
		switch {
		case api == apiResponses && g.stream:
			in.responsesStream(w, r, jobs[0])
		case api == apiResponses:
			in.responsesJSON(w, r, jobs[0])
		case g.stream:
			in.streamResponse(w, r, jobs)
		default:
			in.jsonResponse(w, r, jobs)
		}
	}
}

// newJobs builds one job per prompt and lets the connector configure them.
// A batched completion is one engine request per prompt, each load-balanced
// on its own unless X-data-parallel-rank pins them.
func (in *Instance) newJobs(r *http.Request, g *genReq, pinned int) ([]*job, *apiError) {
	kv := g.kv
	if g.kvDropped && in.cfg.pd() {
		if e := in.violation(g, "kv_transfer_params", "kv_transfer_params on "+g.endpoint+
			" is dropped by vLLM before PR #37424: this route cannot be PD-split (send it whole to one worker)"); e != nil {
			return nil, e
		}
	}
	if len(g.prompts) > 1 && kv != nil && in.cfg.pd() {
		if e := in.violation(g, "prompt", fmt.Sprintf("a batched completion (%d prompts) carries one kv_transfer_params: vLLM hands it to every prompt's engine request, so at most one KV handoff can match (reject batched prompts in PD mode)", len(g.prompts))); e != nil {
			return nil, e
		}
	}
	jobs := make([]*job, 0, len(g.prompts))
	undo := func() {
		for _, j := range jobs {
			if j.onAbort != nil {
				j.onAbort(false)
			}
		}
	}
	for i := range g.prompts {
		sg := g.sub(i)
		rank := pinned
		if rank < 0 {
			rank = in.pickRank()
		}
		j := &job{in: in, g: sg, rank: rank, eng: in.engines[rank], ctx: r.Context()}
		j.req = engine.Request{ID: sg.requestID, PromptTokens: len(sg.promptIDs), MaxTokens: sg.maxTokens,
			Priority: sg.priority, Tokens: sg.promptIDs, CacheSalt: sg.cacheSalt, LoRA: sg.lora.name, LoRAID: sg.lora.id, ReportCachedBlocks: sg.reportCached,
			OutputToken: j.outputToken}
		if !sg.ignoreEOS && sg.minTokens == 0 && in.cfg.EOSProbability > 0 {
			j.req.EOS = func(i int) bool { return i == 0 && j.firstEOS.Load() }
		}
		var aerr *apiError
		switch {
		case in.cfg.Role == RolePrefill && (i == 0 || kv == nil):
			aerr = in.conn.prefill(j)
		case in.cfg.Role == RoleDecode && (i == 0 || kv == nil):
			aerr = in.conn.decode(j)
		case in.cfg.Role == RoleDecode:
			// Prompt i > 0 of a batch shares prompt 0's transfer: its own
			// KV never arrives.
			j.garbage("batched prompt sharing another prompt's kv_transfer_params")
		default:
			j.local()
		}
		if aerr != nil {
			undo()
			return nil, aerr
		}
		jobs = append(jobs, j)
	}
	return jobs, nil
}

// tokenPiece returns the text of generated token i.
func (j *job) tokenPiece(i int) string {
	return oracle.Piece(j.token(i))
}

func (j *job) finished(p engine.Progress) {
	j.stop()
	j.in.ctr.generationTokens.Add(int64(p.Generated))
	if j.onFinish != nil {
		j.onFinish(p)
	}
}

func (j *job) aborted() {
	j.stop()
	admitted := j.handle().Progress().Admitted
	j.handle().Abort()
	j.in.ctr.aborted.Add(1)
	if j.onAbort != nil {
		j.onAbort(admitted)
	}
}

func finishError(p engine.Progress) *apiError {
	msg := "request failed"
	if p.Err != nil {
		msg = p.Err.Error()
	}
	if p.Reason == engine.FinishAbort {
		msg = "request aborted"
	}
	return &apiError{status: http.StatusInternalServerError, message: msg}
}

func failedProgress(p engine.Progress) bool {
	return p.Reason == engine.FinishError || p.Reason == engine.FinishAbort
}

// follow drives jobs to completion. emit(i, p, from) runs whenever job i has
// generated tokens beyond from (after the job's first-token hook and, once
// per response, the stall fault). It returns every job's final progress,
// or ok=false when the client went away: unfinished jobs are then aborted
// and finished ones finalized.
func (in *Instance) follow(r *http.Request, jobs []*job, emit func(i int, p engine.Progress, from int)) ([]engine.Progress, bool) {
	n := len(jobs)
	sent := make([]int, n)
	final := make([]engine.Progress, n)
	done := make([]bool, n)
	left := n
	stalled := false
	abandon := func() {
		for i, j := range jobs {
			if done[i] {
				j.finished(final[i])
			} else {
				j.aborted()
			}
		}
	}
	for {
		for i, j := range jobs {
			if done[i] {
				continue
			}
			p := j.handle().Progress()
			if p.Generated > sent[i] {
				if sent[i] == 0 {
					if j.onFirstToken != nil {
						j.onFirstToken()
					}
					if !stalled {
						stalled = true
						if !in.stallFirstToken(r) {
							abandon()
							return nil, false
						}
					}
				}
				if emit != nil {
					emit(i, p, sent[i])
				}
				sent[i] = p.Generated
			}
			if p.Finished {
				done[i], final[i] = true, p
				left--
			}
		}
		if left == 0 {
			return final, true
		}
		if !waitAny(r.Context(), jobs, done) {
			abandon()
			return nil, false
		}
	}
}

// tokenFaults applies cut_after_tokens and crash_after_tokens once a job
// of the response has generated n tokens: a cut aborts the jobs and closes
// the connection without a [DONE] (the client sees the body end early, as
// when a worker dies); a crash exits the process.
func (in *Instance) tokenFaults(jobs []*job, n int) {
	cut, crash := in.faults.tokenCut()
	if crash > 0 && n >= crash {
		in.log.Error("crash-after-tokens reached: exiting", "tokens", n)
		in.exit(1)
		return
	}
	if cut <= 0 || n < cut {
		return
	}
	in.ctr.faultsInjected.Add(1)
	in.log.Info("cut-after-tokens: closing the connection", "tokens", n)
	for _, j := range jobs {
		if p := j.handle().Progress(); p.Finished {
			j.finished(p)
		} else {
			j.aborted()
		}
	}
	panic(http.ErrAbortHandler)
}

// stallFirstToken applies the stall_first_token fault; false if the client
// went away meanwhile.
func (in *Instance) stallFirstToken(r *http.Request) bool {
	d := in.faults.stall()
	if d <= 0 {
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// waitAny blocks until an unfinished job makes progress (true) or ctx ends
// (false).
func waitAny(ctx context.Context, jobs []*job, done []bool) bool {
	if len(jobs) == 1 {
		select {
		case <-jobs[0].handle().Updates():
			return true
		case <-ctx.Done():
			return false
		}
	}
	cases := []reflect.SelectCase{{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ctx.Done())}}
	for i, j := range jobs {
		if !done[i] {
			cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(j.handle().Updates())})
		}
	}
	chosen, _, _ := reflect.Select(cases)
	return chosen != 0
}

func (in *Instance) streamResponse(w http.ResponseWriter, r *http.Request, jobs []*job) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_ = rc.Flush()
	g := jobs[0].g
	cw := newChunkWriter(g)
	final, ok := in.follow(r, jobs, func(i int, p engine.Progress, from int) {
		j := jobs[i]
		if from == 0 && g.chat {
			_, _ = w.Write(cw.roleChunk())
		}
		end := p.Generated
		if cut, _ := in.faults.tokenCut(); cut > 0 {
			end = min(end, max(cut, from)) // a cut stream ends after exactly cut tokens
		}
		for k := from; k < end; k++ {
			finish := ""
			if p.Finished && k == p.Generated-1 && (p.Reason == engine.FinishLength || p.Reason == engine.FinishStop) {
				finish = p.Reason.String()
			}
			_, _ = w.Write(cw.tokenChunk(i, j.tokenPiece(k), j.token(k), j.g.promptIDs, finish, len(j.g.promptIDs), k+1))
		}
		_ = rc.Flush()
		in.tokenFaults(jobs, end)
	})
	if !ok {
		return
	}
	prompt, completion := 0, 0
	var failed *engine.Progress
	for i, p := range final {
		prompt += len(jobs[i].g.promptIDs)
		completion += p.Generated
		if failedProgress(p) && failed == nil {
			failed = &final[i]
		}
	}
	if failed != nil {
		in.ctr.status5xx.Add(1)
		_, _ = w.Write(errorEvent(finishError(*failed)))
	} else if g.includeUsage {
		cached := cachedTokens(jobs)
		_, _ = w.Write(cw.usageChunk(prompt, completion, func(b []byte) []byte { return in.appendPromptTokensDetails(b, cached) }))
	}
	_, _ = w.Write(doneEvent)
	_ = rc.Flush()
	for i, j := range jobs {
		j.finished(final[i])
	}
}

func (in *Instance) jsonResponse(w http.ResponseWriter, r *http.Request, jobs []*job) {
	final, ok := in.follow(r, jobs, func(_ int, p engine.Progress, _ int) { in.tokenFaults(jobs, p.Generated) })
	if !ok {
		return
	}
	for i, j := range jobs {
		j.finished(final[i])
	}
	for _, p := range final {
		if failedProgress(p) {
			in.writeError(w, finishError(p))
			return
		}
	}
	g := jobs[0].g
	texts := make([]string, len(jobs))
	ids := make([][]uint32, len(jobs))
	var u usage
	for i, j := range jobs {
		var text strings.Builder
		for k := range final[i].Generated {
			text.WriteString(j.tokenPiece(k))
			if g.returnTokenIDs {
				ids[i] = append(ids[i], j.token(k))
			}
		}
		texts[i] = text.String()
		u.PromptTokens += len(j.g.promptIDs)
		u.CompletionTokens += final[i].Generated
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails = in.promptTokensDetails(cachedTokens(jobs))
	// vLLM returns final_res_batch[0].kv_transfer_params.
	var kv any
	if final[0].Reason == engine.FinishLength && jobs[0].responseKV != nil {
		kv = jobs[0].responseKV()
	}
	if g.chat {
		reason := final[0].Reason.String()
		resp := chatResponse{
			ID: g.respID, Object: "chat.completion", Created: g.created, Model: g.model,
			Choices: []chatChoice{{Message: chatMessage{Role: "assistant", Content: texts[0], ToolCalls: []any{}}, FinishReason: &reason, TokenIDs: ids[0]}},
			Usage:   u, KVTransferParams: kv,
		}
		if g.returnTokenIDs {
			resp.PromptTokenIDs = g.promptIDs
		}
		writeJSON(w, 200, resp)
		return
	}
	choices := make([]completionChoice, len(jobs))
	for i := range jobs {
		reason := final[i].Reason.String()
		choices[i] = completionChoice{Index: i, Text: texts[i], FinishReason: &reason, TokenIDs: ids[i]}
		if g.returnTokenIDs {
			choices[i].PromptTokenIDs = jobs[i].g.promptIDs
		}
	}
	writeJSON(w, 200, completionResponse{
		ID: g.respID, Object: "text_completion", Created: g.created, Model: g.model,
		Choices: choices, Usage: u, KVTransferParams: kv,
	})
}
