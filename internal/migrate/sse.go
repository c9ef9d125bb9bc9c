package migrate

import (
	"bytes"
	"sync"
)

// Splitter cuts a byte stream into complete SSE events. An event is
// returned with its terminating blank line ("\n\n" or "\r\n\r\n"); bytes
// after the last complete event are kept for the next call, in a pooled
// buffer held only while they wait: a stream whose reads end on event
// boundaries (a paced one) holds none, and one whose reads cut events (a
// burst) takes one buffer for the stream rather than growing its own.
type Splitter struct {
	pend []byte
	bp   *[]byte // the pooled buffer pend was taken from; nil when none
}

// pendBufs holds the buffers of pending partial events.
var pendBufs = sync.Pool{New: func() any { b := make([]byte, 0, pendBuffer); return &b }}

// pendBuffer fits a read (the transport's 4 KiB) and the partial event
// before it; pendKeepMax: a buffer grown past this goes to the collector.
const (
	pendBuffer  = 8 << 10
	pendKeepMax = 64 << 10
)

// Feed appends p and calls fn with every event completed by it, in order.
// The slice given to fn is valid only during the call.
func (s *Splitter) Feed(p []byte, fn func(ev []byte)) { s.FeedBatch(p, fn, nil) }

// FeedBatch is Feed that then calls done (when not nil) once, while the
// slices given to fn are still valid: consecutive events are consecutive
// in memory, and fn may keep them until done to use them as one.
func (s *Splitter) FeedBatch(p []byte, fn func(ev []byte), done func()) {
	buf := p // the usual case: no partial event pending, p is read in place
	if len(s.pend) > 0 {
		s.pend = append(s.pend, p...)
		buf = s.pend
	}
	start := 0
	for {
		n, ok := eventEnd(buf[start:])
		if !ok {
			break
		}
		fn(buf[start : start+n])
		start += n
	}
	if done != nil {
		done()
	}
	rest := buf[start:]
	switch {
	case len(rest) == 0:
		s.Reset()
	case len(s.pend) == 0:
		s.pend = append(s.take(), rest...)
	case start > 0:
		s.pend = append(s.pend[:0], rest...)
	}
}

// take is an empty pooled buffer for pend.
func (s *Splitter) take() []byte {
	if s.bp == nil {
		s.bp = pendBufs.Get().(*[]byte)
	}
	return (*s.bp)[:0]
}

// Pending returns the bytes of an incomplete trailing event.
func (s *Splitter) Pending() []byte { return s.pend }

// Reset drops any incomplete event and gives its buffer back: nothing
// may use what Pending returned after it.
func (s *Splitter) Reset() {
	if s.bp != nil {
		if cap(s.pend) <= pendKeepMax {
			*s.bp = s.pend[:0] // as grown
			pendBufs.Put(s.bp)
		}
		s.bp = nil
	}
	s.pend = nil
}

// eventEnd returns the length of the first complete event in b (through
// its blank line).
func eventEnd(b []byte) (int, bool) {
	for off := 0; ; {
		j := bytes.IndexByte(b[off:], '\n')
		if j < 0 {
			return 0, false
		}
		i := off + j
		off = i + 1
		if i+1 < len(b) && b[i+1] == '\n' {
			return i + 2, true
		}
		if i+2 < len(b) && b[i+1] == '\r' && b[i+2] == '\n' {
			return i + 3, true
		}
	}
}

// isBlankTail reports whether b, from the first line's "\n" on, holds
// only the event's end: "\n\n", "\n\r\n" or a lone "\n".
func isBlankTail(b []byte) bool {
	return len(b) == 1 || string(b) == "\n\n" || string(b) == "\n\r\n"
}

// eventData returns the event's data (its "data:" lines joined by "\n",
// one optional space after the colon removed), or nil for an event
// without data (a comment, a keep-alive).
func eventData(ev []byte) []byte {
	// The usual event is one "data:" line: its data is a slice of ev.
	if rest, ok := bytes.CutPrefix(ev, []byte("data:")); ok {
		if i := bytes.IndexByte(rest, '\n'); i >= 0 && isBlankTail(rest[i:]) {
			line := bytes.TrimSuffix(rest[:i], []byte("\r"))
			if bytes.IndexByte(line, '\r') < 0 {
				return bytes.TrimPrefix(line, []byte(" "))
			}
		}
	}
	return eventDataLines(ev)
}

// eventDataLines is eventData for any event: every line read, the data
// lines joined in a new slice.
func eventDataLines(ev []byte) []byte {
	var out []byte
	found := false
	for len(ev) > 0 {
		line := ev
		if i := bytes.IndexByte(ev, '\n'); i >= 0 {
			line, ev = ev[:i], ev[i+1:]
		} else {
			ev = nil
		}
		line = bytes.TrimSuffix(line, []byte("\r"))
		rest, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		rest = bytes.TrimPrefix(rest, []byte(" "))
		if found {
			out = append(out, '\n')
		}
		out = append(out, rest...)
		found = true
	}
	if !found {
		return nil
	}
	if out == nil {
		out = []byte{}
	}
	return out
}

// isDone reports whether data is the stream's "[DONE]" sentinel.
func isDone(data []byte) bool { return string(bytes.TrimSpace(data)) == "[DONE]" }

// dataEvent frames one JSON payload as an SSE event.
func dataEvent(data []byte) []byte {
	out := make([]byte, 0, len(data)+8)
	out = append(out, "data: "...)
	out = append(out, data...)
	return append(out, "\n\n"...)
}
