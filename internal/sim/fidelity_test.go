package sim

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// Tests for the places where the simulator must be exactly as strict (or as
// broken) as real vLLM, so that router bugs show up in end-to-end tests.

// readPrefill runs a READ prefill on P (optionally pinned to pRank) and
// returns the decode params a router would build: its own fields overlaid
// with everything P returned.
func readPrefill(t *testing.T, p, d *Instance, prompt string, pRank int) (xrid string, dkv map[string]any) {
	t.Helper()
	ctx := testCtx(t)
	xrid, tid := moriID(p, d), "tx-"+uuid4()
	hdr := map[string]string{"X-Request-Id": xrid}
	if pRank >= 0 {
		hdr["X-data-parallel-rank"] = fmt.Sprint(pRank)
	}
	pres := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)), hdr)
	pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
	if pres.status != 200 || !ok {
		t.Fatalf("prefill: %d %s", pres.status, pres.raw)
	}
	dkv = moriDecodeKV(p, tid)
	for k, v := range pkv {
		dkv[k] = v
	}
	dkv["do_remote_prefill"], dkv["do_remote_decode"] = true, false
	return xrid, dkv
}

func violations(t *testing.T, in *Instance) (int64, string) {
	t.Helper()
	s := statsOf(t, in)
	return s.Transfers.ProtocolViolations, s.Transfers.LastProtocolViolation
}

// S1: D reads from the P rank named by remote_dp_rank. If P ran the request
// on another rank, the RDMA read of rank 0's blocks "succeeds" on the wrong
// memory: garbage output, no error, and the release goes to the wrong
// rank's notify port, so the right rank keeps its blocks until the reaper.
func TestReadFromWrongPrefillRankIsGarbage(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--data-parallel-size", "2", "--defer-timeout", "2s", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	u := startSim(t)
	prompt := words(60, "wr")
	want := unifiedText(t, ctx, u, prompt, 6)

	xrid, dkv := readPrefill(t, p, d, prompt, 1)
	if dkv["remote_dp_rank"] != 1.0 {
		t.Fatalf("P's params name rank %v, want 1", dkv["remote_dp_rank"])
	}
	checkDecodeOutput(t, doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 6), dkv), map[string]string{"X-Request-Id": xrid}), want, 6)
	waitFor(t, "release frees rank 1", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	if got := statsOf(t, p).LastSideChannel["release"]; got != p.notifyBase+1 {
		t.Errorf("release arrived on port %d, want notify base + 1 = %d", got, p.notifyBase+1)
	}

	xrid, dkv = readPrefill(t, p, d, prompt, 1)
	dkv["remote_dp_rank"] = 0 // the router's DP bug
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 6), dkv), map[string]string{"X-Request-Id": xrid})
	if res.status != 200 || !res.done || res.errEvent != nil || res.tokens != 6 {
		t.Fatalf("wrong-rank read: status %d done %v error %v tokens %d; vLLM reports no error", res.status, res.done, res.errEvent, res.tokens)
	}
	if res.text == want {
		t.Fatal("wrong-rank read produced the correct output; vLLM decodes garbage")
	}
	ds, ps := statsOf(t, d), statsOf(t, p)
	if ds.Transfers.KVGarbage != 1 || ds.Transfers.ReadsFailed != 0 || ds.Transfers.ProtocolViolations != 0 {
		t.Errorf("decode: kv_garbage %d reads_failed %d violations %d, want 1 0 0", ds.Transfers.KVGarbage, ds.Transfers.ReadsFailed, ds.Transfers.ProtocolViolations)
	}
	if ps.Transfers.ReadsUnmatched != 1 || ps.LastSideChannel["release"] != p.notifyBase {
		t.Errorf("prefill: reads_unmatched %d, release port %d (want 1, notify base %d)", ps.Transfers.ReadsUnmatched, ps.LastSideChannel["release"], p.notifyBase)
	}
	if ps.Engines[1].KVBlocksUsed == 0 {
		t.Error("rank 1 freed its blocks although its release went to rank 0")
	}
	waitFor(t, "the defer reaper frees rank 1", func() bool {
		s := statsOf(t, p)
		return s.KVBlocksUsed == 0 && s.Transfers.DeferExpired == 1
	})
}

