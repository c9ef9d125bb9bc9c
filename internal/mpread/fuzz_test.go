package mpread

import (
	"errors"
	"testing"
)

// refCodes lays out the formats whose length is not in the type byte, as
// the msgpack spec tables them: the size of the length field, the fixed
// body size, the bytes before the data (an ext's type) and the values per
// counted unit (arrays 1, maps 2).
var refCodes = map[byte]struct{ lenSize, fixed, extra, per int }{
	0xc0: {}, 0xc2: {}, 0xc3: {},
	0xc4: {lenSize: 1}, 0xc5: {lenSize: 2}, 0xc6: {lenSize: 4},
	0xc7: {lenSize: 1, extra: 1}, 0xc8: {lenSize: 2, extra: 1}, 0xc9: {lenSize: 4, extra: 1},
	0xca: {fixed: 4}, 0xcb: {fixed: 8},
	0xcc: {fixed: 1}, 0xcd: {fixed: 2}, 0xce: {fixed: 4}, 0xcf: {fixed: 8},
	0xd0: {fixed: 1}, 0xd1: {fixed: 2}, 0xd2: {fixed: 4}, 0xd3: {fixed: 8},
	0xd4: {fixed: 2}, 0xd5: {fixed: 3}, 0xd6: {fixed: 5}, 0xd7: {fixed: 9}, 0xd8: {fixed: 17},
	0xd9: {lenSize: 1}, 0xda: {lenSize: 2}, 0xdb: {lenSize: 4},
	0xdc: {lenSize: 2, per: 1}, 0xdd: {lenSize: 4, per: 1},
	0xde: {lenSize: 2, per: 2}, 0xdf: {lenSize: 4, per: 2},
}

// refSkip is an independent, recursive reading of the spec: the offset
// after the value at off and the deepest level in it, or ok false.
func refSkip(b []byte, off int) (end, depth int, ok bool) {
	if off >= len(b) {
		return 0, 0, false
	}
	c := b[off]
	var l uint64
	var f struct{ lenSize, fixed, extra, per int }
	switch {
	case c <= 0x7f || c >= 0xe0:
	case c <= 0x8f:
		l, f.per = uint64(c&0x0f), 2
	case c <= 0x9f:
		l, f.per = uint64(c&0x0f), 1
	case c <= 0xbf:
		l = uint64(c & 0x1f)
	default:
		var known bool
		if f, known = refCodes[c]; !known || off+1+f.lenSize > len(b) {
			return 0, 0, false
		}
		for _, x := range b[off+1 : off+1+f.lenSize] {
			l = l<<8 | uint64(x)
		}
	}
	end = off + 1 + f.lenSize + f.fixed + f.extra
	if f.per == 0 {
		if l > uint64(len(b)) || end+int(l) > len(b) {
			return 0, 0, false
		}
		return end + int(l), 1, true
	}
	for range uint64(f.per) * l {
		var d int
		if end, d, ok = refSkip(b, end); !ok {
			return 0, 0, false
		}
		depth = max(depth, d)
	}
	return end, depth + 1, true
}

// FuzzSkip: Skip never panics, never reads past the input, allocates
// nothing, and agrees with refSkip on what is one value and where it
// ends; a depth limit refuses exactly the values nested deeper than it.
// The typed reads never panic either, and when they succeed on a scalar
// they end where Skip does.
func FuzzSkip(f *testing.F) {
	for _, tc := range headerCases {
		f.Add(tc.in)
	}
	for _, bomb := range lengthBombs {
		f.Add(append(bomb.header, 1, 2, 3))
	}
	f.Add(nestArrays(5, "\x01"))
	f.Add(nestMaps(3, "\x92\xc0\xa1x"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r := NewReader(b)
		err := r.Skip(NoDepthLimit)
		end, depth, ok := refSkip(b, 0)
		if (err == nil) != ok || ok && len(b)-r.Remaining() != end {
			t.Fatalf("% x: Skip %v at %d, reference %v at %d", b, err, len(b)-r.Remaining(), ok, end)
		}
		const limit = 3
		err = NewReader(b).Skip(limit)
		if ok && (err == nil) != (depth <= limit) || ok && err != nil && !errors.Is(err, ErrDepth) {
			t.Fatalf("% x: depth %d, Skip(%d): %v", b, depth, limit, err)
		}
		r = NewReader(b) // allocated once, outside the measured runs
		if a := testing.AllocsPerRun(2, func() { *r = Reader{b: b}; _ = r.Skip(limit) }); a != 0 {
			t.Fatalf("% x: Skip allocated %.0f times", b, a)
		}
		checkScalarReads(t, b, end, ok)
	})
}

// checkScalarReads runs every typed read on b; a scalar read that succeeds
// must end at end, where the reference ended the value.
func checkScalarReads(t *testing.T, b []byte, end int, ok bool) {
	reads := map[string]func(*Reader) error{
		"Integer":  func(r *Reader) error { _, _, err := r.Integer(); return err },
		"Float":    func(r *Reader) error { _, err := r.Float(); return err },
		"StrOrBin": func(r *Reader) error { _, _, err := r.StrOrBin(); return err },
		"Nil": func(r *Reader) error {
			if !r.Nil() {
				return errors.New("not nil")
			}
			return nil
		},
	}
	for name, read := range reads {
		r := NewReader(b)
		if err := read(r); err == nil && (!ok || len(b)-r.Remaining() != end) {
			t.Fatalf("% x: %s ended at %d, reference %v at %d", b, name, len(b)-r.Remaining(), ok, end)
		}
	}
	for _, read := range []func(*Reader) (int, error){(*Reader).ArrayLen, (*Reader).MapLen} {
		if n, err := read(NewReader(b)); err == nil && (n < 0 || n > len(b)) {
			t.Fatalf("% x: container of %d in %d bytes", b, n, len(b))
		}
	}
}
