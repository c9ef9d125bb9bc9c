package sim

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
)

// The tests below drive P and D by hand exactly as PROTOCOL §8 prescribes
// for a router, over the real HTTP and ZMQ side channel.

const outTokens = 12

func clientBody(prompt string, n int) map[string]any {
	return map[string]any{
		"model": "sim-model", "prompt": prompt, "max_tokens": n, "ignore_eos": true,
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	}
}

// prefillBody is §8.B's P body: stream off, max_tokens 1, no stream_options.
func prefillBody(prompt string, kv map[string]any) map[string]any {
	return map[string]any{
		"model": "sim-model", "prompt": prompt, "max_tokens": 1, "ignore_eos": true,
		"stream": false, "kv_transfer_params": kv,
	}
}

func withKV(body map[string]any, kv map[string]any) map[string]any {
	out := make(map[string]any, len(body)+1)
	for k, v := range body {
		out[k] = v
	}
	out["kv_transfer_params"] = kv
	return out
}

func moriID(p, d *Instance) string {
	return "___prefill_addr_" + p.zmqAddress() + "___decode_addr_" + d.zmqAddress() + "_" + hex32()
}

func moriPrefillKV(d *Instance, tid string) map[string]any {
	return map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false,
		"remote_engine_id": nil, "remote_block_ids": nil, "transfer_id": tid,
		"remote_dp_size": d.cfg.DPSize, "remote_tp_size": d.cfg.TPSize, "tp_size": d.cfg.TPSize,
		"remote_host": d.cfg.AdvertiseHost, "remote_port": d.httpPort(),
		"remote_handshake_port": d.hsBase, "remote_notify_port": d.notifyBase,
	}
}

func moriDecodeKV(p *Instance, tid string) map[string]any {
	return map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true, "transfer_id": tid,
		"remote_engine_id": nil, "remote_block_ids": nil,
		"remote_dp_size": p.cfg.DPSize, "remote_tp_size": p.cfg.TPSize, "tp_size": p.cfg.TPSize,
		"remote_host": p.cfg.AdvertiseHost, "remote_handshake_port": p.hsBase, "remote_notify_port": p.notifyBase,
	}
}

// runWrite does one MoRI-IO WRITE request: D and P concurrently.
func runWrite(t *testing.T, ctx context.Context, p, d *Instance, prompt string, n int) streamResult {
	t.Helper()
	xrid, tid := moriID(p, d), "tx-"+uuid4()
	hdr := map[string]string{"X-Request-Id": xrid}
	var wg sync.WaitGroup
	var pres jsonResult
	start := time.Now()
	wg.Go(func() {
		pres = postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)), hdr)
	})
	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, d.url("/v1/completions"), withKV(clientBody(prompt, n), moriDecodeKV(p, tid)), hdr))
	if err != nil {
		t.Fatal(err)
	}
	res := readStream(t, resp, start)
	wg.Wait()
	if pres.status != 200 {
		t.Fatalf("prefill status %d: %s", pres.status, pres.raw)
	}
	return res
}

// runRead does one MoRI-IO READ request: P, then D with P's params.
func runRead(t *testing.T, ctx context.Context, p, d *Instance, prompt string, n int) streamResult {
	t.Helper()
	xrid, tid := moriID(p, d), "tx-"+uuid4()
	hdr := map[string]string{"X-Request-Id": xrid}
	start := time.Now()
	pres := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)), hdr)
	if pres.status != 200 {
		t.Fatalf("prefill status %d: %s", pres.status, pres.raw)
	}
	pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
	if !ok {
		t.Fatalf("prefill returned no kv_transfer_params: %s", pres.raw)
	}
	dkv := moriDecodeKV(p, tid)
	for k, v := range pkv { // overlay everything P returned (§8.B READ)
		dkv[k] = v
	}
	dkv["do_remote_prefill"], dkv["do_remote_decode"] = true, false
	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, d.url("/v1/completions"), withKV(clientBody(prompt, n), dkv), hdr))
	if err != nil {
		t.Fatal(err)
	}
	return readStream(t, resp, start)
}

func unifiedText(t *testing.T, ctx context.Context, u *Instance, prompt string, n int) string {
	t.Helper()
	res := doStream(t, ctx, u.url("/v1/completions"), clientBody(prompt, n), nil)
	if res.status != 200 || !res.done {
		t.Fatalf("unified: status %d done=%v", res.status, res.done)
	}
	return res.text
}

