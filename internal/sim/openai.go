package sim

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// apiError is an OpenAI-style error response (vLLM's newer shape).
type apiError struct {
	status  int
	typ     string
	message string
	param   string
}

func (e *apiError) Error() string { return e.message }

func badRequest(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "BadRequestError", message: fmt.Sprintf(format, args...)}
}

func errorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusMethodNotAllowed:
		return "MethodNotAllowed"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case http.StatusRequestEntityTooLarge:
		return "RequestEntityTooLarge"
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return http.StatusText(status)
}

// errorBody renders {"error": {"message", "type", "param", "code"}}.
func errorBody(e *apiError) []byte {
	var param any
	if e.param != "" {
		param = e.param
	}
	typ := e.typ
	if typ == "" {
		typ = errorType(e.status)
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": e.message, "type": typ, "param": param, "code": e.status,
	}})
	return b
}

// apiKind is the OpenAI route a generation request came in on.
type apiKind int

const (
	apiCompletions apiKind = iota
	apiChat
	apiResponses
)

// genReq is a parsed /v1/completions, /v1/chat/completions or /v1/responses
// request. A batched completion (prompt list) is split by sub into one
// genReq per prompt; promptIDs/digest are those of prompt 0.
type genReq struct {
	endpoint        string
	api             apiKind
	chat            bool
	model           string
	lora            loraAdapter // the LoRA adapter the request names (zero: the base model)
	prompts         [][]uint32  // every prompt (len > 1: batched completion)
	promptIDs       []uint32
	digest          uint64
	maxTokens       int
	minTokens       int
	ignoreEOS       bool
	seed            int64
	priority        int // vLLM's request priority (lower first)
	stream          bool
	includeUsage    bool
	continuousUsage bool
	returnTokenIDs  bool   // vLLM's return_token_ids: prompt_token_ids and token_ids in the response
	cacheSalt       string // vLLM's cache_salt ("" for none), an extra key of the first block's hash
	reportCached    bool   // vllm_xargs kv_cache_report_mode "full": reuse reports for prefix-cache hits
	kvRaw           json.RawMessage
	kv              kvParams
	xRequestID      string
	requestID       string // engine request id: cmpl-<id>, cmpl-<id>-<i> in a batch
	respID          string // response id: cmpl-<id> / chatcmpl-<id> / resp_<id>
	index           int    // choice index in a batch
	instructions    *string
	previousID      *string // /v1/responses previous_response_id (found in the store)
	kvDropped       bool    // /v1/responses: kv_transfer_params was sent and ignored
	store           bool    // /v1/responses: "store" is true or absent
	created         int64
}

// sub returns prompt i of a batched completion as its own request (vLLM
// runs one engine request per prompt, id <request id>-<i>).
func (g *genReq) sub(i int) *genReq {
	c := *g
	c.promptIDs = g.prompts[i]
	c.digest = oracle.Digest(c.promptIDs)
	c.index = i
	if len(g.prompts) > 1 {
		c.requestID = g.requestID + "-" + strconv.Itoa(i)
	}
	return &c
}

