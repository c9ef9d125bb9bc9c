package rawjson

import (
	"reflect"
	"strings"
	"testing"
)

// parseTwoPass is Parse as it was before checkedMembers: Valid over the
// whole document first, then a walk that trusts it.
func parseTwoPass(src []byte) (*Object, error) {
	if !Valid(src) {
		return nil, syntaxError(src)
	}
	open := skipWS(src, 0)
	if src[open] != '{' {
		return nil, ErrNotObject
	}
	o := &Object{src: src, open: open}
	s := trustingScanner{scanner{b: src, i: open + 1}}
	for {
		s.ws()
		if s.b[s.i] == '}' {
			break
		}
		if s.b[s.i] == ',' {
			s.i++
			s.ws()
		}
		start := s.i
		keyEnd := s.skipString()
		s.ws()
		s.i++ // ':'
		s.ws()
		value := s.i
		s.skipValue()
		key, err := decodeKey(src[start:keyEnd])
		if err != nil {
			return nil, err
		}
		o.members = append(o.members, Member{Key: key, Value: src[value:s.i], start: start, end: s.i})
	}
	o.close = s.i
	return o, nil
}

type trustingScanner struct{ scanner }

func (s *trustingScanner) skipString() int {
	s.i++
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case '\\':
			s.i += 2
		case '"':
			s.i++
			return s.i
		default:
			s.i++
		}
	}
	return s.i
}

func (s *trustingScanner) skipValue() {
	switch s.b[s.i] {
	case '"':
		s.skipString()
	case '{', '[':
		depth := 0
		for s.i < len(s.b) {
			switch s.b[s.i] {
			case '"':
				s.skipString()
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					s.i++
					return
				}
			}
			s.i++
		}
	default:
		for s.i < len(s.b) {
			c := s.b[s.i]
			if c == ',' || c == '}' || c == ']' || isSpace(c) {
				return
			}
			s.i++
		}
	}
}

// checkSamePass holds Parse (one pass, checkedMembers) to the two passes
// it replaced: the same error, members, offsets and closing brace.
func checkSamePass(t *testing.T, src []byte) {
	t.Helper()
	got, gerr := Parse(src)
	want, werr := parseTwoPass(src)
	if (gerr == nil) != (werr == nil) || (gerr != nil && gerr.Error() != werr.Error()) {
		t.Fatalf("Parse(%.80q): error %v, two passes %v", src, gerr, werr)
	}
	if gerr != nil {
		return
	}
	if got.open != want.open || got.close != want.close || len(got.members) != len(want.members) {
		t.Fatalf("Parse(%.80q): open %d close %d %d members, two passes %d %d %d",
			src, got.open, got.close, len(got.members), want.open, want.close, len(want.members))
	}
	for i := range got.members {
		if !reflect.DeepEqual(got.members[i], want.members[i]) {
			t.Fatalf("Parse(%.80q): member %d %+v, two passes %+v", src, i, got.members[i], want.members[i])
		}
	}
}

func TestParseOnePassMatchesTwo(t *testing.T) {
	cases := append([]string{
		`{"a":1,"b":[1,{"c":"d"}],"e":"\"}"}`, `{"a":1,"a":2}`, ` {"k\u0065y" : {"x":null} } `, `{"\xff":1}`,
		`{"a":1}  x`, `{"a":1}}`, `{"a" :1 , "b":2}`, `{"a":1,,"b":2}`, `{"a":1 "b":2}`, `{"a"::1}`, `{"a":1`,
		`{"a":"\u00"}`, `{"a\u00":1}`, `{"model":"m","prompt":"hi","max_tokens":1,"stream":true}`,
		`{"a":` + strings.Repeat(`[`, 9999) + strings.Repeat(`]`, 9999) + `}`,
		`{"a":` + strings.Repeat(`[`, 10000) + strings.Repeat(`]`, 10000) + `}`,
	}, validCases...)
	for _, c := range cases {
		checkSamePass(t, []byte(c))
	}
}

func FuzzParseOnePass(f *testing.F) {
	for _, c := range validCases {
		if len(c) < 200 {
			f.Add([]byte(c))
		}
	}
	f.Add([]byte(`{"a":1,"b":[1,{"c":"d"}],"e":"\"}"}`))
	f.Add([]byte(`{"a":1 "b":2}`))
	f.Fuzz(func(t *testing.T, src []byte) { checkSamePass(t, src) })
}
