package sim

import (
	"crypto/subtle"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
)

// Upstream checks for testing a router in front of an OpenAI-compatible
// API. --api-key is vLLM's own flag: every /v1/* request must carry
// "Authorization: Bearer <key>", else vLLM's 401 {"error":"Unauthorized"}.
// --openai-strict makes the instance answer like OpenAI's API: a chat or
// completion body with a top-level field OpenAI does not document (vLLM's
// extensions such as top_k or ignore_eos) is OpenAI's 400
// "Unrecognized request argument supplied: <field>", and a bad key is
// OpenAI's 401 invalid_api_key.

// openAIChatFields are the request fields of OpenAI's chat completions API.
var openAIChatFields = []string{
	"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
	"logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
	"parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
	"response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
	"stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
	"verbosity", "web_search_options",
}

// openAICompletionFields are the request fields of OpenAI's (legacy)
// completions API.
var openAICompletionFields = []string{
	"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
	"n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
	"top_p", "user",
}

// checkAPIKey enforces --api-key on /v1/* paths, as vLLM's middleware does.
func (in *Instance) checkAPIKey(next http.Handler) http.Handler {
	key := in.cfg.APIKey
	if key == "" {
		return next
	}
	want := []byte("Bearer " + key)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasPrefix(r.URL.Path, "/v1") ||
			subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) == 1 {
			next.ServeHTTP(w, r)
			return
		}
		if in.cfg.OpenAIStrict {
			in.writeError(w, &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error",
				message: "Incorrect API key provided. You can find your API key at https://platform.openai.com/account/api-keys."})
			return
		}
		in.ctr.status4xx.Add(1)
		writeJSON(w, http.StatusUnauthorized, map[string]string{"error": "Unauthorized"})
	})
}

// openAIStrictCheck rejects, with --openai-strict, a chat or completion body
// carrying a field OpenAI's API does not know.
func (in *Instance) openAIStrictCheck(api apiKind, body []byte) *apiError {
	if !in.cfg.OpenAIStrict || api == apiResponses {
		return nil
	}
	known := openAICompletionFields
	if api == apiChat {
		known = openAIChatFields
	}
	var top map[string]json.RawMessage
	if json.Unmarshal(body, &top) != nil {
		return nil // the regular parser reports it
	}
	var unknown []string
	for k := range top {
		if !slices.Contains(known, k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		return nil
	}
	slices.Sort(unknown)
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error",
		message: "Unrecognized request argument supplied: " + strings.Join(unknown, ", ")}
}
