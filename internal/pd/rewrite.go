package pd

import (
	"encoding/json"
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
		v := o.Get("prompt")
		if v == nil || string(v) == "null" {
			return "'prompt' is required"
		}
		// vLLM shares one kv_transfer_params among the prompts of a batch
		// and returns only the first one's: the others would be decoded
		// without their KV.
		for _, k := range []string{"prompt", "prompt_embeds"} {
			if n := promptCount(o.Get(k)); n > 1 {
				return fmt.Sprintf("PD mode supports one prompt per request; got %d", n)
			}
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

// promptCount is the number of prompts in a completions prompt (or
// prompt_embeds) value: 1 for a string or a flat token-id array, the
// element count for an array of strings or of token arrays, 0 when absent.
func promptCount(v []byte) int {
	if len(v) == 0 || string(v) == "null" {
		return 0
	}
	if v[0] != '[' {
		return 1
	}
	var elems []json.RawMessage
	if err := json.Unmarshal(v, &elems); err != nil {
		return 1 // malformed: vLLM reports it
	}
	if len(elems) <= 1 {
		return 1
	}
	for _, e := range elems {
		if len(e) > 0 && (e[0] == '"' || e[0] == '[' || e[0] == '{') {
			return len(elems) // a batch of prompts
		}
	}
	return 1 // token ids of one prompt
}

var (
	one   = []byte("1")
	falsy = []byte("false")
)

// The token-limit fields of completions and chat requests the prefill leg
// clamps (clampEdits).
var (
	completionMirrors = []string{"max_completion_tokens"}
	completionMins    = []string{"min_tokens", "min_completion_tokens"}
)

// clampEdits caps the token-limit fields of obj for the prefill leg:
// max set to 1 (added if absent), mirrors set to 1 when present, minimums
// clamped to at most 1.
func clampEdits(o *rawjson.Object, max string, mirrors, mins []string) []rawjson.Edit {
	return appendClampEdits(nil, o, max, mirrors, mins)
}

// appendClampEdits is clampEdits appending to edits.
func appendClampEdits(edits []rawjson.Edit, o *rawjson.Object, max string, mirrors, mins []string) []rawjson.Edit {
	edits = append(edits, rawjson.Set(max, one))
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
func prefillBody(kind routeKind, o *rawjson.Object, params []byte) rawjson.Spliced {
	var buf [8]rawjson.Edit // room for the most edits made here: no allocation
	edits := buf[:0]
	switch kind {
	case routeCompletions, routeChat:
		edits = appendClampEdits(edits, o, "max_tokens", completionMirrors, completionMins)
	case routeResponses:
		edits = append(edits, rawjson.Set("max_output_tokens", one))
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
		edits = append(edits, rawjson.Set("sampling_params", nsp))
	}
	edits = append(edits, rawjson.Set("stream", falsy), rawjson.Delete("stream_options"))
	if params != nil {
		edits = append(edits, rawjson.Set("kv_transfer_params", params))
	} else {
		edits = append(edits, rawjson.Delete("kv_transfer_params")) // never the client's
	}
	return o.Splice(edits...)
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

// lowerLimit is decrement plus the minimums: a minimum in mins that was
// valid for the client's limit (<= it) but exceeds the lowered one follows
// the limit down, so D never sees min_tokens > max_tokens (vLLM answers 400
// after P already ran). A minimum already above the client's own limit is
// left alone: vLLM rejects that request as it would without PD.
func lowerLimit(o *rawjson.Object, k string, mins []string) ([]rawjson.Edit, bool) {
	e, ok := decrement(o, k)
	if !ok || e.Key == "" {
		return nil, ok
	}
	n, _ := o.Int(k)
	edits := []rawjson.Edit{e}
	for _, m := range mins {
		if v, ok := o.Int(m); ok && v > n-1 && v <= n {
			edits = append(edits, rawjson.Set(m, e.Value))
		}
	}
	return edits, true
}

// decodeBody is the client body for the decode leg: the output-length policy
// applied, kv_transfer_params set when non-nil and a client-supplied one
// removed otherwise. With OutputExact, nil params and no client
// kv_transfer_params it is the client's bytes, untouched.
func decodeBody(kind routeKind, o *rawjson.Object, params []byte, outputLen string) rawjson.Spliced {
	var edits []rawjson.Edit
	if outputLen == OutputToyProxy {
		mins := []string{"min_tokens", "min_completion_tokens"}
		switch kind {
		case routeCompletions, routeChat:
			// max_completion_tokens if present, else max_tokens if present.
			if es, ok := lowerLimit(o, "max_completion_tokens", mins); ok {
				edits = append(edits, es...)
			} else if es, ok := lowerLimit(o, "max_tokens", mins); ok {
				edits = append(edits, es...)
			}
		case routeResponses:
			if es, ok := lowerLimit(o, "max_output_tokens", nil); ok {
				edits = append(edits, es...)
			}
		case routeGenerate:
			if sp := o.Get("sampling_params"); len(sp) > 0 && sp[0] == '{' {
				if so, err := rawjson.Parse(sp); err == nil {
					if es, ok := lowerLimit(so, "max_tokens", []string{"min_tokens"}); ok && len(es) > 0 {
						edits = append(edits, rawjson.Set("sampling_params", so.Apply(es...)))
					}
				}
			}
		}
	}
	if params != nil {
		edits = append(edits, rawjson.Set("kv_transfer_params", params))
	} else if o.Has("kv_transfer_params") {
		edits = append(edits, rawjson.Delete("kv_transfer_params")) // never the client's
	}
	return o.Splice(edits...)
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

// stoppedAtFirstToken reports whether P's non-streaming answer (one token
// at most) is already the complete answer to the client's request: the
// generation finished with finish_reason "stop" (status "completed" on
// /v1/responses) and the client set no minimum above 1 (P's minimums are
// clamped to 1, so with a higher one P may stop where the full request
// would not).
func stoppedAtFirstToken(kind routeKind, o *rawjson.Object, body []byte) bool {
	for _, k := range []string{"min_tokens", "min_completion_tokens"} {
		if n, ok := o.Int(k); ok && n > 1 {
			return false
		}
	}
	switch kind {
	case routeCompletions, routeChat:
		var r struct {
			Choices []struct {
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if json.Unmarshal(body, &r) != nil || len(r.Choices) != 1 || r.Choices[0].FinishReason == nil {
			return false
		}
		return *r.Choices[0].FinishReason == "stop"
	case routeResponses:
		var r struct {
			Status string `json:"status"`
		}
		return json.Unmarshal(body, &r) == nil && r.Status == "completed"
	}
	return false // generate routes: no finish reason to trust
}
