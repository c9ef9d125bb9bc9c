package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestIGWConfigFileModels: the config file's models sections set a
// model's policy (a conflicting labels.policy is refused) and bound its
// requests in flight: with one stream open, the next request for that
// model is a 429 while other models keep serving.
func TestIGWConfigFileModels(t *testing.T) {
	a := startSim(t, "--role", "unified", "--model", "org/alpha")
	b := startSim(t, "--role", "unified", "--model", "beta")
	cfg := filepath.Join(t.TempDir(), "router.yaml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`enable_igw: true
worker_urls: [%s, %s]
models:
  org/alpha: {policy: random, max_concurrent_requests: 1}
`, a.URL(), b.URL())), 0o600); err != nil {
		t.Fatal(err)
	}
	r := startRouter(t, "--config", cfg, "--policy", "round_robin")
	type models struct {
		Models map[string]struct {
			Policy        string `json:"policy"`
			InFlight      int    `json:"in_flight"`
			MaxConcurrent int    `json:"max_concurrent_requests"`
		} `json:"models"`
	}
	waitFor(t, 15*time.Second, "both models registered", func() bool {
		var ws models
		return getJSON(t, r.Base+"/workers", &ws) == 200 && len(ws.Models) == 2
	})
	var ws models
	getJSON(t, r.Base+"/workers", &ws)
	if m := ws.Models["org/alpha"]; m.Policy != "random" || m.MaxConcurrent != 1 || ws.Models["beta"].Policy != "round_robin" {
		t.Fatalf("/workers models: %+v", ws.Models)
	}
	ctx := ctxT(t, 60*time.Second)
	spare := startSim(t, "--role", "unified", "--model", "org/alpha")
	if code, _, body := post(t, ctx, r.Base+"/workers", fmt.Sprintf(`{"url":%q,"labels":{"policy":"cache_aware"}}`, spare.URL())); code != 400 ||
		!strings.Contains(string(body), `model \"org/alpha\" takes its policies from the config file`) {
		t.Fatalf("conflicting labels.policy: %d %s", code, body)
	}

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, _ := http.NewRequestWithContext(sctx, "POST", r.Base+"/v1/completions",
		strings.NewReader(`{"model":"org/alpha","prompt":"a b c","max_tokens":5000,"stream":true,"ignore_eos":true}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || resp.StatusCode != 200 {
		t.Fatalf("stream: %d %v", resp.StatusCode, err)
	}
	code, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":"org/alpha","prompt":"x","max_tokens":2}`)
	if code != 429 || !strings.Contains(string(body), `Model \"org/alpha\" is at its limit of 1 concurrent requests`) {
		t.Fatalf("second alpha request: %d %s", code, body)
	}
	if code, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":"beta","prompt":"x","max_tokens":2}`); code != 200 {
		t.Fatalf("beta while alpha is full: %d %s", code, body)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, 10*time.Second, "alpha's slot freed", func() bool {
		code, _, _ := post(t, ctx, r.Base+"/v1/completions", `{"model":"org/alpha","prompt":"x","max_tokens":2}`)
		return code == 200
	})
}