func TestNIXLReadOfUnknownRequestIsGarbage(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	u := startSim(t)
	prompt := words(40, "nu")
	want := unifiedText(t, ctx, u, prompt, 5)
	hdr := map[string]string{"X-Request-Id": uuid4()}
	pres := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, map[string]any{"do_remote_decode": true}), hdr)
	pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
	if !ok {
		t.Fatalf("prefill: %s", pres.raw)
	}
	pkv["remote_request_id"] = "cmpl-not-pinned-anywhere"
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 5), pkv), hdr)
	if res.status != 200 || !res.done || res.text == want {
		t.Fatalf("NIXL read of an unknown request: status %d done %v, output must be garbage", res.status, res.done)
	}
	if s := statsOf(t, d); s.Transfers.KVGarbage != 1 || s.Transfers.ReadsFailed != 0 {
		t.Errorf("decode transfers %+v", s.Transfers)
	}
	if s := statsOf(t, p); s.Transfers.ReadsUnmatched != 1 {
		t.Errorf("prefill reads_unmatched %d, want 1", s.Transfers.ReadsUnmatched)
	}
}

// An explicit RDMA failure (fault fail_reads) releases and recomputes: the
// output stays correct, reads_failed counts it.
func TestInjectedReadFailureRecomputes(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict", "--fail-reads", "1")
	u := startSim(t)
	prompt := words(70, "fr")
	want := unifiedText(t, ctx, u, prompt, 5)
	checkDecodeOutput(t, runRead(t, ctx, p, d, prompt, 5), want, 5)
	waitFor(t, "release after a failed read", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	s := statsOf(t, d)
	if s.Transfers.ReadsFailed != 1 || s.Transfers.KVGarbage != 0 || s.Transfers.ReadsDone != 0 || *s.Faults.FailReads != 0 {
		t.Errorf("after an injected read failure: %+v faults %v", s.Transfers, s.Faults)
	}
	checkDecodeOutput(t, runRead(t, ctx, p, d, prompt, 5), want, 5)
	if s := statsOf(t, d); s.Transfers.ReadsDone != 1 {
		t.Errorf("second read: reads_done %d", s.Transfers.ReadsDone)
	}
	two := 2
	if err := d.faults.validateAndApply(FaultsJSON{FailReads: &two}); err != nil {
		t.Fatal(err)
	}
	if got := statsOf(t, d).Faults.FailReads; *got != 2 {
		t.Errorf("fail_reads via faults: %d", *got)
	}
}

// S2: a MoRI-IO prefill without transfer_id is a violation: 400 in strict
// mode, counted (and a sidecar id synthesized) otherwise.
func TestMoRIPrefillWithoutTransferIDIsCounted(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ")
	kv := moriPrefillKV(d, "")
	delete(kv, "transfer_id")
	r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody("a b c", kv), map[string]string{"X-Request-Id": moriID(p, d)})
	if r.status != 200 {
		t.Fatalf("non-strict: %d %s", r.status, r.raw)
	}
	if tid, _ := r.body["kv_transfer_params"].(map[string]any)["transfer_id"].(string); !strings.HasPrefix(tid, "sidecar-") {
		t.Errorf("synthesized transfer_id %q", tid)
	}
	if n, last := violations(t, p); n != 1 || !strings.Contains(last, "transfer_id") {
		t.Errorf("protocol_violations %d %q, want 1 about transfer_id", n, last)
	}
}

// S3: unpinned requests are spread over the DP engines even when they are
// all idle (serial requests).
func TestUnpinnedRequestsRotateOverDPEngines(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--data-parallel-size", "3", "--profile-preset", "zero")
	for i := range 6 {
		if r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": fmt.Sprintf("x %d", i), "max_tokens": 2}, nil); r.status != 200 {
			t.Fatal(r.status)
		}
	}
	for i, e := range u.engines {
		if n := e.Snapshot().FinishedLength; n != 2 {
			t.Errorf("engine %d served %d of 6 serial requests, want 2", i, n)
		}
	}
	for range 3 {
		postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": "y", "max_tokens": 2}, map[string]string{"X-data-parallel-rank": "2"})
	}
	if n := u.engines[2].Snapshot().FinishedLength; n != 5 {
		t.Errorf("pinned requests: engine 2 served %d, want 5", n)
	}
}

