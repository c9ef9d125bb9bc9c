// Package openai holds the small pieces of the OpenAI/vLLM wire format the
// router needs: error bodies and the few request fields it reads.
package openai

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// ErrorBody is vLLM's (newer) error shape: {"error": {...}}.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the inner error object.
type ErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// TypeFor returns the OpenAI error type name for an HTTP status.
func TypeFor(status int) string {
	switch {
	case status == http.StatusBadRequest, status == http.StatusUnprocessableEntity:
		return "BadRequestError"
	case status == http.StatusUnauthorized:
		return "AuthenticationError"
	case status == http.StatusForbidden:
		return "PermissionDeniedError"
	case status == http.StatusNotFound:
		return "NotFoundError"
	case status == http.StatusMethodNotAllowed:
		return "MethodNotAllowedError"
	case status == http.StatusRequestTimeout:
		return "TimeoutError"
	case status == http.StatusRequestEntityTooLarge:
		return "RequestTooLargeError"
	case status == http.StatusTooManyRequests:
		return "RateLimitError"
	case status == http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	case status == http.StatusBadGateway:
		return "BadGatewayError"
	case status == http.StatusGatewayTimeout:
		return "GatewayTimeoutError"
	case status >= 500:
		return "InternalServerError"
	}
	return "Error"
}

// MarshalError returns the JSON error body for status and message.
func MarshalError(status int, message string) []byte {
	b, _ := json.Marshal(ErrorBody{Error: ErrorDetail{Message: message, Type: TypeFor(status), Code: status}})
	return b
}

// WriteError writes an OpenAI-style JSON error response.
func WriteError(w http.ResponseWriter, status int, message string) {
	b := MarshalError(status, message)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// SSEError returns a mid-stream error event followed by [DONE], as vLLM
// emits when a stream fails after its headers were sent.
func SSEError(status int, message string) []byte {
	b := MarshalError(status, message)
	out := make([]byte, 0, len(b)+32)
	out = append(out, "data: "...)
	out = append(out, b...)
	out = append(out, "\n\ndata: [DONE]\n\n"...)
	return out
}
