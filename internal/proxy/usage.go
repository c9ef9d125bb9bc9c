package proxy

import (
	"bytes"
	"sync"

	"github.com/switchyard-llm/switchyard/internal/metrics"
)

// Usage records vllm_router_tokens_total for one relayed response, as
// the regular path does: Observe is a RelayOptions.Observe hook (it keeps
// the response's last bytes), and Finish(count) reads the last usage
// object from them and, when count is true (the relay completed with a
// 2xx), adds its prompt_tokens and completion_tokens. A value (a field of
// the caller's) that Start readies: nothing is allocated per response.
// Without metrics Start leaves it off: Observe must then not be set as a
// hook (On reports false) and Finish does nothing.
type Usage struct {
	m    *metrics.Metrics
	tail *usageTail
}

// Start readies u for one response (m nil: off).
func (u *Usage) Start(m *metrics.Metrics) {
	if m == nil {
		return
	}
	u.m = m
	u.tail = tailPool.Get().(*usageTail)
	u.tail.reset()
}

// On reports whether u records (Start was given metrics).
func (u *Usage) On() bool { return u.tail != nil }

// Observe keeps b's bytes (a RelayOptions.Observe hook).
func (u *Usage) Observe(b []byte) { u.tail.observe(b) }

// Finish counts the response's usage when count is true and ends u.
func (u *Usage) Finish(count bool) {
	if u.tail == nil {
		return
	}
	if count {
		if pt, ct, ok := parseUsage(u.tail.bytes()); ok {
			addUsage(u.m, pt, ct)
		}
	}
	tailPool.Put(u.tail)
	u.tail = nil
}

// NewUsageObserver returns a Usage's two hooks for one response: observe
// (nil when m is nil) and finish, to be called exactly once; observe must
// not be called after it.
func NewUsageObserver(m *metrics.Metrics) (observe func([]byte), finish func(count bool)) {
	u := new(Usage)
	u.Start(m)
	if !u.On() {
		return nil, func(bool) {}
	}
	return u.Observe, u.Finish
}

// CountUsage records vllm_router_tokens_total from the last usage object in
// a complete, buffered response body. m may be nil.
func CountUsage(m *metrics.Metrics, body []byte) {
	if m == nil {
		return
	}
	if pt, ct, ok := parseUsage(body); ok {
		addUsage(m, pt, ct)
	}
}

func addUsage(m *metrics.Metrics, prompt, completion int64) {
	p, c := m.Tokens()
	p.Add(float64(prompt))
	c.Add(float64(completion))
}

// usageTailSize bounds what the usage observer keeps: the usage object is at
// the end of a response (non-streaming) or in the last chunk before
// "data: [DONE]" (streaming with stream_options.include_usage).
const usageTailSize = 4 << 10

// usageTail keeps the last usageTailSize bytes of a response in a ring so
// the token usage can be read once the body is complete.
type usageTail struct {
	buf  [usageTailSize]byte
	pos  int // next write offset
	full bool
	lin  [usageTailSize]byte
}

// observe appends p (Relay's Observe hook).
func (t *usageTail) observe(p []byte) {
	if len(p) >= usageTailSize {
		copy(t.buf[:], p[len(p)-usageTailSize:])
		t.pos, t.full = 0, true
		return
	}
	n := copy(t.buf[t.pos:], p)
	if n < len(p) {
		copy(t.buf[:], p[n:])
		t.full = true
	}
	t.pos = (t.pos + len(p)) % usageTailSize
	if t.pos == 0 && len(p) > 0 {
		t.full = true
	}
}

// tailPool holds the tails of finished responses.
var tailPool = sync.Pool{New: func() any { return new(usageTail) }}

func (t *usageTail) reset() { t.pos, t.full = 0, false }

// bytes returns the tail in order (valid until the next call).
func (t *usageTail) bytes() []byte {
	if !t.full {
		return t.buf[:t.pos]
	}
	n := copy(t.lin[:], t.buf[t.pos:])
	copy(t.lin[n:], t.buf[:t.pos])
	return t.lin[:]
}

var (
	usageKey      = []byte(`"usage"`)
	promptKey     = []byte(`"prompt_tokens"`)
	completionKey = []byte(`"completion_tokens"`)
)

// parseUsage finds the last "usage" object in b and returns its
// prompt_tokens and completion_tokens. ok is false when there is none (or
// it was cut off by the tail bound).
//
// The key is searched forward with bytes.Index (vectorized), first in the
// last usageNear bytes (where a usage object usually is) and then, when
// none is there, in all of b. bytes.LastIndex hashes every byte from the
// end: a stream without usage (the common case) had it hash the whole kept
// tail, about 5 % of the router's CPU in a profile of PD streams
// (docs/BENCHMARKS.md §31).
func parseUsage(b []byte) (prompt, completion int64, ok bool) {
	at := -1
	if len(b) > usageNear {
		at = lastUsageObject(b, len(b)-usageNear)
	}
	if at < 0 {
		at = lastUsageObject(b, 0)
	}
	if at < 0 {
		return 0, 0, false
	}
	return usageObject(b[at:])
}

// usageObject reads the token counts of the usage object b starts with.
func usageObject(b []byte) (prompt, completion int64, ok bool) {
	k := objectEnd(b)
	if k < 0 {
		return 0, 0, false // cut off
	}
	obj := b[:k]
	p, okP := intAfterKey(obj, promptKey)
	c, okC := intAfterKey(obj, completionKey)
	if !okP && !okC {
		return 0, 0, false
	}
	return p, c, true
}

// usageNear is how far from the end parseUsage looks first.
const usageNear = 1 << 10

// lastUsageObject returns where the object of the last "usage" key that
// starts at or after from begins, or -1 when there is none ("usage": null
// is not one). A key starting before from cannot follow one found after it.
func lastUsageObject(b []byte, from int) int {
	at := -1
	for i := from; ; {
		k := bytes.Index(b[i:], usageKey)
		if k < 0 {
			return at
		}
		i += k + 1 // every occurrence, overlapping ones too
		j := skipSpace(b, i-1+len(usageKey))
		if j >= len(b) || b[j] != ':' {
			continue
		}
		if j = skipSpace(b, j+1); j < len(b) && b[j] == '{' {
			at = j
		}
	}
}

// objectEnd returns the length of the JSON object at the start of b
// (which begins with '{'), or -1 if it does not end within b.
func objectEnd(b []byte) int {
	depth, inStr := 0, false
	for i := 0; i < len(b); i++ {
		c := b[i]
		if inStr {
			switch c {
			case '\\':
				i++
			case '"':
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth == 0 {
				return i + 1
			}
		}
	}
	return -1
}

func intAfterKey(b, key []byte) (int64, bool) {
	i := bytes.Index(b, key)
	if i < 0 {
		return 0, false
	}
	j := skipSpace(b, i+len(key))
	if j >= len(b) || b[j] != ':' {
		return 0, false
	}
	j = skipSpace(b, j+1)
	var n int64
	start := j
	for j < len(b) && b[j] >= '0' && b[j] <= '9' && j-start < 18 {
		n = n*10 + int64(b[j]-'0')
		j++
	}
	return n, j > start
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}
