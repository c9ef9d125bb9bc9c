package config

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strings"
)

// EnvVar is one KEY=VALUE assignment from a .env file.
type EnvVar struct {
	Key   string
	Value string
}

// LoadDotEnv loads path (normally ".env" in the working directory) into the
// process environment the way the Rust binary's dotenvy::dotenv() does:
// variables already set are not overridden, a missing file is not an error,
// and on a malformed line the assignments before it are applied and the
// error is returned (the Rust binary ignores it; the caller may log it).
// Call it before Parse.
func LoadDotEnv(path string) error {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	vars, perr := ParseDotEnv(strings.NewReader(string(data)), os.LookupEnv)
	for _, v := range vars {
		if _, set := os.LookupEnv(v.Key); !set {
			if err := os.Setenv(v.Key, v.Value); err != nil {
				return fmt.Errorf("%s: set %s: %w", path, v.Key, err)
			}
		}
	}
	if perr != nil {
		return fmt.Errorf("%s: %w", path, perr)
	}
	return nil
}

// ParseDotEnv parses dotenv syntax: blank lines and '#' comments are
// skipped; lines are [export] KEY=VALUE; VALUE is unquoted (trailing
// " #comment" dropped, surrounding space trimmed), 'single-quoted' (literal,
// may span lines) or "double-quoted" (escapes \n \r \t \\ \" \$, may span
// lines). $NAME and ${NAME} are substituted in unquoted and double-quoted
// values from lookup first, then from earlier lines, else "". It returns
// the assignments parsed before the first error, in file order.
func ParseDotEnv(r io.Reader, lookup func(string) (string, bool)) ([]EnvVar, error) {
	data, err := io.ReadAll(r)
	if err != nil {
		return nil, err
	}
	p := dotenvParser{src: string(data), line: 1, lookup: lookup, seen: map[string]string{}}
	var out []EnvVar
	for {
		v, ok, err := p.next()
		if err != nil {
			return out, fmt.Errorf("line %d: %w", p.errLine, err)
		}
		if !ok {
			return out, nil
		}
		out = append(out, v)
		p.seen[v.Key] = v.Value
	}
}

type dotenvParser struct {
	src     string
	pos     int
	line    int
	errLine int
	lookup  func(string) (string, bool)
	seen    map[string]string
}

func (p *dotenvParser) peek() byte {
	if p.pos < len(p.src) {
		return p.src[p.pos]
	}
	return 0
}

func (p *dotenvParser) eof() bool { return p.pos >= len(p.src) }

func (p *dotenvParser) advance() byte {
	ch := p.src[p.pos]
	p.pos++
	if ch == '\n' {
		p.line++
	}
	return ch
}

func (p *dotenvParser) skipSpaces() {
	for !p.eof() && (p.peek() == ' ' || p.peek() == '\t') {
		p.advance()
	}
}

func (p *dotenvParser) skipLine() {
	for !p.eof() && p.advance() != '\n' {
	}
}

func isKeyChar(ch byte) bool {
	return ch == '_' || ch == '.' || ch >= 'a' && ch <= 'z' || ch >= 'A' && ch <= 'Z' || ch >= '0' && ch <= '9'
}

// next returns the next assignment; ok is false at the end of input.
func (p *dotenvParser) next() (EnvVar, bool, error) {
	for {
		p.skipSpaces()
		switch {
		case p.eof():
			return EnvVar{}, false, nil
		case p.peek() == '\n' || p.peek() == '\r' || p.peek() == '#':
			p.skipLine()
			continue
		}
		break
	}
	p.errLine = p.line
	if strings.HasPrefix(p.src[p.pos:], "export ") || strings.HasPrefix(p.src[p.pos:], "export\t") {
		p.pos += len("export")
		p.skipSpaces()
	}
	start := p.pos
	for !p.eof() && isKeyChar(p.peek()) {
		p.advance()
	}
	key := p.src[start:p.pos]
	if key == "" {
		return EnvVar{}, false, fmt.Errorf("invalid key at %q", firstLine(p.src[start:]))
	}
	p.skipSpaces()
	if p.peek() != '=' {
		return EnvVar{}, false, fmt.Errorf("expected '=' after %s", key)
	}
	p.advance()
	p.skipSpaces()
	val, err := p.value()
	if err != nil {
		return EnvVar{}, false, err
	}
	return EnvVar{Key: key, Value: val}, true, nil
}

