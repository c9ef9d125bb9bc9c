package sim

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// moriio is the MoRI-IO connector (PROTOCOL §2): WRITE (D allocates, sends
// remote_blocks to P's notify port, P writes layer by layer during its
// forward and sends write_done) or READ (P pins its blocks and returns
// them; D reads over the side channel and sends release).
type moriio struct {
	in    *Instance
	read  bool
	ranks []*moriRank
	rpcID atomic.Uint64
}

// moriRank is the connector state of one DP rank (one vLLM worker).
type moriRank struct {
	// P: pinned transfers by transfer_id; its mu guards the whole rank.
	xferTable[*pXfer]

	early   earlyMap[sidechan.Any] // messages that arrived before their request
	waiters map[string]*job        // D (WRITE): requests waiting for write_done
	dead    bool                   // P: notify listener killed by an empty block list
}

// pXfer is one prefill-side transfer: pinned blocks plus (WRITE) the
// layer-wise writes towards D.
type pXfer struct {
	pinned
	dst        moriAddr
	hasDst     bool
	decodeRank int
	rbArrived  bool
	linkAdded  bool
	finished   bool
	acks       int
}

func newMoRIIO(in *Instance) *moriio {
	m := &moriio{in: in, read: in.cfg.readMode()}
	for range in.cfg.DPSize {
		m.ranks = append(m.ranks, &moriRank{
			xferTable: newXferTable[*pXfer](),
			early:     make(earlyMap[sidechan.Any]),
			waiters:   make(map[string]*job),
		})
	}
	return m
}

func (m *moriio) pending() int {
	n := 0
	for _, r := range m.ranks {
		r.mu.Lock()
		n += len(r.xfers) + len(r.waiters)
		r.mu.Unlock()
	}
	return n
}

func (m *moriio) nextRPC() string {
	return "rpc-" + strconv.FormatUint(m.rpcID.Add(1), 10)
}

// ---------------------------------------------------------------- prefill

