package pd

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

const (
	pZMQ = "host:127.0.0.1,handshake:6301,notify:61005"
	dZMQ = "host:127.0.0.2,handshake:6302,notify:61006"
)

// clientBody has unknown fields, nested objects and a deliberate key order
// that must survive byte for byte.
const clientBody = `{"model":"m","prompt":"hello","zeta":{"b":[1,2],"a":"x"},"max_tokens":10,"min_tokens":5,"stream":true,"stream_options":{"include_usage":true},"alpha":1}`

// withParams is body with kv_transfer_params appended.
func withParams(body, params string) string {
	return strings.TrimSuffix(body, "}") + `,"kv_transfer_params":` + params + `}`
}

// prefillOf is clientBody as the prefill must receive it.
func prefillOf(params string) string {
	return `{"model":"m","prompt":"hello","zeta":{"b":[1,2],"a":"x"},"max_tokens":1,"min_tokens":1,"stream":false,"alpha":1,"kv_transfer_params":` + params + `}`
}

func rankHeader(r *recorded) (string, bool) {
	v, ok := r.hdr["X-Data-Parallel-Rank"]
	if !ok || len(v) == 0 {
		return "", false
	}
	return v[0], true
}

func TestMoRIIOWriteConformance(t *testing.T) {
	for _, pw := range prefillWaits {
		t.Run(pw.name, func(t *testing.T) { testMoRIIOWriteConformance(t, pw.client) })
	}
}

func testMoRIIOWriteConformance(t *testing.T, client func(*testing.T) *http.Client) {
	cases := []struct {
		name                   string
		pDP, pRank, dDP, dRank int
		dTP                    int
	}{
		{"dp1", 1, -1, 1, -1, 1},
		{"dp2", 2, 1, 4, 3, 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dGot := make(chan struct{})
			pDone := make(chan struct{})
			P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				// D must be sent no later than P: block until it arrived.
				select {
				case <-dGot:
				case <-time.After(3 * time.Second):
					writeJSON(w, 500, `{"error":"decode never arrived"}`)
					return
				case <-r.Context().Done():
					return
				}
				prefillOK(`{"do_remote_prefill":true}`)(w, r, rec)
				close(pDone)
			})
			D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
				close(dGot)
				startSSE(w)
				select { // like vLLM: the first token only after P's KV
				case <-pDone:
				case <-r.Context().Done():
					return
				}
				sendEvents(w)
			})
			reg := worker.NewRegistry(worker.BreakerConfig{})
			pw := addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "WRITE"), dp(tc.pDP, tc.pRank), tp(2))
			dw := addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "WRITE"), dp(tc.dDP, tc.dRank), tp(tc.dTP))
			h := newHarness(t, reg, Options{Connector: "moriio", APIKey: "secret", Client: client(t)})

			res := h.post(t, "/v1/completions", clientBody, "X-Request-Id", "bench-abc-1")
			if res.err != nil || res.status != 200 {
				t.Fatalf("status %d err %v body %s", res.status, res.err, res.body)
			}
			if res.body != sseAll() {
				t.Fatalf("client body %q, want %q", res.body, sseAll())
			}
			if ct := res.hdr.Get("Content-Type"); ct != "text/event-stream" {
				t.Fatalf("content-type %q", ct)
			}
			pr, dr := P.next(t), D.next(t)

			// X-Request-Id: same on both legs, §2.4 format, client's id not forwarded.
			id := pr.hdr.Get("X-Request-Id")
			if dr.hdr.Get("X-Request-Id") != id {
				t.Fatalf("X-Request-Id differs: %q vs %q", id, dr.hdr.Get("X-Request-Id"))
			}
			checkRequestID(t, id, pZMQ, dZMQ)
			for _, r := range []*recorded{pr, dr} {
				if len(r.hdr.Values("X-Request-Id")) != 1 {
					t.Fatalf("X-Request-Id values %q", r.hdr.Values("X-Request-Id"))
				}
				if r.hdr.Get("Authorization") != "Bearer secret" {
					t.Fatalf("Authorization %q", r.hdr.Get("Authorization"))
				}
				if r.hdr.Get("Content-Type") != "application/json" {
					t.Fatalf("Content-Type %q", r.hdr.Get("Content-Type"))
				}
				if r.path != "/v1/completions" {
					t.Fatalf("path %q", r.path)
				}
			}

			// transfer id: tx-<uuid4 hyphenated>, same on both legs.
			pp, dpar := pr.params(t), dr.params(t)
			tx := strField(t, pp, "transfer_id")
			if !txRE.MatchString(tx) {
				t.Fatalf("transfer_id %q", tx)
			}
			if strField(t, dpar, "transfer_id") != tx {
				t.Fatalf("decode transfer_id %q != %q", strField(t, dpar, "transfer_id"), tx)
			}

			// P params and body, byte for byte. tp_size (D's TP) is what a
			// WRITE-mode prefill reads to map its TP ranks onto D's.
			wantP := fmt.Sprintf(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"transfer_id":%q,"remote_dp_size":%d,"remote_tp_size":%d,"tp_size":%d,"remote_host":"127.0.0.2","remote_port":%d,"remote_handshake_port":6302,"remote_notify_port":61006}`,
				tx, tc.dDP, tc.dTP, tc.dTP, D.port())
			if string(pp) != wantP {
				t.Fatalf("prefill params\n got  %s\n want %s", pp, wantP)
			}
			if string(pr.body) != prefillOf(wantP) {
				t.Fatalf("prefill body\n got  %s\n want %s", pr.body, prefillOf(wantP))
			}

			// D params and body.
			rank := ""
			if tc.pDP > 1 {
				rank = fmt.Sprintf(`,"remote_dp_rank":%d`, tc.pRank)
			}
			wantD := fmt.Sprintf(`{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":%q,"remote_engine_id":null,"remote_block_ids":null,"remote_dp_size":%d,"remote_tp_size":2,"tp_size":2,"remote_host":"127.0.0.1","remote_port":%d,"remote_handshake_port":6301,"remote_notify_port":61005%s}`,
				tx, tc.pDP, P.port(), rank)
			if string(dpar) != wantD {
				t.Fatalf("decode params\n got  %s\n want %s", dpar, wantD)
			}
			if string(dr.body) != withParams(clientBody, wantD) {
				t.Fatalf("decode body\n got  %s\n want %s", dr.body, withParams(clientBody, wantD))
			}

			// DP rank headers only when dp_size > 1; remote_dp_rank == P's header.
			pRank, pHas := rankHeader(pr)
			dRank, dHas := rankHeader(dr)
			if pHas != (tc.pDP > 1) || dHas != (tc.dDP > 1) {
				t.Fatalf("rank headers: P %v %q, D %v %q", pHas, pRank, dHas, dRank)
			}
			if pHas && pRank != fmt.Sprint(tc.pRank) {
				t.Fatalf("P rank header %q", pRank)
			}
			if dHas && dRank != fmt.Sprint(tc.dRank) {
				t.Fatalf("D rank header %q", dRank)
			}
			if pHas && !strings.Contains(string(dpar), `"remote_dp_rank":`+pRank+`}`) {
				t.Fatalf("remote_dp_rank on D does not match P's header %s: %s", pRank, dpar)
			}

			c := h.last.Load()
			rc := c.Receipt
			if rc.Mode != "pd" || rc.Prefill != pw.Key() || rc.Decode != dw.Key() || rc.Attempts != 1 || len(rc.Failovers) != 0 {
				t.Fatalf("receipt %+v", rc)
			}
			waitIdle(t, pw, dw)
		})
	}
}

