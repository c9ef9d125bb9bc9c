package sim

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// The connectors' request-id regexes (PROTOCOL §2.4, §4.1), with Python
// re.search semantics (Go's leftmost-first submatches agree).
var (
	moriPrefillRE = regexp.MustCompile(`___prefill_addr_(.+?)___decode_addr_`)
	moriDecodeRE  = regexp.MustCompile(`___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$`)
	p2pDecodeRE   = regexp.MustCompile(`___decode_addr_(.*):(\d+)`)
	p2pPrefillRE  = regexp.MustCompile(`___prefill_addr_(.*):(\d+)___`)
)

// connector is the PD behaviour of one kv connector.
type connector interface {
	// prefill configures a request arriving at a prefill instance.
	prefill(j *job) *apiError
	// decode configures a request arriving at a decode instance.
	decode(j *job) *apiError
	// pending returns the number of unfinished transfers.
	pending() int
}

// job is one generation request on its way through the instance.
type job struct {
	in   *Instance
	g    *genReq
	rank int
	eng  *engine.Engine
	req  engine.Request
	hp   atomic.Pointer[engine.Handle] // set by Submit or the first engine callback
	ctx  context.Context
	kind string // "prefill", "decode" or "plain"

	digest   atomic.Uint64
	firstEOS atomic.Bool
	seq      atomic.Pointer[oracle.Seq] // the output, from digest and firstEOS
	kvState  atomic.Int32               // 0 waiting, 1 arrived, 2 timed out

	kvTimer *time.Timer

	// Connector hooks, all optional.
	afterSubmit  func()
	onFirstToken func()
	onFinish     func(p engine.Progress)
	onAbort      func(admitted bool)
	responseKV   func() any
}

const (
	kvWaiting int32 = iota
	kvArrived
	kvTimedOut
)

var errKVTimeout = errors.New("timed out waiting for remote KV (--kv-wait-timeout)")

// handle returns the engine handle (never nil once submitted).
func (j *job) handle() *engine.Handle { return j.hp.Load() }

// wrapCallbacks publishes the handle before any connector callback runs:
// the engine may call OnAdmit/OnForward before Submit has returned.
func (j *job) wrapCallbacks() {
	if f := j.req.OnAdmit; f != nil {
		j.req.OnAdmit = func(h *engine.Handle) { j.hp.CompareAndSwap(nil, h); f(h) }
	}
	if f := j.req.OnForward; f != nil {
		j.req.OnForward = func(h *engine.Handle, at time.Time, d time.Duration) {
			j.hp.CompareAndSwap(nil, h)
			f(h, at, d)
		}
	}
}

// setDigest fixes the digest the output is generated from.
func (j *job) setDigest(d uint64) {
	j.digest.Store(d)
	g := j.g
	eos := false
	if !g.ignoreEOS && g.minTokens == 0 && j.in.cfg.EOSProbability > 0 {
		eos = oracle.FirstIsEOS(d, g.seed, j.in.cfg.EOSProbability)
		j.firstEOS.Store(eos)
	}
	j.seq.Store(oracle.NewSeq(d, g.seed, eos))
}

// token returns generated token i of the output (the sequence of the
// digest set last; before any, of the digest loaded now).
func (j *job) token(i int) uint32 {
	s := j.seq.Load()
	if s == nil {
		s = oracle.NewSeq(j.digest.Load(), j.g.seed, j.firstEOS.Load())
	}
	return s.At(i)
}

// local makes the request compute its own prompt (no KV handoff).
func (j *job) local() {
	j.setDigest(j.g.digest)
	if j.kind == "" {
		j.kind = "plain"
	}
}

// remote makes the request wait for remote KV after admission.
func (j *job) remote() {
	j.req.RemoteKV = true
	j.kind = "decode"
}

// garbageXor turns a prompt digest into the digest of "whatever the KV
// blocks contained": a decode that runs on it produces text that differs
// from a unified worker's.
const garbageXor = 0xbadbadbadbadbad

// garbage emulates a decode whose KV never arrived but that runs anyway
// (vLLM READ without block ids): output from an unfilled cache.
func (j *job) garbage(why string) {
	j.in.ctr.kvGarbage.Add(1)
	j.in.log.Warn("decode runs on an unfilled KV cache (garbage output)", "request_id", j.g.requestID, "reason", why)
	j.remote()
	prev := j.afterSubmit
	j.afterSubmit = func() {
		if prev != nil {
			prev()
		}
		j.kvDelivered(j.g.digest^garbageXor, len(j.g.promptIDs), 0, false)
	}
}

