package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
)

// A minimal msgpack reader for the shapes vLLM's KV events use. It never
// allocates from a length header: every array, map, string or binary
// length is checked against the bytes that remain, so a hostile header
// ("an array of 4 billion elements") fails at once instead of reserving
// memory, and nesting is bounded by maxDepth.

const maxDepth = 16

var errTruncated = errors.New("msgpack: truncated input")

type reader struct {
	b   []byte
	off int
}

func (r *reader) remaining() int { return len(r.b) - r.off }

func (r *reader) byte1() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	c := r.b[r.off]
	r.off++
	return c, nil
}

func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || n > r.remaining() {
		return nil, errTruncated
	}
	s := r.b[r.off : r.off+n]
	r.off += n
	return s, nil
}

func (r *reader) uintN(n int) (uint64, error) {
	s, err := r.take(n)
	if err != nil {
		return 0, err
	}
	switch n {
	case 1:
		return uint64(s[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(s)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(s)), nil
	default:
		return binary.BigEndian.Uint64(s), nil
	}
}

func (r *reader) peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errTruncated
	}
	return r.b[r.off], nil
}

// nil reports (and consumes) a msgpack nil.
func (r *reader) isNil() bool {
	if r.off < len(r.b) && r.b[r.off] == 0xc0 {
		r.off++
		return true
	}
	return false
}

// containerLen reads an array (wantMap false) or map header. Each element
// needs at least one byte (two per map entry), so a length larger than the
// bytes left is malformed.
func (r *reader) containerLen(wantMap bool) (int, error) {
	c, err := r.byte1()
	if err != nil {
		return 0, err
	}
	var n uint64
	switch {
	case !wantMap && c&0xf0 == 0x90:
		n = uint64(c & 0x0f)
	case wantMap && c&0xf0 == 0x80:
		n = uint64(c & 0x0f)
	case !wantMap && c == 0xdc, wantMap && c == 0xde:
		n, err = r.uintN(2)
	case !wantMap && c == 0xdd, wantMap && c == 0xdf:
		n, err = r.uintN(4)
	default:
		what := "array"
		if wantMap {
			what = "map"
		}
		return 0, fmt.Errorf("msgpack: want %s, got type byte 0x%02x", what, c)
	}
	if err != nil {
		return 0, err
	}
	per := uint64(1)
	if wantMap {
		per = 2
	}
	if n*per > uint64(r.remaining()) {
		return 0, errTruncated
	}
	return int(n), nil
}

func (r *reader) arrayLen() (int, error) { return r.containerLen(false) }
func (r *reader) mapLen() (int, error)   { return r.containerLen(true) }

// strOrBin reads a str or bin value; isStr tells which it was.
func (r *reader) strOrBin() (s []byte, isStr bool, err error) {
	c, err := r.byte1()
	if err != nil {
		return nil, false, err
	}
	var n uint64
	switch {
	case c&0xe0 == 0xa0:
		n, isStr = uint64(c&0x1f), true
	case c == 0xd9 || c == 0xc4:
		n, err = r.uintN(1)
		isStr = c == 0xd9
	case c == 0xda || c == 0xc5:
		n, err = r.uintN(2)
		isStr = c == 0xda
	case c == 0xdb || c == 0xc6:
		n, err = r.uintN(4)
		isStr = c == 0xdb
	default:
		return nil, false, fmt.Errorf("msgpack: want str or bin, got type byte 0x%02x", c)
	}
	if err != nil {
		return nil, false, err
	}
	s, err = r.take(int(min(n, math.MaxInt32)))
	return s, isStr, err
}

func (r *reader) str() (string, error) {
	s, isStr, err := r.strOrBin()
	if err != nil {
		return "", err
	}
	if !isStr {
		return "", errors.New("msgpack: want str, got bin")
	}
	return string(s), nil
}

// integer reads any msgpack integer. neg reports a negative value, whose
// magnitude-free two's complement is in u.
func (r *reader) integer() (u uint64, neg bool, err error) {
	c, err := r.byte1()
	if err != nil {
		return 0, false, err
	}
	switch {
	case c <= 0x7f:
		return uint64(c), false, nil
	case c >= 0xe0:
		return uint64(int64(int8(c))), true, nil
	case c >= 0xcc && c <= 0xcf:
		u, err = r.uintN(1 << (c - 0xcc))
		return u, false, err
	case c >= 0xd0 && c <= 0xd3:
		n := 1 << (c - 0xd0)
		u, err = r.uintN(n)
		if err != nil {
			return 0, false, err
		}
		shift := 64 - 8*n
		v := int64(u<<shift) >> shift // sign-extend
		return uint64(v), v < 0, nil
	}
	return 0, false, fmt.Errorf("msgpack: want int, got type byte 0x%02x", c)
}

// int64v reads an integer that must fit an int64.
func (r *reader) int64v() (int64, error) {
	u, neg, err := r.integer()
	if err != nil {
		return 0, err
	}
	if !neg && u > math.MaxInt64 {
		return 0, errors.New("msgpack: integer overflows int64")
	}
	return int64(u), nil
}

func (r *reader) float() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case 0xca:
		r.off++
		u, err := r.uintN(4)
		return float64(math.Float32frombits(uint32(u))), err
	case 0xcb:
		r.off++
		u, err := r.uintN(8)
		return math.Float64frombits(u), err
	}
	v, err := r.int64v() // msgspec writes integral floats as floats, but be lenient
	return float64(v), err
}

// skip consumes one value of any type.
func (r *reader) skip(depth int) error {
	if depth > maxDepth {
		return errors.New("msgpack: nesting too deep")
	}
	c, err := r.peek()
	if err != nil {
		return err
	}
	switch {
	case c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3):
		_, _, err = r.integer()
		return err
	case c == 0xc0 || c == 0xc2 || c == 0xc3:
		r.off++
		return nil
	case c == 0xca || c == 0xcb:
		_, err = r.float()
		return err
	case c&0xe0 == 0xa0, c == 0xd9, c == 0xda, c == 0xdb, c == 0xc4, c == 0xc5, c == 0xc6:
		_, _, err = r.strOrBin()
		return err
	case c&0xf0 == 0x90, c == 0xdc, c == 0xdd:
		n, err := r.arrayLen()
		if err != nil {
			return err
		}
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case c&0xf0 == 0x80, c == 0xde, c == 0xdf:
		n, err := r.mapLen()
		if err != nil {
			return err
		}
		for range 2 * n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case c >= 0xd4 && c <= 0xd8: // fixext 1..16
		r.off++
		_, err = r.take(1 + 1<<(c-0xd4))
		return err
	case c >= 0xc7 && c <= 0xc9: // ext 8/16/32
		r.off++
		n, err := r.uintN(1 << (c - 0xc7))
		if err != nil {
			return err
		}
		_, err = r.take(int(min(n+1, math.MaxInt32)))
		return err
	}
	return fmt.Errorf("msgpack: unknown type byte 0x%02x", c)
}
