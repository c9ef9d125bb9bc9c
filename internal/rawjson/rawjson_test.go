package rawjson

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"
	"testing"
	"unicode/utf8"
	"unsafe"
)

func TestApply(t *testing.T) {
	tests := []struct {
		name  string
		in    string
		edits []Edit
		want  string
	}{
		{"replace keeps order and spacing", `{"model": "m", "max_tokens": 100, "x":[1, 2]}`,
			[]Edit{Set("max_tokens", []byte("1"))}, `{"model": "m", "max_tokens": 1, "x":[1, 2]}`},
		{"append new key", `{"a":1}`, []Edit{Set("b", []byte(`{"c":null}`))}, `{"a":1,"b":{"c":null}}`},
		{"append to empty", `{ }`, []Edit{Set("b", []byte(`2`))}, `{"b":2 }`},
		{"delete middle", `{"a":1,"b":2,"c":3}`, []Edit{Delete("b")}, `{"a":1,"c":3}`},
		{"delete first", `{"a":1, "b":2}`, []Edit{Delete("a")}, `{ "b":2}`},
		{"delete last", `{"a":1,"b":2}`, []Edit{Delete("b")}, `{"a":1}`},
		{"delete only", `{"a":1}`, []Edit{Delete("a")}, `{}`},
		{"delete absent", `{"a":1}`, []Edit{Delete("zz")}, `{"a":1}`},
		{"delete first then set new", `{"a":1}`, []Edit{Delete("a"), Set("n", []byte(`true`))}, `{"n":true}`},
		{"unicode and escapes untouched", `{"p":"h\u00e9\"llo","stream":true}`, []Edit{Set("stream", []byte(`false`))}, `{"p":"h\u00e9\"llo","stream":false}`},
		{"repeated key both rewritten", `{"a":1,"a":2}`, []Edit{Set("a", []byte(`3`))}, `{"a":3,"a":3}`},
		{"nested untouched", `{"o":{"max_tokens":5},"max_tokens":7}`, []Edit{Set("max_tokens", []byte(`1`))}, `{"o":{"max_tokens":5},"max_tokens":1}`},
		{"a key edited twice: the last edit", `{"a":1,"b":2}`, []Edit{Set("a", []byte(`3`)), Delete("b"), Set("a", []byte(`4`))}, `{"a":4}`},
		// more edits than Apply scans for (editScan): found through a map
		{"many edits", `{"k0":0,"k3":0,"k9":0,"x":1}`, manyEdits(10), `{"k0":"v0","k3":"v3","k9":"v9","x":1,"k1":"v1","k2":"v2","k4":"v4","k5":"v5","k6":"v6","k7":"v7","k8":"v8"}`},
		{"many edits, a key twice: the last edit", `{"k0":0,"x":1}`, append(manyEdits(editScan), Delete("x"), Set("k0", []byte(`7`))), `{"k0":7,"k1":"v1","k2":"v2","k3":"v3","k4":"v4","k5":"v5","k6":"v6","k7":"v7"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Patch([]byte(tt.in), tt.edits...)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tt.want {
				t.Fatalf("got  %s\nwant %s", got, tt.want)
			}
			if !json.Valid(got) {
				t.Fatalf("invalid output %s", got)
			}
			o, _ := Parse([]byte(tt.in))
			checkSplice(t, o, tt.edits, got)
		})
	}
}

// checkSplice checks that Splice gives Apply's bytes (want) as non-empty
// pieces that alias the source and the edits' values rather than copy them.
func checkSplice(t *testing.T, o *Object, edits []Edit, want []byte) {
	t.Helper()
	if got := o.Splice(edits...).Bytes(); !bytes.Equal(got, want) {
		t.Fatalf("Splice = %q, want Apply's %q", got, want)
	}
	if len(edits) == 0 {
		return
	}
	s := o.pieces(edits) // what Splice makes of a longer source
	if got := s.Bytes(); !bytes.Equal(got, want) || s.Len() != len(want) {
		t.Fatalf("pieces = %q (Len %d), want Apply's %q", got, s.Len(), want)
	}
	if got := s.AppendTo([]byte("x")); string(got) != "x"+string(want) {
		t.Fatalf("AppendTo = %q", got)
	}
	for i := range s.NumParts() {
		p := s.Part(i)
		if len(p) == 0 {
			t.Fatalf("piece %d is empty", i)
		}
		if !aliases(p, o.src) && !aliasesAny(p, edits) && len(p) > len(`,"`)+len(longestKey(edits))+len(`":`) {
			t.Fatalf("piece %q is a copy (longer than a new member's key)", p)
		}
	}
}

// aliases reports whether p lies within b's memory.
func aliases(p, b []byte) bool {
	if len(p) == 0 || len(b) == 0 {
		return false
	}
	pa, ba := uintptr(unsafe.Pointer(&p[0])), uintptr(unsafe.Pointer(&b[0]))
	return pa >= ba && pa+uintptr(len(p)) <= ba+uintptr(len(b))
}

func aliasesAny(p []byte, edits []Edit) bool {
	for _, e := range edits {
		if aliases(p, e.Value) {
			return true
		}
	}
	return false
}

func longestKey(edits []Edit) string {
	k := ""
	for _, e := range edits {
		if len(e.Key) > len(k) {
			k = e.Key
		}
	}
	return k
}

// A leg body's edits, spliced into a prompt: the pieces cost two small
// allocations whatever the prompt's size; Apply copies it in one.
func TestSpliceAllocations(t *testing.T) {
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("word ", 2000) + `","max_tokens":128,"stream":true,"stream_options":{"include_usage":true}}`)
	o, err := Parse(body)
	if err != nil {
		t.Fatal(err)
	}
	edits := []Edit{Set("max_tokens", []byte("1")), Set("stream", []byte("false")), Delete("stream_options"), Set("kv_transfer_params", []byte(`{"a":1}`))}
	var s Spliced
	if n := testing.AllocsPerRun(100, func() { s = o.Splice(edits...) }); n > 2 {
		t.Errorf("Splice: %.0f allocations, want at most 2 (the pieces, the new key)", n)
	}
	if n := testing.AllocsPerRun(100, func() { _ = o.Apply(edits...) }); n != 1 {
		t.Errorf("Apply: %.0f allocations, want 1 (the document)", n)
	}
	if s.Len() > len(body) || s.NumParts() > 8 {
		t.Errorf("%d bytes in %d pieces", s.Len(), s.NumParts())
	}
	short, _ := Parse([]byte(`{"prompt":"hi","max_tokens":128}`))
	if n := testing.AllocsPerRun(100, func() { s = short.Splice(edits...) }); n != 1 || s.NumParts() != 1 {
		t.Errorf("a short source: %.0f allocations, %d pieces, want its copy (spliceMin)", n, s.NumParts())
	}
}

// manyEdits sets k0..k(n-1) to "v0".."v(n-1)".
func manyEdits(n int) []Edit {
	var es []Edit
	for i := range n {
		es = append(es, Set(fmt.Sprintf("k%d", i), []byte(fmt.Sprintf(`"v%d"`, i))))
	}
	return es
}

func TestParseErrors(t *testing.T) {
	for _, in := range []string{``, `[1,2]`, `"s"`, `{"a":}`, `{"a":1`, `null`} {
		if _, err := Parse([]byte(in)); err == nil {
			t.Errorf("Parse(%q): want error", in)
		}
	}
	if _, err := Parse([]byte(`[1]`)); err != ErrNotObject {
		t.Errorf("array: got %v want ErrNotObject", err)
	}
}

func TestGetters(t *testing.T) {
	o, err := Parse([]byte(`{"s":"x","b":true,"n":12,"f":3.0,"g":2.5,"z":null}`))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := o.String("s"); !ok || v != "x" {
		t.Errorf("String = %q %v", v, ok)
	}
	if v, ok := o.Bool("b"); !ok || !v {
		t.Errorf("Bool = %v %v", v, ok)
	}
	if v, ok := o.Int("n"); !ok || v != 12 {
		t.Errorf("Int n = %v %v", v, ok)
	}
	if v, ok := o.Int("f"); !ok || v != 3 {
		t.Errorf("Int f = %v %v", v, ok)
	}
	if _, ok := o.Int("g"); ok {
		t.Errorf("Int g should fail")
	}
	if !o.IsNull("z") || o.Has("missing") {
		t.Errorf("IsNull/Has wrong")
	}
}

func FuzzPatch(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":[1,{"c":"d"}],"e":"\"}"}`), "b")
	f.Add([]byte(`{}`), "x")
	f.Fuzz(func(t *testing.T, src []byte, key string) {
		o, err := Parse(src)
		if err != nil || !utf8.ValidString(key) {
			return
		}
		for _, edits := range [][]Edit{{Set(key, []byte(`1`))}, {Delete(key)}, {Delete(key), Set("k2", []byte(`"v"`))}} {
			out := o.Apply(edits...)
			if s := o.pieces(edits); !bytes.Equal(s.Bytes(), out) || s.Len() != len(out) {
				t.Fatalf("pieces gave %q, Apply %q", s.Bytes(), out)
			}
			if !json.Valid(out) {
				t.Fatalf("invalid output %q from %q edits %+v", out, src, edits)
			}
			var m map[string]any
			if err := json.Unmarshal(out, &m); err != nil {
				t.Fatalf("not an object: %q", out)
			}
			e := edits[len(edits)-1]
			if !e.Delete && m[e.Key] == nil {
				t.Fatalf("key %q missing after set: %q", e.Key, out)
			}
			if edits[0].Delete && len(edits) == 1 {
				if _, ok := m[key]; ok {
					t.Fatalf("key %q present after delete: %q", key, out)
				}
			}
		}
	})
}

// Objects with more members than fit inline, and the interned keys, parse
// to the same members as any other.
func TestParseManyMembersAndCommonKeys(t *testing.T) {
	var b strings.Builder
	b.WriteString(`{"model":"m","prompt":"p","stream":true,"top_k":3`)
	for i := range 20 {
		fmt.Fprintf(&b, `,"k%d":%d`, i, i)
	}
	b.WriteString(`,"modelx":1,"mode":2}`)
	o, err := Parse([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	ms := o.Members()
	if len(ms) != 26 || ms[0].Key != "model" || ms[3].Key != "top_k" || ms[4].Key != "k0" || ms[23].Key != "k19" || ms[24].Key != "modelx" || ms[25].Key != "mode" {
		t.Fatalf("members %d: %+v", len(ms), ms)
	}
	if v := o.Get("k19"); string(v) != "19" {
		t.Fatalf("k19 = %q", v)
	}
	if got, ok := commonKey([]byte("stream_options")); !ok || got != "stream_options" {
		t.Fatalf("commonKey(stream_options) = %q, %v", got, ok)
	}
	if _, ok := commonKey([]byte("streams")); ok {
		t.Fatal("commonKey matched a key it does not list")
	}
	// Appending to Members() must not write into the object.
	small, _ := Parse([]byte(`{"a":1,"b":2}`))
	_ = append(small.Members(), Member{Key: "x"})
	if n := len(small.Members()); n != 2 || small.small[2].Key != "" {
		t.Fatalf("append to Members() wrote into the object's inline members (%d members, slot 2 %q)", n, small.small[2].Key)
	}
}

// TestCommonKeysReturnThemselves: every constant commonKey knows is the
// key it was asked for (a typo in the switch would rename a member).
func TestCommonKeysReturnThemselves(t *testing.T) {
	src, err := os.ReadFile("rawjson.go")
	if err != nil {
		t.Fatal(err)
	}
	cases := regexp.MustCompile(`case "([^"]+)":\s+return "([^"]+)", true`).FindAllStringSubmatch(string(src), -1)
	if len(cases) < 40 {
		t.Fatalf("found %d cases in commonKey; the pattern no longer matches the source", len(cases))
	}
	for _, c := range cases {
		if c[1] != c[2] {
			t.Errorf("commonKey case %q returns %q", c[1], c[2])
		}
		if k, ok := commonKey([]byte(c[1])); !ok || k != c[1] {
			t.Errorf("commonKey(%q) = %q, %v", c[1], k, ok)
		}
	}
	if _, ok := commonKey([]byte("not_a_common_key")); ok {
		t.Error("an unknown key came back as common")
	}
}

// FuzzLookup holds IsObject and Lookup to Parse and Get: the same verdict,
// the same error, the same value (nil when absent).
func FuzzLookup(f *testing.F) {
	for _, tc := range []struct{ src, key string }{
		{`{"a":1,"b":[1,{"c":"d"}],"e":"\"}"}`, "b"},
		{`{"a":1,"a":2}`, "a"},
		{` {"k\u0065y" : {"x":null} } `, "key"},
		{`{"kv_transfer_params":null}`, "kv_transfer_params"},
		{`{"\xff":1}`, "\ufffd"},
		{`[1]`, "a"},
		{`{"a":`, "a"},
		{``, ""},
	} {
		f.Add([]byte(tc.src), tc.key)
	}
	f.Fuzz(func(t *testing.T, src []byte, key string) {
		o, perr := Parse(src)
		v, lerr := Lookup(src, key)
		if (perr == nil) != (lerr == nil) || (perr != nil && perr.Error() != lerr.Error()) {
			t.Fatalf("Lookup(%q) error %v, Parse's %v", src, lerr, perr)
		}
		if IsObject(src) != (perr == nil) {
			t.Fatalf("IsObject(%q) = %v, Parse's error %v", src, !(perr == nil), perr)
		}
		if perr != nil {
			return
		}
		if want := o.Get(key); (v == nil) != (want == nil) || !bytes.Equal(v, want) {
			t.Fatalf("Lookup(%q, %q) = %q, Get %q", src, key, v, want)
		}
	})
}
