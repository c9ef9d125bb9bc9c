package chattmpl

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// reference is testdata/reference.json: templates rendered by HuggingFace
// transformers' own Jinja environment (scripts/chattmpl-reference.py).
type reference struct {
	Special   map[string]string `json:"special"`
	Templates map[string]string `json:"templates"`
	Parts     []string          `json:"parts"` // templates given content as parts
	Cases     []struct {
		Template            string    `json:"template"`
		Messages            []Message `json:"messages"`
		AddGenerationPrompt bool      `json:"add_generation_prompt"`
		Want                *string   `json:"want"`
		Error               *string   `json:"error"`
	} `json:"cases"`
}

// TestRenderMatchesTransformers: every case renders byte for byte as
// transformers renders it, and a template that raises fails here too.
func TestRenderMatchesTransformers(t *testing.T) {
	b, err := os.ReadFile("testdata/reference.json")
	if err != nil {
		t.Fatal(err)
	}
	var ref reference
	if err := json.Unmarshal(b, &ref); err != nil {
		t.Fatal(err)
	}
	if len(ref.Cases) < 50 {
		t.Fatalf("%d reference cases", len(ref.Cases))
	}
	compiled := map[string]*Template{}
	for name, src := range ref.Templates {
		tm, err := Parse(src, ref.Special)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		compiled[name] = tm
		if want := slices.Contains(ref.Parts, name); tm.ContentParts() != want {
			t.Errorf("%s: content as parts %v, want %v", name, tm.ContentParts(), want)
		}
	}
	for i, c := range ref.Cases {
		got, err := compiled[c.Template].Render(c.Messages, c.AddGenerationPrompt)
		switch {
		case c.Error != nil:
			if err == nil || !strings.Contains(err.Error(), *c.Error) {
				t.Errorf("case %d (%s): error %v, want one containing %q", i, c.Template, err, *c.Error)
			}
		case err != nil:
			t.Errorf("case %d (%s): %v", i, c.Template, err)
		case got != *c.Want:
			t.Errorf("case %d (%s, generation prompt %v):\n got %q\nwant %q", i, c.Template, c.AddGenerationPrompt, got, *c.Want)
		}
	}
}

// TestContentParts: a template iterating over a message's content is
// given content as text parts (a string content as one part, text parts
// one each, empty ones kept), as vLLM gives it; another gets the string.
func TestContentParts(t *testing.T) {
	for _, src := range []string{
		`{% for m in messages %}{% for part in m['content'] %}[{{ part.text }}]{% endfor %}{% endfor %}`,
		`{%- for m in messages -%}{%- for c in m.content -%}[{{ c.text }}]{%- endfor -%}{%- endfor -%}`,
		`{% for m in messages %}{% set content = m.content %}{% for x in content %}[{{ x.text }}]{% endfor %}{% endfor %}`,
	} {
		tm, err := Parse(src, nil)
		if err != nil || !tm.ContentParts() {
			t.Fatalf("%q: %v, parts %v", src, err, tm != nil && tm.ContentParts())
		}
		got, err := tm.Render([]Message{{Role: "user", Content: "one"}, {Role: "user", Content: "a\nb", Parts: []string{"a", "", "b"}}}, false)
		if err != nil || got != "[one][a][][b]" {
			t.Errorf("%q: %q (%v)", src, got, err)
		}
	}
	tm, err := Parse(`{% for m in messages %}{{ m['content'] }};{% endfor %}`, nil)
	if err != nil || tm.ContentParts() {
		t.Fatalf("string content: %v", err)
	}
	if got, _ := tm.Render([]Message{{Role: "user", Content: "a\nb", Parts: []string{"a", "", "b"}}}, false); got != "a\nb;" {
		t.Errorf("string content: %q", got)
	}
}

// TestParseRefusesEscapes: an escape the engine would not decode as
// Python does refuses the template rather than render it differently.
func TestParseRefusesEscapes(t *testing.T) {
	for _, src := range []string{
		`{{ messages[0].content.replace('\r\n', '\n') }}`,
		`{{ '\u00e9' }}`,
		`{% set x = "\x41" %}{{ x }}`,
	} {
		if _, err := Parse(src, nil); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%q: %v, want ErrUnsupported", src, err)
		}
	}
	tm, err := Parse("line\\r outside tags {{ '\\n\\t' }}", nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := tm.Render(nil, false); got != "line\\r outside tags \n\t" {
		t.Errorf("decoded escapes: %q", got)
	}
}

func TestRenderRefusesOtherRoles(t *testing.T) {
	tm, err := Parse(`{% for m in messages %}{{ m.role }}{% endfor %}`, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, role := range []string{"developer", "tool", "function", ""} {
		if _, err := tm.Render([]Message{{Role: role, Content: "x"}}, true); err == nil {
			t.Errorf("role %q rendered", role)
		}
	}
}

// TestLoad: chat_template.jinja wins over tokenizer_config.json, whose
// template may be a string or a list of named ones; special tokens may be
// strings or AddedToken objects; a directory without a template says so.
func TestLoad(t *testing.T) {
	write := func(dir, name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	render := func(tm *Template) string {
		t.Helper()
		s, err := tm.Render([]Message{{Role: "user", Content: "hi"}}, false)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	const cfg = `{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", `

	dir := t.TempDir()
	write(dir, "tokenizer.json", "{}")
	write(dir, "tokenizer_config.json", cfg+`"chat_template": "{{ bos_token }}config{{ eos_token }}"}`)
	tm, err := Load(filepath.Join(dir, "tokenizer.json"), "")
	if err != nil {
		t.Fatal(err)
	}
	if got := render(tm); got != "<s>config</s>" || filepath.Base(tm.Path) != "tokenizer_config.json" {
		t.Errorf("config string: %q from %s", got, tm.Path)
	}
	write(dir, "chat_template.jinja", "{{ bos_token }}file")
	if tm, err = Load(dir, ""); err != nil || render(tm) != "<s>file" {
		t.Errorf("chat_template.jinja: %v", err)
	}

	write(dir, "override.jinja", "{{ eos_token }}override")
	if tm, err = Load(dir, filepath.Join(dir, "override.jinja")); err != nil || render(tm) != "</s>override" {
		t.Errorf("--chat-template: %v", err)
	}
	if _, err = Load(dir, filepath.Join(dir, "missing.jinja")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing --chat-template file: %v", err)
	}

	named := t.TempDir()
	write(named, "tokenizer_config.json", cfg+`"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "default {{ messages[0].content }}"}]}`)
	if tm, err = Load(named, ""); err != nil || render(tm) != "default hi" {
		t.Errorf("named templates: %v", err)
	}

	none := t.TempDir()
	write(none, "tokenizer_config.json", cfg+`"model_max_length": 8}`)
	if _, err := Load(none, ""); !errors.Is(err, ErrNoTemplate) {
		t.Errorf("no template: %v", err)
	}
	if _, err := Load(t.TempDir(), ""); !errors.Is(err, ErrNoTemplate) {
		t.Errorf("empty directory: %v", err)
	}
	bad := t.TempDir()
	write(bad, "chat_template.jinja", "{% for m in messages %}")
	if _, err := Load(bad, ""); err == nil || !strings.Contains(err.Error(), "chat_template.jinja") {
		t.Errorf("unterminated for: %v", err)
	}
}