func (m *moriio) prefill(j *job) *apiError {
	in := m.in
	j.local()
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_decode") {
		return nil // plain request: served like normal vLLM
	}
	// 028a39c's add_new_req (P builds a ReqMeta in both modes) reads these
	// with params[...]: absent keys raise KeyError in the scheduler; null is
	// fine.
	for _, k := range []string{"remote_block_ids", "remote_engine_id"} {
		if _, ok := p[k]; !ok {
			if e := in.violation(j.g, "kv_transfer_params", "MoRI-IO prefill: kv_transfer_params lacks the key "+k+
				" (028a39c add_new_req raises KeyError; send it as null)"); e != nil {
				return e
			}
		}
	}
	// Older connectors (and old-format proxies) take the decode's address
	// from the params only.
	if miss := missingParams(p, "remote_host", "remote_port", "remote_handshake_port", "remote_notify_port"); miss != "" {
		if e := in.violation(j.g, "kv_transfer_params", "MoRI-IO prefill: kv_transfer_params lacks "+miss+
			" (the decode's address; older connectors read it from the params only)"); e != nil {
			return e
		}
	}
	tid, ok := p.str("transfer_id")
	if !ok || tid == "" {
		if e := in.violation(j.g, "kv_transfer_params", "kv_transfer_params.transfer_id is required on a MoRI-IO prefill (0158326 raises KeyError in update_state_after_alloc)"); e != nil {
			return e
		}
		tid = "sidecar-" + j.g.requestID
		in.log.Warn("prefill without transfer_id; synthesized one as the newest connector does", "transfer_id", tid)
	}
	dst, okDst, aerr := m.peer(j, p, false)
	if aerr != nil {
		return aerr
	}
	if !okDst {
		msg := "WRITE-mode prefill cannot find the decode's address: kv_transfer_params has no remote_host/remote_handshake_port/remote_notify_port and X-Request-Id has no ___decode_addr_ part"
		if m.read {
			msg = "MoRI-IO prefill cannot find the decode's address: kv_transfer_params has no remote_host/remote_handshake_port/remote_notify_port and X-Request-Id has no ___decode_addr_ part (028a39c add_new_req raises ValueError)"
		}
		if e := in.violation(j.g, "kv_transfer_params", msg); e != nil {
			return e
		}
	}
	if !m.read {
		if n, ok := p.int("tp_size"); !ok || n < 1 {
			if e := in.violation(j.g, "kv_transfer_params", "WRITE-mode prefill: kv_transfer_params.tp_size (the decode's TP size) is required"); e != nil {
				return e
			}
		}
	}
	x := &pXfer{pinned: pinned{id: tid, j: j, rank: j.rank}}
	if !m.read {
		if !okDst {
			in.log.Warn("WRITE prefill has no decode address; write_done cannot be delivered", "request_id", j.g.requestID)
		} else {
			x.dst, x.hasDst = dst, true
			dDP, ok := p.int("remote_dp_size")
			if !ok || dDP < 1 {
				dDP = 1
			}
			eps := make([]string, 0, dDP)
			for r := range dDP {
				eps = append(eps, sidechan.Endpoint(dst.host, dst.handshake+r))
			}
			st := in.hs.ensure(fmt.Sprintf("moriio:%s:%d", dst.host, dst.handshake), eps)
			j.req.ForwardNotBefore = st.readyAt
		}
		j.req.OnForward = func(h *engine.Handle, start time.Time, compute time.Duration) { m.onForward(x, h, start, compute) }
	}
	j.kind = "prefill"
	j.req.KeepBlocks = true
	r := m.ranks[j.rank]
	r.add(x, func(old *pXfer) {
		in.log.Warn("transfer_id reused while a previous transfer is pinned; dropping the old one", "transfer_id", tid)
		m.finishXfer(old, false, "replaced")
	}, func() {
		if e := r.early[tid]; e != nil && e.val.Type == sidechan.TypeRemoteBlocks {
			r.early.take(tid)
			x.rbArrived = true
			x.decodeRank = e.val.DecodeRank
		}
	})
	j.onFinish = func(pr engine.Progress) { m.prefillFinished(x, pr) }
	j.onAbort = func(bool) { m.finishXfer(x, false, "prefill aborted") }
	j.responseKV = func() any { return m.prefillParams(x) }
	return nil
}

// missingParams lists the keys of p that are absent or null.
func missingParams(p kvParams, keys ...string) string {
	var miss []string
	for _, k := range keys {
		if !p.has(k) {
			miss = append(miss, k)
		}
	}
	return strings.Join(miss, "/")
}

// peer finds the peer's MoRI-IO address as 028a39c/0158326 do: explicit
// remote_host/remote_handshake_port/remote_notify_port when all three are
// present, the X-Request-Id (___prefill_addr_ on a decode, ___decode_addr_
// on a prefill) otherwise. Both present but different is a violation.
func (m *moriio) peer(j *job, p kvParams, onDecode bool) (moriAddr, bool, *apiError) {
	fromParams, okP := moriPeerFromParams(p)
	fromID, okI := moriPeerFromID(j.g.xRequestID, onDecode)
	if okP && okI && fromParams != fromID {
		if e := m.in.violation(j.g, "kv_transfer_params", fmt.Sprintf(
			"the peer address in kv_transfer_params (host %s handshake %d notify %d) disagrees with the X-Request-Id's (host %s handshake %d notify %d); vLLM uses the params",
			fromParams.host, fromParams.handshake, fromParams.notify, fromID.host, fromID.handshake, fromID.notify)); e != nil {
			return moriAddr{}, false, e
		}
	}
	if okP {
		return fromParams, true, nil
	}
	return fromID, okI, nil
}

// onForward queues the layer writes of x as its last prefill chunk runs.
func (m *moriio) onForward(x *pXfer, h *engine.Handle, start time.Time, compute time.Duration) {
	r := m.ranks[x.rank]
	r.mu.Lock()
	defer r.mu.Unlock()
	if x.done || x.linkAdded {
		return
	}
	x.linkAdded = true
	n := len(x.j.g.promptIDs)
	times := layerReadyTimes(start, compute, m.in.params.NumLayers)
	m.in.links[x.rank].Add(x.id, times, m.in.params.LayerTransferTime(n), !x.rbArrived, func(time.Time) { m.writesDone(x) })
}

