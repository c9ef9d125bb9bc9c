package bench

import (
	"bytes"
	"errors"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// chunkInfo is what the benchmark needs from one streamed JSON chunk.
type chunkInfo struct {
	token      bool // non-empty "choices": a token event
	usage      bool // a usage chunk (only when not a token event, as vLLM)
	completion int  // usage.completion_tokens (0 if null/absent)
	prompt     int  // usage.prompt_tokens
	promptSet  bool
	errorMsg   string // set when the chunk is an error object
}

var errNotObject = errors.New("chunk is not a JSON object")
var errBadChoices = errors.New(`"choices" is neither a list nor empty`)

// scanChunk validates data as JSON and extracts the fields vLLM's benchmark
// reads, without reflection or per-chunk allocations in the common case. The
// generated text (choices[0].text, or choices[0].delta.content for chat) is
// appended to *text when text is non-nil.
func scanChunk(data []byte, text *[]byte) (chunkInfo, error) {
	var ci chunkInfo
	if !rawjson.Valid(data) {
		return ci, errInvalidJSON
	}
	i := skipWS(data, 0)
	if data[i] != '{' {
		return ci, errNotObject
	}
	var choicesAt, usageAt, errorAt, messageAt = -1, -1, -1, -1
	objectIsError := false
	var kb [32]byte
	it := objIter{b: data, i: i}
	for {
		key, vs, ok := it.next(kb[:0])
		if !ok {
			break
		}
		switch string(key) {
		case "choices":
			choicesAt = vs
		case "usage":
			usageAt = vs
		case "error":
			errorAt = vs
		case "object":
			if data[vs] == '"' {
				objectIsError = bytes.Equal(rawString(data, vs), []byte("error"))
			}
		case "message":
			messageAt = vs
		}
	}
	if errorAt >= 0 && data[errorAt] != 'n' {
		ci.errorMsg = errorMessage(data, errorAt)
		return ci, nil
	}
	if objectIsError {
		msg := "error object in stream"
		if messageAt >= 0 && data[messageAt] == '"' {
			msg = string(unquote(nil, data, messageAt))
		}
		ci.errorMsg = msg
		return ci, nil
	}
	if choicesAt >= 0 {
		switch truthy, isArray := truthiness(data, choicesAt); {
		case isArray && truthy:
			ci.token = true
			first := skipWS(data, choicesAt+1)
			if data[first] == '{' && text != nil {
				*text = appendChoiceText(*text, data, first)
			}
			return ci, nil
		case truthy:
			return ci, errBadChoices
		}
	}
	if usageAt >= 0 && data[usageAt] == '{' {
		if truthy, _ := truthiness(data, usageAt); truthy {
			ci.usage = true
			uit := objIter{b: data, i: usageAt}
			for {
				key, vs, ok := uit.next(kb[:0])
				if !ok {
					break
				}
				switch string(key) {
				case "completion_tokens":
					ci.completion, _ = parseIntValue(data, vs)
				case "prompt_tokens":
					ci.prompt, ci.promptSet = parseIntValue(data, vs)
				}
			}
		}
	}
	return ci, nil
}

var errInvalidJSON = errors.New("invalid JSON")

// appendChoiceText appends choices[0].text or choices[0].delta.content.
func appendChoiceText(dst, data []byte, objStart int) []byte {
	var kb [32]byte
	it := objIter{b: data, i: objStart}
	for {
		key, vs, ok := it.next(kb[:0])
		if !ok {
			return dst
		}
		switch string(key) {
		case "text":
			if data[vs] == '"' {
				return unquote(dst, data, vs)
			}
		case "delta":
			if data[vs] == '{' {
				dit := objIter{b: data, i: vs}
				for {
					k2, v2, ok2 := dit.next(kb[:0])
					if !ok2 {
						break
					}
					if string(k2) == "content" && data[v2] == '"' {
						return unquote(dst, data, v2)
					}
				}
			}
		}
	}
}

// errorMessage renders an "error" member: its "message" if it is an object
// with one, the string itself, or the raw JSON (truncated).
func errorMessage(data []byte, vs int) string {
	switch data[vs] {
	case '"':
		return string(unquote(nil, data, vs))
	case '{':
		var kb [32]byte
		it := objIter{b: data, i: vs}
		for {
			key, v, ok := it.next(kb[:0])
			if !ok {
				break
			}
			if string(key) == "message" && data[v] == '"' {
				return string(unquote(nil, data, v))
			}
		}
	}
	raw := data[vs:skipValue(data, vs)]
	return truncate(string(raw), 200)
}

// truthiness reports Python truthiness of the JSON value at vs and whether
// it is an array.
func truthiness(data []byte, vs int) (truthy, isArray bool) {
	switch data[vs] {
	case '[':
		return data[skipWS(data, vs+1)] != ']', true
	case '{':
		return data[skipWS(data, vs+1)] != '}', false
	case '"':
		return data[vs+1] != '"', false
	case 'n', 'f':
		return false, false
	case 't':
		return true, false
	}
	end := skipValue(data, vs)
	f, err := strconv.ParseFloat(string(data[vs:end]), 64)
	return err != nil || f != 0, false
}

// parseIntValue parses an integer JSON number at vs (null gives 0,false).
func parseIntValue(data []byte, vs int) (int, bool) {
	end := skipValue(data, vs)
	v := data[vs:end]
	if len(v) == 0 || v[0] == 'n' {
		return 0, false
	}
	n, neg, i := 0, false, 0
	if v[0] == '-' {
		neg, i = true, 1
	}
	for ; i < len(v); i++ {
		c := v[i]
		if c < '0' || c > '9' {
			f, err := strconv.ParseFloat(string(v), 64)
			if err != nil {
				return 0, false
			}
			return int(f), true
		}
		n = n*10 + int(c-'0')
	}
	if neg {
		n = -n
	}
	return n, true
}

// objIter walks the members of a JSON object in validated input.
type objIter struct {
	b    []byte
	i    int // at '{' initially, then after the previous value
	open bool
}

// next returns the next member's key (unescaped into kb if needed) and the
// offset of its value.
func (it *objIter) next(kb []byte) (key []byte, valueStart int, ok bool) {
	b := it.b
	i := skipWS(b, it.i)
	if !it.open {
		if i >= len(b) || b[i] != '{' {
			return nil, 0, false
		}
		it.open = true
		i = skipWS(b, i+1)
	} else if i < len(b) && b[i] == ',' {
		i = skipWS(b, i+1)
	}
	if i >= len(b) || b[i] != '"' {
		it.i = len(b)
		return nil, 0, false
	}
	raw := rawString(b, i)
	if bytes.IndexByte(raw, '\\') >= 0 {
		key = unquote(kb, b, i)
	} else {
		key = raw
	}
	i = skipWS(b, skipString(b, i))
	i = skipWS(b, i+1) // ':'
	it.i = skipValue(b, i)
	return key, i, true
}

func skipWS(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// skipString returns the offset just past the string starting at b[i]=='"'.
func skipString(b []byte, i int) int {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1
		}
	}
	return len(b)
}

