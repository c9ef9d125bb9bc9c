package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// TestIGWPDModelBesideRegular: --enable-igw with a regular model
// (--worker-urls) and a PD NIXL model (--prefill/--decode) behind one
// router, a second PD model added at runtime with POST /workers; each
// request is split (PD) or proxied (regular) on its own model's workers,
// bad input is a clear 4xx, and a PD model missing a role is a 503 saying
// which while the others keep serving.
func TestIGWPDModelBesideRegular(t *testing.T) {
	chat := startSim(t, "--role", "unified", "--model", "chat", "--max-model-len", "4096")
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict", "--model", "big", "--max-model-len", "8192")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict", "--model", "big", "--max-model-len", "16384")
	r := startRouter(t, "--enable-igw", "--kv-connector", "nixl", "--policy", "round_robin",
		"--worker-urls", chat.URL(), "--prefill", p.URL(), "--decode", d.URL(),
		"--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--retry-initial-backoff-ms", "5")
	ctx := ctxT(t, 90*time.Second)
	waitFor(t, 15*time.Second, "the three static workers registered with their models", func() bool {
		var ws struct {
			Total int `json:"total"`
		}
		return getJSON(t, r.Base+"/workers", &ws) == 200 && ws.Total == 3
	})
	if got := listModels(t, r.Base); !slices.Equal(got, []string{"big", "chat"}) {
		t.Fatalf("/v1/models: %v", got)
	}
	complete := func(model string, stream bool) (int, []byte) {
		t.Helper()
		code, _, body := post(t, ctx, r.Base+"/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":"the quick brown fox","max_tokens":4,"stream":%t}`, model, stream))
		return code, body
	}
	for range 3 {
		for _, m := range []string{"big", "chat"} {
			code, body := complete(m, false)
			if code != 200 || completionText(t, body) == "" {
				t.Fatalf("%s: %d %s", m, code, body)
			}
		}
	}
	code, body := complete("big", true)
	if text, events := harness.SSEText(t, body); code != 200 || text == "" || events == 0 {
		t.Fatalf("big streamed: %d %s", code, body)
	}
	waitFor(t, 10*time.Second, "big's 4 requests split on its pair", func() bool {
		ps, ds := p.Stats(t), d.Stats(t)
		return ps.Requests.PrefillLeg == 4 && ds.Requests.DecodeLeg == 4 && ds.Transfers.Completed == 4
	})
	if ds := d.Stats(t); ds.Transfers.ProtocolViolations != 0 {
		t.Fatalf("big's decode saw protocol violations: %s", ds.Transfers.LastProtocolViolation)
	}
	if cs := chat.Stats(t); cs.Requests.Completions != 3 || cs.Requests.PrefillLeg+cs.Requests.DecodeLeg != 0 {
		t.Fatalf("chat served %+v, want 3 plain completions", cs.Requests)
	}

	// /tokenize goes to the named model's fleet (a PD model's prefill);
	// the sims tell themselves apart by max_model_len.
	for _, tc := range []struct {
		model string
		want  int
	}{{"chat", 4096}, {"big", 8192}} {
		var tok struct {
			Count       int `json:"count"`
			MaxModelLen int `json:"max_model_len"`
		}
		code, _, body := post(t, ctx, r.Base+"/tokenize", fmt.Sprintf(`{"model":%q,"prompt":"a b c"}`, tc.model))
		if code != 200 || json.Unmarshal(body, &tok) != nil || tok.Count != 3 || tok.MaxModelLen != tc.want {
			t.Fatalf("/tokenize %s: %d %s, want max_model_len %d", tc.model, code, body, tc.want)
		}
	}
	if code, _, body := post(t, ctx, r.Base+"/tokenize", `{"prompt":"a b c"}`); code != 400 || !strings.Contains(string(body), "several models (big, chat)") {
		t.Fatalf("/tokenize without a model: %d %s", code, body)
	}

	// A second PD model at runtime: prefill with its model_id, decode
	// with the model read from the worker.
	p2 := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict", "--model", "small")
	d2 := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict", "--model", "small")
	addWorker := func(body string) (int, []byte) {
		t.Helper()
		code, _, b := post(t, ctx, r.Base+"/workers", body)
		return code, b
	}
	if code, body := addWorker(fmt.Sprintf(`{"url":%q,"worker_type":"prefill","model_id":"small","labels":{"policy":"random"}}`, p2.URL())); code != 200 {
		t.Fatalf("add small's prefill: %d %s", code, body)
	}
	if code, body := addWorker(fmt.Sprintf(`{"url":%q,"worker_type":"decode"}`, d2.URL())); code != 200 {
		t.Fatalf("add small's decode (model discovered): %d %s", code, body)
	}
	waitFor(t, 10*time.Second, "small served", func() bool {
		code, _ := complete("small", false)
		return code == 200
	})
	if st := p2.Stats(t); st.Requests.PrefillLeg < 1 || d2.Stats(t).Requests.DecodeLeg < 1 || p.Stats(t).Requests.PrefillLeg != 4 || d.Stats(t).Requests.DecodeLeg != 4 {
		t.Fatalf("small's legs: prefill %d, decode %d (big's: %d, %d, want 4 each: small stays on its pair)",
			st.Requests.PrefillLeg, d2.Stats(t).Requests.DecodeLeg, p.Stats(t).Requests.PrefillLeg, d.Stats(t).Requests.DecodeLeg)
	}
	var ws struct {
		Models map[string]struct {
			Kind          string   `json:"kind"`
			Policy        string   `json:"policy"`
			PrefillPolicy string   `json:"prefill_policy"`
			DecodePolicy  string   `json:"decode_policy"`
			Prefill       int      `json:"prefill"`
			Decode        int      `json:"decode"`
			Workers       []string `json:"workers"`
		} `json:"models"`
	}
	if code := getJSON(t, r.Base+"/workers", &ws); code != 200 || ws.Models["big"].Kind != "pd" || ws.Models["big"].Prefill != 1 ||
		ws.Models["big"].Decode != 1 || ws.Models["big"].PrefillPolicy != "round_robin" || ws.Models["small"].DecodePolicy != "random" ||
		ws.Models["chat"].Kind != "regular" || ws.Models["chat"].Policy != "round_robin" {
		t.Fatalf("/workers by model: %d %+v", code, ws.Models)
	}

	spare := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--model", "chat")
	for _, bad := range []struct{ body, want string }{
		{fmt.Sprintf(`{"url":%q,"worker_type":"prefill","model_id":"chat"}`, spare.URL()), `model \"chat\" is served by regular workers; a prefill worker cannot join it`},
		{fmt.Sprintf(`{"url":%q,"worker_type":"decode","model_id":"big","bootstrap_port":8998}`, spare.URL()), "bootstrap_port is only for prefill workers"},
		{fmt.Sprintf(`{"url":%q,"worker_type":"prefill","model_id":"big","bootstrap_port":0}`, spare.URL()), "bootstrap_port 0: must be between 1 and 65535"},
		{fmt.Sprintf(`{"url":%q,"worker_type":"encoder","model_id":"big"}`, spare.URL()), "unknown worker role"},
		{fmt.Sprintf(`{"url":%q,"worker_type":"decode","model_id":"other"}`, p.URL()), `already serves model \"big\"`},
		{fmt.Sprintf(`{"url":%q,"worker_type":"prefill","bootstrap_port":"x"}`, spare.URL()), "Invalid JSON body"},
	} {
		if code, body := addWorker(bad.body); code < 400 || code >= 500 || !strings.Contains(string(body), bad.want) {
			t.Errorf("POST /workers %s: %d %s, want a 4xx with %q", bad.body, code, body, bad.want)
		}
	}

	// A PD model with one role only.
	lonely := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--model", "lonely")
	if code, body := addWorker(fmt.Sprintf(`{"url":%q,"worker_type":"prefill","model_id":"lonely"}`, lonely.URL())); code != 200 {
		t.Fatalf("add lonely: %d %s", code, body)
	}
	waitFor(t, 10*time.Second, "lonely answered 503 naming its missing role", func() bool {
		code, body := complete("lonely", false)
		return code == 503 && strings.Contains(string(body), `Model \"lonely\" has no decode workers (1 prefill registered)`)
	})

	// big's decode dies: 503 saying which role, the others keep serving.
	d.Kill()
	waitFor(t, 20*time.Second, "big answered 503 naming its decode role", func() bool {
		code, body := complete("big", false)
		return code == 503 && strings.Contains(string(body), `Model \"big\" has no live decode workers`)
	})
	for _, m := range []string{"chat", "small"} {
		if code, body := complete(m, false); code != 200 {
			t.Fatalf("%s with big's decode down: %d %s", m, code, body)
		}
	}

	// Removing lonely's only worker removes the model.
	req, _ := http.NewRequestWithContext(ctx, "DELETE", r.Base+"/workers/"+url.PathEscape(lonely.URL()), nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("DELETE lonely: %d", resp.StatusCode)
	}
	if code, body := complete("lonely", false); code != 404 || !strings.Contains(string(body), "The model `lonely` does not exist.") {
		t.Fatalf("removed model: %d %s", code, body)
	}
}

