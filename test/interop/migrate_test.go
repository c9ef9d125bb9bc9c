package interop

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// migTokens is every migration test's answer length: long enough that the
// kill lands mid-answer on a loaded machine, short enough to stay well
// inside the tests' bound.
const migTokens = 300

// startExtraEngine starts one more engine for a test (unified when kvRole
// is empty, else a NIXL engine of that role) and stops it when t ends. It
// does not wait: waitServing does, so the start-up overlaps the fleet's.
func startExtraEngine(t *testing.T, name, kvRole string) *engine {
	t.Helper()
	ports, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(name, ports[0], ports[1], kvRole, t.TempDir())
	e.startFor(t)
	return e
}

// waitServing waits until e answers /v1/models with the model (a bare
// /health could be another process's that held the free port a moment).
func waitServing(t *testing.T, e *engine) {
	t.Helper()
	if _, err := e.waitReady(engineReadyWithin); err != nil {
		t.Fatal(err)
	}
	harness.WaitFor(t, engineReadyWithin, 250*time.Millisecond, e.name+" serving the model", func() bool {
		select {
		case <-e.done:
			t.Fatalf("%s exited during start-up:\n%s", e.name, e.logTail(4000))
		default:
		}
		resp, err := http.Get(e.URL() + "/v1/models")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode == 200 && strings.Contains(string(b), modelDir)
	})
	t.Logf("engine %s serving %v after its start", e.name, time.Since(e.started).Round(100*time.Millisecond))
}

// migCase is one request shape the migration tests stream.
type migCase struct {
	name     string
	chat     bool
	tokenIDs bool // the client asks for return_token_ids
}

var migCases = []migCase{
	{name: "completions"},
	{name: "completions+token_ids", tokenIDs: true},
	{name: "chat", chat: true},
	{name: "chat+token_ids", chat: true, tokenIDs: true},
}

func (c migCase) path() string { return genPath(c.chat) }

