// Package chattmpl renders a model's chat template the way vLLM's
// /v1/chat/completions does (HuggingFace transformers' apply_chat_template:
// Jinja with trim_blocks and lstrip_blocks, the tokenizer's special tokens
// as variables), for plain conversations: messages of a system, user or
// assistant role whose content is text (a string, or text parts, given to
// the template as vLLM gives them). The router tokenizes the
// result in-process (internal/tokenizer) so that kv_aware can route a chat
// request without asking an engine's /tokenize first; internal/kvaware
// checks the first results against the engine and switches itself off at
// the first difference.
package chattmpl

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"

	"github.com/ardanlabs/jinja"
)

// ErrNoTemplate: the model directory holds no chat template.
var ErrNoTemplate = errors.New("no chat template")

// ErrUnsupported: the template uses an escape in a string literal the
// Jinja engine does not decode as Python's does (only \n, \t, \\, \' and \"
// are).
var ErrUnsupported = errors.New("chat template uses an escape sequence the router does not render")

// Template is a compiled chat template with the variables
// apply_chat_template adds.
type Template struct {
	Path    string // where it was read from
	tmpl    *jinja.Template
	special map[string]any
	// parts: the template iterates over a message's content, so vLLM
	// gives it content as a list of parts (its "openai" content format,
	// renderers/hf.py _detect_content_format) rather than one string.
	parts bool
}

// Message is one turn of a plain conversation: its text content, and when
// the request gave the content as text parts, their texts.
type Message struct {
	Role    string   `json:"role"`
	Content string   `json:"content"`
	Parts   []string `json:"-"`
}

// Roles the router renders; any other role (developer, tool) is left to
// the engine, which rewrites or annotates such messages first.
var Roles = map[string]bool{"system": true, "user": true, "assistant": true}

// contentLoop finds a loop over a message's content ("for part in
// message['content']", "for c in message.content", "for x in content"):
// vLLM then passes content as a list of parts. Where it and vLLM's
// detection disagree, the engine's check finds the difference.
var contentLoop = regexp.MustCompile(`\{%-?\s*for\s+[^%]*\bin\s+[^%]*content`)

// tags are the template's expressions and statements, where string
// literals are; badEscape is an escape in them the engine would keep as
// written where Python decodes it (\r, \u..., \x..., octal).
var (
	tags      = regexp.MustCompile(`(?s)\{\{.*?\}\}|\{%.*?%\}`)
	badEscape = regexp.MustCompile(`\\[^nt\\'"]`)
)

// Load reads the chat template of the model directory holding path (a
// tokenizer.json or the directory itself): file when not "" (what the
// engines were given with vLLM's --chat-template), else
// chat_template.jinja, else the "chat_template" of tokenizer_config.json
// (a string, or a list of named templates whose "default" is taken). The
// special tokens come from tokenizer_config.json.
func Load(path, file string) (*Template, error) {
	dir := path
	if st, err := os.Stat(path); err == nil && !st.IsDir() {
		dir = filepath.Dir(path)
	}
	cfg, err := readConfig(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil {
		return nil, err
	}
	src, from := "", file
	if from == "" {
		from = filepath.Join(dir, "chat_template.jinja")
	}
	if b, err := os.ReadFile(from); err == nil {
		src = string(b)
	} else if file != "" {
		return nil, err
	} else if src, err = cfg.template(); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, "tokenizer_config.json"), err)
	} else {
		from = filepath.Join(dir, "tokenizer_config.json")
	}
	if src == "" {
		return nil, fmt.Errorf("%s: %w", dir, ErrNoTemplate)
	}
	t, err := Parse(src, cfg.specialTokens())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", from, err)
	}
	t.Path = from
	return t, nil
}

// Parse compiles a template with the given special tokens (bos_token,
// eos_token, ...).
func Parse(src string, special map[string]string) (*Template, error) {
	for _, tag := range tags.FindAllString(src, -1) {
		if e := badEscape.FindString(tag); e != "" {
			return nil, fmt.Errorf("%w: %s", ErrUnsupported, e)
		}
	}
	tmpl, err := jinja.Compile(src)
	if err != nil {
		return nil, err
	}
	t := &Template{tmpl: tmpl, special: make(map[string]any, len(special)), parts: contentLoop.MatchString(src)}
	for k, v := range special {
		t.special[k] = v
	}
	return t, nil
}

// Render returns the prompt text of msgs, ending with the assistant's
// header when addGenerationPrompt.
func (t *Template) Render(msgs []Message, addGenerationPrompt bool) (string, error) {
	ms := make([]any, len(msgs))
	for i, m := range msgs {
		if !Roles[m.Role] {
			return "", fmt.Errorf("chat template: role %q not rendered by the router", m.Role)
		}
		ms[i] = map[string]any{"role": m.Role, "content": t.content(m)}
	}
	data := make(map[string]any, len(t.special)+2)
	for k, v := range t.special {
		data[k] = v
	}
	data["messages"] = ms
	data["add_generation_prompt"] = addGenerationPrompt
	return t.tmpl.Render(data)
}

// ContentParts reports whether the template is given content as a list of
// parts.
func (t *Template) ContentParts() bool { return t.parts }

// content is a message's content as vLLM gives it to the template: the
// string (text parts joined, as the caller did), or for a template
// iterating over content, a text part per part given (a string content is
// one part).
func (t *Template) content(m Message) any {
	if !t.parts {
		return m.Content
	}
	texts := m.Parts
	if texts == nil {
		texts = []string{m.Content}
	}
	parts := make([]any, len(texts))
	for i, text := range texts {
		parts[i] = map[string]any{"type": "text", "text": text}
	}
	return parts
}

// config is what Load reads of tokenizer_config.json.
type config map[string]json.RawMessage

func readConfig(path string) (config, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return config{}, nil
	}
	if err != nil {
		return nil, err
	}
	var c config
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// template is "chat_template": a string, or [{"name", "template"}] whose
// "default" entry is used ("" when absent).
func (c config) template() (string, error) {
	raw, ok := c["chat_template"]
	if !ok || string(raw) == "null" {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var named []struct{ Name, Template string }
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", fmt.Errorf("chat_template: %w", err)
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", nil
}

// specialTokenNames are the tokenizer attributes apply_chat_template
// passes to the template (transformers' special_tokens_map).
var specialTokenNames = []string{"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}

// specialTokens are the named special tokens, as strings or
// {"content": ...} objects.
func (c config) specialTokens() map[string]string {
	out := map[string]string{}
	for _, name := range specialTokenNames {
		raw, ok := c[name]
		if !ok {
			continue
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			out[name] = s
			continue
		}
		var obj struct {
			Content *string `json:"content"`
		}
		if json.Unmarshal(raw, &obj) == nil && obj.Content != nil {
			out[name] = *obj.Content
		}
	}
	return out
}
