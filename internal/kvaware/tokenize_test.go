package kvaware

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/switchyard-llm/switchyard/internal/chattmpl"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

// TestTokenizerStats: a prompt asked once is then served from the cache;
// the stats count both and the time spent asking.
func TestTokenizerStats(t *testing.T) {
	ts := newTokenizeServer(t)
	tok := NewTokenizer(http.DefaultClient, time.Second, 10)
	for range 3 {
		if _, err := tok.Tokens(t.Context(), ts.URL, "/v1/completions", []byte(`{"prompt":"a b c"}`)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := tok.Tokens(t.Context(), ts.URL, "/v1/completions", []byte(`{"prompt":[1,2,3]}`)); err != nil {
		t.Fatal(err) // token ids: neither asked nor cached
	}
	if a, h, ns := tok.S.Asks.Load(), tok.S.CacheHits.Load(), tok.S.AskNanos.Load(); a != 1 || h != 2 || ns == 0 || ts.calls.Load() != 1 {
		t.Errorf("asks %d, cache hits %d, ask time %d ns, server calls %d; want 1, 2, > 0, 1", a, h, ns, ts.calls.Load())
	}
}

// engineTokenizer answers POST /tokenize with ids from f (prompt,
// add_special_tokens), and counts the calls.
type engineTokenizer struct {
	*httptest.Server
	calls atomic.Int64
}

func newEngineTokenizer(t *testing.T, f func(prompt string, add bool) []uint32) *engineTokenizer {
	return newFakeEngine(t, func(req tokenizeReq) []uint32 {
		if req.Messages != nil {
			return f(string(req.Messages), req.AddSpecial == nil || *req.AddSpecial)
		}
		return f(req.Prompt, req.AddSpecial == nil || *req.AddSpecial)
	})
}

// tokenizeReq is the part of a /tokenize body the fake engines read.
type tokenizeReq struct {
	Prompt     string          `json:"prompt"`
	AddSpecial *bool           `json:"add_special_tokens"`
	Messages   json.RawMessage `json:"messages"`
	Gen        *bool           `json:"add_generation_prompt"`
}

// newFakeEngine answers POST /tokenize with ids(request), counting calls.
func newFakeEngine(t testing.TB, ids func(tokenizeReq) []uint32) *engineTokenizer {
	e := &engineTokenizer{}
	e.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		e.calls.Add(1)
		var req tokenizeReq
		if r.URL.Path != "/tokenize" || json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, `{"error":{"message":"bad"}}`, 400)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids(req)})
	}))
	t.Cleanup(e.Close)
	return e
}

func loadTestTokenizer(t *testing.T) *tokenizer.Tokenizer {
	t.Helper()
	lt, err := tokenizer.Load("../tokenizer/testdata/llama3ish.json")
	if err != nil {
		t.Fatal(err)
	}
	return lt
}

// TestLocalTokenizer: string completions prompts are tokenized in-process,
// the first Verify of them also at the engine; chat requests (no chat
// template set), batches and odd add_special_tokens values go to
// /tokenize or the fallback as before. The steps run on raw bodies
// (Tokens) and on bodies the router's server has parsed (TokensOf): the
// two agree step by step.
func TestLocalTokenizer(t *testing.T) {
	t.Run("body", func(t *testing.T) { testLocalTokenizer(t, false) })
	t.Run("parsed", func(t *testing.T) { testLocalTokenizer(t, true) })
}

