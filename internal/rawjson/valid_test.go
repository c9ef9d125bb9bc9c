package rawjson

import (
	"encoding/json"
	"strings"
	"testing"
)

var validCases = []string{
	``, ` `, `{}`, `[]`, `""`, `0`, `-0`, `1`, `-1.5e10`, `1E+2`, `1e-2`, `0.1`, `true`, `false`, `null`,
	`{"a":1}`, ` { "a" : [ 1 , 2 , { "b" : null } ] } `, `{"a":1,}`, `[1,]`, `[,1]`, `{,}`, `{"a"}`, `{"a":}`,
	`{"a" 1}`, `{1:2}`, `[1 2]`, `01`, `1.`, `.1`, `-`, `1e`, `1e+`, `+1`, `tru`, `truee`, `nul`, `[true false]`,
	`"\u00e9"`, `"\u00g9"`, `"\u00e"`, `"\x"`, `"\/\b\f\n\r\t\"\\"`, "\"a\tb\"", "\"a\x01b\"", "\"\xff\xfe\"", `"abc`,
	`"é"`, `{"a":"b"}x`, `{}{}`, `[[[]]]`, `[[[]]`, `[]]`, `{"a":{"b":{"c":[1,{"d":"e"}]}}}`, "\n\r\t 1 \n",
	`{"id":"cmpl-1","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null}],"usage":null}`,
	`[` + strings.Repeat(`[`, 9998) + strings.Repeat(`]`, 9998) + `]`,
	strings.Repeat(`[`, 10000) + strings.Repeat(`]`, 10000),
	strings.Repeat(`[`, 10001) + strings.Repeat(`]`, 10001),
	strings.Repeat(`[`, 10000) + `[]` + strings.Repeat(`]`, 10000),
	strings.Repeat(`{"a":`, 10000) + `1` + strings.Repeat(`}`, 10000),
	strings.Repeat(`{"a":`, 10001) + `1` + strings.Repeat(`}`, 10001),
}

// TestValidMatchesEncodingJSON: Valid agrees with encoding/json.Valid on
// every case, including the nesting limit.
func TestValidMatchesEncodingJSON(t *testing.T) {
	for _, c := range validCases {
		if got, want := Valid([]byte(c)), json.Valid([]byte(c)); got != want {
			t.Errorf("Valid(%.60q) = %v, encoding/json says %v", c, got, want)
		}
	}
}

func FuzzValid(f *testing.F) {
	for _, c := range validCases {
		if len(c) < 200 {
			f.Add([]byte(c))
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if got, want := Valid(b), json.Valid(b); got != want {
			t.Fatalf("Valid(%q) = %v, encoding/json says %v", b, got, want)
		}
	})
}

func BenchmarkValid(b *testing.B) {
	event := []byte(`{"id":"cmpl-8f1c2a","object":"text_completion","created":1733000000,"model":"Qwen/Qwen3-8B","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}`)
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("lorem ipsum dolor sit amet ", 200) + `","max_tokens":100,"stream":true,"temperature":0.7}`)
	for _, in := range []struct {
		name string
		b    []byte
	}{{"event", event}, {"body-5KB", body}} {
		b.Run(in.name+"/rawjson", func(b *testing.B) {
			b.SetBytes(int64(len(in.b)))
			for b.Loop() {
				if !Valid(in.b) {
					b.Fatal("invalid")
				}
			}
		})
		b.Run(in.name+"/encoding-json", func(b *testing.B) {
			b.SetBytes(int64(len(in.b)))
			for b.Loop() {
				if !json.Valid(in.b) {
					b.Fatal("invalid")
				}
			}
		})
	}
}

// TestValueEnd: the end of the first value, whatever follows it.
func TestValueEnd(t *testing.T) {
	for _, c := range []struct {
		in  string
		end int
		ok  bool
	}{
		{`"a\"b",1`, 6, true}, {`{"a":[1,2]} ,`, 11, true}, {`[]]`, 2, true}, {`123x`, 3, true}, {`-1.5e3}`, 6, true},
		{`null,`, 4, true}, {`{"a":1`, 0, false}, {`tru`, 0, false}, {`"a`, 0, false}, {`{"a":01}`, 0, false},
	} {
		end, ok := ValueEnd([]byte(c.in), 0)
		if ok != c.ok || (ok && end != c.end) {
			t.Errorf("ValueEnd(%q) = %d, %v; want %d, %v", c.in, end, ok, c.end, c.ok)
		}
	}
	if end, esc, ok := StringEnd([]byte(`"x\u00e9y" `), 0); !ok || !esc || end != 10 {
		t.Errorf("StringEnd = %d, %v, %v", end, esc, ok)
	}
	if end, esc, ok := StringEnd([]byte(`"plain"`), 0); !ok || esc || end != 7 {
		t.Errorf("StringEnd(plain) = %d, %v, %v", end, esc, ok)
	}
}
