package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// Prompts and tokens
//
// sybench has no tokenizer. The simulated worker (cmd/vllm-sim) counts
// tokens by splitting on whitespace, so a prompt of n tokens is n words from
// a fixed vocabulary joined by single spaces: strings.Fields(prompt) has
// exactly n elements, and the same text counted by the simulator gives the
// sampled length. Words are two pronounceable lowercase ASCII syllables
// ("bako", "tumi", ...); the vocabulary has vocabSize entries and needs no
// JSON escaping. Against a real vLLM server the counts differ (BPE tokens),
// but the server's usage.prompt_tokens still overrides the recorded prompt
// length, exactly as in vllm bench serve.

const (
	consonants = "bdfghjklmnprstvwz" // 17
	vowels     = "aeiou"             // 5
	syllables  = len(consonants) * len(vowels)
	vocabSize  = syllables * syllables // 7225 words
)

// word returns vocabulary word k (0 <= k < vocabSize) appended to dst.
func appendWord(dst []byte, k int) []byte {
	a, b := k/syllables, k%syllables
	return append(dst,
		consonants[a/len(vowels)], vowels[a%len(vowels)],
		consonants[b/len(vowels)], vowels[b%len(vowels)])
}

// wordLen is the byte length of every vocabulary word.
const wordLen = 4

// Sample is one request of the dataset: its lengths and how to build its
// prompt deterministically.
type Sample struct {
	Index     int // position in the run; the x-request-id suffix
	PromptLen int // tokens (whitespace words) in the prompt
	OutputLen int // max_tokens / max_completion_tokens
	prefix    []byte
	suffixLen int
	seed      uint64
}

// AppendPrompt appends the sample's prompt text to dst: the shared prefix
// words (if any) followed by the sample's own random words, separated by
// single spaces.
func (s Sample) AppendPrompt(dst []byte) []byte {
	dst = append(dst, s.prefix...)
	if s.suffixLen == 0 {
		return dst
	}
	if len(s.prefix) > 0 {
		dst = append(dst, ' ')
	}
	r := rand.New(rand.NewPCG(s.seed, 0x7061796c6f6164)) // "payload"
	for i := 0; i < s.suffixLen; i++ {
		if i > 0 {
			dst = append(dst, ' ')
		}
		dst = appendWord(dst, r.IntN(vocabSize))
	}
	return dst
}

// Prompt returns the prompt text.
func (s Sample) Prompt() string { return string(s.AppendPrompt(make([]byte, 0, s.promptBytes()))) }

func (s Sample) promptBytes() int { return s.PromptLen * (wordLen + 1) }

func randomWords(r *rand.Rand, n int) []byte {
	if n == 0 {
		return nil
	}
	b := make([]byte, 0, n*(wordLen+1))
	for i := 0; i < n; i++ {
		if i > 0 {
			b = append(b, ' ')
		}
		b = appendWord(b, r.IntN(vocabSize))
	}
	return b
}

// lengthRange returns vLLM's inclusive sampling bounds for a mean length l
// and range ratio r: [floor(l(1-r)), ceil(l(1+r))], with the lower bound
// clamped to minLow.
func lengthRange(l int, r float64, minLow int) (lo, hi int) {
	lo = int(math.Floor(float64(l) * (1 - r)))
	hi = int(math.Ceil(float64(l) * (1 + r)))
	lo = max(lo, minLow)
	hi = max(hi, lo)
	return lo, hi
}

// sampleLengths draws n integers uniformly in [lo, hi].
func sampleLengths(r *rand.Rand, n, lo, hi int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = lo + r.IntN(hi-lo+1)
	}
	return out
}

// Stream identifiers for the PCG generator, so each use of the seed draws an
// independent sequence.
const (
	streamLengths = 0x6c656e67 // "leng"
	streamPrefix  = 0x70726566 // "pref"
	streamPrompts = 0x70726f6d // "prom"
	streamArrival = 0x61727276 // "arrv"
	streamShuffle = 0x73687566 // "shuf"
	streamAnswers = 0x616e7377 // "answ"
)

