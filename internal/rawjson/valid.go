package rawjson

// Valid reports whether b is exactly one JSON value with optional
// surrounding white space, as encoding/json.Valid does (RFC 8259 syntax;
// string bytes are not checked for UTF-8; nesting deeper than 10000 is
// refused). It is a single pass without a per-byte state function, several
// times faster than encoding/json.Valid on the request bodies and SSE
// events the router checks on every request.
func Valid(b []byte) bool {
	end, ok := ValueEnd(b, skipWS(b, 0))
	return ok && skipWS(b, end) == len(b)
}

// ValueEnd checks the one JSON value that starts at b[i] (no white space
// before it) with Valid's rules and returns the offset just after it.
func ValueEnd(b []byte, i int) (int, bool) {
	return valueEnd(b, i, maxDepth)
}

// maxDepth is encoding/json's nesting limit.
const maxDepth = 10000

// valueEnd is ValueEnd for a value already nested in depth-maxDepth
// containers: at most maxDepth open ones, counting its own.
func valueEnd(b []byte, i, maxDepth int) (int, bool) {
	var small [16]byte
	stack := small[:0] // '{' or '[' per open container
	for {
		// A value starts at i.
		if i >= len(b) {
			return i, false
		}
		switch b[i] {
		case '{':
			if len(stack) >= maxDepth { // an empty one counts too
				return i, false
			}
			i = skipWS(b, i+1)
			if i < len(b) && b[i] == '}' {
				i++
				break
			}
			stack = append(stack, '{')
			var ok bool
			if i, ok = key(b, i); !ok {
				return i, false
			}
			continue
		case '[':
			if len(stack) >= maxDepth {
				return i, false
			}
			i = skipWS(b, i+1)
			if i < len(b) && b[i] == ']' {
				i++
				break
			}
			stack = append(stack, '[')
			continue
		default:
			var ok bool
			if i, ok = scalar(b, i); !ok {
				return i, false
			}
		}
		// After a value: close containers, or a comma before the next one.
		for {
			if len(stack) == 0 {
				return i, true
			}
			i = skipWS(b, i)
			if i >= len(b) {
				return i, false
			}
			top, c := stack[len(stack)-1], b[i]
			if (top == '{' && c == '}') || (top == '[' && c == ']') {
				stack = stack[:len(stack)-1]
				i++
				continue
			}
			if c != ',' {
				return i, false
			}
			i = skipWS(b, i+1)
			if top == '{' {
				var ok bool
				if i, ok = key(b, i); !ok {
					return i, false
				}
			}
			break
		}
	}
}

// key checks an object key and its colon at i; it returns where the value
// starts.
func key(b []byte, i int) (int, bool) {
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	i, ok := validString(b, i)
	if !ok {
		return i, false
	}
	i = skipWS(b, i)
	if i >= len(b) || b[i] != ':' {
		return i, false
	}
	return skipWS(b, i+1), true
}

// scalar checks a string, number or literal at i and returns its end.
func scalar(b []byte, i int) (int, bool) {
	switch c := b[i]; {
	case c == '"':
		return validString(b, i)
	case c == 't':
		return literal(b, i, "true")
	case c == 'f':
		return literal(b, i, "false")
	case c == 'n':
		return literal(b, i, "null")
	case c == '-' || (c >= '0' && c <= '9'):
		return number(b, i)
	}
	return i, false
}

func literal(b []byte, i int, lit string) (int, bool) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, false
	}
	return i + len(lit), true
}

// strSpecial marks the bytes a string scan stops at: the quote, the
// backslash and the control characters a string may not hold raw.
var strSpecial = func() (t [256]bool) {
	for c := range 0x20 {
		t[c] = true
	}
	t['"'], t['\\'] = true, true
	return t
}()

// StringEnd checks the JSON string whose opening quote is at b[i] and
// returns the offset after its closing quote, and whether it holds escapes.
func StringEnd(b []byte, i int) (end int, escaped, ok bool) {
	end, n, ok := scanString(b, i)
	return end, n > 0, ok
}

// validString checks the string whose opening quote is at i and returns
// the offset after its closing quote.
func validString(b []byte, i int) (int, bool) {
	end, _, ok := scanString(b, i)
	return end, ok
}

// scanString is validString counting the escapes.
func scanString(b []byte, i int) (end, escapes int, ok bool) {
	i++
	for {
		for i < len(b) && !strSpecial[b[i]] {
			i++
		}
		if i >= len(b) {
			return i, escapes, false
		}
		switch b[i] {
		case '"':
			return i + 1, escapes, true
		case '\\':
			escapes++
			if i+1 >= len(b) {
				return i, escapes, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if len(b)-i < 6 || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					return i, escapes, false
				}
				i += 6
			default:
				return i, escapes, false
			}
		default: // a control character
			return i, escapes, false
		}
	}
}

func isHex(c byte) bool {
	return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// number checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at i.
func number(b []byte, i int) (int, bool) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		i = digits(b, i+1)
	default:
		return i, false
	}
	if i < len(b) && b[i] == '.' {
		j := digits(b, i+1)
		if j == i+1 {
			return i, false
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := digits(b, i)
		if j == i {
			return i, false
		}
		i = j
	}
	return i, true
}

func digits(b []byte, i int) int {
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		i++
	}
	return i
}

func skipWS(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

// checkedMembers walks the top-level members of an object and checks it
// with Valid's rules in the same pass, where a check first and a walk
// after it read every byte twice. After each next that
// reports true, the member's quoted key is b[start:keyEnd] and its value
// b[value:end]; once next reports false, valid says whether b was one
// valid JSON object, and i is at its closing '}'.
type checkedMembers struct {
	b                         []byte
	i                         int
	n                         int // members read
	start, keyEnd, value, end int
	bad                       bool
}

// checkMembers starts the walk of b, which must start with '{' after white
// space (ok false otherwise: the caller tells invalid JSON from a value
// that is not an object).
func checkMembers(b []byte) (m checkedMembers, open int, ok bool) {
	open = skipWS(b, 0)
	if open >= len(b) || b[open] != '{' {
		return m, open, false
	}
	return checkedMembers{b: b, i: open + 1}, open, true
}

func (m *checkedMembers) next() bool {
	b := m.b
	i := skipWS(b, m.i)
	if i < len(b) && b[i] == '}' {
		m.i = i
		return false
	}
	if m.n > 0 {
		if i >= len(b) || b[i] != ',' {
			m.bad = true
			return false
		}
		i = skipWS(b, i+1)
	}
	if i >= len(b) || b[i] != '"' {
		m.bad = true
		return false
	}
	keyEnd, ok := validString(b, i)
	colon := skipWS(b, keyEnd)
	if !ok || colon >= len(b) || b[colon] != ':' {
		m.bad = true
		return false
	}
	valueAt := skipWS(b, colon+1)
	end, ok := valueEnd(b, valueAt, maxDepth-1) // inside the object
	if !ok {
		m.bad = true
		return false
	}
	m.start, m.keyEnd, m.value, m.end, m.i = i, keyEnd, valueAt, end, end
	m.n++
	return true
}

// valid reports, once next has reported false, whether the object was
// valid JSON with nothing but white space after it.
func (m *checkedMembers) valid() bool {
	return !m.bad && m.i < len(m.b) && m.b[m.i] == '}' && skipWS(m.b, m.i+1) == len(m.b)
}
