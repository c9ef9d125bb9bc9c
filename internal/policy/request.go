package policy

import (
	"bytes"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// This file derives the two things policies read from a request body: the
// routing text (what cache_aware matches) and the hash key (what the hash
// policies hash). Both are computed lazily, at most once per Request, and
// cached on it; a Request must therefore not be shared between goroutines
// while a policy runs (the same rule as for *http.Request).
//
// The body is validated with encoding/json (json.Valid) and then walked in
// place: values are sub-slices of the body, so a multi-megabyte prompt is
// not copied into intermediate maps. Only strings that contain escapes are
// decoded with json.Unmarshal.

// RoutingText returns the text a prefix-aware policy matches, the same in
// regular and PD mode:
//
//   - chat "messages": "role: text\n" per message; content is a string or
//     parts whose "text" fields are concatenated; other parts (images,
//     audio) render as "[type:hash]" so different media diverge;
//   - "prompt" (completions, generate): a string; strings of an array joined
//     by "\n"; token ids as decimal numbers joined by " " (prompts of a batch
//     by "\n");
//   - "input" (responses, embeddings): a string, strings or token ids as
//     above, or a list of messages rendered as for chat;
//   - "text" (generate), "query" (rerank), "input_ids" (generate).
//
// The first of those fields (in that order) that renders non-empty wins. An
// empty, invalid or non-object body, or one without any of them, yields "".
func (r *Request) RoutingText() string {
	if r.text == nil {
		r.analyze(true)
	}
	return *r.text
}

// HashKey returns the session key with DefaultHashHeaders (see KeyExtractor).
func (r *Request) HashKey() string { return defaultKeys.Key(r) }

var defaultKeys = NewKeyExtractor(DefaultHashHeaders)

// KeyExtractor derives the session key consistent_hash and rendezvous_hash
// hash (REFERENCE §3.6, with its weaknesses fixed):
//
//  1. the first configured header present with a non-empty value, matched
//     case-insensitively, as "header:<name>:<value>" (name lower-cased);
//  2. top-level body fields, parsed as JSON (never by substring search):
//     session_params.session_id → "session:<v>", user → "user:<v>",
//     session_id → "session:<v>", user_id → "user:<v>"; strings or numbers
//     (numbers as written), empty strings skipped;
//  3. "text:<xxhash64 of RoutingText>" when the routing text is non-empty;
//  4. "body:<xxhash64 of the raw body>" for any other non-empty body
//     (invalid JSON, non-object, unknown shape);
//  5. "" for an empty body without headers: there is no identity, and the
//     hash policies then spread such requests randomly rather than sending
//     all of them to one worker.
type KeyExtractor struct {
	names []string // lower-case
}

// NewKeyExtractor returns an extractor consulting headers in order.
func NewKeyExtractor(headers []string) *KeyExtractor {
	e := &KeyExtractor{names: make([]string, 0, len(headers))}
	for _, h := range headers {
		if h = strings.ToLower(strings.TrimSpace(h)); h != "" {
			e.names = append(e.names, h)
		}
	}
	return e
}

// Key returns the request's hash key.
func (e *KeyExtractor) Key(r *Request) string {
	if k := e.headerKey(r.Headers); k != "" {
		return k
	}
	if r.hashKey == nil {
		r.analyze(false)
	}
	return *r.hashKey
}

// headerKey scans the request headers once (any key casing) and returns the
// key of the highest-priority configured header with a non-empty value.
func (e *KeyExtractor) headerKey(h http.Header) string {
	if len(h) == 0 || len(e.names) == 0 {
		return ""
	}
	best, bestKey, bestVal := len(e.names), "", ""
	for k, vs := range h {
		for i := 0; i <= best && i < len(e.names); i++ {
			name := e.names[i]
			if len(k) != len(name) || !strings.EqualFold(k, name) {
				continue
			}
			if v := firstNonEmpty(vs); v != "" && (i < best || k < bestKey) {
				best, bestKey, bestVal = i, k, v
			}
			break
		}
	}
	if best == len(e.names) {
		return ""
	}
	return "header:" + e.names[best] + ":" + bestVal
}

func firstNonEmpty(vs []string) string {
	for _, v := range vs {
		if v = strings.TrimSpace(v); v != "" {
			return v
		}
	}
	return ""
}

// analyze parses the body once and fills r.hashKey (the body part of the
// key) and, when needText or no body key exists, r.text.
func (r *Request) analyze(needText bool) {
	var f topFields
	var valid bool
	if r.Obj != nil {
		f.fromObject(r.Obj)
		valid = true
	} else {
		valid = len(r.Body) > 0 && (r.ValidJSON || rawjson.Valid(r.Body)) && f.parse(r.Body)
	}
	if r.hashKey == nil && valid {
		if k := f.bodyKey(); k != "" {
			r.hashKey = &k
		}
	}
	if r.text == nil && (needText || r.hashKey == nil) {
		t := ""
		if valid {
			t = f.routingText()
		}
		r.text = &t
	}
	if r.hashKey == nil {
		var k string
		switch {
		case *r.text != "":
			k = "text:" + hex16(xxhash.Sum64String(*r.text))
		case len(r.Body) > 0:
			k = "body:" + hex16(xxhash.Sum64(r.Body))
		}
		r.hashKey = &k
	}
}

// topFields holds the raw values (sub-slices of the body) of the top-level
// members policies read. A repeated key keeps its last value, as in
// encoding/json and Python.
type topFields struct {
	messages, prompt, input, text, query, inputIDs []byte
	user, sessionID, userID, sessionParams         []byte
}

// topNames are the members topFields holds, in the order of slots.
var topNames = [...]string{"messages", "prompt", "input", "text", "query", "input_ids", "user", "session_id", "user_id", "session_params"}

// slots are f's fields in topNames' order.
func (f *topFields) slots() [len(topNames)]*[]byte {
	return [...]*[]byte{&f.messages, &f.prompt, &f.input, &f.text, &f.query, &f.inputIDs, &f.user, &f.sessionID, &f.userID, &f.sessionParams}
}

// parse fills f from a valid JSON document; it reports false when the
// document is not an object.
func (f *topFields) parse(b []byte) bool {
	i := skipWS(b, 0)
	if i >= len(b) || b[i] != '{' {
		return false
	}
	slots := f.slots()
	eachMember(b[i:], func(key, val []byte) {
		if j := topIndex(key); j >= 0 {
			*slots[j] = val
		}
	})
	return true
}

// fromObject fills f from a parsed object, as parse does from its source.
func (f *topFields) fromObject(o *rawjson.Object) {
	slots := f.slots()
	for _, m := range o.Members() {
		if j := slices.Index(topNames[:], m.Key); j >= 0 {
			*slots[j] = m.Value
		}
	}
}

// topIndex is the index in topNames of a raw (quoted) member key, -1 for
// none; an escaped key is decoded once.
func topIndex(key []byte) int {
	if len(key) < 2 {
		return -1
	}
	inner := key[1 : len(key)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		var s string
		if json.Unmarshal(key, &s) != nil {
			return -1
		}
		return slices.Index(topNames[:], s)
	}
	for j, name := range topNames {
		if string(inner) == name {
			return j
		}
	}
	return -1
}

func (f *topFields) bodyKey() string {
	if len(f.sessionParams) > 0 && f.sessionParams[0] == '{' {
		var sid []byte
		eachMember(f.sessionParams, func(key, val []byte) {
			if keyIs(key, "session_id") {
				sid = val
			}
		})
		if v, ok := scalar(sid); ok {
			return "session:" + v
		}
	}
	if v, ok := scalar(f.user); ok {
		return "user:" + v
	}
	if v, ok := scalar(f.sessionID); ok {
		return "session:" + v
	}
	if v, ok := scalar(f.userID); ok {
		return "user:" + v
	}
	return ""
}

func (f *topFields) routingText() string {
	var sb strings.Builder
	for _, v := range [...][]byte{f.messages, f.prompt, f.input, f.text, f.query, f.inputIDs} {
		if len(v) == 0 {
			continue
		}
		sb.Grow(len(v))
		renderValue(&sb, v, 0)
		if sb.Len() > 0 {
			return sb.String()
		}
	}
	return ""
}

// maxDepth bounds recursion into nested arrays and objects.
const maxDepth = 8

// renderValue appends the routing text of one JSON value.
func renderValue(sb *strings.Builder, v []byte, depth int) {
	if len(v) == 0 || depth > maxDepth {
		return
	}
	switch c := v[0]; {
	case c == '"':
		appendString(sb, v)
	case c == '-' || (c >= '0' && c <= '9'):
		sb.Write(v)
	case c == '[':
		// Numbers are joined by ' ', other scalars and arrays by '\n';
		// objects (messages, parts) carry their own separators.
		prev := byte(0)
		eachElem(v, func(e []byte) {
			if prev != 0 && prev != '{' && e[0] != '{' {
				if isNumber(e) && prev == '0' {
					sb.WriteByte(' ')
				} else {
					sb.WriteByte('\n')
				}
			}
			prev = e[0]
			if isNumber(e) {
				prev = '0'
			}
			renderValue(sb, e, depth+1)
		})
	case c == '{':
		renderObject(sb, v, depth)
	}
}

// renderObject renders a chat/responses message ("role: content\n"), a text
// part (its text) or anything else as "[type:hash]".
func renderObject(sb *strings.Builder, v []byte, depth int) {
	var role, content, text, typ []byte
	hasContent := false
	eachMember(v, func(key, val []byte) {
		switch {
		case keyIs(key, "role"):
			role = val
		case keyIs(key, "content"):
			content, hasContent = val, true
		case keyIs(key, "text"):
			text = val
		case keyIs(key, "type"):
			typ = val
		}
	})
	switch {
	case hasContent || len(role) > 0:
		if len(role) > 0 && role[0] == '"' {
			appendString(sb, role)
		}
		sb.WriteString(": ")
		if len(content) > 0 && content[0] == '[' {
			eachElem(content, func(p []byte) { renderValue(sb, p, depth+1) })
		} else {
			renderValue(sb, content, depth+1)
		}
		sb.WriteByte('\n')
	case len(text) > 0 && text[0] == '"':
		appendString(sb, text)
	default:
		sb.WriteByte('[')
		if len(typ) > 0 && typ[0] == '"' {
			appendString(sb, typ)
		} else {
			sb.WriteString("object")
		}
		sb.WriteByte(':')
		sb.WriteString(hex16(xxhash.Sum64(v)))
		sb.WriteByte(']')
	}
}

// scalar returns a string or number value as text; false for anything else
// and for the empty string.
func scalar(v []byte) (string, bool) {
	if len(v) == 0 {
		return "", false
	}
	if v[0] == '"' {
		var sb strings.Builder
		appendString(&sb, v)
		return sb.String(), sb.Len() > 0
	}
	if isNumber(v) {
		return string(v), true
	}
	return "", false
}

func isNumber(v []byte) bool {
	return len(v) > 0 && (v[0] == '-' || (v[0] >= '0' && v[0] <= '9'))
}

// appendString appends the decoded value of the JSON string literal v,
// exactly as json.Unmarshal would decode it (escapes resolved, invalid UTF-8
// and lone surrogates replaced by U+FFFD), without the second validation
// pass json.Unmarshal would make.
func appendString(sb *strings.Builder, v []byte) {
	if len(v) < 2 {
		return
	}
	inner := v[1 : len(v)-1]
	if bytes.IndexByte(inner, '\\') < 0 && utf8.Valid(inner) {
		sb.Write(inner)
		return
	}
	for r := 0; r < len(inner); {
		c := inner[r]
		switch {
		case c == '\\':
			if r+1 >= len(inner) {
				return
			}
			switch e := inner[r+1]; e {
			case '"', '\\', '/', '\'':
				sb.WriteByte(e)
			case 'b':
				sb.WriteByte('\b')
			case 'f':
				sb.WriteByte('\f')
			case 'n':
				sb.WriteByte('\n')
			case 'r':
				sb.WriteByte('\r')
			case 't':
				sb.WriteByte('\t')
			case 'u':
				rr := getu4(inner[r:])
				if rr < 0 {
					return
				}
				r += 6
				if utf16.IsSurrogate(rr) {
					if dec := utf16.DecodeRune(rr, getu4(inner[r:])); dec != unicode.ReplacementChar {
						rr = dec
						r += 6
					} else {
						rr = unicode.ReplacementChar
					}
				}
				sb.WriteRune(rr)
				continue
			default:
				return
			}
			r += 2
		case c < utf8.RuneSelf:
			end := r + 1
			for end < len(inner) && inner[end] != '\\' && inner[end] < utf8.RuneSelf {
				end++
			}
			sb.Write(inner[r:end])
			r = end
		default:
			rr, size := utf8.DecodeRune(inner[r:])
			sb.WriteRune(rr)
			r += size
		}
	}
}

// getu4 decodes the \uXXXX escape at the start of s, or returns -1.
func getu4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	var r rune
	for _, c := range s[2:6] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r*16 + rune(c)
	}
	return r
}

