package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

// trickyWords are pieces that stress the cut points' conditions: words
// around which a cut may fall, contractions, combining marks (NFC), added
// tokens of the test tokenizers (lstrip/rstrip, normalized), runs of
// spaces and newlines, digits, CJK, emoji, punctuation glued to letters.
var trickyWords = strings.Fields("the router a b x y I it It's we'll DON'T 'S 're 'Ve " +
	"cafe\u0301 e\u0301 \u0301 naïve Å A\u030a 123 4567 3.14 1,000 東京 中文 😀 👍🏽 " +
	"<|eot_id|> <|begin_of_text|> <|im_start|> <mark> [tool] <réf> <s> </s> <pad> " +
	"(see below): caching, routing; latency! a-b x_y $100 €200 {\"k\": [1]}")

// trickyText is n random pieces joined by single spaces mostly, and at
// times by runs of spaces, tabs or newlines or by nothing.
func trickyText(r *rand.Rand, n int) string {
	var b strings.Builder
	seps := []string{" ", " ", " ", " ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "", "   "}
	for i := range n {
		if i > 0 {
			b.WriteString(seps[r.IntN(len(seps))])
		}
		b.WriteString(trickyWords[r.IntN(len(trickyWords))])
	}
	return b.String()
}

// TestPrefixCacheMatchesEncode is the differential test: conversations
// whose every turn resends the history, groups sharing a system prompt,
// and texts diverging just after a cut point, through a PrefixCache and
// through Encode, with and without special tokens, on every test
// tokenizer. The cache must reuse prefixes (or the test proves nothing)
// and give Encode's ids every time.
func TestPrefixCacheMatchesEncode(t *testing.T) {
	for _, name := range fuzzTokenizers {
		t.Run(name, func(t *testing.T) {
			tok, err := Load(filepath.Join("testdata", name))
			if err != nil {
				t.Fatal(err)
			}
			if !tok.cuttable() {
				t.Fatalf("%s not cuttable: the test exercises nothing", name)
			}
			pc := NewPrefixCache(tok, 4<<20)
			r := rand.New(rand.NewPCG(1, uint64(len(name))))
			check := func(text string) {
				t.Helper()
				for _, add := range []bool{true, false} {
					if got, want := pc.Encode(text, add), tok.Encode(text, add); !slices.Equal(got, want) {
						i := 0
						for i < min(len(got), len(want)) && got[i] == want[i] {
							i++
						}
						t.Fatalf("add %v, %d bytes: ids differ from Encode's at %d of %d/%d", add, len(text), i, len(got), len(want))
					}
				}
			}
			for g := range 6 {
				system := trickyText(r, 300+g*50)
				for range 3 {
					history := system
					for range 4 {
						prompt := history + " " + trickyText(r, 40)
						check(prompt)
						history = prompt + " " + trickyText(r, 10)
					}
				}
			}
			// Diverging at and just after every cut point of a text.
			base := trickyText(r, 800)
			for _, p := range appendCuts(nil, base) {
				for _, tail := range []string{"", " ", "x", "'re", "\u0301", " <mark>", "<|eot_id|>", "\n", "  z"} {
					check(base[:p] + tail)
					check(base[:p+1] + tail)
					check(base[:p+2] + tail)
				}
			}
			st := pc.Stats()
			if st.Hits == 0 || st.ReusedBytes < st.TotalBytes/2 {
				t.Errorf("stats %+v: the cache reused too little to test anything", st)
			}
		})
	}
}

// TestPrefixCacheEviction: a cache smaller than its texts stays within
// its bound, counts evictions, and stays exact.
func TestPrefixCacheEviction(t *testing.T) {
	tok, err := Load("testdata/tiny-llama.json")
	if err != nil {
		t.Fatal(err)
	}
	pc := NewPrefixCache(tok, 200<<10)
	r := rand.New(rand.NewPCG(3, 4))
	history := trickyText(r, 400)
	for range 40 {
		history += " " + trickyText(r, 60)
		if got, want := pc.Encode(history, true), tok.Encode(history, true); !slices.Equal(got, want) {
			t.Fatalf("%d bytes: ids differ from Encode's", len(history))
		}
		pc.mu.Lock()
		bytes, entries := pc.bytes, len(pc.q)-pc.head
		pc.mu.Unlock()
		if bytes > 200<<10 {
			t.Fatalf("cache holds %d bytes, bound %d", bytes, 200<<10)
		}
		if entries == 0 && len(history)*5 < 200<<10 {
			t.Fatalf("a %d-byte text was not kept", len(history))
		}
	}
	if st := pc.Stats(); st.Evicted == 0 || st.Hits == 0 {
		t.Errorf("stats %+v: want evictions and hits", st)
	}
}

// TestPrefixCacheUncuttable: a tokenizer with an added token holding a
// space (a match could span a cut) is encoded whole, and exactly.
func TestPrefixCacheUncuttable(t *testing.T) {
	b, err := os.ReadFile("testdata/tiny-llama.json")
	if err != nil {
		t.Fatal(err)
	}
	s := strings.Replace(string(b), `"content": "<pad>"`, `"content": "d y"`, 1)
	if s == string(b) {
		t.Fatal("test tokenizer has no <pad> added token to rewrite")
	}
	tok, err := Parse([]byte(s))
	if err != nil {
		t.Fatal(err)
	}
	if tok.cuttable() {
		t.Fatal("an added token with a space: cuttable")
	}
	pc := NewPrefixCache(tok, 0)
	r := rand.New(rand.NewPCG(5, 6))
	text := trickyText(r, 600)
	for _, p := range []string{text, text + " and d y more", text + " and d y more words"} {
		if got, want := pc.Encode(p, true), tok.Encode(p, true); !slices.Equal(got, want) {
			t.Fatalf("ids differ from Encode's")
		}
	}
	if st := pc.Stats(); st.Hits != 0 || st.Encodes != 0 {
		t.Errorf("stats %+v: an uncuttable tokenizer went through the cache", st)
	}
	// A space-free rstrip token ending in a letter is refused too.
	s = strings.Replace(string(b), `"content": "<pad>",
      "single_word": false,
      "lstrip": false,
      "rstrip": false`, `"content": "<pad",
      "single_word": false,
      "lstrip": false,
      "rstrip": true`, 1)
	if s == string(b) {
		t.Fatal("test tokenizer's <pad> entry not in the expected layout")
	}
	if tok, err := Parse([]byte(s)); err != nil {
		t.Fatal(err)
	} else if tok.cuttable() {
		t.Error("an rstrip token ending in a letter: cuttable")
	}
}

// FuzzPrefixCache: a long text, then the text and more, then the text cut
// and continued otherwise, through one cache per tokenizer, against
// Encode.
func FuzzPrefixCache(f *testing.F) {
	r := rand.New(rand.NewPCG(7, 8))
	for range 8 {
		f.Add(trickyText(r, 40), trickyText(r, 8), uint16(r.IntN(2000)))
	}
	f.Add("hello world", " 're", uint16(256))
	f.Add("a b", "\u0301", uint16(257))
	var toks []*Tokenizer
	var caches []*PrefixCache
	for _, name := range fuzzTokenizers {
		tok, err := Load(filepath.Join("testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		toks = append(toks, tok)
		caches = append(caches, NewPrefixCache(tok, 1<<20))
	}
	f.Fuzz(func(t *testing.T, base, more string, cut uint16) {
		if !utf8.ValidString(base) || !utf8.ValidString(more) || base == "" {
			return
		}
		long := strings.Repeat(base+" ", 2048/len(base)+1)
		texts := []string{long, long + more}
		if c := int(cut) % len(long); utf8.RuneStart(long[c]) {
			texts = append(texts, long[:c]+more, long[:c]+more+long)
		}
		for i, tok := range toks {
			for _, text := range texts {
				for _, add := range []bool{true, false} {
					if got, want := caches[i].Encode(text, add), tok.Encode(text, add); !slices.Equal(got, want) {
						t.Fatalf("%s: %q (add %v): cached %v\nencode %v", fuzzTokenizers[i], text, add, got, want)
					}
				}
			}
		}
	})
}

func ExamplePrefixCache() {
	tok, err := Load("testdata/tiny-llama.json")
	if err != nil {
		fmt.Println(err)
		return
	}
	pc := NewPrefixCache(tok, 0)
	history := strings.Repeat("the router sends each request to the engine ", 40)
	first := pc.Encode(history+"What is cached?", true)
	second := pc.Encode(history+"What is cached? Most of it.", true)
	fmt.Println(slices.Equal(first, tok.Encode(history+"What is cached?", true)),
		slices.Equal(second, tok.Encode(history+"What is cached? Most of it.", true)), pc.Stats().Hits)
	// Output: true true 1
}
