package mpread

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

func TestInteger(t *testing.T) {
	for _, tc := range []struct {
		in  []byte
		u   uint64
		neg bool
	}{
		{[]byte{0x00}, 0, false},
		{[]byte{0x7f}, 127, false},
		{[]byte{0xe0}, uint64(1<<64 - 32), true},
		{[]byte{0xff}, math.MaxUint64, true},
		{[]byte{0xcc, 0xff}, 255, false},
		{[]byte{0xcd, 0xff, 0xfe}, 65534, false},
		{[]byte{0xce, 0xff, 0xff, 0xff, 0xfd}, 1<<32 - 3, false},
		{[]byte{0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfc}, math.MaxUint64 - 3, false},
		{[]byte{0xd0, 0x80}, uint64(1<<64 - 128), true},
		{[]byte{0xd0, 0x7f}, 127, false},
		{[]byte{0xd1, 0xff, 0xfe}, math.MaxUint64 - 1, true},
		{[]byte{0xd2, 0xff, 0xff, 0xff, 0xfd}, math.MaxUint64 - 2, true},
		{[]byte{0xd2, 0x7f, 0xff, 0xff, 0xff}, math.MaxInt32, false},
		{[]byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}, 1 << 63, true},
	} {
		r := NewReader(append(bytes.Clone(tc.in), 0xc0))
		u, neg, err := r.Integer()
		if err != nil || u != tc.u || neg != tc.neg || r.Remaining() != 1 {
			t.Errorf("% x: %d %v %v (%d left), want %d %v", tc.in, u, neg, err, r.Remaining(), tc.u, tc.neg)
		}
	}
}

func TestInt64(t *testing.T) {
	if v, err := NewReader([]byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}).Int64(); err != nil || v != math.MinInt64 {
		t.Errorf("int64 min: %d %v", v, err)
	}
	if v, err := NewReader([]byte{0xcf, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}).Int64(); err != nil || v != math.MaxInt64 {
		t.Errorf("uint64 MaxInt64: %d %v", v, err)
	}
	if _, err := NewReader([]byte{0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0}).Int64(); err == nil || !strings.Contains(err.Error(), "overflows int64") {
		t.Errorf("uint64 1<<63: %v, want overflow", err)
	}
}

func TestFloat(t *testing.T) {
	for _, tc := range []struct {
		in   []byte
		want float64
	}{
		{[]byte{0xca, 0x3f, 0xc0, 0, 0}, 1.5},
		{[]byte{0xcb, 0xc0, 0x04, 0, 0, 0, 0, 0, 0}, -2.5},
	} {
		if f, err := NewReader(tc.in).Float(); err != nil || f != tc.want {
			t.Errorf("% x: %v %v, want %v", tc.in, f, err, tc.want)
		}
	}
}

func TestStrOrBin(t *testing.T) {
	for _, tc := range headerCases {
		if tc.want.Family != Str && tc.want.Family != Bin {
			continue
		}
		r := NewReader(tc.in)
		s, isStr, err := r.StrOrBin()
		want := tc.in[len(tc.in)-tc.want.Len:]
		if err != nil || !bytes.Equal(s, want) || isStr != (tc.want.Family == Str) || r.Remaining() != 0 {
			t.Errorf("%s: %q %v %v, want %q", tc.name, s, isStr, err, want)
		}
		if cap(s) != len(s) {
			t.Errorf("%s: data not capped: an append would write into the input", tc.name)
		}
		s, err = NewReader(tc.in).Str()
		if tc.want.Family == Str && (err != nil || !bytes.Equal(s, want)) {
			t.Errorf("%s: Str %q %v", tc.name, s, err)
		}
		if tc.want.Family == Bin && (err == nil || err.Error() != "msgpack: want str, got bin") {
			t.Errorf("%s: Str %v, want an error", tc.name, err)
		}
	}
}

func TestNil(t *testing.T) {
	r := NewReader([]byte{0xc0, 0x01})
	if !r.Nil() || r.Remaining() != 1 || r.Nil() || r.Remaining() != 1 {
		t.Fatal("Nil consumed the wrong bytes")
	}
	if NewReader(nil).Nil() {
		t.Fatal("nil at the end of the input")
	}
}

func TestContainerLen(t *testing.T) {
	for _, tc := range headerCases {
		r := NewReader(tc.in)
		switch tc.want.Family {
		case Array:
			if n, err := r.ArrayLen(); err != nil || n != tc.want.Len || len(tc.in)-r.Remaining() != tc.hdr {
				t.Errorf("%s: ArrayLen %d %v", tc.name, n, err)
			}
		case Map:
			if n, err := r.MapLen(); err != nil || n != tc.want.Len || len(tc.in)-r.Remaining() != tc.hdr {
				t.Errorf("%s: MapLen %d %v", tc.name, n, err)
			}
		}
	}
}