func testLocalTokenizer(t *testing.T, parsed bool) {
	lt := loadTestTokenizer(t)
	eng := newEngineTokenizer(t, lt.Encode)
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Verify: 2, Background: -1, SampleEvery: -1})
	t.Cleanup(tok.Close)
	get := func(path, body string) ([]uint32, error) {
		if !parsed {
			return tok.Tokens(t.Context(), eng.URL, path, []byte(body))
		}
		o, err := rawjson.Parse([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return tok.TokensOf(t.Context(), eng.URL, path, o)
	}
	want := func(text string, add bool) []uint32 { return lt.Encode(text, add) }
	type step struct {
		name, path, body   string
		ids                []uint32 // nil: not checked
		err                error    // want errors.Is
		calls, local, hits int64    // running totals after the step
	}
	steps := []step{
		{"verified 1", "/v1/completions", `{"model":"m","prompt":"Hello world"}`, want("Hello world", true), nil, 1, 1, 0},
		{"verified 2, no special tokens", "/v1/completions", `{"model":"m","prompt":"It's 2026","add_special_tokens":false}`, want("It's 2026", false), nil, 2, 2, 0},
		{"local only", "/v1/completions", `{"model":"m","prompt":"a third prompt"}`, want("a third prompt", true), nil, 2, 3, 0},
		{"single-string list", "/v1/completions", `{"model":"m","prompt":["in a list"]}`, want("in a list", true), nil, 2, 4, 0},
		{"repeat: cache", "/v1/completions", `{"model":"m","prompt":"Hello world"}`, want("Hello world", true), nil, 2, 4, 1},
		{"chat: /tokenize", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`, nil, nil, 3, 4, 1},
		{"add_special_tokens not a bool: /tokenize (which refuses it)", "/v1/completions", `{"model":"m","prompt":"x","add_special_tokens":1}`, nil, ErrNotTokenizable, 4, 4, 1},
		{"batch: fallback", "/v1/completions", `{"model":"m","prompt":["a","b"]}`, nil, ErrNotTokenizable, 4, 4, 1},
		{"token ids: as given", "/v1/completions", `{"model":"m","prompt":[5,6]}`, []uint32{5, 6}, nil, 4, 4, 1},
		{"other model: /tokenize", "/v1/completions", `{"model":"other","prompt":"Hello world"}`, want("Hello world", true), nil, 5, 4, 1},
	}
	for _, s := range steps {
		ids, err := get(s.path, s.body)
		switch {
		case s.err != nil && !errors.Is(err, s.err):
			t.Errorf("%s: err %v, want %v", s.name, err, s.err)
		case s.err == nil && err != nil:
			t.Errorf("%s: %v", s.name, err)
		case s.ids != nil && !slices.Equal(ids, s.ids):
			t.Errorf("%s: ids %v, want %v", s.name, ids, s.ids)
		}
		if c, l, h := eng.calls.Load(), int64(tok.S.LocalEncodes.Load()), int64(tok.S.CacheHits.Load()); c != s.calls || l != s.local || h != s.hits {
			t.Errorf("%s: engine calls %d, local encodes %d, cache hits %d; want %d, %d, %d", s.name, c, l, h, s.calls, s.local, s.hits)
		}
	}
	if c, m, off := tok.S.VerifyChecks.Load(), tok.S.VerifyMismatches.Load(), tok.S.LocalOff.Load(); c != 2 || m != 0 || off {
		t.Errorf("verify checks %d, mismatches %d, off %v; want 2, 0, false", c, m, off)
	}
	if tok.S.LocalNanos.Load() == 0 {
		t.Error("local encode time not counted")
	}
}

// TestLocalTokenizerMismatch: an engine whose ids differ switches the
// local tokenizer off at the first check: its ids are used, one error is
// logged with both, and every later prompt goes to /tokenize.
func TestLocalTokenizerMismatch(t *testing.T) {
	lt := loadTestTokenizer(t)
	eng := newEngineTokenizer(t, func(p string, _ bool) []uint32 { return wordIDs(p) })
	var logs bytes.Buffer
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Logger: slog.New(slog.NewJSONHandler(&logs, nil))})
	t.Cleanup(tok.Close)
	for i, p := range []string{"one two three", "four five", "one two three"} {
		ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/completions", []byte(fmt.Sprintf(`{"prompt":%q}`, p)))
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ids, wordIDs(p)) {
			t.Errorf("prompt %d: ids %v, want the engine's %v", i, ids, wordIDs(p))
		}
	}
	if m, off, l := tok.S.VerifyMismatches.Load(), tok.S.LocalOff.Load(), tok.S.LocalEncodes.Load(); m != 1 || !off || l != 1 {
		t.Errorf("mismatches %d, off %v, local encodes %d; want 1, true, 1", m, off, l)
	}
	if c := eng.calls.Load(); c != 2 { // the check, then "four five"; the repeat is cached
		t.Errorf("engine calls %d, want 2", c)
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], `"level":"ERROR"`) || !strings.Contains(lines[0], `"local_ids":[`) || !strings.Contains(lines[0], `"engine_ids":[3000,3001,5002]`) {
		t.Errorf("log: %s", logs.String())
	}
}

// waitFor fails t unless cond holds within 20 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 20 s", what)
		}
	}
}

// TestLocalTokenizerBackgroundChecks: after the inline checks, local ids
// are used at once and the next prompts, then one in SampleEvery, are
// compared in the background; an engine that differs there switches the
// local tokenizer off for the requests that follow, and Close stops the
// checker.
func TestLocalTokenizerBackgroundChecks(t *testing.T) {
	lt := loadTestTokenizer(t)
	var drift atomic.Bool // the engine starts to differ
	eng := newEngineTokenizer(t, func(p string, add bool) []uint32 {
		if drift.Load() {
			return wordIDs(p)
		}
		return lt.Encode(p, add)
	})
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Verify: 1, Background: 2, SampleEvery: 3})
	t.Cleanup(tok.Close)
	get := func(p string) []uint32 {
		t.Helper()
		ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/completions", []byte(fmt.Sprintf(`{"model":"m","prompt":%q}`, p)))
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	// Prompt 1 is checked inline, 2 and 3 in the background, 4 and 5 not,
	// 6 (a multiple of 3) in the background.
	for i := 1; i <= 6; i++ {
		p := fmt.Sprintf("prompt number %d", i)
		if ids := get(p); !slices.Equal(ids, lt.Encode(p, true)) {
			t.Fatalf("prompt %d: ids %v, want the local %v", i, ids, lt.Encode(p, true))
		}
	}
	waitFor(t, "three background checks", func() bool { return tok.S.VerifyBackground.Load() == 3 })
	if c, m, calls := tok.S.VerifyChecks.Load(), tok.S.VerifyMismatches.Load(), eng.calls.Load(); c != 4 || m != 0 || calls != 4 {
		t.Errorf("checks %d, mismatches %d, engine calls %d; want 4, 0, 4", c, m, calls)
	}

	// The engine drifts: prompt 9 is checked in the background, used as
	// tokenized locally, and switches the local tokenizer off.
	drift.Store(true)
	for i := 7; i <= 9; i++ {
		get(fmt.Sprintf("prompt number %d", i))
	}
	waitFor(t, "switched off", tok.S.LocalOff.Load)
	if m := tok.S.VerifyMismatches.Load(); m != 1 {
		t.Errorf("mismatches %d, want 1", m)
	}
	if ids := get("after the drift"); !slices.Equal(ids, wordIDs("after the drift")) {
		t.Errorf("after the switch-off: ids %v, want the engine's %v", ids, wordIDs("after the drift"))
	}
	tok.Close()
	tok.Close() // idempotent
}

// TestLocalTokenizerProbe: a probe against an engine that agrees lets the
// first prompts use local ids without asking the engine on their path; an
// engine that is not up yet is asked again; one that differs switches the
// local tokenizer off before any prompt used it.
func TestLocalTokenizerProbe(t *testing.T) {
	lt := loadTestTokenizer(t)
	probes := uint64(2 * len(probeTexts))
	t.Run("agrees", func(t *testing.T) {
		var up atomic.Bool // the engine answers 503 until up
		eng := newEngineTokenizer(t, lt.Encode)
		gate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if !up.Load() {
				http.Error(w, `{"error":{"message":"starting"}}`, http.StatusServiceUnavailable)
				return
			}
			eng.Config.Handler.ServeHTTP(w, r)
		}))
		t.Cleanup(gate.Close)
		tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
		tok.SetLocal(LocalOptions{Tokenizer: lt, Background: -1, SampleEvery: -1})
		t.Cleanup(tok.Close)
		tok.Probe(gate.URL)
		time.Sleep(50 * time.Millisecond) // the first try fails: 503
		up.Store(true)
		waitFor(t, "probe passed", func() bool { return tok.inline.Load() >= uint64(DefaultVerify) && !tok.probing.Load() })
		if c, b := tok.S.VerifyChecks.Load(), tok.S.VerifyBackground.Load(); c != probes || b != probes {
			t.Fatalf("checks %d, background %d; want %d, %d", c, b, probes, probes)
		}
		before := eng.calls.Load()
		ids, err := tok.Tokens(t.Context(), gate.URL, "/v1/completions", []byte(`{"model":"m","prompt":"a live prompt"}`))
		if err != nil || !slices.Equal(ids, lt.Encode("a live prompt", true)) {
			t.Fatalf("ids %v, %v", ids, err)
		}
		if eng.calls.Load() != before {
			t.Errorf("the first live prompt asked the engine (%d calls) after a passed probe", eng.calls.Load()-before)
		}
		tok.Probe(gate.URL) // verified: nothing more
		if tok.probing.Load() {
			t.Error("a second probe was started")
		}
	})
	t.Run("differs", func(t *testing.T) {
		eng := newEngineTokenizer(t, func(p string, _ bool) []uint32 { return wordIDs(p) })
		tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
		tok.SetLocal(LocalOptions{Tokenizer: lt, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		t.Cleanup(tok.Close)
		tok.Probe(eng.URL)
		waitFor(t, "switched off", tok.S.LocalOff.Load)
		if m := tok.S.VerifyMismatches.Load(); m != 1 {
			t.Errorf("mismatches %d, want 1", m)
		}
		ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/completions", []byte(`{"prompt":"one two"}`))
		if err != nil || !slices.Equal(ids, wordIDs("one two")) || tok.S.LocalEncodes.Load() != 0 {
			t.Errorf("after a failed probe: ids %v (%v), local encodes %d; want the engine's, none", ids, err, tok.S.LocalEncodes.Load())
		}
	})
}

// BenchmarkTokenizeLocal is BenchmarkTokenize's miss through the
// in-process tokenizer (the tiny model's tokenizer.json): the whole of
// Tokens for a new 1k or 8k-word prompt, body parsing included, once the
// verification is done.
func BenchmarkTokenizeLocal(b *testing.B) {
	lt, err := tokenizer.Load("../tokenizer/testdata/tiny-llama.json")
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var req struct{ Prompt string }
		_ = json.NewDecoder(r.Body).Decode(&req)
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": lt.Encode(req.Prompt, true)})
	}))
	defer srv.Close()
	for _, n := range []int{1000, 8000} {
		prompt := words(n, "w")
		b.Run(fmt.Sprintf("words=%d", n), func(b *testing.B) {
			tok := NewTokenizer(srv.Client(), 5*time.Second, 1)
			tok.SetLocal(LocalOptions{Tokenizer: lt, Verify: 1, Background: -1, SampleEvery: -1})
			defer tok.Close()
			bodies := [][]byte{completion(prompt), completion("x " + prompt)}
			i := 0
			for b.Loop() {
				i++
				if _, err := tok.Tokens(b.Context(), srv.URL, "/v1/completions", bodies[i%2]); err != nil {
					b.Fatal(err)
				}
			}
			if tok.S.VerifyChecks.Load() != 1 || tok.S.LocalOff.Load() {
				b.Fatalf("verification: %d checks, off %v", tok.S.VerifyChecks.Load(), tok.S.LocalOff.Load())
			}
		})
	}
}

// TestPlainString: the fast path decodes what json.Unmarshal decodes, and
// leaves it everything else.
// TestAnswerIDs: a /tokenize answer's ids, read without reflection when
// plain, else by encoding/json, whose results and errors it keeps.
func TestAnswerIDs(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []uint32
		wantErr bool
	}{
		{`{"count":3,"max_model_len":4096,"tokens":[1,22,333],"token_strs":null}`, []uint32{1, 22, 333}, false},
		{` { "tokens" : [ 7 ] } `, []uint32{7}, false},
		{`{"tokens":[]}`, []uint32{}, false},
		{`{"tokens":[1],"tokens":[2]}`, []uint32{2}, false}, // the last, as encoding/json
		{`{"Tokens":[5]}`, []uint32{5}, false},              // encoding/json matches keys without case
		{`{"count":0}`, nil, false},
		{`{"tokens":[1e0]}`, nil, true},
		{`{"tokens":[-1]}`, nil, true},
		{`{"tokens":[4294967296]}`, nil, true},
		{`{"tokens":[1,2]`, nil, true},
		{`{"tokens":[1,2]} x`, nil, true},
	} {
		got, err := answerIDs([]byte(tc.in))
		if (err != nil) != tc.wantErr || !slices.Equal(got, tc.want) || (got == nil) != (tc.want == nil) {
			t.Errorf("answerIDs(%s) = %#v, %v; want %#v, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
	for _, p := range []string{`[5,6]`, ` [ 5 , 6 ] `} {
		if got, err := tokenIDPrompt([]byte(p)); err != nil || !slices.Equal(got, []uint32{5, 6}) {
			t.Errorf("tokenIDPrompt(%s) = %v, %v", p, got, err)
		}
	}
	for _, p := range []string{`[[5],[6]]`, `[5e0,6]`} { // encoding/json takes no exponent for an integer
		if _, err := tokenIDPrompt([]byte(p)); !errors.Is(err, ErrNotTokenizable) {
			t.Errorf("tokenIDPrompt(%s): %v", p, err)
		}
	}
}

func TestPlainString(t *testing.T) {
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{`"hello world"`, true},
		{`""`, true},
		{`"café 東京 😀"`, true},
		{`"a\nb"`, false},
		{`"a\"b"`, false},
		{`"\u00e9"`, false},
		{"\"tab\there\"", false},
		{"\"bad \xff utf8\"", false},
		{`"unterminated`, false},
		{`123`, false},
	} {
		got, ok := plainString([]byte(tc.in))
		if ok != tc.ok {
			t.Errorf("plainString(%q) ok = %v, want %v", tc.in, ok, tc.ok)
			continue
		}
		var want string
		if ok {
			if err := json.Unmarshal([]byte(tc.in), &want); err != nil || got != want {
				t.Errorf("plainString(%q) = %q, json.Unmarshal %q (%v)", tc.in, got, want, err)
			}
		}
	}
}

// TestPlainStringEveryPosition: the word-at-a-time scan misses no
// special byte wherever it falls (each of them at each offset of a
// 40-byte prompt, and in its last partial word), and agrees with
// json.Unmarshal on what it accepts; special matches a byte-wise check of
// every byte value in every lane.
func TestPlainStringEveryPosition(t *testing.T) {
	for v := range 256 {
		for lane := range 8 {
			w := uint64(v) << (8 * lane)
			w |= 0x6161616161616161 &^ (0xff << (8 * lane)) // 'a' elsewhere
			want := v == '"' || v == '\\' || v < 0x20 || v >= 0x80
			if got := special(w); got != want {
				t.Fatalf("special(%#016x) = %v, want %v (byte %#x in lane %d)", w, got, want, v, lane)
			}
		}
	}
	for _, sp := range []string{`"`, `\`, "\x01", "\x1f", "\xff", "é", "\x7f"} {
		for pos := range 40 {
			body := []byte(strings.Repeat("a", 40))
			in := append(append(append([]byte{'"'}, body[:pos]...), sp...), append(body[pos:], '"')...)
			got, ok := plainString(in)
			var want string
			err := json.Unmarshal(in, &want)
			// Escapes and invalid UTF-8 (which json.Unmarshal replaces) are
			// json.Unmarshal's to decode.
			wantOK := err == nil && sp != `\\` && utf8.Valid(in)
			if ok != wantOK || (ok && got != want) {
				t.Fatalf("plainString(%q) = %q, %v; json.Unmarshal %q, %v", in, got, ok, want, err)
			}
		}
	}
}

// tinyChat is scripts/make-tiny-model.py's chat template (the real-engine
// tier's model), and renderTiny the same rendering written out by hand:
// the fake engine below renders with it, so the router's Jinja rendering
// is compared with an independent one.
const tinyChat = "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}{% endfor %}" +
	"{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"

// tinyTemplate is tinyChat compiled.
func tinyTemplate(tb testing.TB) *chattmpl.Template {
	tb.Helper()
	tmpl, err := chattmpl.Parse(tinyChat, nil)
	if err != nil {
		tb.Fatal(err)
	}
	return tmpl
}

func renderTiny(msgs []chattmpl.Message, gen bool) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|" + m.Role + "|>\n" + m.Content + "</s>\n")
	}
	if gen {
		b.WriteString("<|assistant|>\n")
	}
	return b.String()
}

// newChatEngine is an engine whose /tokenize renders chat requests with
// render and encodes the text without special tokens (vLLM's chat
// default), and encodes completions prompts as lt does.
func newChatEngine(t testing.TB, lt *tokenizer.Tokenizer, render func([]chattmpl.Message, bool) string) *engineTokenizer {
	return newFakeEngine(t, func(req tokenizeReq) []uint32 {
		if req.Messages == nil {
			return lt.Encode(req.Prompt, req.AddSpecial == nil || *req.AddSpecial)
		}
		var msgs []chattmpl.Message
		text := string(req.Messages) // contents the fake does not render: any ids
		if json.Unmarshal(req.Messages, &msgs) == nil {
			text = render(msgs, req.Gen == nil || *req.Gen)
		}
		return lt.Encode(text, req.AddSpecial != nil && *req.AddSpecial)
	})
}

func chatBody(gen string, msgs ...string) string {
	var ms []string
	for i := 0; i+1 < len(msgs); i += 2 {
		ms = append(ms, fmt.Sprintf(`{"role":%q,"content":%q}`, msgs[i], msgs[i+1]))
	}
	return `{"model":"m"` + gen + `,"messages":[` + strings.Join(ms, ",") + `]}`
}

// TestLocalChat: with a chat template, plain chat requests are rendered
// and tokenized in-process, the first Verify of them also asked of the
// engine (whose rendering is written independently); requests the router
// does not render exactly go to /tokenize.
func TestLocalChat(t *testing.T) {
	lt := loadTestTokenizer(t)
	tmpl := tinyTemplate(t)
	eng := newChatEngine(t, lt, renderTiny)
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Verify: 2, Background: -1, SampleEvery: -1})
	t.Cleanup(tok.Close)
	want := func(gen bool, msgs ...string) []uint32 {
		var ms []chattmpl.Message
		for i := 0; i+1 < len(msgs); i += 2 {
			ms = append(ms, chattmpl.Message{Role: msgs[i], Content: msgs[i+1]})
		}
		return lt.Encode(renderTiny(ms, gen), false)
	}
	const chat = "/v1/chat/completions"
	steps := []struct {
		name, path, body string
		ids              []uint32 // nil: not checked
		calls, chatLocal uint64   // running totals after the step
	}{
		{"verified 1", chat, chatBody("", "system", "Be brief.", "user", "Hello world"), want(true, "system", "Be brief.", "user", "Hello world"), 1, 1},
		{"verified 2, no generation prompt", chat, chatBody(`,"add_generation_prompt":false`, "user", "It's 2026"), want(false, "user", "It's 2026"), 2, 2},
		{"local only", chat, chatBody("", "user", "hi", "assistant", "Ünïcödé\n😀", "user", "again?"), want(true, "user", "hi", "assistant", "Ünïcödé\n😀", "user", "again?"), 2, 3},
		{"repeat: cache", chat, chatBody("", "system", "Be brief.", "user", "Hello world"), want(true, "system", "Be brief.", "user", "Hello world"), 2, 3},
		{"tools: /tokenize", chat, `{"model":"m","tools":[{"type":"function","function":{"name":"f"}}],"messages":[{"role":"user","content":"x"}]}`, nil, 3, 3},
		{"a message name: /tokenize", chat, `{"model":"m","messages":[{"role":"user","name":"bob","content":"x"}]}`, nil, 4, 3},
		{"developer role: /tokenize", chat, chatBody("", "developer", "rules", "user", "x"), nil, 5, 3},
		{"text parts: local, joined as vLLM joins them", chat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""},{"type":"text","text":"b"}]}]}`, want(true, "user", "a\nb"), 5, 4},
		{"a part with more fields: /tokenize", chat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x","cache_control":{}}]}]}`, nil, 6, 4},
		{"add_special_tokens: /tokenize", chat, chatBody(`,"add_special_tokens":true`, "user", "x"), nil, 7, 4},
		{"continue_final_message: /tokenize", chat, chatBody(`,"continue_final_message":true,"add_generation_prompt":false`, "user", "x", "assistant", "y"), nil, 8, 4},
		{"template kwargs: /tokenize", chat, `{"model":"m","chat_template_kwargs":{"enable_thinking":false},"messages":[{"role":"user","content":"x"}]}`, nil, 9, 4},
		{"completions still local", "/v1/completions", `{"model":"m","prompt":"a completions prompt"}`, lt.Encode("a completions prompt", true), 10, 4},
	}
	for _, s := range steps {
		ids, err := tok.Tokens(t.Context(), eng.URL, s.path, []byte(s.body))
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if s.ids != nil && !slices.Equal(ids, s.ids) {
			t.Errorf("%s: ids %v, want %v", s.name, ids, s.ids)
		}
		if c, l := uint64(eng.calls.Load()), tok.S.ChatLocal.Load(); c != s.calls || l != s.chatLocal {
			t.Errorf("%s: engine calls %d, chat rendered locally %d; want %d, %d", s.name, c, l, s.calls, s.chatLocal)
		}
	}
	if tok.S.VerifyMismatches.Load() != 0 || tok.S.ChatOff.Load() || tok.S.LocalOff.Load() {
		t.Errorf("mismatches %d, chat off %v, local off %v", tok.S.VerifyMismatches.Load(), tok.S.ChatOff.Load(), tok.S.LocalOff.Load())
	}
}

// TestLocalChatMismatch: an engine rendering the template differently
// switches in-process chat off at the first check (its ids are used, and
// every later chat request goes to /tokenize), and leaves completions
// prompts local.
func TestLocalChatMismatch(t *testing.T) {
	lt := loadTestTokenizer(t)
	tmpl := tinyTemplate(t)
	other := func(msgs []chattmpl.Message, gen bool) string { return "<s>" + renderTiny(msgs, gen) }
	eng := newChatEngine(t, lt, other)
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Verify: 1, Background: -1, SampleEvery: -1})
	t.Cleanup(tok.Close)
	msgs := []chattmpl.Message{{Role: "user", Content: "hello"}}
	ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/chat/completions", []byte(chatBody("", "user", "hello")))
	if err != nil {
		t.Fatal(err)
	}
	if want := lt.Encode(other(msgs, true), false); !slices.Equal(ids, want) {
		t.Errorf("ids %v, want the engine's %v", ids, want)
	}
	if !tok.S.ChatOff.Load() || tok.S.LocalOff.Load() || tok.S.VerifyMismatches.Load() != 1 {
		t.Fatalf("chat off %v, local off %v, mismatches %d", tok.S.ChatOff.Load(), tok.S.LocalOff.Load(), tok.S.VerifyMismatches.Load())
	}
	if _, err := tok.Tokens(t.Context(), eng.URL, "/v1/chat/completions", []byte(chatBody("", "user", "next"))); err != nil {
		t.Fatal(err)
	}
	if tok.S.ChatLocal.Load() != 1 || eng.calls.Load() != 2 {
		t.Errorf("after the mismatch: chat rendered locally %d, engine calls %d; want 1, 2", tok.S.ChatLocal.Load(), eng.calls.Load())
	}
	for _, p := range []string{"first completions prompt", "second completions prompt"} {
		if _, err := tok.Tokens(t.Context(), eng.URL, "/v1/completions", []byte(fmt.Sprintf(`{"model":"m","prompt":%q}`, p))); err != nil {
			t.Fatal(err)
		}
	}
	if tok.S.LocalOff.Load() || tok.S.LocalEncodes.Load() != 3 {
		t.Errorf("completions: local off %v, local encodes %d (want 3: one chat, two prompts)", tok.S.LocalOff.Load(), tok.S.LocalEncodes.Load())
	}
}

// BenchmarkTokenizeLocalChat is BenchmarkTokenizeLocal for a chat request
// (a system prompt of n words and a question) rendered with the tiny
// model's chat template before the encode.
func BenchmarkTokenizeLocalChat(b *testing.B) {
	lt, err := tokenizer.Load("../tokenizer/testdata/tiny-llama.json")
	if err != nil {
		b.Fatal(err)
	}
	tmpl := tinyTemplate(b)
	eng := newChatEngine(b, lt, renderTiny)
	for _, n := range []int{1000, 8000} {
		prompt := words(n, "w")
		b.Run(fmt.Sprintf("words=%d", n), func(b *testing.B) {
			tok := NewTokenizer(eng.Client(), 5*time.Second, 1)
			tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Verify: 1, Background: -1, SampleEvery: -1})
			defer tok.Close()
			bodies := [][]byte{[]byte(chatBody("", "system", prompt, "user", "a question?")), []byte(chatBody("", "system", "x "+prompt, "user", "a question?"))}
			i := 0
			for b.Loop() {
				i++
				if _, err := tok.Tokens(b.Context(), eng.URL, "/v1/chat/completions", bodies[i%2]); err != nil {
					b.Fatal(err)
				}
			}
			if tok.S.VerifyChecks.Load() != 1 || tok.S.ChatOff.Load() || tok.S.ChatLocal.Load() == 0 {
				b.Fatalf("verification: %d checks, chat off %v, rendered %d", tok.S.VerifyChecks.Load(), tok.S.ChatOff.Load(), tok.S.ChatLocal.Load())
			}
		})
	}
}

