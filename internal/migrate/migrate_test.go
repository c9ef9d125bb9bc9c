package migrate

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// sse renders chunks as an SSE stream, ending with [DONE] when done.
func sse(done bool, chunks ...string) string {
	var b strings.Builder
	for _, c := range chunks {
		b.WriteString("data: " + c + "\n\n")
	}
	if done {
		b.WriteString("data: [DONE]\n\n")
	}
	return b.String()
}

func cmplChunk(text string, extra string) string {
	return fmt.Sprintf(`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":%q,"logprobs":null,"finish_reason":null%s}]}`, text, extra)
}

func chatChunk(delta string) string {
	return fmt.Sprintf(`{"id":"chatcmpl-a","object":"chat.completion.chunk","created":111,"model":"m","choices":[{"index":0,"delta":%s,"logprobs":null,"finish_reason":null}]}`, delta)
}

func track(t *testing.T, stream string) *Tracker {
	t.Helper()
	tr := NewTracker()
	var sp Splitter
	sp.Feed([]byte(stream), func(ev []byte) { tr.Event(ev) })
	return tr
}

func TestSplitterAnyBoundary(t *testing.T) {
	stream := sse(true, cmplChunk(" a", ""), cmplChunk(" b", "")) + ": keep-alive\r\n\r\n" + "data: {\"x\":1}\n"
	var want [][]byte
	var sp Splitter
	sp.Feed([]byte(stream), func(ev []byte) { want = append(want, slices.Clone(ev)) })
	if len(want) != 4 || string(sp.Pending()) != "data: {\"x\":1}\n" {
		t.Fatalf("%d events, pending %q", len(want), sp.Pending())
	}
	for cut := 1; cut < len(stream); cut++ {
		var got [][]byte
		var s Splitter
		for _, part := range []string{stream[:cut], stream[cut:]} {
			s.Feed([]byte(part), func(ev []byte) { got = append(got, slices.Clone(ev)) })
		}
		if len(got) != len(want) {
			t.Fatalf("cut %d: %d events", cut, len(got))
		}
		for i := range got {
			if string(got[i]) != string(want[i]) {
				t.Fatalf("cut %d event %d: %q vs %q", cut, i, got[i], want[i])
			}
		}
	}
}

func TestTracker(t *testing.T) {
	tests := []struct {
		name       string
		stream     string
		text       string
		tokens     int
		ids        []uint32
		idsOK      bool
		role, done bool
		finish     string
		errEvent   bool
		prompt     int
	}{
		{name: "completions", stream: sse(false, cmplChunk(" a", ""), cmplChunk(" b", "")), text: " a b", tokens: 2, prompt: -1},
		{name: "completions token ids", stream: sse(false,
			cmplChunk(" a", `,"prompt_token_ids":[7,8],"token_ids":[1]`), cmplChunk(" b c", `,"token_ids":[2,3]`)),
			text: " a b c", tokens: 3, ids: []uint32{1, 2, 3}, idsOK: true, prompt: 2},
		{name: "chat role and content", stream: sse(true, chatChunk(`{"role":"assistant","content":""}`), chatChunk(`{"content":" hi"}`),
			`{"id":"chatcmpl-a","created":111,"model":"m","choices":[{"index":0,"delta":{"content":""},"finish_reason":"length"}]}`),
			text: " hi", tokens: 1, role: true, done: true, finish: "length", prompt: -1},
		{name: "continuous usage counts", stream: sse(false,
			`{"id":"x","created":1,"model":"m","choices":[{"index":0,"text":" a b","finish_reason":null}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}`),
			text: " a b", tokens: 2, prompt: 5},
		{name: "engine error event", stream: sse(true, cmplChunk(" a", ""), `{"error":{"message":"boom","type":"InternalServerError","code":500}}`),
			text: " a", tokens: 1, errEvent: true, done: true, prompt: -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := track(t, tc.stream)
			gen, _, ok := tr.TokenIDs()
			if tr.Text() != tc.text || tr.Tokens() != tc.tokens || ok != tc.idsOK || (tc.ids != nil && !slices.Equal(gen, tc.ids)) {
				t.Errorf("text %q tokens %d ids %v ok %v", tr.Text(), tr.Tokens(), gen, ok)
			}
			if tr.RoleSent() != tc.role || tr.Done() != tc.done || tr.Finished() != tc.finish || tr.ErrorEvent() != tc.errEvent || tr.PromptTokens() != tc.prompt {
				t.Errorf("role %v done %v finish %q err %v prompt %d", tr.RoleSent(), tr.Done(), tr.Finished(), tr.ErrorEvent(), tr.PromptTokens())
			}
			if string(tr.ID) == "" {
				t.Error("no id recorded")
			}
		})
	}
}

