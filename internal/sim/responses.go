package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// A minimal vLLM-like /v1/responses (OpenAI Responses API): text input
// only, one assistant message as output, no tools, no reasoning, no
// background mode; final responses are kept for GET /v1/responses/{id} only
// with --responses-store (responses_store.go). It is served like a plain generation on every role: vLLM
// versions before PR #37424 have no kv_transfer_params on this route (the
// request field is dropped and the response has none), so the route cannot
// be PD-split; a kv_transfer_params sent here on a P or D is counted as a
// protocol violation (400 with --strict) and otherwise ignored.

type rawResponses struct {
	Model           *string         `json:"model"`
	Input           json.RawMessage `json:"input"`
	Instructions    *string         `json:"instructions"`
	MaxOutputTokens *int            `json:"max_output_tokens"`
	Stream          *bool           `json:"stream"`
	IgnoreEOS       *bool           `json:"ignore_eos"`
	Seed            *int64          `json:"seed"`
	KVParams        json.RawMessage `json:"kv_transfer_params"`
	Store           json.RawMessage `json:"store"`
	PreviousID      *string         `json:"previous_response_id"`
	Priority        *int            `json:"priority"`
	CacheSalt       json.RawMessage `json:"cache_salt"`

	VLLMXargs map[string]json.RawMessage `json:"vllm_xargs"` // only kv_cache_report_mode is read
}

// parseResponses validates a /v1/responses body. The prompt is the chat
// rendering of [instructions as system] + input (a string is one user
// message), so a /v1/responses request and the equivalent chat request
// generate the same text.
func (in *Instance) parseResponses(body []byte, xrid string) (*genReq, *apiError) {
	g := &genReq{api: apiResponses, xRequestID: xrid}
	var raw rawResponses
	salt, aerr := decodeSalted(body, &raw, &raw.CacheSalt)
	if aerr != nil {
		return g, aerr
	}
	g.cacheSalt = salt
	g.reportCached = kvCacheReportFull(raw.VLLMXargs)
	store, aerr := parseStore(raw.Store)
	if aerr != nil {
		return g, aerr
	}
	g.store = store
	if len(raw.KVParams) > 0 && string(raw.KVParams) != "null" {
		g.kvRaw = raw.KVParams
		g.kvDropped = true
	}
	if aerr := in.servedModel(g, raw.Model, ""); aerr != nil {
		return g, aerr
	}
	if raw.PreviousID != nil {
		// vLLM answers 404 when the previous response is not in this
		// server's store (without the store, never found).
		if _, ok := in.lookupResponse(*raw.PreviousID); !ok {
			return g, responseNotFound(*raw.PreviousID)
		}
		g.previousID = raw.PreviousID
	}
	if len(raw.Input) == 0 || string(raw.Input) == "null" {
		return g, &apiError{status: 400, typ: "BadRequestError", message: "Field required: input", param: "input"}
	}
	msgs, err := parseResponsesInput(raw.Input)
	if err != nil {
		return g, &apiError{status: 400, typ: "BadRequestError", message: err.Error(), param: "input"}
	}
	if raw.Instructions != nil {
		g.instructions = raw.Instructions
		msgs = append([]oracle.Message{{Role: "system", Content: *raw.Instructions}}, msgs...)
	}
	ids := in.tokenize(oracle.ChatPrompt(msgs), false)
	g.prompts = [][]uint32{ids}
	g.promptIDs = ids
	g.digest = oracle.Digest(ids)
	L := len(ids)
	if raw.MaxOutputTokens != nil {
		if *raw.MaxOutputTokens < 1 {
			return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("max_output_tokens must be at least 1, got %d.", *raw.MaxOutputTokens), param: "max_output_tokens"}
		}
		g.maxTokens = *raw.MaxOutputTokens
	} else {
		g.maxTokens = in.cfg.MaxModelLen - L
	}
	if L+g.maxTokens > in.cfg.MaxModelLen || g.maxTokens < 1 {
		return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the input, %d in the output). Please reduce the length of the input or output.",
			in.cfg.MaxModelLen, L+g.maxTokens, L, g.maxTokens)}
	}
	g.stream = raw.Stream != nil && *raw.Stream
	g.ignoreEOS = raw.IgnoreEOS != nil && *raw.IgnoreEOS
	if g.priority, aerr = in.priority(raw.Priority); aerr != nil {
		return g, aerr
	}
	g.seed = in.cfg.Seed
	if raw.Seed != nil {
		g.seed = *raw.Seed
	}
	id := xrid
	if id == "" {
		id = randomHex()
	}
	g.requestID = "resp_" + id
	g.respID = g.requestID
	return g, nil
}