func checkDecodeOutput(t *testing.T, res streamResult, want string, n int) {
	t.Helper()
	if res.status != 200 || res.contentType != "text/event-stream; charset=utf-8" {
		t.Fatalf("decode: status %d content-type %q", res.status, res.contentType)
	}
	if res.errEvent != nil {
		t.Fatalf("decode stream error: %v", res.errEvent)
	}
	if !res.done || res.finish != "length" || res.tokens != n {
		t.Errorf("decode: done=%v finish=%q tokens=%d, want [DONE], length, %d", res.done, res.finish, res.tokens, n)
	}
	if res.text != want {
		t.Errorf("decode output differs from the unified worker:\n got %q\nwant %q", res.text, want)
	}
	if res.usage == nil || res.usage["completion_tokens"] != float64(n) {
		t.Errorf("usage chunk %v", res.usage)
	}
}

func TestMoRIIOWritePairMatchesUnified(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "WRITE", "--seed", "7", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "WRITE", "--seed", "7", "--strict")
	u := startSim(t, "--seed", "7")
	prompt := words(300, "a")
	want := unifiedText(t, ctx, u, prompt, outTokens)
	if o := oracle.Text(oracle.DigestText(prompt), 7, outTokens); o != want {
		t.Fatalf("unified worker %q disagrees with the oracle %q", want, o)
	}
	for range 2 {
		checkDecodeOutput(t, runWrite(t, ctx, p, d, prompt, outTokens), want, outTokens)
	}
	waitFor(t, "prefill blocks freed", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	ps, ds := statsOf(t, p), statsOf(t, d)
	if ps.Transfers.WriteDoneSent != 2 || ds.Transfers.WriteDoneReceived != 2 || ds.Transfers.RemoteBlocksSent != 2 || ps.Transfers.RemoteBlocksRecv != 2 {
		t.Errorf("side channel counts: P %+v, D %+v", ps.Transfers, ds.Transfers)
	}
	if ds.Transfers.KVDigestMismatch != 0 || ds.KVBlocksUsed != 0 {
		t.Errorf("decode: mismatch %d, blocks used %d", ds.Transfers.KVDigestMismatch, ds.KVBlocksUsed)
	}
	if got := ps.LastSideChannel["remote_blocks"]; got != p.notifyBase {
		t.Errorf("remote_blocks arrived on port %d, want P's notify base %d", got, p.notifyBase)
	}
	if ps.Transfers.HandshakesStarted != 1 || ds.Transfers.HandshakesServed != 1 {
		t.Errorf("handshakes: P started %d, D served %d; want 1 and 1", ps.Transfers.HandshakesStarted, ds.Transfers.HandshakesServed)
	}
	// A different prompt through the same pair must not reuse old KV.
	other := words(300, "b")
	checkDecodeOutput(t, runWrite(t, ctx, p, d, other, outTokens), unifiedText(t, ctx, u, other, outTokens), outTokens)
}

func TestMoRIIOReadPairMatchesUnified(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	u := startSim(t)
	prompt := words(200, "r")
	want := unifiedText(t, ctx, u, prompt, outTokens)
	checkDecodeOutput(t, runRead(t, ctx, p, d, prompt, outTokens), want, outTokens)
	waitFor(t, "release frees P's blocks", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	ps, ds := statsOf(t, p), statsOf(t, d)
	if ps.Transfers.ReadsServed != 1 || ps.Transfers.ReleaseReceived != 1 || ds.Transfers.ReadsDone != 1 || ps.Transfers.Completed != 1 {
		t.Errorf("P %+v\nD %+v", ps.Transfers, ds.Transfers)
	}
	// The D leg's kv_transfer_params are what the "router" sent.
	last := string(ds.LastKVParams["/v1/completions"])
	for _, k := range []string{`"remote_block_ids"`, `"remote_engine_id"`, `"transfer_id"`} {
		if !containsStr(last, k) {
			t.Errorf("last D kv_transfer_params %s lack %s", last, k)
		}
	}
}

func containsStr(s, sub string) bool { return len(s) >= len(sub) && indexOf(s, sub) >= 0 }

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return -1
}

