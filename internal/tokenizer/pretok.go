package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// The split patterns HuggingFace pre-tokenizers use are Oniguruma regexes
// with a (?!\S) lookahead Go's regexp lacks. Each supported pattern has a
// hand-written scanner here, selected by the exact pattern string; a
// scanner returns the end of the match starting at i (every pattern below
// matches at every position, so splitting is a walk from match to match).
// The alternatives are tried in the pattern's order with the backtracking
// semantics of the regex engine.

// Patterns, exactly as they appear in tokenizer.json files.
const (
	// GPT-2, and ByteLevel's use_regex.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	// Llama 3 (digits in runs of up to three).
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// Qwen2 (single digits).
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// scanner returns the end of the match that starts at i < len(s).
type scanner func(s string, i int) int

var scanners = map[string]scanner{
	patternGPT2:   scanGPT2,
	patternLlama3: func(s string, i int) int { return scanLlama(s, i, 3) },
	patternQwen2:  func(s string, i int) int { return scanLlama(s, i, 1) },
}

func isL(r rune) bool     { return unicode.IsLetter(r) }
func isN(r rune) bool     { return unicode.IsNumber(r) }
func isSpace(r rune) bool { return unicode.IsSpace(r) }

// isOther: [^\s\p{L}\p{N}].
func isOther(r rune) bool { return !isSpace(r) && !isL(r) && !isN(r) }

func runeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return utf8.RuneError, 0
	}
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

// run returns the end of the longest run of runes from i satisfying f.
func run(s string, i int, f func(rune) bool) int {
	for i < len(s) {
		r, w := runeAt(s, i)
		if !f(r) {
			break
		}
		i += w
	}
	return i
}

// contraction matches 's|'t|'re|'ve|'m|'ll|'d after the apostrophe at i;
// fold makes it case-insensitive (Unicode simple folding: s also matches
// U+017F LATIN SMALL LETTER LONG S). It returns the match end or -1.
func contraction(s string, i int, fold bool) int {
	j := i + 1
	eq := func(k int, c byte) int {
		if k >= len(s) {
			return 0
		}
		if s[k] == c || fold && s[k] == c-'a'+'A' {
			return 1
		}
		if fold && c == 's' && k+1 < len(s) && s[k] == 0xC5 && s[k+1] == 0xBF {
			return 2
		}
		return 0
	}
	for _, c := range []byte{'s', 't', 'm', 'd'} {
		if n := eq(j, c); n > 0 {
			return j + n
		}
	}
	for _, p := range [][2]byte{{'r', 'e'}, {'v', 'e'}, {'l', 'l'}} {
		if n := eq(j, p[0]); n > 0 {
			if m := eq(j+n, p[1]); m > 0 {
				return j + n + m
			}
		}
	}
	return -1
}

// spaceTail matches \s+(?!\S)|\s+ at i, a whitespace rune: the whole run
// when it ends the text, else the run but its last rune (which then
// starts the next match), else the single rune.
func spaceTail(s string, i int) int {
	j := run(s, i, isSpace)
	if j == len(s) {
		return j
	}
	_, w := utf8.DecodeLastRuneInString(s[i:j])
	if j-w > i {
		return j - w
	}
	return j
}

func scanGPT2(s string, i int) int {
	if s[i] == '\'' {
		if e := contraction(s, i, false); e > 0 {
			return e
		}
	}
	k := i
	if s[i] == ' ' {
		k++
	}
	if r, _ := runeAt(s, k); k < len(s) {
		switch {
		case isL(r):
			return run(s, k, isL)
		case isN(r):
			return run(s, k, isN)
		case isOther(r):
			return run(s, k, isOther)
		}
	}
	return spaceTail(s, i)
}

// scanLlama is the Llama 3 pattern, with digits in runs of up to maxDigits
// (Qwen2: 1).
func scanLlama(s string, i int, maxDigits int) int {
	if s[i] == '\'' {
		if e := contraction(s, i, true); e > 0 {
			return e
		}
	}
	r, w := runeAt(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if isL(r) {
		return run(s, i, isL)
	}
	if r != '\r' && r != '\n' && !isN(r) {
		if r2, _ := runeAt(s, i+w); i+w < len(s) && isL(r2) {
			return run(s, i+w, isL)
		}
	}
	// \p{N}{1,maxDigits}
	if isN(r) {
		j := i
		for n := 0; n < maxDigits && j < len(s); n++ {
			r, w := runeAt(s, j)
			if !isN(r) {
				break
			}
			j += w
		}
		return j
	}
	// ' ?[^\s\p{L}\p{N}]+[\r\n]*'
	k := i
	if s[i] == ' ' {
		k++
	}
	if r2, _ := runeAt(s, k); k < len(s) && isOther(r2) {
		j := run(s, k, isOther)
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// \s*[\r\n]+ : through the run's last newline.
	j := run(s, i, isSpace)
	for p := j - 1; p >= i; p-- {
		if s[p] == '\r' || s[p] == '\n' {
			return p + 1
		}
	}
	return spaceTail(s, i)
}