// TestLocalChatProbe: with a chat template the probe also renders the chat
// probes and compares them with the engine's /tokenize, so no chat request
// waits for a check; an engine rendering differently switches in-process
// chat off before any request, leaving completions prompts local.
func TestLocalChatProbe(t *testing.T) {
	lt := loadTestTokenizer(t)
	tmpl := tinyTemplate(t)
	t.Run("agrees", func(t *testing.T) {
		eng := newChatEngine(t, lt, renderTiny)
		tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
		tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Background: -1, SampleEvery: -1})
		t.Cleanup(tok.Close)
		tok.Probe(eng.URL)
		waitFor(t, "probe passed", func() bool { return tok.chatInline.Load() >= uint64(DefaultVerify) && !tok.probing.Load() })
		if c := tok.S.VerifyChecks.Load(); c != uint64(ProbeChecks(true)) || tok.S.ChatOff.Load() {
			t.Fatalf("checks %d (want %d), chat off %v", c, ProbeChecks(true), tok.S.ChatOff.Load())
		}
		before := eng.calls.Load()
		ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/chat/completions", []byte(chatBody("", "user", "a live chat")))
		want := lt.Encode(renderTiny([]chattmpl.Message{{Role: "user", Content: "a live chat"}}, true), false)
		if err != nil || !slices.Equal(ids, want) {
			t.Fatalf("ids %v (%v), want %v", ids, err, want)
		}
		if eng.calls.Load() != before || tok.S.ChatLocal.Load() != 1 {
			t.Errorf("the first live chat: %d engine calls, %d rendered locally; want 0, 1", eng.calls.Load()-before, tok.S.ChatLocal.Load())
		}
	})
	t.Run("differs", func(t *testing.T) {
		eng := newChatEngine(t, lt, func(msgs []chattmpl.Message, gen bool) string { return renderTiny(msgs, !gen) })
		tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
		tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		t.Cleanup(tok.Close)
		tok.Probe(eng.URL)
		waitFor(t, "chat switched off, completions verified", func() bool {
			return tok.S.ChatOff.Load() && tok.inline.Load() >= uint64(DefaultVerify) && !tok.probing.Load()
		})
		if tok.S.LocalOff.Load() || tok.S.VerifyMismatches.Load() != 1 || tok.ChatLocal() {
			t.Errorf("local off %v, mismatches %d, chat local %v; want false, 1, false", tok.S.LocalOff.Load(), tok.S.VerifyMismatches.Load(), tok.ChatLocal())
		}
	})
}

