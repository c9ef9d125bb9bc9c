package sim

import (
	"encoding/json"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/chattmpl"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// TestParseMessagesJoinsTextParts: content parts are flattened as vLLM
// flattens them for a template taking string content: the non-empty text
// parts joined with newlines, other parts left out.
func TestParseMessagesJoinsTextParts(t *testing.T) {
	for _, tt := range []struct{ content, want string }{
		{`"plain"`, "plain"},
		{`null`, ""},
		{`[{"type":"text","text":"a"},{"type":"text","text":"b"}]`, "a\nb"},
		{`[{"type":"text","text":""},{"type":"text","text":"a"},{"type":"text","text":""},{"type":"text","text":"b"}]`, "a\nb"},
		{`[{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"caption"}]`, "caption"},
		{`[]`, ""},
	} {
		raw := json.RawMessage(`[{"role":"user","content":` + tt.content + `}]`)
		msgs, err := parseMessages(raw)
		if err != nil {
			t.Fatalf("%s: %v", tt.content, err)
		}
		if len(msgs) != 1 || msgs[0].Content != tt.want {
			t.Errorf("%s: %+v, want content %q", tt.content, msgs, tt.want)
		}
	}
}

// TestChatTemplateFile: chat_template.jinja, the file to give a router's
// --chat-template in front of vllm-sims, renders every conversation as
// the sims render it (renderChat), with and without the generation
// prompt.
func TestChatTemplateFile(t *testing.T) {
	tmpl, err := chattmpl.Load(".", "chat_template.jinja")
	if err != nil {
		t.Fatal(err)
	}
	convs := [][]oracle.Message{
		{{Role: "user", Content: "hello"}},
		{{Role: "system", Content: "be brief"}, {Role: "user", Content: "line\nbreak"}, {Role: "assistant", Content: ""}, {Role: "user", Content: "Ünïcödé 😀 {{ x }}"}},
	}
	for _, conv := range convs {
		msgs := make([]chattmpl.Message, len(conv))
		for i, m := range conv {
			msgs[i] = chattmpl.Message{Role: m.Role, Content: m.Content}
		}
		for _, gen := range []bool{true, false} {
			want, aerr := renderChat(conv, &gen, nil)
			if aerr != nil {
				t.Fatal(aerr.message)
			}
			got, err := tmpl.Render(msgs, gen)
			if err != nil || got != want {
				t.Errorf("generation prompt %v: %q (%v), want %q", gen, got, err, want)
			}
		}
	}
}
