package rawjson

import (
	"bytes"
	"math"
)

// Uint32s decodes a JSON array of integers in [0, 2^32) written as plain
// digits, what vLLM's /tokenize answers and a token-id prompt holds,
// without reflection. ok is false for anything else: a sign, a fraction,
// an exponent, a leading zero, null or another type, a value out of
// range, bytes after the array. A caller then decodes b with
// encoding/json, which returns the error or, for the rare valid shape
// this does not take (an integer written 1e3 is not one), the value.
// When ok, the result equals encoding/json's (an empty array gives an
// empty, non-nil slice).
func Uint32s(b []byte) (ids []uint32, ok bool) {
	s := scanner{b: b}
	s.ws()
	if s.i >= len(b) || b[s.i] != '[' {
		return nil, false
	}
	s.i++
	s.ws()
	ids = make([]uint32, 0, bytes.Count(b, []byte{','})+1)
	if s.i < len(b) && b[s.i] == ']' {
		s.i++
		return s.end(ids)
	}
	for {
		v, good := s.uint32()
		if !good {
			return nil, false
		}
		ids = append(ids, v)
		s.ws()
		if s.i >= len(b) {
			return nil, false
		}
		switch b[s.i] {
		case ',':
			s.i++
			s.ws()
		case ']':
			s.i++
			return s.end(ids)
		default:
			return nil, false
		}
	}
}

// uint32 reads one integer of plain digits, without a leading zero
// unless it is 0.
func (s *scanner) uint32() (uint32, bool) {
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		v = v*10 + uint64(s.b[s.i]-'0')
		if v > math.MaxUint32 {
			return 0, false
		}
		s.i++
	}
	n := s.i - start
	if n == 0 || (n > 1 && s.b[start] == '0') {
		return 0, false
	}
	// A fraction or an exponent makes it a number this does not take.
	if s.i < len(s.b) && (s.b[s.i] == '.' || s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		return 0, false
	}
	return uint32(v), true
}

// end returns ids if only white space is left.
func (s *scanner) end(ids []uint32) ([]uint32, bool) {
	s.ws()
	if s.i != len(s.b) {
		return nil, false
	}
	return ids, true
}
