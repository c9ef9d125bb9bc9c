package config

import (
	"errors"
	"flag"
)

// ErrHelp is returned by Parse after --help/-h printed the usage; the
// process should exit 0. It is flag.ErrHelp, so either sentinel matches.
var ErrHelp = flag.ErrHelp

// ErrVersion is returned by Parse after --version/-V printed
// "switchyard <version>"; the process should exit 0.
var ErrVersion = errors.New("config: version requested")

// Kind classifies an *Error. The first three mirror the Rust ConfigError
// variants so reasons can be compared with the Rust router.
type Kind int

const (
	// KindInvalidValue is Rust's InvalidValue{field, value, reason}.
	KindInvalidValue Kind = iota + 1
	// KindValidationFailed is Rust's ValidationFailed{reason}.
	KindValidationFailed
	// KindIncompatible is Rust's IncompatibleConfig{reason}.
	KindIncompatible
	// KindNotSupported names a recognised setting Switchyard refuses.
	KindNotSupported
	// KindUsage is a command-line syntax problem: unknown flag, missing
	// value, stray argument, malformed --prefill.
	KindUsage
	// KindConfigFile is a --config file that cannot be read or decoded.
	KindConfigFile
)

func (k Kind) String() string {
	switch k {
	case KindInvalidValue:
		return "invalid_value"
	case KindValidationFailed:
		return "validation_failed"
	case KindIncompatible:
		return "incompatible"
	case KindNotSupported:
		return "not_supported"
	case KindUsage:
		return "usage"
	case KindConfigFile:
		return "config_file"
	default:
		return "unknown"
	}
}

// Error is one configuration problem. Field is the flag as the operator
// knows it ("--cache-threshold"), Reason is the Rust router's text verbatim
// where the rule comes from it.
type Error struct {
	Field  string
	Value  string
	Reason string
	Kind   Kind
}

func (e *Error) Error() string {
	switch e.Kind {
	case KindInvalidValue:
		return "invalid value for " + e.Field + ": " + e.Value + " - " + e.Reason
	case KindValidationFailed:
		return "validation failed: " + e.Reason
	case KindIncompatible:
		return "incompatible configuration: " + e.Reason
	case KindNotSupported:
		if e.Reason == "" {
			return "not supported: " + e.Field
		}
		return "not supported: " + e.Field + " (" + e.Reason + ")"
	case KindConfigFile:
		return "config file " + e.Value + ": " + e.Reason
	default:
		return e.Reason
	}
}

func invalid(field, value, reason string) *Error {
	return &Error{Kind: KindInvalidValue, Field: field, Value: value, Reason: reason}
}

func failed(reason string) *Error { return &Error{Kind: KindValidationFailed, Reason: reason} }

func incompatible(reason string) *Error { return &Error{Kind: KindIncompatible, Reason: reason} }

func usage(field, reason string) *Error { return &Error{Kind: KindUsage, Field: field, Reason: reason} }