func TestMoRIIOReadDecodeWithoutParams(t *testing.T) {
	ctx := testCtx(t)
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ")
	u := startSim(t)
	prompt := words(50, "g")
	// Non-strict: vLLM decodes from an unfilled cache: garbage.
	res := doStream(t, ctx, d.url("/v1/completions"), clientBody(prompt, 5), nil)
	if res.status != 200 || res.text == unifiedText(t, ctx, u, prompt, 5) {
		t.Errorf("READ decode without params: status %d, output should differ from unified", res.status)
	}
	if s := statsOf(t, d); s.Transfers.KVGarbage != 1 {
		t.Errorf("kv_garbage = %d, want 1", s.Transfers.KVGarbage)
	}
	strict := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	r := postJSON(t, ctx, strict.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": 3}, nil)
	if r.status != 400 {
		t.Errorf("strict READ decode without params: status %d, want 400", r.status)
	}
}

// nixlPrefill runs §8.B's NIXL prefill leg on p and returns the
// kv_transfer_params it answers with, for the decode leg.
func nixlPrefill(t *testing.T, ctx context.Context, p *Instance, prompt string, hdr map[string]string) map[string]any {
	t.Helper()
	pres := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, map[string]any{
		"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
	}), hdr)
	pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
	if pres.status != 200 || !ok {
		t.Fatalf("prefill: %d %s", pres.status, pres.raw)
	}
	return pkv
}

func TestNIXLPairMatchesUnified(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	u := startSim(t)
	prompt := words(250, "n")
	want := unifiedText(t, ctx, u, prompt, outTokens)
	hdr := map[string]string{"X-Request-Id": uuid4()}
	pkv := nixlPrefill(t, ctx, p, prompt, hdr)
	for _, k := range []string{"remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id", "tp_size"} {
		if _, ok := pkv[k]; !ok {
			t.Errorf("NIXL prefill params lack %s: %v", k, pkv)
		}
	}
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, outTokens), pkv), hdr)
	checkDecodeOutput(t, res, want, outTokens)
	waitFor(t, "NIXL release frees P's blocks", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	// A plain request on a NIXL decode is computed locally (correct output).
	plain := doStream(t, ctx, d.url("/v1/completions"), clientBody(prompt, outTokens), nil)
	if plain.text != want {
		t.Errorf("plain request on NIXL decode: %q, want %q", plain.text, want)
	}
}

// TestNIXLDecodeReadsOnlyWhatItLacks: as vLLM's NIXL scheduler, a decode
// pulls only the blocks its own prefix cache lacks, so a prompt whose prefix
// the decode already holds moves less KV.
func TestNIXLDecodeReadsOnlyWhatItLacks(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	split := func(prompt string) (promptTokens int) {
		t.Helper()
		hdr := map[string]string{"X-Request-Id": uuid4()}
		pkv := nixlPrefill(t, ctx, p, prompt, hdr)
		res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 4), pkv), hdr)
		if res.status != 200 || !res.done || res.usage == nil {
			t.Fatalf("decode: status %d done %v usage %v", res.status, res.done, res.usage)
		}
		return int(res.usage["prompt_tokens"].(float64))
	}
	read := func() (int64, int64) {
		tr := statsOf(t, d).Transfers
		return tr.TokensRead, tr.TokensReadLocal
	}
	shared := words(300, "s")
	n1 := split(shared + " first question")
	if r, l := read(); r != int64(n1) || l != 0 {
		t.Fatalf("first request: read %d, cached locally %d; want %d, 0", r, l, n1)
	}
	n2 := split(shared + " another question entirely")
	r, l := read()
	r2, l2 := r-int64(n1), l
	if l2 < 256 || l2%16 != 0 || r2+l2 != int64(n2) {
		t.Errorf("second request (%d prompt tokens, ~300 shared): read %d, cached locally %d; want whole blocks of the shared prefix held locally and only the rest read", n2, r2, l2)
	}
	// Without prefix caching on the decode everything is read again.
	d2 := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict", "--no-enable-prefix-caching")
	d = d2
	n3 := split(shared + " first question")
	if r, l := read(); r != int64(n3) || l != 0 {
		t.Errorf("decode without prefix caching: read %d, cached locally %d; want %d, 0", r, l, n3)
	}
}

