package migrate

import (
	"bytes"
	"encoding/json"
	"strconv"
	"unicode/utf8"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// scanner is a small, allocation-light reader of one SSE chunk: the fields
// the tracker needs, every other value skipped. It handles any valid JSON;
// on anything it does not expect it reports failure and the tracker falls
// back to encoding/json (the reference: scan_test.go compares both).
type scanner struct {
	b   []byte
	i   int
	bad bool
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) peek() byte {
	s.ws()
	if s.i >= len(s.b) {
		s.bad = true
		return 0
	}
	return s.b[s.i]
}

func (s *scanner) expect(c byte) {
	if s.peek() != c {
		s.bad = true
		return
	}
	s.i++
}

// str reads a JSON string (checked as encoding/json would) and returns
// its raw contents (between the quotes) and whether it has escapes.
func (s *scanner) str() (raw []byte, esc bool) {
	if s.peek() != '"' {
		s.bad = true
		return nil, false
	}
	end, esc, ok := rawjson.StringEnd(s.b, s.i)
	if !ok {
		s.bad = true
		return nil, false
	}
	raw = s.b[s.i+1 : end-1]
	s.i = end
	return raw, esc
}

// textBytes reads a JSON string value; the bytes are the input's own when
// the string has no escapes and is valid UTF-8, else its decoding.
func (s *scanner) textBytes() []byte {
	start := s.i
	raw, esc := s.str()
	if s.bad {
		return nil
	}
	if !esc && utf8.Valid(raw) {
		return raw
	}
	var out string
	if err := json.Unmarshal(s.b[start:s.i], &out); err != nil {
		s.bad = true
	}
	return []byte(out)
}

// text reads a JSON string value as a Go string.
func (s *scanner) text() string { return string(s.textBytes()) }

// skip skips one value of any kind, checked as encoding/json would, and
// returns its raw bytes.
func (s *scanner) skip() []byte {
	s.peek()
	if s.bad {
		return nil
	}
	from := s.i
	end, ok := rawjson.ValueEnd(s.b, from)
	if !ok {
		s.bad = true
		return nil
	}
	s.i = end
	return s.b[from:end]
}

// object calls member for each key of an object; member must consume the
// value.
func (s *scanner) object(member func(key []byte)) {
	s.expect('{')
	if s.peek() == '}' {
		s.i++
		return
	}
	for !s.bad {
		key, esc := s.str()
		if esc {
			s.bad = true // keys the tracker reads have no escapes; be safe
		}
		s.expect(':')
		if s.bad {
			return
		}
		member(key)
		switch s.peek() {
		case ',':
			s.i++
		case '}':
			s.i++
			return
		default:
			s.bad = true
		}
	}
}

// array calls elem for each element; elem must consume it.
func (s *scanner) array(elem func()) {
	s.expect('[')
	if s.peek() == ']' {
		s.i++
		return
	}
	for !s.bad {
		elem()
		switch s.peek() {
		case ',':
			s.i++
		case ']':
			s.i++
			return
		default:
			s.bad = true
		}
	}
}

func (s *scanner) isNull() bool {
	if s.peek() == 'n' && bytes.HasPrefix(s.b[s.i:], []byte("null")) {
		s.i += 4
		return true
	}
	return false
}

func (s *scanner) int() int {
	raw := s.skip()
	n, err := strconv.Atoi(string(raw))
	if err != nil {
		s.bad = true
	}
	return n
}

func (s *scanner) ids(dst []uint32) []uint32 {
	s.array(func() {
		raw := s.skip()
		n, err := strconv.ParseUint(string(raw), 10, 32)
		if err != nil {
			s.bad = true
		}
		dst = append(dst, uint32(n))
	})
	return dst
}

// Keys the chunk struct reads, per object. encoding/json matches keys
// case-insensitively; a key that folds to one of these but differs is left
// to it (the scanner gives up).
var (
	topKeys    = []string{"id", "created", "model", "error", "prompt_token_ids", "usage", "choices"}
	choiceKeys = []string{"index", "text", "finish_reason", "token_ids", "prompt_token_ids", "delta", "logprobs"}
	deltaKeys  = []string{"role", "content", "tool_calls", "reasoning_content", "reasoning"}
	usageKeys  = []string{"prompt_tokens", "completion_tokens"}
)

// once reports whether key, when it is one of known, is met for the
// first time in its object. A repeated key makes the scanner give up:
// encoding/json decodes a repeated object or array into what it decoded
// first (and null into nil), which the scanner does not mimic.
func (s *scanner) once(seen *uint16, key []byte, known []string) bool {
	for i, k := range known {
		if string(key) == k {
			if *seen&(1<<i) != 0 {
				s.bad = true
				return false
			}
			*seen |= 1 << i
			return true
		}
	}
	return true
}

// other skips the value of a key the scanner does not read, or gives up
// when encoding/json would read it under another spelling.
func (s *scanner) other(key []byte, known []string) {
	for _, k := range known {
		if len(k) == len(key) && bytes.EqualFold(key, []byte(k)) {
			s.bad = true
			return
		}
	}
	s.skip()
}

// scratch backs a scanned chunk so an ordinary token event allocates only
// its text.
type scratch struct {
	c       chunk
	choices [2]choice
	deltas  [2]delta
	usage   usage
	texts   [2]string
	content [2]string
	role    string
	ids     []uint32
	// where the first choice's variable values lie in the scanned data
	// (a template's holes); each kind at most once, as once refuses a
	// repeated key
	holes [maxHoles]hole
	nh    int
	tv    tokenVals // a template match's values
}

// mark records the span [start, s.i) of the first choice's value of the
// given kind.
func (sc *scratch) mark(n int, kind holeKind, start int, s *scanner) {
	if n == 0 && !s.bad {
		sc.holes[sc.nh] = hole{kind: kind, start: start, end: s.i}
		sc.nh++
	}
}

// scanChunk fills sc.c from data; false when the scanner could not read it.
func scanChunk(data []byte, sc *scratch) bool {
	sc.c = chunk{Choices: sc.choices[:0]}
	sc.ids = sc.ids[:0]
	sc.nh = 0
	s := &scanner{b: data}
	c := &sc.c
	var seen uint16
	s.object(func(key []byte) {
		if !s.once(&seen, key, topKeys) {
			return
		}
		switch string(key) {
		case "id":
			c.ID = s.skip()
		case "created":
			c.Created = s.skip()
		case "model":
			c.Model = s.skip()
		case "error":
			c.Error = s.skip()
		case "prompt_token_ids":
			if !s.isNull() {
				c.PromptTokenIDs = s.ids([]uint32{})
			}
		case "usage":
			if s.isNull() {
				return
			}
			sc.usage = usage{}
			var seen uint16
			s.object(func(k []byte) {
				if !s.once(&seen, k, usageKeys) {
					return
				}
				switch string(k) {
				case "prompt_tokens":
					sc.usage.PromptTokens = s.int()
				case "completion_tokens":
					sc.usage.CompletionTokens = s.int()
				default:
					s.other(k, usageKeys)
				}
			})
			c.Usage = &sc.usage
		case "choices":
			if s.isNull() {
				c.Choices = nil
				return
			}
			c.Choices = sc.choices[:0]
			s.array(func() {
				n := len(c.Choices)
				if n == len(sc.choices) {
					s.bad = true // more choices than the fast path keeps
					return
				}
				c.Choices = append(c.Choices, choice{})
				scanChoice(s, sc, n, &c.Choices[n])
			})
		default:
			s.other(key, topKeys)
		}
	})
	s.ws()
	return !s.bad && s.i == len(data)
}

func scanChoice(s *scanner, sc *scratch, n int, ch *choice) {
	var seen uint16
	s.object(func(key []byte) {
		if !s.once(&seen, key, choiceKeys) {
			return
		}
		switch string(key) {
		case "index":
			ch.Index = s.int()
		case "text":
			if !s.isNull() {
				start := s.i
				sc.texts[n] = s.text()
				ch.Text = &sc.texts[n]
				sc.mark(n, holeText, start, s)
			}
		case "finish_reason":
			if !s.isNull() {
				f := s.text()
				ch.FinishReason = &f
			}
		case "token_ids":
			if !s.isNull() {
				from, start := s.i, len(sc.ids)
				sc.ids = s.ids(sc.ids)
				ch.TokenIDs = sc.ids[start:len(sc.ids):len(sc.ids)]
				if ch.TokenIDs == nil {
					ch.TokenIDs = []uint32{}
				}
				sc.mark(n, holeIDs, from, s)
			}
		case "prompt_token_ids":
			if !s.isNull() {
				ch.PromptTokenIDs = s.ids([]uint32{})
			}
		case "delta":
			if s.isNull() {
				return
			}
			d := &sc.deltas[n]
			*d = delta{}
			var seen uint16
			s.object(func(k []byte) {
				if !s.once(&seen, k, deltaKeys) {
					return
				}
				switch string(k) {
				case "role":
					if !s.isNull() {
						sc.role = s.text()
						d.Role = &sc.role
					}
				case "content":
					if !s.isNull() {
						start := s.i
						sc.content[n] = s.text()
						d.Content = &sc.content[n]
						sc.mark(n, holeContent, start, s)
					}
				case "tool_calls":
					d.ToolCalls = s.skip()
				case "reasoning_content":
					if !s.isNull() {
						r := s.text()
						d.ReasoningContent = &r
					}
				case "reasoning":
					if !s.isNull() {
						r := s.text()
						d.Reasoning = &r
					}
				default:
					s.other(k, deltaKeys)
				}
			})
			ch.Delta = d
		case "logprobs":
			s.skip()
		default:
			s.other(key, choiceKeys)
		}
	})
}
