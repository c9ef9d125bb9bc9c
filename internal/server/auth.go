package server

import (
	"container/list"
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
)

// Validation cache bounds (REFERENCE §10.4 #35: the Rust cache was unbounded
// and cached negatives forever).
const (
	authCacheSize      = 1024
	authPositiveTTL    = 5 * time.Minute
	authNegativeTTL    = 30 * time.Second
	authValidateTimout = 5 * time.Second
)

const unauthorizedMessage = "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'."

var errValidatorUnavailable = errors.New("API key validation service unavailable")

// authenticator checks inbound bearer tokens. Tokens are only ever held as
// SHA-256 digests and never logged.
type authenticator struct {
	static   [][sha256.Size]byte
	admin    *[sha256.Size]byte
	urls     []string
	client   *http.Client
	log      *slog.Logger
	now      func() time.Time
	sf       singleflight.Group
	cacheMu  sync.Mutex
	cache    map[[sha256.Size]byte]*list.Element
	lru      list.List // of *authEntry, most recent first
	cacheCap int
}

type authEntry struct {
	key     [sha256.Size]byte
	valid   bool
	expires time.Time
}

func newAuthenticator(keys []string, admin string, urls []string, c *http.Client, log *slog.Logger) *authenticator {
	a := &authenticator{urls: urls, client: c, log: log, now: time.Now,
		cache: map[[sha256.Size]byte]*list.Element{}, cacheCap: authCacheSize}
	for _, k := range keys {
		if k = strings.TrimSpace(k); k != "" {
			a.static = append(a.static, sha256.Sum256([]byte(k)))
		}
	}
	if admin != "" {
		d := sha256.Sum256([]byte(admin))
		a.admin = &d
	}
	return a
}

// enabled reports whether ordinary routes need a token.
func (a *authenticator) enabled() bool { return len(a.static) > 0 || len(a.urls) > 0 }

// bearer extracts the token of "Authorization: Bearer <token>" (scheme
// case-insensitive, token trimmed).
func bearer(r *http.Request) string {
	h := r.Header.Get("Authorization")
	if len(h) < 7 || !strings.EqualFold(h[:7], "bearer ") {
		return ""
	}
	return strings.TrimSpace(h[7:])
}

// authorize applies the route's auth rule, writing 401/503 itself when it
// fails. Probes (/health, /liveness, /readiness) are exempt; admin routes
// need AdminAPIKey when one is set, and that key is accepted everywhere.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request, acc access) bool {
	a := s.auth
	if acc == accessProbe {
		return true
	}
	tok := bearer(r)
	if a.isAdmin(tok) {
		return true // the admin key also opens every ordinary route
	}
	if acc == accessAdmin && a.admin != nil {
		s.unauthorized(w, r, "Admin API key required: send it as 'Authorization: Bearer <admin key>'.")
		return false
	}
	if !a.enabled() {
		return true
	}
	if tok == "" {
		s.unauthorized(w, r, unauthorizedMessage)
		return false
	}
	ok, err := a.check(r.Context(), tok)
	if err != nil {
		if r.Context().Err() != nil {
			stateFrom(r.Context()).logOnly = 499
			return false
		}
		s.writeError(w, r, http.StatusServiceUnavailable, "auth_unavailable", err.Error())
		return false
	}
	if !ok {
		s.unauthorized(w, r, unauthorizedMessage)
	}
	return ok
}

func (s *Server) unauthorized(w http.ResponseWriter, r *http.Request, msg string) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="switchyard"`)
	s.writeError(w, r, http.StatusUnauthorized, "unauthorized", msg)
}

func (a *authenticator) isAdmin(tok string) bool {
	if a.admin == nil || tok == "" {
		return false
	}
	d := sha256.Sum256([]byte(tok))
	return subtle.ConstantTimeCompare(d[:], a.admin[:]) == 1
}

// check reports whether tok is a static key or accepted by a validation URL.
func (a *authenticator) check(ctx context.Context, tok string) (bool, error) {
	d := sha256.Sum256([]byte(tok))
	match := 0
	for i := range a.static {
		match |= subtle.ConstantTimeCompare(d[:], a.static[i][:]) // no early exit
	}
	if match == 1 {
		return true, nil
	}
	if len(a.urls) == 0 {
		return false, nil
	}
	if valid, ok := a.cached(d); ok {
		return valid, nil
	}
	// Concurrent requests with the same token share one validation round.
	ch := a.sf.DoChan(string(d[:]), func() (any, error) {
		vctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), authValidateTimout)
		defer cancel()
		valid, err := a.validate(vctx, tok)
		if err == nil {
			a.store(d, valid)
		}
		return valid, err
	})
	select {
	case res := <-ch:
		if res.Err != nil {
			return false, res.Err
		}
		return res.Val.(bool), nil
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// validate asks each URL in order; the first 200 accepts the token. A
// definite non-200 answer from every URL rejects it; if some URL could not be
// reached and none accepted, the result is unknown (error, not cached).
func (a *authenticator) validate(ctx context.Context, tok string) (bool, error) {
	unreachable := false
	for _, u := range a.urls {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			a.log.Warn("api key validation: bad URL", "url", u, "error", err)
			unreachable = true
			continue
		}
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := a.client.Do(req)
		if err != nil {
			a.log.Warn("api key validation: request failed", "url", u, "error", err)
			unreachable = true
			continue
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		_ = resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return true, nil
		}
		if resp.StatusCode >= 500 {
			unreachable = true
		}
	}
	if unreachable {
		return false, errValidatorUnavailable
	}
	return false, nil
}

func (a *authenticator) cached(d [sha256.Size]byte) (valid, ok bool) {
	a.cacheMu.Lock()
	defer a.cacheMu.Unlock()
	el, found := a.cache[d]
	if !found {
		return false, false
	}
	e := el.Value.(*authEntry)
	if !a.now().Before(e.expires) {
		a.lru.Remove(el)
		delete(a.cache, d)
		return false, false
	}
	a.lru.MoveToFront(el)
	return e.valid, true
}

func (a *authenticator) store(d [sha256.Size]byte, valid bool) {
	ttl := authNegativeTTL
	if valid {
		ttl = authPositiveTTL
	}
	a.cacheMu.Lock()
	defer a.cacheMu.Unlock()
	if el, found := a.cache[d]; found {
		e := el.Value.(*authEntry)
		e.valid, e.expires = valid, a.now().Add(ttl)
		a.lru.MoveToFront(el)
		return
	}
	for a.lru.Len() >= a.cacheCap {
		old := a.lru.Back()
		delete(a.cache, old.Value.(*authEntry).key)
		a.lru.Remove(old)
	}
	a.cache[d] = a.lru.PushFront(&authEntry{key: d, valid: valid, expires: a.now().Add(ttl)})
}