// S4: explicit params win over the X-Request-Id; if both are there and
// disagree it is a violation.
func TestMoRIAddressParamsFirst(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "WRITE")
	d := startSim(t, "--role", "decode", "--transfer-mode", "WRITE")
	u := startSim(t)
	prompt := words(50, "ap")
	want := unifiedText(t, ctx, u, prompt, 4)
	bogus := "host:127.0.0.1,handshake:1,notify:2"
	xrid := "___prefill_addr_" + bogus + "___decode_addr_" + bogus + "_" + hex32()
	tid := "tx-" + uuid4()
	hdr := map[string]string{"X-Request-Id": xrid}
	var wg sync.WaitGroup
	var pres jsonResult
	wg.Go(func() {
		pres = postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)), hdr)
	})
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 4), moriDecodeKV(p, tid)), hdr)
	wg.Wait()
	if pres.status != 200 {
		t.Fatalf("prefill %d %s", pres.status, pres.raw)
	}
	checkDecodeOutput(t, res, want, 4) // the params were used on both sides
	for name, in := range map[string]*Instance{"prefill": p, "decode": d} {
		if n, last := violations(t, in); n != 1 || !strings.Contains(last, "disagrees") {
			t.Errorf("%s: protocol_violations %d %q, want 1 (address disagreement)", name, n, last)
		}
	}
	strict := startSim(t, "--role", "decode", "--transfer-mode", "WRITE", "--strict")
	if r := postJSON(t, ctx, strict.url("/v1/completions"), withKV(clientBody(prompt, 4), moriDecodeKV(p, "tx-"+uuid4())), hdr); r.status != 400 {
		t.Errorf("strict decode with disagreeing addresses: %d", r.status)
	}
	// Only the id: it is used (no violation).
	d2 := startSim(t, "--role", "decode", "--transfer-mode", "WRITE", "--strict")
	tid = "tx-" + uuid4()
	xrid = moriID(p, d2)
	hdr = map[string]string{"X-Request-Id": xrid}
	dkv := moriDecodeKV(p, tid)
	delete(dkv, "remote_host")
	delete(dkv, "remote_handshake_port")
	delete(dkv, "remote_notify_port")
	wg.Go(func() {
		pres = postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d2, tid)), hdr)
	})
	checkDecodeOutput(t, doStream(t, ctx, d2.url("/v1/completions"), withKV(clientBody(prompt, 4), dkv), hdr), want, 4)
	wg.Wait()
	if n, _ := violations(t, d2); n != 0 {
		t.Errorf("id-only decode: %d violations", n)
	}
}

// S5: READ D needs tp_size from P's response (no remote_tp_size fallback);
// WRITE P needs tp_size.
func TestTPSizeRequired(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ")
	strictD := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	laxD := startSim(t, "--role", "decode", "--transfer-mode", "READ")
	u := startSim(t)
	prompt := words(30, "tp")
	xrid, dkv := readPrefill(t, p, strictD, prompt, -1)
	delete(dkv, "tp_size")
	if r := postJSON(t, ctx, strictD.url("/v1/completions"), withKV(clientBody(prompt, 3), dkv), map[string]string{"X-Request-Id": xrid}); r.status != 400 || !strings.Contains(string(r.raw), "tp_size") {
		t.Errorf("strict READ decode without tp_size: %d %s", r.status, r.raw)
	}
	xrid, dkv = readPrefill(t, p, laxD, prompt, -1)
	delete(dkv, "tp_size")
	checkDecodeOutput(t, doStream(t, ctx, laxD.url("/v1/completions"), withKV(clientBody(prompt, 3), dkv), map[string]string{"X-Request-Id": xrid}),
		unifiedText(t, ctx, u, prompt, 3), 3)
	if n, last := violations(t, laxD); n != 1 || !strings.Contains(last, "tp_size") {
		t.Errorf("lax READ decode without tp_size: violations %d %q", n, last)
	}
	wp := startSim(t, "--role", "prefill", "--transfer-mode", "WRITE", "--strict")
	kv := moriPrefillKV(laxD, "tx-"+uuid4())
	delete(kv, "tp_size")
	if r := postJSON(t, ctx, wp.url("/v1/completions"), prefillBody(prompt, kv), nil); r.status != 400 || !strings.Contains(string(r.raw), "tp_size") {
		t.Errorf("strict WRITE prefill without tp_size: %d %s", r.status, r.raw)
	}
}