// writesDone runs when every layer write of x completed: send write_done
// to D.notify_base + decode_rank + P tp rank, then free P's blocks.
func (m *moriio) writesDone(x *pXfer) {
	if !m.ranks[x.rank].complete(x) {
		return
	}
	in := m.in
	switch {
	case in.faults.dropWrites():
		in.ctr.writeDoneDropped.Add(1)
		in.log.Info("drop-write-done: not sending write_done", "transfer_id", x.id)
	case !x.hasDst:
		in.ctr.writeDoneDropped.Add(1)
	default:
		msg := sidechan.Encode(sidechan.WriteDone{
			Type: sidechan.TypeWriteDone, TransferID: x.id,
			SimDigest: sidechan.FormatDigest(x.j.g.digest), SimNumTokens: len(x.j.g.promptIDs),
		})
		for t := range in.cfg.TPSize {
			in.pool.Send(sidechan.Endpoint(x.dst.host, x.dst.notify+x.decodeRank+t), "", msg)
			in.ctr.writeDoneSent.Add(1)
		}
	}
	in.ctr.transfersCompleted.Add(1)
	x.j.handle().Release()
}

func (m *moriio) prefillFinished(x *pXfer, p engine.Progress) {
	if p.Reason != engine.FinishLength {
		// EOS on the first token: vLLM returns kv_transfer_params null and
		// hands nothing off.
		m.finishXfer(x, false, "prefill finished with "+p.Reason.String())
		return
	}
	r := m.ranks[x.rank]
	r.mu.Lock()
	defer r.mu.Unlock()
	if x.done {
		return
	}
	x.finished = true
	if m.read || !x.rbArrived {
		// READ: pinned until release; WRITE: until the remote blocks arrive.
		x.timer = m.in.deferTimer(func() { m.finishXfer(x, false, "defer timeout") })
	}
}

// finishXfer ends x without a successful handoff (or, ok, after READ's
// release) and frees P's blocks.
func (m *moriio) finishXfer(x *pXfer, ok bool, why string) {
	if !m.ranks[x.rank].finish(x) {
		return
	}
	m.in.links[x.rank].Cancel(x.id)
	if ok {
		m.in.ctr.transfersCompleted.Add(1)
	} else {
		if why == "defer timeout" {
			m.in.ctr.deferExpired.Add(1)
		}
		if x.finished {
			m.in.ctr.transfersFailed.Add(1)
		}
		m.in.log.Debug("transfer ended", "transfer_id", x.id, "reason", why)
	}
	if h := x.j.handle(); h != nil {
		h.Release()
	}
}

// prefillParams is the kv_transfer_params of P's response.
func (m *moriio) prefillParams(x *pXfer) any {
	in := m.in
	blocks := x.j.handle().Blocks()
	var ids any = blocks
	out := map[string]any{
		"do_remote_prefill":     true,
		"do_remote_decode":      false,
		"remote_engine_id":      in.engineID(),
		"remote_host":           in.cfg.AdvertiseHost,
		"remote_handshake_port": in.hsBase,
		"remote_notify_port":    in.notifyBase,
		"remote_dp_size":        in.cfg.DPSize,
		"tp_size":               in.cfg.TPSize,
		"transfer_id":           x.id,
		"remote_dp_rank":        x.rank,
	}
	if in.cfg.NestedBlockIDs {
		ids = [][]int{blocks}
		out["remote_dp_rank_override"] = true
		out["remote_dp_size_local"] = in.cfg.DPSize
	}
	out["remote_block_ids"] = ids
	return out
}

// ----------------------------------------------------------------- decode

