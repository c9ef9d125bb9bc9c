package bench

import (
	"testing"
)

func TestScanChunk(t *testing.T) {
	cases := []struct {
		name    string
		in      string
		want    chunkInfo
		text    string
		wantErr bool
	}{
		{
			name: "completions token",
			in:   `{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" hello","logprobs":null,"finish_reason":null}]}`,
			want: chunkInfo{token: true}, text: " hello",
		},
		{
			name: "chat first delta with role",
			in:   `{"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`,
			want: chunkInfo{token: true}, text: "",
		},
		{
			name: "chat delta",
			in:   `{"choices":[{"index":0,"delta":{"content":"wor\u006cd\n\"q\" \ud83d\ude00"}}]}`,
			want: chunkInfo{token: true}, text: "world\n\"q\" 😀",
		},
		{
			name: "null text is still a token event",
			in:   `{"choices":[{"index":0,"text":null}]}`,
			want: chunkInfo{token: true},
		},
		{
			name: "usage chunk",
			in:   `{"id":"x","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}`,
			want: chunkInfo{usage: true, completion: 34, prompt: 12, promptSet: true},
		},
		{
			name: "usage with null completion",
			in:   `{"choices":[],"usage":{"completion_tokens":null}}`,
			want: chunkInfo{usage: true},
		},
		{
			name: "usage on a token chunk is ignored (vLLM elif)",
			in:   `{"choices":[{"text":"a"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}`,
			want: chunkInfo{token: true}, text: "a",
		},
		{
			name: "empty usage object",
			in:   `{"choices":[],"usage":{}}`,
			want: chunkInfo{},
		},
		{
			name: "error event (new shape)",
			in:   `{"error":{"message":"decode failed","type":"InternalServerError","code":500}}`,
			want: chunkInfo{errorMsg: "decode failed"},
		},
		{
			name: "error event (old shape)",
			in:   `{"object":"error","message":"boom","type":"x","code":500}`,
			want: chunkInfo{errorMsg: "boom"},
		},
		{
			name: "error null is not an error",
			in:   `{"error":null,"choices":[{"text":"a"}]}`,
			want: chunkInfo{token: true}, text: "a",
		},
		{name: "invalid JSON", in: `{"choices":[`, wantErr: true},
		{name: "not an object", in: `[1,2]`, wantErr: true},
		{name: "choices is a string", in: `{"choices":"abc"}`, wantErr: true},
		{name: "choices empty object is falsy", in: `{"choices":{}}`, want: chunkInfo{}},
		{name: "keys with escapes", in: `{"ch\u006fices":[{"t\u0065xt":"z"}]}`, want: chunkInfo{token: true}, text: "z"},
	}
	for _, c := range cases {
		var text []byte
		got, err := scanChunk([]byte(c.in), &text)
		if (err != nil) != c.wantErr {
			t.Errorf("%s: err = %v, wantErr %v", c.name, err, c.wantErr)
			continue
		}
		if c.wantErr {
			continue
		}
		if got != c.want {
			t.Errorf("%s: got %+v, want %+v", c.name, got, c.want)
		}
		if string(text) != c.text {
			t.Errorf("%s: text %q, want %q", c.name, text, c.text)
		}
	}
}

func TestScanChunkDoesNotAllocate(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts differ under the race detector")
	}
	tok := []byte(`{"id":"cmpl-bench-1-0","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}`)
	usage := []byte(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":1024,"completion_tokens":128,"total_tokens":1152}}`)
	text := make([]byte, 0, 1<<16)
	allocs := testing.AllocsPerRun(200, func() {
		text = text[:0]
		if ci, err := scanChunk(tok, &text); err != nil || !ci.token {
			t.Fatal("token chunk not recognised")
		}
		if ci, err := scanChunk(usage, nil); err != nil || ci.completion != 128 {
			t.Fatal("usage chunk not recognised")
		}
	})
	if allocs != 0 {
		t.Errorf("scanChunk allocates %v times per call pair, want 0", allocs)
	}
}

func FuzzScanChunk(f *testing.F) {
	f.Add([]byte(`{"choices":[{"text":"a\u00e9"}],"usage":{"completion_tokens":3}}`))
	f.Add([]byte(`{"error":{"message":1}}`))
	f.Add([]byte(`{"choices":0.0,"usage":{"prompt_tokens":-1e3}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var text []byte
		_, _ = scanChunk(data, &text)
	})
}
