package migrate

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// Refusal reasons: why an answer cannot be continued (metric label values).
const (
	RefuseRoute          = "route"             // not /v1/completions or /v1/chat/completions
	RefuseBody           = "body"              // not a JSON object the router can read
	RefuseN              = "n"                 // n > 1: several answers in one stream
	RefuseBestOf         = "best_of"           // best_of > 1 / beam search
	RefuseBatch          = "batched_prompt"    // a list of prompts
	RefuseEcho           = "echo"              // the answer repeats the prompt
	RefuseSuffix         = "suffix"            // insertion, not continuation
	RefuseLogprobs       = "logprobs"          // completions' logprobs carry text offsets
	RefusePromptLogprobs = "prompt_logprobs"   // would be the longer prompt's
	RefuseStructured     = "structured_output" // a grammar cannot resume mid-answer
	RefuseToolCall       = "tool_call"         // a tool call was cut halfway
	RefuseReasoning      = "reasoning"         // reasoning content cannot be re-sent as a prefix
	RefuseTokenPrompt    = "token_prompt"      // token-id prompt, answer without token ids
	RefuseFinalContent   = "final_message"     // continue_final_message with non-text content
	RefuseStream         = "stream"            // an event the router could not read
)

// ErrNothingLeft is returned by Continue when the token budget is spent:
// the answer is complete and only its end is missing.
var ErrNothingLeft = errors.New("migrate: no tokens left to generate")

// Request is a client's generation request as the continuation builder
// needs it. It never changes the client's body.
type Request struct {
	chat bool
	obj  *rawjson.Object

	maxKey    string // the limit's field, "" when absent
	maxTokens int    // -1 when absent
	minTokens int
	stops     []string

	promptText *string
	promptIDs  []uint32
	messages   []json.RawMessage
	contFinal  bool // the client already continues its final message

	includeUsage bool
	always       string // refusal whatever was generated
	started      string // refusal once tokens were delivered
}

// completionsDefaultMaxTokens is vLLM's default max_tokens for completions.
const completionsDefaultMaxTokens = 16

// NewRequest parses a /v1/completions or /v1/chat/completions body.
func NewRequest(route string, body []byte) *Request {
	r := &Request{maxTokens: -1}
	switch route {
	case "/v1/completions":
	case "/v1/chat/completions":
		r.chat = true
	default:
		r.always = RefuseRoute
		return r
	}
	obj, err := rawjson.Parse(body)
	if err != nil {
		r.always = RefuseBody
		return r
	}
	r.obj = obj
	r.always = r.parse()
	return r
}

// Chat reports whether this is a chat completion.
func (r *Request) Chat() bool { return r.chat }

// Stops returns the request's stop strings.
func (r *Request) Stops() []string { return r.stops }

// IncludeUsage reports whether the client asked for the usage chunk.
func (r *Request) IncludeUsage() bool { return r.includeUsage }

func (r *Request) parse() string {
	o := r.obj
	if n, ok := o.Int("n"); ok && n > 1 {
		return RefuseN
	}
	if n, ok := o.Int("best_of"); ok && n > 1 {
		return RefuseBestOf
	}
	if b, _ := o.Bool("use_beam_search"); b {
		return RefuseBestOf
	}
	if b, _ := o.Bool("echo"); b {
		return RefuseEcho
	}
	if s, ok := o.String("suffix"); ok && s != "" {
		return RefuseSuffix
	}
	if !o.IsNull("prompt_logprobs") && o.Has("prompt_logprobs") {
		return RefusePromptLogprobs
	}
	if !r.chat && o.Has("logprobs") && !o.IsNull("logprobs") {
		return RefuseLogprobs
	}
	for _, k := range []string{"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"} {
		if o.Has(k) && !o.IsNull(k) && !(k == "response_format" && isTextFormat(o.Get(k))) {
			r.started = RefuseStructured
		}
	}
	if s := o.Get("stream_options"); s != nil {
		var so struct {
			IncludeUsage *bool `json:"include_usage"`
		}
		_ = json.Unmarshal(s, &so)
		r.includeUsage = so.IncludeUsage != nil && *so.IncludeUsage
	}
	if s := o.Get("stop"); s != nil && string(s) != "null" {
		var one string
		if json.Unmarshal(s, &one) == nil {
			r.stops = []string{one}
		} else if json.Unmarshal(s, &r.stops) != nil {
			return RefuseBody
		}
	}
	if n, ok := o.Int("min_tokens"); ok {
		r.minTokens = int(n)
	}
	r.maxKey = "max_tokens"
	if r.chat && o.Has("max_completion_tokens") && !o.IsNull("max_completion_tokens") {
		r.maxKey = "max_completion_tokens"
	}
	if n, ok := o.Int(r.maxKey); ok {
		r.maxTokens = int(n)
	} else if !r.chat {
		r.maxTokens = completionsDefaultMaxTokens
	} else {
		r.maxKey = ""
	}
	if r.chat {
		return r.parseChat()
	}
	return r.parsePrompt()
}

