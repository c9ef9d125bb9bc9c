package migrate

import (
	"encoding/json"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// Stitcher rewrites the events of one continuation leg so the client sees
// them as the rest of the original answer. Build one per leg with
// NewStitcher, after the tracker has recorded everything the client got.
type Stitcher struct {
	t    *Tracker
	chat bool
	base int // tokens delivered before this leg, less those it generates again
	skip int // ids this leg generates again: already delivered, dropped
	// redoIDs are those ids as delivered, when the tracker has them: a
	// leg id that differs ends the skipping (the continuation went
	// another way, its ids are new).
	redoIDs []uint32
	// extra is the budget the continuation got for tokens it did not
	// generate again after all (a redone id differed): the leg may end one
	// past the client's limit, and that last token is dropped.
	extra, dropped int
	prompt         int // the original prompt's tokens (-1: derive from the leg's usage)
	// Stop-string seam: the tail of the delivered text that a stop string
	// could start in, and how much of the leg's text may still complete one.
	stops    []string
	tail     string
	keep     int // longest stop string - 1: where one can start
	seamLeft int
}

// NewStitcher prepares the rewrite of a continuation leg of req after what
// t has recorded.
func NewStitcher(req *Request, t *Tracker) *Stitcher {
	redo := req.redo(t)
	s := &Stitcher{t: t, chat: req.chat, base: t.Tokens() - redo, skip: redo, prompt: t.PromptTokens(), stops: req.stops}
	if gen, _, ok := t.TokenIDs(); ok && redo > 0 {
		s.redoIDs = gen[len(gen)-redo:]
	}
	longest := 0
	for _, st := range req.stops {
		longest = max(longest, len(st))
	}
	if longest > 1 {
		text := t.Text()
		s.tail = text[max(0, len(text)-(longest-1)):]
		s.keep, s.seamLeft = longest-1, longest-1
	}
	return s
}

// Rewrite returns the event to write to the client in place of ev (nil:
// drop it) and whether the answer ends with it (a stop string completed
// across the cut: the caller writes "data: [DONE]" and stops reading the
// leg). Events it cannot read pass unchanged.
func (s *Stitcher) Rewrite(ev []byte) (out []byte, final bool) {
	data := eventData(ev)
	if data == nil || isDone(data) {
		return ev, false
	}
	var c chunk
	if json.Unmarshal(data, &c) != nil || (len(c.Error) > 0 && string(c.Error) != "null") {
		return ev, false
	}
	obj, err := rawjson.Parse(data)
	if err != nil {
		return ev, false
	}
	var edits []rawjson.Edit
	if s.t.ID != nil {
		edits = append(edits, rawjson.Set("id", s.t.ID), rawjson.Set("created", s.t.Created), rawjson.Set("model", s.t.Model))
	}
	if c.PromptTokenIDs != nil && s.t.promptIDs != nil {
		edits = append(edits, rawjson.Delete("prompt_token_ids"))
	}
	if c.Usage != nil {
		edits = append(edits, rawjson.SetJSON("usage", s.usage(obj.Get("usage"), *c.Usage)))
	}
	if len(c.Choices) > 0 {
		choices, drop, fin := s.choices(obj.Get("choices"), c.Choices)
		if drop {
			return nil, false
		}
		if choices != nil {
			edits = append(edits, rawjson.Set("choices", choices))
		}
		final = fin
	}
	return dataEvent(obj.Apply(edits...)), final
}

// usage counts over the whole answer: the original prompt, and every
// completion token the client received.
func (s *Stitcher) usage(raw []byte, u usage) map[string]json.RawMessage {
	m := map[string]json.RawMessage{}
	_ = json.Unmarshal(raw, &m)
	p := s.prompt
	if p < 0 {
		p = max(0, u.PromptTokens-s.base)
	}
	ct := s.base + u.CompletionTokens - s.dropped
	m["prompt_tokens"] = itoa(p)
	m["completion_tokens"] = itoa(ct)
	m["total_tokens"] = itoa(p + ct)
	return m
}

func itoa(n int) json.RawMessage {
	b, _ := json.Marshal(n)
	return b
}

// choices rewrites the choice list when needed (nil: unchanged): the
// second chat role delta goes (drop: the whole event was only that), a
// second prompt_token_ids goes, and a stop string completed across the
// seam ends the answer.
func (s *Stitcher) choices(raw []byte, cs []choice) (out []byte, drop, final bool) {
	var list []map[string]json.RawMessage
	if json.Unmarshal(raw, &list) != nil || len(list) != len(cs) {
		return nil, false, false
	}
	changed := false
	for i, ch := range cs {
		m := list[i]
		if ch.PromptTokenIDs != nil && s.t.promptIDs != nil {
			delete(m, "prompt_token_ids")
			changed = true
		}
		piece := ""
		if ch.Text != nil {
			piece = *ch.Text
		}
		if d := ch.Delta; d != nil {
			if d.Content != nil {
				piece = *d.Content
			}
			if d.Role != nil && s.t.RoleSent() {
				if piece == "" && len(cs) == 1 && ch.FinishReason == nil && len(d.ToolCalls) == 0 {
					return nil, true, false
				}
				var dm map[string]json.RawMessage
				_ = json.Unmarshal(m["delta"], &dm)
				delete(dm, "role")
				m["delta"], _ = json.Marshal(dm)
				changed = true
			}
		}
		ids := ch.TokenIDs
		if s.skip > 0 && len(ids) > 0 {
			n := s.redone(ids)
			if n == len(ids) && piece == "" && len(cs) == 1 && ch.FinishReason == nil {
				return nil, true, false // a token the client already has, with no text
			}
			if n > 0 {
				ids = ids[n:]
				m["token_ids"], _ = json.Marshal(ids)
				changed = true
			}
		}
		if s.extra > 0 && len(ids) > 0 && ch.FinishReason != nil && *ch.FinishReason == "length" {
			// The leg's last tokens are past the client's limit.
			n := min(s.extra, len(ids))
			s.extra -= n
			s.dropped += n
			m["token_ids"], _ = json.Marshal(ids[:len(ids)-n])
			if n == len(ids) {
				s.clearText(m, ch)
				piece = ""
			}
			changed = true
		}
		if s.seamLeft > 0 && piece != "" {
			if stop, hit := s.seam(piece); hit {
				s.cut(m, ch, stop)
				changed, final = true, true
			}
		}
	}
	if !changed {
		return nil, false, final
	}
	b, err := json.Marshal(list)
	if err != nil {
		return nil, false, false
	}
	return b, false, final
}

// redone is how many of ids, from the first, are tokens delivered before
// (generated again); it consumes them from the skip. Without the delivered
// ids to compare, the next skip ids are taken as redone.
func (s *Stitcher) redone(ids []uint32) int {
	n := 0
	for n < len(ids) && s.skip > 0 {
		if s.redoIDs != nil {
			if ids[n] != s.redoIDs[0] {
				// The rest were delivered and are not generated again:
				// they count among the tokens before this leg.
				s.base += s.skip
				s.extra += s.skip
				s.skip, s.redoIDs = 0, nil
				break
			}
			s.redoIDs = s.redoIDs[1:]
		}
		s.skip--
		n++
	}
	return n
}

// seam reports a stop string that starts in the delivered tail and ends in
// this leg's first characters. Stop strings wholly inside the leg are the
// engine's to find.
func (s *Stitcher) seam(piece string) (stop string, hit bool) {
	look := piece[:min(len(piece), s.seamLeft)]
	combined := s.tail + look
	for _, st := range s.stops {
		for i := max(0, len(s.tail)-len(st)+1); i < len(s.tail); i++ {
			if strings.HasPrefix(combined[i:], st) {
				return st, true
			}
		}
	}
	s.tail = combined[max(0, len(combined)-s.keep):]
	s.seamLeft -= len(look)
	return "", false
}

// clearText empties a choice's text (completions) or content (chat).
func (s *Stitcher) clearText(m map[string]json.RawMessage, ch choice) {
	empty, _ := json.Marshal("")
	if ch.Delta != nil {
		var dm map[string]json.RawMessage
		_ = json.Unmarshal(m["delta"], &dm)
		dm["content"] = empty
		m["delta"], _ = json.Marshal(dm)
	} else {
		m["text"] = empty
	}
}

// cut ends a choice at a stop string that straddled the seam: none of the
// leg's text is shown (the stop string is not part of the answer, as in
// vLLM), finish_reason "stop" with the string as stop_reason.
func (s *Stitcher) cut(m map[string]json.RawMessage, ch choice, stop string) {
	s.clearText(m, ch)
	m["finish_reason"], _ = json.Marshal("stop")
	m["stop_reason"], _ = json.Marshal(stop)
	delete(m, "token_ids")
}
