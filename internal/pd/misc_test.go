package pd

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestBadInput(t *testing.T) {
	P := newFake(t, prefillOK(`{}`))
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl"})
	cases := []struct {
		path, body string
		status     int
		msg        string
	}{
		{"/v1/completions", `[1,2]`, 400, "must be a JSON object"},
		{"/v1/completions", `"str"`, 400, "must be a JSON object"},
		{"/v1/completions", `{"prompt":`, 400, "invalid JSON"},
		{"/v1/completions", `{"model":"m"}`, 400, "'prompt' is required"},
		{"/v1/completions", `{"model":"m","prompt":null}`, 400, "'prompt' is required"},
		{"/v1/chat/completions", `{"model":"m"}`, 400, "'messages' is required"},
		{"/v1/completions", `{"prompt":"p","n":2}`, 400, "not supported in PD mode"},
		{"/v1/completions", `{"prompt":"p","best_of":3}`, 400, "not supported in PD mode"},
		{"/v1/chat/completions", `{"messages":[],"n":4}`, 400, "not supported in PD mode"},
		{"/generate", `{"prompt":"p","sampling_params":{"n":2}}`, 400, "sampling_params.n=2"},
		{"/v1/embeddings", `{"input":"x"}`, 404, "not served in PD mode"},
	}
	for _, tc := range cases {
		res := h.post(t, tc.path, tc.body)
		if res.status != tc.status || !strings.Contains(res.body, tc.msg) {
			t.Errorf("%s %s: status %d body %s; want %d %q", tc.path, tc.body, res.status, res.body, tc.status, tc.msg)
		}
	}
	// n=1 is fine
	if res := h.post(t, "/v1/completions", `{"prompt":"p","n":1,"stream":true}`); res.status != 200 {
		t.Fatalf("n=1: %d %s", res.status, res.body)
	}
	req, _ := http.NewRequest(http.MethodGet, h.front.URL+"/v1/completions", nil)
	resp, err := h.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Fatalf("GET: %d", resp.StatusCode)
	}
	if n := P.count.Load(); n != 1 {
		t.Fatalf("prefill called %d times", n)
	}
}

func TestNoWorkers(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	h := newHarness(t, reg, Options{})
	if ok, why := h.eng.Ready(); ok || why != "no prefill workers registered" {
		t.Fatalf("Ready %v %q", ok, why)
	}
	res := h.post(t, "/v1/completions", `{"prompt":"p"}`)
	if res.status != 503 || !strings.Contains(res.body, "no prefill workers available") {
		t.Fatalf("%d %s", res.status, res.body)
	}
	P := newFake(t, prefillOK(`{}`))
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
	res = h.post(t, "/v1/completions", `{"prompt":"p"}`)
	if res.status != 503 || !strings.Contains(res.body, "no decode workers available") {
		t.Fatalf("%d %s", res.status, res.body)
	}
	if ok, why := h.eng.Ready(); ok || why != "no decode workers registered" {
		t.Fatalf("Ready %v %q", ok, why)
	}
	D := newFake(t, decodeSSE)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	if ok, why := h.eng.Ready(); !ok {
		t.Fatalf("not ready: %s", why)
	}
	pw.SetHealthy(false)
	if ok, why := h.eng.Ready(); ok || !strings.Contains(why, "no healthy routable prefill") {
		t.Fatalf("Ready %v %q", ok, why)
	}
	res = h.post(t, "/v1/completions", `{"prompt":"p"}`)
	if res.status != 503 || !strings.Contains(res.body, "1 unhealthy") {
		t.Fatalf("%d %s", res.status, res.body)
	}
	P.none(t)
}

func TestConcurrentPrefill4xxRelayedAndDecodeCancelled(t *testing.T) {
	dCancel := make(chan time.Time, 1)
	dGot := make(chan struct{})
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		close(dGot)
		startSSE(w)
		blockUntilCancelled(dCancel)(w, r, rec)
	})
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		<-dGot
		writeJSON(w, 400, `{"error":{"message":"This model's maximum context length is 10 tokens","code":400}}`)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 1})
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"))
	addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"))
	h := newHarness(t, reg, Options{Connector: "moriio", MaxFailovers: 2})
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 400 || !strings.Contains(res.body, "maximum context length") {
		t.Fatalf("%d %s", res.status, res.body)
	}
	waitDone(t, dCancel, time.Second, "decode cancellation")
	if pw.Breaker().State() != worker.BreakerClosed {
		t.Fatal("a client error opened the prefill's breaker")
	}
	if P.count.Load() != 1 {
		t.Fatal("a client error was failed over")
	}
}

