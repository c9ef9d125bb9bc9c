package migrate

import (
	"strings"
	"testing"
)

// templateStreams are event sequences of one stream each: plain token
// events the template reads, and neighbours that only look like them.
var templateStreams = []struct {
	name   string
	events []string
	hits   int // events the fast tracker must read through the template
}{
	{"completion", []string{
		cmplChunk(" a", ""), cmplChunk(" b", ""), cmplChunk("", ""), cmplChunk(" c", ""),
	}, 3},
	{"escapes and unicode", []string{
		cmplChunk(" a", ""),
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" \"q\" \\ \u00e9 \ud83d\ude00 \/","logprobs":null,"finish_reason":null}]}`,
		"{\"id\":\"cmpl-a\",\"object\":\"text_completion\",\"created\":111,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" bad \xff utf8\",\"logprobs\":null,\"finish_reason\":null}]}",
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":"\n\t","logprobs":null,"finish_reason":null}]}`,
	}, 3},
	{"invalid values in the hole", []string{
		cmplChunk(" a", ""),
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":12,"logprobs":null,"finish_reason":null}]}`,
		cmplChunk(" b", ""),
		"{\"id\":\"cmpl-a\",\"object\":\"text_completion\",\"created\":111,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" ctl \x01\",\"logprobs\":null,\"finish_reason\":null}]}",
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" \x","logprobs":null,"finish_reason":null}]}`,
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" unterminated`,
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" a" ,"logprobs":null,"finish_reason":null}]}`,
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" a"}`,
		`{"id":"cmpl-a","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null}]}]`,
		cmplChunk(" c", ""),
	}, 1},
	{"the cut values change", []string{
		cmplChunk(" a", ""),
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" b","logprobs":null,"finish_reason":null}]}`,
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" c","logprobs":null,"finish_reason":"length"}]}`,
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" d","logprobs":{"tokens":[" d"]},"finish_reason":null}]}`,
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" e","logprobs":{"tokens":[" e"]},"finish_reason":null}]}`,
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" f","logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":6}}`,
		`{"id":"cmpl-b","object":"text_completion","created":111,"model":"m","choices":[{"index":0,"text":" g","logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":7}}`,
		`{"error":{"message":"boom","code":500}}`,
	}, 0},
	{"token ids", []string{
		cmplChunk(" a", `,"prompt_token_ids":[1,2],"token_ids":[4]`),
		cmplChunk(" b", `,"token_ids":[5]`),
		cmplChunk("", `,"token_ids":[6, 7]`),
		cmplChunk("", `,"token_ids":[]`),
		cmplChunk(" c", `,"token_ids":[8]`),
		cmplChunk(" d", `,"token_ids":[-1]`),
		cmplChunk(" d", `,"token_ids":[1e3]`),
		cmplChunk(" d", `,"token_ids":[4294967296]`),
		cmplChunk(" d", `,"token_ids":[9,]`),
		cmplChunk(" d", `,"token_ids":null`),
		cmplChunk(" e", `,"token_ids":[10]`),
	}, 3},
	{"ids before text", []string{
		`{"id":"c","choices":[{"token_ids":[1],"index":0,"text":" a"}]}`,
		`{"id":"c","choices":[{"token_ids":[2,3],"index":0,"text":" b"}]}`,
		`{"id":"c","choices":[{"token_ids":[4],"index":0,"text":""}]}`,
	}, 2},
	{"chat", []string{
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[9,8]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" x"},"logprobs":null,"finish_reason":null,"token_ids":[5]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" y"},"logprobs":null,"finish_reason":null,"token_ids":[6]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":null},"logprobs":null,"finish_reason":null,"token_ids":[7]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" z"},"logprobs":null,"finish_reason":null,"token_ids":[8]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" w","reasoning_content":"t"},"logprobs":null,"finish_reason":null,"token_ids":[8]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[{"index":0,"delta":{"content":" z"},"logprobs":null,"finish_reason":"stop","token_ids":[8]}]}`,
		`{"id":"c","object":"chat.completion.chunk","created":3,"model":"m","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":4}}`,
	}, 1},
	{"text and content both", []string{
		`{"id":"c","choices":[{"text":" t","delta":{"content":" c"}}]}`,
		`{"id":"c","choices":[{"text":" u","delta":{"content":" d"}}]}`,
		`{"id":"c","choices":[{"text":" v","delta":{"content":""}}]}`,
	}, 2},
	{"tool calls", []string{
		chatChunk(`{"content":" x"}`),
		chatChunk(`{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}`),
		chatChunk(`{"tool_calls":[{"index":0,"function":{"arguments":"}"}}]}`),
		chatChunk(`{"content":" y","tool_calls":null}`),
		chatChunk(`{"content":" z","tool_calls":null}`),
	}, 1},
	{"duplicate keys", []string{
		`{"id":"c","choices":[{"text":" a","text":" b"}]}`,
		`{"id":"c","choices":[{"text":" c","text":" d"}]}`,
	}, 0},
}

// TestTemplateMatchesEncodingJSON feeds every stream, event by event, to
// a fast tracker and to one using encoding/json only: the states agree
// after every event, and the fast one read the expected events through
// its template.
func TestTemplateMatchesEncodingJSON(t *testing.T) {
	for _, st := range templateStreams {
		t.Run(strings.ReplaceAll(st.name, " ", "_"), func(t *testing.T) {
			fast, slow := NewTracker(), NewTracker()
			slow.slow = true
			for i, e := range st.events {
				ev := []byte("data: " + e + "\n\n")
				okF, okS := fast.Event(ev), slow.Event(ev)
				if okF != okS || state(fast) != state(slow) {
					t.Fatalf("event %d %s:\nfast %v %s\nslow %v %s", i, e, okF, state(fast), okS, state(slow))
				}
			}
			if fast.tmplHits != st.hits {
				t.Errorf("template reads = %d, want %d", fast.tmplHits, st.hits)
			}
		})
	}
}

// FuzzTemplate: whatever two events follow a plain token event, the
// template and encoding/json leave a tracker in the same state.
func FuzzTemplate(f *testing.F) {
	for _, st := range templateStreams {
		for i := 1; i < len(st.events); i++ {
			f.Add([]byte(st.events[0]), []byte(st.events[i]))
		}
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		if strings.ContainsRune(string(a), '\n') || strings.ContainsRune(string(b), '\n') {
			return
		}
		fast, slow := NewTracker(), NewTracker()
		slow.slow = true
		for i, data := range [][]byte{a, b, a, b} {
			ev := append(append([]byte("data: "), data...), "\n\n"...)
			okF, okS := fast.Event(ev), slow.Event(ev)
			if okF != okS || state(fast) != state(slow) {
				t.Fatalf("event %d (%q then %q):\nfast %v %s\nslow %v %s", i, a, b, okF, state(fast), okS, state(slow))
			}
		}
	})
}