// readGarbage delivers the result of a read that "succeeded" on memory that
// does not hold this request's KV (a transfer pinned on another DP rank,
// already released, or never pinned): RDMA/NIXL reads raw blocks without
// any error, so vLLM decodes garbage.
func (j *job) readGarbage(load time.Duration, why string) {
	j.in.ctr.kvGarbage.Add(1)
	j.in.log.Warn("KV read hit blocks that do not hold this request's KV (garbage output, as in vLLM)", "request_id", j.g.requestID, "reason", why)
	j.kvDelivered(j.g.digest^garbageXor, len(j.g.promptIDs), load, false)
}

// violation records a PD protocol violation by the caller (normally the
// router): it is logged and counted in both modes
// (transfers.protocol_violations, last_protocol_violation). With --strict it
// returns the 400 to answer with; otherwise nil, and the caller goes on
// emulating what vLLM does (hang, garbage, KeyError-free newest behaviour).
func (in *Instance) violation(g *genReq, param, msg string) *apiError {
	in.ctr.protocolViolations.Add(1)
	in.ctr.mu.Lock()
	in.ctr.lastViolation = msg
	in.ctr.mu.Unlock()
	in.log.Warn("PD protocol violation", "request_id", g.requestID, "x_request_id", g.xRequestID, "violation", msg)
	if in.cfg.Strict {
		return &apiError{status: 400, typ: "BadRequestError", param: param, message: msg}
	}
	return nil
}

// readResult is the outcome of a decode-side KV read (MoRI-IO READ, NIXL).
type readResult int

const (
	readOK       readResult = iota // KV delivered
	readGarbage                    // "succeeded" on the wrong memory: garbage delivered
	readFailed                     // transport/RDMA failure: release, then recompute
	readCanceled                   // the request or the instance went away
)

// kvDelivered records the KV that arrived and lets the request run.
// load > 0 makes its first step wait for a layer-wise read; recompute
// discards the remote KV (the local digest is used, as vLLM recomputes).
func (j *job) kvDelivered(digest uint64, numTokens int, load time.Duration, recompute bool) {
	if !j.kvState.CompareAndSwap(kvWaiting, kvArrived) {
		return
	}
	if j.kvTimer != nil {
		j.kvTimer.Stop()
	}
	if recompute {
		digest = j.g.digest
	} else if digest != j.g.digest || numTokens != len(j.g.promptIDs) {
		j.in.ctr.kvDigestMismatch.Add(1)
		j.in.log.Warn("received KV does not match this request's prompt",
			"request_id", j.g.requestID, "kv_tokens", numTokens, "prompt_tokens", len(j.g.promptIDs))
	}
	j.setDigest(digest)
	if !recompute {
		j.in.ctr.transfersCompleted.Add(1)
	}
	j.handle().KVReady(load, recompute)
}

// armKVTimeout starts --kv-wait-timeout for a remote-KV request.
func (j *job) armKVTimeout() {
	d := j.in.cfg.KVWaitTimeout
	if d <= 0 || !j.req.RemoteKV {
		return
	}
	j.kvTimer = time.AfterFunc(d, func() {
		if j.kvState.CompareAndSwap(kvWaiting, kvTimedOut) {
			j.in.ctr.kvWaitTimeouts.Add(1)
			j.handle().Fail(errKVTimeout)
		}
	})
}

func (j *job) stop() {
	if j.kvTimer != nil {
		j.kvTimer.Stop()
	}
}

// kvParams is a decoded kv_transfer_params object (numbers as json.Number).
type kvParams map[string]any

func decodeKVParams(raw json.RawMessage) (kvParams, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil {
		return nil, errors.New("kv_transfer_params must be a JSON object or null")
	}
	return kvParams(m), nil
}

func (p kvParams) has(k string) bool {
	v, ok := p[k]
	return ok && v != nil
}

func (p kvParams) str(k string) (string, bool) {
	switch v := p[k].(type) {
	case string:
		return v, true
	case json.Number:
		return v.String(), true
	}
	return "", false
}

func (p kvParams) int(k string) (int, bool) {
	switch v := p[k].(type) {
	case json.Number:
		n, err := strconv.Atoi(v.String())
		return n, err == nil
	case string:
		n, err := strconv.Atoi(v)
		return n, err == nil
	}
	return 0, false
}

func (p kvParams) boolean(k string) bool {
	v, _ := p[k].(bool)
	return v
}

// ints returns a list of ints, flattening nested lists ([[int]] per KV
// group in the newest MoRI-IO connector).
func (p kvParams) ints(k string) ([]int, bool) {
	v, ok := p[k].([]any)
	if !ok {
		return nil, false
	}
	var out []int
	var walk func([]any) bool
	walk = func(xs []any) bool {
		for _, x := range xs {
			switch t := x.(type) {
			case json.Number:
				n, err := strconv.Atoi(t.String())
				if err != nil {
					return false
				}
				out = append(out, n)
			case []any:
				if !walk(t) {
					return false
				}
			default:
				return false
			}
		}
		return true
	}
	if !walk(v) {
		return nil, false
	}
	return out, true
}

