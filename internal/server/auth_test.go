package server

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// validator accepts "good" tokens and counts calls.
type validator struct {
	*httptest.Server
	mu    sync.Mutex
	calls map[string]int
	code  int // forced status for every call when set
}

func newValidator(t *testing.T) *validator {
	v := &validator{calls: map[string]int{}}
	v.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
		v.mu.Lock()
		v.calls[tok]++
		code := v.code
		v.mu.Unlock()
		switch {
		case code != 0:
			w.WriteHeader(code)
		case strings.HasPrefix(tok, "good"):
			w.WriteHeader(200)
		default:
			w.WriteHeader(403)
		}
	}))
	t.Cleanup(v.Close)
	return v
}

func (v *validator) n(tok string) int {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.calls[tok]
}

func TestAuth(t *testing.T) {
	v := newValidator(t)
	e := newEnv(t, func(o *Options) {
		o.RouterAPIKeys = []string{"static-1", "static-2"}
		o.APIKeyValidationURLs = []string{v.URL}
	})
	for _, tc := range []struct {
		name, method, path, auth string
		status                   int
	}{
		{"missing", "POST", "/v1/completions", "", 401},
		{"not bearer", "POST", "/v1/completions", "Basic abc", 401},
		{"empty bearer", "POST", "/v1/completions", "Bearer  ", 401},
		{"wrong static", "POST", "/v1/completions", "Bearer static-3", 401},
		{"static", "POST", "/v1/completions", "Bearer static-2", 200},
		{"static lower-case scheme", "POST", "/v1/completions", "bearer static-1", 200},
		{"validated", "POST", "/v1/completions", "Bearer good-1", 200},
		{"validated again (cached)", "POST", "/v1/completions", "Bearer good-1", 200},
		{"rejected by validator", "POST", "/v1/completions", "Bearer bad-1", 401},
		{"rejected again (cached)", "POST", "/v1/completions", "Bearer bad-1", 401},
		{"models need auth", "GET", "/v1/models", "", 401},
		{"catch-all needs auth", "GET", "/foo", "", 401},
		{"admin falls under normal auth", "GET", "/workers", "", 401},
		{"health exempt", "GET", "/health", "", 503},
		{"liveness exempt", "GET", "/liveness", "", 200},
		{"readiness exempt", "GET", "/readiness", "", 503},
		{"health_generate not exempt", "GET", "/health_generate", "", 401},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var hdr []string
			if tc.auth != "" {
				hdr = []string{"Authorization", tc.auth}
			}
			r := e.do(tc.method, tc.path, `{}`, hdr...)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.status, tc.status, r.body)
			}
			if tc.status == 401 {
				r.errMsg(t)
				if r.header.Get("WWW-Authenticate") == "" {
					t.Fatal("no WWW-Authenticate")
				}
			}
		})
	}
	if v.n("good-1") != 1 || v.n("bad-1") != 1 {
		t.Fatalf("validator calls good=%d bad=%d, want 1 each (cache)", v.n("good-1"), v.n("bad-1"))
	}
	if v.n("static-2") != 0 {
		t.Fatal("static key sent to the validator")
	}
}

func TestAuthValidatorDown(t *testing.T) {
	v := newValidator(t)
	v.code = 500
	e := newEnv(t, func(o *Options) { o.APIKeyValidationURLs = []string{v.URL} })
	if r := e.do("POST", "/v1/completions", `{}`, "Authorization", "Bearer good-x"); r.status != 503 {
		t.Fatalf("status %d, want 503 while the validator fails", r.status)
	}
	v.mu.Lock()
	v.code = 0
	v.mu.Unlock()
	if r := e.do("POST", "/v1/completions", `{}`, "Authorization", "Bearer good-x"); r.status != 200 {
		t.Fatalf("status %d: a failed validation must not be cached", r.status)
	}
	// A second URL is tried when the first refuses.
	v2 := newValidator(t)
	e2 := newEnv(t, func(o *Options) { o.APIKeyValidationURLs = []string{"http://127.0.0.1:1/unreachable", v2.URL} })
	if r := e2.do("POST", "/v1/completions", `{}`, "Authorization", "Bearer good-y"); r.status != 200 {
		t.Fatalf("status %d via the second URL", r.status)
	}
}

func TestAuthCacheTTLAndBound(t *testing.T) {
	v := newValidator(t)
	now := time.Unix(1000, 0)
	a := newAuthenticator(nil, "", []string{v.URL}, v.Client(), slog.New(slog.DiscardHandler))
	a.now = func() time.Time { return now }
	ctx := t.Context()
	check := func(tok string, want bool) {
		t.Helper()
		ok, err := a.check(ctx, tok)
		if err != nil || ok != want {
			t.Fatalf("check(%s) = %v, %v; want %v", tok, ok, err, want)
		}
	}
	check("good-a", true)
	check("bad-a", false)
	now = now.Add(29 * time.Second)
	check("good-a", true)
	check("bad-a", false)
	if v.n("bad-a") != 1 {
		t.Fatal("negative not cached")
	}
	now = now.Add(2 * time.Second) // negative TTL (30 s) over, positive (5 min) not
	check("good-a", true)
	check("bad-a", false)
	if v.n("good-a") != 1 || v.n("bad-a") != 2 {
		t.Fatalf("calls good=%d bad=%d", v.n("good-a"), v.n("bad-a"))
	}
	now = now.Add(5 * time.Minute)
	check("good-a", true)
	if v.n("good-a") != 2 {
		t.Fatal("positive entry outlived its TTL")
	}
	a.cacheCap = 3
	for _, tok := range []string{"good-1", "good-2", "good-3", "good-4"} {
		check(tok, true)
	}
	if a.lru.Len() != 3 || len(a.cache) != 3 {
		t.Fatalf("cache size %d/%d, want 3", a.lru.Len(), len(a.cache))
	}
	check("good-1", true) // evicted (least recently used) → asked again
	if v.n("good-1") != 2 {
		t.Fatal("LRU did not evict the oldest entry")
	}
}

func TestAdminKey(t *testing.T) {
	e := newEnv(t, func(o *Options) {
		o.RouterAPIKeys = []string{"user"}
		o.AdminAPIKey = "admin"
		o.RemoveWorker = func(string) []*worker.Worker { return nil }
	})
	w := newFakeWorker(t)
	e.add(w.URL, worker.RoleRegular, -1, 1)
	for _, tc := range []struct {
		method, path, auth string
		status             int
	}{
		{"POST", "/flush_cache", "", 401},
		{"POST", "/flush_cache", "Bearer user", 401},
		{"POST", "/flush_cache", "Bearer admin", 200},
		{"POST", "/remove_worker?url=http://x:1", "Bearer user", 401},
		{"POST", "/remove_worker?url=http://x:1", "Bearer admin", 404},
		{"DELETE", "/workers/" + url.PathEscape("http://x:1"), "Bearer user", 401},
		{"DELETE", "/workers/" + url.PathEscape("http://x:1"), "Bearer admin", 404},
		{"POST", "/start_profile", "Bearer user", 401},
		{"GET", "/workers", "Bearer user", 200},  // read-only: the normal key
		{"GET", "/workers", "Bearer admin", 200}, // the admin key is a superset
		{"POST", "/v1/completions", "Bearer user", 200},
	} {
		var hdr []string
		if tc.auth != "" {
			hdr = []string{"Authorization", tc.auth}
		}
		if r := e.do(tc.method, tc.path, `{}`, hdr...); r.status != tc.status {
			t.Errorf("%s %s (%s): %d, want %d: %s", tc.method, tc.path, tc.auth, r.status, tc.status, r.body)
		}
	}
}