func TestMooncakePairMatchesUnified(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "mooncake", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "mooncake", "--strict")
	u := startSim(t)
	boot := p.Ready().BootstrapPort
	if boot == 0 {
		t.Fatal("prefill has no bootstrap port")
	}
	bootAddr := fmt.Sprintf("http://127.0.0.1:%d", boot)
	var q map[string]struct {
		EngineID   string                       `json:"engine_id"`
		WorkerAddr map[string]map[string]string `json:"worker_addr"`
	}
	if st := getJSON(t, bootAddr+"/query", &q); st != 200 || q["0"].EngineID == "" || q["0"].WorkerAddr["0"]["0"] == "" {
		t.Fatalf("/query: %d %+v", st, q)
	}
	prompt := words(400, "m")
	want := unifiedText(t, ctx, u, prompt, outTokens)
	xrid := hex32()
	tid := "xfer-" + xrid
	hdr := map[string]string{"X-Request-Id": xrid, "X-data-parallel-rank": "0"}
	var wg sync.WaitGroup
	var pres jsonResult
	wg.Go(func() {
		pres = postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, map[string]any{
			"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": tid,
		}), hdr)
	})
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, outTokens), map[string]any{
		"do_remote_decode": false, "do_remote_prefill": true, "remote_bootstrap_addr": bootAddr,
		"remote_engine_id": q["0"].EngineID, "transfer_id": tid,
	}), map[string]string{"X-Request-Id": xrid})
	wg.Wait()
	if pres.status != 200 {
		t.Fatalf("prefill: %d %s", pres.status, pres.raw)
	}
	checkDecodeOutput(t, res, want, outTokens)
	waitFor(t, "Mooncake push frees P's blocks", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
	if s := statsOf(t, p); s.Transfers.PullsReceived != 1 || s.Transfers.PushesSent != 1 {
		t.Errorf("P transfers %+v", s.Transfers)
	}
}

func TestP2PNCCLPairMatchesUnified(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "p2pnccl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "p2pnccl", "--strict")
	u := startSim(t)
	if got := d.Ready().ZMQAddress; got != fmt.Sprintf("127.0.0.1:%d", d.kvBase) {
		t.Fatalf("p2p zmq_address %q", got)
	}
	prompt := words(150, "p")
	want := unifiedText(t, ctx, u, prompt, outTokens)
	hdr := map[string]string{"X-Request-Id": "___prefill_addr_" + p.zmqAddress() + "___decode_addr_" + d.zmqAddress() + "_" + hex32()}
	pres := postJSON(t, ctx, p.url("/v1/completions"), map[string]any{"prompt": prompt, "max_tokens": 1, "ignore_eos": true}, hdr)
	if pres.status != 200 {
		t.Fatalf("prefill: %d %s", pres.status, pres.raw)
	}
	// D gets the original body, no kv_transfer_params.
	res := doStream(t, ctx, d.url("/v1/completions"), clientBody(prompt, outTokens), hdr)
	checkDecodeOutput(t, res, want, outTokens)
	if s := statsOf(t, d); s.Transfers.PushesReceived != 1 || s.LastSideChannel["PUT"] != d.kvBase {
		t.Errorf("D transfers %+v ports %v", s.Transfers, s.LastSideChannel)
	}
}

// TestWriteTTFTBeatsRead measures both modes in one run at 8k input with the
// default preset and compares medians (PROTOCOL §7, §9.5). It compares wall
// clock times of real sockets, which a loaded machine (CI with other builds)
// reorders, so it runs only when asked: SWITCHYARD_TIMING_TESTS=1. The
// timing model it exercises is checked deterministically in
// internal/sim/engine (fake time), and `make bench-pd` measures the modes.
func TestWriteTTFTBeatsRead(t *testing.T) {
	if testing.Short() || os.Getenv("SWITCHYARD_TIMING_TESTS") == "" {
		t.Skip("wall-clock timing comparison: set SWITCHYARD_TIMING_TESTS=1")
	}
	ctx := testCtx(t)
	pw := startSim(t, "--role", "prefill", "--transfer-mode", "WRITE")
	dw := startSim(t, "--role", "decode", "--transfer-mode", "WRITE")
	pr := startSim(t, "--role", "prefill", "--transfer-mode", "READ")
	dr := startSim(t, "--role", "decode", "--transfer-mode", "READ")
	// A fresh prompt every time: a repeated one would be served from the
	// prefill's prefix cache and measure no prefill at all.
	prompt := func(i int) string { return words(8000, fmt.Sprintf("t%d-", i)) }
	// Warm both pairs (first-contact handshakes), then alternate.
	runWrite(t, ctx, pw, dw, prompt(0), 2)
	runRead(t, ctx, pr, dr, prompt(1), 2)
	var ws, rs []time.Duration
	for i := range 3 {
		w := runWrite(t, ctx, pw, dw, prompt(2+2*i), 2)
		r := runRead(t, ctx, pr, dr, prompt(3+2*i), 2)
		if w.ttft == 0 || r.ttft == 0 {
			t.Fatalf("no first token: write %+v read %+v", w.status, r.status)
		}
		ws, rs = append(ws, w.ttft), append(rs, r.ttft)
	}
	med := func(d []time.Duration) time.Duration {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
		return d[len(d)/2]
	}
	mw, mr := med(ws), med(rs)
	ratio := float64(mw) / float64(mr)
	t.Logf("8k input, default preset: TTFT WRITE median %v %v, READ median %v %v, WRITE/READ = %.2f", mw, ws, mr, rs, ratio)
	if ratio >= 0.95 {
		t.Errorf("WRITE TTFT %v is not below READ TTFT %v (ratio %.2f)", mw, mr, ratio)
	}
}

