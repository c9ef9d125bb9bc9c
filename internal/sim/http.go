package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
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
		"/v1/completions":      {map[string]http.HandlerFunc{http.MethodPost: in.handleGenerate(false)}},
		"/v1/chat/completions": {map[string]http.HandlerFunc{http.MethodPost: in.handleGenerate(true)}},
		"/v1/models":           {map[string]http.HandlerFunc{http.MethodGet: in.handleModels}},
		"/health":              {map[string]http.HandlerFunc{http.MethodGet: in.handleHealth}},
		"/load":                {map[string]http.HandlerFunc{http.MethodGet: in.handleLoad}},
		"/tokenize":            {map[string]http.HandlerFunc{http.MethodPost: in.handleTokenize}},
		"/detokenize":          {map[string]http.HandlerFunc{http.MethodPost: in.handleDetokenize}},
		"/start_profile":       {map[string]http.HandlerFunc{http.MethodPost: in.handleProfile(true)}},
		"/stop_profile":        {map[string]http.HandlerFunc{http.MethodPost: in.handleProfile(false)}},
		"/metrics":             {map[string]http.HandlerFunc{http.MethodGet: in.handleMetrics}},
		"/sim/stats":           {map[string]http.HandlerFunc{http.MethodGet: in.handleStats}},
		"/sim/faults":          {map[string]http.HandlerFunc{http.MethodGet: in.handleFaultsGet, http.MethodPost: in.handleFaultsPost}},
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rt, ok := table[r.URL.Path]
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
	return in.recoverMiddleware(h)
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

func (in *Instance) handleModels(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, 200, map[string]any{
		"object": "list",
		"data": []any{map[string]any{
			"id":            in.cfg.Model,
			"object":        "model",
			"created":       in.created,
			"owned_by":      "vllm",
			"root":          in.cfg.Model,
			"parent":        nil,
			"max_model_len": in.cfg.MaxModelLen,
			"permission": []any{map[string]any{
				"id": "modelperm-" + in.permID, "object": "model_permission", "created": in.created,
				"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
				"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
				"organization": "*", "group": nil, "is_blocking": false,
			}},
		}},
	})
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
		Model    *string         `json:"model"`
		Prompt   *string         `json:"prompt"`
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		in.writeError(w, badRequest("invalid JSON body: %v", err))
		return
	}
	var text string
	switch {
	case req.Prompt != nil:
		text = *req.Prompt
	case len(req.Messages) > 0 && string(req.Messages) != "null":
		msgs, err := parseMessages(req.Messages)
		if err != nil {
			in.writeError(w, badRequest("%v", err))
			return
		}
		text = oracle.ChatPrompt(msgs)
	default:
		in.writeError(w, badRequest("Field required: prompt or messages"))
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
	var length, stop, abort uint64
	for _, e := range in.engines {
		s := e.Snapshot()
		length += s.FinishedLength
		stop += s.FinishedStop
		abort += s.Aborted + s.Failed
	}
	b.WriteString("# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n")
	fmt.Fprintf(&b, "vllm:request_success_total{finished_reason=\"length\",model_name=%s} %d\n", model, length)
	fmt.Fprintf(&b, "vllm:request_success_total{finished_reason=\"stop\",model_name=%s} %d\n", model, stop)
	fmt.Fprintf(&b, "vllm:request_success_total{finished_reason=\"abort\",model_name=%s} %d\n", model, abort)
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = io.WriteString(w, b.String())
}

