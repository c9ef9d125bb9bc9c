package sim

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// nixl is the NIXL connector (PROTOCOL §4.2): sequential. P pins its blocks
// and returns {remote_engine_id, remote_block_ids, remote_host, remote_port
// (its side-channel port), remote_request_id, tp_size}; D must receive them
// verbatim, reads from P over the side channel and notifies P to free.
type nixl struct {
	in    *Instance
	ranks []*nixlRank
	rpcID atomic.Uint64
}

type nixlRank struct {
	xferTable[*nixlXfer] // by remote_request_id
}

type nixlXfer struct {
	pinned
}

func newNIXL(in *Instance) *nixl {
	n := &nixl{in: in}
	for range in.cfg.DPSize {
		n.ranks = append(n.ranks, &nixlRank{newXferTable[*nixlXfer]()})
	}
	return n
}

func (n *nixl) pending() int {
	c := 0
	for _, r := range n.ranks {
		c += r.size()
	}
	return c
}

// nixlEngineID names one P DP engine.
func (n *nixl) engineID(rank int) string {
	return fmt.Sprintf("nixl-%s-%d-dp%d", n.in.cfg.AdvertiseHost, n.in.hsBase, rank)
}

func (n *nixl) prefill(j *job) *apiError {
	j.local()
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_decode") {
		return nil
	}
	j.kind = "prefill"
	j.req.KeepBlocks = true
	x := &nixlXfer{pinned{id: j.g.requestID, j: j, rank: j.rank}}
	j.onFinish = func(pr engine.Progress) {
		if pr.Reason != engine.FinishLength {
			if h := j.handle(); h != nil {
				h.Release()
			}
			return
		}
		n.ranks[x.rank].add(x, func(old *nixlXfer) { n.finish(old, false) }, func() {
			x.timer = n.in.deferTimer(func() { n.in.ctr.deferExpired.Add(1); n.finish(x, false) })
		})
	}
	j.responseKV = func() any {
		return map[string]any{
			"do_remote_prefill": true,
			"do_remote_decode":  false,
			"remote_block_ids":  j.handle().Blocks(),
			"remote_engine_id":  n.engineID(x.rank),
			"remote_request_id": x.id,
			"remote_host":       n.in.cfg.AdvertiseHost,
			"remote_port":       n.in.hsBase + x.rank,
			"tp_size":           n.in.cfg.TPSize,
		}
	}
	return nil
}

func (n *nixl) finish(x *nixlXfer, ok bool) {
	if !n.ranks[x.rank].finish(x) {
		return
	}
	if ok {
		n.in.ctr.transfersCompleted.Add(1)
	} else {
		n.in.ctr.transfersFailed.Add(1)
	}
	x.j.handle().Release()
}

func (n *nixl) decode(j *job) *apiError {
	in := n.in
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_prefill") {
		j.local() // NIXL checks do_remote_prefill: a plain request is computed locally
		return nil
	}
	blocks, okB := p.ints("remote_block_ids")
	engineID, okE := p.str("remote_engine_id")
	host, okH := p.str("remote_host")
	port, okP := p.int("remote_port")
	reqID, okR := p.str("remote_request_id")
	var missing string
	switch {
	case !okB || len(blocks) == 0:
		missing = "remote_block_ids"
	case !okE || engineID == "":
		missing = "remote_engine_id"
	case !okH || host == "":
		missing = "remote_host"
	case !okP || port <= 0:
		missing = "remote_port"
	case !okR || reqID == "":
		missing = "remote_request_id"
	}
	if missing != "" {
		if e := in.violation(j.g, "kv_transfer_params", "NIXL decode needs "+missing+" in kv_transfer_params (forward the prefill's kv_transfer_params verbatim)"); e != nil {
			return e
		}
		j.garbage("missing " + missing)
		return nil
	}
	j.remote()
	ep := sidechan.Endpoint(host, port)
	var readDone, released atomic.Bool
	release := func() {
		if !released.CompareAndSwap(false, true) {
			return
		}
		if c, err := in.clients.Get(ep); err == nil {
			if c.Send(sidechan.Encode(sidechan.Release{Type: sidechan.TypeRelease, TransferID: reqID, ConsumerTPSize: in.cfg.TPSize})) == nil {
				in.ctr.releaseSent.Add(1)
			}
		}
	}
	j.req.OnAdmit = func(*engine.Handle) {
		in.goBackground(func(ictx context.Context) {
			ctx, cancel := context.WithCancel(j.ctx)
			defer cancel()
			stop := context.AfterFunc(ictx, cancel)
			defer stop()
			res := n.read(ctx, j, ep, engineID, reqID, blocks)
			readDone.Store(true)
			if res == readFailed {
				release()
				j.kvDelivered(0, 0, 0, true)
			}
		})
	}
	j.onFirstToken = release
	j.onAbort = func(bool) {
		if !readDone.Load() {
			release()
		}
	}
	return nil
}

