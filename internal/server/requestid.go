package server

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
)

// maxRequestIDLen bounds an inbound id we echo back and log.
const maxRequestIDLen = 256

var defaultRequestIDHeaders = []string{"x-request-id", "x-correlation-id", "x-trace-id", "request-id"}

func requestIDHeaders(in []string) ([]string, error) {
	if len(in) == 0 {
		in = defaultRequestIDHeaders
	}
	out := make([]string, 0, len(in))
	for _, h := range in {
		h = strings.TrimSpace(h)
		if h == "" || strings.ContainsAny(h, " \t\r\n:") {
			return nil, fmt.Errorf("server: invalid request id header name %q", h)
		}
		out = append(out, http.CanonicalHeaderKey(h))
	}
	return out, nil
}

// requestID returns the first valid id among the configured headers, else a
// generated one: a route-dependent prefix (chatcmpl-, cmpl-, gnt-, req-, as
// in the Rust router) and 24 random alphanumerics.
func (s *Server) requestID(r *http.Request) string {
	for _, h := range s.idHeaders { // canonical: Header.Get without its canonicalization
		if vs := r.Header[h]; len(vs) > 0 && validRequestID(vs[0]) {
			return vs[0]
		}
	}
	return newRequestID(r.URL.Path)
}

// validRequestID accepts 1..256 visible ASCII characters, so an echoed id is
// always a legal header value and a single log token.
func validRequestID(v string) bool {
	if v == "" || len(v) > maxRequestIDLen {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= 0x20 || c >= 0x7f {
			return false
		}
	}
	return true
}

const idAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"

func newRequestID(path string) string {
	prefix := "req-"
	switch {
	case strings.Contains(path, "/chat/completions"):
		prefix = "chatcmpl-"
	case strings.Contains(path, "/completions"):
		prefix = "cmpl-"
	case strings.Contains(path, "/generate"):
		prefix = "gnt-"
	}
	var buf [len("chatcmpl-") + 24]byte // the longest prefix: on the stack
	b := buf[:len(prefix)+24]
	copy(b, prefix)
	for i := len(prefix); i < len(b); {
		// One 64-bit draw yields ten 6-bit indexes; reject 62 and 63 to stay uniform.
		x := rand.Uint64()
		for k := 0; k < 10 && i < len(b); k++ {
			if c := x & 63; c < 62 {
				b[i] = idAlphabet[c]
				i++
			}
			x >>= 6
		}
	}
	return string(b)
}
