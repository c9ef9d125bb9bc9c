package policy

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

func textKey(s string) string { return "text:" + hex16(xxhash.Sum64String(s)) }
func bodyKey(s string) string { return "body:" + hex16(xxhash.Sum64String(s)) }

func TestHashKey(t *testing.T) {
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}],"user":"bob"}`
	tests := []struct {
		name    string
		headers http.Header
		body    string
		want    string
	}{
		{"session header", http.Header{"X-Session-Id": {"abc"}}, chat, "header:x-session-id:abc"},
		{"header beats body", http.Header{"X-User-Id": {"u1"}}, chat, "header:x-user-id:u1"},
		{"header priority", http.Header{"X-Request-Id": {"r"}, "X-Tenant-Id": {"t"}, "X-Session-Id": {"s"}}, "", "header:x-session-id:s"},
		{"correlation before request id", http.Header{"X-Request-Id": {"r"}, "X-Correlation-Id": {"c"}}, "", "header:x-correlation-id:c"},
		{"lower-case header map", http.Header{"x-user-id": {"u2"}}, "", "header:x-user-id:u2"},
		{"mixed-case header map", http.Header{"X-USER-ID": {"u3"}}, "", "header:x-user-id:u3"},
		{"empty header value skipped", http.Header{"X-Session-Id": {" "}, "X-Trace-Id": {"tr"}}, "", "header:x-trace-id:tr"},
		{"second header value", http.Header{"X-Session-Id": {"", "s2"}}, "", "header:x-session-id:s2"},
		{"role user before top-level user", nil, chat, "user:bob"},
		{"user after messages with user field inside", nil, `{"messages":[{"role":"user","content":"x","user":"mallory"}],"user":"bob"}`, "user:bob"},
		{"nested user ignored", nil, `{"messages":[{"role":"user","content":"x","user":"mallory"}]}`, textKey("user: x\n")},
		{"session_params first", nil, `{"user":"bob","session_params":{"session_id":"s1"}}`, "session:s1"},
		{"session_params without id", nil, `{"user":"bob","session_params":{"other":1}}`, "user:bob"},
		{"session_id", nil, `{"session_id":"s9","user_id":"u9"}`, "session:s9"},
		{"user_id", nil, `{"user_id":"u9","prompt":"p"}`, "user:u9"},
		{"numeric session", nil, `{"session_id":42}`, "session:42"},
		{"numeric user id", nil, `{"user_id":-1.5e3}`, "user:-1.5e3"},
		{"empty user skipped", nil, `{"user":"","prompt":"hello"}`, textKey("hello")},
		{"object user skipped", nil, `{"user":{"id":1},"prompt":"hello"}`, textKey("hello")},
		{"null user skipped", nil, `{"user":null,"user_id":7}`, "user:7"},
		{"escaped key", nil, `{"\u0075ser":"eve"}`, "user:eve"},
		{"escaped value", nil, `{"user":"e\"ve"}`, `user:e"ve`},
		{"duplicate key, last wins", nil, `{"user":"a","user":"b"}`, "user:b"},
		{"prompt fallback", nil, `{"prompt":"once upon a time"}`, textKey("once upon a time")},
		{"no routing fields", nil, `{"model":"m"}`, bodyKey(`{"model":"m"}`)},
		{"invalid JSON", nil, `{"user":"bob"`, bodyKey(`{"user":"bob"`)},
		{"non-object", nil, `["user","bob"]`, bodyKey(`["user","bob"]`)},
		{"string document", nil, `"user"`, bodyKey(`"user"`)},
		{"null document", nil, `null`, bodyKey(`null`)},
		{"empty body", nil, ``, ""},
		{"whitespace around", nil, " \n{\"user\" : \"bob\" } \n", "user:bob"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Request{Headers: tt.headers, Body: []byte(tt.body)}
			if got := r.HashKey(); got != tt.want {
				t.Fatalf("HashKey() = %q, want %q", got, tt.want)
			}
			if got := r.HashKey(); got != tt.want {
				t.Fatalf("cached HashKey() = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestKeyExtractorCustomHeaders(t *testing.T) {
	e := NewKeyExtractor([]string{"X-Api-Key", " x-session-id "})
	r := &Request{Headers: http.Header{"X-Session-Id": {"s"}, "X-Api-Key": {"k"}}, Body: []byte(`{"user":"bob"}`)}
	if got := e.Key(r); got != "header:x-api-key:k" {
		t.Fatalf("got %q", got)
	}
	none := NewKeyExtractor([]string{})
	if got := none.Key(r); got != "user:bob" {
		t.Fatalf("no headers: got %q", got)
	}
}

func TestRoutingText(t *testing.T) {
	tests := []struct {
		name, body, want string
	}{
		{"completion string", `{"prompt":"Hello"}`, "Hello"},
		{"completion strings", `{"prompt":["a","b"]}`, "a\nb"},
		{"token ids", `{"prompt":[1, 2,3]}`, "1 2 3"},
		{"token batch", `{"prompt":[[1,2],[3]]}`, "1 2\n3"},
		{"escapes decoded", `{"prompt":"line1\nline2 \u00e9"}`, "line1\nline2 é"},
		{"chat string content", `{"messages":[{"role":"system","content":"be nice"},{"role":"user","content":"hi"}]}`, "system: be nice\nuser: hi\n"},
		{"chat parts", `{"messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"text","text":" here"}]}]}`, "user: look here\n"},
		{"chat null content", `{"messages":[{"role":"assistant","content":null},{"role":"user","content":"x"}]}`, "assistant: \nuser: x\n"},
		{"chat before prompt", `{"prompt":"p","messages":[{"role":"user","content":"m"}]}`, "user: m\n"},
		{"responses string", `{"input":"question"}`, "question"},
		{"responses messages", `{"input":[{"role":"user","content":[{"type":"input_text","text":"q1"}]},{"type":"message","role":"assistant","content":"a1"}]}`, "user: q1\nassistant: a1\n"},
		{"embeddings strings", `{"input":["x","y"]}`, "x\ny"},
		{"embeddings tokens", `{"input":[5,6]}`, "5 6"},
		{"rerank", `{"query":"what","documents":["a","b"]}`, "what"},
		{"generate text", `{"text":"gen"}`, "gen"},
		{"generate input ids", `{"input_ids":[7,8]}`, "7 8"},
		{"empty prompt falls through", `{"prompt":"","text":"t"}`, "t"},
		{"escaped key", `{"pro\u006dpt":"esc"}`, "esc"},
		{"repeated key keeps the last", `{"prompt":"a","prompt":"b"}`, "b"},
		{"invalid", `{"prompt":"x"`, ""},
		{"non-object", `["prompt"]`, ""},
		{"empty", ``, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &Request{Body: []byte(tt.body)}
			if got := r.RoutingText(); got != tt.want {
				t.Fatalf("RoutingText() = %q, want %q", got, tt.want)
			}
			// The same from the parsed object a caller passes.
			if o, err := rawjson.Parse([]byte(tt.body)); err == nil {
				r := &Request{Body: []byte(tt.body), Obj: o}
				if got := r.RoutingText(); got != tt.want {
					t.Fatalf("with Obj: RoutingText() = %q, want %q", got, tt.want)
				}
			}
		})
	}
}

func TestRoutingTextMediaParts(t *testing.T) {
	a := &Request{Body: []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:a"}}]}]}`)}
	b := &Request{Body: []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"data:b"}}]}]}`)}
	ta, tb := a.RoutingText(), b.RoutingText()
	if !strings.HasPrefix(ta, "user: see[image_url:") || ta == tb {
		t.Fatalf("media parts: %q vs %q", ta, tb)
	}
}

func TestAnalyzeOnce(t *testing.T) {
	r := &Request{Body: []byte(`{"prompt":"p","user":"u"}`)}
	if r.HashKey() != "user:u" || r.text != nil {
		t.Fatal("hash key with a body key should not render the text")
	}
	if r.RoutingText() != "p" || r.HashKey() != "user:u" {
		t.Fatal("text after key")
	}
	r2 := &Request{Body: []byte(`{"prompt":"p"}`)}
	_ = r2.RoutingText()
	if r2.hashKey == nil {
		t.Fatal("RoutingText should also cache the body key")
	}
}

// FuzzHashKey: extraction never panics, is deterministic, and only an empty
// body without headers yields no key.
func FuzzHashKey(f *testing.F) {
	for _, s := range []string{
		`{"messages":[{"role":"user","content":"hi"}],"user":"bob"}`,
		`{"session_params":{"session_id":1},"prompt":[1,2,[3]]}`,
		`{"input":[{"role":"user","content":[{"type":"input_text","text":"q"},{"x":[]}]}]}`,
		`{"user":"\u00e9\"","prompt":"a\\b"}`,
		`{"prompt":[[[[[[[[[[[1]]]]]]]]]]]}`,
		`[1,2]`, `{`, ``, `"x"`, `{"a":}`,
	} {
		f.Add([]byte(s), "")
	}
	f.Add([]byte(`{}`), "sess")
	f.Fuzz(func(t *testing.T, body []byte, hdr string) {
		h := http.Header{}
		if hdr != "" {
			h.Set("X-Session-Id", hdr)
		}
		r1 := &Request{Body: body, Headers: h}
		r2 := &Request{Body: append([]byte(nil), body...), Headers: h}
		k1 := r1.HashKey()
		text := r1.RoutingText()
		if k2 := r2.HashKey(); k1 != k2 {
			t.Fatalf("nondeterministic key %q vs %q", k1, k2)
		}
		if r2.RoutingText() != text {
			t.Fatal("nondeterministic text")
		}
		if k1 == "" && (len(body) > 0 || strings.TrimSpace(hdr) != "") {
			t.Fatalf("empty key for body %q header %q", body, hdr)
		}
		// A caller wrongly claiming validity must not crash extraction.
		r3 := &Request{Body: body, ValidJSON: true}
		_, _ = r3.HashKey(), r3.RoutingText()
		if json.Valid(body) {
			r4 := &Request{Body: body, Headers: h, ValidJSON: true}
			if r4.HashKey() != k1 || r4.RoutingText() != text {
				t.Fatal("ValidJSON changed the result for a valid body")
			}
		}
		if o, err := rawjson.Parse(body); err == nil {
			r5 := &Request{Body: body, Headers: h, Obj: o}
			if k5, t5 := r5.HashKey(), r5.RoutingText(); k5 != k1 || t5 != text {
				t.Fatalf("Obj changed the result: key %q vs %q, text %q vs %q", k5, k1, t5, text)
			}
		}
	})
}

// FuzzUnquote: appendString decodes every valid JSON string literal exactly
// as encoding/json does.
func FuzzUnquote(f *testing.F) {
	for _, s := range []string{`plain`, `a\nb\t\"q\"\\`, `\u00e9\u20ac`, `\ud83d\ude00`, `\ud83d`, `\ud83dx`, `\udc00\ud800`, "\xff\xfe", `\/`, "é\\n€"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, inner string) {
		lit := []byte(`"` + inner + `"`)
		if !json.Valid(lit) {
			return
		}
		var want string
		if err := json.Unmarshal(lit, &want); err != nil {
			t.Fatal(err)
		}
		var sb strings.Builder
		appendString(&sb, lit)
		if sb.String() != want {
			t.Fatalf("appendString(%q) = %q, json.Unmarshal = %q", lit, sb.String(), want)
		}
	})
}
