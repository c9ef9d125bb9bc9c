package e2e

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"
)

type simCompletions struct {
	Requests struct {
		Completions int64 `json:"completions"`
	} `json:"requests"`
}

func completionsServed(t *testing.T, s *sim) int64 {
	t.Helper()
	var st simCompletions
	if code := getJSON(t, s.URL()+"/sim/stats", &st); code != 200 {
		t.Fatalf("%s /sim/stats: %d", s.URL(), code)
	}
	return st.Requests.Completions
}

func listModels(t *testing.T, base string) []string {
	t.Helper()
	var l struct {
		Data []struct{ ID string } `json:"data"`
	}
	if code := getJSON(t, base+"/v1/models", &l); code != 200 {
		return nil
	}
	var ids []string
	for _, m := range l.Data {
		ids = append(ids, m.ID)
	}
	slices.Sort(ids)
	return ids
}

// TestIGWMultiModel: --enable-igw with two models from --worker-urls (each
// worker's model read from its /v1/models) and two more added at runtime
// with POST /workers; every request lands on its model's fleet, bad input
// is a clear 4xx, a model whose fleet died is a 503 naming it while the
// others keep serving, and a removed model is gone.
func TestIGWMultiModel(t *testing.T) {
	a1 := startSim(t, "--role", "unified", "--model", "llama")
	a2 := startSim(t, "--role", "unified", "--model", "llama")
	b1 := startSim(t, "--role", "unified", "--model", "qwen")
	r := startRouter(t, "--enable-igw", "--worker-urls", a1.URL(), a2.URL(), b1.URL(), "--policy", "round_robin",
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--retry-initial-backoff-ms", "5")
	ctx := ctxT(t, 90*time.Second)
	waitFor(t, 15*time.Second, "the three static workers registered with their models", func() bool {
		var ws struct {
			Total int `json:"total"`
		}
		return getJSON(t, r.Base+"/workers", &ws) == 200 && ws.Total == 3
	})
	if got := listModels(t, r.Base); !slices.Equal(got, []string{"llama", "qwen"}) {
		t.Fatalf("/v1/models: %v", got)
	}

	complete := func(model string) (int, []byte) {
		t.Helper()
		m := ""
		if model != "" {
			m = fmt.Sprintf(`"model":%q,`, model)
		}
		code, _, body := post(t, ctx, r.Base+"/v1/completions", `{`+m+`"prompt":"hello","max_tokens":2}`)
		return code, body
	}
	for range 4 {
		if code, body := complete("llama"); code != 200 {
			t.Fatalf("llama: %d %s", code, body)
		}
	}
	for range 2 {
		if code, body := complete("qwen"); code != 200 {
			t.Fatalf("qwen: %d %s", code, body)
		}
	}
	// Each model's requests stayed in its fleet (how llama's four were
	// spread between its two workers depends on their health, not checked).
	if na1, na2, nb := completionsServed(t, a1), completionsServed(t, a2), completionsServed(t, b1); na1+na2 != 4 || nb != 2 {
		t.Fatalf("served: llama %d+%d (want 4), qwen %d (want 2)", na1, na2, nb)
	}
	if code, body := complete("gpt-9"); code != 404 || !strings.Contains(string(body), "The model `gpt-9` does not exist.") {
		t.Fatalf("unknown model: %d %s", code, body)
	}
	if code, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":["llama"],"prompt":"x"}`); code != 400 || !strings.Contains(string(body), "model must be a string") {
		t.Fatalf("non-string model: %d %s", code, body)
	}
	if code, body := complete(""); code != 400 || !strings.Contains(string(body), "several models (llama, qwen)") {
		t.Fatalf("no model: %d %s", code, body)
	}

	// Runtime additions: one with model_id and labels.policy, one whose
	// model the router reads from the worker.
	c1 := startSim(t, "--role", "unified", "--model", "mistral")
	d1 := startSim(t, "--role", "unified", "--model", "phi")
	addWorker := func(body string) (int, []byte) {
		t.Helper()
		code, _, b := post(t, ctx, r.Base+"/workers", body)
		return code, b
	}
	if code, body := addWorker(fmt.Sprintf(`{"url":%q,"model_id":"mistral","worker_type":"regular","labels":{"policy":"random"}}`, c1.URL())); code != 200 {
		t.Fatalf("add mistral: %d %s", code, body)
	}
	if code, body := addWorker(fmt.Sprintf(`{"url":%q}`, d1.URL())); code != 200 {
		t.Fatalf("add phi (model discovered): %d %s", code, body)
	}
	for _, bad := range []struct {
		body string
		want string
	}{
		{fmt.Sprintf(`{"url":%q,"model_id":"x","worker_type":"router"}`, c1.URL()), "unknown worker role"},
		{fmt.Sprintf(`{"url":%q,"model_id":"mistral","worker_type":"prefill"}`, startSim(t, "--model", "mistral").URL()), `model \"mistral\" is served by regular workers`},
		{`{"url":"http://127.0.0.1:1","model_id":5}`, "Invalid JSON body"},
		{`{"url":`, "Invalid JSON body"},
		{fmt.Sprintf(`{"url":%q,"model_id":"other"}`, a1.URL()), `already serves model \"llama\"`},
		{fmt.Sprintf(`{"url":%q,"model_id":"mistral","labels":{"policy":"cache_aware"}}`, startSim(t, "--model", "mistral").URL()), `already routes with policy \"random\"`},
		{fmt.Sprintf(`{"url":%q,"model_id":"z","labels":{"policy":7}}`, c1.URL()), "Invalid JSON body"},
	} {
		if code, body := addWorker(bad.body); code < 400 || code >= 500 || !strings.Contains(string(body), bad.want) {
			t.Errorf("POST /workers %s: %d %s, want a 4xx with %q", bad.body, code, body, bad.want)
		}
	}
	for _, m := range []string{"mistral", "phi"} {
		if code, body := complete(m); code != 200 {
			t.Fatalf("%s: %d %s", m, code, body)
		}
	}
	if completionsServed(t, c1) != 1 || completionsServed(t, d1) != 1 {
		t.Fatalf("runtime workers served %d and %d", completionsServed(t, c1), completionsServed(t, d1))
	}
	waitFor(t, 10*time.Second, "four models listed", func() bool {
		return slices.Equal(listModels(t, r.Base), []string{"llama", "mistral", "phi", "qwen"})
	})

	var ws struct {
		Models map[string]struct {
			Policy  string   `json:"policy"`
			Total   int      `json:"total"`
			Healthy int      `json:"healthy"`
			Workers []string `json:"workers"`
		} `json:"models"`
	}
	if code := getJSON(t, r.Base+"/workers", &ws); code != 200 || ws.Models["llama"].Total != 2 ||
		ws.Models["mistral"].Policy != "random" || ws.Models["qwen"].Policy != "round_robin" || len(ws.Models) != 4 {
		t.Fatalf("/workers by model: %d %+v", code, ws.Models)
	}

	// qwen's fleet dies: 503 naming qwen, the others keep serving.
	b1.Kill()
	waitFor(t, 20*time.Second, "qwen answered 503 naming it", func() bool {
		code, body := complete("qwen")
		return code == 503 && strings.Contains(string(body), `Model \"qwen\" has no live workers`)
	})
	for _, m := range []string{"llama", "mistral", "phi"} {
		if code, body := complete(m); code != 200 {
			t.Fatalf("%s with qwen down: %d %s", m, code, body)
		}
	}
	waitFor(t, 10*time.Second, "qwen gone from /v1/models", func() bool {
		return slices.Equal(listModels(t, r.Base), []string{"llama", "mistral", "phi"})
	})

	// Removing mistral's worker removes the model.
	req, _ := http.NewRequestWithContext(ctx, "DELETE", r.Base+"/workers/"+url.PathEscape(c1.URL()), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("DELETE: %d %s", resp.StatusCode, b)
	}
	code, body := complete("mistral")
	var e struct{ Error struct{ Param string } }
	if code != 404 || json.Unmarshal(body, &e) != nil || e.Error.Param != "model" {
		t.Fatalf("removed model: %d %s", code, body)
	}
}
