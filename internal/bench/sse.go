package bench

import (
	"bytes"
	"errors"
	"fmt"
	"io"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// DefaultMaxEventBytes bounds one SSE event (and so the parser's buffer).
const DefaultMaxEventBytes = 1 << 20

const sseMinBuf = 4 << 10

var errEventTooLarge = errors.New("SSE event too large")

// sseParser splits a text/event-stream body into events incrementally.
//
// Framing follows the SSE format restricted to what vLLM servers send: lines
// end in "\n" or "\r\n", an empty line ends an event, lines starting with ':'
// are comments, the payload is the event's "data" field (several data lines
// are joined with "\n"; other fields are ignored).
//
// With eager set the parser also mirrors vLLM's StreamedResponseHandler: an
// unterminated single "data:" line at the end of what has been read so far is
// delivered as soon as its payload is complete JSON (or "[DONE]"), without
// waiting for the blank line. That only changes *when* an event is seen, not
// which events are seen, for well-formed streams.
//
// Memory is bounded: the buffer never grows beyond max+sseMinBuf bytes, and a
// pending event longer than max is an error.
type sseParser struct {
	buf   []byte
	start int // first unconsumed byte
	end   int // end of valid data
	scan  int // next offset to search for a line end
	max   int
	eager bool
	join  []byte // scratch for multi-line data payloads
}

func newSSEParser(buf []byte, max int, eager bool) *sseParser {
	if max <= 0 {
		max = DefaultMaxEventBytes
	}
	if cap(buf) < sseMinBuf {
		buf = make([]byte, sseMinBuf)
	}
	return &sseParser{buf: buf[:cap(buf)], max: max, eager: eager}
}

func (p *sseParser) reset(buf []byte) {
	if cap(buf) < sseMinBuf {
		buf = make([]byte, sseMinBuf)
	}
	p.buf = buf[:cap(buf)]
	p.start, p.end, p.scan = 0, 0, 0
	p.join = p.join[:0]
}

// readFrom performs one Read from r into the buffer, making room first.
func (p *sseParser) readFrom(r io.Reader) (int, error) {
	if p.end == len(p.buf) {
		if err := p.makeRoom(); err != nil {
			return 0, err
		}
	}
	n, err := r.Read(p.buf[p.end:])
	p.end += n
	return n, err
}

func (p *sseParser) makeRoom() error {
	pending := p.end - p.start
	if pending > p.max {
		return fmt.Errorf("%w: more than %d bytes without an event terminator", errEventTooLarge, p.max)
	}
	if p.start > 0 {
		copy(p.buf, p.buf[p.start:p.end])
		p.scan -= p.start
		p.end = pending
		p.start = 0
		if p.end < len(p.buf) {
			return nil
		}
	}
	limit := p.max + sseMinBuf
	if len(p.buf) >= limit {
		return fmt.Errorf("%w: more than %d bytes without an event terminator", errEventTooLarge, p.max)
	}
	n := min(2*len(p.buf), limit)
	nb := make([]byte, n)
	copy(nb, p.buf[:p.end])
	p.buf = nb
	return nil
}

// next returns the data payload of the next complete event in the buffer.
// ok is false when more input is needed. The returned slice is valid until
// the next call on p.
func (p *sseParser) next() (data []byte, ok bool, err error) {
	for {
		blockEnd, after, found := p.findTerminator()
		if !found {
			if p.end-p.start > p.max {
				return nil, false, fmt.Errorf("%w: more than %d bytes without an event terminator", errEventTooLarge, p.max)
			}
			if p.eager {
				if d, ok := p.eagerData(); ok {
					return d, true, nil
				}
			}
			return nil, false, nil
		}
		block := p.buf[p.start:blockEnd]
		p.start = after
		p.scan = after
		if len(block) > p.max {
			return nil, false, fmt.Errorf("%w: %d bytes (limit %d)", errEventTooLarge, len(block), p.max)
		}
		if d, has := p.parseBlock(block); has {
			return d, true, nil
		}
	}
}

// finish returns the payload of a final event left unterminated at the end
// of the body, if any.
func (p *sseParser) finish() (data []byte, ok bool) {
	block := bytes.TrimSpace(p.buf[p.start:p.end])
	p.start, p.scan = p.end, p.end
	if len(block) == 0 {
		return nil, false
	}
	return p.parseBlock(block)
}

// findTerminator looks for a blank line ("\n\n" or "\n\r\n") at or after
// p.scan. blockEnd is the offset of the first '\n' of the terminator and
// after the offset just past it.
func (p *sseParser) findTerminator() (blockEnd, after int, found bool) {
	b := p.buf[:p.end]
	i := max(p.scan, p.start)
	for i < len(b) {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 0 {
			p.scan = len(b)
			return 0, 0, false
		}
		nl := i + j
		switch {
		case nl+1 >= len(b):
			p.scan = nl // decide when more bytes arrive
			return 0, 0, false
		case b[nl+1] == '\n':
			return nl, nl + 2, true
		case b[nl+1] == '\r':
			if nl+2 >= len(b) {
				p.scan = nl
				return 0, 0, false
			}
			if b[nl+2] == '\n' {
				return nl, nl + 3, true
			}
		}
		i = nl + 1
	}
	p.scan = len(b)
	return 0, 0, false
}

// parseBlock extracts the data payload of one event block.
func (p *sseParser) parseBlock(block []byte) ([]byte, bool) {
	var first []byte
	lines := 0
	p.join = p.join[:0]
	for len(block) > 0 {
		var line []byte
		if k := bytes.IndexByte(block, '\n'); k >= 0 {
			line, block = block[:k], block[k+1:]
		} else {
			line, block = block, nil
		}
		line = bytes.TrimSuffix(line, []byte{'\r'})
		if len(line) == 0 || line[0] == ':' {
			continue
		}
		field, value := line, []byte(nil)
		if k := bytes.IndexByte(line, ':'); k >= 0 {
			field, value = line[:k], line[k+1:]
			if len(value) > 0 && value[0] == ' ' {
				value = value[1:]
			}
		}
		if string(field) != "data" {
			continue
		}
		switch lines {
		case 0:
			first = value
		case 1:
			p.join = append(append(append(p.join, first...), '\n'), value...)
		default:
			p.join = append(append(p.join, '\n'), value...)
		}
		lines++
	}
	switch lines {
	case 0:
		return nil, false
	case 1:
		return first, true
	}
	return p.join, true
}

// eagerData implements vLLM's early delivery of an unterminated single
// "data:" line whose payload is already complete.
func (p *sseParser) eagerData() ([]byte, bool) {
	pending := p.buf[p.start:p.end]
	t := bytes.TrimSpace(pending)
	if !bytes.HasPrefix(t, []byte("data:")) || bytes.IndexByte(t, '\n') >= 0 {
		return nil, false
	}
	d := bytes.TrimSpace(t[len("data:"):])
	if len(d) == 0 {
		return nil, false
	}
	if !bytes.Equal(d, doneMarker) && (d[len(d)-1] != '}' || !rawjson.Valid(d)) {
		return nil, false
	}
	p.start, p.scan = p.end, p.end
	return d, true
}

var doneMarker = []byte("[DONE]")
