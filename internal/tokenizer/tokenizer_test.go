package tokenizer

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

type vector struct {
	Text       string   `json:"text"`
	AddSpecial bool     `json:"add_special_tokens"`
	IDs        []uint32 `json:"ids"`
}

func loadVectors(t testing.TB) map[string][]vector {
	t.Helper()
	b, err := os.ReadFile("testdata/vectors.json")
	if err != nil {
		t.Fatal(err)
	}
	var v map[string][]vector
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestVectors checks every text of scripts/make-tokenizer-vectors.py
// against the ids HuggingFace tokenizers gave for it.
func TestVectors(t *testing.T) {
	vecs := loadVectors(t)
	for _, name := range []string{"tiny-llama.json", "llama3ish.json", "qwen2ish.json"} {
		t.Run(name, func(t *testing.T) {
			tok, err := Load(filepath.Join("testdata", name))
			if err != nil {
				t.Fatal(err)
			}
			cases := vecs[name]
			if len(cases) < 100 {
				t.Fatalf("%d vectors for %s", len(cases), name)
			}
			bad := 0
			for _, c := range cases {
				got := tok.Encode(c.Text, c.AddSpecial)
				if !slices.Equal(got, c.IDs) {
					bad++
					if bad <= 10 {
						t.Errorf("Encode(%q, %v)\n got %v\nwant %v", c.Text, c.AddSpecial, got, c.IDs)
					}
				}
			}
			if bad > 0 {
				t.Errorf("%d of %d vectors differ", bad, len(cases))
			}
		})
	}
}

// TestLoadDirectory: a model directory means its tokenizer.json.
func TestLoadDirectory(t *testing.T) {
	dir := t.TempDir()
	b, err := os.ReadFile("testdata/tiny-llama.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if tok.Path != filepath.Join(dir, "tokenizer.json") || len(tok.Encode("hello world", true)) == 0 {
		t.Errorf("path %s, ids %v", tok.Path, tok.Encode("hello world", true))
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("missing file: %v", err)
	}
}

// TestUnsupported: every component outside the exact subset is refused at
// load, naming it.
func TestUnsupported(t *testing.T) {
	base, err := os.ReadFile("testdata/qwen2ish.json")
	if err != nil {
		t.Fatal(err)
	}
	edit := func(f func(m map[string]any)) []byte {
		var m map[string]any
		if err := json.Unmarshal(base, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		b, _ := json.Marshal(m)
		return b
	}
	model := func(m map[string]any) map[string]any { return m["model"].(map[string]any) }
	for _, tc := range []struct {
		name, want string
		f          func(m map[string]any)
	}{
		{"WordPiece model", "model WordPiece", func(m map[string]any) { model(m)["type"] = "WordPiece" }},
		{"dropout", "dropout", func(m map[string]any) { model(m)["dropout"] = 0.1 }},
		{"suffix", "end_of_word_suffix", func(m map[string]any) { model(m)["end_of_word_suffix"] = "</w>" }},
		{"fuse_unk", "fuse_unk", func(m map[string]any) { model(m)["fuse_unk"] = true }},
		{"NFKC", "normalizer NFKC", func(m map[string]any) { m["normalizer"] = map[string]any{"type": "NFKC"} }},
		{"Lowercase in a Sequence", "normalizer Lowercase", func(m map[string]any) {
			m["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "NFC"}, map[string]any{"type": "Lowercase"}}}
		}},
		{"Metaspace", "pre_tokenizer Metaspace", func(m map[string]any) { m["pre_tokenizer"] = map[string]any{"type": "Metaspace"} }},
		{"no pre-tokenizer", "pre_tokenizer none", func(m map[string]any) { m["pre_tokenizer"] = nil }},
		{"other Split pattern", "Split pattern", func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["pattern"] = map[string]any{"Regex": `\s+`}
		}},
		{"Split Removed", "Split behavior Removed", func(m map[string]any) {
			m["pre_tokenizer"].(map[string]any)["pretokenizers"].([]any)[0].(map[string]any)["behavior"] = "Removed"
		}},
		{"Split only", "without ByteLevel", func(m map[string]any) {
			p := m["pre_tokenizer"].(map[string]any)
			p["pretokenizers"] = p["pretokenizers"].([]any)[:1]
		}},
		{"Bert post-processor", "post_processor BertProcessing", func(m map[string]any) { m["post_processor"] = map[string]any{"type": "BertProcessing"} }},
		{"truncation", "truncation", func(m map[string]any) { m["truncation"] = map[string]any{"max_length": 8} }},
		{"single_word", "single_word", func(m map[string]any) {
			m["added_tokens"].([]any)[3].(map[string]any)["single_word"] = true
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse(edit(tc.f))
			if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want ErrUnsupported naming %q", err, tc.want)
			}
		})
	}
	if _, err := Parse([]byte(`{"model":`)); err == nil {
		t.Error("truncated JSON accepted")
	}
}
