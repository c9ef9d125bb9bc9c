package mpread

import (
	"errors"
	"fmt"
	"math"
)

// Typed reads. Each checks the type byte first: a value of another family
// is an error naming what was wanted ("msgpack: want array, got type byte
// 0x81") before any of it is read.

var (
	errBin      = errors.New("msgpack: want str, got bin")
	errOverflow = errors.New("msgpack: integer overflows int64")
)

// typed reads the header of a value of family a or b.
func (r *Reader) typed(want string, a, b Family) (Header, error) {
	c, err := r.Peek()
	if err != nil {
		return Header{}, err
	}
	if f := FamilyOf(c); f != a && f != b {
		return Header{}, fmt.Errorf("msgpack: want %s, got type byte 0x%02x", want, c)
	}
	return r.Header()
}

// Nil consumes a nil and reports whether the next value was one.
func (r *Reader) Nil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// ArrayLen reads an array header and returns its element count, at most
// the bytes left; the elements follow.
func (r *Reader) ArrayLen() (int, error) {
	h, err := r.typed("array", Array, Array)
	return h.Len, err
}

// MapLen reads a map header and returns its entry count, at most half the
// bytes left; the keys and values follow, alternating.
func (r *Reader) MapLen() (int, error) {
	h, err := r.typed("map", Map, Map)
	return h.Len, err
}

// StrOrBin reads a str or bin value: its data, a sub-slice of the input,
// and whether it was a str.
func (r *Reader) StrOrBin() (data []byte, isStr bool, err error) {
	// The common cases inline (block hashes are bin8 or short strs): a
	// fixstr, str8 or bin8 whose data is there.
	if left := len(r.b) - r.off; left > 0 {
		switch c := r.b[r.off]; {
		case c >= 0xa0 && c <= 0xbf:
			if n := int(c & 0x1f); n < left {
				r.off++
				return r.take(n), true, nil
			}
		case c == 0xc4 || c == 0xd9:
			if left >= 2 {
				if n := int(r.b[r.off+1]); n <= left-2 {
					r.off += 2
					return r.take(n), c == 0xd9, nil
				}
			}
		}
	}
	return r.strOrBin()
}

// strOrBin is StrOrBin through the general header.
func (r *Reader) strOrBin() (data []byte, isStr bool, err error) {
	h, err := r.typed("str or bin", Str, Bin)
	if err != nil {
		return nil, false, err
	}
	return r.take(h.Body), h.Family == Str, nil
}

// Str reads a str value (not bin); its data is a sub-slice of the input.
func (r *Reader) Str() ([]byte, error) {
	s, isStr, err := r.StrOrBin()
	if err != nil {
		return nil, err
	}
	if !isStr {
		return nil, errBin
	}
	return s, nil
}

// Integer reads an int or uint of any size. neg reports a negative value,
// whose two's complement is in u (int64(u) is the value).
func (r *Reader) Integer() (u uint64, neg bool, err error) {
	// The common cases inline (a block's token ids are thousands of
	// them): a fixint, or an int or uint of 1-8 bytes that are there.
	if r.off < len(r.b) {
		switch c := r.b[r.off]; {
		case c <= 0x7f:
			r.off++
			return uint64(c), false, nil
		case c >= 0xe0:
			r.off++
			return uint64(int64(int8(c))), true, nil
		case c >= 0xcc && c <= 0xd3:
			size := 1 << ((c - 0xcc) & 3)
			if size < len(r.b)-r.off {
				r.off++
				u, _ = r.bigEndian(size)
				if c <= 0xcf {
					return u, false, nil
				}
				shift := 64 - 8*size // sign-extend
				v := int64(u<<shift) >> shift
				return uint64(v), v < 0, nil
			}
		}
	}
	return r.integer()
}

// integer is Integer through the general header: type errors, truncation.
func (r *Reader) integer() (u uint64, neg bool, err error) {
	h, err := r.typed("int", Int, Uint)
	if err != nil {
		return 0, false, err
	}
	if h.Body == 0 { // positive or negative fixint
		v := int64(int8(h.Code))
		return uint64(v), v < 0, nil
	}
	u, _ = r.bigEndian(h.Body) // fits: checked by Header
	if h.Family == Uint {
		return u, false, nil
	}
	shift := 64 - 8*h.Body // sign-extend
	v := int64(u<<shift) >> shift
	return uint64(v), v < 0, nil
}

// Int64 reads an integer that fits an int64.
func (r *Reader) Int64() (int64, error) {
	u, neg, err := r.Integer()
	if err != nil {
		return 0, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, errOverflow
	}
	return int64(u), nil
}

// Float reads a float32 or float64.
func (r *Reader) Float() (float64, error) {
	h, err := r.typed("float", Float, Float)
	if err != nil {
		return 0, err
	}
	u, _ := r.bigEndian(h.Body) // fits: checked by Header
	if h.Body == 4 {
		return float64(math.Float32frombits(uint32(u))), nil
	}
	return math.Float64frombits(u), nil
}
