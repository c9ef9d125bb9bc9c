package e2e

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// TestIGWDiscoveredMoRIIO: --enable-igw with ZMQ discovery. Two PD models
// (MoRI-IO WRITE pairs registering over ZMQ; a registration carries no
// model, so each instance's /v1/models names it) beside a static regular
// model: each request is split on its own model's pair, a model whose
// decode stopped registering is a 503 saying so, and a model whose last
// instance expired is gone while the others keep serving.
func TestIGWDiscoveredMoRIIO(t *testing.T) {
	addr := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
	chat := startSim(t, "--role", "unified", "--model", "chat")
	r := startRouter(t, "--enable-igw", "--kv-connector", "moriio", "--vllm-discovery-address", addr, "--discovery-ttl-secs", "1.5",
		"--kv-wait-timeout-secs", "10", "--policy", "round_robin", "--worker-urls", chat.URL())
	simArgs := []string{"--kv-connector", "moriio", "--transfer-mode", "WRITE", "--proxy-address", addr, "--heartbeat-interval", "200ms", "--strict"}
	pair := func(model string) (*sim, *sim) {
		return startSim(t, append([]string{"--role", "prefill", "--model", model}, simArgs...)...),
			startSim(t, append([]string{"--role", "decode", "--model", model}, simArgs...)...)
	}
	bigP, bigD := pair("big")
	smallP, smallD := pair("small")
	waitFor(t, 20*time.Second, "five workers registered with their models", func() bool {
		var ws struct {
			Models map[string]struct {
				Total int `json:"total"`
			} `json:"models"`
		}
		return getJSON(t, r.Base+"/workers", &ws) == 200 && ws.Models["big"].Total == 2 && ws.Models["small"].Total == 2 && ws.Models["chat"].Total == 1
	})
	if got := listModels(t, r.Base); !slices.Equal(got, []string{"big", "chat", "small"}) {
		t.Fatalf("/v1/models: %v", got)
	}
	ctx := ctxT(t, 90*time.Second)
	complete := func(model string, stream bool) (int, []byte) {
		t.Helper()
		code, _, body := post(t, ctx, r.Base+"/v1/completions",
			fmt.Sprintf(`{"model":%q,"prompt":"a b c d","max_tokens":3,"stream":%t}`, model, stream))
		return code, body
	}
	for i := range 4 {
		for _, m := range []string{"big", "small", "chat"} {
			code, body := complete(m, i%2 == 1)
			if code != 200 {
				t.Fatalf("%s: %d %s", m, code, body)
			}
		}
	}
	for _, s := range []struct {
		name string
		p, d *sim
	}{{"big", bigP, bigD}, {"small", smallP, smallD}} {
		waitFor(t, 10*time.Second, s.name+"'s 4 requests split on its own pair", func() bool {
			return s.p.Stats(t).Requests.PrefillLeg == 4 && s.d.Stats(t).Requests.DecodeLeg == 4
		})
		if ds := s.d.Stats(t); ds.Transfers.ProtocolViolations != 0 {
			t.Fatalf("%s: protocol violations: %s", s.name, ds.Transfers.LastProtocolViolation)
		}
	}
	if n := chat.Stats(t).Requests.Completions; n != 4 {
		t.Fatalf("chat served %d, want 4", n)
	}

	// small's decode stops registering: once it expires, small is a 503
	// naming the missing role.
	smallD.Kill()
	waitFor(t, 20*time.Second, "small answered 503 naming its decode role", func() bool {
		code, body := complete("small", false)
		return code == 503 && strings.Contains(string(body), `Model \"small\" has no decode workers (1 prefill registered)`)
	})
	// ... and with its prefill gone too, the model is gone.
	smallP.Kill()
	waitFor(t, 20*time.Second, "small gone", func() bool {
		code, body := complete("small", false)
		return code == 404 && strings.Contains(string(body), "The model `small` does not exist.")
	})
	if got := listModels(t, r.Base); !slices.Equal(got, []string{"big", "chat"}) {
		t.Fatalf("/v1/models after small left: %v", got)
	}
	for _, m := range []string{"big", "chat"} {
		if code, body := complete(m, false); code != 200 {
			t.Fatalf("%s after small left: %d %s", m, code, body)
		}
	}
}
