package mpread

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// headerCases: one complete value of every header format, the header it
// starts with, and how many bytes Header consumes (type byte and length
// field).
var headerCases = []struct {
	name string
	in   []byte
	want Header
	hdr  int
}{
	{"positive fixint 0", []byte{0x00}, Header{Code: 0x00, Family: Int}, 1},
	{"positive fixint 127", []byte{0x7f}, Header{Code: 0x7f, Family: Int}, 1},
	{"negative fixint -32", []byte{0xe0}, Header{Code: 0xe0, Family: Int}, 1},
	{"negative fixint -1", []byte{0xff}, Header{Code: 0xff, Family: Int}, 1},
	{"fixmap empty", []byte{0x80}, Header{Code: 0x80, Family: Map}, 1},
	{"fixmap 1", []byte{0x81, 0xa1, 'k', 0x01}, Header{Code: 0x81, Family: Map, Len: 1, Children: 2}, 1},
	{"fixarray empty", []byte{0x90}, Header{Code: 0x90, Family: Array}, 1},
	{"fixarray 2", []byte{0x92, 0x01, 0xc0}, Header{Code: 0x92, Family: Array, Len: 2, Children: 2}, 1},
	{"fixstr empty", []byte{0xa0}, Header{Code: 0xa0, Family: Str}, 1},
	{"fixstr 2", []byte{0xa2, 'h', 'i'}, Header{Code: 0xa2, Family: Str, Len: 2, Body: 2}, 1},
	{"nil", []byte{0xc0}, Header{Code: 0xc0, Family: Nil}, 1},
	{"false", []byte{0xc2}, Header{Code: 0xc2, Family: Bool}, 1},
	{"true", []byte{0xc3}, Header{Code: 0xc3, Family: Bool}, 1},
	{"bin8", []byte{0xc4, 2, 'a', 'b'}, Header{Code: 0xc4, Family: Bin, Len: 2, Body: 2}, 2},
	{"bin16", []byte{0xc5, 0, 2, 'a', 'b'}, Header{Code: 0xc5, Family: Bin, Len: 2, Body: 2}, 3},
	{"bin32", []byte{0xc6, 0, 0, 0, 2, 'a', 'b'}, Header{Code: 0xc6, Family: Bin, Len: 2, Body: 2}, 5},
	{"ext8", []byte{0xc7, 2, 5, 'a', 'b'}, Header{Code: 0xc7, Family: Ext, Len: 2, Body: 3}, 2},
	{"ext8 empty", []byte{0xc7, 0, 5}, Header{Code: 0xc7, Family: Ext, Body: 1}, 2},
	{"ext16", []byte{0xc8, 0, 2, 5, 'a', 'b'}, Header{Code: 0xc8, Family: Ext, Len: 2, Body: 3}, 3},
	{"ext32", []byte{0xc9, 0, 0, 0, 2, 5, 'a', 'b'}, Header{Code: 0xc9, Family: Ext, Len: 2, Body: 3}, 5},
	{"float32", []byte{0xca, 0x3f, 0xc0, 0, 0}, Header{Code: 0xca, Family: Float, Body: 4}, 1},
	{"float64", []byte{0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}, Header{Code: 0xcb, Family: Float, Body: 8}, 1},
	{"uint8", []byte{0xcc, 0xff}, Header{Code: 0xcc, Family: Uint, Body: 1}, 1},
	{"uint16", []byte{0xcd, 0xff, 0xfe}, Header{Code: 0xcd, Family: Uint, Body: 2}, 1},
	{"uint32", []byte{0xce, 0xff, 0xff, 0xff, 0xfd}, Header{Code: 0xce, Family: Uint, Body: 4}, 1},
	{"uint64", []byte{0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfc}, Header{Code: 0xcf, Family: Uint, Body: 8}, 1},
	{"int8", []byte{0xd0, 0x80}, Header{Code: 0xd0, Family: Int, Body: 1}, 1},
	{"int16", []byte{0xd1, 0xff, 0xfe}, Header{Code: 0xd1, Family: Int, Body: 2}, 1},
	{"int32", []byte{0xd2, 0xff, 0xff, 0xff, 0xfd}, Header{Code: 0xd2, Family: Int, Body: 4}, 1},
	{"int64", []byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}, Header{Code: 0xd3, Family: Int, Body: 8}, 1},
	{"fixext1", []byte{0xd4, 5, 'a'}, Header{Code: 0xd4, Family: Ext, Len: 1, Body: 2}, 1},
	{"fixext2", []byte{0xd5, 5, 'a', 'b'}, Header{Code: 0xd5, Family: Ext, Len: 2, Body: 3}, 1},
	{"fixext4", append([]byte{0xd6, 5}, "abcd"...), Header{Code: 0xd6, Family: Ext, Len: 4, Body: 5}, 1},
	{"fixext8", append([]byte{0xd7, 5}, "abcdefgh"...), Header{Code: 0xd7, Family: Ext, Len: 8, Body: 9}, 1},
	{"fixext16", append([]byte{0xd8, 5}, "abcdefghijklmnop"...), Header{Code: 0xd8, Family: Ext, Len: 16, Body: 17}, 1},
	{"str8", []byte{0xd9, 2, 'h', 'i'}, Header{Code: 0xd9, Family: Str, Len: 2, Body: 2}, 2},
	{"str16", []byte{0xda, 0, 2, 'h', 'i'}, Header{Code: 0xda, Family: Str, Len: 2, Body: 2}, 3},
	{"str32", []byte{0xdb, 0, 0, 0, 2, 'h', 'i'}, Header{Code: 0xdb, Family: Str, Len: 2, Body: 2}, 5},
	{"array16", []byte{0xdc, 0, 2, 0x01, 0x02}, Header{Code: 0xdc, Family: Array, Len: 2, Children: 2}, 3},
	{"array32", []byte{0xdd, 0, 0, 0, 2, 0x01, 0x02}, Header{Code: 0xdd, Family: Array, Len: 2, Children: 2}, 5},
	{"map16", []byte{0xde, 0, 1, 0xa1, 'k', 0x01}, Header{Code: 0xde, Family: Map, Len: 1, Children: 2}, 3},
	{"map32", []byte{0xdf, 0, 0, 0, 1, 0xa1, 'k', 0x01}, Header{Code: 0xdf, Family: Map, Len: 1, Children: 2}, 5},
}