// parseStore reads "store": absent means true (the OpenAI default), null is
// vLLM's None, which is falsy (not stored); anything but a boolean is a type
// error like the other fields'.
func parseStore(raw json.RawMessage) (bool, *apiError) {
	if len(raw) == 0 {
		return true, nil
	}
	if string(raw) == "null" {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		got := "value"
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			got = te.Value
		}
		return false, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("invalid type for field %q: got JSON %s", "store", got), param: "store"}
	}
	return b, nil
}

// parseResponsesInput accepts a string (one user message) or a list of
// message items {"type"?: "message", "role", "content"} whose content is a
// string or a list of input_text/output_text/text parts.
func parseResponsesInput(raw json.RawMessage) ([]oracle.Message, error) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []oracle.Message{{Role: "user", Content: s}}, nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, errors.New("input must be a string or a list of message items")
	}
	if len(items) == 0 {
		return nil, errors.New("input must not be empty")
	}
	out := make([]oracle.Message, 0, len(items))
	for i, it := range items {
		if it.Type != "" && it.Type != "message" {
			return nil, fmt.Errorf("input[%d]: item type %q is not supported by vllm-sim (only messages)", i, it.Type)
		}
		if it.Role == "" {
			return nil, fmt.Errorf("input[%d].role is required", i)
		}
		var text string
		if len(it.Content) > 0 && string(it.Content) != "null" {
			if err := json.Unmarshal(it.Content, &text); err != nil {
				var parts []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				}
				if err := json.Unmarshal(it.Content, &parts); err != nil {
					return nil, fmt.Errorf("input[%d].content must be a string or a list of content parts", i)
				}
				var b strings.Builder
				for _, p := range parts {
					switch p.Type {
					case "input_text", "output_text", "text", "":
						if b.Len() > 0 {
							b.WriteByte(' ')
						}
						b.WriteString(p.Text)
					}
				}
				text = b.String()
			}
		}
		out = append(out, oracle.Message{Role: it.Role, Content: text})
	}
	return out, nil
}

// responseObject renders the Responses API object of j (status
// "in_progress" while p is unfinished).
func (j *job) responseObject(p engine.Progress, text string) map[string]any {
	g := j.g
	status := "in_progress"
	var incomplete any
	var usage any
	output := []any{}
	if p.Finished {
		status = "completed"
		if p.Reason == engine.FinishLength {
			status = "incomplete"
			incomplete = map[string]any{"reason": "max_output_tokens"}
		}
		output = append(output, j.responseMessage("completed", text))
		usage = map[string]any{
			"input_tokens":          len(g.promptIDs),
			"input_tokens_details":  map[string]any{"cached_tokens": j.handle().CachedTokens()},
			"output_tokens":         p.Generated,
			"output_tokens_details": map[string]any{"reasoning_tokens": 0},
			"total_tokens":          len(g.promptIDs) + p.Generated,
		}
	}
	var instructions, previous any
	if g.instructions != nil {
		instructions = *g.instructions
	}
	if g.previousID != nil {
		previous = *g.previousID
	}
	return map[string]any{
		"id": g.respID, "object": "response", "created_at": g.created, "model": g.model,
		"status": status, "incomplete_details": incomplete, "instructions": instructions,
		"metadata": nil, "output": output, "parallel_tool_calls": true, "temperature": 1.0,
		"tool_choice": "auto", "tools": []any{}, "top_p": 1.0, "background": false,
		"max_output_tokens": g.maxTokens, "max_tool_calls": nil, "previous_response_id": previous,
		"prompt": nil, "reasoning": nil, "service_tier": "auto", "text": nil, "top_logprobs": nil,
		"truncation": "disabled", "usage": usage, "user": nil,
	}
}

