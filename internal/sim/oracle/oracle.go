// Package oracle is vllm-sim's deterministic "model": a cheap tokenizer, the
// prompt digest that stands in for the KV cache, and the generation function.
//
// The generated text is a pure function of (prompt digest, seed, token index).
// In PD mode the digest is computed by the prefill worker and travels over the
// simulated KV side channel; the decode worker generates from the digest it
// actually received. A router that mispairs legs, loses a transfer or alters
// the prompt therefore changes the decode output compared with a unified
// worker, and tests can compute the expected text with this package alone.
//
// Tokenizer: the text is split on Unicode white space (strings.Fields); each
// piece is one token. Words of the generation vocabulary map to ids
// [0, VocabSize); EOS is VocabSize; any other word maps to a stable hashed id
// above EOS. Generated pieces are " "+word, so a completion's text is the
// concatenation of its per-token pieces and re-tokenizes to the same ids.
package oracle

import (
	"encoding/binary"
	"math"
	"strings"
	"unicode"

	"github.com/cespare/xxhash/v2"
)

// VocabSize is the number of words the generator can produce.
const VocabSize = 4096

// EOS is the id of the end-of-sequence token. Its text is empty.
const EOS uint32 = VocabSize

var syllables = [16]string{
	"ka", "lo", "mi", "nu", "pe", "ra", "si", "to",
	"vu", "ze", "ba", "do", "fi", "gu", "he", "jo",
}

// vocab and vocabIndex are computed once and never modified.
var vocab, vocabIndex = buildVocab()

func buildVocab() ([VocabSize]string, map[string]uint32) {
	var v [VocabSize]string
	idx := make(map[string]uint32, VocabSize)
	for i := range VocabSize {
		w := syllables[i&15] + syllables[(i>>4)&15] + syllables[(i>>8)&15]
		v[i] = w
		idx[w] = uint32(i)
	}
	return v, idx
}

// Word returns the vocabulary word for id, "" for EOS and for ids outside
// the vocabulary.
func Word(id uint32) string {
	if id < VocabSize {
		return vocab[id]
	}
	return ""
}

// Piece returns the text a generated token adds to the output: " "+word, or
// "" for EOS.
func Piece(id uint32) string {
	if id < VocabSize {
		return " " + vocab[id]
	}
	return ""
}

// TokenID returns the id of one white-space-free word.
func TokenID(word string) uint32 {
	if id, ok := vocabIndex[word]; ok {
		return id
	}
	const base = uint64(EOS) + 1
	return uint32(base + xxhash.Sum64String(word)%(math.MaxInt32-base))
}

// Tokenize splits text on white space and maps every piece to its id.
func Tokenize(text string) []uint32 {
	fields := strings.Fields(text)
	ids := make([]uint32, len(fields))
	for i, f := range fields {
		ids[i] = TokenID(f)
	}
	return ids
}

// CountTokens returns len(Tokenize(text)) without allocating the ids.
func CountTokens(text string) int {
	n := 0
	inField := false
	for _, r := range text {
		if unicode.IsSpace(r) {
			inField = false
		} else if !inField {
			inField = true
			n++
		}
	}
	return n
}

// Detokenize turns ids back into text. Vocabulary ids become their word;
// EOS is dropped; other ids are looked up with lookup (may be nil) and
// otherwise rendered as "<id:N>". Words are joined with single spaces.
func Detokenize(ids []uint32, lookup func(uint32) (string, bool)) string {
	var b strings.Builder
	for _, id := range ids {
		var w string
		switch {
		case id < VocabSize:
			w = vocab[id]
		case id == EOS:
			continue
		default:
			if lookup != nil {
				if s, ok := lookup(id); ok {
					w = s
				}
			}
			if w == "" {
				w = "<id:" + uitoa(uint64(id)) + ">"
			}
		}
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w)
	}
	return b.String()
}

func uitoa(v uint64) string {
	var buf [20]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			return string(buf[i:])
		}
	}
}

// Digest is the stand-in for a prompt's KV cache: an xxhash64 over the
// prompt token ids (4 bytes little-endian each).
func Digest(ids []uint32) uint64 {
	d := xxhash.New()
	var buf [4]byte
	for _, id := range ids {
		binary.LittleEndian.PutUint32(buf[:], id)
		_, _ = d.Write(buf[:])
	}
	return d.Sum64()
}

// DigestText is Digest(Tokenize(text)).
func DigestText(text string) uint64 { return Digest(Tokenize(text)) }

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// NextToken returns the id generated at position i (0 = first token) for a
// prompt with the given digest and sampling seed. It is always a vocabulary
// word; EOS is decided separately by FirstIsEOS.
func NextToken(digest uint64, seed int64, i int) uint32 {
	h := splitmix64(digest ^ splitmix64(uint64(seed)^splitmix64(uint64(i)+0x5851f42d4c957f2d)))
	return uint32(h % VocabSize)
}

// FirstIsEOS reports whether the first generated token is EOS, which happens
// with probability p (deterministically per digest and seed). It only
// matters when the request does not set ignore_eos and min_tokens is 0.
func FirstIsEOS(digest uint64, seed int64, p float64) bool {
	if p <= 0 {
		return false
	}
	if p >= 1 {
		return true
	}
	h := splitmix64(digest ^ splitmix64(uint64(seed)^0x2545f4914f6cdd1d))
	return float64(h>>11)/float64(1<<53) < p
}

// Token returns the id at position i, EOS included: EOS at position 0 when
// eos is true, NextToken otherwise.
func Token(digest uint64, seed int64, i int, eos bool) uint32 {
	if i == 0 && eos {
		return EOS
	}
	return NextToken(digest, seed, i)
}

// Text returns the concatenated pieces of tokens [0, n) without EOS
// handling: the text a worker streams for n tokens when ignore_eos is set
// (or the EOS probability is 0).
func Text(digest uint64, seed int64, n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(Piece(NextToken(digest, seed, i)))
	}
	return b.String()
}

// Message is one chat message after content flattening.
type Message struct {
	Role    string
	Content string
}

// ChatPrompt renders messages with the simulator's chat template: for each
// message "<|role|> content", then "<|assistant|>", joined by newlines. The
// role markers are tokens, so they count in usage.prompt_tokens as a real
// chat template's special tokens do.
func ChatPrompt(msgs []Message) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|> ")
		b.WriteString(m.Content)
		b.WriteByte('\n')
	}
	b.WriteString("<|assistant|>")
	return b.String()
}