// waitIdle waits for the in-flight counts to drop to zero.
func waitIdle(t *testing.T, ws ...*worker.Worker) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for _, w := range ws {
		for w.Load() != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s still has %d in flight", w.Key(), w.Load())
			}
			time.Sleep(time.Millisecond)
		}
	}
}

func TestMoRIIOReadConformance(t *testing.T) {
	pFin := make(chan time.Time, 1)
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		tx := strField(t, rec.params(t), "transfer_id")
		pFin <- time.Now()
		writeJSON(w, 200, prefillJSON(fmt.Sprintf(`{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2], [3]], "remote_engine_id": "127.0.0.1:6301", "remote_host": "127.0.0.1", "remote_handshake_port": 6301, "remote_notify_port": 61005, "remote_dp_size": 2, "tp_size": 2, "transfer_id": %q, "remote_dp_rank": 1, "remote_dp_rank_override": true, "remote_dp_size_local": 2}`, tx)))
	})
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, zmqAddr4(pZMQ, "READ"), dp(2, 1), tp(2))
	addWorker(t, reg, D.URL(), worker.RoleDecode, zmqAddr4(dZMQ, "READ"))
	h := newHarness(t, reg, Options{Connector: "moriio"})

	res := h.post(t, "/v1/completions", clientBody)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	pr, dr := P.next(t), D.next(t)
	if !dr.at.After(<-pFin) {
		t.Fatalf("READ: decode sent before the prefill finished")
	}
	id := pr.hdr.Get("X-Request-Id")
	checkRequestID(t, id, pZMQ, dZMQ)
	if dr.hdr.Get("X-Request-Id") != id {
		t.Fatal("X-Request-Id differs between legs")
	}
	if pr.hdr.Get("Authorization") != "" {
		t.Fatalf("unexpected Authorization %q", pr.hdr.Get("Authorization"))
	}
	tx := strField(t, pr.params(t), "transfer_id")
	if !txRE.MatchString(tx) {
		t.Fatalf("transfer_id %q", tx)
	}
	// everything P returned overlaid, base order kept, new keys appended
	want := fmt.Sprintf(`{"do_remote_decode":false,"do_remote_prefill":true,"transfer_id":%q,"remote_engine_id":"127.0.0.1:6301","remote_block_ids":[[1, 2], [3]],"remote_dp_size":2,"remote_tp_size":2,"tp_size":2,"remote_host":"127.0.0.1","remote_port":%d,"remote_handshake_port":6301,"remote_notify_port":61005,"remote_dp_rank":1,"remote_dp_rank_override":true,"remote_dp_size_local":2}`, tx, P.port())
	if got := string(dr.params(t)); got != want {
		t.Fatalf("decode params\n got  %s\n want %s", got, want)
	}
	if rk, _ := rankHeader(pr); rk != "1" {
		t.Fatalf("P rank header %q", rk)
	}
	if _, ok := rankHeader(dr); ok {
		t.Fatal("D rank header with dp_size 1")
	}
}

