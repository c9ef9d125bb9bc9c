package igw

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/openai"
)

// statusWriter records the status of a response; Unwrap keeps flushing
// and hijacking (http.ResponseController) working.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() { _ = http.NewResponseController(s.ResponseWriter).Flush() }

func (s *statusWriter) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// statusClass is "2xx", "4xx", ... ("none" when nothing was written: the
// client went away first).
func statusClass(code int) string {
	if code < 100 || code > 599 {
		return "none"
	}
	return strconv.Itoa(code/100) + "xx"
}

var errModelRequired = errors.New("model is required")

// requestModel reads a body's "model" (v, nil when absent).
func requestModel(v []byte, models []string) (string, error) {
	if v == nil || string(v) == "null" {
		if len(models) == 1 {
			return models[0], nil
		}
		if len(models) == 0 {
			return "", fmt.Errorf("%w (no model is being served yet)", errModelRequired)
		}
		return "", fmt.Errorf("%w: this router serves several models (%s)", errModelRequired, strings.Join(models, ", "))
	}
	var s string
	if v[0] != '"' || json.Unmarshal(v, &s) != nil {
		return "", fmt.Errorf("model must be a string, got %s", truncate(string(v), 64))
	}
	return s, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// writeError writes vLLM's error body with param set.
func writeError(w http.ResponseWriter, status int, msg, param string) {
	var p *string
	if param != "" {
		p = &param
	}
	b, _ := json.Marshal(openai.ErrorBody{Error: openai.ErrorDetail{Message: msg, Type: openai.TypeFor(status), Param: p, Code: status}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}