// S6: the keys vLLM's MoRI-IO prefill indexes must be present (null ok).
func TestMoRIPrefillRequiredKeys(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--strict")
	lax := startSim(t, "--role", "prefill", "--transfer-mode", "READ")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ")
	for _, k := range []string{"remote_block_ids", "remote_engine_id", "remote_host", "remote_port", "remote_handshake_port", "remote_notify_port"} {
		kv := moriPrefillKV(d, "tx-"+uuid4())
		delete(kv, k)
		hdr := map[string]string{"X-Request-Id": moriID(p, d)}
		if r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody("a b", kv), hdr); r.status != 400 || !strings.Contains(string(r.raw), k) {
			t.Errorf("strict prefill without %s: %d %s", k, r.status, r.raw)
		}
		if r := postJSON(t, ctx, lax.url("/v1/completions"), prefillBody("a b", kv), hdr); r.status != 200 {
			t.Errorf("lax prefill without %s: %d %s", k, r.status, r.raw)
		}
	}
	if n, _ := violations(t, lax); n != 6 {
		t.Errorf("lax prefill counted %d violations, want 6", n)
	}
	// null values are what routers send: fine.
	if r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody("a b", moriPrefillKV(d, "tx-"+uuid4())), map[string]string{"X-Request-Id": moriID(p, d)}); r.status != 200 {
		t.Errorf("complete params: %d %s", r.status, r.raw)
	}
	if n, _ := violations(t, p); n != 6 {
		t.Errorf("strict prefill counted %d violations, want 6 (the 400s)", n)
	}
}

// responsesEvent is one "event: X\ndata: Y" SSE event.
type responsesEvent struct {
	typ  string
	data map[string]any
}

func readResponsesStream(t *testing.T, resp *http.Response) []responsesEvent {
	t.Helper()
	defer resp.Body.Close()
	var out []responsesEvent
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var cur responsesEvent
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if cur.typ != "" || cur.data != nil {
				out = append(out, cur)
			}
			cur = responsesEvent{}
		case strings.HasPrefix(line, "event: "):
			cur.typ = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &cur.data); err != nil {
				t.Fatalf("bad responses event data %q: %v", line, err)
			}
		default:
			t.Fatalf("unexpected SSE line %q", line)
		}
	}
	return out
}