// A typed read of the wrong family names what it wanted and the type
// byte, and consumes nothing.
func TestTypeMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []byte
		read func(*Reader) error
		want string
	}{
		{"ArrayLen of a map", []byte{0x80}, func(r *Reader) error { _, err := r.ArrayLen(); return err }, "msgpack: want array, got type byte 0x80"},
		{"MapLen of an array", []byte{0xdc, 0, 0}, func(r *Reader) error { _, err := r.MapLen(); return err }, "msgpack: want map, got type byte 0xdc"},
		{"StrOrBin of an int", []byte{0x01}, func(r *Reader) error { _, _, err := r.StrOrBin(); return err }, "msgpack: want str or bin, got type byte 0x01"},
		{"Str of an ext", []byte{0xd4, 1, 1}, func(r *Reader) error { _, err := r.Str(); return err }, "msgpack: want str or bin, got type byte 0xd4"},
		{"Integer of a float", []byte{0xca, 0, 0, 0, 0}, func(r *Reader) error { _, _, err := r.Integer(); return err }, "msgpack: want int, got type byte 0xca"},
		{"Integer of a bool", []byte{0xc3}, func(r *Reader) error { _, _, err := r.Integer(); return err }, "msgpack: want int, got type byte 0xc3"},
		{"Float of an int", []byte{0x01}, func(r *Reader) error { _, err := r.Float(); return err }, "msgpack: want float, got type byte 0x01"},
		// The family is checked before a length field that is cut short.
		{"Integer of a cut str32", []byte{0xdb, 0xff}, func(r *Reader) error { _, _, err := r.Integer(); return err }, "msgpack: want int, got type byte 0xdb"},
	} {
		r := NewReader(tc.in)
		if err := tc.read(r); err == nil || err.Error() != tc.want || r.Remaining() != len(tc.in) {
			t.Errorf("%s: %v (%d left), want %q", tc.name, err, r.Remaining(), tc.want)
		}
	}
	for name, read := range map[string]func(*Reader) error{
		"ArrayLen": func(r *Reader) error { _, err := r.ArrayLen(); return err },
		"Integer":  func(r *Reader) error { _, _, err := r.Integer(); return err },
		"Float":    func(r *Reader) error { _, err := r.Float(); return err },
		"Str":      func(r *Reader) error { _, err := r.Str(); return err },
	} {
		if err := read(NewReader(nil)); err != ErrTruncated {
			t.Errorf("%s of nothing: %v, want ErrTruncated", name, err)
		}
	}
}

// Against an independent encoder: every value it writes is skipped to its
// end, and numbers and strings read back as written.
func TestAgainstEncoder(t *testing.T) {
	values := []any{
		nil, true, false, 0, -1, -32, -33, 127, 128, 255, 256, 65535, 65536, -129, -32769, int64(math.MinInt64),
		uint64(math.MaxUint64), float32(1.5), 2.25, "", "x", strings.Repeat("s", 40), strings.Repeat("s", 300), strings.Repeat("s", 70000),
		[]byte{}, []byte("b"), bytes.Repeat([]byte("b"), 300), bytes.Repeat([]byte("b"), 70000), time.Unix(1, 2), time.Unix(1<<40, 0),
		[]any{}, make([]any, 20), make([]int, 70000), map[string]any{}, map[string]any{"a": []any{1, map[string]any{"b": nil}}},
	}
	for _, v := range values {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if r := NewReader(b); r.Skip(4) != nil || r.Remaining() != 0 {
			t.Errorf("%T %.40v: not skipped to its end", v, v)
		}
		checkRead(t, v, b)
	}
}

// checkRead reads b with the typed read for v's type and compares.
func checkRead(t *testing.T, v any, b []byte) {
	t.Helper()
	r := NewReader(b)
	var got any
	var err error
	switch v.(type) {
	case int:
		var n int64
		n, err = r.Int64()
		got = int(n)
	case int64:
		got, err = r.Int64()
	case uint64:
		got, _, err = r.Integer()
	case float32:
		var f float64
		f, err = r.Float()
		got = float32(f)
	case float64:
		got, err = r.Float()
	case string:
		var s []byte
		s, err = r.Str()
		got = string(s)
	default:
		return
	}
	if err != nil || got != v || r.Remaining() != 0 {
		t.Errorf("%T %.40v: read %.40v %v", v, v, got, err)
	}
}

func TestBigEndian(t *testing.T) {
	r := NewReader([]byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
	for _, want := range []uint64{0x01, 0x0203, 0x04050607, 0x08090a0b0c0d0e0f} {
		if got, err := r.bigEndian(bits(want)); err != nil || got != want {
			t.Fatalf("got %#x %v, want %#x", got, err, want)
		}
	}
	if _, err := r.bigEndian(1); !errors.Is(err, ErrTruncated) {
		t.Fatalf("past the end: %v", err)
	}
}

func bits(v uint64) int {
	switch {
	case v <= 0xff:
		return 1
	case v <= 0xffff:
		return 2
	case v <= 0xffffffff:
		return 4
	}
	return 8
}

// TestFastPathsMatchHeader: Integer and StrOrBin's inline cases give what
// the general header path gives (value, error, bytes consumed) for every
// type byte followed by 0-40 bytes.
func TestFastPathsMatchHeader(t *testing.T) {
	for c := 0; c < 256; c++ {
		for n := 0; n <= 40; n++ {
			in := make([]byte, 1+n)
			in[0] = byte(c)
			for i := 1; i <= n; i++ {
				in[i] = byte(i * 7)
			}
			if n > 0 && c != 0xc4 && c != 0xd9 {
				in[1] = 0x05 // a length that fits for the one-byte lengths
			}
			fast, slow := NewReader(in), NewReader(in)
			u1, n1, e1 := fast.Integer()
			u2, n2, e2 := slow.integer()
			if u1 != u2 || n1 != n2 || (e1 == nil) != (e2 == nil) || (e1 == nil && fast.off != slow.off) {
				t.Fatalf("Integer % x: fast %d %v %v @%d, header %d %v %v @%d", in, u1, n1, e1, fast.off, u2, n2, e2, slow.off)
			}
			fast, slow = NewReader(in), NewReader(in)
			d1, s1, e1 := fast.StrOrBin()
			d2, s2, e2 := slow.strOrBin()
			if string(d1) != string(d2) || s1 != s2 || (e1 == nil) != (e2 == nil) || (e1 == nil && fast.off != slow.off) {
				t.Fatalf("StrOrBin % x: fast %q %v %v @%d, header %q %v %v @%d", in, d1, s1, e1, fast.off, d2, s2, e2, slow.off)
			}
		}
	}
}