// body is a greedy streamed request of migTokens tokens with usage.
func (c migCase) body(prompt string) string {
	m := map[string]any{"model": modelDir, "max_tokens": migTokens, "temperature": 0, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true}}
	if c.chat {
		m["messages"] = []map[string]string{{"role": "user", "content": prompt}}
	} else {
		m["prompt"] = prompt
	}
	if c.tokenIDs {
		m["return_token_ids"] = true
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// liveStream is a streamed answer being read in the background.
type liveStream struct {
	c      migCase
	route  string // x-switchyard-route
	mu     sync.Mutex
	body   bytes.Buffer
	chunks int
	done   chan struct{}
	err    error
}

// openStream posts body and reads the answer into the stream until it
// ends or ctx does; it fails t unless the status is 200.
func openStream(t *testing.T, ctx context.Context, url string, c migCase, body string) *liveStream {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("POST %s: %d %s", url, resp.StatusCode, b)
	}
	s := &liveStream{c: c, route: resp.Header.Get("X-Switchyard-Route"), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		defer resp.Body.Close()
		br := bufio.NewReader(resp.Body)
		for {
			l, err := br.ReadString('\n')
			s.mu.Lock()
			s.body.WriteString(l)
			if strings.HasPrefix(l, "data: {") {
				s.chunks++
			}
			if err != nil {
				if err != io.EOF {
					s.err = err
				}
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *liveStream) snapshot() (body string, chunks int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.body.String(), s.chunks
}

func (s *liveStream) finished() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// routeField returns the value of key in an x-switchyard-route header.
func routeField(route, key string) string {
	for _, kv := range strings.Split(route, "; ") {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v
		}
	}
	return ""
}

// migView is what a client read from one streamed answer.
type migView struct {
	text     string
	tokenIDs []int
	ids      []string
	created  []float64
	roles    int
	finish   string
	usage    map[string]float64
	prompts  int      // chunks carrying prompt_token_ids
	errors   []string // error events
	// heldBack: the last token chunk had token ids but no text (vLLM holds
	// back the bytes of a character not yet complete).
	heldBack bool
}

// readMigView parses a whole SSE answer; framing errors fail t, error
// events are returned in the view.
func readMigView(t *testing.T, body string) migView {
	t.Helper()
	var v migView
	harness.EachSSEData(t, []byte(body), func(data []byte) {
		var c struct {
			Error          json.RawMessage `json:"error"`
			ID             string          `json:"id"`
			Created        float64         `json:"created"`
			PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
			Choices        []struct {
				Text  string `json:"text"`
				Delta struct {
					Role    *string `json:"role"`
					Content string  `json:"content"`
				} `json:"delta"`
				FinishReason   *string         `json:"finish_reason"`
				TokenIDs       []int           `json:"token_ids"`
				PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
			} `json:"choices"`
			Usage map[string]float64 `json:"usage"`
		}
		if err := json.Unmarshal(data, &c); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		if c.Error != nil {
			v.errors = append(v.errors, string(data))
			return
		}
		v.ids = append(v.ids, c.ID)
		v.created = append(v.created, c.Created)
		if len(c.PromptTokenIDs) > 0 && string(c.PromptTokenIDs) != "null" {
			v.prompts++
		}
		for _, ch := range c.Choices {
			v.text += ch.Text + ch.Delta.Content
			v.tokenIDs = append(v.tokenIDs, ch.TokenIDs...)
			if len(ch.TokenIDs) > 0 {
				v.heldBack = ch.Text+ch.Delta.Content == ""
			}
			if ch.Delta.Role != nil {
				v.roles++
			}
			if ch.FinishReason != nil {
				v.finish = *ch.FinishReason
			}
			if len(ch.PromptTokenIDs) > 0 && string(ch.PromptTokenIDs) != "null" {
				v.prompts++
			}
		}
		if c.Usage != nil {
			v.usage = c.Usage
		}
	})
	return v
}

// cutView is what a client had received when its worker was killed: the
// whole events in the snapshot.
func cutView(t *testing.T, snapshot string) migView {
	t.Helper()
	i := strings.LastIndex(snapshot, "\n\n")
	if i < 0 {
		return migView{}
	}
	return readMigView(t, snapshot[:i+2]+"data: [DONE]\n\n")
}

// commonPrefix is the length of the longest common prefix of a and b.
func commonPrefix(a, b string) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// migrationRun streams two copies of every case through r (round robin
// puts one of each on each worker of the two), kills the worker `victim`
// once each of its streams has a few chunks, and checks every answer
// against the oracle, the uninterrupted answer of each case streamed
// straight from `oracleURL` before. routeKey names the receipt field that
// says which engine streams ("worker" or "decode"). It returns the number
// of streams that were on the victim.
func migrationRun(t *testing.T, r *harnessRouter, oracleURL, victimURL string, victim *engine, routeKey, prompt string) int {
	t.Helper()
	want := map[string]migView{}
	for _, c := range migCases {
		code, _, b := post(t, ctxT(t, 90*time.Second), oracleURL+c.path(), c.body(prompt))
		if code != 200 {
			t.Fatalf("oracle %s: %d %s", c.name, code, b)
		}
		v := readMigView(t, string(b))
		if len(v.errors) > 0 || v.finish != "length" || v.usage["completion_tokens"] != migTokens {
			t.Fatalf("oracle %s: errors %v finish %q usage %v", c.name, v.errors, v.finish, v.usage)
		}
		want[c.name] = v
	}

	ctx := ctxT(t, 150*time.Second)
	var streams []*liveStream
	for _, c := range migCases {
		for range 2 {
			streams = append(streams, openStream(t, ctx, r.Base+c.path(), c, c.body(prompt)))
		}
	}
	var onVictim []*liveStream
	for _, c := range migCases {
		n := 0
		for _, s := range streams {
			if s.c == c && routeField(s.route, routeKey) == victimURL {
				n++
				onVictim = append(onVictim, s)
			}
		}
		if n != 1 {
			var routes []string
			for _, s := range streams {
				routes = append(routes, s.c.name+": "+s.route)
			}
			t.Fatalf("case %s: %d streams on %s, want 1 (round robin); routes:\n%s", c.name, n, victimURL, strings.Join(routes, "\n"))
		}
	}
	harness.WaitFor(t, 60*time.Second, 5*time.Millisecond, "a few chunks on every stream of the victim", func() bool {
		for _, s := range onVictim {
			if s.finished() {
				b, _ := s.snapshot()
				t.Fatalf("%s finished before the kill: %s", s.c.name, harness.Tail(b, 300))
			}
			if _, n := s.snapshot(); n < 4 {
				return false
			}
		}
		return true
	})
	cuts := map[*liveStream]migView{}
	victim.kill()
	killed := time.Now()
	for _, s := range onVictim {
		b, _ := s.snapshot()
		cuts[s] = cutView(t, b)
	}
	for _, s := range streams {
		select {
		case <-s.done:
		case <-ctx.Done():
			t.Fatalf("%s (%s) did not end: %v", s.c.name, s.route, ctx.Err())
		}
	}
	t.Logf("every stream ended %v after the kill", time.Since(killed).Round(time.Millisecond))

	for _, s := range streams {
		b, _ := s.snapshot()
		if s.err != nil {
			t.Errorf("%s: reading the stream: %v", s.c.name, s.err)
			continue
		}
		cut, migrated := cuts[s]
		checkMigrated(t, s, b, want[s.c.name], cut, migrated)
	}
	return len(onVictim)
}

// checkMigrated checks one answer against the uninterrupted one. What is
// guaranteed on a real engine (docs/RELIABILITY.md, "Mid-stream migration",
// and docs/INTEROP.md, "Mid-stream migration on real engines"): no error event,
// [DONE], one id and created, one role delta, finish_reason "length" and
// migTokens completion tokens, no token ids for a client that did not ask,
// the text before the cut is the oracle's. Completions whose client asked
// for token ids continue from the token ids: the answer is the oracle's
// token for token, and usage's prompt_tokens the original prompt's. Text
// continuations (completions without token ids, chat) re-tokenize the text
// so far, which a byte-level tokenizer cannot always do faithfully (a
// token that is an incomplete UTF-8 sequence is held back or shows as
// U+FFFD): where they differ is logged, not failed. So is a token-id
// continuation whose cut followed a token with held-back text: its tokens
// must be exact, its text is vLLM's echo of the prompt (see above).
func checkMigrated(t *testing.T, s *liveStream, body string, want migView, cut migView, migrated bool) {
	t.Helper()
	v := readMigView(t, body)
	name := s.c.name
	exactRoute := !migrated || (s.c.tokenIDs && !s.c.chat)
	if len(v.errors) > 0 {
		t.Errorf("%s: error events %v", name, v.errors)
		return
	}
	if len(slices.Compact(slices.Clone(v.ids))) != 1 || len(slices.Compact(slices.Clone(v.created))) != 1 {
		t.Errorf("%s: ids %v created %v", name, slices.Compact(v.ids), slices.Compact(v.created))
	}
	if s.c.chat && v.roles != 1 {
		t.Errorf("%s: %d role deltas, want 1", name, v.roles)
	}
	if v.finish != "length" {
		t.Errorf("%s: finish_reason %q, want length", name, v.finish)
	}
	pt := want.usage["prompt_tokens"]
	if v.usage["completion_tokens"] != migTokens || v.usage["total_tokens"] != v.usage["prompt_tokens"]+migTokens {
		t.Errorf("%s: usage %v, want completion %d", name, v.usage, migTokens)
	}
	if v.usage["prompt_tokens"] != pt {
		d := fmt.Sprintf("%s: usage prompt_tokens %v, the original prompt has %v", name, v.usage["prompt_tokens"], pt)
		if exactRoute || s.c.tokenIDs {
			t.Error(d)
		} else {
			t.Log(d + " (estimated from the re-tokenized continuation prompt)")
		}
	}
	if s.c.tokenIDs {
		if len(v.tokenIDs) != migTokens || v.prompts != 1 {
			t.Errorf("%s: %d token ids, %d prompt_token_ids chunks", name, len(v.tokenIDs), v.prompts)
		}
	} else if len(v.tokenIDs) > 0 || v.prompts > 0 {
		t.Errorf("%s: token ids leaked to a client that did not ask", name)
	}
	if !strings.HasPrefix(v.text, cut.text) {
		t.Errorf("%s: the text before the cut %q is not the start of the answer %q", name, cut.text, harness.Tail(v.text, 100))
		return
	}
	if !strings.HasPrefix(want.text, cut.text) || (s.c.tokenIDs && !slices.Equal(cut.tokenIDs, want.tokenIDs[:min(len(cut.tokenIDs), len(want.tokenIDs))])) {
		// The engine itself answered otherwise than the oracle before the
		// cut: greedy decoding of the tiny random-weight model has near
		// ties, and which token wins can change with what else is in the
		// batch (the oracle ran alone, the streams 8 at a time). What the
		// router relayed is continuous (checked above); the answer has no
		// reference to be compared with.
		t.Logf("%s: before the cut the engine answered %q, the oracle %q: batched greedy decoding broke a near tie; not comparable", name,
			harness.Tail(cut.text, 60), harness.Tail(want.text[:min(len(want.text), len(cut.text))], 60))
		return
	}
	exact := v.text == want.text && (!s.c.tokenIDs || slices.Equal(v.tokenIDs, want.tokenIDs))
	where := "served whole"
	if migrated {
		where = fmt.Sprintf("migrated after %d characters", len(cut.text))
		if s.c.tokenIDs {
			where += fmt.Sprintf(", %d tokens", len(cut.tokenIDs))
		}
	}
	if exact {
		t.Logf("%s (%s): identical to the uninterrupted answer", name, where)
		return
	}
	at := commonPrefix(v.text, want.text)
	d := fmt.Sprintf("%s (%s): text differs from the uninterrupted answer at character %d of %d: got %q, want %q", name, where,
		at, len(want.text), harness.Tail(v.text[:min(len(v.text), at+40)], 80), harness.Tail(want.text[:min(len(want.text), at+40)], 80))
	if s.c.tokenIDs {
		i := 0
		for i < len(v.tokenIDs) && i < len(want.tokenIDs) && v.tokenIDs[i] == want.tokenIDs[i] {
			i++
		}
		d += fmt.Sprintf("; token ids differ at %d: got %v, want %v", i,
			v.tokenIDs[max(0, i-3):min(len(v.tokenIDs), i+4)], want.tokenIDs[max(0, i-3):min(len(want.tokenIDs), i+4)])
	}
	if exactRoute && migrated && cut.heldBack && slices.Equal(v.tokenIDs, want.tokenIDs) {
		// The continuation's token-id prompt ends inside a character: vLLM
		// 0.32 then streams the whole prompt's text with the continuation's
		// first token (docs/INTEROP.md, difference 15). The tokens are
		// exact; the text is not, until the router handles this cut.
		t.Logf("%s; the cut followed a token whose text was held back: tokens exact, text not (vLLM echoes the token-id prompt's text)", d)
		return
	}
	if exactRoute {
		t.Error(d)
		return
	}
	t.Log(d)
}

// TestMigrationRegularRealEngines: two real unified engines behind the
// router in regular mode (the fleet's and one more); two streams of every
// request shape, one on each; kill -9 of the extra engine mid-answer. Each
// of its streams continues on the other engine without an error event and
// ends with [DONE], usage and finish_reason over the whole answer; with
// token ids on completions the answer equals the uninterrupted one token
// for token.
func TestMigrationRegularRealEngines(t *testing.T) {
	if skipReason != "" {
		t.Skip("interop: " + skipReason)
	}
	other := startExtraEngine(t, "mig-unified", "")
	needEnv(t)
	waitServing(t, other)
	r := bins.StartRouter(t, "--worker-urls", other.URL(), unified.URL(), "--policy", "round_robin",
		"--route-receipt", "--health-check-interval-secs", "1", "--request-timeout-secs", "150")
	r.WaitReady(t, 60*time.Second)

	n := migrationRun(t, r, unified.URL(), other.URL(), other, "worker", "The router moves a stream to another engine when")
	if c := metric(t, r.Metrics, "vllm_router_migrations_total", `reason="upstream_broken"`, `result="continued"`); c != float64(n) {
		t.Errorf("continued migrations %v, want %d", c, n)
	}
	logs := r.Logs.String()
	if !strings.Contains(logs, "migrated_from=["+other.URL()+"]") {
		t.Errorf("no request log line names the killed engine in migrated_from:\n%s", harness.Tail(logs, 2000))
	}
}

// TestMigrationPDNixlRealEngines: the real NIXL prefill and two real
// decodes (the fleet's and one more) behind the router in PD mode; two
// streams of every request shape, one on each decode; kill -9 of the extra
// decode mid-answer. Each of its streams continues through a new prefill
// of the prompt and the answer so far and a decode on the other engine,
// with the same guarantees as in regular mode.
func TestMigrationPDNixlRealEngines(t *testing.T) {
	if skipReason != "" {
		t.Skip("interop: " + skipReason)
	}
	other := startExtraEngine(t, "mig-decode", "kv_consumer")
	needEnv(t)
	waitServing(t, other)
	r := bins.StartRouter(t, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
		"--prefill", prefill.URL(), "--decode", other.URL(), "--decode", decode.URL(), "--policy", "round_robin",
		"--route-receipt", "--health-check-interval-secs", "1", "--request-timeout-secs", "150")
	r.WaitReady(t, 60*time.Second)

	n := migrationRun(t, r, unified.URL(), other.URL(), other, "decode", "Prefill and decode engines hand the answer over when")
	if c := metric(t, r.Metrics, "vllm_router_migrations_total", `reason="upstream_broken"`, `result="continued"`); c != float64(n) {
		t.Errorf("continued migrations %v, want %d", c, n)
	}
	named := false
	for _, l := range strings.Split(r.Logs.String(), "\n") {
		if _, from, ok := strings.Cut(l, "migrated_from=["); ok && strings.Contains(from, other.URL()) {
			named = true
		}
	}
	if logs := r.Logs.String(); !named {
		t.Errorf("no request log line names the killed decode in migrated_from:\n%s", harness.Tail(logs, 2000))
	}
}

// asciiAlnum keeps s's ASCII letters and digits.
func asciiAlnum(s string) string {
	return strings.Map(func(r rune) rune {
		if r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' {
			return r
		}
		return -1
	}, s)
}

// TestEngineTokenPromptEndingMidCharacter pins what makes a token-id
// continuation's text inexact on vLLM 0.32 (docs/INTEROP.md, difference
// 15): a greedy answer's token whose text is held back (part of a UTF-8
// character) streams with empty text; a completion whose token-id prompt
// ends with that token streams, with its first token, the text of the
// whole prompt. The tokens after it are the uninterrupted answer's.
func TestEngineTokenPromptEndingMidCharacter(t *testing.T) {
	needEnv(t)
	c := migCase{name: "completions+token_ids", tokenIDs: true}
	code, _, b := post(t, ctxT(t, 90*time.Second), unified.URL()+c.path(), c.body("The router moves a stream to another engine when"))
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	var prompt []int
	var pieces []string
	var ids []int
	harness.EachSSEData(t, b, func(data []byte) {
		var ch struct {
			Choices []struct {
				Text           string `json:"text"`
				TokenIDs       []int  `json:"token_ids"`
				PromptTokenIDs []int  `json:"prompt_token_ids"`
			} `json:"choices"`
		}
		if err := json.Unmarshal(data, &ch); err != nil {
			t.Fatal(err)
		}
		for _, x := range ch.Choices {
			if x.PromptTokenIDs != nil {
				prompt = x.PromptTokenIDs
			}
			for _, id := range x.TokenIDs {
				ids = append(ids, id)
				pieces = append(pieces, x.Text)
			}
		}
	})
	k := slices.Index(pieces, "")
	if k < 0 || k+2 >= len(ids) || len(prompt) == 0 {
		t.Fatalf("no held-back token in the answer (prompt %v, %d tokens)", prompt, len(ids))
	}
	cont := append(slices.Clone(prompt), ids[:k+1]...)
	body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": cont, "max_tokens": 2, "temperature": 0,
		"ignore_eos": true, "stream": true, "return_token_ids": true})
	code, _, b = post(t, ctxT(t, 60*time.Second), unified.URL()+"/v1/completions", string(body))
	if code != 200 {
		t.Fatalf("%d %s", code, b)
	}
	v := readMigView(t, string(b))
	if !slices.Equal(v.tokenIDs, ids[k+1:k+3]) {
		t.Fatalf("continuation tokens %v, the answer's %v", v.tokenIDs, ids[k+1:k+3])
	}
	// The first chunk starts with the original prompt's text: that is the
	// behaviour pinned. What follows it is the answer's tokens decoded as
	// one sequence, which need not match their streamed pieces: bytes that
	// end no character decode to U+FFFD, how many depends on where a decode
	// cuts the byte stream, and in CI (after earlier requests) the engine
	// streamed pieces whose text the whole decode did not contain. The
	// letters are compared and logged only.
	const question = "The router moves a stream to another engine when"
	if !strings.HasPrefix(v.text, question) || len(v.text) <= len(question) {
		t.Fatalf("token %d (id %d) held back; the continuation's text %q does not start with the prompt's text (pieces %q, ids %v): vLLM changed, update docs/INTEROP.md difference 15 and the migration tests", k, ids[k], v.text, pieces, ids)
	}
	if a, e := asciiAlnum(strings.Join(pieces[:k], "")), asciiAlnum(v.text[len(question):]); !strings.HasPrefix(e, a) {
		t.Logf("the echo's answer text %q is not the streamed pieces' %q (letters and digits compared)", e, a)
	}
	t.Logf("token %d (id %d) streamed with empty text; continuing from it, the first chunk's text is %q (pieces %q)", k, ids[k], v.text, pieces)
}
