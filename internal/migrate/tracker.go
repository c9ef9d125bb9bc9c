package migrate

import (
	"encoding/json"
	"time"
)

// chunk is the part of a completion / chat completion SSE chunk the
// tracker reads (vLLM's CompletionStreamResponse and
// ChatCompletionStreamResponse, with return_token_ids' fields).
type chunk struct {
	ID             json.RawMessage `json:"id"`
	Created        json.RawMessage `json:"created"`
	Model          json.RawMessage `json:"model"`
	Choices        []choice        `json:"choices"`
	PromptTokenIDs []uint32        `json:"prompt_token_ids"` // chat, first chunk
	Usage          *usage          `json:"usage"`
	Error          json.RawMessage `json:"error"`
}

type choice struct {
	Index          int             `json:"index"`
	Text           *string         `json:"text"`
	Delta          *delta          `json:"delta"`
	FinishReason   *string         `json:"finish_reason"`
	TokenIDs       []uint32        `json:"token_ids"`
	PromptTokenIDs []uint32        `json:"prompt_token_ids"` // completions, first chunk
	Logprobs       json.RawMessage `json:"logprobs"`
}

type delta struct {
	Role             *string         `json:"role"`
	Content          *string         `json:"content"`
	ToolCalls        json.RawMessage `json:"tool_calls"`
	ReasoningContent *string         `json:"reasoning_content"`
	Reasoning        *string         `json:"reasoning"`
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// Tracker is what the client has received of one streamed answer (choice
// 0; batched prompts and n > 1 are refused). Feed it every event written
// to the client, in order.
type Tracker struct {
	// Original's envelope, raw JSON values (nil until the first chunk).
	ID, Created, Model json.RawMessage

	text      []byte
	ids       []uint32
	idsOK     bool // every token chunk so far carried token_ids
	promptIDs []uint32
	tokens    int
	// heldBack: the trailing delivered ids whose chunks had no text (vLLM
	// holds back the text of a token that ends mid-character until the
	// character is complete).
	heldBack  int
	usageCT   int // completion_tokens of the latest usage seen (-1 none)
	promptTok int // prompt_tokens of the first usage seen (-1 none)

	roleSent  bool
	finish    string
	usageSeen bool
	done      bool
	errEvent  bool
	toolCall  bool
	reasoning bool
	// unreadable: an event the tracker could not read reached the client,
	// so the answer so far is not known for sure.
	unreadable bool
	chunks     int
	lastWrite  time.Time // set by the Writer, once per write

	sc       scratch  // the fast scanner's reused storage
	tmpl     template // the latest plain token event (template.go)
	tmplHits int      // events read through the template (tests)
	slow     bool     // encoding/json only (tests: the reference)
}

// NewTracker returns an empty tracker.
func NewTracker() *Tracker { return &Tracker{idsOK: true, usageCT: -1, promptTok: -1} }

// Event records one complete SSE event the client received. It returns
// false for an event that is not a well-formed chunk (the tracker then
// cannot vouch for the answer; Refusal reports it).
func (t *Tracker) Event(ev []byte) bool {
	data := eventData(ev)
	if data == nil {
		return true
	}
	if isDone(data) {
		t.done = true
		return true
	}
	c := &t.sc.c
	switch {
	case t.slow:
		c = nil
	case t.ID != nil && t.tmpl.match(data, &t.sc): // envelope settled
		t.chunks++ // a plain token event: only its values count
		t.tmplHits++
		v := &t.sc.tv
		take(t, v.piece, v.has, v.ids, nil)
		return true
	case scanChunk(data, &t.sc):
		t.tmpl.set(data, &t.sc)
	default: // unreadable here: the template stays
		c = nil
	}
	if c == nil {
		c = &chunk{}
		if err := json.Unmarshal(data, c); err != nil {
			t.idsOK, t.unreadable = false, true
			return false
		}
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		t.errEvent = true
		return true
	}
	t.chunks++
	if t.ID == nil { // the scanned values point into data: copy (one allocation)
		env := make([]byte, 0, len(c.ID)+len(c.Created)+len(c.Model))
		t.ID, env = clip(env, c.ID)
		t.Created, env = clip(env, c.Created)
		t.Model, _ = clip(env, c.Model)
	}
	if c.PromptTokenIDs != nil && t.promptIDs == nil {
		t.promptIDs = c.PromptTokenIDs
	}
	if c.Usage != nil {
		t.usageCT = c.Usage.CompletionTokens
		if t.promptTok < 0 {
			t.promptTok = c.Usage.PromptTokens
		}
		if len(c.Choices) == 0 {
			t.usageSeen = true
		}
	}
	for _, ch := range c.Choices {
		t.choice(ch, c.Usage)
	}
	return true
}

func (t *Tracker) choice(ch choice, u *usage) {
	if ch.PromptTokenIDs != nil && t.promptIDs == nil {
		t.promptIDs = ch.PromptTokenIDs
	}
	piece := ""
	has := false
	if ch.Text != nil {
		piece, has = *ch.Text, true
	}
	if d := ch.Delta; d != nil {
		if d.Role != nil {
			t.roleSent = true
		}
		if d.Content != nil {
			piece, has = *d.Content, true
		}
		if len(d.ToolCalls) > 0 && string(d.ToolCalls) != "null" && string(d.ToolCalls) != "[]" {
			t.toolCall = true
		}
		if (d.ReasoningContent != nil && *d.ReasoningContent != "") || (d.Reasoning != nil && *d.Reasoning != "") {
			t.reasoning = true
		}
	}
	take(t, piece, has, ch.TokenIDs, u)
	if ch.FinishReason != nil && *ch.FinishReason != "" {
		t.finish = *ch.FinishReason
	}
}

// clip appends v to buf and returns the appended copy (nil for nil v) and
// the grown buf.
func clip(buf, v []byte) (json.RawMessage, []byte) {
	if v == nil {
		return nil, buf
	}
	n := len(buf)
	buf = append(buf, v...)
	return buf[n:len(buf):len(buf)], buf
}

// take counts one choice's text piece (has: the chunk carried a text or
// content value) and token ids.
func take[T string | []byte](t *Tracker, piece T, has bool, ids []uint32, u *usage) {
	if t.text == nil && len(piece) > 0 {
		t.text = make([]byte, 0, 512) // a few hundred tokens' text before it grows
	}
	t.text = append(t.text, piece...)
	switch {
	case ids != nil:
		t.ids = append(t.ids, ids...)
		t.tokens += len(ids)
		if len(piece) == 0 {
			t.heldBack += len(ids)
		} else {
			t.heldBack = 0
		}
	case u != nil:
		t.idsOK = t.idsOK && len(piece) == 0
		t.tokens = u.CompletionTokens
	case has && len(piece) != 0:
		t.idsOK = false
		t.tokens++
	}
}

// Text is the answer text the client received.
func (t *Tracker) Text() string { return string(t.text) }

// Tokens is the number of completion tokens the client received: exact
// when the chunks carry token_ids or continuous usage, else one per
// non-empty chunk (vLLM streams one token per chunk unless speculative
// decoding or a stream interval batches them).
func (t *Tracker) Tokens() int { return t.tokens }

// HeldBack is how many of the last delivered tokens came without text
// (their text is held back by the engine until a character completes).
// A token-id continuation restarts before them (a token-id prompt that
// ends mid-character makes vLLM 0.32 stream the whole prompt's text with
// its first token); a chat continuation, whose text lacks their bytes,
// generates them again.
func (t *Tracker) HeldBack() int { return t.heldBack }

// TokenIDs returns the generated ids and the prompt's, and whether every
// token the client received came with its id (return_token_ids).
func (t *Tracker) TokenIDs() (gen, prompt []uint32, ok bool) {
	return t.ids, t.promptIDs, t.idsOK && t.promptIDs != nil && len(t.ids) == t.tokens
}

// PromptTokens is the original prompt's token count when a usage object
// reported it, else -1.
func (t *Tracker) PromptTokens() int {
	if t.promptTok >= 0 {
		return t.promptTok
	}
	if t.promptIDs != nil {
		return len(t.promptIDs)
	}
	return -1
}

// RoleSent reports whether the chat role delta reached the client.
func (t *Tracker) RoleSent() bool { return t.roleSent }

// Finished returns the finish_reason the client received ("" if none).
func (t *Tracker) Finished() string { return t.finish }

// Done reports whether "[DONE]" reached the client.
func (t *Tracker) Done() bool { return t.done }

// UsageSent reports whether the final usage chunk reached the client.
func (t *Tracker) UsageSent() bool { return t.usageSeen }

// ErrorEvent reports whether an error event was seen (the caller holds it
// back from the client and migrates instead).
func (t *Tracker) ErrorEvent() bool { return t.errEvent }

// ClearError forgets an error event after a migration took over.
func (t *Tracker) ClearError() { t.errEvent = false; t.done = false }

// Chunks is the number of chunks (not [DONE], not errors) received.
func (t *Tracker) Chunks() int { return t.chunks }

// LastWrite is when the latest event reached the client.
func (t *Tracker) LastWrite() time.Time { return t.lastWrite }