// moriAddr is a parsed MoRI-IO zmq_address.
type moriAddr struct {
	host      string
	handshake int
	notify    int
}

// parseMoRIZMQ parses "host:IP,handshake:PORT,notify:PORT" (each item split
// on its first colon, so "host:::1" is IPv6 ::1).
func parseMoRIZMQ(s string) (moriAddr, bool) {
	var a moriAddr
	for _, item := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(item), ":")
		if !ok {
			return a, false
		}
		switch k {
		case "host":
			a.host = v
		case "handshake":
			n, err := strconv.Atoi(v)
			if err != nil {
				return a, false
			}
			a.handshake = n
		case "notify":
			n, err := strconv.Atoi(v)
			if err != nil {
				return a, false
			}
			a.notify = n
		}
	}
	return a, a.host != "" && a.handshake > 0 && a.notify > 0
}

// moriPeerFromID extracts the peer's address from an X-Request-Id: the
// prefill's when decode is true, the decode's otherwise.
func moriPeerFromID(xrid string, decode bool) (moriAddr, bool) {
	re := moriDecodeRE
	if decode {
		re = moriPrefillRE
	}
	m := re.FindStringSubmatch(xrid)
	if m == nil {
		return moriAddr{}, false
	}
	return parseMoRIZMQ(m[1])
}

// moriRemoteTPRank is get_moriio_remote_tp_rank: the prefill TP rank a
// decode TP rank reads from (and releases to) under heterogeneous TP.
func moriRemoteTPRank(local, localSize, remoteSize int) int {
	localSize, remoteSize = max(localSize, 1), max(remoteSize, 1)
	switch {
	case remoteSize == localSize:
		return local
	case remoteSize > localSize && remoteSize%localSize == 0:
		return local * (remoteSize / localSize)
	case remoteSize < localSize && localSize%remoteSize == 0:
		return local / (localSize / remoteSize)
	}
	return local % remoteSize // vLLM raises ValueError; any rank will do here
}

// moriPeerFromParams reads remote_host/remote_handshake_port/remote_notify_port.
func moriPeerFromParams(p kvParams) (moriAddr, bool) {
	host, ok1 := p.str("remote_host")
	hs, ok2 := p.int("remote_handshake_port")
	nt, ok3 := p.int("remote_notify_port")
	if !ok1 || !ok2 || !ok3 || host == "" {
		return moriAddr{}, false
	}
	return moriAddr{host: host, handshake: hs, notify: nt}, true
}

// handshakes tracks first contact with peer engines. The simulated cost Hs
// starts at first contact; the real ZMQ handshake runs alongside.
type handshakes struct {
	in *Instance
	mu sync.Mutex
	m  map[string]*hsState
}

type hsState struct {
	readyAt time.Time
	done    chan struct{}
	err     error
}

// ensure returns key's handshake state, starting it on first contact with a
// real get_meta_msg exchange against every endpoint (none for connectors
// without one).
func (hs *handshakes) ensure(key string, endpoints []string) *hsState {
	hs.mu.Lock()
	defer hs.mu.Unlock()
	if st, ok := hs.m[key]; ok {
		return st
	}
	st := &hsState{readyAt: time.Now().Add(hs.in.params.HandshakeTime), done: make(chan struct{})}
	hs.m[key] = st
	hs.in.ctr.handshakesStarted.Add(1)
	if len(endpoints) == 0 {
		close(st.done)
		return st
	}
	hs.in.goBackground(func(ctx context.Context) {
		defer close(st.done)
		for _, ep := range endpoints {
			if _, err := sidechan.Handshake(ctx, ep, hs.in.cfg.TransferTime); err != nil {
				st.err = err
				hs.in.ctr.handshakeFailures.Add(1)
				hs.in.log.Warn("handshake failed", "peer", key, "endpoint", ep, "err", err)
				hs.mu.Lock()
				if hs.m[key] == st {
					delete(hs.m, key) // retry on the next contact
				}
				hs.mu.Unlock()
				return
			}
		}
	})
	return st
}

// wait blocks until the simulated handshake time has passed and the real
// exchange finished.
func (st *hsState) wait(ctx context.Context) error {
	select {
	case <-st.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	if st.err != nil {
		return st.err
	}
	if d := time.Until(st.readyAt); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// layerReadyTimes returns when each layer of a forward is computed.
func layerReadyTimes(start time.Time, compute time.Duration, layers int) []time.Time {
	layers = max(layers, 1)
	out := make([]time.Time, layers)
	for i := range layers {
		out[i] = start.Add(time.Duration(i+1) * compute / time.Duration(layers))
	}
	return out
}

// pinTimer runs f after the defer timeout unless stopped.
func (in *Instance) deferTimer(f func()) *time.Timer {
	return time.AfterFunc(in.cfg.DeferTimeout, f)
}
