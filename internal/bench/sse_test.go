package bench

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
)

// chunkReader returns the input in chunks of the given sizes (cycling).
type chunkReader struct {
	data  []byte
	sizes []int
	i     int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	n := len(r.data)
	if len(r.sizes) > 0 {
		n = max(1, r.sizes[r.i%len(r.sizes)])
		r.i++
	}
	n = min(n, len(p), len(r.data))
	copy(p, r.data[:n])
	r.data = r.data[n:]
	return n, nil
}

// parseAll runs the parser over r and returns the payloads.
func parseAll(r io.Reader, max int, eager bool) ([]string, error) {
	p := newSSEParser(nil, max, eager)
	var out []string
	for {
		_, rerr := p.readFrom(r)
		for {
			d, ok, err := p.next()
			if err != nil {
				return out, err
			}
			if !ok {
				break
			}
			out = append(out, string(d))
		}
		if rerr == io.EOF {
			if d, ok := p.finish(); ok {
				out = append(out, string(d))
			}
			return out, nil
		}
		if rerr != nil {
			return out, rerr
		}
	}
}

func TestSSEFraming(t *testing.T) {
	cases := []struct {
		name string
		in   string
		want []string
	}{
		{"basic", "data: {\"a\":1}\n\ndata: [DONE]\n\n", []string{`{"a":1}`, "[DONE]"}},
		{"crlf", "data: {\"a\":1}\r\n\r\ndata: {\"b\":2}\r\n\r\n", []string{`{"a":1}`, `{"b":2}`}},
		{"comment and ping", ": ping\n\ndata: x\n\n:keepalive\n\n", []string{"x"}},
		{"no space after colon", "data:{\"a\":1}\n\n", []string{`{"a":1}`}},
		{"multi-line data", "data: a\ndata: b\ndata: c\n\n", []string{"a\nb\nc"}},
		{"other fields ignored", "event: message\nid: 7\ndata: d\nretry: 5\n\n", []string{"d"}},
		{"comment inside event", ": hi\ndata: d\n\n", []string{"d"}},
		{"blank lines between", "\n\n\ndata: a\n\n\n\ndata: b\n\n", []string{"a", "b"}},
		{"unterminated final event", "data: a\n\ndata: {\"tail\":true}", []string{"a", `{"tail":true}`}},
		{"no data field", "event: x\n\n", nil},
	}
	for _, c := range cases {
		for _, sizes := range [][]int{nil, {1}, {2, 3}, {7}} {
			got, err := parseAll(&chunkReader{data: []byte(c.in), sizes: sizes}, 1<<10, false)
			if err != nil {
				t.Fatalf("%s %v: %v", c.name, sizes, err)
			}
			if strings.Join(got, "|") != strings.Join(c.want, "|") || len(got) != len(c.want) {
				t.Errorf("%s (chunks %v): got %q, want %q", c.name, sizes, got, c.want)
			}
		}
	}
}

func TestSSEEagerDeliversCompleteJSONBeforeTerminator(t *testing.T) {
	p := newSSEParser(nil, 1<<10, true)
	feed := func(s string) {
		if _, err := p.readFrom(strings.NewReader(s)); err != nil && err != io.EOF {
			t.Fatal(err)
		}
	}
	feed(`data: {"a":1}`)
	d, ok, err := p.next()
	if err != nil || !ok || string(d) != `{"a":1}` {
		t.Fatalf("eager: got %q %v %v, want the complete JSON event", d, ok, err)
	}
	feed(`data: {"b":`) // incomplete JSON: wait
	if _, ok, _ := p.next(); ok {
		t.Fatal("incomplete JSON delivered")
	}
	feed("2}\n\n")
	d, ok, _ = p.next()
	if !ok || string(d) != `{"b":2}` {
		t.Fatalf("got %q, want {\"b\":2}", d)
	}
	feed("\n\ndata: [DONE]")
	d, ok, _ = p.next()
	if !ok || string(d) != "[DONE]" {
		t.Fatalf("got %q %v, want [DONE]", d, ok)
	}
}

func TestSSEEventTooLarge(t *testing.T) {
	in := "data: " + strings.Repeat("x", 5000) + "\n\n"
	_, err := parseAll(&chunkReader{data: []byte(in), sizes: []int{100}}, 1024, true)
	if !errors.Is(err, errEventTooLarge) {
		t.Fatalf("err = %v, want errEventTooLarge", err)
	}
	// A stream of many small events is fine however long it is.
	var b bytes.Buffer
	for range 2000 {
		b.WriteString("data: {\"choices\":[{\"text\":\"hello\"}]}\n\n")
	}
	got, err := parseAll(&chunkReader{data: b.Bytes(), sizes: []int{333}}, 1024, true)
	if err != nil || len(got) != 2000 {
		t.Fatalf("got %d events, err %v", len(got), err)
	}
}

// FuzzSSEParser checks that arbitrary input, read in arbitrary chunks, never
// panics, keeps the buffer bounded, and (without eager delivery) yields the
// same events whatever the chunking.
func FuzzSSEParser(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"), uint8(3))
	f.Add([]byte(": c\r\n\r\ndata: x\ndata: y\r\n\r\n"), uint8(1))
	f.Add([]byte("data: {\"a\":\n\n\n\r\r\n"), uint8(2))
	f.Add([]byte("data:"+strings.Repeat("z", 300)), uint8(17))
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8) {
		const limit = 256
		sizes := []int{int(chunk%31) + 1, int(chunk%7) + 1}
		whole, werr := parseAll(bytes.NewReader(data), limit, false)
		split, serr := parseAll(&chunkReader{data: data, sizes: sizes}, limit, false)
		if (werr == nil) == (serr == nil) && werr == nil {
			if strings.Join(whole, "\x00") != strings.Join(split, "\x00") || len(whole) != len(split) {
				t.Fatalf("chunking changed events: %q vs %q", whole, split)
			}
		}
		p := newSSEParser(nil, limit, true)
		r := &chunkReader{data: data, sizes: sizes}
		for {
			_, rerr := p.readFrom(r)
			if len(p.buf) > limit+sseMinBuf {
				t.Fatalf("buffer grew to %d", len(p.buf))
			}
			broke := false
			for {
				d, ok, err := p.next()
				if err != nil {
					broke = true
					break
				}
				if !ok {
					break
				}
				if len(d) > limit {
					t.Fatalf("event of %d bytes over the limit", len(d))
				}
				_, _ = scanChunk(bytes.TrimSpace(d), new([]byte))
			}
			if broke || rerr != nil {
				break
			}
		}
	})
}
