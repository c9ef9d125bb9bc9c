package sim

import (
	"strconv"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// p2p is the P2P-NCCL connector (PROTOCOL §4.1): sequential. P parses D's
// "ip:port" from X-Request-Id and pushes the KV layer by layer to D's
// kv_port during its forward; D receives the original body (no params) and
// waits for the push keyed by the request id.
type p2p struct {
	in *Instance

	mu       sync.Mutex
	waiters  map[string]*job        // D: X-Request-Id -> waiting request
	pushed   earlyMap[sidechan.Any] // D: pushes that arrived first
	inFlight int                    // P: pushes in flight
}

func newP2P(in *Instance) *p2p {
	return &p2p{in: in, waiters: make(map[string]*job), pushed: make(earlyMap[sidechan.Any])}
}

func (p *p2p) pendingCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.waiters) + p.inFlight
}

func (p *p2p) pending() int { return p.pendingCount() }

func (p *p2p) prefill(j *job) *apiError {
	in := p.in
	j.local()
	m := p2pDecodeRE.FindStringSubmatch(j.g.xRequestID)
	if m == nil {
		if j.g.kv != nil {
			if e := in.violation(j.g, "", "P2P-NCCL prefill: X-Request-Id has no ___decode_addr_<ip>:<port> part"); e != nil {
				return e
			}
		}
		return nil // plain request
	}
	port, err := strconv.Atoi(m[2])
	if err != nil || port <= 0 || port > 65535 {
		return badRequest("P2P-NCCL prefill: bad decode port in X-Request-Id")
	}
	dst := sidechan.Endpoint(m[1], port)
	key := j.g.xRequestID
	j.kind = "prefill"
	j.req.KeepBlocks = true
	st := in.hs.ensure("p2p:"+m[1]+":"+m[2], nil) // NCCL communicator set-up on first contact
	j.req.ForwardNotBefore = st.readyAt
	var once sync.Once
	var added bool
	j.req.OnForward = func(h *engine.Handle, start time.Time, compute time.Duration) {
		once.Do(func() {
			p.mu.Lock()
			p.inFlight++
			added = true
			p.mu.Unlock()
			times := layerReadyTimes(start, compute, in.params.NumLayers)
			in.links[j.rank].Add(key, times, in.params.LayerTransferTime(len(j.g.promptIDs)), false, func(time.Time) {
				p.mu.Lock()
				p.inFlight--
				p.mu.Unlock()
				if in.faults.dropWrites() {
					in.ctr.writeDoneDropped.Add(1)
				} else {
					in.pool.Send(dst, in.zmqAddress(), sidechan.Encode(sidechan.Push{
						Cmd: "PUT", RequestID: key,
						SimDigest: sidechan.FormatDigest(j.g.digest), SimNumTokens: len(j.g.promptIDs),
					}))
					in.ctr.pushesSent.Add(1)
				}
				in.ctr.transfersCompleted.Add(1)
				h.Release()
			})
		})
	}
	cancel := func() {
		in.links[j.rank].Cancel(key)
		p.mu.Lock()
		if added {
			p.inFlight--
			added = false
		}
		p.mu.Unlock()
		if h := j.handle(); h != nil {
			h.Release()
		}
	}
	j.onFinish = func(pr engine.Progress) {
		if pr.Reason != engine.FinishLength {
			cancel()
		}
	}
	j.onAbort = func(bool) { cancel() }
	return nil
}

func (p *p2p) decode(j *job) *apiError {
	in := p.in
	key := j.g.xRequestID
	if p2pPrefillRE.FindStringSubmatch(key) == nil {
		if e := in.violation(j.g, "", "P2P-NCCL decode: X-Request-Id has no ___prefill_addr_<ip>:<port>___ part, so no KV will be pushed"); e != nil {
			return e
		}
	}
	j.remote()
	if key == "" {
		in.log.Warn("P2P-NCCL decode without X-Request-Id: it will wait forever")
		return nil
	}
	p.mu.Lock()
	if old := p.waiters[key]; old != nil {
		in.log.Warn("P2P-NCCL: duplicate request id on decode", "request_id", key)
	}
	msg, got := p.pushed.await(p.waiters, key, j)
	p.mu.Unlock()
	if got {
		j.afterSubmit = func() { p.deliver(j, msg) }
	}
	forget := forgetWaiter(&p.mu, p.waiters, key, j)
	j.onFinish = func(engine.Progress) { forget() }
	j.onAbort = func(bool) { forget() }
	return nil
}

func (p *p2p) deliver(j *job, msg sidechan.Any) {
	d, ok := sidechan.ParseDigest(msg.SimDigest)
	if !ok {
		d = j.g.digest ^ garbageXor
	}
	j.kvDelivered(d, msg.SimNumTokens, 0, false)
}

func (p *p2p) onKVSocket(offset int, payload []byte) {
	in := p.in
	msg, err := sidechan.Decode(payload)
	if err != nil || msg.Cmd != "PUT" || msg.RequestID == "" {
		return
	}
	in.ctr.pushesReceived.Add(1)
	in.ctr.notePort("PUT", in.kvBase+offset)
	p.mu.Lock()
	j := p.waiters[msg.RequestID]
	if j == nil {
		p.pushed.stash(in, &p.mu, msg.RequestID, msg)
		p.mu.Unlock()
		return
	}
	delete(p.waiters, msg.RequestID)
	p.mu.Unlock()
	p.deliver(j, msg)
}

func (p *p2p) onHandshakeSocket(int, []byte, func([]byte) error) {}
func (p *p2p) onNotifySocket(int, []byte)                        {}