func TestBreakerRecordsLegOutcomes(t *testing.T) {
	bad := newFake(t, func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 502, `{}`) })
	P := newFake(t, prefillOK(`{"k":1}`))
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{FailureThreshold: 1, OpenDuration: time.Hour})
	bw := addWorker(t, reg, bad.URL(), worker.RolePrefill)
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
	dw := addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", MaxFailovers: 1, PrefillPolicy: &prefer{urls: []string{bad.URL()}}})
	if res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`); res.status != 200 {
		t.Fatalf("%d %s", res.status, res.body)
	}
	if bw.Breaker().State() != worker.BreakerOpen {
		t.Fatal("failed prefill not recorded on its breaker")
	}
	if !bw.Healthy() {
		t.Fatal("a 502 is not a connect error")
	}
	if pw.Breaker().State() != worker.BreakerClosed || dw.Breaker().State() != worker.BreakerClosed {
		t.Fatal("healthy legs recorded as failures")
	}
	// the open breaker keeps the policy away from it now
	if res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`); res.status != 200 {
		t.Fatalf("%d %s", res.status, res.body)
	}
	if bad.count.Load() != 1 {
		t.Fatalf("open-circuit prefill called again")
	}
	waitIdle(t, bw, pw, dw)
	if pw.TotalRequests() != 2 || dw.TotalRequests() != 2 {
		t.Fatalf("in-flight accounting: P %d D %d", pw.TotalRequests(), dw.TotalRequests())
	}
}

// pairPolicy picks the last prefill and the last decode.
type pairPolicy struct{ prefer }

func (pairPolicy) PickPair(req *policy.Request, p, d policy.Candidates) (policy.Choice, policy.Choice, error) {
	return policy.Choice{Worker: p.Workers[len(p.Workers)-1], Reason: "pair-p"},
		policy.Choice{Worker: d.Workers[len(d.Workers)-1], Reason: "pair-d"}, nil
}