func (m *moriio) decode(j *job) *apiError {
	in := m.in
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_prefill") {
		if e := in.violation(j.g, "kv_transfer_params", "MoRI-IO decode needs kv_transfer_params with do_remote_prefill=true (vLLM treats every request on a decode as remote-prefilled: WRITE hangs, READ produces garbage)"); e != nil {
			return e
		}
		if m.read {
			j.garbage("plain request on a READ-mode decode")
		} else {
			in.log.Warn("plain request on a WRITE-mode decode: it will wait for KV that never comes (vLLM behaviour)", "request_id", j.g.requestID)
			j.remote()
		}
		return nil
	}
	tid, _ := p.str("transfer_id")
	pRank, ok := p.int("remote_dp_rank")
	if !ok {
		if n, _ := p.int("remote_dp_size"); n > 1 {
			if e := in.violation(j.g, "kv_transfer_params", "remote_dp_size > 1 without remote_dp_rank: vLLM falls back to prefill DP rank 0 (the transfer is paired with the wrong rank unless P ran there)"); e != nil {
				return e
			}
		}
		pRank = 0
	}
	src, okSrc, aerr := m.peer(j, p, true)
	if aerr != nil {
		return aerr
	}
	if m.read {
		return m.decodeRead(j, p, tid, pRank, src, okSrc)
	}
	return m.decodeWrite(j, tid, pRank, src, okSrc)
}

func (m *moriio) decodeWrite(j *job, tid string, pRank int, src moriAddr, okSrc bool) *apiError {
	in := m.in
	if tid == "" {
		if e := in.violation(j.g, "kv_transfer_params", "kv_transfer_params.transfer_id is required (vLLM raises KeyError in update_state_after_alloc)"); e != nil {
			return e
		}
	}
	if !okSrc {
		if e := in.violation(j.g, "kv_transfer_params", "WRITE-mode decode cannot find the prefill's address: kv_transfer_params has no remote_host/remote_handshake_port/remote_notify_port and X-Request-Id has no ___prefill_addr_ part"); e != nil {
			return e
		}
	}
	j.remote()
	if tid == "" || !okSrc {
		in.log.Warn("WRITE decode cannot notify its prefill; it will wait forever", "request_id", j.g.requestID, "transfer_id", tid)
		return nil
	}
	r := m.ranks[j.rank]
	r.mu.Lock()
	early, got := r.early.await(r.waiters, tid, j)
	r.mu.Unlock()
	if got {
		j.afterSubmit = func() { m.deliverWriteDone(j, early) }
	}
	j.req.OnAdmit = func(h *engine.Handle) {
		blocks := h.AdmittedBlocks()
		msg := sidechan.Encode(sidechan.RemoteBlocks{
			Type: sidechan.TypeRemoteBlocks, ReqID: j.g.requestID, TransferID: tid,
			BlockNotifyList: blocks, DecodeRank: j.rank,
		})
		// notify_base + get_port_offset(remote_dp_rank, tp_index), default
		// tp_size=1, once per decode TP rank.
		for t := range in.cfg.TPSize {
			in.pool.Send(sidechan.Endpoint(src.host, src.notify+pRank+t), "", msg)
			in.ctr.remoteBlocksSent.Add(1)
		}
	}
	forget := forgetWaiter(&r.mu, r.waiters, tid, j)
	j.onFinish = func(engine.Progress) { forget() }
	j.onAbort = func(admitted bool) {
		forget()
		if !admitted {
			// vLLM: aborted before allocation, request_finished sends
			// release so P frees its blocks.
			m.sendWriteRelease(src, pRank, tid)
		}
	}
	return nil
}

func (m *moriio) deliverWriteDone(j *job, msg sidechan.Any) {
	d, ok := sidechan.ParseDigest(msg.SimDigest)
	if !ok {
		m.in.ctr.kvGarbage.Add(1)
		d = j.g.digest ^ garbageXor // bare-string write_done carries no KV
	}
	n := msg.SimNumTokens
	if !ok {
		n = len(j.g.promptIDs)
	}
	j.kvDelivered(d, n, 0, false)
}

