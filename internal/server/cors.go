package server

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// corsPolicy implements REFERENCE §6.10: with no origins configured any
// origin, method and header is allowed; otherwise only the listed origins,
// methods GET/POST/OPTIONS and headers Content-Type/Authorization, exposing
// the request id and route receipt. Preflights are cached for an hour.
type corsPolicy struct {
	any     bool
	origins map[string]bool
}

const (
	corsMaxAge         = "3600"
	corsAllowedMethods = "GET, POST, OPTIONS"
	corsAllowedHeaders = "Content-Type, Authorization"
	corsExposedHeaders = "X-Request-Id, X-Switchyard-Route"
)

func newCORS(origins []string) (corsPolicy, error) {
	if len(origins) == 0 {
		return corsPolicy{any: true}, nil
	}
	p := corsPolicy{origins: map[string]bool{}}
	for _, o := range origins {
		o = strings.TrimRight(strings.TrimSpace(o), "/")
		if o == "*" {
			return corsPolicy{any: true}, nil
		}
		u, err := url.Parse(o)
		if err != nil || u.Scheme == "" || u.Host == "" || (u.Path != "" && u.Path != "/") {
			return corsPolicy{}, fmt.Errorf("server: invalid CORS origin %q (want scheme://host[:port])", o)
		}
		p.origins[strings.ToLower(u.Scheme+"://"+u.Host)] = true
	}
	return p, nil
}

// apply sets the CORS response headers for r and reports whether r is a
// preflight the caller must answer (204) without running the handler.
func (p corsPolicy) apply(w http.ResponseWriter, r *http.Request) (preflight bool) {
	origin := r.Header.Get("Origin")
	preflight = r.Method == http.MethodOptions && origin != "" && r.Header.Get("Access-Control-Request-Method") != ""
	if origin == "" {
		return false
	}
	h := w.Header()
	if p.any {
		h.Set("Access-Control-Allow-Origin", "*")
		if preflight {
			h.Set("Access-Control-Allow-Methods", orDefault(r.Header.Get("Access-Control-Request-Method"), "*"))
			h.Set("Access-Control-Allow-Headers", orDefault(r.Header.Get("Access-Control-Request-Headers"), "*"))
			h.Set("Access-Control-Max-Age", corsMaxAge)
		} else {
			h.Set("Access-Control-Expose-Headers", "*")
		}
		return preflight
	}
	h.Add("Vary", "Origin")
	if !p.origins[strings.ToLower(origin)] {
		return preflight // answered without CORS headers: the browser refuses
	}
	h.Set("Access-Control-Allow-Origin", origin)
	if preflight {
		h.Add("Vary", "Access-Control-Request-Method")
		h.Add("Vary", "Access-Control-Request-Headers")
		h.Set("Access-Control-Allow-Methods", corsAllowedMethods)
		h.Set("Access-Control-Allow-Headers", corsAllowedHeaders)
		h.Set("Access-Control-Max-Age", corsMaxAge)
	} else {
		h.Set("Access-Control-Expose-Headers", corsExposedHeaders)
	}
	return preflight
}

func orDefault(v, d string) string {
	if v == "" {
		return d
	}
	return v
}