// rawString returns the bytes between the quotes of the string at b[i].
func rawString(b []byte, i int) []byte {
	end := skipString(b, i)
	if end-1 <= i {
		return nil
	}
	return b[i+1 : end-1]
}

// skipValue returns the offset just past the value starting at b[i].
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return i
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = skipString(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	}
	j := i
	for j < len(b) {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j
		}
		j++
	}
	return j
}

// unquote appends the decoded JSON string at b[i] to dst.
func unquote(dst, b []byte, i int) []byte {
	raw := rawString(b, i)
	for k := 0; k < len(raw); k++ {
		c := raw[k]
		if c != '\\' {
			dst = append(dst, c)
			continue
		}
		k++
		if k >= len(raw) {
			break
		}
		switch raw[k] {
		case 'n':
			dst = append(dst, '\n')
		case 't':
			dst = append(dst, '\t')
		case 'r':
			dst = append(dst, '\r')
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'u':
			r, n := decodeU(raw[k+1:])
			k += n
			if utf16.IsSurrogate(r) && k+2 < len(raw) && raw[k+1] == '\\' && raw[k+2] == 'u' {
				r2, n2 := decodeU(raw[k+3:])
				if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
					r = dec
					k += 2 + n2
				} else {
					r = utf8.RuneError
				}
			} else if utf16.IsSurrogate(r) {
				r = utf8.RuneError
			}
			dst = utf8.AppendRune(dst, r)
		default: // '"', '\\', '/'
			dst = append(dst, raw[k])
		}
	}
	return dst
}

func decodeU(b []byte) (rune, int) {
	if len(b) < 4 {
		return utf8.RuneError, len(b)
	}
	var r rune
	for _, c := range b[:4] {
		switch {
		case c >= '0' && c <= '9':
			c -= '0'
		case c >= 'a' && c <= 'f':
			c = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			c = c - 'A' + 10
		default:
			return utf8.RuneError, 4
		}
		r = r<<4 | rune(c)
	}
	return r, 4
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