func TestRefusal(t *testing.T) {
	started := track(t, sse(false, cmplChunk(" a", "")))
	chatStarted := track(t, sse(false, chatChunk(`{"role":"assistant","content":""}`), chatChunk(`{"content":" a"}`)))
	none := NewTracker()
	tests := []struct {
		name, route, body string
		tr                *Tracker
		want              string
	}{
		{"plain completion", "/v1/completions", `{"prompt":"x","stream":true}`, started, ""},
		{"plain chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, chatStarted, ""},
		{"responses route", "/v1/responses", `{"input":"x"}`, none, RefuseRoute},
		{"not json", "/v1/completions", `{"prompt":`, none, RefuseBody},
		{"n", "/v1/completions", `{"prompt":"x","n":2}`, none, RefuseN},
		{"n=1 is fine", "/v1/completions", `{"prompt":"x","n":1}`, started, ""},
		{"best_of", "/v1/completions", `{"prompt":"x","best_of":3}`, none, RefuseBestOf},
		{"beam", "/v1/completions", `{"prompt":"x","use_beam_search":true}`, none, RefuseBestOf},
		{"echo", "/v1/completions", `{"prompt":"x","echo":true}`, none, RefuseEcho},
		{"suffix", "/v1/completions", `{"prompt":"x","suffix":"y"}`, none, RefuseSuffix},
		{"completion logprobs", "/v1/completions", `{"prompt":"x","logprobs":2}`, none, RefuseLogprobs},
		{"chat logprobs stitch", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"logprobs":true}`, chatStarted, ""},
		{"prompt_logprobs", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"prompt_logprobs":1}`, none, RefusePromptLogprobs},
		{"batched", "/v1/completions", `{"prompt":["x","y"]}`, none, RefuseBatch},
		{"one-element list", "/v1/completions", `{"prompt":["x"]}`, started, ""},
		{"json schema before any token", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}`, none, ""},
		{"json schema cut halfway", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}}`, chatStarted, RefuseStructured},
		{"text format", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"text"}}`, chatStarted, ""},
		{"tool call cut", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}],"tools":[]}`,
			track(t, sse(false, chatChunk(`{"role":"assistant","content":""}`), chatChunk(`{"tool_calls":[{"index":0,"function":{"name":"f"}}]}`))), RefuseToolCall},
		{"reasoning", "/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`,
			track(t, sse(false, chatChunk(`{"reasoning_content":"hmm"}`))), RefuseReasoning},
		{"token prompt, text answer", "/v1/completions", `{"prompt":[1,2]}`, started, RefuseTokenPrompt},
		{"token prompt, nothing yet", "/v1/completions", `{"prompt":[1,2]}`, none, ""},
		{"token prompt with ids", "/v1/completions", `{"prompt":[1,2],"return_token_ids":true}`,
			track(t, sse(false, cmplChunk(" a", `,"prompt_token_ids":[1,2],"token_ids":[9]`))), ""},
		{"unreadable event", "/v1/completions", `{"prompt":"x"}`, track(t, sse(false, cmplChunk(" a", ""), `{not json`)), RefuseStream},
		{"open final message with parts", "/v1/chat/completions", `{"messages":[{"role":"assistant","content":[{"type":"text","text":"a"}]}],"continue_final_message":true,"add_generation_prompt":false}`, none, RefuseFinalContent},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := NewRequest(tc.route, []byte(tc.body)).Refusal(tc.tr); got != tc.want {
				t.Errorf("Refusal = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestContinue(t *testing.T) {
	cmpl := track(t, sse(false, cmplChunk(" a", ""), cmplChunk(" b", "")))
	ids := track(t, sse(false, cmplChunk(" a", `,"prompt_token_ids":[7,8],"token_ids":[1]`), cmplChunk(" b", `,"token_ids":[2]`)))
	chat := track(t, sse(false, chatChunk(`{"role":"assistant","content":""}`), chatChunk(`{"content":" a"}`), chatChunk(`{"content":" b"}`)))
	tests := []struct {
		name, route, body string
		tr                *Tracker
		want              map[string]string // member -> compact JSON
		absent            []string
		err               error
	}{
		{name: "completion text", route: "/v1/completions", body: `{"prompt":"hi there","max_tokens":10,"stream":true,"seed":3}`, tr: cmpl,
			want: map[string]string{"prompt": `"hi there a b"`, "max_tokens": "8", "seed": "3", "stream": "true"}},
		{name: "completion default limit", route: "/v1/completions", body: `{"prompt":"hi"}`, tr: cmpl,
			want: map[string]string{"prompt": `"hi a b"`, "max_tokens": "14"}},
		{name: "completion token ids", route: "/v1/completions", body: `{"prompt":"hi there","max_tokens":5,"return_token_ids":true}`, tr: ids,
			want: map[string]string{"prompt": `[7,8,1,2]`, "max_tokens": "3", "return_token_ids": "true"}},
		{name: "token prompt kept", route: "/v1/completions", body: `{"prompt":[4,5,6],"max_tokens":5,"return_token_ids":true}`, tr: ids,
			want: map[string]string{"prompt": `[4,5,6,1,2]`}},
		{name: "min_tokens shrinks", route: "/v1/completions", body: `{"prompt":"x","max_tokens":9,"min_tokens":5}`, tr: cmpl,
			want: map[string]string{"min_tokens": "3", "max_tokens": "7"}},
		{name: "chat appends an open assistant message", route: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"q"}],"max_completion_tokens":4,"max_tokens":99,"stream":true}`, tr: chat,
			want: map[string]string{"messages": `[{"content":"q","role":"user"},{"content":" a b","role":"assistant"}]`,
				"max_completion_tokens": "2", "max_tokens": "99", "continue_final_message": "true", "add_generation_prompt": "false"}},
		{name: "chat without a limit", route: "/v1/chat/completions", body: `{"messages":[{"role":"user","content":"q"}]}`, tr: chat,
			absent: []string{"max_tokens", "max_completion_tokens"}},
		{name: "chat already continuing", route: "/v1/chat/completions",
			body: `{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"Sure,"}],"continue_final_message":true,"add_generation_prompt":false}`, tr: chat,
			want: map[string]string{"messages": `[{"content":"q","role":"user"},{"content":"Sure, a b","role":"assistant"}]`}},
		{name: "budget spent", route: "/v1/completions", body: `{"prompt":"x","max_tokens":2}`, tr: cmpl, err: ErrNothingLeft},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := NewRequest(tc.route, []byte(tc.body)).Continue(tc.tr)
			if !errors.Is(err, tc.err) {
				t.Fatalf("err %v, want %v", err, tc.err)
			}
			if err != nil {
				return
			}
			var m map[string]json.RawMessage
			if err := json.Unmarshal(b, &m); err != nil {
				t.Fatalf("body %s: %v", b, err)
			}
			for k, v := range tc.want {
				if got := compact(m[k]); got != v {
					t.Errorf("%s = %s, want %s (body %s)", k, got, v, b)
				}
			}
			for _, k := range tc.absent {
				if _, ok := m[k]; ok {
					t.Errorf("%s present: %s", k, b)
				}
			}
		})
	}
	// Nothing delivered: the original body, byte for byte.
	body := `{"prompt":  "x", "max_tokens":3}`
	if b, err := NewRequest("/v1/completions", []byte(body)).Continue(NewTracker()); err != nil || string(b) != `{"prompt":  "x", "max_tokens":3}` {
		t.Errorf("untouched retry: %s %v", b, err)
	}
}

func compact(v json.RawMessage) string {
	var x any
	if json.Unmarshal(v, &x) != nil {
		return string(v)
	}
	b, _ := json.Marshal(x)
	return string(b)
}

func TestStitcher(t *testing.T) {
	chatReq := NewRequest("/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"q"}],"stream":true}`))
	chatTr := track(t, sse(false, `{"id":"chatcmpl-orig","created":111,"model":"m","prompt_token_ids":[1,2,3],"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`,
		chatChunk(`{"content":" a"}`), chatChunk(`{"content":" b"}`)))
	cmplReq := NewRequest("/v1/completions", []byte(`{"prompt":"p","stream":true,"stop":["END"]}`))
	cmplTr := track(t, sse(false, cmplChunk(" a", ""), cmplChunk(" E", "")))
	tests := []struct {
		name  string
		s     *Stitcher
		in    string
		want  string // compact JSON of the data, "" = dropped
		final bool
	}{
		{"envelope is the original's", NewStitcher(chatReq, chatTr),
			`{"id":"chatcmpl-new","created":222,"model":"m2","choices":[{"index":0,"delta":{"content":" c"},"finish_reason":null}]}`,
			`{"choices":[{"delta":{"content":" c"},"finish_reason":null,"index":0}],"created":111,"id":"chatcmpl-orig","model":"m"}`, false},
		{"second role delta dropped", NewStitcher(chatReq, chatTr),
			`{"id":"chatcmpl-new","created":222,"model":"m","prompt_token_ids":[1,2,3,4,5],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`, "", false},
		{"usage over the whole answer", NewStitcher(chatReq, chatTr),
			`{"id":"chatcmpl-new","created":222,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}}`,
			`{"choices":[],"created":111,"id":"chatcmpl-orig","model":"m","usage":{"completion_tokens":5,"prompt_tokens":3,"total_tokens":8}}`, false},
		{"usage without a known prompt", NewStitcher(cmplReq, cmplTr),
			`{"id":"cmpl-new","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4}}`,
			`{"choices":[],"created":111,"id":"cmpl-a","model":"m","usage":{"completion_tokens":6,"prompt_tokens":1,"total_tokens":7}}`, false},
		{"stop string across the cut", NewStitcher(cmplReq, cmplTr),
			cmplChunk("ND more", `,"token_ids":[5]`),
			`{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"stop_reason":"END","text":""}],"created":111,"id":"cmpl-a","model":"m","object":"text_completion"}`, true},
		{"no stop across the cut", NewStitcher(cmplReq, cmplTr),
			cmplChunk("Nd", ""),
			`{"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"Nd"}],"created":111,"id":"cmpl-a","model":"m","object":"text_completion"}`, false},
		{"second prompt_token_ids dropped", NewStitcher(cmplReq, track(t, sse(false, cmplChunk(" a", `,"prompt_token_ids":[1],"token_ids":[2]`)))),
			cmplChunk(" b", `,"prompt_token_ids":[1,2],"token_ids":[3]`),
			`{"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":" b","token_ids":[3]}],"created":111,"id":"cmpl-a","model":"m","object":"text_completion"}`, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out, final := tc.s.Rewrite([]byte("data: " + tc.in + "\n\n"))
			if final != tc.final {
				t.Errorf("final %v, want %v", final, tc.final)
			}
			if tc.want == "" {
				if out != nil {
					t.Errorf("not dropped: %s", out)
				}
				return
			}
			if got := compact(eventData(out)); got != tc.want {
				t.Errorf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
	// [DONE], comments and error events pass unchanged.
	s := NewStitcher(chatReq, chatTr)
	for _, ev := range []string{"data: [DONE]\n\n", ": ping\n\n", "data: {\"error\":{\"message\":\"x\"}}\n\n"} {
		if out, _ := s.Rewrite([]byte(ev)); string(out) != ev {
			t.Errorf("%q rewritten to %q", ev, out)
		}
	}
}

func TestEnding(t *testing.T) {
	tests := []struct {
		name, route, body, stream string
		complete                  bool
		want                      []string // events, in order
	}{
		{"finish seen, usage asked and missing", "/v1/completions", `{"prompt":"p","stream":true,"stream_options":{"include_usage":true}}`,
			sse(false, `{"id":"cmpl-a","created":111,"model":"m","choices":[{"index":0,"text":" a","finish_reason":"stop"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}`), true,
			[]string{`{"id":"cmpl-a","created":111,"model":"m","choices":[],"usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1}}`, "[DONE]"}},
		{"budget spent, no finish", "/v1/chat/completions", `{"messages":[{"role":"user","content":"q"}],"max_tokens":2,"stream":true}`,
			sse(false, chatChunk(`{"role":"assistant","content":""}`), chatChunk(`{"content":" a"}`), chatChunk(`{"content":" b"}`)), true,
			[]string{`{"id":"chatcmpl-a","created":111,"model":"m","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}`, "[DONE]"}},
		{"not complete", "/v1/completions", `{"prompt":"p","max_tokens":5,"stream":true}`, sse(false, cmplChunk(" a", "")), false, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r, tr := NewRequest(tc.route, []byte(tc.body)), track(t, tc.stream)
			if r.Complete(tr) != tc.complete {
				t.Fatalf("Complete = %v", !tc.complete)
			}
			if !tc.complete {
				return
			}
			var got []string
			var sp Splitter
			sp.Feed(r.Ending(tr), func(ev []byte) { got = append(got, string(eventData(ev))) })
			if !slices.Equal(got, tc.want) {
				t.Errorf("ending %q, want %q", got, tc.want)
			}
		})
	}
}

// TestHeldBackTokensGeneratedAgain: the cut follows tokens whose text the
// engine held back (parts of one UTF-8 character). The token-id
// continuation restarts before them, so its prompt never ends
// mid-character; the stitcher drops the ids the client already has and
// passes the rest, whose text completes the character.
func TestHeldBackTokensGeneratedAgain(t *testing.T) {
	req := NewRequest("/v1/completions", []byte(`{"prompt":"hi","max_tokens":10,"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true}}`))
	tr := track(t, sse(false,
		cmplChunk(" a", `,"prompt_token_ids":[7,8],"token_ids":[1]`),
		cmplChunk("", `,"token_ids":[2]`),
		cmplChunk("", `,"token_ids":[3]`)))
	if tr.HeldBack() != 2 || tr.Tokens() != 3 {
		t.Fatalf("held back %d of %d tokens, want 2 of 3", tr.HeldBack(), tr.Tokens())
	}
	m := continuation(t, req, tr)
	if compact(m["prompt"]) != "[7,8,1]" || compact(m["max_tokens"]) != "9" {
		t.Fatalf("continuation prompt %s max_tokens %s, want [7,8,1] and 9", m["prompt"], m["max_tokens"])
	}
	s := NewStitcher(req, tr)
	steps := []struct{ in, want string }{
		{cmplChunk("", `,"prompt_token_ids":[7,8,1],"token_ids":[2]`), ""},
		{cmplChunk("", `,"token_ids":[3]`), ""},
		{cmplChunk("é", `,"token_ids":[4]`),
			`{"choices":[{"finish_reason":null,"index":0,"logprobs":null,"text":"é","token_ids":[4]}],"created":111,"id":"cmpl-a","model":"m","object":"text_completion"}`},
		{`{"id":"cmpl-b","object":"text_completion","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3}}`,
			`{"choices":[],"created":111,"id":"cmpl-a","model":"m","object":"text_completion","usage":{"completion_tokens":4,"prompt_tokens":2,"total_tokens":6}}`},
	}
	for i, st := range steps {
		out, _ := s.Rewrite([]byte("data: " + st.in + "\n\n"))
		if st.want == "" {
			if out != nil {
				t.Errorf("step %d: not dropped: %s", i, out)
			}
			continue
		}
		if got := compact(eventData(out)); got != st.want {
			t.Errorf("step %d:\n got  %s\n want %s", i, got, st.want)
		}
	}
	// a chunk carrying a re-generated id and a new one keeps the new one
	s = NewStitcher(req, tr)
	out, _ := s.Rewrite([]byte("data: " + cmplChunk("", `,"token_ids":[2,3,4]`) + "\n\n"))
	if got := compact(eventData(out)); !strings.Contains(got, `"token_ids":[4]`) {
		t.Errorf("mixed chunk: %s", got)
	}
}

// TestChatHeldBackTokens: a chat continuation's text ends before the bytes
// of the held-back tokens, so the engine generates them again: the token
// budget counts them once and the stitcher drops their ids when they match
// what the client got; an id that differs ends the dropping, and the
// delivered tokens then count in usage.
func TestChatHeldBackTokens(t *testing.T) {
	req := NewRequest("/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"q"}],"max_tokens":10,"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true}}`))
	chatEv := func(content, extra string) string {
		return `{"id":"chatcmpl-a","object":"chat.completion.chunk","created":111,"model":"m","choices":[{"index":0,"delta":{"content":` + content + `},"finish_reason":null` + extra + `}]}`
	}
	tr := track(t, sse(true,
		`{"id":"chatcmpl-a","object":"chat.completion.chunk","created":111,"model":"m","prompt_token_ids":[7,8],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
		chatEv(`" a"`, `,"token_ids":[1]`),
		chatEv(`""`, `,"token_ids":[2]`)))
	if tr.HeldBack() != 1 || tr.Tokens() != 2 {
		t.Fatalf("held back %d of %d tokens, want 1 of 2", tr.HeldBack(), tr.Tokens())
	}
	m := continuation(t, req, tr)
	if compact(m["max_tokens"]) != "9" || !strings.Contains(string(m["messages"]), `" a"`) {
		t.Fatalf("continuation max_tokens %s messages %s, want 9 and the text so far", m["max_tokens"], m["messages"])
	}
	usage := `{"id":"chatcmpl-b","object":"chat.completion.chunk","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2}}`
	for _, tc := range []struct {
		name      string
		leg       string // the leg's first token event
		dropped   bool
		wantIDs   string
		wantUsage string
	}{
		{"the same id again", chatEv(`"é"`, `,"token_ids":[2]`), false, `"token_ids":[]`, `"completion_tokens":3`},
		{"the same id, no text yet", chatEv(`""`, `,"token_ids":[2]`), true, "", `"completion_tokens":3`},
		{"another id", chatEv(`"x"`, `,"token_ids":[9]`), false, `"token_ids":[9]`, `"completion_tokens":4`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewStitcher(req, tr)
			out, _ := s.Rewrite([]byte("data: " + tc.leg + "\n\n"))
			if tc.dropped != (out == nil) {
				t.Fatalf("dropped %v, want %v: %s", out == nil, tc.dropped, out)
			}
			if !tc.dropped && !strings.Contains(compact(eventData(out)), tc.wantIDs) {
				t.Fatalf("leg event %s, want %s", eventData(out), tc.wantIDs)
			}
			out, _ = s.Rewrite([]byte("data: " + usage + "\n\n"))
			if got := compact(eventData(out)); !strings.Contains(got, tc.wantUsage) {
				t.Fatalf("usage %s, want %s", got, tc.wantUsage)
			}
		})
	}
}

