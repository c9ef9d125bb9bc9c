package oracle

import (
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
	if Tokenize(gen)[0] != NextToken(123, 4, 0) {
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
	if NextToken(a, 0, 0) == NextToken(b, 0, 0) && NextToken(a, 0, 1) == NextToken(b, 0, 1) {
		t.Error("first tokens do not depend on the digest")
	}
	if Text(a, 0, 20) == Text(a, 1, 20) {
		t.Error("seed has no effect")
	}
	var b2 strings.Builder
	for i := range 20 {
		b2.WriteString(Piece(NextToken(a, 0, i)))
	}
	if b2.String() != Text(a, 0, 20) {
		t.Error("Text is not the concatenation of pieces")
	}
	if Piece(EOS) != "" || Token(a, 0, 0, true) != EOS || Token(a, 0, 1, true) == EOS {
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
