package rawjson

import (
	"encoding/json"
	"slices"
	"strconv"
	"strings"
	"testing"
)

func TestUint32s(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []uint32
		ok   bool
	}{
		{`[1,2,3]`, []uint32{1, 2, 3}, true},
		{" [ 0 ,\n\t42\r, 4294967295 ] \n", []uint32{0, 42, 4294967295}, true},
		{`[]`, []uint32{}, true},
		{`[ ]`, []uint32{}, true},
		{`[4294967296]`, nil, false}, // out of range
		{`[99999999999999999999999]`, nil, false},
		{`[-1]`, nil, false},
		{`[01]`, nil, false},
		{`[1.0]`, nil, false},
		{`[1e3]`, nil, false}, // valid JSON, left to encoding/json
		{`[1,]`, nil, false},
		{`[,1]`, nil, false},
		{`[1 2]`, nil, false},
		{`[1]x`, nil, false},
		{`[1`, nil, false},
		{`[`, nil, false},
		{``, nil, false},
		{`null`, nil, false},
		{`["1"]`, nil, false},
		{`{"tokens":[1]}`, nil, false},
	} {
		got, ok := Uint32s([]byte(tc.in))
		if ok != tc.ok || !slices.Equal(got, tc.want) || (ok && got == nil) {
			t.Errorf("Uint32s(%q) = %v, %v; want %v, %v", tc.in, got, ok, tc.want, tc.ok)
		}
	}
}

// FuzzUint32s holds Uint32s to encoding/json: whatever it takes, json
// takes too, with the same ids.
func FuzzUint32s(f *testing.F) {
	for _, s := range []string{`[1,2,3]`, `[]`, ` [0, 4294967295 ]`, `[4294967296]`, `[01]`, `[1e3]`, `[-0]`, `[1,]`, `null`, `[1]]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, ok := Uint32s(b)
		if !ok {
			return
		}
		var ref []uint32
		if err := json.Unmarshal(b, &ref); err != nil {
			t.Fatalf("Uint32s(%q) = %v, encoding/json: %v", b, got, err)
		}
		if !slices.Equal(got, ref) || got == nil || ref == nil {
			t.Fatalf("Uint32s(%q) = %#v, encoding/json %#v", b, got, ref)
		}
	})
}

// tokenizeAnswer is a /tokenize answer of n ids as vLLM writes it.
func tokenizeAnswer(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"count":` + strconv.Itoa(n) + `,"max_model_len":4096,"tokens":[`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(strconv.Itoa((i * 7919) % 32000))
	}
	b.WriteString(`],"token_strs":null}`)
	return []byte(b.String())
}

// BenchmarkTokenIDs: the ids of a 2,300-token /tokenize answer, found with
// Lookup and read by Uint32s, against encoding/json into a struct.
func BenchmarkTokenIDs(b *testing.B) {
	answer := tokenizeAnswer(2300)
	b.Run("rawjson", func(b *testing.B) {
		for b.Loop() {
			v, err := Lookup(answer, "tokens")
			if err != nil {
				b.Fatal(err)
			}
			if ids, ok := Uint32s(v); !ok || len(ids) != 2300 {
				b.Fatal(len(ids), ok)
			}
		}
	})
	b.Run("encoding_json", func(b *testing.B) {
		for b.Loop() {
			var out struct {
				Tokens []uint32 `json:"tokens"`
			}
			if err := json.Unmarshal(answer, &out); err != nil || len(out.Tokens) != 2300 {
				b.Fatal(err)
			}
		}
	})
}

func BenchmarkUint32sOnly(b *testing.B) {
	v, _ := Lookup(tokenizeAnswer(2300), "tokens")
	for b.Loop() {
		if ids, ok := Uint32s(v); !ok || len(ids) != 2300 {
			b.Fatal(len(ids), ok)
		}
	}
}
