// Package rawjson edits the top level of a JSON object in place, byte for byte.
//
// The router forwards client JSON bodies faithfully: it never decodes a body
// into a typed struct and re-encodes it (that drops unknown fields, adds
// defaulted ones and reorders keys). Instead it locates the top-level members
// of the object and rewrites only the members the protocol requires. Every
// byte outside a touched member, including whitespace and key order, is kept.
package rawjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"
)

// ErrNotObject is returned when the body is not a JSON object.
var ErrNotObject = errors.New("request body must be a JSON object")

// Member is one top-level member of an object: its decoded key and the raw
// bytes of its value.
type Member struct {
	Key   string
	Value []byte // raw JSON value, a sub-slice of the source
	start int    // offset of the key's opening quote
	end   int    // offset just past the value
}

// Object is a parsed view of a JSON object. It keeps a reference to the
// source bytes; edits produce new byte slices and never modify the source.
type Object struct {
	src     []byte
	open    int // offset of '{'
	close   int // offset of the final '}'
	members []Member
	// small backs members for the usual request (a dozen keys or fewer),
	// so parsing one allocates the Object and nothing else for them.
	small [smallMembers]Member
}

// smallMembers is how many members fit without a separate allocation.
const smallMembers = 12

// Parse scans the top level of a JSON object. It validates the whole
// document, so a nil error means src is valid JSON.
func Parse(src []byte) (*Object, error) {
	m, open, ok := checkMembers(src)
	if !ok {
		return nil, notObject(src)
	}
	o := &Object{src: src, open: open}
	o.members = o.small[:0]
	var keyErr error
	for m.next() {
		key, err := decodeKey(src[m.start:m.keyEnd])
		if err != nil && keyErr == nil {
			keyErr = err
		}
		o.members = append(o.members, Member{Key: key, Value: src[m.value:m.end], start: m.start, end: m.end})
	}
	if !m.valid() {
		return nil, syntaxError(src)
	}
	if keyErr != nil {
		return nil, keyErr
	}
	o.close = m.i
	return o, nil
}

// notObject is the error for src that does not start with '{': invalid
// JSON, or valid JSON that is not an object.
func notObject(src []byte) error {
	if !Valid(src) {
		return syntaxError(src)
	}
	return ErrNotObject
}

// IsObject reports whether src is one valid JSON object: Parse's check,
// without building the Object.
func IsObject(src []byte) bool {
	i := skipWS(src, 0)
	return i < len(src) && src[i] == '{' && Valid(src)
}

// Lookup returns the raw value of the object src's top-level member key
// (the last one, as Object.Get), nil when there is none: Parse and Get
// without the Object, so nothing is allocated for a key without escapes.
// Its errors are Parse's.
func Lookup(src []byte, key string) ([]byte, error) {
	m, _, ok := checkMembers(src)
	if !ok {
		return nil, notObject(src)
	}
	var v []byte
	var keyErr error
	for m.next() {
		raw := src[m.start+1 : m.keyEnd-1]
		if bytes.IndexByte(raw, '\\') < 0 && utf8.Valid(raw) { // decodeKey's string(raw)
			if string(raw) == key {
				v = src[m.value:m.end]
			}
			continue
		}
		k, err := decodeKey(src[m.start:m.keyEnd])
		if err != nil && keyErr == nil {
			keyErr = err
		}
		if k == key {
			v = src[m.value:m.end]
		}
	}
	if !m.valid() {
		return nil, syntaxError(src)
	}
	if keyErr != nil {
		return nil, keyErr
	}
	return v, nil
}

// decodeKey decodes a quoted JSON key; keys without escapes (nearly all)
// are converted directly.
func decodeKey(q []byte) (string, error) {
	raw := q[1 : len(q)-1]
	if k, ok := commonKey(raw); ok {
		return k, nil
	}
	if bytes.IndexByte(raw, '\\') < 0 && utf8.Valid(raw) {
		return string(raw), nil
	}
	var key string
	if err := json.Unmarshal(q, &key); err != nil {
		return "", fmt.Errorf("invalid key: %w", err)
	}
	return key, nil
}

// commonKey returns the OpenAI request keys (and a completion's response
// keys, which the prefill's answer is, with its kv_transfer_params) as
// constants: a switch on
// string(raw) compiles to comparisons without converting (allocating) the
// key, so the keys of nearly every request cost nothing.
func commonKey(raw []byte) (string, bool) {
	switch string(raw) {
	case "model":
		return "model", true
	case "prompt":
		return "prompt", true
	case "messages":
		return "messages", true
	case "stream":
		return "stream", true
	case "stream_options":
		return "stream_options", true
	case "max_tokens":
		return "max_tokens", true
	case "max_completion_tokens":
		return "max_completion_tokens", true
	case "temperature":
		return "temperature", true
	case "top_p":
		return "top_p", true
	case "top_k":
		return "top_k", true
	case "n":
		return "n", true
	case "stop":
		return "stop", true
	case "seed":
		return "seed", true
	case "user":
		return "user", true
	case "ignore_eos":
		return "ignore_eos", true
	case "kv_transfer_params":
		return "kv_transfer_params", true
	case "input":
		return "input", true
	case "id":
		return "id", true
	case "object":
		return "object", true
	case "created":
		return "created", true
	case "choices":
		return "choices", true
	case "usage":
		return "usage", true
	case "system_fingerprint":
		return "system_fingerprint", true
	case "prompt_logprobs":
		return "prompt_logprobs", true
	case "prompt_token_ids":
		return "prompt_token_ids", true
	case "service_tier":
		return "service_tier", true
	case "logprobs":
		return "logprobs", true
	case "min_tokens":
		return "min_tokens", true
	case "return_token_ids":
		return "return_token_ids", true
	// kv_transfer_params (vLLM's NIXL, MoRI-IO and Mooncake connectors)
	case "do_remote_decode":
		return "do_remote_decode", true
	case "do_remote_prefill":
		return "do_remote_prefill", true
	case "remote_block_ids":
		return "remote_block_ids", true
	case "remote_engine_id":
		return "remote_engine_id", true
	case "remote_host":
		return "remote_host", true
	case "remote_port":
		return "remote_port", true
	case "remote_request_id":
		return "remote_request_id", true
	case "tp_size":
		return "tp_size", true
	case "transfer_id":
		return "transfer_id", true
	case "remote_handshake_port":
		return "remote_handshake_port", true
	case "remote_notify_port":
		return "remote_notify_port", true
	case "remote_dp_size":
		return "remote_dp_size", true
	case "remote_tp_size":
		return "remote_tp_size", true
	case "remote_dp_rank":
		return "remote_dp_rank", true
	case "remote_bootstrap_addr":
		return "remote_bootstrap_addr", true
	// a choice and usage
	case "index":
		return "index", true
	case "text":
		return "text", true
	case "finish_reason":
		return "finish_reason", true
	case "stop_reason":
		return "stop_reason", true
	case "token_ids":
		return "token_ids", true
	case "prompt_tokens":
		return "prompt_tokens", true
	case "total_tokens":
		return "total_tokens", true
	case "completion_tokens":
		return "completion_tokens", true
	case "prompt_tokens_details":
		return "prompt_tokens_details", true
	}
	return "", false
}

