package migrate

import (
	"fmt"
	"slices"
	"testing"
)

// state is everything a tracker keeps, for comparing the fast scanner
// with encoding/json.
func state(t *Tracker) string {
	gen, prompt, ok := t.TokenIDs()
	return fmt.Sprintf("id=%s created=%s model=%s text=%q tokens=%d gen=%v prompt=%v idsOK=%v ptok=%d role=%v finish=%q usage=%v done=%v err=%v tool=%v reason=%v chunks=%d held=%d",
		t.ID, t.Created, t.Model, t.Text(), t.Tokens(), gen, prompt, ok, t.PromptTokens(), t.RoleSent(), t.Finished(),
		t.UsageSent(), t.Done(), t.ErrorEvent(), t.toolCall, t.reasoning, t.Chunks(), t.HeldBack())
}

var scanCases = []string{
	cmplChunk(" a", ""),
	cmplChunk(` "quoted" \ back`, ""),
	cmplChunk(" caf\u00e9 \U0001F600 \t\n", ""),
	`{"id":"x","created":1,"model":"m","choices":[{"index":0,"text":"\u00e9\ud83d\ude00\/","finish_reason":null}]}`,
	`  { "choices" : [ { "text" : " a" , "index" : 0 , "logprobs" : {"tokens":[" a"],"token_logprobs":[-0.5e-3],"top_logprobs":[{" a":-1}]} } ] , "id" : "x" , "created" : 12 , "model" : "m" }  `,
	cmplChunk(" a", `,"prompt_token_ids":[1,2,3],"token_ids":[4]`),
	cmplChunk(" a b", `,"token_ids":[5,6]`),
	cmplChunk("", `,"token_ids":[]`),
	cmplChunk(" a", `,"token_ids":null,"prompt_token_ids":null`),
	chatChunk(`{"role":"assistant","content":""}`),
	chatChunk(`{"content":" hi","role":null}`),
	chatChunk(`{"content":null,"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f","arguments":"{\"a\":[1,{}]}"}}]}`),
	chatChunk(`{"tool_calls":[]}`),
	chatChunk(`{"tool_calls":null,"content":" x"}`),
	chatChunk(`{"reasoning_content":"think"}`),
	chatChunk(`{"reasoning":"","content":" y"}`),
	`{"id":"c","created":3,"model":"m","prompt_token_ids":[9,8],"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
	`{"id":"c","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" z"},"finish_reason":"stop","stop_reason":"END"}],"usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":2}}}`,
	`{"id":"c","created":3,"model":"m","choices":[],"usage":{"prompt_tokens":5,"total_tokens":9,"completion_tokens":4}}`,
	`{"id":"c","created":3,"model":"m","choices":[{"index":0,"text":" a"},{"index":1,"text":" b"}]}`,
	`{"id":"c","created":3,"model":"m","choices":[{"index":0,"text":" a"},{"index":1,"text":" b"},{"index":2,"text":" c"}]}`,
	`{"error":{"message":"boom","type":"InternalServerError","param":null,"code":500}}`,
	`{"error":null,"id":"c","created":3,"model":"m","choices":[{"text":" e"}]}`,
	`{"id":"c","created":3,"model":"m","choices":null,"usage":null}`,
	`{"id":"c","created":1.5e3,"model":"m","choices":[{"text":" n","index":0,"extra":[true,false,null,-1,{"k":"v\"}"}]}]}`,
	`{"id":"c","choices":[{"text":" broken"`,
	`[1,2]`,
	`"just a string"`,
	`{"id":"c","choices":[{"text":12}]}`,
	`{"id":"c","choices":[{"token_ids":[1,-2]}]}`,
	// invalid JSON the scanner must refuse as encoding/json does (it
	// checks what it skips and every string itself)
	`{"id":"c","choices":[{"text":" a","x":tru}]}`,
	`{"id":"c","choices":[{"text":" a","x":01}]}`,
	`{"id":"c","choices":[{"text":" a\u00g1"}]}`,
	"{\"id\":\"c\",\"choices\":[{\"text\":\" a\x01\"}]}",
	`{"id":"c","choices":[{"text":" a"}]}x`,
	`{"id":"c","created":+1,"choices":[]}`,
	`{"id":"c","choices":[{"index":+1,"text":" a"}]}`,
	`{"i\x":"c","choices":[]}`,
	`{"id":"c","model":"m\q","choices":[]}`,
	`{"id":"c","choices":[{"text":" a","logprobs":{"a":[1,]}}]}`,
}

// TestScannerMatchesEncodingJSON feeds every case, alone and after the
// others, to a fast tracker and to one using encoding/json only.
func TestScannerMatchesEncodingJSON(t *testing.T) {
	for i, c := range scanCases {
		fast, slow := NewTracker(), NewTracker()
		slow.slow = true
		ev := []byte("data: " + c + "\n\n")
		okF, okS := fast.Event(ev), slow.Event(ev)
		if okF != okS || state(fast) != state(slow) {
			t.Errorf("case %d %s:\nfast %v %s\nslow %v %s", i, c, okF, state(fast), okS, state(slow))
		}
	}
	fast, slow := NewTracker(), NewTracker()
	slow.slow = true
	for _, c := range scanCases {
		ev := []byte("data: " + c + "\n\n")
		fast.Event(ev)
		slow.Event(ev)
	}
	if state(fast) != state(slow) {
		t.Errorf("all cases in a row:\nfast %s\nslow %s", state(fast), state(slow))
	}
}

// FuzzScanner: whatever the bytes, the fast scanner and encoding/json
// leave a tracker in the same state.
func FuzzScanner(f *testing.F) {
	for _, c := range scanCases {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if slices.Contains(data, '\n') { // one SSE data line
			return
		}
		fast, slow := NewTracker(), NewTracker()
		slow.slow = true
		ev := append(append([]byte("data: "), data...), "\n\n"...)
		okF, okS := fast.Event(ev), slow.Event(ev)
		if okF != okS || state(fast) != state(slow) {
			t.Fatalf("%q:\nfast %v %s\nslow %v %s", data, okF, state(fast), okS, state(slow))
		}
	})
}
