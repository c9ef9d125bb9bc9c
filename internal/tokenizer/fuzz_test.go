package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// The reference below implements the same rules the slow, obvious way:
// the split patterns as Go regexps (leftmost-first alternation, as the
// backtracking engines choose) with the (?!\S) lookahead done by hand, and
// BPE as repeated merges of the lowest-ranked adjacent pair of GPT-2 rune
// strings. FuzzEncode checks the fast path against it.

const ws = `\t\n\v\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`

var (
	refGPT2   = regexp.MustCompile(`^(?:'s|'t|'re|'ve|'m|'ll|'d| ?\pL+| ?\pN+| ?[^` + ws + `\pL\pN]+)`)
	refLlama3 = regexp.MustCompile(`^(?:(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\pL\pN]?\pL+|\pN{1,3}| ?[^` + ws + `\pL\pN]+[\r\n]*|[` + ws + `]*[\r\n]+)`)
	refQwen2  = regexp.MustCompile(`^(?:(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\pL\pN]?\pL+|\pN| ?[^` + ws + `\pL\pN]+[\r\n]*|[` + ws + `]*[\r\n]+)`)
	refSpaces = regexp.MustCompile(`^[` + ws + `]+`)
)

// refSplit splits s with re followed by \s+(?!\S)|\s+.
func refSplit(re *regexp.Regexp, s string) []string {
	var out []string
	for s != "" {
		m := re.FindString(s)
		if m == "" {
			m = refSpaces.FindString(s)
			if m == "" {
				panic("no alternative matches " + s)
			}
			if len(m) < len(s) { // followed by \S: (?!\S) backtracks one rune
				if _, w := utf8.DecodeLastRuneInString(m); len(m) > w {
					m = m[:len(m)-w]
				}
			}
		}
		out = append(out, m)
		s = s[len(m):]
	}
	return out
}

type refModel struct {
	t            *Tokenizer
	split        *regexp.Regexp // nil: none
	vocab        map[string]uint32
	ranks        map[[2]string]int
	ignoreMerges bool
}

func newRef(t testing.TB, path string) *refModel {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := Parse(b)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		PreTokenizer struct {
			Pretokenizers []struct {
				Pattern struct{ Regex string }
			}
		} `json:"pre_tokenizer"`
		Model bpeJSON
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	r := &refModel{t: tok, vocab: f.Model.Vocab, ranks: map[[2]string]int{}, ignoreMerges: f.Model.IgnoreMerges}
	for i, m := range f.Model.Merges {
		if _, ok := r.ranks[m]; !ok {
			r.ranks[m] = i
		}
	}
	if ps := f.PreTokenizer.Pretokenizers; len(ps) > 0 {
		r.split = map[string]*regexp.Regexp{patternLlama3: refLlama3, patternQwen2: refQwen2, patternGPT2: refGPT2}[ps[0].Pattern.Regex]
	}
	return r
}

func (r *refModel) encode(text string, add bool) []uint32 {
	var ids []uint32
	if add {
		ids = append(ids, r.t.pre...)
	}
	ids = r.t.raw.each(ids, text, func(dst []uint32, piece string) []uint32 {
		return r.t.normed.each(dst, r.t.normalize(piece), func(dst []uint32, piece string) []uint32 {
			words := []string{piece}
			if r.split != nil {
				words = refSplit(r.split, piece)
			}
			for _, w := range words {
				if r.t.prefix && !strings.HasPrefix(w, " ") {
					w = " " + w
				}
				sub := []string{w}
				if r.t.regex {
					sub = refSplit(refGPT2, w)
				}
				for _, s := range sub {
					dst = append(dst, r.bpe(s)...)
				}
			}
			return dst
		})
	})
	if add {
		ids = append(ids, r.t.suf...)
	}
	return ids
}

func (r *refModel) bpe(word string) []uint32 {
	if word == "" {
		return nil
	}
	var mapped strings.Builder
	var syms []string
	for i := 0; i < len(word); i++ {
		syms = append(syms, string(byteRunes[word[i]]))
		mapped.WriteRune(byteRunes[word[i]])
	}
	if id, ok := r.vocab[mapped.String()]; ok && r.ignoreMerges {
		return []uint32{id}
	}
	for {
		best, at := -1, -1
		for i := 0; i+1 < len(syms); i++ {
			if rk, ok := r.ranks[[2]string{syms[i], syms[i+1]}]; ok && (best < 0 || rk < best) {
				best, at = rk, i
			}
		}
		if at < 0 {
			break
		}
		syms = slices.Replace(syms, at, at+2, syms[at]+syms[at+1])
	}
	var ids []uint32
	for _, s := range syms {
		if id, ok := r.vocab[s]; ok {
			ids = append(ids, id)
		}
	}
	return ids
}

var fuzzTokenizers = []string{"tiny-llama.json", "llama3ish.json", "qwen2ish.json"}

// TestReferenceAgreesWithVectors keeps the reference honest: it too gives
// HuggingFace's ids for every vector.
func TestReferenceAgreesWithVectors(t *testing.T) {
	vecs := loadVectors(t)
	for _, name := range fuzzTokenizers {
		r := newRef(t, filepath.Join("testdata", name))
		for _, c := range vecs[name] {
			if got := r.encode(c.Text, c.AddSpecial); !slices.Equal(got, c.IDs) {
				t.Errorf("%s: reference(%q) = %v, want %v", name, c.Text, got, c.IDs)
			}
		}
	}
}

func FuzzEncode(f *testing.F) {
	for _, cases := range loadVectors(f) {
		for i, c := range cases {
			if i%4 == 0 {
				f.Add(c.Text)
			}
		}
	}
	var toks []*Tokenizer
	var refs []*refModel
	for _, name := range fuzzTokenizers {
		tok, err := Load(filepath.Join("testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		toks = append(toks, tok)
		refs = append(refs, newRef(f, filepath.Join("testdata", name)))
	}
	f.Fuzz(func(t *testing.T, text string) {
		if !utf8.ValidString(text) {
			return // prompts reach the tokenizer decoded from JSON: valid UTF-8
		}
		for i, tok := range toks {
			if got, want := tok.Encode(text, true), refs[i].encode(text, true); !slices.Equal(got, want) {
				t.Errorf("%s: Encode(%q) = %v, reference %v", fuzzTokenizers[i], text, got, want)
			}
		}
	})
}