// TestLocalChatProbeRefused: an engine answering the chat probes with an
// error (it has no chat template) does not hold up the tokenizer's probe:
// completions prompts are verified, chat requests stay checked on their
// path.
func TestLocalChatProbeRefused(t *testing.T) {
	lt := loadTestTokenizer(t)
	eng := newFakeEngine(t, func(req tokenizeReq) []uint32 { return lt.Encode(req.Prompt, req.AddSpecial == nil || *req.AddSpecial) })
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if bytes.Contains(b, []byte(`"messages"`)) {
			http.Error(w, `{"error":{"message":"no chat template"}}`, http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(b))
		eng.Config.Handler.ServeHTTP(w, r)
	}))
	t.Cleanup(refusing.Close)
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tinyTemplate(t), Background: -1, SampleEvery: -1})
	t.Cleanup(tok.Close)
	tok.Probe(refusing.URL)
	waitFor(t, "tokenizer probe passed", func() bool { return tok.inline.Load() >= uint64(DefaultVerify) && !tok.probing.Load() })
	if tok.chatInline.Load() != 0 || tok.S.ChatOff.Load() || tok.S.LocalOff.Load() {
		t.Errorf("chat inline %d, chat off %v, local off %v; want 0, false, false", tok.chatInline.Load(), tok.S.ChatOff.Load(), tok.S.LocalOff.Load())
	}
}