func TestHeader(t *testing.T) {
	for _, tc := range headerCases {
		t.Run(tc.name, func(t *testing.T) {
			r := NewReader(tc.in)
			h, err := r.Header()
			if err != nil {
				t.Fatalf("% x: %v", tc.in, err)
			}
			if h != tc.want {
				t.Fatalf("% x: header %+v, want %+v", tc.in, h, tc.want)
			}
			if got := len(tc.in) - r.Remaining(); got != tc.hdr {
				t.Fatalf("% x: consumed %d bytes, want %d", tc.in, got, tc.hdr)
			}
			if f := FamilyOf(tc.in[0]); f != tc.want.Family {
				t.Fatalf("FamilyOf(0x%02x) = %v, want %v", tc.in[0], f, tc.want.Family)
			}
		})
	}
}

// Every type byte is classified, and 0xc1 alone is invalid.
func TestFamilyOfEveryByte(t *testing.T) {
	for c := range 256 {
		f := FamilyOf(byte(c))
		if (f == Invalid) != (c == 0xc1) || f.String() == "unknown" {
			t.Errorf("FamilyOf(0x%02x) = %v", c, f)
		}
	}
	if _, err := NewReader([]byte{0xc1}).Header(); !errors.Is(err, ErrCode) {
		t.Errorf("0xc1: %v, want ErrCode", err)
	}
	if err := NewReader([]byte{0x91, 0xc1}).Skip(NoDepthLimit); !errors.Is(err, ErrCode) {
		t.Errorf("0xc1 in an array: %v, want ErrCode", err)
	}
}

