package e2e

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
	"github.com/switchyard-llm/switchyard/internal/tracing/otlptest"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// streamView is what a client reads from one streamed answer.
type streamView struct {
	text     string
	ids      []string
	created  []float64
	roles    int
	finish   string
	usage    map[string]float64
	tokenIDs []uint32
	prompts  int // chunks carrying prompt_token_ids
}

func readView(t *testing.T, body []byte) streamView {
	t.Helper()
	var v streamView
	text, _ := harness.SSEText(t, body) // framing, [DONE], no error event
	v.text = text
	harness.EachSSEData(t, body, func(data []byte) {
		var c struct {
			ID             string          `json:"id"`
			Created        float64         `json:"created"`
			PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
			Choices        []struct {
				Delta struct {
					Role *string `json:"role"`
				} `json:"delta"`
				FinishReason   *string         `json:"finish_reason"`
				TokenIDs       []uint32        `json:"token_ids"`
				PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
			} `json:"choices"`
			Usage map[string]float64 `json:"usage"`
		}
		if err := json.Unmarshal(data, &c); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		v.ids = append(v.ids, c.ID)
		v.created = append(v.created, c.Created)
		if c.PromptTokenIDs != nil {
			v.prompts++
		}
		for _, ch := range c.Choices {
			if ch.Delta.Role != nil {
				v.roles++
			}
			if ch.FinishReason != nil {
				v.finish = *ch.FinishReason
			}
			if ch.PromptTokenIDs != nil {
				v.prompts++
			}
			v.tokenIDs = append(v.tokenIDs, ch.TokenIDs...)
		}
		if c.Usage != nil {
			v.usage = c.Usage
		}
	})
	return v
}

func sameAll[T comparable](xs []T) bool {
	for _, x := range xs {
		if x != xs[0] {
			return false
		}
	}
	return true
}