func (p *dotenvParser) value() (string, error) {
	var b strings.Builder
	switch p.peek() {
	case '\'':
		p.advance()
		for {
			if p.eof() {
				return "", errors.New("unterminated single-quoted value")
			}
			ch := p.advance()
			if ch == '\'' {
				break
			}
			b.WriteByte(ch)
		}
		return b.String(), p.restOfLine()
	case '"':
		p.advance()
		for {
			if p.eof() {
				return "", errors.New("unterminated double-quoted value")
			}
			ch := p.advance()
			switch ch {
			case '"':
				return b.String(), p.restOfLine()
			case '\\':
				if p.eof() {
					return "", errors.New("unterminated double-quoted value")
				}
				switch e := p.advance(); e {
				case 'n':
					b.WriteByte('\n')
				case 'r':
					b.WriteByte('\r')
				case 't':
					b.WriteByte('\t')
				case '\\', '"', '$', '\'':
					b.WriteByte(e)
				default:
					b.WriteByte('\\')
					b.WriteByte(e)
				}
			case '$':
				if err := p.substitute(&b); err != nil {
					return "", err
				}
			default:
				b.WriteByte(ch)
			}
		}
	}
	// Unquoted: up to end of line; " #" starts a comment.
	for !p.eof() && p.peek() != '\n' {
		ch := p.peek()
		if ch == '#' && (b.Len() == 0 || strings.HasSuffix(b.String(), " ") || strings.HasSuffix(b.String(), "\t")) {
			p.skipLine()
			return strings.TrimRight(b.String(), " \t\r"), nil
		}
		p.advance()
		switch ch {
		case '\\':
			if !p.eof() && p.peek() != '\n' {
				b.WriteByte(p.advance())
			}
		case '$':
			if err := p.substitute(&b); err != nil {
				return "", err
			}
		case '"', '\'':
			return "", fmt.Errorf("unexpected quote in unquoted value")
		default:
			b.WriteByte(ch)
		}
	}
	if !p.eof() {
		p.advance()
	}
	return strings.TrimRight(b.String(), " \t\r"), nil
}

// restOfLine accepts only spaces and a comment after a closing quote.
func (p *dotenvParser) restOfLine() error {
	p.skipSpaces()
	switch {
	case p.eof():
		return nil
	case p.peek() == '\r' || p.peek() == '\n' || p.peek() == '#':
		p.skipLine()
		return nil
	}
	return fmt.Errorf("unexpected text after closing quote: %q", firstLine(p.src[p.pos:]))
}

// substitute expands $NAME or ${NAME}; the '$' is already consumed.
func (p *dotenvParser) substitute(b *strings.Builder) error {
	braced := p.peek() == '{'
	if braced {
		p.advance()
	}
	start := p.pos
	for !p.eof() && (isKeyChar(p.peek()) && p.peek() != '.') {
		p.advance()
	}
	name := p.src[start:p.pos]
	if braced {
		if p.peek() != '}' {
			return errors.New("unterminated ${...} substitution")
		}
		p.advance()
	}
	if name == "" {
		if !braced {
			b.WriteByte('$')
		}
		return nil
	}
	if v, ok := p.lookup(name); ok {
		b.WriteString(v)
	} else {
		b.WriteString(p.seen[name])
	}
	return nil
}

func firstLine(s string) string {
	s, _, _ = strings.Cut(s, "\n")
	if len(s) > 40 {
		s = s[:40] + "..."
	}
	return s
}
