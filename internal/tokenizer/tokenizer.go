// Package tokenizer encodes text to token ids exactly as HuggingFace
// tokenizers' Tokenizer.encode(text, add_special_tokens) does, for the
// tokenizer.json pipelines of the common byte-level BPE model families
// (GPT-2, Llama 3, Qwen2 and the like). Anything outside that subset is
// refused when the file is loaded, with an error naming the component, so
// a loaded Tokenizer is exact or does not exist.
package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/text/unicode/norm"
)

// ErrUnsupported marks a tokenizer.json with a component this package does
// not implement exactly.
var ErrUnsupported = errors.New("unsupported tokenizer component")

func unsupported(component, what string) error {
	return fmt.Errorf("%w: %s %s", ErrUnsupported, component, what)
}

// Tokenizer is a loaded tokenizer.json. It is safe for concurrent use.
type Tokenizer struct {
	nfc          bool     // normalizer
	split        scanner  // Split pre-tokenizer (nil: none)
	prefix       bool     // ByteLevel add_prefix_space
	regex        bool     // ByteLevel use_regex (GPT-2 pattern)
	hasByteLevel bool     // a ByteLevel pre-tokenizer was seen
	model        *bpe     // the model
	raw          matcher  // added tokens matched on the raw text
	normed       matcher  // added tokens matched on the normalized text
	pre, suf     []uint32 // TemplateProcessing single: ids around the sequence
	Path         string   // the file loaded
}

// Load reads a tokenizer.json file, or the tokenizer.json in a model
// directory.
func Load(path string) (*Tokenizer, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "tokenizer.json")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := Parse(b)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", path, err)
	}
	t.Path = path
	return t, nil
}