// TestMigrateRegularMidStream: a worker that cuts every answer after a
// few tokens (the cut_after_tokens fault: the connection closes, no
// [DONE]) and one that works. Round robin sends half of the requests to
// the cutting worker; each of those continues on the other, and every
// client gets one uninterrupted answer equal to the oracle's, token for
// token: one id, one created, one role delta, usage over the whole answer,
// finish_reason "length". Streaming and not, completions and chat.
func TestMigrateRegularMidStream(t *testing.T) {
	cut := startSim(t, "--cut-after-tokens", "7")
	good := startSim(t)
	r := startRouter(t, "--worker-urls", cut.URL(), good.URL(), "--policy", "round_robin")
	const n = 30
	prompt := "once upon a time there was a router"
	chatPrompt := oracle.ChatPrompt([]oracle.Message{{Role: "user", Content: prompt}})
	wantCmpl := oracle.Text(oracle.DigestText(prompt), 0, n)
	wantChat := oracle.Text(oracle.DigestText(chatPrompt), 0, n)
	msgs := fmt.Sprintf(`[{"role":"user","content":%q}]`, prompt)

	cases := []struct {
		name, path, body, want string
		stream, chat, ids      bool
	}{
		{name: "completions stream", path: "/v1/completions", want: wantCmpl, stream: true,
			body: fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, prompt, n)},
		{name: "completions stream with token ids", path: "/v1/completions", want: wantCmpl, stream: true, ids: true,
			body: fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true,"return_token_ids":true,"stream_options":{"include_usage":true}}`, prompt, n)},
		{name: "chat stream", path: "/v1/chat/completions", want: wantChat, stream: true, chat: true,
			body: fmt.Sprintf(`{"messages":%s,"max_completion_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, msgs, n)},
		{name: "completions", path: "/v1/completions", want: wantCmpl,
			body: fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true}`, prompt, n)},
		{name: "chat", path: "/v1/chat/completions", want: wantChat, chat: true,
			body: fmt.Sprintf(`{"messages":%s,"max_tokens":%d,"ignore_eos":true}`, msgs, n)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for i := range 2 { // one of the two lands on the cutting worker
				status, _, body := post(t, ctxT(t, 20*time.Second), r.Base+tc.path, tc.body)
				if status != 200 {
					t.Fatalf("request %d: status %d %s", i, status, body)
				}
				if !tc.stream {
					if got := completionText(t, body); got != tc.want {
						t.Fatalf("request %d: %q, want %q", i, got, tc.want)
					}
					continue
				}
				v := readView(t, body)
				if v.text != tc.want {
					t.Fatalf("request %d: text %q, want %q", i, v.text, tc.want)
				}
				if !sameAll(v.ids) || !sameAll(v.created) || v.finish != "length" {
					t.Errorf("request %d: ids %v created %v finish %q", i, v.ids, v.created, v.finish)
				}
				if tc.chat && v.roles != 1 {
					t.Errorf("request %d: %d role deltas, want 1", i, v.roles)
				}
				pt := len(oracle.Tokenize(prompt))
				if tc.chat {
					pt = len(oracle.Tokenize(chatPrompt))
				}
				if v.usage["prompt_tokens"] != float64(pt) || v.usage["completion_tokens"] != n || v.usage["total_tokens"] != float64(pt+n) {
					t.Errorf("request %d: usage %v, want prompt %d completion %d", i, v.usage, pt, n)
				}
				if tc.ids {
					if !slices.Equal(v.tokenIDs, oracle.Generate(oracle.DigestText(prompt), 0, n)) || v.prompts != 1 {
						t.Errorf("request %d: token_ids %v (%d prompt_token_ids chunks)", i, v.tokenIDs, v.prompts)
					}
				} else if len(v.tokenIDs) > 0 || v.prompts > 0 {
					t.Errorf("request %d: token ids leaked to a client that did not ask", i)
				}
			}
		})
	}
	streams := routerGauge(t, r, `vllm_router_migrations_total{reason="upstream_broken",result="continued"`)
	whole := routerGauge(t, r, `vllm_router_migrations_total{reason="no_response",result="retried"`)
	st := cut.Stats(t)
	if hits := float64(st.Requests.Completions + st.Requests.ChatCompletions); streams+whole != hits || streams == 0 || whole == 0 {
		t.Errorf("migrations: %v streams continued, %v whole retries; the cutting worker cut %v answers", streams, whole, hits)
	}
	if c := routerGauge(t, r, "vllm_router_migration_stall_seconds_count"); c != streams {
		t.Errorf("stall histogram count %v, want %v", c, streams)
	}
}

// TestMigrateRegularKill9: the worker exits (kill -9 style, the
// crash_after_tokens fault) in the middle of a stream; the client's answer
// continues on the other worker and equals the uninterrupted one.
func TestMigrateRegularKill9(t *testing.T) {
	dying := startSim(t, "--crash-after-tokens", "5")
	good := startSim(t)
	r := startRouter(t, "--worker-urls", dying.URL(), good.URL(), "--policy", "round_robin")
	const n = 24
	prompt := "the engine died halfway through"
	want := oracle.Text(oracle.DigestText(prompt), 0, n)
	body := fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true}`, prompt, n)
	for i := range 3 {
		status, _, b := post(t, ctxT(t, 20*time.Second), r.Base+"/v1/completions", body)
		if status != 200 {
			t.Fatalf("request %d: status %d %s", i, status, b)
		}
		if v := readView(t, b); v.text != want || !sameAll(v.ids) {
			t.Fatalf("request %d: %q, want %q", i, v.text, want)
		}
	}
	select {
	case <-dying.Done:
	case <-time.After(10 * time.Second):
		t.Fatal("the crash_after_tokens worker did not exit")
	}
	if c := routerGauge(t, r, `vllm_router_migrations_total{reason="upstream_broken",result="continued"`); c != 1 {
		t.Errorf("continued migrations %v, want 1", c)
	}
	// The request log names both workers: the one that died and the one
	// that finished the answer.
	waitFor(t, 5*time.Second, "the migrated request's log line", func() bool {
		return strings.Contains(r.Logs.String(), "migrated_from=["+dying.URL()+"]") && strings.Contains(r.Logs.String(), "worker="+good.URL())
	})
}

// TestMigrateRegularRefused: what cannot be continued ends as before, with
// the SSE error event, counted by reason; --max-migrations 0 turns
// migration off.
func TestMigrateRegularRefused(t *testing.T) {
	cut := startSim(t, "--cut-after-tokens", "4")
	r := startRouter(t, "--worker-urls", cut.URL(), startSim(t).URL(), "--policy", "round_robin")
	endsWithError := func(b []byte) bool {
		s := string(b)
		return strings.HasSuffix(s, "data: [DONE]\n\n") && strings.Contains(s, `data: {"error":`)
	}
	errors := 0
	for range 2 { // completions logprobs carry text offsets: refused
		_, _, b := post(t, ctxT(t, 20*time.Second), r.Base+"/v1/completions", `{"prompt":"a b c","max_tokens":20,"ignore_eos":true,"stream":true,"logprobs":1}`)
		if endsWithError(b) {
			errors++
		} else if text, _ := harness.SSEText(t, b); text != oracle.Text(oracle.DigestText("a b c"), 0, 20) {
			t.Errorf("uncut answer %q", text)
		}
	}
	st := cut.Stats(t)
	if hits := int(st.Requests.Completions); errors != hits || hits == 0 {
		t.Errorf("%d streams ended with the error event, %d reached the cutting worker", errors, hits)
	}
	if c := routerGauge(t, r, `vllm_router_migrations_total{reason="upstream_broken",result="refused_logprobs"`); c != float64(errors) {
		t.Errorf("refused_logprobs %v, want %d", c, errors)
	}

	off := startRouter(t, "--worker-urls", startSim(t, "--cut-after-tokens", "4").URL(), startSim(t).URL(), "--max-migrations", "0", "--policy", "round_robin")
	errors = 0
	for range 2 {
		if _, _, b := post(t, ctxT(t, 20*time.Second), off.Base+"/v1/completions", `{"prompt":"a b c","max_tokens":20,"ignore_eos":true,"stream":true}`); endsWithError(b) {
			errors++
		}
	}
	if errors != 1 {
		t.Errorf("--max-migrations 0: %d streams ended with the error event, want 1 (round robin)", errors)
	}
	if c := routerGauge(t, off, "vllm_router_migrations_total"); c != 0 {
		t.Errorf("--max-migrations 0 migrated %v times", c)
	}
}

// TestMigratePDDecodeMidStream: a PD fleet with one prefill and two
// decodes, one of which cuts every answer after a few tokens. A stream cut
// on it continues with a new prefill of prompt + answer so far on the
// prefill and a decode on the other decode; every answer equals the
// uninterrupted one (the oracle's), for NIXL and MoRI-IO WRITE and READ,
// completions and chat, streaming and not; with NIXL also when the decode
// process exits mid-stream (kill -9 at a chosen token).
func TestMigratePDDecodeMidStream(t *testing.T) {
	for _, tc := range []struct{ connector, mode, fault string }{
		{"nixl", "", "--cut-after-tokens"}, {"nixl", "", "--crash-after-tokens"}, {"moriio", "WRITE", "--cut-after-tokens"}, {"moriio", "READ", "--cut-after-tokens"},
	} {
		t.Run(tc.connector+tc.mode+tc.fault, func(t *testing.T) {
			var r *router
			var cutD *sim
			if tc.connector == "nixl" {
				p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
				cutD = startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict", tc.fault, "6")
				d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
				r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", p.URL(), "--decode", cutD.URL(), "--decode", d.URL(), "--policy", "round_robin")
			} else {
				addr := fmt.Sprintf("127.0.0.1:%d", harness.FreePort(t))
				r = startRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "moriio", "--vllm-discovery-address", addr,
					"--policy", "round_robin", "--discovery-ttl-secs", "1.5", "--kv-wait-timeout-secs", "10")
				simArgs := []string{"--kv-connector", "moriio", "--proxy-address", addr, "--heartbeat-interval", "200ms", "--strict", "--transfer-mode", tc.mode}
				startSim(t, append([]string{"--role", "prefill"}, simArgs...)...)
				cutD = startSim(t, append([]string{"--role", "decode", "--cut-after-tokens", "6"}, simArgs...)...)
				startSim(t, append([]string{"--role", "decode"}, simArgs...)...)
				waitFor(t, 10*time.Second, "three registered workers", func() bool {
					var ws struct {
						Total int `json:"total"`
					}
					getJSON(t, r.Base+"/workers", &ws)
					return ws.Total == 3
				})
			}
			r.WaitReady(t, 10*time.Second)
			const n = 20
			prompt := "a prefill and a decode walk into a bar"
			msgs := fmt.Sprintf(`[{"role":"user","content":%q}]`, prompt)
			wantCmpl := oracle.Text(oracle.DigestText(prompt), 0, n)
			wantChat := oracle.Text(oracle.DigestText(oracle.ChatPrompt([]oracle.Message{{Role: "user", Content: prompt}})), 0, n)
			reqs := []struct {
				path, body, want string
				stream           bool
			}{
				{"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, prompt, n), wantCmpl, true},
				{"/v1/chat/completions", fmt.Sprintf(`{"messages":%s,"max_completion_tokens":%d,"ignore_eos":true,"stream":true}`, msgs, n), wantChat, true},
				{"/v1/completions", fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"ignore_eos":true}`, prompt, n), wantCmpl, false},
				{"/v1/chat/completions", fmt.Sprintf(`{"messages":%s,"max_completion_tokens":%d,"ignore_eos":true}`, msgs, n), wantChat, false},
			}
			for round := range 2 {
				for _, rq := range reqs {
					if !rq.stream && tc.fault == "--crash-after-tokens" {
						continue // the first answer it decodes must be a stream: the one it dies in
					}
					status, _, body := post(t, ctxT(t, 30*time.Second), r.Base+rq.path, rq.body)
					if status != 200 {
						t.Fatalf("round %d %s: status %d %s", round, rq.path, status, body)
					}
					got := ""
					if rq.stream {
						v := readView(t, body)
						got = v.text
						if !sameAll(v.ids) || v.finish != "length" {
							t.Errorf("round %d %s: ids %v finish %q", round, rq.path, v.ids, v.finish)
						}
						if v.usage != nil && (v.usage["completion_tokens"] != n || v.usage["prompt_tokens"] != float64(len(oracle.Tokenize(prompt)))) {
							t.Errorf("round %d %s: usage %v", round, rq.path, v.usage)
						}
					} else {
						got = completionText(t, body)
					}
					if got != rq.want {
						t.Fatalf("round %d %s stream=%v: %q, want %q", round, rq.path, rq.stream, got, rq.want)
					}
				}
			}
			if c := routerGauge(t, r, `vllm_router_migrations_total{reason="upstream_broken",result="continued"`); c < 1 {
				t.Errorf("no stream was continued (%v)", c)
			}
			if tc.fault == "--crash-after-tokens" {
				select {
				case <-cutD.Done: // kill -9 at the 6th token of the first answer it decoded
				case <-time.After(10 * time.Second):
					t.Error("the crash_after_tokens decode did not exit")
				}
			}
		})
	}
}

// TestMigrateTraced: every migration is a span under the request's server
// span, naming the cause and the worker that took over.
func TestMigrateTraced(t *testing.T) {
	col, err := otlptest.Start()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(col.Stop)
	cut, good := startSim(t, "--cut-after-tokens", "3"), startSim(t)
	r := startRouter(t, "--worker-urls", cut.URL(), good.URL(), "--policy", "round_robin",
		"--enable-trace", "--otlp-traces-endpoint", col.Addr(), "--otel-sampling-ratio", "1")
	for range 2 { // one of them lands on the cutting worker
		if code, _, b := post(t, ctxT(t, 20*time.Second), r.Base+"/v1/completions", `{"prompt":"a b","max_tokens":8,"ignore_eos":true,"stream":true}`); code != 200 {
			t.Fatalf("%d %s", code, b)
		}
	}
	r.Stop() // flushes the spans
	servers := map[string]bool{}
	var migs []otlptest.Span
	for _, s := range col.Spans() {
		if s.Kind == 2 {
			servers[s.SpanID] = true
		}
		if s.Name == "migration" {
			migs = append(migs, s)
		}
	}
	if hits := int(cut.Stats(t).Requests.Completions); len(migs) != hits || hits == 0 {
		t.Fatalf("%d migration spans, %d requests cut", len(migs), hits)
	}
	for _, m := range migs {
		if !servers[m.ParentID] || m.Attrs["switchyard.migration.cause"] != "upstream_broken" || m.Attrs["switchyard.migration.worker"] != good.URL() ||
			m.Attrs["switchyard.migration.tokens_before"] != "3" {
			t.Errorf("migration span %+v", m)
		}
	}
}