func TestWritePrefillFailureLeavesDecodeWaiting(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--fail-next", "1")
	d := startSim(t, "--role", "decode")
	prompt := words(100, "f")
	xrid, tid := moriID(p, d), "tx-"+uuid4()
	hdr := map[string]string{"X-Request-Id": xrid}

	dctx, cancelD := context.WithCancel(ctx)
	resp, err := testClient.Do(newReq(t, dctx, http.MethodPost, d.url("/v1/completions"), withKV(clientBody(prompt, 4), moriDecodeKV(p, tid)), hdr))
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream; charset=utf-8" {
		t.Fatalf("decode headers: %d %q (WRITE sends them before the KV)", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)), hdr); r.status != 500 {
		t.Fatalf("injected prefill failure: status %d", r.status)
	}
	waitFor(t, "decode admitted", func() bool { return statsOf(t, d).WaitingRemote == 1 })
	time.Sleep(200 * time.Millisecond)
	s := statsOf(t, d)
	if s.WaitingRemote != 1 || s.KVBlocksUsed == 0 || s.Transfers.WriteDoneReceived != 0 {
		t.Fatalf("decode should still wait holding blocks: %+v", s)
	}
	// The router closes D's connection: vLLM aborts and frees the blocks.
	cancelD()
	resp.Body.Close()
	waitFor(t, "decode frees blocks on disconnect", func() bool {
		s := statsOf(t, d)
		return s.KVBlocksUsed == 0 && s.WaitingRemote == 0 && s.Requests.Aborted == 1
	})

	// With --kv-wait-timeout the decode fails instead of waiting forever.
	dt := startSim(t, "--role", "decode", "--kv-wait-timeout", "150ms")
	start := time.Now()
	res := doStream(t, ctx, dt.url("/v1/completions"), withKV(clientBody(prompt, 4), moriDecodeKV(p, "tx-"+uuid4())), map[string]string{"X-Request-Id": moriID(p, dt)})
	if res.status != 200 || res.errEvent == nil || !res.done || res.tokens != 0 {
		t.Fatalf("kv-wait-timeout: status %d error %v done %v tokens %d", res.status, res.errEvent, res.done, res.tokens)
	}
	if el := time.Since(start); el < 150*time.Millisecond || el > 5*time.Second {
		t.Errorf("failed after %v, want about 150ms", el)
	}
	if s := statsOf(t, dt); s.Transfers.KVWaitTimeouts != 1 || s.KVBlocksUsed != 0 {
		t.Errorf("after timeout: %+v", s.Transfers)
	}
}

func TestWriteDecodeWithoutPrefillAddressStrict(t *testing.T) {
	ctx := testCtx(t)
	d := startSim(t, "--role", "decode", "--strict")
	for name, kv := range map[string]any{
		"no params":      nil,
		"no transfer_id": map[string]any{"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_handshake_port": 1, "remote_notify_port": 2},
		"no address":     map[string]any{"do_remote_prefill": true, "transfer_id": "tx-1"},
	} {
		body := map[string]any{"prompt": "a b c", "max_tokens": 2}
		if kv != nil {
			body["kv_transfer_params"] = kv
		}
		if r := postJSON(t, ctx, d.url("/v1/completions"), body, map[string]string{"X-Request-Id": hex32()}); r.status != 400 {
			t.Errorf("%s: status %d, want 400", name, r.status)
		}
	}
	p := startSim(t, "--role", "prefill", "--strict")
	if r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody("a b c", map[string]any{"do_remote_decode": true}), nil); r.status != 400 {
		t.Errorf("strict prefill without transfer_id: %d, want 400", r.status)
	}
}