// S7: /v1/responses, non-streaming and streaming.
func TestResponsesAPI(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--seed", "5")
	chat := postJSON(t, ctx, u.url("/v1/chat/completions"), map[string]any{
		"messages":   []any{map[string]any{"role": "system", "content": "be brief"}, map[string]any{"role": "user", "content": "hello there"}},
		"max_tokens": 6, "ignore_eos": true,
	}, nil)
	want := chat.body["choices"].([]any)[0].(map[string]any)["message"].(map[string]any)["content"].(string)
	wantPrompt := chat.body["usage"].(map[string]any)["prompt_tokens"]

	for name, input := range map[string]any{
		"string":   "hello there",
		"messages": []any{map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": "hello there"}}}},
	} {
		r := postJSON(t, ctx, u.url("/v1/responses"), map[string]any{"model": "sim-model", "input": input, "instructions": "be brief", "max_output_tokens": 6, "ignore_eos": true},
			map[string]string{"X-Request-Id": "r1"})
		if r.status != 200 || r.body["id"] != "resp_r1" || r.body["object"] != "response" || r.body["status"] != "incomplete" {
			t.Fatalf("%s: %d %s", name, r.status, r.raw)
		}
		if _, has := r.body["kv_transfer_params"]; has {
			t.Errorf("%s: /v1/responses must not return kv_transfer_params (vLLM < PR #37424)", name)
		}
		item := r.body["output"].([]any)[0].(map[string]any)
		text := item["content"].([]any)[0].(map[string]any)["text"]
		usage := r.body["usage"].(map[string]any)
		if item["type"] != "message" || item["role"] != "assistant" || text != want || usage["output_tokens"] != 6.0 || usage["input_tokens"] != wantPrompt {
			t.Errorf("%s: output %v usage %v, want text %q", name, item, usage, want)
		}
	}

	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, u.url("/v1/responses"),
		map[string]any{"input": "hello there", "instructions": "be brief", "max_output_tokens": 6, "ignore_eos": true, "stream": true}, nil))
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("content-type %q", ct)
	}
	evs := readResponsesStream(t, resp)
	var types []string
	var deltas strings.Builder
	for i, e := range evs {
		types = append(types, e.typ)
		if e.data["type"] != e.typ || e.data["sequence_number"] != float64(i) {
			t.Errorf("event %d: type %q data %v", i, e.typ, e.data)
		}
		if e.typ == "response.output_text.delta" {
			deltas.WriteString(e.data["delta"].(string))
		}
	}
	wantTypes := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	for range 6 {
		wantTypes = append(wantTypes, "response.output_text.delta")
	}
	wantTypes = append(wantTypes, "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed")
	if strings.Join(types, ",") != strings.Join(wantTypes, ",") {
		t.Errorf("event types\n got %v\nwant %v", types, wantTypes)
	}
	if deltas.String() != want {
		t.Errorf("streamed text %q, want %q", deltas.String(), want)
	}
	if last := evs[len(evs)-1].data["response"].(map[string]any); last["usage"].(map[string]any)["output_tokens"] != 6.0 {
		t.Errorf("completed event %v", last)
	}
	if s := statsOf(t, u); s.Requests.Responses != 4-1 {
		t.Errorf("responses counter %d", s.Requests.Responses)
	}
	// On a PD worker the route is plain generation; kv_transfer_params is
	// dropped by vLLM, which a router must not rely on: counted.
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ")
	r := postJSON(t, ctx, p.url("/v1/responses"), map[string]any{"input": "hi", "max_output_tokens": 1, "kv_transfer_params": map[string]any{"do_remote_decode": true, "transfer_id": "tx-1"}}, nil)
	if s := statsOf(t, p); r.status != 200 || s.Requests.Plain != 1 || s.Requests.PrefillLeg != 0 || s.KVBlocksUsed != 0 || s.Transfers.ProtocolViolations != 1 {
		t.Errorf("responses with kv params on a prefill: %d %s; stats %+v", r.status, r.raw, s.Requests)
	}
	sp := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--strict")
	if r := postJSON(t, ctx, sp.url("/v1/responses"), map[string]any{"input": "hi", "kv_transfer_params": map[string]any{"do_remote_decode": true}}, nil); r.status != 400 {
		t.Errorf("strict: responses with kv params: %d", r.status)
	}
	if r := postJSON(t, ctx, sp.url("/v1/responses"), map[string]any{"input": "hi", "max_output_tokens": 2}, nil); r.status != 200 {
		t.Errorf("strict prefill, plain responses: %d %s", r.status, r.raw)
	}
	sd := startSim(t, "--role", "decode", "--transfer-mode", "WRITE", "--strict")
	if r := postJSON(t, ctx, sd.url("/v1/responses"), map[string]any{"input": "hi"}, nil); r.status != 400 {
		t.Errorf("strict MoRI decode, plain responses: %d (a plain request on a MoRI decode hangs in vLLM)", r.status)
	}
	for name, body := range map[string]any{
		"no input":       map[string]any{"max_output_tokens": 2},
		"bad input":      map[string]any{"input": 3},
		"zero max":       map[string]any{"input": "x", "max_output_tokens": 0},
		"tool item":      map[string]any{"input": []any{map[string]any{"type": "function_call_output", "call_id": "c"}}},
		"wrong model":    map[string]any{"input": "x", "model": "nope"},
		"not an object":  []any{1},
		"empty messages": map[string]any{"input": []any{}},
	} {
		if r := postJSON(t, ctx, u.url("/v1/responses"), body, nil); r.status/100 != 4 {
			t.Errorf("%s: %d %s", name, r.status, r.raw)
		}
	}
}