type rawGen struct {
	Model               *string         `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            json.RawMessage `json:"messages"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	MinTokens           *int            `json:"min_tokens"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage         *bool `json:"include_usage"`
		ContinuousUsageStats *bool `json:"continuous_usage_stats"`
	} `json:"stream_options"`
	IgnoreEOS        *bool           `json:"ignore_eos"`
	Seed             *int64          `json:"seed"`
	N                *int            `json:"n"`
	Priority         *int            `json:"priority"`
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
	ReturnTokenIDs   *bool           `json:"return_token_ids"`
	CacheSalt        json.RawMessage `json:"cache_salt"`
	// vllm_xargs: vLLM's extra_args; only kv_cache_report_mode is read.
	VLLMXargs map[string]json.RawMessage `json:"vllm_xargs"`
	// Chat template options (vLLM): add_generation_prompt defaults to true.
	AddGenerationPrompt  *bool `json:"add_generation_prompt"`
	ContinueFinalMessage *bool `json:"continue_final_message"`
	// add_special_tokens: vLLM's default is true for completions, false
	// for chat (the template holds them).
	AddSpecialTokens *bool `json:"add_special_tokens"`
}

// completionsDefaultMaxTokens is vLLM's default for /v1/completions.
const completionsDefaultMaxTokens = 16

func randomHex() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// decodeBody decodes a request body that must be a JSON object into v,
// with vLLM's 400s for a non-object, malformed JSON and a field of the
// wrong type.
func decodeBody(body []byte, v any) *apiError {
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) == 0 || trimmed[0] != '{' {
		if json.Valid(trimmed) {
			return badRequest("request body must be a JSON object")
		}
		return badRequest("invalid JSON body")
	}
	if err := json.Unmarshal(trimmed, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("invalid type for field %q: got JSON %s", te.Field, te.Value), param: te.Field}
		}
		return badRequest("invalid JSON body: %v", err)
	}
	return nil
}

// vLLM's cache_salt limits (entrypoints/generate/base/protocol.py).
const (
	maxCacheSaltLen     = 128 // characters
	cacheSaltForbidden  = "@/\\\x00"
	errCacheSaltNotStr  = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
	errCacheSaltTooLong = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL. (parameter=cache_salt)"
)

// decodeSalted is decodeBody for a body with a cache_salt field (salt
// points into v). The salt is checked first, as vLLM's before-validator
// does: a bad salt is reported before a type error in another field (a
// type error does not stop json.Unmarshal from filling the other fields).
func decodeSalted(body []byte, v any, salt *json.RawMessage) (string, *apiError) {
	derr := decodeBody(body, v)
	s, serr := parseCacheSalt(*salt)
	if serr != nil {
		return "", serr
	}
	return s, derr
}

// parseCacheSalt is vLLM's validate_cache_salt: absent or null is no
// salt; anything but a non-empty string, or a string over 128 characters
// or holding '@', '/', '\' or NUL, is a 400.
func parseCacheSalt(raw json.RawMessage) (string, *apiError) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil || s == "" {
		return "", &apiError{status: http.StatusBadRequest, typ: "BadRequestError", message: errCacheSaltNotStr, param: "cache_salt"}
	}
	if utf8.RuneCountInString(s) > maxCacheSaltLen || strings.ContainsAny(s, cacheSaltForbidden) {
		return "", &apiError{status: http.StatusBadRequest, typ: "BadRequestError", message: errCacheSaltTooLong, param: "cache_salt"}
	}
	return s, nil
}

// kvCacheReportFull reads vLLM 0.32's per-request kv_cache_report_mode
// from vllm_xargs (v1/request.py reads it from sampling_params.extra_args):
// "full" asks for reuse reports (a BlockStored of the cached blocks a
// prefix-cache lookup finds); any other value, or none, is "incremental",
// without validation. A vllm_xargs that is not an object is decodeBody's
// type error (a 400, as vLLM's dict field); its values are not checked.
func kvCacheReportFull(xargs map[string]json.RawMessage) bool {
	var mode string
	return json.Unmarshal(xargs["kv_cache_report_mode"], &mode) == nil && mode == "full"
}

// missingMessages is vLLM 0.32's 400 for a chat body without messages:
// FastAPI's request validation error, as its handler renders it.
func missingMessages(body []byte) *apiError {
	var top map[string]json.RawMessage
	_ = json.Unmarshal(body, &top)
	return &apiError{status: 400, typ: "Bad Request", param: "body.messages", message: fmt.Sprintf(
		"1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of %d items>'}", len(top))}
}

// parseGen validates a generation body. It mirrors vLLM's 400s.
func (in *Instance) parseGen(body []byte, chat bool, xrid string) (*genReq, *apiError) {
	g := &genReq{chat: chat, xRequestID: xrid}
	if chat {
		g.api = apiChat
	}
	var raw rawGen
	salt, aerr := decodeSalted(body, &raw, &raw.CacheSalt)
	if aerr != nil {
		return g, aerr
	}
	g.cacheSalt = salt
	g.reportCached = kvCacheReportFull(raw.VLLMXargs)
	g.kvRaw = raw.KVTransferParams
	kv, err := decodeKVParams(raw.KVTransferParams)
	if err != nil {
		return g, &apiError{status: 400, typ: "BadRequestError", message: err.Error(), param: "kv_transfer_params"}
	}
	g.kv = kv

	if aerr := in.servedModel(g, raw.Model, fmt.Sprintf(" Valid aliases: %s.", in.cfg.Model)); aerr != nil {
		return g, aerr
	}

	if chat {
		if len(raw.Messages) == 0 || string(raw.Messages) == "null" {
			return g, missingMessages(body)
		}
		msgs, err := parseMessages(raw.Messages)
		if err != nil {
			return g, &apiError{status: 400, typ: "BadRequestError", message: err.Error(), param: "messages"}
		}
		prompt, aerr := renderChat(msgs, raw.AddGenerationPrompt, raw.ContinueFinalMessage)
		if aerr != nil {
			return g, aerr
		}
		g.prompts = [][]uint32{in.tokenize(prompt, raw.AddSpecialTokens != nil && *raw.AddSpecialTokens)}
	} else {
		if len(raw.Prompt) == 0 || string(raw.Prompt) == "null" {
			return g, &apiError{status: 400, typ: "BadRequestError", message: "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)", param: "prompt"}
		}
		add := raw.AddSpecialTokens == nil || *raw.AddSpecialTokens
		prompts, err := parsePrompts(raw.Prompt, func(s string) []uint32 { return in.tokenize(s, add) })
		if err != nil {
			return g, &apiError{status: 400, typ: "BadRequestError", message: err.Error(), param: "prompt"}
		}
		g.prompts = prompts
	}
	for _, p := range g.prompts {
		if len(p) == 0 {
			return g, &apiError{status: 400, typ: "BadRequestError", message: "The prompt is empty (vllm-sim tokenizes on white space).", param: "prompt"}
		}
	}
	g.promptIDs = g.prompts[0]
	g.digest = oracle.Digest(g.promptIDs)

	if raw.N != nil && *raw.N != 1 {
		return g, &apiError{status: 400, typ: "BadRequestError", message: "vllm-sim supports only n=1", param: "n"}
	}
	maxField, maxVal := "max_tokens", raw.MaxTokens
	if chat && raw.MaxCompletionTokens != nil {
		maxField, maxVal = "max_completion_tokens", raw.MaxCompletionTokens
	}
	L := 0
	for _, p := range g.prompts {
		L = max(L, len(p))
	}
	// vLLM 0.32 checks the prompt alone against the context, then
	// max_tokens alone; a prompt plus max_tokens over the context is
	// accepted and generation stops at the context (finish "length").
	if L >= in.cfg.MaxModelLen {
		n := min(L, in.cfg.MaxModelLen+1) // vLLM tokenizes at most max_model_len+1
		return g, &apiError{status: 400, typ: "BadRequestError", param: "input_tokens", message: fmt.Sprintf(
			"This model's maximum context length is %d tokens. However, your prompt contains at least %d input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=%d)",
			in.cfg.MaxModelLen, n, n)}
	}
	switch {
	case maxVal != nil:
		if *maxVal < 1 {
			return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("%s must be at least 1, got %d. (parameter=%s, value=%d)", maxField, *maxVal, maxField, *maxVal), param: maxField}
		}
		if *maxVal > in.cfg.MaxModelLen {
			return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf(
				"%s=%d cannot be greater than max_model_len=%d. Please request fewer output tokens. (parameter=%s, value=%d)",
				maxField, *maxVal, in.cfg.MaxModelLen, maxField, *maxVal), param: maxField}
		}
		g.maxTokens = *maxVal
	case chat:
		g.maxTokens = in.cfg.MaxModelLen - L
	default:
		g.maxTokens = completionsDefaultMaxTokens
	}
	g.maxTokens = min(g.maxTokens, in.cfg.MaxModelLen-L)
	if raw.MinTokens != nil {
		if *raw.MinTokens < 0 {
			return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("min_tokens must be greater than or equal to 0, got %d.", *raw.MinTokens), param: "min_tokens"}
		}
		if *raw.MinTokens > g.maxTokens {
			return g, &apiError{status: 400, typ: "BadRequestError", message: fmt.Sprintf("min_tokens must be less than or equal to max_tokens=%d, got %d.", g.maxTokens, *raw.MinTokens), param: "min_tokens"}
		}
		g.minTokens = *raw.MinTokens
	}
	g.stream = raw.Stream != nil && *raw.Stream
	if raw.StreamOptions != nil {
		if !g.stream {
			return g, &apiError{status: 400, typ: "BadRequestError", message: "Stream options can only be defined when `stream=True`.", param: "stream_options"}
		}
		g.includeUsage = raw.StreamOptions.IncludeUsage != nil && *raw.StreamOptions.IncludeUsage
		g.continuousUsage = raw.StreamOptions.ContinuousUsageStats != nil && *raw.StreamOptions.ContinuousUsageStats
	}
	g.ignoreEOS = raw.IgnoreEOS != nil && *raw.IgnoreEOS
	prio, perr := in.priority(raw.Priority)
	if perr != nil {
		return g, perr
	}
	g.priority = prio
	g.returnTokenIDs = raw.ReturnTokenIDs != nil && *raw.ReturnTokenIDs
	g.seed = in.cfg.Seed
	if raw.Seed != nil {
		g.seed = *raw.Seed
	}
	id := xrid
	if id == "" {
		id = randomHex()
	}
	if chat {
		g.requestID = "chatcmpl-" + id
	} else {
		g.requestID = "cmpl-" + id
	}
	g.respID = g.requestID
	return g, nil
}

// priority checks a request's "priority" field: vLLM's input processor
// raises this ValueError (a 400) for a non-zero priority unless the engine
// runs --scheduling-policy priority.
func (in *Instance) priority(p *int) (int, *apiError) {
	if p == nil {
		return 0, nil
	}
	if *p != 0 && !in.cfg.Engine.Priority() {
		return 0, badRequest("Got priority %d but Priority scheduling is not enabled.", *p)
	}
	return *p, nil
}

// renderChat applies the chat template as vLLM does with its template
// options: continue_final_message leaves the last message open (the model
// continues it) and cannot be combined with add_generation_prompt (true by
// default); add_generation_prompt=false omits the trailing assistant marker.
func renderChat(msgs []oracle.Message, addGen, cont *bool) (string, *apiError) {
	add := addGen == nil || *addGen
	if cont != nil && *cont {
		if add && addGen != nil {
			return "", &apiError{status: 400, typ: "BadRequestError", param: "continue_final_message",
				message: "Cannot set both `continue_final_message` and `add_generation_prompt` to True."}
		}
		return oracle.ChatPromptContinue(msgs), nil
	}
	p := oracle.ChatPrompt(msgs)
	if !add {
		p = strings.TrimSuffix(p, "<|assistant|>")
	}
	return p, nil
}

// parsePrompts accepts what vLLM's completions API accepts: a string, a
// list of strings (one prompt each), a list of token ids (one prompt), or a
// list of lists of token ids (one prompt each).
func parsePrompts(raw json.RawMessage, tokenize func(string) []uint32) ([][]uint32, error) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return [][]uint32{tokenize(s)}, nil
	}
	var ss []string
	if err := json.Unmarshal(raw, &ss); err == nil {
		if len(ss) == 0 {
			return nil, errors.New("prompt must not be an empty list")
		}
		out := make([][]uint32, len(ss))
		for i, s := range ss {
			out[i] = tokenize(s)
		}
		return out, nil
	}
	var ids []uint32
	if err := json.Unmarshal(raw, &ids); err == nil {
		if len(ids) == 0 {
			return nil, errors.New("prompt must not be an empty list")
		}
		return [][]uint32{ids}, nil
	}
	var idss [][]uint32
	if err := json.Unmarshal(raw, &idss); err == nil {
		if len(idss) == 0 {
			return nil, errors.New("prompt must not be an empty list")
		}
		return idss, nil
	}
	return nil, errors.New("prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids")
}

// parseMessages flattens chat messages; content may be a string, null, or a
// list of parts whose non-empty "text" parts are joined with newlines, as
// vLLM joins them for a template taking string content
// (renderers/chat_utils.py, _parse_chat_message_content_parts).
func parseMessages(raw json.RawMessage) ([]oracle.Message, error) {
	var msgs []struct {
		Role    *string         `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, errors.New("messages must be a list of objects")
	}
	if len(msgs) == 0 {
		return nil, errors.New("messages must not be empty")
	}
	out := make([]oracle.Message, 0, len(msgs))
	for i, m := range msgs {
		if m.Role == nil || *m.Role == "" {
			return nil, fmt.Errorf("messages[%d].role is required", i)
		}
		var text string
		switch {
		case len(m.Content) == 0 || string(m.Content) == "null":
		default:
			if err := json.Unmarshal(m.Content, &text); err != nil {
				var parts []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				}
				if err := json.Unmarshal(m.Content, &parts); err != nil {
					return nil, fmt.Errorf("messages[%d].content must be a string or a list of content parts", i)
				}
				var b strings.Builder
				for _, p := range parts {
					if (p.Type == "text" || p.Type == "") && p.Text != "" {
						if b.Len() > 0 {
							b.WriteByte('\n')
						}
						b.WriteString(p.Text)
					}
				}
				text = b.String()
			}
		}
		out = append(out, oracle.Message{Role: *m.Role, Content: text})
	}
	return out, nil
}

