package pd

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// waitBoot waits until the Mooncake bootstrap info of every w is loaded
// (it is fetched in the background).
func waitBoot(t *testing.T, h *harness, ws ...*worker.Worker) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for _, w := range ws {
		for {
			_, _, err := h.eng.boot.lookup(w, -1)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("bootstrap info never loaded: %v", err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// R1: a prefill the router believes is dp=1 but whose bootstrap /query
// lists several ranks gets one rank per request, round-robin, sent as
// X-data-parallel-rank on P, with that rank's engine_id for D.
func TestMooncakeMultiRankBootstrapRoundRobin(t *testing.T) {
	boot := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		writeJSON(w, 200, `{"1":{"engine_id":"eng-1"},"0":{"engine_id":"eng-0"}}`)
	})
	single := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		writeJSON(w, 200, `{"0":{"engine_id":"only"}}`)
	})
	g := newKVGate()
	P := newFake(t, g.prefill(prefillOK(`{}`)))
	P1 := newFake(t, g.prefill(prefillOK(`{}`)))
	D := newFake(t, g.decode)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill, bootPort(boot.port()))     // dp=1, no @rank
	p1w := addWorker(t, reg, P1.URL(), worker.RolePrefill, bootPort(single.port())) // dp=1, one rank
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	pol := &prefer{urls: []string{P.URL()}}
	h := newHarness(t, reg, Options{Connector: "mooncake", PrefillPolicy: pol})
	waitBoot(t, h, pw, p1w)

	var order []string
	for i := range 4 {
		res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
		if res.status != 200 || res.body != sseAll() {
			t.Fatalf("request %d: status %d body %q", i, res.status, res.body)
		}
		pr, dr := P.next(t), D.next(t)
		rank, ok := rankHeader(pr)
		if !ok {
			t.Fatalf("request %d: no X-data-parallel-rank on P (its bootstrap server lists 2 ranks)", i)
		}
		if _, ok := rankHeader(dr); ok {
			t.Fatalf("request %d: rank header on the dp=1 decode", i)
		}
		if got := strField(t, dr.params(t), "remote_engine_id"); got != "eng-"+rank {
			t.Fatalf("request %d: P rank %s but D remote_engine_id %q", i, rank, got)
		}
		order = append(order, rank)
	}
	if strings.Join(order, ",") != "0,1,0,1" {
		t.Fatalf("ranks %v, want round-robin 0,1,0,1", order)
	}

	// one listed rank: no header, that rank's engine id
	pol.urls = []string{P1.URL()}
	if res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`); res.status != 200 {
		t.Fatalf("status %d %s", res.status, res.body)
	}
	pr, dr := P1.next(t), D.next(t)
	if _, ok := rankHeader(pr); ok {
		t.Fatal("rank header for a single-rank prefill")
	}
	if got := strField(t, dr.params(t), "remote_engine_id"); got != "only" {
		t.Fatalf("remote_engine_id %q", got)
	}
}

// R2: toy-proxy lowers the limit by one; a minimum that equalled the
// client's limit follows it down so D never sees min > max.
func TestToyProxyClampsMinimums(t *testing.T) {
	P := newFake(t, prefillOK(`{"k":1}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", OutputLength: OutputToyProxy})
	cases := []struct{ path, in, want string }{
		{"/v1/completions", `{"prompt":"p","max_tokens":5,"min_tokens":5}`, `{"prompt":"p","max_tokens":4,"min_tokens":4}`},
		{"/v1/completions", `{"prompt":"p","max_tokens":5,"min_tokens":3}`, `{"prompt":"p","max_tokens":4,"min_tokens":3}`},
		{"/v1/chat/completions", `{"messages":[],"max_completion_tokens":3,"min_tokens":3,"min_completion_tokens":2}`,
			`{"messages":[],"max_completion_tokens":2,"min_tokens":2,"min_completion_tokens":2}`},
		{"/v1/chat/completions", `{"messages":[],"max_tokens":8,"min_completion_tokens":8}`, `{"messages":[],"max_tokens":7,"min_completion_tokens":7}`},
		// already invalid for the client's own limit: left for vLLM to reject
		{"/v1/completions", `{"prompt":"p","max_tokens":5,"min_tokens":9}`, `{"prompt":"p","max_tokens":4,"min_tokens":9}`},
		{"/v1/completions", `{"prompt":"p","max_tokens":1,"min_tokens":1}`, `{"prompt":"p","max_tokens":1,"min_tokens":1}`},
		{"/generate", `{"prompt":"p","sampling_params":{"max_tokens":4,"min_tokens":4}}`, `{"prompt":"p","sampling_params":{"max_tokens":3,"min_tokens":3}}`},
	}
	for _, tc := range cases {
		if res := h.post(t, tc.path, tc.in); res.status != 200 {
			t.Fatalf("%s: %d %s", tc.in, res.status, res.body)
		}
		P.next(t)
		if got := string(D.next(t).body); got != withParams(tc.want, `{"k":1}`) {
			t.Fatalf("%s: decode body\n got  %s\n want %s", tc.in, got, withParams(tc.want, `{"k":1}`))
		}
	}
}