func TestPairPolicyUsed(t *testing.T) {
	var fs []*fake
	reg := worker.NewRegistry(worker.BreakerConfig{})
	var lastP, lastD *worker.Worker
	for i := range 4 {
		role := worker.RolePrefill
		h := prefillOK(`{}`)
		if i >= 2 {
			role, h = worker.RoleDecode, decodeSSE
		}
		f := newFake(t, h)
		fs = append(fs, f)
		addWorker(t, reg, f.URL(), role)
	}
	snap := reg.Snapshot()
	lastP, lastD = snap.Prefill[1], snap.Decode[1]
	h := newHarness(t, reg, Options{Connector: "nixl", PrefillPolicy: &pairPolicy{}})
	if res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`); res.status != 200 {
		t.Fatalf("%d %s", res.status, res.body)
	}
	rc := h.last.Load().Receipt
	if rc.Prefill != lastP.Key() || rc.Decode != lastD.Key() || !strings.Contains(rc.Reason, "pair-p") {
		t.Fatalf("receipt %+v", rc)
	}
	_ = fs
}

func TestLogprobsMergeCharacterOffsets(t *testing.T) {
	prefill := []byte(`{"id":"p","choices":[{"index":0,"text":"héllo wörld!","logprobs":{"text_offset":[0,2,5,11],"token_logprobs":[null,-1.5,-2.5,-0.5],"tokens":["hé","llo"," wörld","!"],"top_logprobs":[null,{"llo":-1.5},{" wörld":-2.5},{"!":-0.5}]},"finish_reason":"length","prompt_logprobs":[null,{"5":{"logprob":-1.5}},{"6":{"logprob":-2.5}}]}],"kv_transfer_params":{}}`)
	decode := []byte(`{"id":"d","object":"text_completion","choices":[{"index":0,"text":"!?","logprobs":{"text_offset":[0,1],"token_logprobs":[-0.4,-0.6],"tokens":["!","?"],"top_logprobs":[{"!":-0.4},{"?":-0.6}]},"finish_reason":"length","z":1}],"usage":{"completion_tokens":2}}`)
	got, ok := mergeLogprobs(routeCompletions, prefill, decode)
	if !ok {
		t.Fatal("nothing merged")
	}
	want := `{"id":"d","object":"text_completion","choices":[{"index":0,"text":"!?","logprobs":{"text_offset":[0,2,5,11,12],"token_logprobs":[null,-1.5,-2.5,-0.4,-0.6],"tokens":["hé","llo"," wörld","!","?"],"top_logprobs":[null,{"llo":-1.5},{" wörld":-2.5},{"!":-0.4},{"?":-0.6}]},"finish_reason":"length","z":1,"prompt_logprobs":[null,{"5":{"logprob":-1.5}},{"6":{"logprob":-2.5}}]}],"usage":{"completion_tokens":2}}`
	if string(got) != want {
		t.Fatalf("merged\n got  %s\n want %s", got, want)
	}
	// chat: top-level prompt_logprobs copied
	got, ok = mergeLogprobs(routeChat, []byte(`{"prompt_logprobs":[null,{"1":{}}]}`), []byte(`{"id":"c","prompt_logprobs":null}`))
	if !ok || string(got) != `{"id":"c","prompt_logprobs":[null,{"1":{}}]}` {
		t.Fatalf("chat merge %s", got)
	}
	// nothing to merge: unchanged bytes
	if got, ok := mergeLogprobs(routeCompletions, []byte(`{"choices":[{"prompt_logprobs":null}]}`), decode); ok || string(got) != string(decode) {
		t.Fatal("no-op merge changed the body")
	}
}

func TestNonStreamingMergeOverHTTP(t *testing.T) {
	P := newFake(t, prefillOK(`{"remote_block_ids":[1]}`))
	P.setHandler(func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		writeJSON(w, 200, `{"choices":[{"index":0,"logprobs":{"text_offset":[0,3],"tokens":["abc","d"],"token_logprobs":[null,-1]},"prompt_logprobs":[null]}],"kv_transfer_params":{"remote_block_ids":[1]}}`)
	})
	const dBody = `{"choices":[{"index":0,"text":"x","logprobs":{"text_offset":[0],"tokens":["x"],"token_logprobs":[-2]}}]}`
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) { writeJSON(w, 200, dBody) })
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl"})
	res := h.post(t, "/v1/completions", `{"prompt":"abc","echo":true,"logprobs":0}`)
	want := `{"choices":[{"index":0,"text":"x","logprobs":{"text_offset":[0,3],"tokens":["abc","x"],"token_logprobs":[null,-2]},"prompt_logprobs":[null]}]}`
	if res.status != 200 || res.body != want {
		t.Fatalf("%d\n got  %s\n want %s", res.status, res.body, want)
	}
	// a chat without prompt_logprobs is relayed untouched
	res = h.post(t, "/v1/chat/completions", `{"messages":[],"logprobs":false}`)
	if res.status != 200 || res.body != dBody {
		t.Fatalf("%d %s", res.status, res.body)
	}
}

func TestServeProfileFanOut(t *testing.T) {
	mk := func(body string) *fake {
		return newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) { writeJSON(w, 200, body) })
	}
	P := mk(`{"profiler":"p"}`)
	D := mk(`{"profiler":"d"}`)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, dp(2, 0))
	addWorker(t, reg, P.URL(), worker.RolePrefill, dp(2, 1))
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{APIKey: "k"})
	rec := httptest.NewRecorder()
	h.eng.ServeProfile(rec, httptest.NewRequest(http.MethodPost, "/start_profile", nil), "start_profile")
	if rec.Code != 200 || rec.Body.String() != `{"profiler":"p"}` {
		t.Fatalf("%d %s", rec.Code, rec.Body.String())
	}
	if P.count.Load() != 1 || D.count.Load() != 1 {
		t.Fatalf("fan-out: P %d D %d (want one call per base URL)", P.count.Load(), D.count.Load())
	}
	if r := P.next(t); r.path != "/start_profile" || r.hdr.Get("Authorization") != "Bearer k" {
		t.Fatalf("path %s auth %q", r.path, r.hdr.Get("Authorization"))
	}
	P.setHandler(func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 500, `{}`) })
	D.setHandler(func(w http.ResponseWriter, r *http.Request, _ *recorded) { writeJSON(w, 500, `{}`) })
	rec = httptest.NewRecorder()
	h.eng.ServeProfile(rec, httptest.NewRequest(http.MethodPost, "/stop_profile", nil), "stop_profile")
	if rec.Code != 502 || !strings.Contains(rec.Body.String(), `"results"`) {
		t.Fatalf("%d %s", rec.Code, rec.Body.String())
	}
}

func TestPerRequestProfileHooks(t *testing.T) {
	var mu sync.Mutex
	paths := map[string][]string{}
	mk := func(name string, gen func(http.ResponseWriter, *http.Request, *recorded)) *fake {
		return newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
			mu.Lock()
			paths[name] = append(paths[name], rec.path)
			mu.Unlock()
			if strings.HasSuffix(rec.path, "_profile") {
				writeJSON(w, 200, `{}`)
				return
			}
			gen(w, r, rec)
		})
	}
	P := mk("P", prefillOK(`{"k":1}`))
	D := mk("D", decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", Profile: true})
	if res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`); res.status != 200 {
		t.Fatalf("%d %s", res.status, res.body)
	}
	h.eng.bg.Wait()
	mu.Lock()
	defer mu.Unlock()
	want := "/start_profile,/v1/completions,/stop_profile"
	if got := strings.Join(paths["P"], ","); got != want {
		t.Fatalf("P calls %s", got)
	}
	if got := strings.Join(paths["D"], ","); got != want {
		t.Fatalf("D calls %s", got)
	}
}

func TestIDs(t *testing.T) {
	u := asV4([16]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	if got := hyphenated(u); got != "ffffffff-ffff-4fff-bfff-ffffffffffff" {
		t.Fatal(got)
	}
	if !txRE.MatchString(moriio{}.TransferID(asV4(randomUUID()))) {
		t.Fatal("tx id")
	}
	id := requestID("a:1", "b:2", asV4(randomUUID()))
	checkRequestID(t, id, "a:1", "b:2")
}

func TestNewValidation(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	for _, o := range []Options{
		{},
		{Registry: reg},
		{Registry: reg, PrefillPolicy: &prefer{}, DecodePolicy: &prefer{}, Connector: "lmcache"},
		{Registry: reg, PrefillPolicy: &prefer{}, DecodePolicy: &prefer{}, OutputLength: "short"},
	} {
		if e, err := New(o); err == nil {
			e.Close()
			t.Fatalf("New(%+v) succeeded", o)
		}
	}
}
