package migrate

import "bytes"

// A stream's token events differ only in a few values: vLLM repeats the
// id, object, created and model of the first chunk and the same choice
// fields in the same order, and only the text (or delta content) and the
// token ids change. The tracker keeps the latest fully scanned plain token
// event as a template and reads a new event by comparing it with the
// template around those values: the fixed bytes must be equal and each
// variable value must be one valid value of its kind. Such an event is
// valid JSON (a valid value replaced by another of the same kind at the
// same place) and reads as the template with the new values, so the
// tracker applies only what the values change. Anything else is scanned
// whole (and becomes the template when it is a plain token event).

type holeKind uint8

const (
	holeText    holeKind = iota + 1 // choices[0].text, a string
	holeContent                     // choices[0].delta.content, a string
	holeIDs                         // choices[0].token_ids, an array of ids
)

const maxHoles = 3

// hole is the span [start, end) of one variable value in the data.
type hole struct {
	kind       holeKind
	start, end int
}

type template struct {
	ok    bool
	data  []byte // the template event's data
	holes [maxHoles]hole
	nh    int
}

// plainToken reports whether a scanned chunk is an ordinary token event:
// one choice whose only effect on the tracker is its text and token ids
// (no error, usage, prompt ids, role, finish, tool call or reasoning), so
// its fixed bytes need not be applied again.
func plainToken(c *chunk) bool {
	if (len(c.Error) > 0 && string(c.Error) != "null") || c.Usage != nil || c.PromptTokenIDs != nil || len(c.Choices) != 1 {
		return false
	}
	ch := &c.Choices[0]
	if ch.PromptTokenIDs != nil || ch.FinishReason != nil {
		return false
	}
	d := ch.Delta
	return d == nil || (d.Role == nil && d.ReasoningContent == nil && d.Reasoning == nil &&
		(len(d.ToolCalls) == 0 || string(d.ToolCalls) == "null"))
}

// set makes the scanned event data the template when it is a plain token
// event, else forgets the template.
func (tp *template) set(data []byte, sc *scratch) {
	tp.ok = plainToken(&sc.c)
	if !tp.ok {
		return
	}
	tp.data = append(tp.data[:0], data...)
	tp.nh = sc.nh
	tp.holes = sc.holes
	h := tp.holes[:tp.nh]
	for i := 1; i < len(h); i++ { // in order of appearance (at most 3)
		for j := i; j > 0 && h[j].start < h[j-1].start; j-- {
			h[j], h[j-1] = h[j-1], h[j]
		}
	}
}

// tokenVals are the values of a plain token event.
type tokenVals struct {
	piece []byte // the text or content (content wins, as in choice)
	has   bool   // a text or content value was present
	ids   []uint32
}

// match reads data as the template with other values; false when it is
// not one (the caller scans it whole). On success sc.tv holds the values.
func (tp *template) match(data []byte, sc *scratch) bool {
	if !tp.ok {
		return false
	}
	sc.ids = sc.ids[:0]
	var text, content []byte
	var hasText, hasContent bool
	var ids []uint32
	cur, prev := 0, 0
	for _, h := range tp.holes[:tp.nh] {
		seg := tp.data[prev:h.start]
		if !bytes.HasPrefix(data[cur:], seg) {
			return false
		}
		cur += len(seg)
		s := scanner{b: data, i: cur}
		switch h.kind {
		case holeText, holeContent:
			if cur >= len(data) || data[cur] != '"' {
				return false
			}
			b := s.textBytes()
			if s.bad {
				return false
			}
			if h.kind == holeText {
				text, hasText = b, true
			} else {
				content, hasContent = b, true
			}
		case holeIDs:
			if cur >= len(data) || data[cur] != '[' {
				return false
			}
			if sc.ids = s.ids(sc.ids); s.bad {
				return false
			}
			ids = sc.ids[:len(sc.ids):len(sc.ids)]
			if ids == nil {
				ids = []uint32{}
			}
		}
		cur, prev = s.i, h.end
	}
	if !bytes.Equal(data[cur:], tp.data[prev:]) {
		return false
	}
	sc.tv = tokenVals{piece: text, has: hasText, ids: ids}
	if hasContent {
		sc.tv.piece, sc.tv.has = content, true
	}
	return true
}