func (m *moriio) decodeRead(j *job, p kvParams, tid string, pRank int, src moriAddr, okSrc bool) *apiError {
	in := m.in
	blocks, okBlocks := p.ints("remote_block_ids")
	engineID, okEngine := p.str("remote_engine_id")
	var missing string
	switch {
	case !okBlocks || len(blocks) == 0:
		missing = "remote_block_ids"
	case !okEngine || engineID == "":
		missing = "remote_engine_id"
	case tid == "":
		missing = "transfer_id"
	case !okSrc:
		missing = "remote_host/remote_handshake_port/remote_notify_port (or an X-Request-Id with ___prefill_addr_)"
	}
	if missing != "" {
		if e := in.violation(j.g, "kv_transfer_params", "READ-mode decode needs "+missing+" in kv_transfer_params (vLLM logs \"Got invalid KVTransferParams\" and decodes garbage)"); e != nil {
			return e
		}
		j.garbage("missing " + missing)
		return nil
	}
	// ReqMeta.tp_size comes from "tp_size" (default 1), never from
	// remote_tp_size (that fallback exists only in the newest connector).
	pTP, ok := p.int("tp_size")
	if !ok || pTP < 1 {
		if e := in.violation(j.g, "kv_transfer_params", "READ-mode decode needs kv_transfer_params.tp_size (the prefill's TP size, from its response; vLLM reads tp_size with default 1, not remote_tp_size)"); e != nil {
			return e
		}
		pTP = 1
	}
	j.remote()
	var readDone, released atomic.Bool
	release := func() {
		if released.CompareAndSwap(false, true) {
			m.sendReadRelease(src, pRank, pTP, tid)
		}
	}
	j.req.OnAdmit = func(h *engine.Handle) {
		in.goBackground(func(ictx context.Context) {
			ctx, cancel := context.WithCancel(j.ctx)
			defer cancel()
			stop := context.AfterFunc(ictx, cancel)
			defer stop()
			res := m.readKV(ctx, j, src, pRank, engineID, tid, blocks)
			readDone.Store(true)
			if res == readFailed {
				release() // a failed read still releases, then D recomputes
				j.kvDelivered(0, 0, 0, true)
			}
		})
	}
	j.onFirstToken = release
	j.onAbort = func(bool) {
		if !readDone.Load() {
			release() // vLLM issues an empty read so P gets notified
		}
	}
	return nil
}

// readKV performs the handshake (first contact) and the read RPC against
// P's rank pRank. A reply for a transfer that rank does not hold is a
// successful RDMA read of the wrong memory: garbage, no error.
func (m *moriio) readKV(ctx context.Context, j *job, src moriAddr, pRank int, engineID, tid string, blocks []int) readResult {
	in := m.in
	fail := func(msg string, args ...any) readResult {
		if ctx.Err() != nil {
			return readCanceled
		}
		in.ctr.readsFailed.Add(1)
		in.ctr.transfersFailed.Add(1)
		in.log.Warn(msg, append([]any{"transfer_id", tid}, args...)...)
		return readFailed
	}
	ep := sidechan.Endpoint(src.host, src.handshake+pRank)
	st := in.hs.ensure(fmt.Sprintf("moriio:%s_dp%d", engineID, pRank), []string{ep})
	if err := st.wait(ctx); err != nil {
		return fail("READ: handshake with the prefill failed; recomputing locally", "endpoint", ep, "err", err)
	}
	if in.faults.takeReadFailure() {
		return fail("READ: injected read failure (fail_reads); recomputing locally")
	}
	c, err := in.clients.Get(ep)
	if err != nil {
		return fail("READ: cannot reach prefill; recomputing locally", "endpoint", ep, "err", err)
	}
	rctx, cancel := context.WithTimeout(ctx, in.cfg.TransferTime)
	defer cancel()
	id := m.nextRPC()
	reply, err := c.Call(rctx, id, sidechan.Encode(sidechan.ReadRequest{Type: sidechan.TypeRead, RPCID: id, TransferID: tid, BlockIDs: blocks}))
	if err != nil {
		return fail("READ failed; recomputing locally", "err", err)
	}
	load := in.params.TransferTime(len(j.g.promptIDs))
	if !reply.OK {
		j.readGarbage(load, fmt.Sprintf("prefill %s rank %d: %s", engineID, pRank, reply.Error))
		return readGarbage
	}
	in.ctr.readsDone.Add(1)
	d, _ := sidechan.ParseDigest(reply.SimDigest)
	j.kvDelivered(d, reply.SimNumTokens, in.params.TransferTime(reply.SimNumTokens), false)
	return readOK
}