type fileJSON struct {
	Truncation    json.RawMessage `json:"truncation"`
	Padding       json.RawMessage `json:"padding"`
	AddedTokens   []addedJSON     `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Model         bpeJSON         `json:"model"`
}

type addedJSON struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// component is the common shape of normalizers, pre-tokenizers and
// post-processors: a type and, for Sequence, the members.
type component struct {
	Type           string            `json:"type"`
	Normalizers    []json.RawMessage `json:"normalizers"`
	Pretokenizers  []json.RawMessage `json:"pretokenizers"`
	Processors     []json.RawMessage `json:"processors"`
	AddPrefixSpace *bool             `json:"add_prefix_space"`
	UseRegex       *bool             `json:"use_regex"`
	Pattern        struct {
		Regex  *string `json:"Regex"`
		String *string `json:"String"`
	} `json:"pattern"`
	Behavior string `json:"behavior"`
	Invert   bool   `json:"invert"`
	Single   []struct {
		SpecialToken *struct {
			ID string `json:"id"`
		} `json:"SpecialToken"`
		Sequence *struct {
			ID string `json:"id"`
		} `json:"Sequence"`
	} `json:"single"`
	SpecialTokens map[string]struct {
		IDs []uint32 `json:"ids"`
	} `json:"special_tokens"`
}

func isNull(b json.RawMessage) bool { return len(b) == 0 || string(b) == "null" }

// Parse builds a Tokenizer from the contents of a tokenizer.json.
func Parse(data []byte) (*Tokenizer, error) {
	var f fileJSON
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	if !isNull(f.Truncation) {
		return nil, unsupported("truncation", string(f.Truncation))
	}
	if !isNull(f.Padding) {
		return nil, unsupported("padding", "(set)")
	}
	t := &Tokenizer{}
	var err error
	if t.model, err = newBPE(&f.Model); err != nil {
		return nil, err
	}
	if err := t.parseNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	if err := t.parsePre(f.PreTokenizer, 0); err != nil {
		return nil, err
	}
	if !t.byteLevel() {
		return nil, unsupported("pre_tokenizer", "without ByteLevel")
	}
	if err := t.parsePost(f.PostProcessor, 0); err != nil {
		return nil, err
	}
	if err := t.parseAdded(f.AddedTokens); err != nil {
		return nil, err
	}
	return t, nil
}

func (t *Tokenizer) byteLevel() bool { return t.hasByteLevel }

func (t *Tokenizer) parseNormalizer(raw json.RawMessage) error {
	if isNull(raw) {
		return nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("normalizer: %w", err)
	}
	switch c.Type {
	case "NFC":
		t.nfc = true
		return nil
	case "Sequence":
		for _, m := range c.Normalizers {
			if err := t.parseNormalizer(m); err != nil {
				return err
			}
		}
		return nil
	}
	return unsupported("normalizer", c.Type)
}

// parsePre accepts an optional Split (of a known pattern) followed by
// ByteLevel, as a Sequence or ByteLevel alone.
func (t *Tokenizer) parsePre(raw json.RawMessage, depth int) error {
	if isNull(raw) {
		return unsupported("pre_tokenizer", "none (not byte-level)")
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("pre_tokenizer: %w", err)
	}
	switch c.Type {
	case "Sequence":
		if depth > 0 {
			return unsupported("pre_tokenizer", "nested Sequence")
		}
		for _, p := range c.Pretokenizers {
			if err := t.parsePre(p, depth+1); err != nil {
				return err
			}
		}
		return nil
	case "Split":
		if t.split != nil || t.hasByteLevel {
			return unsupported("pre_tokenizer", "Split after Split or ByteLevel")
		}
		if c.Pattern.Regex == nil {
			return unsupported("pre_tokenizer", "Split with a String pattern")
		}
		sc, ok := scanners[*c.Pattern.Regex]
		if !ok {
			return unsupported("pre_tokenizer", fmt.Sprintf("Split pattern %q", *c.Pattern.Regex))
		}
		if c.Behavior != "Isolated" || c.Invert {
			return unsupported("pre_tokenizer", fmt.Sprintf("Split behavior %s (invert %v)", c.Behavior, c.Invert))
		}
		t.split = sc
		return nil
	case "ByteLevel":
		if t.hasByteLevel {
			return unsupported("pre_tokenizer", "two ByteLevel")
		}
		t.hasByteLevel = true
		t.prefix = c.AddPrefixSpace == nil || *c.AddPrefixSpace
		t.regex = c.UseRegex == nil || *c.UseRegex
		return nil
	}
	return unsupported("pre_tokenizer", c.Type)
}

func (t *Tokenizer) parsePost(raw json.RawMessage, depth int) error {
	if isNull(raw) {
		return nil
	}
	var c component
	if err := json.Unmarshal(raw, &c); err != nil {
		return fmt.Errorf("post_processor: %w", err)
	}
	switch c.Type {
	case "ByteLevel":
		return nil // offsets only
	case "Sequence":
		if depth > 0 {
			return unsupported("post_processor", "nested Sequence")
		}
		for _, p := range c.Processors {
			if err := t.parsePost(p, depth+1); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		if t.pre != nil || t.suf != nil {
			return unsupported("post_processor", "two TemplateProcessing")
		}
		seq := false
		t.pre, t.suf = []uint32{}, []uint32{}
		for _, it := range c.Single {
			switch {
			case it.Sequence != nil && it.Sequence.ID == "A" && !seq:
				seq = true
			case it.SpecialToken != nil:
				st, ok := c.SpecialTokens[it.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("post_processor: TemplateProcessing special token %q not defined", it.SpecialToken.ID)
				}
				if seq {
					t.suf = append(t.suf, st.IDs...)
				} else {
					t.pre = append(t.pre, st.IDs...)
				}
			default:
				return unsupported("post_processor", "TemplateProcessing single template other than special tokens around $A")
			}
		}
		if !seq {
			return unsupported("post_processor", "TemplateProcessing single template without $A")
		}
		return nil
	}
	return unsupported("post_processor", c.Type)
}

func (t *Tokenizer) parseAdded(toks []addedJSON) error {
	for _, a := range toks {
		if a.SingleWord {
			return unsupported("added_tokens", fmt.Sprintf("%q with single_word", a.Content))
		}
		if a.Content == "" {
			continue
		}
		at := addedToken{content: a.Content, id: a.ID, lstrip: a.LStrip, rstrip: a.RStrip}
		if a.Normalized {
			// HuggingFace matches these (special or not) in the
			// normalized text, by their normalized content.
			at.content = t.normalize(a.Content)
			t.normed.add(at)
		} else {
			t.raw.add(at)
		}
	}
	return nil
}

func (t *Tokenizer) normalize(s string) string {
	if t.nfc {
		return norm.NFC.String(s)
	}
	return s
}

// Encode returns the ids of text, with the post-processor's special tokens
// when addSpecial.
func (t *Tokenizer) Encode(text string, addSpecial bool) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/3+4), text, addSpecial)
}

// AppendEncode appends the ids of text to dst.
func (t *Tokenizer) AppendEncode(dst []uint32, text string, addSpecial bool) []uint32 {
	if addSpecial {
		dst = append(dst, t.pre...)
	}
	sc := scratchPool.Get().(*scratch)
	dst = t.appendBody(dst, text, sc)
	if cap(sc.ids) <= 1<<16 { // a huge word's buffers are not kept
		scratchPool.Put(sc)
	}
	if addSpecial {
		dst = append(dst, t.suf...)
	}
	return dst
}

// appendBody appends the ids of text without the post-processor's
// tokens: added tokens, normalizer, pre-tokenizer, model.
// The word cache is read under one read lock for the whole text; the
// words merged meanwhile are added after it.
func (t *Tokenizer) appendBody(dst []uint32, text string, sc *scratch) []uint32 {
	t.model.mu.RLock()
	dst = t.raw.each(dst, text, func(dst []uint32, piece string) []uint32 {
		return t.normed.each(dst, t.normalize(piece), func(dst []uint32, piece string) []uint32 {
			return t.preTokenize(dst, piece, sc)
		})
	})
	t.model.mu.RUnlock()
	t.model.flush(sc)
	return dst
}

// preTokenize splits one piece (between added tokens, normalized) into
// words and appends their BPE ids.
func (t *Tokenizer) preTokenize(dst []uint32, piece string, sc *scratch) []uint32 {
	if t.split == nil {
		return t.byteLevelWord(dst, piece, sc)
	}
	for i := 0; i < len(piece); {
		e := t.split(piece, i)
		dst = t.byteLevelWord(dst, piece[i:e], sc)
		i = e
	}
	return dst
}

// byteLevelWord is the ByteLevel step on one split: the prefix space, the
// GPT-2 split with use_regex, then the model.
func (t *Tokenizer) byteLevelWord(dst []uint32, s string, sc *scratch) []uint32 {
	if s == "" {
		return dst
	}
	if t.prefix && s[0] != ' ' {
		s = " " + s
	}
	if !t.regex {
		return t.model.appendWord(dst, s, sc)
	}
	for i := 0; i < len(s); {
		e := scanGPT2(s, i)
		dst = t.model.appendWord(dst, s[i:e], sc)
		i = e
	}
	return dst
}

// addedToken is an added_tokens entry as it is matched.
type addedToken struct {
	content        string
	id             uint32
	lstrip, rstrip bool
}

// matcher finds added tokens leftmost-longest (HuggingFace's Aho-Corasick
// match kind), indexed by first byte.
type matcher struct {
	byFirst *[256][]addedToken // longest first; nil: no tokens
}

func (m *matcher) add(a addedToken) {
	if m.byFirst == nil {
		m.byFirst = new([256][]addedToken)
	}
	l := m.byFirst[a.content[0]]
	for _, o := range l {
		if o.content == a.content {
			return // the first definition wins
		}
	}
	i := len(l)
	for i > 0 && len(l[i-1].content) < len(a.content) {
		i--
	}
	l = append(l, addedToken{})
	copy(l[i+1:], l[i:])
	l[i] = a
	m.byFirst[a.content[0]] = l
}

// each appends the ids of the added tokens in s and, through f, of the
// text between them. An lstrip (rstrip) token takes the whitespace before
// (after) it, as HuggingFace's AddedVocabulary does.
func (m *matcher) each(dst []uint32, s string, f func([]uint32, string) []uint32) []uint32 {
	if m.byFirst == nil {
		return f(dst, s)
	}
	last := 0 // end of the previous match, with its rstrip
	for i := 0; i < len(s); {
		a, ok := m.at(s, i)
		if !ok {
			i++
			continue
		}
		start, stop := i, i+len(a.content)
		i = stop
		if a.lstrip {
			start = max(len(strings.TrimRightFunc(s[:start], isSpace)), last)
		}
		if a.rstrip {
			stop = len(s) - len(strings.TrimLeftFunc(s[stop:], isSpace))
		}
		if last < start {
			dst = f(dst, s[last:start])
		}
		dst = append(dst, a.id)
		last = max(last, stop)
	}
	if last < len(s) {
		dst = f(dst, s[last:])
	}
	return dst
}

func (m *matcher) at(s string, i int) (addedToken, bool) {
	for _, a := range m.byFirst[s[i]] {
		if strings.HasPrefix(s[i:], a.content) {
			return a, true
		}
	}
	return addedToken{}, false
}