func syntaxError(src []byte) error {
	var v any
	err := json.Unmarshal(src, &v)
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return fmt.Errorf("invalid JSON at offset %d: %s", se.Offset, se.Error())
	}
	if err == nil {
		err = errors.New("invalid JSON")
	}
	return fmt.Errorf("invalid JSON: %w", err)
}

// Members returns the top-level members in source order.
func (o *Object) Members() []Member { return o.members[:len(o.members):len(o.members)] }

// Source returns the bytes the object was parsed from.
func (o *Object) Source() []byte { return o.src }

// Get returns the raw value of key, or nil if absent. When a key repeats, the
// last occurrence wins, as in encoding/json and Python's json module.
func (o *Object) Get(key string) []byte {
	for i := len(o.members) - 1; i >= 0; i-- {
		if o.members[i].Key == key {
			return o.members[i].Value
		}
	}
	return nil
}

// Has reports whether key is present.
func (o *Object) Has(key string) bool { return o.Get(key) != nil }

// IsNull reports whether key is present with the literal value null.
func (o *Object) IsNull(key string) bool {
	v := o.Get(key)
	return v != nil && string(v) == "null"
}

// Bool returns the value of key when it is a JSON boolean.
func (o *Object) Bool(key string) (val, ok bool) {
	switch string(o.Get(key)) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// String returns the value of key when it is a JSON string.
func (o *Object) String(key string) (string, bool) {
	v := o.Get(key)
	if len(v) == 0 || v[0] != '"' {
		return "", false
	}
	var s string
	if json.Unmarshal(v, &s) != nil {
		return "", false
	}
	return s, true
}

// Int returns the value of key when it is a JSON number with an integral value.
func (o *Object) Int(key string) (int64, bool) {
	v := o.Get(key)
	if len(v) == 0 {
		return 0, false
	}
	if n, err := strconv.ParseInt(string(v), 10, 64); err == nil {
		return n, true
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || f != float64(int64(f)) {
		return 0, false
	}
	return int64(f), true
}

// Edit is one change to apply with Apply.
type Edit struct {
	Key    string
	Value  []byte // raw JSON; nil means delete the member
	Delete bool
}

// Set returns an edit that sets key to the raw JSON value v.
func Set(key string, v []byte) Edit { return Edit{Key: key, Value: v} }

// SetJSON returns an edit that sets key to the JSON encoding of v.
func SetJSON(key string, v any) Edit {
	b, err := json.Marshal(v)
	if err != nil {
		// Only called with values the router builds itself.
		b = []byte("null")
	}
	return Edit{Key: key, Value: b}
}

// Delete returns an edit that removes key if present.
func Delete(key string) Edit { return Edit{Key: key, Delete: true} }

// Apply returns a new document with the edits applied. Existing members are
// replaced in place (every occurrence of a repeated key is rewritten, so the
// result is unambiguous); new members are appended before the closing brace
// in the order given. Of several edits of one key, the last is applied.
// Untouched bytes are copied verbatim. Splice gives the same bytes without
// copying them.
func (o *Object) Apply(edits ...Edit) []byte {
	if len(edits) == 0 {
		return o.src
	}
	var partBuf [3 * smallMembers][]byte
	var newBuf [editScan]newMember
	parts, news, tail := o.splice(partBuf[:0], newBuf[:0], edits)
	n := len(tail) + newRoom(news)
	for _, p := range parts {
		n += len(p)
	}
	out := make([]byte, 0, n)
	for _, p := range parts {
		out = append(out, p...)
	}
	for _, m := range news {
		out = append(m.appendKey(out), m.value...)
	}
	return append(out, tail...)
}

// editScan is the most edits Apply finds by a scan, without a map.
const editScan = 8

// Patch parses src and applies edits in one step.
func Patch(src []byte, edits ...Edit) ([]byte, error) {
	o, err := Parse(src)
	if err != nil {
		return nil, err
	}
	return o.Apply(edits...), nil
}

// Compact returns v without insignificant whitespace (for logs and tests).
func Compact(v []byte) []byte {
	var b bytes.Buffer
	if json.Compact(&b, v) != nil {
		return v
	}
	return b.Bytes()
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// scanner walks JSON that json.Valid has already accepted.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) && isSpace(s.b[s.i]) {
		s.i++
	}
}