// Every complete value skips to its end; every shorter prefix of it is
// truncated, whatever the format.
func TestTruncatedEveryFamily(t *testing.T) {
	for _, tc := range headerCases {
		t.Run(tc.name, func(t *testing.T) {
			r := NewReader(tc.in)
			if err := r.Skip(NoDepthLimit); err != nil || r.Remaining() != 0 {
				t.Fatalf("% x: %v, %d bytes left", tc.in, err, r.Remaining())
			}
			for i := range len(tc.in) {
				p := tc.in[:i:i]
				if err := NewReader(p).Skip(NoDepthLimit); !errors.Is(err, ErrTruncated) {
					t.Errorf("prefix % x: Skip %v, want ErrTruncated", p, err)
				}
				_, err := NewReader(p).Header()
				if i < tc.hdr+tc.want.Body && !errors.Is(err, ErrTruncated) {
					t.Errorf("prefix % x: Header %v, want ErrTruncated", p, err)
				}
			}
		})
	}
}

// lengthBombs declare more than the 8 bytes that follow them.
var lengthBombs = []struct {
	name   string
	header []byte
}{
	{"fixstr", []byte{0xbf}},
	{"str8", []byte{0xd9, 0xff}},
	{"str16", []byte{0xda, 0xff, 0xff}},
	{"str32", []byte{0xdb, 0xff, 0xff, 0xff, 0xff}},
	{"bin8", []byte{0xc4, 0xff}},
	{"bin16", []byte{0xc5, 0xff, 0xff}},
	{"bin32", []byte{0xc6, 0xff, 0xff, 0xff, 0xff}},
	{"fixarray", []byte{0x9f}},
	{"array16", []byte{0xdc, 0xff, 0xff}},
	{"array32", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}},
	{"fixmap", []byte{0x8f}},
	{"fixmap pairs", []byte{0x85}}, // 5 entries fit in 8 bytes, 10 values do not
	{"map16", []byte{0xde, 0xff, 0xff}},
	{"map32", []byte{0xdf, 0xff, 0xff, 0xff, 0xff}},
	{"map32 pairs", []byte{0xdf, 0x7f, 0xff, 0xff, 0xff}},
	{"fixext16", []byte{0xd8}},
	{"ext8", []byte{0xc7, 0xff}},
	{"ext16", []byte{0xc8, 0xff, 0xff}},
	{"ext32", []byte{0xc9, 0xff, 0xff, 0xff, 0xff}},
	{"ext8 type byte", []byte{0xc7, 0x08}}, // 8 data bytes, but the type byte too
}

// A declared length larger than the input fails at the header, without
// allocating, through every reading that can meet it.
func TestDeclaredTooLarge(t *testing.T) {
	tail := bytes.Repeat([]byte{0x01}, 8)
	reads := map[string]func(*Reader) error{
		"Header":   func(r *Reader) error { _, err := r.Header(); return err },
		"Skip":     func(r *Reader) error { return r.Skip(NoDepthLimit) },
		"Skip(16)": func(r *Reader) error { return r.Skip(16) },
		"StrOrBin": func(r *Reader) error { _, _, err := r.StrOrBin(); return err },
		"ArrayLen": func(r *Reader) error { _, err := r.ArrayLen(); return err },
		"MapLen":   func(r *Reader) error { _, err := r.MapLen(); return err },
	}
	for _, bomb := range lengthBombs {
		in := append(bytes.Clone(bomb.header), tail...)
		fam := FamilyOf(in[0])
		for name, read := range reads {
			if name == "StrOrBin" && fam != Str && fam != Bin || name == "ArrayLen" && fam != Array || name == "MapLen" && fam != Map {
				continue
			}
			if err := read(NewReader(in)); !errors.Is(err, ErrLength) {
				t.Errorf("%s: %s: %v, want ErrLength", bomb.name, name, err)
			}
			r := NewReader(in) // allocated here: read is called indirectly
			if a := testing.AllocsPerRun(100, func() { *r = Reader{b: in}; _ = read(r) }); a != 0 {
				t.Errorf("%s: %s: %.0f allocations", bomb.name, name, a)
			}
		}
	}
}

