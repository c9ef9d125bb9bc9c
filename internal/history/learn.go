package history

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// maxSniff bounds the bytes of a relayed answer examined for its id: vLLM
// puts "id" first in a response object and response.created is the first
// event of a stream, so the id is in the first few hundred bytes.
const maxSniff = 64 << 10

// Learner wraps the ResponseWriter of a POST /v1/responses relay. It reads
// the response id as the bytes go by (the "id" of a JSON answer, or the
// response.id of the response.created SSE event) and calls onID once,
// before the chunk that completes the id (JSON) or the response.created
// event (SSE) is written on: a client that read the id can never ask for it
// before the router knows its owner. The relayed
// bytes are never buffered or altered.
type Learner struct {
	http.ResponseWriter
	onID func(id string)

	wroteHeader bool
	active      bool // 2xx answer still being examined
	sse         bool
	buf         []byte
}

// NewLearner wraps w; onID is called at most once, with a non-empty id.
func NewLearner(w http.ResponseWriter, onID func(id string)) *Learner {
	return &Learner{ResponseWriter: w, onID: onID}
}

// WriteHeader notes whether the answer is a 2xx worth examining.
func (l *Learner) WriteHeader(code int) {
	if !l.wroteHeader && (code < 100 || code >= 200) {
		l.wroteHeader = true
		l.active = code >= 200 && code < 300
		ct := strings.ToLower(l.Header().Get("Content-Type"))
		l.sse = strings.HasPrefix(ct, "text/event-stream")
	}
	l.ResponseWriter.WriteHeader(code)
}

func (l *Learner) Write(p []byte) (int, error) {
	if !l.wroteHeader {
		l.WriteHeader(http.StatusOK)
	}
	if l.active {
		l.sniff(p)
	}
	return l.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls.
func (l *Learner) FlushError() error {
	if !l.wroteHeader {
		l.WriteHeader(http.StatusOK)
	}
	return http.NewResponseController(l.ResponseWriter).Flush()
}

// Flush implements http.Flusher.
func (l *Learner) Flush() { _ = l.FlushError() }

// Unwrap lets http.ResponseController reach the real writer.
func (l *Learner) Unwrap() http.ResponseWriter { return l.ResponseWriter }

func (l *Learner) sniff(p []byte) {
	l.buf = append(l.buf, p[:min(len(p), maxSniff-len(l.buf))]...)
	var id string
	var done bool
	if l.sse {
		id, done = createdEventID(l.buf)
	} else {
		id, done = leadingID(l.buf)
	}
	if !done && len(l.buf) >= maxSniff {
		done = true
	}
	if !done {
		return
	}
	l.active, l.buf = false, nil
	if id != "" {
		l.onID(id)
	}
}

// createdEventID looks through the complete events of an SSE prefix for
// response.created and returns its response.id. done is true once an
// answer is certain: the id was found, or a complete event other than
// response.created came first (vLLM sends it first, so it is not coming).
func createdEventID(b []byte) (id string, done bool) {
	for {
		end := bytes.Index(b, []byte("\n\n"))
		if end < 0 {
			return "", false
		}
		ev := b[:end]
		b = b[end+2:]
		var data []byte
		for line := range bytes.SplitSeq(ev, []byte("\n")) {
			line = bytes.TrimSuffix(line, []byte("\r"))
			if v, ok := bytes.CutPrefix(line, []byte("data:")); ok {
				data = append(data, bytes.TrimPrefix(v, []byte(" "))...)
			}
		}
		if len(data) == 0 {
			continue // a comment or keep-alive
		}
		obj, err := rawjson.Parse(data)
		if err != nil {
			return "", true
		}
		if typ, _ := obj.String("type"); typ != "response.created" {
			return "", true
		}
		resp, err := rawjson.Parse(obj.Get("response"))
		if err != nil {
			return "", true
		}
		id, _ := resp.String("id")
		return id, true
	}
}

// leadingID finds the top-level "id" string of the JSON object whose first
// bytes are b. done is false while more bytes are needed to decide.
func leadingID(b []byte) (id string, done bool) {
	s := prefixScanner{b: b}
	s.ws()
	if s.eof() {
		return "", false
	}
	if b[s.i] != '{' {
		return "", true
	}
	s.i++
	for {
		s.ws()
		if s.eof() {
			return "", false
		}
		switch b[s.i] {
		case '}':
			return "", true
		case ',':
			s.i++
			continue
		case '"':
		default:
			return "", true
		}
		ks := s.i
		if !s.str() {
			return "", false
		}
		var key string
		if json.Unmarshal(b[ks:s.i], &key) != nil {
			return "", true
		}
		s.ws()
		if s.eof() {
			return "", false
		}
		if b[s.i] != ':' {
			return "", true
		}
		s.i++
		s.ws()
		if s.eof() {
			return "", false
		}
		vs := s.i
		if key == "id" {
			if b[s.i] != '"' {
				return "", true
			}
			if !s.str() {
				return "", false
			}
			var v string
			if json.Unmarshal(b[vs:s.i], &v) != nil {
				return "", true
			}
			return v, true
		}
		if !s.value() {
			return "", false
		}
	}
}

// prefixScanner skips JSON tokens of a possibly truncated document; each
// step reports false when the input ended first.
type prefixScanner struct {
	b []byte
	i int
}

func (s *prefixScanner) eof() bool { return s.i >= len(s.b) }

func (s *prefixScanner) ws() {
	for s.i < len(s.b) && (s.b[s.i] == ' ' || s.b[s.i] == '\t' || s.b[s.i] == '\n' || s.b[s.i] == '\r') {
		s.i++
	}
}

// str skips a string starting at s.i (an opening quote).
func (s *prefixScanner) str() bool {
	for j := s.i + 1; j < len(s.b); j++ {
		switch s.b[j] {
		case '\\':
			j++
		case '"':
			s.i = j + 1
			return true
		}
	}
	return false
}

// value skips one value: nested containers by depth, strings whole,
// scalars up to the next delimiter.
func (s *prefixScanner) value() bool {
	depth := 0
	for s.i < len(s.b) {
		switch c := s.b[s.i]; c {
		case '"':
			if !s.str() {
				return false
			}
			if depth == 0 {
				return true
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth == 0 {
				s.i++
				return true
			}
			if depth < 0 { // the end of the enclosing object: the scalar before it ended
				return true
			}
		case ',':
			if depth == 0 {
				return true
			}
		default:
			if depth == 0 && (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
				return true
			}
		}
		s.i++
	}
	return false
}
