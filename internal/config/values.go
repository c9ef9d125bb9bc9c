package config

import (
	"flag"
	"strconv"
	"strings"
)

// flag.Value implementations bound to Config fields. Set returns a bare
// reason; the parser wraps it into an *Error naming the flag.

// reason is an error whose text is a Rust-style reason ("Must be > 0"),
// capitalised on purpose so it can be embedded verbatim in an *Error.
type reason string

func (r reason) Error() string { return string(r) }

type stringValue struct{ p *string }

func (v stringValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}
func (v stringValue) Set(s string) error { *v.p = s; return nil }

type boolValue struct{ p *bool }

func (v boolValue) String() string {
	if v.p == nil {
		return "false"
	}
	return strconv.FormatBool(*v.p)
}

func (v boolValue) Set(s string) error {
	b, err := strconv.ParseBool(s)
	if err != nil {
		return reason("Must be true or false")
	}
	*v.p = b
	return nil
}
func (v boolValue) IsBoolFlag() bool { return true }

type uintValue[T uint16 | uint32 | uint64] struct{ p *T }

func (v uintValue[T]) bits() int {
	var z T
	switch any(z).(type) {
	case uint16:
		return 16
	case uint32:
		return 32
	default:
		return 64
	}
}

func (v uintValue[T]) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.FormatUint(uint64(*v.p), 10)
}

func (v uintValue[T]) Set(s string) error {
	n, err := strconv.ParseUint(strings.TrimPrefix(s, "+"), 10, v.bits())
	if err != nil {
		return reason("Must be an integer between 0 and " + strconv.FormatUint(1<<v.bits()-1, 10))
	}
	*v.p = T(n)
	return nil
}

// intValue backs Rust usize fields (and our int extras): negative values
// are rejected, as clap rejects them for usize.
type intValue struct{ p *int }

func (v intValue) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.Itoa(*v.p)
}

func (v intValue) Set(s string) error {
	n, err := strconv.ParseUint(strings.TrimPrefix(s, "+"), 10, strconv.IntSize-1)
	if err != nil {
		return reason("Must be a non-negative integer")
	}
	*v.p = int(n)
	return nil
}

type floatValue struct{ p *float64 }

func (v floatValue) String() string {
	if v.p == nil {
		return "0"
	}
	return formatFloat(*v.p)
}

func (v floatValue) Set(s string) error {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return reason("Must be a number")
	}
	*v.p = f
	return nil
}

func formatFloat(f float64) string { return strconv.FormatFloat(f, 'g', -1, 64) }

type enumValue struct {
	p       *string
	allowed []string
}

func (v enumValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}

func (v enumValue) Set(s string) error {
	if !contains(v.allowed, s) {
		return reason(oneOf(v.allowed))
	}
	*v.p = s
	return nil
}

func oneOf(allowed []string) string { return "Must be one of: " + strings.Join(allowed, ", ") }

func contains(list []string, s string) bool {
	for _, a := range list {
		if a == s {
			return true
		}
	}
	return false
}

// listValue backs the multi-value flags. The tokenizer hands it every value
// of every occurrence; the first Set of a parse replaces whatever the config
// file put there, later ones append (clap's Append across occurrences).
type listValue struct {
	p     *[]string
	fresh bool
}

func (v *listValue) String() string {
	if v.p == nil {
		return ""
	}
	return strings.Join(*v.p, " ")
}

func (v *listValue) Set(s string) error {
	if !v.fresh {
		*v.p = nil
		v.fresh = true
	}
	*v.p = append(*v.p, s)
	return nil
}

// reset is used for an occurrence with zero values (`--worker-urls` alone):
// the list becomes explicitly empty.
func (v *listValue) reset() {
	if !v.fresh {
		*v.p = []string{}
		v.fresh = true
	}
}

var (
	_ flag.Value = stringValue{}
	_ flag.Value = boolValue{}
	_ flag.Value = uintValue[uint16]{}
	_ flag.Value = intValue{}
	_ flag.Value = floatValue{}
	_ flag.Value = enumValue{}
	_ flag.Value = (*listValue)(nil)
)