// pickRank validates X-data-parallel-rank or picks the least-loaded engine.
func (in *Instance) pickRank(r *http.Request) (int, *apiError) {
	hv := r.Header.Get("X-data-parallel-rank")
	if hv == "" {
		best, bestLoad := 0, -1
		for i, e := range in.engines {
			s := e.Snapshot()
			load := 4*(s.Waiting+s.WaitingRemote) + s.Running
			if bestLoad < 0 || load < bestLoad {
				best, bestLoad = i, load
			}
		}
		return best, nil
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

func (in *Instance) handleGenerate(chat bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if chat {
			in.ctr.reqChat.Add(1)
		} else {
			in.ctr.reqCompletions.Add(1)
		}
		n := in.ctr.started.Add(1)
		if lim := in.faults.crashLimit(); lim > 0 && n >= int64(lim) {
			in.log.Error("crash-after reached: exiting", "requests_started", n)
			in.exit(1)
			return
		}
		in.ctr.inflight.Add(1)
		defer in.ctr.inflight.Add(-1)

		xrid := r.Header.Get("X-Request-Id")
		body, aerr := readBody(w, r)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		g, aerr := in.parseGen(body, chat, xrid)
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
		rank, aerr := in.pickRank(r)
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		g.created = time.Now().Unix()
		j := &job{in: in, g: g, rank: rank, eng: in.engines[rank], ctx: r.Context()}
		j.req = engine.Request{ID: g.requestID, PromptTokens: len(g.promptIDs), MaxTokens: g.maxTokens}
		if !g.ignoreEOS && g.minTokens == 0 && in.cfg.EOSProbability > 0 {
			j.req.EOS = func(i int) bool { return i == 0 && j.firstEOS.Load() }
		}
		switch in.cfg.Role {
		case RolePrefill:
			aerr = in.conn.prefill(j)
		case RoleDecode:
			aerr = in.conn.decode(j)
		default:
			j.local()
		}
		if aerr != nil {
			in.writeError(w, aerr)
			return
		}
		switch j.kind {
		case "prefill":
			in.ctr.reqPrefillLeg.Add(1)
		case "decode":
			in.ctr.reqDecodeLeg.Add(1)
		default:
			in.ctr.reqPlain.Add(1)
		}
		j.wrapCallbacks()
		h, err := j.eng.Submit(&j.req)
		if err != nil {
			if j.onAbort != nil {
				j.onAbort(false)
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
		in.ctr.promptTokens.Add(int64(len(g.promptIDs)))
		j.armKVTimeout()
		if j.afterSubmit != nil {
			j.afterSubmit()
		}
		if g.stream {
			in.streamResponse(w, r, j)
		} else {
			in.jsonResponse(w, r, j)
		}
	}
}

// tokenPiece returns the text of generated token i.
func (j *job) tokenPiece(i int) string {
	return oracle.Piece(oracle.Token(j.digest.Load(), j.g.seed, i, j.firstEOS.Load()))
}

// awaitFirst applies the stall fault and the first-token hook.
func (j *job) firstToken(r *http.Request) bool {
	if j.onFirstToken != nil {
		j.onFirstToken()
	}
	if d := j.in.faults.stall(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return false
		}
	}
	return true
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

func (in *Instance) streamResponse(w http.ResponseWriter, r *http.Request, j *job) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	_ = rc.Flush()
	cw := newChunkWriter(j.g)
	sent := 0
	for {
		p := j.handle().Progress()
		if p.Generated > sent {
			if sent == 0 {
				if !j.firstToken(r) {
					j.aborted()
					return
				}
				if j.g.chat {
					_, _ = w.Write(cw.roleChunk())
				}
			}
			for sent < p.Generated {
				finish := ""
				if p.Finished && sent == p.Generated-1 && (p.Reason == engine.FinishLength || p.Reason == engine.FinishStop) {
					finish = p.Reason.String()
				}
				_, _ = w.Write(cw.tokenChunk(j.tokenPiece(sent), finish, sent+1))
				sent++
			}
			_ = rc.Flush()
		}
		if p.Finished {
			if p.Reason == engine.FinishError || p.Reason == engine.FinishAbort {
				e := finishError(p)
				in.ctr.status5xx.Add(1)
				_, _ = w.Write(errorEvent(e))
			} else if j.g.includeUsage {
				_, _ = w.Write(cw.usageChunk(p.Generated))
			}
			_, _ = w.Write(doneEvent)
			_ = rc.Flush()
			j.finished(p)
			return
		}
		select {
		case <-j.handle().Updates():
		case <-r.Context().Done():
			j.aborted()
			return
		}
	}
}

func (in *Instance) jsonResponse(w http.ResponseWriter, r *http.Request, j *job) {
	firstSeen := false
	var p engine.Progress
	for {
		p = j.handle().Progress()
		if p.Generated > 0 && !firstSeen {
			firstSeen = true
			if !j.firstToken(r) {
				j.aborted()
				return
			}
		}
		if p.Finished {
			break
		}
		select {
		case <-j.handle().Updates():
		case <-r.Context().Done():
			j.aborted()
			return
		}
	}
	j.finished(p)
	if p.Reason == engine.FinishError || p.Reason == engine.FinishAbort {
		in.writeError(w, finishError(p))
		return
	}
	var text strings.Builder
	for i := range p.Generated {
		text.WriteString(j.tokenPiece(i))
	}
	reason := p.Reason.String()
	var kv any
	if p.Reason == engine.FinishLength && j.responseKV != nil {
		kv = j.responseKV()
	}
	u := usage{PromptTokens: len(j.g.promptIDs), CompletionTokens: p.Generated, TotalTokens: len(j.g.promptIDs) + p.Generated}
	if j.g.chat {
		writeJSON(w, 200, chatResponse{
			ID: j.g.requestID, Object: "chat.completion", Created: j.g.created, Model: j.g.model,
			Choices: []chatChoice{{Message: chatMessage{Role: "assistant", Content: text.String(), ToolCalls: []any{}}, FinishReason: &reason}},
			Usage:   u, KVTransferParams: kv,
		})
		return
	}
	writeJSON(w, 200, completionResponse{
		ID: j.g.requestID, Object: "text_completion", Created: j.g.created, Model: j.g.model,
		Choices: []completionChoice{{Text: text.String(), FinishReason: &reason}},
		Usage:   u, KVTransferParams: kv,
	})
}