// keyIs reports whether the raw JSON string key equals name.
func keyIs(key []byte, name string) bool {
	if len(key) < 2 {
		return false
	}
	inner := key[1 : len(key)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		var s string
		return json.Unmarshal(key, &s) == nil && s == name
	}
	return string(inner) == name
}

func hex16(h uint64) string {
	const digits = "0123456789abcdef"
	var b [16]byte
	for i := 15; i >= 0; i-- {
		b[i] = digits[h&0xf]
		h >>= 4
	}
	return string(b[:])
}

// The walkers below require b to be valid JSON (json.Valid) and never read
// past its end even if it is not.

func isWS(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipWS(b []byte, i int) int {
	for i < len(b) && isWS(b[i]) {
		i++
	}
	return i
}

// skipString returns the offset just past the string starting at b[i]. A
// quote ends the string when an even number of backslashes precede it.
func skipString(b []byte, i int) int {
	start := i
	for i++; i < len(b); {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b)
		}
		q := i + j
		n := 0
		for p := q - 1; p > start && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		i = q + 1
	}
	return len(b)
}

// skipValue returns the offset just past the value starting at b[i].
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return len(b)
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for i < len(b) {
			switch b[i] {
			case '"':
				i = skipString(b, i)
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1
				}
			}
			i++
		}
		return len(b)
	}
	for i < len(b) && b[i] != ',' && b[i] != '}' && b[i] != ']' && !isWS(b[i]) {
		i++
	}
	return i
}

// eachElem calls fn with every element of the array b.
func eachElem(b []byte, fn func(elem []byte)) {
	if len(b) == 0 || b[0] != '[' {
		return
	}
	i := skipWS(b, 1)
	for i < len(b) && b[i] != ']' {
		end := skipValue(b, i)
		if end == i {
			return
		}
		fn(b[i:end])
		i = skipWS(b, end)
		if i < len(b) && b[i] == ',' {
			i = skipWS(b, i+1)
		}
	}
}

// eachMember calls fn with the raw key (quotes included) and value of every
// member of the object b.
func eachMember(b []byte, fn func(key, val []byte)) {
	if len(b) == 0 || b[0] != '{' {
		return
	}
	i := skipWS(b, 1)
	for i < len(b) && b[i] == '"' {
		ke := skipString(b, i)
		key := b[i:ke]
		i = skipWS(b, ke)
		if i >= len(b) || b[i] != ':' {
			return
		}
		i = skipWS(b, i+1)
		ve := skipValue(b, i)
		if ve == i {
			return
		}
		fn(key, b[i:ve])
		i = skipWS(b, ve)
		if i < len(b) && b[i] == ',' {
			i = skipWS(b, i+1)
		}
	}
}
