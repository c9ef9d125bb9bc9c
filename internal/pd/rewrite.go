package pd

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// Output-length policies for the decode leg.
const (
	OutputExact    = "exact"     // decode body unchanged: the client gets the tokens it asked for
	OutputToyProxy = "toy-proxy" // decrement the token limit by one, as vLLM's toy proxies do
)

// routeKind is a generation route the PD engine serves.
type routeKind int

const (
	routeNone routeKind = iota
	routeCompletions
	routeChat
	routeResponses
	routeGenerate // /generate and /inference/v1/generate: sampling_params
)

func (k routeKind) String() string {
	switch k {
	case routeCompletions:
		return "completions"
	case routeChat:
		return "chat"
	case routeResponses:
		return "responses"
	case routeGenerate:
		return "generate"
	}
	return "none"
}

func classify(path string) routeKind {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	path = strings.TrimRight(path, "/")
	switch path {
	case "/v1/completions":
		return routeCompletions
	case "/v1/chat/completions":
		return routeChat
	case "/v1/responses":
		return routeResponses
	case "/generate", "/inference/v1/generate":
		return routeGenerate
	}
	return routeNone
}

// validate rejects requests PD mode cannot serve. It returns a client
// error message ("" = fine).
func validate(kind routeKind, o *rawjson.Object) string {
	switch kind {
	case routeCompletions:
		if v := o.Get("prompt"); v == nil || string(v) == "null" {
			return "'prompt' is required"
		}
	case routeChat:
		if v := o.Get("messages"); v == nil || string(v) == "null" {
			return "'messages' is required"
		}
	}
	check := func(obj *rawjson.Object, where string) string {
		for _, k := range []string{"n", "best_of"} {
			if n, ok := obj.Int(k); ok && n > 1 {
				return fmt.Sprintf("%s%s=%d is not supported in PD mode (the prefill/decode handoff carries one sequence)", where, k, n)
			}
		}
		return ""
	}
	if msg := check(o, ""); msg != "" {
		return msg
	}
	if kind == routeGenerate {
		if sp := o.Get("sampling_params"); len(sp) > 0 && sp[0] == '{' {
			if so, err := rawjson.Parse(sp); err == nil {
				return check(so, "sampling_params.")
			}
		}
	}
	return ""
}

var (
	one   = []byte("1")
	falsy = []byte("false")
)

// clampEdits caps the token-limit fields of obj for the prefill leg:
// max set to 1 (added if absent), mirrors set to 1 when present, minimums
// clamped to at most 1.
func clampEdits(o *rawjson.Object, max string, mirrors, mins []string) []rawjson.Edit {
	edits := []rawjson.Edit{rawjson.Set(max, one)}
	for _, k := range mirrors {
		if o.Has(k) {
			edits = append(edits, rawjson.Set(k, one))
		}
	}
	for _, k := range mins {
		if n, ok := o.Int(k); ok && n > 1 {
			edits = append(edits, rawjson.Set(k, one))
		}
	}
	return edits
}

// prefillBody rewrites the client body for the prefill leg (REFERENCE §4.3,
// fixed): one generated token, no streaming, params set when non-nil.
func prefillBody(kind routeKind, o *rawjson.Object, params []byte) []byte {
	var edits []rawjson.Edit
	switch kind {
	case routeCompletions, routeChat:
		edits = clampEdits(o, "max_tokens", []string{"max_completion_tokens"}, []string{"min_tokens", "min_completion_tokens"})
	case routeResponses:
		edits = []rawjson.Edit{rawjson.Set("max_output_tokens", one)}
	case routeGenerate:
		sp := o.Get("sampling_params")
		var nsp []byte
		if len(sp) > 0 && sp[0] == '{' {
			if so, err := rawjson.Parse(sp); err == nil {
				nsp = so.Apply(clampEdits(so, "max_tokens", nil, []string{"min_tokens"})...)
			}
		}
		if nsp == nil {
			nsp = []byte(`{"max_tokens":1}`)
		}
		edits = []rawjson.Edit{rawjson.Set("sampling_params", nsp)}
	}
	edits = append(edits, rawjson.Set("stream", falsy), rawjson.Delete("stream_options"))
	if params != nil {
		edits = append(edits, rawjson.Set("kv_transfer_params", params))
	}
	return o.Apply(edits...)
}

// decrement returns the edit lowering the integer member k of o by one
// (never below 1), or ok=false when k is absent or not an integer.
func decrement(o *rawjson.Object, k string) (rawjson.Edit, bool) {
	if !o.Has(k) {
		return rawjson.Edit{}, false
	}
	n, ok := o.Int(k)
	if !ok {
		return rawjson.Edit{}, false
	}
	if n <= 1 {
		return rawjson.Edit{}, true // present, already at the floor: leave it
	}
	return rawjson.Set(k, []byte(strconv.FormatInt(n-1, 10))), true
}

// decodeBody is the client body for the decode leg: the output-length policy
// applied and kv_transfer_params set when non-nil. With OutputExact and nil
// params it is the client's bytes, untouched.
func decodeBody(kind routeKind, o *rawjson.Object, params []byte, outputLen string) []byte {
	var edits []rawjson.Edit
	if outputLen == OutputToyProxy {
		switch kind {
		case routeCompletions, routeChat:
			// max_completion_tokens if present, else max_tokens if present.
			if e, ok := decrement(o, "max_completion_tokens"); ok {
				if e.Key != "" {
					edits = append(edits, e)
				}
			} else if e, ok := decrement(o, "max_tokens"); ok && e.Key != "" {
				edits = append(edits, e)
			}
		case routeResponses:
			if e, ok := decrement(o, "max_output_tokens"); ok && e.Key != "" {
				edits = append(edits, e)
			}
		case routeGenerate:
			if sp := o.Get("sampling_params"); len(sp) > 0 && sp[0] == '{' {
				if so, err := rawjson.Parse(sp); err == nil {
					if e, ok := decrement(so, "max_tokens"); ok && e.Key != "" {
						edits = append(edits, rawjson.Set("sampling_params", so.Apply(e)))
					}
				}
			}
		}
	}
	if params != nil {
		edits = append(edits, rawjson.Set("kv_transfer_params", params))
	}
	if len(edits) == 0 {
		return o.Source()
	}
	return o.Apply(edits...)
}

// needsMerge reports whether a non-streaming response must be merged with
// the prefill's (REFERENCE §4.7): only when the client asked for prompt
// logprobs or echo, which only the prefill can compute.
func needsMerge(kind routeKind, o *rawjson.Object, stream bool) bool {
	if stream {
		return false
	}
	nonNull := func(k string) bool { v := o.Get(k); return v != nil && string(v) != "null" && string(v) != "false" }
	switch kind {
	case routeCompletions:
		echo, _ := o.Bool("echo")
		return echo || nonNull("logprobs") || nonNull("prompt_logprobs")
	case routeChat:
		return nonNull("prompt_logprobs")
	}
	return false
}