func TestPrefillEOSReturnsNullParams(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--eos-probability", "1")
	body := prefillBody("x y z", map[string]any{"do_remote_decode": true, "transfer_id": "tx-e"})
	body["ignore_eos"] = false
	r := postJSON(t, ctx, p.url("/v1/completions"), body, nil)
	choice := r.body["choices"].([]any)[0].(map[string]any)
	if r.status != 200 || choice["finish_reason"] != "stop" || r.body["kv_transfer_params"] != nil {
		t.Errorf("EOS prefill: %s", r.raw)
	}
	waitFor(t, "blocks freed", func() bool { return statsOf(t, p).KVBlocksUsed == 0 })
}

func TestReadPrefillDeferTimeoutFreesBlocks(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--defer-timeout", "100ms")
	r := postJSON(t, ctx, p.url("/v1/completions"), prefillBody(words(64, "d"), map[string]any{"do_remote_decode": true, "transfer_id": "tx-d"}), nil)
	if r.status != 200 {
		t.Fatal(r.status)
	}
	if s := statsOf(t, p); s.KVBlocksUsed == 0 {
		t.Fatal("READ prefill should pin its blocks until release")
	}
	waitFor(t, "defer timeout", func() bool { s := statsOf(t, p); return s.KVBlocksUsed == 0 && s.Transfers.DeferExpired == 1 })
}

func TestDPRankPinning(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--data-parallel-size", "2")
	d := startSim(t, "--role", "decode", "--data-parallel-size", "2")
	u := startSim(t)
	prompt := words(80, "dp")
	xrid, tid := moriID(p, d), "tx-"+uuid4()
	var wg sync.WaitGroup
	wg.Go(func() {
		postJSON(t, ctx, p.url("/v1/completions"), prefillBody(prompt, moriPrefillKV(d, tid)),
			map[string]string{"X-Request-Id": xrid, "X-data-parallel-rank": "1"})
	})
	dkv := moriDecodeKV(p, tid)
	dkv["remote_dp_rank"] = 1
	res := doStream(t, ctx, d.url("/v1/completions"), withKV(clientBody(prompt, 6), dkv),
		map[string]string{"X-Request-Id": xrid, "X-data-parallel-rank": "0"})
	wg.Wait()
	checkDecodeOutput(t, res, unifiedText(t, ctx, u, prompt, 6), 6)
	ps := statsOf(t, p)
	if got := ps.LastSideChannel["remote_blocks"]; got != p.notifyBase+1 {
		t.Errorf("remote_blocks went to port %d, want notify base + 1 = %d", got, p.notifyBase+1)
	}
	if ps.Engines[1].Steps == 0 || ps.Engines[0].Steps != 0 {
		t.Errorf("prefill engines steps %+v, want only rank 1", ps.Engines)
	}
	if r := postJSON(t, ctx, d.url("/v1/completions"), map[string]any{"prompt": "a"}, map[string]string{"X-data-parallel-rank": "2"}); r.status != 400 {
		t.Errorf("rank out of range: %d", r.status)
	}
	if r := postJSON(t, ctx, d.url("/v1/completions"), map[string]any{"prompt": "a"}, map[string]string{"X-data-parallel-rank": "x"}); r.status != 400 {
		t.Errorf("rank not an int: %d", r.status)
	}
}

func TestPlainRequestHangsOnWriteDecode(t *testing.T) {
	ctx := testCtx(t)
	d := startSim(t, "--role", "decode")
	rctx, cancel := context.WithCancel(ctx)
	resp, err := testClient.Do(newReq(t, rctx, http.MethodPost, d.url("/v1/completions"), clientBody("a warm up probe", 4), nil))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "plain request parked in WAITING_FOR_REMOTE_KVS", func() bool { return statsOf(t, d).WaitingRemote == 1 })
	time.Sleep(100 * time.Millisecond)
	if s := statsOf(t, d); s.WaitingRemote != 1 || s.Transfers.RemoteBlocksSent != 0 {
		t.Errorf("plain request on WRITE decode: %+v", s)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "abort frees", func() bool { s := statsOf(t, d); return s.WaitingRemote == 0 && s.KVBlocksUsed == 0 })
}

func TestReadNestedBlockIDs(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--transfer-mode", "READ", "--nested-block-ids", "--strict")
	d := startSim(t, "--role", "decode", "--transfer-mode", "READ", "--strict")
	u := startSim(t)
	prompt := words(90, "nb")
	checkDecodeOutput(t, runRead(t, ctx, p, d, prompt, 5), unifiedText(t, ctx, u, prompt, 5), 5)
	last := string(statsOf(t, d).LastKVParams["/v1/completions"])
	if !containsStr(last, `"remote_block_ids":[[`) {
		t.Errorf("D did not receive nested block ids: %s", last)
	}
}
