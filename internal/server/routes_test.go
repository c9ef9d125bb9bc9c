package server

import (
	"net/http"
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// TestGenerationRoutesDispatch pins the shortcut serveHTTP takes for a
// generation route (the handler classify found, not a second mux lookup):
// each generation path's POST reaches the dispatcher with its route, and a
// request the mux would answer otherwise (another method, a path it
// redirects, a neighbour path) never does.
func TestGenerationRoutesDispatch(t *testing.T) {
	const body = `{"model":"m1","prompt":"hi"}`
	e := newEnv(t, nil)
	e.add("http://w1:8000", worker.RoleRegular, -1, 1)
	for _, p := range generationPaths {
		n := e.gen.count()
		r := e.do(http.MethodPost, p, body, "Content-Type", "application/json")
		if r.status != http.StatusOK || e.gen.count() != n+1 {
			t.Fatalf("POST %s: status %d, dispatched %d times: %s", p, r.status, e.gen.count()-n, r.body)
		}
		if got := e.gen.last().Route; got != p {
			t.Errorf("POST %s: the call's route is %q", p, got)
		}
	}
	for _, tc := range []struct{ method, path string }{
		{http.MethodGet, "/v1/completions"},
		{http.MethodPut, "/v1/chat/completions"},
		{http.MethodPost, "/v1//completions"},
		{http.MethodPost, "/v1/completions/"},
		{http.MethodPost, "/v1/completionsx"},
	} {
		n := e.gen.count()
		req, err := http.NewRequestWithContext(t.Context(), tc.method, e.srv.URL+tc.path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		// Not followed: a redirect's target would be dispatched.
		c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		req.Header.Set("Content-Type", "application/json")
		res, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.path, err)
		}
		res.Body.Close()
		if e.gen.count() != n {
			t.Errorf("%s %s: status %d, dispatched %d times", tc.method, tc.path, res.StatusCode, e.gen.count()-n)
		}
	}
}