// R4: /v1/responses is served unsplit by a prefill worker unless
// SplitResponses: the client's bytes go as is, the answer is relayed as is,
// and a prefill that cannot be reached is failed over.
func TestResponsesUnsplitByDefault(t *testing.T) {
	const sse = "event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent: response.completed\ndata: {\"type\":\"response.completed\"}\n\n"
	const js = `{"id":"resp_1","object":"response","status":"completed","output":[]}`
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		if s, _ := rec.obj(t).Bool("stream"); s {
			startSSE(w)
			_, _ = w.Write([]byte(sse))
			return
		}
		writeJSON(w, 200, js)
	})
	D := newFake(t, decodeSSE)
	dead := deadURL(t)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	deadW := addWorker(t, reg, dead, worker.RolePrefill)
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "moriio", MaxFailovers: 1, ForwardClientAuth: true, PrefillPolicy: &prefer{urls: []string{dead}}})

	// stream, through a failover (MoRI-IO eligibility is irrelevant: no KV moves)
	body := `{"model":"m","input":"hi","max_output_tokens":50,"stream":true,"kv_transfer_params":{"x":1}}`
	res := h.post(t, "/v1/responses", body, "Authorization", "Bearer c")
	if res.status != 200 || res.body != sse || res.hdr.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d ct %q body %q", res.status, res.hdr.Get("Content-Type"), res.body)
	}
	pr := P.next(t)
	if string(pr.body) != body || pr.path != "/v1/responses" {
		t.Fatalf("prefill got %s %s, want the client's body untouched", pr.path, pr.body)
	}
	if pr.hdr.Get("Authorization") != "Bearer c" || pr.hdr.Get("X-Request-Id") == "" {
		t.Fatalf("headers %v", pr.hdr)
	}
	rc := h.last.Load().Receipt
	if rc.Prefill != pw.Key() || rc.Decode != "" || rc.Attempts != 2 || len(rc.Failovers) != 1 ||
		!strings.Contains(rc.Failovers[0], deadW.Key()) || !strings.Contains(rc.Reason, "unsplit") {
		t.Fatalf("receipt %+v", rc)
	}

	// non-streaming: relayed with its Content-Length
	res = h.post(t, "/v1/responses", `{"model":"m","input":"hi"}`)
	if res.status != 200 || res.body != js || res.hdr.Get("Content-Length") != fmt.Sprint(len(js)) {
		t.Fatalf("status %d hdr %v body %q", res.status, res.hdr, res.body)
	}
	P.next(t)
	D.none(t)
	waitIdle(t, pw)

	// the other PD routes are still split
	if ok, _ := h.eng.Ready(); ok {
		t.Fatal("static MoRI-IO workers cannot be paired: Ready must be false")
	}
	if res := h.post(t, "/v1/completions", `{"prompt":"p"}`); res.status != 503 {
		t.Fatalf("completions: %d %s", res.status, res.body)
	}
}

