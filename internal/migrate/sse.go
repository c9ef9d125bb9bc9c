package migrate

import "bytes"

// Splitter cuts a byte stream into complete SSE events. An event is
// returned with its terminating blank line ("\n\n" or "\r\n\r\n"); bytes
// after the last complete event are kept for the next call.
type Splitter struct {
	pend []byte
}

// Feed appends p and calls fn with every event completed by it, in order.
// The slice given to fn is valid only during the call.
func (s *Splitter) Feed(p []byte, fn func(ev []byte)) {
	s.pend = append(s.pend, p...)
	start := 0
	for {
		n, ok := eventEnd(s.pend[start:])
		if !ok {
			break
		}
		fn(s.pend[start : start+n])
		start += n
	}
	if start > 0 {
		s.pend = append(s.pend[:0], s.pend[start:]...)
	}
}

// Pending returns the bytes of an incomplete trailing event.
func (s *Splitter) Pending() []byte { return s.pend }

// Reset drops any incomplete event.
func (s *Splitter) Reset() { s.pend = s.pend[:0] }

// eventEnd returns the length of the first complete event in b (through
// its blank line).
func eventEnd(b []byte) (int, bool) {
	for i := 0; i < len(b); i++ {
		if b[i] != '\n' {
			continue
		}
		if i+1 < len(b) && b[i+1] == '\n' {
			return i + 2, true
		}
		if i+2 < len(b) && b[i+1] == '\r' && b[i+2] == '\n' {
			return i + 3, true
		}
	}
	return 0, false
}

// eventData returns the event's data (its "data:" lines joined by "\n",
// one optional space after the colon removed), or nil for an event
// without data (a comment, a keep-alive).
func eventData(ev []byte) []byte {
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