// read handshakes (first contact) and reads from P's side channel. A reply
// for a remote_request_id P does not hold is a NIXL read of whatever those
// blocks contain: garbage, no error.
func (n *nixl) read(ctx context.Context, j *job, ep, engineID, reqID string, blocks []int) readResult {
	in := n.in
	fail := func(msg string, args ...any) readResult {
		if ctx.Err() != nil {
			return readCanceled
		}
		in.ctr.readsFailed.Add(1)
		in.ctr.transfersFailed.Add(1)
		in.log.Warn(msg, append([]any{"remote_request_id", reqID}, args...)...)
		return readFailed
	}
	st := in.hs.ensure("nixl:"+engineID, []string{ep})
	if err := st.wait(ctx); err != nil {
		return fail("NIXL handshake failed; recomputing locally", "endpoint", ep, "err", err)
	}
	if in.faults.takeReadFailure() {
		return fail("NIXL: injected read failure (fail_reads); recomputing locally")
	}
	c, err := in.clients.Get(ep)
	if err != nil {
		return fail("NIXL: cannot reach prefill; recomputing locally", "endpoint", ep, "err", err)
	}
	rctx, cancel := context.WithTimeout(ctx, in.cfg.TransferTime)
	defer cancel()
	id := "nixl-" + strconv.FormatUint(n.rpcID.Add(1), 10)
	reply, err := c.Call(rctx, id, sidechan.Encode(sidechan.ReadRequest{Type: sidechan.TypeRead, RPCID: id, TransferID: reqID, BlockIDs: blocks}))
	if err != nil {
		return fail("NIXL read failed; recomputing locally", "err", err)
	}
	if !reply.OK {
		j.readGarbage(in.params.TransferTime(len(j.g.promptIDs)), fmt.Sprintf("prefill %s: %s", engineID, reply.Error))
		return readGarbage
	}
	in.ctr.readsDone.Add(1)
	d, _ := sidechan.ParseDigest(reply.SimDigest)
	// D reads only the blocks its own prefix cache lacks: vLLM's NIXL
	// scheduler pulls the request's unhashed blocks (a full local hit pulls
	// none and only notifies P; nixl/pull_scheduler.py, vLLM 0.32).
	local := min(j.handle().CachedTokens(), reply.SimNumTokens)
	var load time.Duration
	if read := reply.SimNumTokens - local; read > 0 {
		load = in.params.TransferTime(read)
		in.ctr.tokensRead.Add(int64(read))
	}
	in.ctr.tokensReadLocal.Add(int64(local))
	j.kvDelivered(d, reply.SimNumTokens, load, false)
	return readOK
}

func (n *nixl) onHandshakeSocket(offset int, payload []byte, reply func([]byte) error) {
	in := n.in
	msg, err := sidechan.Decode(payload)
	if err != nil {
		return
	}
	in.ctr.notePort(msg.Type, in.hsBase+offset)
	r := n.ranks[in.cfg.rankForOffset(offset)]
	switch msg.Type {
	case sidechan.TypeRead:
		x := r.lookup(msg.TransferID)
		rep := sidechan.Reply{Type: sidechan.TypeReadReply, RPCID: msg.RPCID, OK: x != nil}
		if x != nil {
			in.ctr.readsServed.Add(1)
			rep.SimDigest = sidechan.FormatDigest(x.j.g.digest)
			rep.SimNumTokens = len(x.j.g.promptIDs)
		} else {
			in.ctr.readsUnmatched.Add(1)
			rep.Error = "unknown remote_request_id " + msg.TransferID
			in.log.Warn("NIXL read of a request this engine does not hold: the decode gets garbage", "remote_request_id", msg.TransferID)
		}
		_ = reply(sidechan.Encode(rep))
	case sidechan.TypeRelease:
		in.ctr.releaseReceived.Add(1)
		x := r.lookup(msg.TransferID)
		if x != nil {
			n.finish(x, true)
		}
	}
}

func (n *nixl) onNotifySocket(int, []byte) {}
func (n *nixl) onKVSocket(int, []byte)     {}