// S8: batched prompts: one choice per prompt, like vLLM.
func TestBatchedPrompts(t *testing.T) {
	ctx := testCtx(t)
	u := startSim(t, "--data-parallel-size", "2")
	prompts := []string{"alpha beta", "gamma delta epsilon", "zeta"}
	r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": prompts, "max_tokens": 4, "ignore_eos": true}, map[string]string{"X-Request-Id": "b1"})
	if r.status != 200 || r.body["id"] != "cmpl-b1" {
		t.Fatalf("%d %s", r.status, r.raw)
	}
	choices := r.body["choices"].([]any)
	if len(choices) != 3 {
		t.Fatalf("%d choices", len(choices))
	}
	for i, c := range choices {
		c := c.(map[string]any)
		if c["index"] != float64(i) || c["text"] != oracle.Text(oracle.DigestText(prompts[i]), 0, 4) || c["finish_reason"] != "length" {
			t.Errorf("choice %d: %v", i, c)
		}
	}
	if us := r.body["usage"].(map[string]any); us["prompt_tokens"] != 6.0 || us["completion_tokens"] != 12.0 {
		t.Errorf("usage %v", us)
	}
	// streaming: chunks carry their choice index; the usage chunk sums.
	res := doStream(t, ctx, u.url("/v1/completions"), map[string]any{
		"prompt": prompts, "max_tokens": 4, "ignore_eos": true, "stream": true, "stream_options": map[string]any{"include_usage": true},
	}, nil)
	if !res.done || res.tokens != 12 || res.usage["completion_tokens"] != 12.0 || res.usage["prompt_tokens"] != 6.0 {
		t.Fatalf("batched stream: done %v tokens %d usage %v", res.done, res.tokens, res.usage)
	}
	texts := make([]string, len(prompts))
	for _, ev := range res.events {
		for _, c := range ev["choices"].([]any) {
			c := c.(map[string]any)
			texts[int(c["index"].(float64))] += c["text"].(string)
		}
	}
	for i, p := range prompts {
		if want := oracle.Text(oracle.DigestText(p), 0, 4); texts[i] != want {
			t.Errorf("streamed choice %d: %q, want %q", i, texts[i], want)
		}
	}
	// token-id batches too.
	if r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": [][]int{{5, 6}, {7}}, "max_tokens": 2}, nil); r.status != 200 || len(r.body["choices"].([]any)) != 2 {
		t.Errorf("token-id batch: %d %s", r.status, r.raw)
	}
	if r := postJSON(t, ctx, u.url("/v1/completions"), map[string]any{"prompt": []string{}}, nil); r.status != 400 {
		t.Errorf("empty prompt list: %d", r.status)
	}

	// PD: a batch with kv_transfer_params is a violation (strict 400); a
	// lax decode hands the transfer to prompt 0 only: the others decode
	// garbage.
	sp := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	body := prefillBody("x", map[string]any{"do_remote_decode": true})
	body["prompt"] = prompts
	if r := postJSON(t, ctx, sp.url("/v1/completions"), body, nil); r.status != 400 || !strings.Contains(string(r.raw), "batched") {
		t.Errorf("strict prefill, batched PD request: %d %s", r.status, r.raw)
	}
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl")
	pres := postJSON(t, ctx, p.url("/v1/completions"), body, nil)
	pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
	if pres.status != 200 || !ok || len(pres.body["choices"].([]any)) != 3 {
		t.Fatalf("lax batched prefill: %d %s", pres.status, pres.raw)
	}
	dr := postJSON(t, ctx, d.url("/v1/completions"), map[string]any{"prompt": prompts, "max_tokens": 4, "ignore_eos": true, "kv_transfer_params": pkv}, nil)
	dc := dr.body["choices"].([]any)
	if dr.status != 200 || len(dc) != 3 {
		t.Fatalf("lax batched decode: %d %s", dr.status, dr.raw)
	}
	if got := dc[0].(map[string]any)["text"]; got != oracle.Text(oracle.DigestText(prompts[0]), 0, 4) {
		t.Errorf("prompt 0 got the transfer but decoded %q", got)
	}
	if got := dc[1].(map[string]any)["text"]; got == oracle.Text(oracle.DigestText(prompts[1]), 0, 4) {
		t.Error("prompt 1 shares prompt 0's transfer and must not decode correctly")
	}
	if s := statsOf(t, d); s.Transfers.KVGarbage != 2 || s.Transfers.ProtocolViolations != 1 {
		t.Errorf("lax decode: kv_garbage %d violations %d, want 2 and 1", s.Transfers.KVGarbage, s.Transfers.ProtocolViolations)
	}
}