func nestArrays(k int, inner string) []byte { return []byte(strings.Repeat("\x91", k) + inner) }
func nestMaps(k int, inner string) []byte   { return []byte(strings.Repeat("\x81\xa1k", k) + inner) }

// Skip's limit: a value at level maxDepth is accepted (an empty container
// too), one deeper is ErrDepth.
func TestSkipDepth(t *testing.T) {
	for _, limit := range []int{1, 2, 16, 32, MaxDepth} {
		for name, nest := range map[string]func(int, string) []byte{"arrays": nestArrays, "maps": nestMaps} {
			for _, tc := range []struct {
				in   []byte
				want error
			}{
				{nest(limit-1, "\x01"), nil},
				{nest(limit-1, "\x90"), nil},
				{nest(limit-1, "\x80"), nil},
				{nest(limit, "\x01"), ErrDepth},
				{nest(limit-1, "\x92\x01\x01"), ErrDepth},
				{nest(limit+5, "\x01"), ErrDepth},
			} {
				r := NewReader(tc.in)
				err := r.Skip(limit)
				if !errors.Is(err, tc.want) || err == nil && r.Remaining() != 0 {
					t.Errorf("%s, limit %d, % x: %v (%d left), want %v", name, limit, tc.in, err, r.Remaining(), tc.want)
				}
			}
		}
	}
}

// Without a limit any nesting the input can hold is skipped, without
// recursion or allocation.
func TestSkipNoDepthLimit(t *testing.T) {
	deep := nestArrays(100000, "\x01")
	skip := func() {
		if err := NewReader(deep).Skip(NoDepthLimit); err != nil {
			t.Fatal(err)
		}
	}
	if a := testing.AllocsPerRun(10, skip); a != 0 {
		t.Fatalf("%.0f allocations", a)
	}
	deep = nestMaps(1000, "\x01")
	if err := NewReader(deep).Skip(NoDepthLimit); err != nil {
		t.Fatal(err)
	}
	if err := NewReader(deep).Skip(MaxDepth); !errors.Is(err, ErrDepth) {
		t.Fatalf("limit %d: %v", MaxDepth, err)
	}
}

func TestSkipLimitOutOfRange(t *testing.T) {
	for _, limit := range []int{-1, MaxDepth + 1} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Skip(%d) did not panic", limit)
				}
			}()
			_ = NewReader([]byte{0x01}).Skip(limit)
		}()
	}
}

// Skip reads exactly one value: what follows is left, and a container
// whose elements run past the input fails as soon as the bytes left are
// fewer than the values pending.
func TestSkipTrailing(t *testing.T) {
	for _, tc := range []struct {
		in   []byte
		left int
		err  error
	}{
		{[]byte{0x92, 0x01, 0x02, 0xc0, 0xc0}, 2, nil},
		{[]byte{0x81, 0xa1, 'k', 0x90, 0x01}, 1, nil},
		{[]byte{0x01, 0x01}, 1, nil},
		{[]byte{0x93, 0xa3, 'a', 'b', 'c', 0x01}, 0, ErrLength},
		{[]byte{0x92, 0x92, 0x01, 0x01}, 0, ErrLength},
	} {
		r := NewReader(tc.in)
		err := r.Skip(NoDepthLimit)
		if !errors.Is(err, tc.err) || err == nil && r.Remaining() != tc.left {
			t.Errorf("% x: %v with %d left, want %v with %d", tc.in, err, r.Remaining(), tc.err, tc.left)
		}
	}
}
