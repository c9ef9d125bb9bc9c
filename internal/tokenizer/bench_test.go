package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// benchWords is an n-word prompt of English-like text with punctuation,
// digits and newlines, distinct for each seed.
func benchWords(n int, seed uint64) string {
	vocab := strings.Fields("the router sends each request to the engine whose prefix cache already holds most of " +
		"its prompt blended with load tokens blocks events index worker prefill decode system user assistant " +
		"It's we'll don't 2026 3.14 1,000 (see below): caching, routing; latency! throughput? 東京 café 😀")
	r := rand.New(rand.NewPCG(seed, 7))
	var b strings.Builder
	for i := range n {
		if i > 0 {
			if r.IntN(20) == 0 {
				b.WriteString("\n")
			} else {
				b.WriteString(" ")
			}
		}
		b.WriteString(vocab[r.IntN(len(vocab))])
	}
	return b.String()
}

// BenchmarkEncode: a new 1k-word (and 8k-word) prompt each iteration, the
// per-word cache warm as it is on a running router; and cold (a freshly
// loaded tokenizer per prompt).
func BenchmarkEncode(b *testing.B) {
	for _, name := range []string{"tiny-llama.json", "llama3ish.json"} {
		for _, words := range []int{1000, 8000} {
			tok, err := Load("testdata/" + name)
			if err != nil {
				b.Fatal(err)
			}
			prompts := make([]string, 64)
			for i := range prompts {
				prompts[i] = benchWords(words, uint64(i))
			}
			b.Run(fmt.Sprintf("%s/%dwords/warm", name, words), func(b *testing.B) {
				b.ReportAllocs()
				n := 0
				for i := 0; b.Loop(); i++ {
					n = len(tok.Encode(prompts[i%len(prompts)], true))
				}
				b.ReportMetric(float64(n), "tokens")
			})
			b.Run(fmt.Sprintf("%s/%dwords/cold", name, words), func(b *testing.B) {
				for i := 0; b.Loop(); i++ {
					b.StopTimer()
					tok, _ := Load("testdata/" + name)
					b.StartTimer()
					tok.Encode(prompts[i%len(prompts)], true)
				}
			})
		}
	}
}