// sendReadRelease is READ's release: one per decode TP rank t to
// remote_notify_port + get_port_offset(remote_dp_rank, eff_tp, tp_size),
// i.e. notify + dp·tp_size + eff_tp (0158326 _read_blocks).
func (m *moriio) sendReadRelease(src moriAddr, pRank, pTP int, tid string) {
	in := m.in
	msg := sidechan.Encode(sidechan.Release{Type: sidechan.TypeRelease, TransferID: tid, ConsumerTPSize: in.cfg.TPSize})
	for t := range in.cfg.TPSize {
		port := src.notify + pRank*pTP + moriRemoteTPRank(t, in.cfg.TPSize, pTP)
		in.pool.Send(sidechan.Endpoint(src.host, port), "", msg)
		in.ctr.releaseSent.Add(1)
	}
}

// sendWriteRelease is WRITE's release after an abort before allocation:
// one per decode TP index to notify + get_port_offset(remote_dp_rank,
// tp_index) with the default tp_size=1 (0158326
// _release_write_prefill_blocks).
func (m *moriio) sendWriteRelease(src moriAddr, pRank int, tid string) {
	in := m.in
	msg := sidechan.Encode(sidechan.Release{Type: sidechan.TypeRelease, TransferID: tid, ConsumerTPSize: in.cfg.TPSize})
	for t := range in.cfg.TPSize {
		in.pool.Send(sidechan.Endpoint(src.host, src.notify+pRank+t), "", msg)
		in.ctr.releaseSent.Add(1)
	}
}

// ----------------------------------------------------------- side channel

func (m *moriio) onNotifySocket(offset int, payload []byte) {
	in := m.in
	msg, err := sidechan.Decode(payload)
	if err != nil {
		in.log.Warn("notify: undecodable message", "err", err)
		return
	}
	r := m.ranks[in.cfg.rankForOffset(offset)]
	port := in.notifyBase + offset
	if msg.Bare != "" {
		// Older format: a bare transfer id means "done" on both sides.
		msg.TransferID = msg.Bare
		if in.cfg.Role == RoleDecode {
			msg.Type = sidechan.TypeWriteDone
		} else {
			msg.Type = sidechan.TypeRelease
		}
	}
	in.ctr.notePort(msg.Type, port)
	switch {
	case msg.Type == sidechan.TypeRemoteBlocks && in.cfg.Role == RolePrefill:
		in.ctr.remoteBlocksRecv.Add(1)
		m.onRemoteBlocks(r, msg)
	case msg.Type == sidechan.TypeRelease && in.cfg.Role == RolePrefill:
		in.ctr.releaseReceived.Add(1)
		m.onRelease(r, msg)
	case msg.Type == sidechan.TypeWriteDone && in.cfg.Role == RoleDecode:
		in.ctr.writeDoneReceived.Add(1)
		m.onWriteDone(r, msg)
	default:
		in.log.Warn("notify: unexpected message", "type", msg.Type, "role", in.cfg.Role, "port", port)
	}
}

func (m *moriio) onRemoteBlocks(r *moriRank, msg sidechan.Any) {
	r.mu.Lock()
	if r.dead {
		r.mu.Unlock()
		m.in.log.Debug("notify listener is dead; message ignored", "transfer_id", msg.TransferID)
		return
	}
	if len(msg.BlockNotifyList) == 0 {
		// vLLM raises MoRIIOError in the listener thread, which dies.
		r.dead = true
		r.mu.Unlock()
		m.in.log.Error("remote_blocks with an empty block_notify_list: the notify listener died (vLLM behaviour); later WRITE transfers on this rank stall", "transfer_id", msg.TransferID)
		return
	}
	x := r.xfers[msg.TransferID]
	if x == nil {
		m.stashEarly(r, msg)
		r.mu.Unlock()
		return
	}
	if x.rbArrived || x.done {
		r.mu.Unlock()
		return // duplicate (one per D TP rank)
	}
	x.rbArrived = true
	x.decodeRank = msg.DecodeRank
	x.disarm()
	if x.linkAdded {
		m.in.links[x.rank].Open(x.id, time.Now())
	}
	r.mu.Unlock()
}

