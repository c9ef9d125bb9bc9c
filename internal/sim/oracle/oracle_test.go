package oracle

import (
	"slices"
	"strings"
	"testing"
)

func TestTokenizeRoundTrip(t *testing.T) {
	text := "  hello\tworld \n foo  "
	ids := Tokenize(text)
	if len(ids) != 3 || CountTokens(text) != 3 {
		t.Fatalf("Tokenize(%q) = %v", text, ids)
	}
	seen := map[uint32]string{ids[0]: "hello", ids[1]: "world", ids[2]: "foo"}
	got := Detokenize(ids, func(id uint32) (string, bool) { s, ok := seen[id]; return s, ok })
	if got != "hello world foo" {
		t.Errorf("Detokenize = %q", got)
	}
	gen := Text(123, 4, 10)
	if d := Detokenize(Tokenize(gen), nil); " "+d != gen {
		t.Errorf("generated text does not round-trip: %q vs %q", d, gen)
	}
	if Tokenize(gen)[0] != NextToken(123, 4) {
		t.Error("generated words must map back to their ids")
	}
}

func TestGenerationDependsOnDigestSeedIndex(t *testing.T) {
	a := DigestText("the quick brown fox")
	b := DigestText("the quick brown fax")
	if a == b {
		t.Fatal("digest collision on a one-word change")
	}
	if Text(a, 0, 20) != Text(a, 0, 20) {
		t.Error("not deterministic")
	}
	if ga, gb := Generate(a, 0, 2), Generate(b, 0, 2); ga[0] == gb[0] && ga[1] == gb[1] {
		t.Error("first tokens do not depend on the digest")
	}
	if Text(a, 0, 20) == Text(a, 1, 20) {
		t.Error("seed has no effect")
	}
	var b2 strings.Builder
	s := NewSeq(a, 0, false)
	for i := range 20 {
		b2.WriteString(Piece(s.At(i)))
	}
	if b2.String() != Text(a, 0, 20) {
		t.Error("Text is not the concatenation of pieces")
	}
	if e := NewSeq(a, 0, true); Piece(EOS) != "" || e.At(0) != EOS || e.At(1) == EOS {
		t.Error("EOS handling")
	}
}

func TestFirstIsEOSProbability(t *testing.T) {
	hits := 0
	for i := range 10000 {
		if FirstIsEOS(uint64(i)*0x9e3779b97f4a7c15, 0, 0.3) {
			hits++
		}
	}
	if hits < 2700 || hits > 3300 {
		t.Errorf("p=0.3 gave %d/10000", hits)
	}
	if FirstIsEOS(1, 0, 0) || !FirstIsEOS(1, 0, 1) {
		t.Error("bounds")
	}
}

func TestChatPrompt(t *testing.T) {
	p := ChatPrompt([]Message{{Role: "user", Content: "hi"}})
	if p != "<|user|> hi\n<|assistant|>" || len(Tokenize(p)) != 3 {
		t.Errorf("ChatPrompt = %q", p)
	}
}

// TestContinuationIsExact is the language-model property migration relies
// on: the prompt plus the first k generated tokens, as a new prompt (ids or
// re-tokenized text), generates exactly the rest of the uninterrupted run.
func TestContinuationIsExact(t *testing.T) {
	prompt := "the quick brown fox jumps"
	const n = 40
	full := Generate(DigestText(prompt), 7, n)
	for _, k := range []int{0, 1, 5, 39} {
		ctx := append(Tokenize(prompt), full[:k]...)
		if got := Generate(Digest(ctx), 7, n-k); !slices.Equal(got, full[k:]) {
			t.Errorf("k=%d: ids continuation differs", k)
		}
		text := prompt + Text(DigestText(prompt), 7, k)
		if got := Text(DigestText(text), 7, n-k); prompt+Text(DigestText(prompt), 7, n) != text+got {
			t.Errorf("k=%d: text continuation differs", k)
		}
	}
	// a token depends on the whole context, not on its index
	if Generate(DigestText("a b"), 0, 3)[2] == Generate(DigestText("a c"), 0, 3)[2] &&
		Generate(DigestText("a b"), 0, 3)[1] == Generate(DigestText("a c"), 0, 3)[1] {
		t.Error("tokens do not depend on the context")
	}
}

func TestChatPromptContinue(t *testing.T) {
	msgs := []Message{{Role: "user", Content: "hi"}}
	gen := Text(DigestText(ChatPrompt(msgs)), 0, 6)
	cont := ChatPromptContinue(append(msgs, Message{Role: "assistant", Content: gen[:len(gen)/2]}))
	want := append(Tokenize(ChatPrompt(msgs)), Tokenize(gen[:len(gen)/2])...)
	if !slices.Equal(Tokenize(cont), want) {
		t.Errorf("ChatPromptContinue tokens %v, want %v", Tokenize(cont), want)
	}
}
