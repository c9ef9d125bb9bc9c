package sidechan

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// maxDepth bounds the nesting of a side-channel message: the protocol's
// deepest is a map holding lists.
const maxDepth = 32

// errTruncated: a declared length or element count runs past the payload.
var errTruncated = errors.New("msgpack: declared length exceeds the payload")

// checkBounds walks the first msgpack value of b and fails when a declared
// string, binary or extension length, or an array or map count, cannot fit
// in the bytes that follow it, or the nesting is deeper than maxDepth. The
// msgpack decoder allocates what a header declares (up to a megabyte per
// value) before it finds the payload short: a 16-byte message declaring a
// 3.6 GB string cost a megabyte, and a fuzzer's stream of them grew a
// process to gigabytes. Checked first, no value can declare more than the
// payload holds.
func checkBounds(b []byte) error {
	// pending[i]: values still to read at depth i (the top level: one).
	pending := make([]int, 1, 8)
	pending[0] = 1
	off := 0
	for len(pending) > 0 {
		top := len(pending) - 1
		if pending[top] == 0 {
			pending = pending[:top]
			continue
		}
		pending[top]--
		n, children, err := header(b, off)
		if err != nil {
			return err
		}
		off += n
		if children == 0 {
			continue
		}
		// Every element takes at least one byte.
		if children > len(b)-off {
			return errTruncated
		}
		if len(pending) == maxDepth {
			return fmt.Errorf("msgpack: nested deeper than %d", maxDepth)
		}
		pending = append(pending, children)
	}
	return nil
}

// header reads the value at b[off:]: the bytes it takes up to its first
// element (all of it for a scalar, a string or binary data) and, for an
// array or map, how many elements follow (a map's keys and values both).
func header(b []byte, off int) (n, children int, err error) {
	if off >= len(b) {
		return 0, 0, errTruncated
	}
	c := b[off]
	fixed := func(size int) (int, int, error) {
		if size > len(b)-off {
			return 0, 0, errTruncated
		}
		return size, 0, nil
	}
	// length reads a size-byte big-endian length after the code byte;
	// then skip bytes before the data (an extension's type), per bytes
	// for each unit it declares.
	length := func(size, skip int) (int, int, error) {
		if 1+size > len(b)-off {
			return 0, 0, errTruncated
		}
		var l uint64
		switch size {
		case 1:
			l = uint64(b[off+1])
		case 2:
			l = uint64(binary.BigEndian.Uint16(b[off+1:]))
		default:
			l = uint64(binary.BigEndian.Uint32(b[off+1:]))
		}
		if l > uint64(len(b)-off-1-size-skip) {
			return 0, 0, errTruncated
		}
		return fixed(1 + size + skip + int(l))
	}
	count := func(size, per int) (int, int, error) {
		if 1+size > len(b)-off {
			return 0, 0, errTruncated
		}
		var l uint64
		if size == 2 {
			l = uint64(binary.BigEndian.Uint16(b[off+1:]))
		} else {
			l = uint64(binary.BigEndian.Uint32(b[off+1:]))
		}
		if l > uint64(len(b)) { // before multiplying: no overflow
			return 0, 0, errTruncated
		}
		return 1 + size, int(l) * per, nil
	}
	switch {
	case c <= 0x7f || c >= 0xe0, c == 0xc0, c == 0xc2, c == 0xc3: // fixints, nil, bools
		return 1, 0, nil
	case c <= 0x8f: // fixmap
		return 1, int(c&0x0f) * 2, nil
	case c <= 0x9f: // fixarray
		return 1, int(c & 0x0f), nil
	case c <= 0xbf: // fixstr
		return fixed(1 + int(c&0x1f))
	}
	switch c {
	case 0xc4, 0xd9: // bin8, str8
		return length(1, 0)
	case 0xc5, 0xda: // bin16, str16
		return length(2, 0)
	case 0xc6, 0xdb: // bin32, str32
		return length(4, 0)
	case 0xc7: // ext8
		return length(1, 1)
	case 0xc8: // ext16
		return length(2, 1)
	case 0xc9: // ext32
		return length(4, 1)
	case 0xcc, 0xd0: // uint8, int8
		return fixed(2)
	case 0xcd, 0xd1: // uint16, int16
		return fixed(3)
	case 0xca, 0xce, 0xd2: // float32, uint32, int32
		return fixed(5)
	case 0xcb, 0xcf, 0xd3: // float64, uint64, int64
		return fixed(9)
	case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1, 2, 4, 8, 16
		return fixed(2 + 1<<(c-0xd4))
	case 0xdc: // array16
		return count(2, 1)
	case 0xdd: // array32
		return count(4, 1)
	case 0xde: // map16
		return count(2, 2)
	case 0xdf: // map32
		return count(4, 2)
	}
	return 0, 0, fmt.Errorf("msgpack: invalid code 0x%02x", c) // 0xc1
}