func isTextFormat(v []byte) bool {
	var f struct {
		Type string `json:"type"`
	}
	return json.Unmarshal(v, &f) == nil && f.Type == "text"
}

func (r *Request) parseChat() string {
	if err := json.Unmarshal(r.obj.Get("messages"), &r.messages); err != nil || len(r.messages) == 0 {
		return RefuseBody
	}
	if b, _ := r.obj.Bool("continue_final_message"); b {
		r.contFinal = true
		var last struct {
			Content json.RawMessage `json:"content"`
		}
		var s string
		if json.Unmarshal(r.messages[len(r.messages)-1], &last) != nil || json.Unmarshal(last.Content, &s) != nil {
			return RefuseFinalContent
		}
	}
	return ""
}

func (r *Request) parsePrompt() string {
	p := r.obj.Get("prompt")
	var s string
	if json.Unmarshal(p, &s) == nil {
		r.promptText = &s
		return ""
	}
	var ids []uint32
	if json.Unmarshal(p, &ids) == nil && len(ids) > 0 {
		r.promptIDs = ids
		return ""
	}
	var many []json.RawMessage
	if json.Unmarshal(p, &many) == nil && len(many) == 1 {
		if json.Unmarshal(many[0], &s) == nil {
			r.promptText = &s
			return ""
		}
		if json.Unmarshal(many[0], &ids) == nil && len(ids) > 0 {
			r.promptIDs = ids
			return ""
		}
	}
	if len(many) > 1 {
		return RefuseBatch
	}
	return RefuseBody
}

// Refusal returns why the answer t tracks cannot be continued, or "".
// Nothing delivered yet (no token) makes most refusals moot: the
// continuation is then the original request itself.
func (r *Request) Refusal(t *Tracker) string {
	if r.always != "" {
		return r.always
	}
	if t.unreadable {
		return RefuseStream
	}
	if t.Tokens() == 0 && t.Text() == "" && !t.toolCall && !t.reasoning {
		return ""
	}
	switch {
	case r.started != "":
		return r.started
	case t.toolCall:
		return RefuseToolCall
	case t.reasoning:
		return RefuseReasoning
	}
	if !r.chat && r.promptText == nil {
		if _, _, ok := t.TokenIDs(); !ok {
			return RefuseTokenPrompt
		}
	}
	return ""
}

// Continue returns the body of the continuation request: the client's
// body with only the members the continuation needs changed (prompt or
// messages, the token limits, the chat template options; stream is
// forced on for a streamed answer by the caller's body already).
func (r *Request) Continue(t *Tracker) ([]byte, error) {
	if why := r.Refusal(t); why != "" {
		return nil, fmt.Errorf("migrate: cannot continue: %s", why)
	}
	k := t.Tokens() - r.redo(t)
	var edits []rawjson.Edit
	if r.maxKey != "" {
		left := r.maxTokens - k
		if left <= 0 {
			return nil, ErrNothingLeft
		}
		edits = append(edits, rawjson.Set(r.maxKey, strconv.AppendInt(nil, int64(left), 10)))
	}
	if r.minTokens > 0 {
		edits = append(edits, rawjson.Set("min_tokens", strconv.AppendInt(nil, int64(max(0, r.minTokens-k)), 10)))
	}
	if k == 0 && t.Text() == "" {
		return r.obj.Apply(edits...), nil
	}
	if r.chat {
		e, err := r.chatEdits(t)
		if err != nil {
			return nil, err
		}
		edits = append(edits, e...)
	} else {
		edits = append(edits, r.promptEdit(t))
	}
	return r.obj.Apply(edits...), nil
}