func (j *job) responseMsgID() string { return "msg_" + strings.TrimPrefix(j.g.respID, "resp_") }

func responseTextPart(text string) map[string]any {
	return map[string]any{"type": "output_text", "text": text, "annotations": []any{}, "logprobs": nil}
}

func (j *job) responseMessage(status, text string) map[string]any {
	content := []any{}
	if status == "completed" {
		content = append(content, responseTextPart(text))
	}
	return map[string]any{"id": j.responseMsgID(), "type": "message", "role": "assistant", "status": status, "content": content}
}

// responsesJSON serves a non-streaming /v1/responses request.
func (in *Instance) responsesJSON(w http.ResponseWriter, r *http.Request, j *job) {
	final, ok := in.follow(r, []*job{j}, nil)
	if !ok {
		return
	}
	p := final[0]
	j.finished(p)
	if p.Reason == engine.FinishError || p.Reason == engine.FinishAbort {
		in.writeError(w, finishError(p))
		return
	}
	var text strings.Builder
	for i := range p.Generated {
		text.WriteString(j.tokenPiece(i))
	}
	b, _ := json.Marshal(j.responseObject(p, text.String()))
	in.storeResponse(j.g, b)
	writeRawJSON(w, http.StatusOK, b)
}

// responsesStream serves a streaming /v1/responses request with vLLM's SSE
// framing: "event: <type>\ndata: <json>\n\n" per event, every event with a
// sequence_number, and no [DONE].
func (in *Instance) responsesStream(w http.ResponseWriter, r *http.Request, j *job) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	seq := 0
	send := func(typ string, fields map[string]any) {
		fields["type"] = typ
		fields["sequence_number"] = seq
		seq++
		b, _ := json.Marshal(fields)
		_, _ = fmt.Fprintf(w, "event: %s\ndata: %s\n\n", typ, b)
	}
	msgID := j.responseMsgID()
	send("response.created", map[string]any{"response": j.responseObject(engine.Progress{}, "")})
	send("response.in_progress", map[string]any{"response": j.responseObject(engine.Progress{}, "")})
	_ = rc.Flush()
	var text strings.Builder
	begun := false
	begin := func() {
		if !begun {
			begun = true
			send("response.output_item.added", map[string]any{"output_index": 0, "item": j.responseMessage("in_progress", "")})
			send("response.content_part.added", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0,
				"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}, "logprobs": []any{}}})
		}
	}
	final, ok := in.follow(r, []*job{j}, func(_ int, p engine.Progress, from int) {
		begin()
		for k := from; k < p.Generated; k++ {
			piece := j.tokenPiece(k)
			text.WriteString(piece)
			send("response.output_text.delta", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0,
				"delta": piece, "logprobs": []any{}})
		}
		_ = rc.Flush()
	})
	if !ok {
		return
	}
	p := final[0]
	if p.Reason == engine.FinishError || p.Reason == engine.FinishAbort {
		e := finishError(p)
		in.ctr.status5xx.Add(1)
		send("error", map[string]any{"code": errorType(e.status), "message": e.message, "param": nil})
	} else {
		begin()
		t := text.String()
		send("response.output_text.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "text": t, "logprobs": []any{}})
		send("response.content_part.done", map[string]any{"item_id": msgID, "output_index": 0, "content_index": 0, "part": responseTextPart(t)})
		send("response.output_item.done", map[string]any{"output_index": 0, "item": j.responseMessage("completed", t)})
		// vLLM stores the final object before it sends response.completed.
		b, _ := json.Marshal(j.responseObject(p, t))
		in.storeResponse(j.g, b)
		send("response.completed", map[string]any{"response": json.RawMessage(b)})
	}
	_ = rc.Flush()
	j.finished(p)
}