// TestLocalChatContentParts: a template iterating over content is given
// each message's text parts (a string content as one part, empty parts
// kept), as vLLM gives them; checked against an engine rendering the same
// by hand.
func TestLocalChatContentParts(t *testing.T) {
	lt := loadTestTokenizer(t)
	tmpl, err := chattmpl.Parse(`{% for m in messages %}<|{{ m.role }}|>{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}`, nil)
	if err != nil || !tmpl.ContentParts() {
		t.Fatalf("%v, parts %v", err, tmpl != nil && tmpl.ContentParts())
	}
	byHand := func(role string, texts ...string) string {
		return "<|" + role + "|>[" + strings.Join(texts, "][") + "]"
	}
	eng := newFakeEngine(t, func(req tokenizeReq) []uint32 {
		var msgs []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		_ = json.Unmarshal(req.Messages, &msgs)
		var b strings.Builder
		for _, m := range msgs {
			var s string
			var parts []struct{ Text string }
			if json.Unmarshal(m.Content, &s) == nil {
				b.WriteString(byHand(m.Role, s))
			} else if json.Unmarshal(m.Content, &parts) == nil {
				texts := make([]string, len(parts))
				for i, p := range parts {
					texts[i] = p.Text
				}
				b.WriteString(byHand(m.Role, texts...))
			}
		}
		return lt.Encode(b.String(), false)
	})
	tok := NewTokenizer(http.DefaultClient, 5*time.Second, 100)
	tok.SetLocal(LocalOptions{Tokenizer: lt, Chat: tmpl, Verify: 2, Background: -1, SampleEvery: -1})
	t.Cleanup(tok.Close)
	for _, tc := range []struct{ body, text string }{
		{chatBody("", "user", "hello"), byHand("user", "hello")},
		{`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""},{"type":"text","text":"b"}]}]}`, byHand("user", "a", "", "b")},
		{chatBody("", "user", "local only"), byHand("user", "local only")},
	} {
		ids, err := tok.Tokens(t.Context(), eng.URL, "/v1/chat/completions", []byte(tc.body))
		if want := lt.Encode(tc.text, false); err != nil || !slices.Equal(ids, want) {
			t.Errorf("%s: ids %v (%v), want %v", tc.body, ids, err, want)
		}
	}
	if tok.S.ChatLocal.Load() != 3 || tok.S.VerifyChecks.Load() != 2 || tok.S.VerifyMismatches.Load() != 0 {
		t.Errorf("rendered %d, checks %d, mismatches %d; want 3, 2, 0", tok.S.ChatLocal.Load(), tok.S.VerifyChecks.Load(), tok.S.VerifyMismatches.Load())
	}
}