// chunkWriter renders SSE events for one request with precomputed framing.
type chunkWriter struct {
	g      *genReq
	prefix []byte // `data: {"id":...,"model":...,"choices":[{"index":0,`
	buf    []byte
}

func newChunkWriter(g *genReq) *chunkWriter {
	obj := "text_completion"
	if g.chat {
		obj = "chat.completion.chunk"
	}
	var p []byte
	p = append(p, `data: {"id":`...)
	p = rawjson.AppendString(p, g.respID)
	p = append(p, `,"object":"`...)
	p = append(p, obj...)
	p = append(p, `","created":`...)
	p = strconv.AppendInt(p, g.created, 10)
	p = append(p, `,"model":`...)
	p = rawjson.AppendString(p, g.model)
	return &chunkWriter{g: g, prefix: p}
}

func appendUsage(b []byte, prompt, completion int) []byte {
	b = append(b, `{"prompt_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt), 10)
	b = append(b, `,"total_tokens":`...)
	b = strconv.AppendInt(b, int64(prompt+completion), 10)
	b = append(b, `,"completion_tokens":`...)
	b = strconv.AppendInt(b, int64(completion), 10)
	return append(b, '}')
}

// roleChunk is the chat stream's first event: delta {role, content: ""}.
func (c *chunkWriter) roleChunk() []byte {
	b := append(c.buf[:0], c.prefix...)
	b = append(b, `,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`...)
	if c.g.returnTokenIDs { // vLLM: the prompt's ids in the first chunk only
		b = append(b, `,"prompt_token_ids":`...)
		b = appendIDs(b, c.g.promptIDs)
	}
	if c.g.continuousUsage {
		b = append(b, `,"usage":`...)
		b = appendUsage(b, len(c.g.promptIDs), 0)
	}
	b = append(b, "}\n\n"...)
	c.buf = b
	return b
}

// tokenChunk renders one token event of choice index; finish is "" while
// unfinished; promptTokens/completionTokens are that choice's counts.
// With return_token_ids it carries the token's id (token_ids) and, in a
// completion's first chunk of the choice, the choice's prompt_token_ids.
func (c *chunkWriter) tokenChunk(index int, piece string, id uint32, prompt []uint32, finish string, promptTokens, completionTokens int) []byte {
	b := append(c.buf[:0], c.prefix...)
	b = append(b, `,"choices":[{"index":`...)
	b = strconv.AppendInt(b, int64(index), 10)
	if c.g.chat {
		b = append(b, `,"delta":{"content":`...)
		b = rawjson.AppendString(b, piece)
		b = append(b, `},"logprobs":null,"finish_reason":`...)
	} else {
		b = append(b, `,"text":`...)
		b = rawjson.AppendString(b, piece)
		b = append(b, `,"logprobs":null,"finish_reason":`...)
	}
	if finish == "" {
		b = append(b, "null"...)
	} else {
		b = rawjson.AppendString(b, finish)
	}
	b = append(b, `,"stop_reason":null`...)
	if c.g.returnTokenIDs {
		if !c.g.chat && completionTokens == 1 {
			b = append(b, `,"prompt_token_ids":`...)
			b = appendIDs(b, prompt)
		}
		b = append(b, `,"token_ids":[`...)
		b = strconv.AppendUint(b, uint64(id), 10)
		b = append(b, ']')
	}
	b = append(b, "}]"...)
	if c.g.continuousUsage {
		b = append(b, `,"usage":`...)
		b = appendUsage(b, promptTokens, completionTokens)
	}
	b = append(b, "}\n\n"...)
	c.buf = b
	return b
}

// usageChunk is the final include_usage event (choices: []), summed over
// the choices; details (optional) extends the usage object.
func (c *chunkWriter) usageChunk(promptTokens, completionTokens int, details func([]byte) []byte) []byte {
	b := append(c.buf[:0], c.prefix...)
	b = append(b, `,"choices":[],"usage":`...)
	b = appendUsage(b, promptTokens, completionTokens)
	if details != nil {
		b = details(b)
	}
	b = append(b, "}\n\n"...)
	c.buf = b
	return b
}

// appendIDs appends ids as a JSON array.
func appendIDs(b []byte, ids []uint32) []byte {
	b = append(b, '[')
	for i, id := range ids {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(id), 10)
	}
	return append(b, ']')
}

func errorEvent(e *apiError) []byte {
	b := append([]byte("data: "), errorBody(e)...)
	return append(b, "\n\n"...)
}

var doneEvent = []byte("data: [DONE]\n\n")

// completionResponse is the non-streaming /v1/completions body (§5.2).
type completionResponse struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Choices           []completionChoice `json:"choices"`
	Usage             usage              `json:"usage"`
	SystemFingerprint *string            `json:"system_fingerprint"`
	ServiceTier       *string            `json:"service_tier"`
	KVTransferParams  any                `json:"kv_transfer_params"`
}

type completionChoice struct {
	Index          int     `json:"index"`
	Text           string  `json:"text"`
	Logprobs       any     `json:"logprobs"`
	FinishReason   *string `json:"finish_reason"`
	StopReason     any     `json:"stop_reason"`
	PromptLogprobs any     `json:"prompt_logprobs"`
	// return_token_ids (vLLM ≥ 0.10.2); absent otherwise.
	PromptTokenIDs []uint32 `json:"prompt_token_ids,omitempty"`
	TokenIDs       []uint32 `json:"token_ids,omitempty"`
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails any `json:"prompt_tokens_details"`
}

// chatResponse is the non-streaming /v1/chat/completions body.
type chatResponse struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []chatChoice `json:"choices"`
	Usage             usage        `json:"usage"`
	PromptLogprobs    any          `json:"prompt_logprobs"`
	SystemFingerprint *string      `json:"system_fingerprint"`
	ServiceTier       *string      `json:"service_tier"`
	KVTransferParams  any          `json:"kv_transfer_params"`
	PromptTokenIDs    []uint32     `json:"prompt_token_ids,omitempty"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     any         `json:"logprobs"`
	FinishReason *string     `json:"finish_reason"`
	StopReason   any         `json:"stop_reason"`
	TokenIDs     []uint32    `json:"token_ids,omitempty"`
}

type chatMessage struct {
	Role             string  `json:"role"`
	Content          string  `json:"content"`
	ReasoningContent *string `json:"reasoning_content"`
	ToolCalls        []any   `json:"tool_calls"`
}

// servedModel sets g's model from the request's: the model itself (also
// when absent), or a LoRA adapter the engine holds; else vLLM's 404 (with
// the endpoint's own tail on its message).
func (in *Instance) servedModel(g *genReq, model *string, tail string) *apiError {
	g.model = in.cfg.Model
	if model == nil || *model == "" || *model == in.cfg.Model {
		return nil
	}
	a, ok := in.lora.get(*model)
	if !ok {
		return &apiError{status: http.StatusNotFound, typ: "NotFoundError", message: fmt.Sprintf("The model `%s` does not exist.%s", *model, tail), param: "model"}
	}
	g.model, g.lora = a.name, a
	return nil
}
