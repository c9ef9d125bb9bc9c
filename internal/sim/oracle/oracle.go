// Package oracle is vllm-sim's deterministic "model": a cheap tokenizer, the
// prompt digest that stands in for the KV cache, and the generation function.
//
// Generation works like a language model's: each next token is a pure
// function of the whole token context so far (prompt and generated tokens,
// through a chained digest) and the seed, so a continuation request whose
// prompt is the original prompt plus a partial answer generates exactly the
// rest of the uninterrupted answer. In PD mode the digest is computed by the prefill worker and travels over the
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
	"math"
	"strings"
	"sync"
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

// Digest is the stand-in for a token context's KV cache: a hash chained
// over the ids (Extend from DigestSeed), so the digest of a prompt followed
// by generated tokens is the state the generator reached after producing
// them. That is what makes a continuation exact: a request whose prompt is
// the original prompt plus the tokens generated so far continues with the
// very tokens the uninterrupted run would have produced.
func Digest(ids []uint32) uint64 {
	d := DigestSeed
	for _, id := range ids {
		d = Extend(d, id)
	}
	return d
}

// DigestSeed is the digest of the empty context.
const DigestSeed uint64 = 0x6a09e667f3bcc908

// Extend returns the digest of the context d followed by token id.
func Extend(d uint64, id uint32) uint64 {
	return splitmix64(d ^ splitmix64(uint64(id)+0x243f6a8885a308d3))
}

// DigestText is Digest(Tokenize(text)).
func DigestText(text string) uint64 { return Digest(Tokenize(text)) }

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// NextToken returns the id the model generates after the context whose
// digest is ctx, for a sampling seed: like a language model's greedy (or
// seeded) step, a function of the whole context so far. It is always a
// vocabulary word; EOS is decided separately by FirstIsEOS.
func NextToken(ctx uint64, seed int64) uint32 {
	h := splitmix64(ctx ^ splitmix64(uint64(seed)^0x5851f42d4c957f2d))
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

// Seq is one request's generated tokens, computed on demand: token i is
// NextToken of the prompt digest extended by tokens [0, i). When firstEOS
// is set, token 0 is EOS. Safe for concurrent use.
type Seq struct {
	mu       sync.Mutex
	seed     int64
	firstEOS bool
	ctx      uint64   // digest of the prompt + ids
	ids      []uint32 // generated so far
}

// NewSeq starts the generation after a prompt with the given digest.
func NewSeq(digest uint64, seed int64, firstEOS bool) *Seq {
	return &Seq{seed: seed, firstEOS: firstEOS, ctx: digest}
}

// At returns generated token i (0 = first).
func (s *Seq) At(i int) uint32 {
	if i == 0 && s.firstEOS {
		return EOS
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for len(s.ids) <= i {
		id := NextToken(s.ctx, s.seed)
		s.ids = append(s.ids, id)
		s.ctx = Extend(s.ctx, id)
	}
	return s.ids[i]
}

// Generate returns the first n tokens generated after a prompt with the
// given digest (no EOS).
func Generate(digest uint64, seed int64, n int) []uint32 {
	ids := make([]uint32, n)
	for i := range n {
		ids[i] = NextToken(digest, seed)
		digest = Extend(digest, ids[i])
	}
	return ids
}

// Text returns the concatenated pieces of tokens [0, n) without EOS
// handling: the text a worker streams for n tokens when ignore_eos is set
// (or the EOS probability is 0).
func Text(digest uint64, seed int64, n int) string {
	var b strings.Builder
	for _, id := range Generate(digest, seed, n) {
		b.WriteString(Piece(id))
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

// ChatPromptContinue renders messages as vLLM does with
// continue_final_message=true and add_generation_prompt=false: the last
// message (an assistant's partial answer) is left open, without the
// newline that ends a turn and without a new "<|assistant|>" marker, so the
// model continues it. Its tokens are those of ChatPrompt(msgs[:len-1])
// followed by the partial answer's.
func ChatPromptContinue(msgs []Message) string {
	var b strings.Builder
	for i, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|> ")
		b.WriteString(m.Content)
		if i < len(msgs)-1 {
			b.WriteByte('\n')
		}
	}
	return b.String()
}