// S9: Mooncake's remote_bootstrap_addr needs its scheme.
func TestMooncakeBootstrapAddrNeedsScheme(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "mooncake")
	strict := startSim(t, "--role", "decode", "--kv-connector", "mooncake", "--strict")
	lax := startSim(t, "--role", "decode", "--kv-connector", "mooncake", "--kv-wait-timeout", "300ms")
	kv := map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": "xfer-1",
		"remote_bootstrap_addr": fmt.Sprintf("127.0.0.1:%d", p.Ready().BootstrapPort), "remote_engine_id": "e",
	}
	if r := postJSON(t, ctx, strict.url("/v1/completions"), withKV(clientBody("a b", 2), kv), nil); r.status != 400 || !strings.Contains(string(r.raw), "http://") {
		t.Errorf("strict: %d %s", r.status, r.raw)
	}
	res := doStream(t, ctx, lax.url("/v1/completions"), withKV(clientBody("a b", 2), kv), nil)
	if res.errEvent == nil || res.tokens != 0 {
		t.Errorf("lax: the decode must wait for KV that never comes (kv-wait-timeout error), got tokens %d err %v", res.tokens, res.errEvent)
	}
	if s := statsOf(t, lax); s.Transfers.ProtocolViolations != 1 || s.Transfers.Failed != 1 || s.Transfers.KVWaitTimeouts != 1 {
		t.Errorf("lax: %+v", s.Transfers)
	}
}

// S9: READ's release goes to notify + dp·tp_size + tp (0158326
// _read_blocks), the WRITE abort release and remote_blocks to notify + dp +
// tp.
func TestMoRIReleasePortArithmetic(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	u := startSim(t)
	prompt := words(20, "rp")
	xrid, dkv := readPrefill(t, p, d, prompt, 1)
	if dkv["tp_size"] != 2.0 || dkv["remote_dp_rank"] != 1.0 {
		t.Fatalf("prefill params %v", dkv)
	}
	checkDecodeOutput(t, doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 3), dkv), map[string]string{"X-Request-Id": xrid}),
		unifiedText(t, ctx, u, prompt, 3), 3)
	waitFor(t, "release", func() bool { return statsOf(t, p).Transfers.ReleaseReceived == 1 })
	if got := statsOf(t, p).LastSideChannel["release"]; got != p.notifyBase+1*2+0 {
		t.Errorf("READ release on port %d, want notify + 1*2 + 0 = %d", got, p.notifyBase+2)
	}
	if got, want := moriRemoteTPRank(1, 2, 4), 2; got != want {
		t.Errorf("remote tp rank(1, 2, 4) = %d, want %d", got, want)
	}
	if got, want := moriRemoteTPRank(3, 4, 2), 1; got != want {
		t.Errorf("remote tp rank(3, 4, 2) = %d, want %d", got, want)
	}
}

// A client's spare connection that never carried a request must not delay
// shutdown (http.Server.Shutdown alone waits 5 s for it).
func TestCloseDoesNotWaitForUnusedConnections(t *testing.T) {
	in := startSim(t, "--role", "prefill", "--kv-connector", "mooncake")
	for _, addr := range []string{in.HTTPAddr(), in.bootLn.Addr().String()} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	time.Sleep(50 * time.Millisecond) // let the servers accept them
	start := time.Now()
	in.Close()
	if d := time.Since(start); d > time.Second {
		t.Errorf("Close took %v with an unused connection open", d)
	}
}