// TestChatHeldBackDiffers: when the continuation does not generate the
// held-back token again, it had one token of budget too many: the leg's
// last token (the one finishing with "length") is dropped, so the client
// gets max_tokens tokens and usage says so.
func TestChatHeldBackDiffers(t *testing.T) {
	req := NewRequest("/v1/chat/completions", []byte(`{"messages":[{"role":"user","content":"q"}],"max_tokens":4,"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true}}`))
	ev := func(content, finish, ids string) string {
		return `{"id":"chatcmpl-a","object":"chat.completion.chunk","created":111,"model":"m","choices":[{"index":0,"delta":{"content":` + content + `},"finish_reason":` + finish + `,"token_ids":` + ids + `}]}`
	}
	tr := track(t, sse(true,
		`{"id":"chatcmpl-a","object":"chat.completion.chunk","created":111,"model":"m","prompt_token_ids":[7,8],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
		ev(`" a"`, "null", "[1]"),
		ev(`""`, "null", "[2]")))
	if m := continuation(t, req, tr); compact(m["max_tokens"]) != "3" {
		t.Fatalf("continuation max_tokens %s, want 3 (4 less the one token not held back)", m["max_tokens"])
	}
	s := NewStitcher(req, tr)
	steps := []struct{ in, want string }{
		{ev(`"x"`, "null", "[9]"), `"token_ids":[9]`},
		{ev(`"y"`, "null", "[10]"), `"token_ids":[10]`},
		{ev(`"z"`, `"length"`, "[11]"), `"delta":{"content":""},"finish_reason":"length","index":0,"token_ids":[]`},
		{`{"id":"chatcmpl-b","object":"chat.completion.chunk","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":8,"completion_tokens":3}}`, `"completion_tokens":4`},
	}
	for i, st := range steps {
		out, _ := s.Rewrite([]byte("data: " + st.in + "\n\n"))
		if got := compact(eventData(out)); !strings.Contains(got, st.want) {
			t.Errorf("step %d: %s, want %s", i, got, st.want)
		}
	}
}

// continuation is req's continuation body after tr, as top-level fields.
func continuation(t *testing.T, req *Request, tr *Tracker) map[string]json.RawMessage {
	t.Helper()
	b, err := req.Continue(tr)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}
