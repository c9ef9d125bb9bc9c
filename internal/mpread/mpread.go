// Package mpread reads untrusted msgpack from the network without
// allocating more than the input justifies.
//
// A general msgpack decoder trusts the lengths a header declares: it reads
// a 5-byte "4 GiB string" (db ff ff ff ff) or "array of 4 billion
// elements" by reserving memory for it before it finds the input short,
// and recurses into any nesting. Here every declared string, binary or
// extension length and every array or map count is checked against the
// bytes that remain before anything is read (each element takes at least
// one byte, each map entry two), data is returned as sub-slices of the
// input, and skipping is iterative with an optional depth limit. A Reader
// never allocates except to build the error of a type mismatch.
//
// Its callers keep only their schema: the KV-event decoder
// (internal/kvevents), the worker-registration decoder
// (internal/discovery/zmq) and the side-channel bounds check
// (internal/sim/sidechan).
package mpread

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Errors of malformed input. ErrLength wraps ErrTruncated.
var (
	// ErrTruncated: the input ends inside a header or a fixed-size value.
	ErrTruncated = errors.New("msgpack: truncated input")
	// ErrLength: a declared length or element count is larger than the
	// bytes left.
	ErrLength = fmt.Errorf("%w: declared length exceeds the bytes left", ErrTruncated)
	// ErrCode: the type byte 0xc1, which msgpack never uses.
	ErrCode = errors.New("msgpack: invalid type byte 0xc1")
	// ErrDepth: values nested deeper than Skip's limit.
	ErrDepth = errors.New("msgpack: nesting too deep")
)

// Reader reads msgpack values from a byte slice, from an offset that only
// moves forward. It holds no state beyond the offset.
type Reader struct {
	b   []byte
	off int
}

// NewReader returns a Reader at the start of b.
func NewReader(b []byte) *Reader { return &Reader{b: b} }

// Remaining is the number of bytes not yet read.
func (r *Reader) Remaining() int { return len(r.b) - r.off }

// Peek returns the next type byte without consuming it.
func (r *Reader) Peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, ErrTruncated
	}
	return r.b[r.off], nil
}

// take consumes n bytes, which the caller has checked are there; the slice
// is capped so that appending to it cannot write into the input.
func (r *Reader) take(n int) []byte {
	p := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return p
}

// bigEndian reads a size-byte (1, 2, 4 or 8) big-endian unsigned integer:
// every length field and every number body goes through it.
func (r *Reader) bigEndian(size int) (uint64, error) {
	if size > r.Remaining() {
		return 0, ErrTruncated
	}
	p := r.take(size)
	switch size {
	case 1:
		return uint64(p[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), nil
	}
	return binary.BigEndian.Uint64(p), nil
}

// Header reads a type byte and the length field that follows it, if any,
// and checks that what the header declares fits in the bytes left: its
// Body, and one byte for each of its Children. The body and the children
// are left to read.
func (r *Reader) Header() (Header, error) {
	c, err := r.Peek()
	if err != nil {
		return Header{}, err
	}
	r.off++
	n, err := r.declared(c)
	if err != nil {
		return Header{}, err
	}
	h := Header{Code: c, Family: FamilyOf(c)}
	switch h.Family {
	case Array, Map:
		per := uint64(1)
		if h.Family == Map {
			per = 2
		}
		if n*per > uint64(r.Remaining()) {
			return Header{}, ErrLength
		}
		h.Len, h.Children = int(n), int(n*per)
	case Str, Bin, Ext:
		body := n
		if h.Family == Ext {
			body++ // the extension's type byte
		}
		if body > uint64(r.Remaining()) {
			return Header{}, ErrLength
		}
		h.Len, h.Body = int(n), int(body)
	default:
		if n > uint64(r.Remaining()) {
			return Header{}, ErrTruncated
		}
		h.Body = int(n)
	}
	return h, nil
}

// declared reads what the header with type byte c declares: the length or
// count in its low bits or its length field, or the size of a fixed-size
// body (0 for fixints, nil and bools).
func (r *Reader) declared(c byte) (uint64, error) {
	switch {
	case c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3:
		return 0, nil
	case c <= 0x9f: // fixmap, fixarray
		return uint64(c & 0x0f), nil
	case c <= 0xbf: // fixstr
		return uint64(c & 0x1f), nil
	case c == 0xc1:
		return 0, ErrCode
	case c <= 0xc6: // bin 8/16/32
		return r.bigEndian(1 << (c - 0xc4))
	case c <= 0xc9: // ext 8/16/32
		return r.bigEndian(1 << (c - 0xc7))
	case c <= 0xcb: // float32/64
		return 4 << (c - 0xca), nil
	case c <= 0xcf: // uint 8/16/32/64
		return 1 << (c - 0xcc), nil
	case c <= 0xd3: // int 8/16/32/64
		return 1 << (c - 0xd0), nil
	case c <= 0xd8: // fixext 1/2/4/8/16
		return 1 << (c - 0xd4), nil
	case c <= 0xdb: // str 8/16/32
		return r.bigEndian(1 << (c - 0xd9))
	case c <= 0xdd: // array 16/32
		return r.bigEndian(2 << (c - 0xdc))
	}
	return r.bigEndian(2 << (c - 0xde)) // map 16/32
}

// MaxDepth is the deepest nesting limit Skip enforces.
const MaxDepth = 64

// NoDepthLimit, as Skip's limit, accepts any nesting: the input bounds it
// (every level takes a byte), and Skip does not recurse.
const NoDepthLimit = 0

// Skip consumes one value and everything nested in it. The value is at
// level 1 and its elements at level 2; a value at a level deeper than
// maxDepth is ErrDepth (so is a non-empty container at level maxDepth).
// maxDepth is NoDepthLimit or at most MaxDepth. Skip neither recurses nor
// allocates, and fails (ErrLength) as soon as more values are pending
// than bytes remain.
func (r *Reader) Skip(maxDepth int) error {
	if maxDepth < 0 || maxDepth > MaxDepth {
		panic(fmt.Sprintf("mpread: Skip depth limit %d out of range", maxDepth))
	}
	var left [MaxDepth]int // left[i]: values still to read at level i+1
	left[0] = 1
	depth, pending := 1, 1 // levels open; values to read at all of them
	for pending > 0 {
		for left[depth-1] == 0 {
			depth--
		}
		left[depth-1]--
		pending--
		h, err := r.Header()
		if err != nil {
			return err
		}
		r.off += h.Body // checked by Header
		pending += h.Children
		if pending > r.Remaining() {
			return ErrLength
		}
		switch {
		case h.Children == 0:
		case maxDepth == NoDepthLimit:
			left[0] += h.Children // one level: only the count matters
		case depth == maxDepth:
			return ErrDepth
		default:
			left[depth] = h.Children
			depth++
		}
	}
	return nil
}