// buildSamples produces the run's samples from the dataset configuration.
func buildSamples(c *Config) ([]Sample, error) {
	switch c.DatasetName {
	case DatasetRandom:
		return randomSamples(c), nil
	case DatasetSharedPrefix:
		return sharedPrefixSamples(c), nil
	}
	return nil, fmt.Errorf("unknown dataset %q", c.DatasetName)
}

// randomSamples mirrors vLLM's RandomDataset: input lengths uniform in
// [floor(L(1-r)), ceil(L(1+r))], output lengths uniform in
// [max(1, floor(O(1-r))), ceil(O(1+r))], and a random prefix of
// RandomPrefixLen tokens shared by every prompt (so PromptLen = prefix +
// sampled input length).
func randomSamples(c *Config) []Sample {
	seed := uint64(c.Seed)
	lr := rand.New(rand.NewPCG(seed, streamLengths))
	ilo, ihi := lengthRange(c.InputLen, c.RangeRatio, 0)
	olo, ohi := lengthRange(c.OutputLen, c.RangeRatio, 1)
	in := sampleLengths(lr, c.NumPrompts, ilo, ihi)
	out := sampleLengths(lr, c.NumPrompts, olo, ohi)
	prefix := randomWords(rand.New(rand.NewPCG(seed, streamPrefix)), c.RandomPrefixLen)
	pr := rand.New(rand.NewPCG(seed, streamPrompts))
	s := make([]Sample, c.NumPrompts)
	for i := range s {
		s[i] = Sample{
			Index:     i,
			PromptLen: c.RandomPrefixLen + in[i],
			OutputLen: out[i],
			prefix:    prefix,
			suffixLen: in[i],
			seed:      pr.Uint64(),
		}
	}
	return s
}

// sharedPrefixSamples builds SharedPrefixGroups groups of
// SharedPrefixPromptsPerGroup prompts. Every prompt of a group starts with
// the group's own SharedPrefixLen random words, followed by a per-prompt
// random suffix whose length is sampled like a random-dataset input
// (InputLen, RangeRatio); output lengths are sampled as in the random
// dataset. The requests are shuffled deterministically so groups interleave.
func sharedPrefixSamples(c *Config) []Sample {
	seed := uint64(c.Seed)
	n := c.NumPrompts
	lr := rand.New(rand.NewPCG(seed, streamLengths))
	ilo, ihi := lengthRange(c.InputLen, c.RangeRatio, 0)
	olo, ohi := lengthRange(c.OutputLen, c.RangeRatio, 1)
	in := sampleLengths(lr, n, ilo, ihi)
	out := sampleLengths(lr, n, olo, ohi)
	prefRand := rand.New(rand.NewPCG(seed, streamPrefix))
	prefixes := make([][]byte, c.SharedPrefixGroups)
	for g := range prefixes {
		prefixes[g] = randomWords(prefRand, c.SharedPrefixLen)
	}
	pr := rand.New(rand.NewPCG(seed, streamPrompts))
	if c.SharedPrefixTurns > 1 {
		return conversationSamples(c, prefixes, in, out, pr)
	}
	s := make([]Sample, n)
	for i := range s {
		g := i / c.SharedPrefixPromptsPerGroup
		s[i] = Sample{
			PromptLen: c.SharedPrefixLen + in[i],
			OutputLen: out[i],
			prefix:    prefixes[g],
			suffixLen: in[i],
			seed:      pr.Uint64(),
		}
	}
	sr := rand.New(rand.NewPCG(seed, streamShuffle))
	sr.Shuffle(len(s), func(a, b int) { s[a], s[b] = s[b], s[a] })
	for i := range s {
		s[i].Index = i
	}
	return s
}