func (m *moriio) onRelease(r *moriRank, msg sidechan.Any) {
	r.mu.Lock()
	x := r.xfers[msg.TransferID]
	if x == nil {
		r.mu.Unlock()
		return
	}
	// get_moriio_expected_ack_count: consumer_tp_size / producer_tp_size
	// release messages (at least 1; a bare string counts as consumer TP 1).
	x.acks++
	need := 1
	if c := msg.ConsumerTPSize; c > m.in.cfg.TPSize {
		need = (c + m.in.cfg.TPSize - 1) / m.in.cfg.TPSize
	}
	enough := x.acks >= need
	r.mu.Unlock()
	if !enough {
		return
	}
	if m.read {
		m.finishXfer(x, true, "released")
	} else {
		m.finishXfer(x, false, "decode aborted before allocation")
	}
}

func (m *moriio) onWriteDone(r *moriRank, msg sidechan.Any) {
	r.mu.Lock()
	j := r.waiters[msg.TransferID]
	if j == nil {
		m.stashEarly(r, msg)
		r.mu.Unlock()
		return
	}
	delete(r.waiters, msg.TransferID)
	r.mu.Unlock()
	m.deliverWriteDone(j, msg)
}

// stashEarly keeps a message whose request is not known yet (r.mu held),
// as vLLM buffers ids that arrive before the mapping exists.
func (m *moriio) stashEarly(r *moriRank, msg sidechan.Any) {
	r.early.stash(m.in, &r.mu, msg.TransferID, msg)
}

func (m *moriio) onHandshakeSocket(offset int, payload []byte, reply func([]byte) error) {
	in := m.in
	msg, err := sidechan.Decode(payload)
	if err != nil || msg.Type != sidechan.TypeRead {
		in.log.Warn("handshake socket: unexpected message", "type", msg.Type, "err", err)
		return
	}
	in.ctr.notePort(msg.Type, in.hsBase+offset)
	rank := in.cfg.rankForOffset(offset)
	r := m.ranks[rank]
	r.mu.Lock()
	x := r.xfers[msg.TransferID]
	ok := x != nil && x.finished && !x.done
	r.mu.Unlock()
	rep := sidechan.Reply{Type: sidechan.TypeReadReply, RPCID: msg.RPCID, OK: ok}
	if ok {
		in.ctr.readsServed.Add(1)
		rep.SimDigest = sidechan.FormatDigest(x.j.g.digest)
		rep.SimNumTokens = len(x.j.g.promptIDs)
	} else {
		// RDMA reads the requested blocks of this rank's memory anyway.
		in.ctr.readsUnmatched.Add(1)
		rep.Error = fmt.Sprintf("transfer_id %s is not pinned on DP rank %d", msg.TransferID, rank)
		if other := m.pinnedRank(msg.TransferID); other >= 0 && other != rank {
			rep.Error += fmt.Sprintf(" (it is pinned on rank %d: X-data-parallel-rank on P must equal remote_dp_rank on D)", other)
		}
		in.log.Warn("READ of a transfer this rank does not hold: the decode gets garbage", "rank", rank, "error", rep.Error)
	}
	_ = reply(sidechan.Encode(rep))
}

// pinnedRank returns the DP rank holding transfer tid, or -1.
func (m *moriio) pinnedRank(tid string) int {
	for i, r := range m.ranks {
		if r.lookup(tid) != nil {
			return i
		}
	}
	return -1
}

func (m *moriio) onKVSocket(int, []byte) {}