// R5: a completions batch cannot share one KV handoff.
func TestMultiPromptCompletionsRejected(t *testing.T) {
	P := newFake(t, prefillOK(`{}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl"})
	for _, prompt := range []string{`["a","b"]`, `[[1,2],[3,4]]`, `["a", "b", "c"]`, `[[1],[2],[3]]`} {
		res := h.post(t, "/v1/completions", `{"prompt":`+prompt+`}`)
		want := fmt.Sprintf("PD mode supports one prompt per request; got %d", strings.Count(prompt, ",")+1)
		if prompt == `[[1,2],[3,4]]` {
			want = "got 2"
		}
		if res.status != 400 || !strings.Contains(res.body, want) {
			t.Fatalf("%s: status %d body %s, want 400 %q", prompt, res.status, res.body, want)
		}
	}
	P.none(t)
	for _, prompt := range []string{`"a"`, `["a"]`, `[1,2,3]`, `[[1,2]]`, `[]`} {
		if res := h.post(t, "/v1/completions", `{"prompt":`+prompt+`}`); res.status != 200 {
			t.Fatalf("%s: status %d body %s", prompt, res.status, res.body)
		}
		P.next(t)
		D.next(t)
	}
}

// R8: the client never controls the KV handoff: P2P-NCCL removes a
// client-supplied kv_transfer_params on both legs, the other connectors
// overwrite it.
func TestClientKVTransferParamsNeverForwarded(t *testing.T) {
	const evil = `{"do_remote_prefill":true,"remote_engine_id":"evil"}`
	t.Run("p2pnccl", func(t *testing.T) {
		P := newFake(t, prefillOK("null"))
		D := newFake(t, decodeSSE)
		reg := worker.NewRegistry(worker.BreakerConfig{})
		addWorker(t, reg, P.URL(), worker.RolePrefill, func(s *worker.Spec) { s.ZMQAddress = "127.0.0.1:21001" })
		addWorker(t, reg, D.URL(), worker.RoleDecode, func(s *worker.Spec) { s.ZMQAddress = "127.0.0.1:22001" })
		h := newHarness(t, reg, Options{Connector: "p2pnccl"})
		res := h.post(t, "/v1/completions", `{"prompt":"x","kv_transfer_params":`+evil+`,"max_tokens":5,"stream":true}`)
		if res.status != 200 {
			t.Fatalf("status %d %s", res.status, res.body)
		}
		if got := string(P.next(t).body); got != `{"prompt":"x","max_tokens":1,"stream":false}` {
			t.Fatalf("prefill body %s", got)
		}
		if got := string(D.next(t).body); got != `{"prompt":"x","max_tokens":5,"stream":true}` {
			t.Fatalf("decode body %s", got)
		}
	})
	t.Run("nixl", func(t *testing.T) {
		P := newFake(t, prefillOK(`{"remote_engine_id":"e1"}`))
		D := newFake(t, decodeJSON)
		reg := worker.NewRegistry(worker.BreakerConfig{})
		addWorker(t, reg, P.URL(), worker.RolePrefill)
		addWorker(t, reg, D.URL(), worker.RoleDecode)
		h := newHarness(t, reg, Options{Connector: "nixl"})
		if res := h.post(t, "/v1/completions", `{"prompt":"x","kv_transfer_params":`+evil+`}`); res.status != 200 {
			t.Fatalf("status %d %s", res.status, res.body)
		}
		if got := string(P.next(t).params(t)); strings.Contains(got, "evil") || !strings.Contains(got, `"do_remote_decode":true`) {
			t.Fatalf("prefill params %s", got)
		}
		if got := string(D.next(t).params(t)); got != `{"remote_engine_id":"e1"}` {
			t.Fatalf("decode params %s", got)
		}
	})
	// every connector but P2P-NCCL builds both legs' params itself
	p := &worker.Worker{Spec: worker.Spec{DPRank: -1, DPSize: 1, TPSize: 1, TransferMode: "WRITE"}}
	pr := &Pair{P: p, D: p, PRank: -1, DRank: -1}
	for _, name := range []string{ConnectorNIXL, ConnectorMoRIIO, ConnectorMooncake} {
		c, err := newConnector(name, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.PrefillParams(pr) == nil {
			t.Errorf("%s: nil prefill params would forward the client's", name)
		}
	}
	for _, c := range []Connector{nixl{}, moriio{}} {
		if b, err := c.DecodeParams(pr, []byte(`{"remote_engine_id":"e","remote_block_ids":[1]}`)); err != nil || b == nil {
			t.Errorf("%s: decode params %s %v", c.Name(), b, err)
		}
	}
	o, _ := rawjson.Parse([]byte(`{"a":1,"kv_transfer_params":{"x":1}}`))
	if got := string(prefillBody(routeCompletions, o, nil).Bytes()); strings.Contains(got, "kv_transfer_params") {
		t.Errorf("prefillBody kept the client's params: %s", got)
	}
	if got := string(decodeBody(routeCompletions, o, nil, OutputExact).Bytes()); got != `{"a":1}` {
		t.Errorf("decodeBody kept the client's params: %s", got)
	}
}

// A4: P's first token ended the generation (kv_transfer_params null,
// finish_reason stop): a non-streaming request gets P's answer; streaming,
// a client minimum above 1, or a "length" finish keep the explicit error.
func TestPrefillStopAtFirstToken(t *testing.T) {
	stopJSON := strings.Replace(prefillJSON("null"), `"finish_reason":"length"`, `"finish_reason":"stop"`, 1)
	lengthJSON := prefillJSON("null")
	answer := stopJSON
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) { writeJSON(w, 200, answer) })
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	pw := addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl"})

	res := h.post(t, "/v1/completions", `{"prompt":"p","max_tokens":20}`)
	if res.status != 200 || res.body != stopJSON || res.hdr.Get("Content-Length") != fmt.Sprint(len(stopJSON)) {
		t.Fatalf("status %d hdr %v body %s", res.status, res.hdr, res.body)
	}
	rc := h.last.Load().Receipt
	if rc.Prefill != pw.Key() || rc.Decode != "" || !strings.Contains(rc.Reason, "prefill alone") {
		t.Fatalf("receipt %+v", rc)
	}
	P.next(t)

	for _, tc := range []struct{ name, body, answer string }{
		{"stream", `{"prompt":"p","stream":true}`, stopJSON},
		{"min_tokens", `{"prompt":"p","min_tokens":4}`, stopJSON},
		{"finish length", `{"prompt":"p"}`, lengthJSON},
	} {
		answer = tc.answer
		res := h.post(t, "/v1/completions", tc.body)
		if res.status != 502 || !strings.Contains(res.body, "kv_transfer_params is null") {
			t.Fatalf("%s: status %d body %s", tc.name, res.status, res.body)
		}
		P.next(t)
	}
	D.none(t)
}