func TestNIXLConformanceChatMaxCompletionTokens(t *testing.T) {
	const pRet = `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [4, 5], "remote_engine_id": "e1", "remote_request_id": "r", "remote_host": "h", "remote_port": 5600, "tp_size": 1}`
	P := newFake(t, prefillOK(pRet))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", ForwardClientAuth: true})

	body := `{"messages":[{"role":"user","content":"hi"}],"model":"m","max_completion_tokens":7,"stream":false}`
	res := h.post(t, "/v1/chat/completions", body, "Authorization", "Bearer client-key", "X-Request-Id", "mine")
	if res.status != 200 || !strings.Contains(res.body, `"Hello"`) {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	if res.hdr.Get("Content-Length") == "" {
		t.Fatal("non-streaming relay lost Content-Length")
	}
	pr, dr := P.next(t), D.next(t)
	const wantP = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`
	wantPBody := `{"messages":[{"role":"user","content":"hi"}],"model":"m","max_completion_tokens":1,"stream":false,"max_tokens":1,"kv_transfer_params":` + wantP + `}`
	if string(pr.body) != wantPBody {
		t.Fatalf("prefill body\n got  %s\n want %s", pr.body, wantPBody)
	}
	// D gets P's params verbatim (bytes, whitespace included), body otherwise untouched.
	if string(dr.body) != withParams(body, pRet) {
		t.Fatalf("decode body\n got  %s\n want %s", dr.body, withParams(body, pRet))
	}
	// static workers: host:port in the request id
	hp := func(u string) string { return strings.TrimPrefix(u, "http://") }
	checkRequestID(t, pr.hdr.Get("X-Request-Id"), hp(P.URL()), hp(D.URL()))
	if dr.hdr.Get("X-Request-Id") != pr.hdr.Get("X-Request-Id") {
		t.Fatal("X-Request-Id differs")
	}
	for _, r := range []*recorded{pr, dr} {
		if r.hdr.Get("Authorization") != "Bearer client-key" {
			t.Fatalf("client Authorization not forwarded: %q", r.hdr.Get("Authorization"))
		}
		if r.path != "/v1/chat/completions" {
			t.Fatalf("path %q", r.path)
		}
	}
}

func TestP2PNCCLConformance(t *testing.T) {
	P := newFake(t, prefillOK("null"))
	D := newFake(t, decodeSSE)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill, func(s *worker.Spec) { s.ZMQAddress = "127.0.0.1:21001"; s.Format = "p2pnccl" })
	addWorker(t, reg, D.URL(), worker.RoleDecode, func(s *worker.Spec) { s.ZMQAddress = "127.0.0.1:22001"; s.Format = "p2pnccl" })
	h := newHarness(t, reg, Options{Connector: "p2pnccl"})

	body := `{"prompt":"x","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}`
	res := h.post(t, "/v1/completions", body)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	pr, dr := P.next(t), D.next(t)
	if string(pr.body) != `{"prompt":"x","max_tokens":1,"stream":false}` {
		t.Fatalf("prefill body %s", pr.body)
	}
	if string(dr.body) != body {
		t.Fatalf("decode body %s, want the original", dr.body)
	}
	checkRequestID(t, pr.hdr.Get("X-Request-Id"), "127.0.0.1:21001", "127.0.0.1:22001")
	if dr.hdr.Get("X-Request-Id") != pr.hdr.Get("X-Request-Id") {
		t.Fatal("X-Request-Id differs")
	}
}

func TestResponsesAndGenerateRewrites(t *testing.T) {
	P := newFake(t, prefillOK(`{"remote_block_ids":[1]}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", SplitResponses: true})
	const kv = `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`
	cases := []struct{ path, in, wantP string }{
		{"/v1/responses", `{"model":"m","input":"hi","max_output_tokens":50,"stream":true}`,
			`{"model":"m","input":"hi","max_output_tokens":1,"stream":false,"kv_transfer_params":` + kv + `}`},
		{"/generate", `{"prompt":"hi","sampling_params":{"temperature":0,"max_tokens":50,"min_tokens":3},"x":1}`,
			`{"prompt":"hi","sampling_params":{"temperature":0,"max_tokens":1,"min_tokens":1},"x":1,"stream":false,"kv_transfer_params":` + kv + `}`},
		{"/inference/v1/generate", `{"token_ids":[1,2,3]}`,
			`{"token_ids":[1,2,3],"sampling_params":{"max_tokens":1},"stream":false,"kv_transfer_params":` + kv + `}`},
		{"/v1/completions", `{"prompt":"hi","min_tokens":1,"min_completion_tokens":9}`,
			`{"prompt":"hi","min_tokens":1,"min_completion_tokens":1,"max_tokens":1,"stream":false,"kv_transfer_params":` + kv + `}`},
	}
	for _, tc := range cases {
		res := h.post(t, tc.path, tc.in)
		if res.status != 200 {
			t.Fatalf("%s: status %d %s", tc.path, res.status, res.body)
		}
		pr, dr := P.next(t), D.next(t)
		if string(pr.body) != tc.wantP {
			t.Fatalf("%s prefill body\n got  %s\n want %s", tc.path, pr.body, tc.wantP)
		}
		if pr.path != tc.path || dr.path != tc.path {
			t.Fatalf("paths %s %s", pr.path, dr.path)
		}
		if string(dr.body) != withParams(tc.in, `{"remote_block_ids":[1]}`) {
			t.Fatalf("%s decode body %s", tc.path, dr.body)
		}
	}
}

func TestToyProxyOutputLength(t *testing.T) {
	P := newFake(t, prefillOK(`{"k":1}`))
	D := newFake(t, decodeJSON)
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P.URL(), worker.RolePrefill)
	addWorker(t, reg, D.URL(), worker.RoleDecode)
	h := newHarness(t, reg, Options{Connector: "nixl", OutputLength: OutputToyProxy})
	cases := []struct{ path, in, want string }{
		{"/v1/chat/completions", `{"messages":[],"max_tokens":20,"max_completion_tokens":10}`, `{"messages":[],"max_tokens":20,"max_completion_tokens":9}`},
		{"/v1/chat/completions", `{"messages":[],"max_completion_tokens":10}`, `{"messages":[],"max_completion_tokens":9}`},
		{"/v1/completions", `{"prompt":"p","max_tokens":5}`, `{"prompt":"p","max_tokens":4}`},
		{"/v1/completions", `{"prompt":"p","max_tokens":1}`, `{"prompt":"p","max_tokens":1}`},
		{"/v1/completions", `{"prompt":"p"}`, `{"prompt":"p"}`},
		{"/v1/completions", `{"prompt":"p","max_tokens":null}`, `{"prompt":"p","max_tokens":null}`},
	}
	for _, tc := range cases {
		if res := h.post(t, tc.path, tc.in); res.status != 200 {
			t.Fatalf("%s: %d %s", tc.in, res.status, res.body)
		}
		P.next(t)
		if got := string(D.next(t).body); got != withParams(tc.want, `{"k":1}`) {
			t.Fatalf("%s: decode body %s", tc.in, got)
		}
	}
}

func TestMooncakeBootstrapRetriedAndUsed(t *testing.T) {
	var queries = make(chan struct{}, 16)
	boot := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		queries <- struct{}{}
		if r.URL.Path != "/query" || r.Method != http.MethodGet {
			writeJSON(w, 404, `{}`)
			return
		}
		if len(queries) <= 2 { // fail the first two queries
			writeJSON(w, 503, `{"error":"not yet"}`)
			return
		}
		writeJSON(w, 200, `{"0":{"engine_id":"eng-0","worker_addr":{"0":{"0":"10.0.0.1:7000"}}},"1":{"engine_id":"eng-1","worker_addr":{}}}`)
	})
	dGot, pDone := make(chan struct{}), make(chan struct{})
	P := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		select {
		case <-dGot:
		case <-time.After(3 * time.Second):
		}
		prefillOK(`{"x":1}`)(w, r, rec)
		close(pDone)
	})
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		close(dGot)
		startSSE(w)
		<-pDone // the first token needs P's KV
		sendEvents(w)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	h := newHarness(t, reg, Options{Connector: "mooncake", BootstrapBackoff: 20 * time.Millisecond, BootstrapMaxBackoff: 40 * time.Millisecond})
	// workers appear after the engine started: bootstrap is fetched in the background
	addWorker(t, reg, P.URL(), worker.RolePrefill, bootPort(boot.port()), dp(2, 1))
	addWorker(t, reg, D.URL(), worker.RoleDecode)

	deadline := time.Now().Add(3 * time.Second)
	for {
		ok, why := h.eng.Ready()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("never ready: %s", why)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := len(queries); n < 3 {
		t.Fatalf("bootstrap queried %d times, want >= 3 (two failures retried)", n)
	}
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 || res.body != sseAll() {
		t.Fatalf("status %d body %q", res.status, res.body)
	}
	pr, dr := P.next(t), D.next(t)
	tx := strField(t, pr.params(t), "transfer_id")
	if !xferRE.MatchString(tx) {
		t.Fatalf("transfer_id %q", tx)
	}
	if got, want := string(pr.params(t)), fmt.Sprintf(`{"do_remote_decode":true,"do_remote_prefill":false,"transfer_id":%q}`, tx); got != want {
		t.Fatalf("prefill params %s want %s", got, want)
	}
	want := fmt.Sprintf(`{"do_remote_decode":false,"do_remote_prefill":true,"remote_bootstrap_addr":"http://127.0.0.1:%d","remote_engine_id":"eng-1","transfer_id":%q}`, boot.port(), tx)
	if got := string(dr.params(t)); got != want {
		t.Fatalf("decode params\n got  %s\n want %s", got, want)
	}
	if rk, _ := rankHeader(pr); rk != "1" {
		t.Fatalf("P rank header %q", rk)
	}
}

func TestMooncakeRoutesToPrefillWithBootstrapInfo(t *testing.T) {
	boot := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		writeJSON(w, 200, `{"0":{"engine_id":"eng-ok"}}`)
	})
	noBoot := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		writeJSON(w, 500, `{"error":"down"}`)
	})
	pDone := make(chan struct{}, 1)
	pf := func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		prefillOK(`{}`)(w, r, rec)
		pDone <- struct{}{}
	}
	P1 := newFake(t, pf)
	P2 := newFake(t, pf)
	D := newFake(t, func(w http.ResponseWriter, r *http.Request, rec *recorded) {
		startSSE(w)
		<-pDone
		sendEvents(w)
	})
	reg := worker.NewRegistry(worker.BreakerConfig{})
	addWorker(t, reg, P1.URL(), worker.RolePrefill, bootPort(noBoot.port()))
	h := newHarness(t, reg, Options{Connector: "mooncake", BootstrapBackoff: time.Hour,
		PrefillPolicy: &prefer{urls: []string{P1.URL()}}})
	addWorker(t, reg, D.URL(), worker.RoleDecode)

	// only P1, without bootstrap info: 503 with the reason
	res := h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 503 || !strings.Contains(res.body, "bootstrap") {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	if ok, why := h.eng.Ready(); ok || !strings.Contains(why, "bootstrap") {
		t.Fatalf("Ready = %v %q", ok, why)
	}
	addWorker(t, reg, P2.URL(), worker.RolePrefill, bootPort(boot.port()))
	deadline := time.Now().Add(3 * time.Second)
	for ok, _ := h.eng.Ready(); !ok; ok, _ = h.eng.Ready() {
		if time.Now().After(deadline) {
			t.Fatal("never ready")
		}
		time.Sleep(5 * time.Millisecond)
	}
	res = h.post(t, "/v1/completions", `{"prompt":"p","stream":true}`)
	if res.status != 200 {
		t.Fatalf("status %d body %s", res.status, res.body)
	}
	P2.next(t)
	P1.none(t)
	if !strings.Contains(string(D.next(t).params(t)), `"remote_engine_id":"eng-ok"`) {
		t.Fatal("decode did not get the engine id")
	}
}