// conversationSamples splits every group's prompts into conversations of
// SharedPrefixTurns turns (the group's last one may be shorter). Turn t's
// prompt is the group prefix, then the conversation's earlier turns (each
// its question and an answer of OutputLen random words standing in for the
// model's reply), then its own question. The requests are ordered turn by
// turn (every conversation's first turn, shuffled; then every second turn,
// ...), so a turn is sent after its predecessor was.
func conversationSamples(c *Config, prefixes [][]byte, in, out []int, pr *rand.Rand) []Sample {
	turns, per := c.SharedPrefixTurns, c.SharedPrefixPromptsPerGroup
	ar := rand.New(rand.NewPCG(uint64(c.Seed), streamAnswers))
	byTurn := make([][]Sample, turns)
	for i := 0; i < c.NumPrompts; {
		g := i / per
		end := min((g+1)*per, c.NumPrompts)
		for i < end {
			history, hlen := prefixes[g], c.SharedPrefixLen
			for t := 0; t < turns && i < end; t++ {
				sm := Sample{PromptLen: hlen + in[i], OutputLen: out[i], prefix: history, suffixLen: in[i], seed: pr.Uint64()}
				byTurn[t] = append(byTurn[t], sm)
				next := sm.AppendPrompt(make([]byte, 0, sm.promptBytes()+c.OutputLen*(wordLen+1)+1))
				if a := randomWords(ar, c.OutputLen); len(a) > 0 {
					next = append(append(next, ' '), a...)
				}
				history, hlen = next, sm.PromptLen+c.OutputLen
				i++
			}
		}
	}
	sr := rand.New(rand.NewPCG(uint64(c.Seed), streamShuffle))
	var s []Sample
	for _, ts := range byTurn {
		sr.Shuffle(len(ts), func(a, b int) { ts[a], ts[b] = ts[b], ts[a] })
		s = append(s, ts...)
	}
	for i := range s {
		s[i].Index = i
	}
	return s
}

// Samples returns the prompts a run of cfg sends, in order (cfg is
// validated as Run does).
func Samples(cfg Config) ([]Sample, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	return buildSamples(&cfg)
}

// samePrefix reports whether two samples share the same prefix buffer (one
// shared-prefix group); used by tests.
func samePrefix(a, b Sample) bool { return len(a.prefix) > 0 && &a.prefix[0] == &b.prefix[0] }

// arrivalOffsets returns the cumulative send offsets (seconds) for n
// requests: all zero for an infinite rate, else gamma-distributed intervals
// with shape burstiness and scale 1/(rate*burstiness) (exponential, i.e.
// Poisson arrivals, for burstiness 1), rescaled so the last offset is
// n/rate exactly, as vLLM's get_request does. An infinite burstiness gives
// constant intervals.
func arrivalOffsets(n int, rate, burstiness float64, seed int64) []float64 {
	d := make([]float64, n)
	if math.IsInf(rate, 1) || n == 0 {
		return d
	}
	r := rand.New(rand.NewPCG(uint64(seed), streamArrival))
	theta := 1 / (rate * burstiness)
	for i := range d {
		var v float64
		if math.IsInf(burstiness, 1) {
			v = 1 / rate
		} else {
			v = gammaSample(r, burstiness) * theta
		}
		if i > 0 {
			v += d[i-1]
		}
		d[i] = v
	}
	if last := d[n-1]; last != 0 {
		f := (float64(n) / rate) / last
		for i := range d {
			d[i] *= f
		}
	}
	return d
}

// gammaSample draws from Gamma(shape, 1) with Marsaglia and Tsang's method.
func gammaSample(r *rand.Rand, shape float64) float64 {
	if shape < 1 {
		u := r.Float64()
		for u == 0 {
			u = r.Float64()
		}
		return gammaSample(r, shape+1) * math.Pow(u, 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := r.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := r.Float64()
		if u < 1-0.0331*x*x*x*x {
			return d * v
		}
		if u > 0 && math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}