// promptEdit is the completion's new prompt: prompt + answer so far, as
// token ids when the tracker has every id (exact whatever the tokenizer),
// else as text.
func (r *Request) promptEdit(t *Tracker) rawjson.Edit {
	if gen, prompt, ok := t.TokenIDs(); ok {
		if r.promptIDs != nil {
			prompt = r.promptIDs
		}
		gen = gen[:len(gen)-r.redo(t)]
		ids := make([]uint32, 0, len(prompt)+len(gen))
		return rawjson.SetJSON("prompt", append(append(ids, prompt...), gen...))
	}
	return rawjson.SetJSON("prompt", *r.promptText+t.Text())
}

// redo is how many delivered tokens the continuation generates again: the
// trailing tokens whose text the engine still held back (parts of a UTF-8
// character). A completion continued from token ids restarts before them
// (greedy decoding gives the same ids); a text continuation (chat, or a
// completion without ids) ends before their bytes, so the engine generates
// them again (measured on vLLM 0.32). The stitcher drops the ids the
// client already has, their text then arrives whole, and the token budget
// counts them once.
func (r *Request) redo(t *Tracker) int { return t.HeldBack() }

// chatEdits puts the partial answer in an open final assistant message.
func (r *Request) chatEdits(t *Tracker) ([]rawjson.Edit, error) {
	msgs := make([]json.RawMessage, len(r.messages), len(r.messages)+1)
	copy(msgs, r.messages)
	if r.contFinal {
		var last map[string]json.RawMessage
		var prev string
		if err := json.Unmarshal(msgs[len(msgs)-1], &last); err != nil {
			return nil, err
		}
		if err := json.Unmarshal(last["content"], &prev); err != nil {
			return nil, err
		}
		c, _ := json.Marshal(prev + t.Text())
		last["content"] = c
		b, err := json.Marshal(last)
		if err != nil {
			return nil, err
		}
		msgs[len(msgs)-1] = b
	} else {
		b, _ := json.Marshal(struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		}{"assistant", t.Text()})
		msgs = append(msgs, b)
	}
	m, err := json.Marshal(msgs)
	if err != nil {
		return nil, err
	}
	return []rawjson.Edit{
		rawjson.Set("messages", m),
		rawjson.Set("continue_final_message", []byte("true")),
		rawjson.Set("add_generation_prompt", []byte("false")),
	}, nil
}

// MaxTokens returns the answer's token limit (-1: none given for chat).
func (r *Request) MaxTokens() int { return r.maxTokens }

// Complete reports whether the answer t tracks needs no continuation: its
// finish_reason reached the client, or its whole token budget did; only
// the end of the stream is missing.
func (r *Request) Complete(t *Tracker) bool {
	return t.Finished() != "" || (r.maxKey != "" && t.Tokens() >= r.maxTokens)
}

// Ending returns the events that end a complete answer whose stream broke
// before its end: a last chunk with finish_reason "length" when none was
// sent, the usage chunk the client asked for when it had not come (if the
// prompt's token count is known), then [DONE].
func (r *Request) Ending(t *Tracker) []byte {
	var b []byte
	env := func() []byte {
		e := append([]byte(`{"id":`), t.ID...)
		e = append(append(e, `,"created":`...), t.Created...)
		return append(append(e, `,"model":`...), t.Model...)
	}
	if t.ID != nil && t.Finished() == "" {
		c := `{"index":0,"text":"","logprobs":null,"finish_reason":"length"}`
		if r.chat {
			c = `{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}`
		}
		b = append(b, dataEvent(append(append(append(env(), `,"choices":[`...), c...), "]}"...))...)
	}
	if p := t.PromptTokens(); t.ID != nil && r.includeUsage && !t.UsageSent() && p >= 0 {
		u := fmt.Sprintf(`,"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}}`, p, p+t.Tokens(), t.Tokens())
		b = append(b, dataEvent(append(env(), u...))...)
	}
	return append(b, "data: [DONE]\n\n"...)
}