// TestIGWPDMooncake: a Mooncake PD model added with POST /workers (the
// prefill's bootstrap_port given) is served beside a regular model; the
// model's engine queries the prefill's bootstrap server in the background.
func TestIGWPDMooncake(t *testing.T) {
	chat := startSim(t, "--role", "unified", "--model", "chat")
	p := startSim(t, "--role", "prefill", "--kv-connector", "mooncake", "--bootstrap-port", "0", "--strict", "--model", "mc")
	d := startSim(t, "--role", "decode", "--kv-connector", "mooncake", "--strict", "--model", "mc")
	r := startRouter(t, "--enable-igw", "--kv-connector", "mooncake", "--worker-urls", chat.URL())
	ctx := ctxT(t, 60*time.Second)
	for _, body := range []string{
		fmt.Sprintf(`{"url":%q,"worker_type":"prefill","bootstrap_port":%d}`, p.URL(), p.Info.BootstrapPort),
		fmt.Sprintf(`{"url":%q,"worker_type":"decode","model_id":"mc"}`, d.URL()),
	} {
		if code, _, b := post(t, ctx, r.Base+"/workers", body); code != 200 {
			t.Fatalf("POST /workers %s: %d %s", body, code, b)
		}
	}
	waitFor(t, 15*time.Second, "mc served once the bootstrap query answered", func() bool {
		code, _, _ := post(t, ctx, r.Base+"/v1/completions", `{"model":"mc","prompt":"warm up","max_tokens":2}`)
		return code == 200
	})
	code, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":"mc","prompt":"the quick brown fox","max_tokens":4}`)
	if code != 200 || completionText(t, body) == "" {
		t.Fatalf("mc: %d %s", code, body)
	}
	if ps, ds := p.Stats(t), d.Stats(t); ps.Requests.PrefillLeg < 2 || ds.Requests.DecodeLeg < 2 || ds.Transfers.ProtocolViolations != 0 {
		t.Fatalf("mc legs: prefill %d decode %d violations %d", ps.Requests.PrefillLeg, ds.Requests.DecodeLeg, ds.Transfers.ProtocolViolations)
	}
	if code, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":"chat","prompt":"x","max_tokens":2}`); code != 200 {
		t.Fatalf("chat: %d %s", code, body)
	}
}
