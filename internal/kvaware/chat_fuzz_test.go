package kvaware

import (
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

// FuzzPlainChat: any request body either is refused by plainChat or gives
// messages that render (the tiny model's template puts every content in
// the text, in order) and encode, without a panic.
func FuzzPlainChat(f *testing.F) {
	for _, s := range []string{
		chatBody("", "system", "be brief", "user", "hi"),
		chatBody(`,"add_generation_prompt":false`, "user", "a", "assistant", "b"),
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":""}]}]}`,
		`{"messages":[{"role":"user","content":"{{ messages }} {% for %}"}],"tools":null}`,
		`{"messages":[{"role":"user","content":"\u0000\ud800 x"}],"continue_final_message":false}`,
		`{"messages":[]}`, `{"messages":null}`, `{"messages":[{"role":"tool","content":"x"}]}`,
	} {
		f.Add([]byte(s))
	}
	lt, err := tokenizer.Load("../tokenizer/testdata/llama3ish.json")
	if err != nil {
		f.Fatal(err)
	}
	tmpl := tinyTemplate(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		o, err := rawjson.Parse(body)
		if err != nil {
			return
		}
		msgs, gen, ok := plainChat(o)
		if !ok {
			return
		}
		text, err := tmpl.Render(msgs, gen)
		if err != nil {
			t.Fatalf("a plain chat did not render: %v", err)
		}
		at := 0
		for _, m := range msgs {
			i := strings.Index(text[at:], m.Content)
			if i < 0 {
				t.Fatalf("content %q missing from %q", m.Content, text)
			}
			at += i + len(m.Content)
		}
		_ = lt.Encode(text, false)
	})
}
