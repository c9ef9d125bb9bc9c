package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// mooncake is the Mooncake connector (PROTOCOL §4.3): P runs a bootstrap
// HTTP server (GET /query → per-DP-rank engine_id and worker address); P and
// D run concurrently. D resolves P's worker from remote_bootstrap_addr and
// remote_engine_id, registers its blocks for transfer_id with P over ZMQ,
// and P pushes the KV once its forward is done and replies.
type mooncake struct {
	in    *Instance
	ranks []*mcRank
	rpcID atomic.Uint64

	httpc   *http.Client
	queryMu sync.Mutex
	queries map[string]map[string]mcQueryEntry // bootstrap addr -> /query
}

type mcRank struct {
	xferTable[*mcXfer]
	early earlyMap[*mcPull] // pulls before the prefill request arrived
}

type mcPull struct {
	msg   sidechan.Any
	reply func([]byte) error
	at    time.Time
}

type mcXfer struct {
	pinned
	pull      *mcPull
	linkAdded bool
	finished  bool
}

type mcQueryEntry struct {
	EngineID   string                       `json:"engine_id"`
	WorkerAddr map[string]map[string]string `json:"worker_addr"`
}

func newMooncake(in *Instance) *mooncake {
	m := &mooncake{
		in:      in,
		httpc:   &http.Client{Timeout: 5 * time.Second},
		queries: make(map[string]map[string]mcQueryEntry),
	}
	for range in.cfg.DPSize {
		m.ranks = append(m.ranks, &mcRank{xferTable: newXferTable[*mcXfer](), early: make(earlyMap[*mcPull])})
	}
	return m
}

func (m *mooncake) pending() int {
	n := 0
	for _, r := range m.ranks {
		n += r.size()
	}
	return n
}

func (m *mooncake) engineID(rank int) string {
	return fmt.Sprintf("mooncake-%s-%d-dp%d", m.in.cfg.AdvertiseHost, m.in.hsBase, rank)
}

// bootstrapHandler serves the prefill's bootstrap API.
func (m *mooncake) bootstrapHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, _ *http.Request) {
		out := make(map[string]mcQueryEntry, m.in.cfg.DPSize)
		for r := range m.in.cfg.DPSize {
			workers := make(map[string]map[string]string, m.in.cfg.TPSize)
			for t := range m.in.cfg.TPSize {
				workers[strconv.Itoa(t)] = map[string]string{
					"0": net.JoinHostPort(m.in.cfg.AdvertiseHost, strconv.Itoa(m.in.hsBase+r+t)),
				}
			}
			out[strconv.Itoa(r)] = mcQueryEntry{EngineID: m.engineID(r), WorkerAddr: workers}
		}
		writeJSON(w, 200, out)
	})
	mux.HandleFunc("POST /register", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
		writeJSON(w, 200, map[string]string{"status": "ok"})
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(200) })
	return mux
}

func (m *mooncake) prefill(j *job) *apiError {
	in := m.in
	j.local()
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_decode") {
		return nil
	}
	tid, ok := p.str("transfer_id")
	if !ok || tid == "" {
		if e := in.violation(j.g, "kv_transfer_params", "Mooncake prefill needs kv_transfer_params.transfer_id"); e != nil {
			return e
		}
		tid = "xfer-" + j.g.xRequestID
	}
	j.kind = "prefill"
	j.req.KeepBlocks = true
	x := &mcXfer{pinned: pinned{id: tid, j: j, rank: j.rank}}
	r := m.ranks[j.rank]
	r.add(x, func(old *mcXfer) { m.finish(old, false) }, func() {
		if e, ok := r.early.take(tid); ok {
			x.pull = e
		}
	})
	j.req.OnForward = func(h *engine.Handle, start time.Time, compute time.Duration) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if x.done || x.linkAdded {
			return
		}
		x.linkAdded = true
		// Mooncake sends the whole KV after the forward, not per layer.
		end := start.Add(compute)
		in.links[x.rank].Add(x.id, []time.Time{end}, in.params.TransferTime(len(j.g.promptIDs)), x.pull == nil,
			func(time.Time) { m.pushed(x) })
	}
	j.onFinish = func(pr engine.Progress) {
		if pr.Reason != engine.FinishLength {
			m.finish(x, false)
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if x.done {
			return
		}
		x.finished = true
		if x.pull == nil {
			x.timer = in.deferTimer(func() { in.ctr.deferExpired.Add(1); m.finish(x, false) })
		}
	}
	j.onAbort = func(bool) { m.finish(x, false) }
	return nil
}

// pushed runs when the simulated push finished: answer D's pull.
func (m *mooncake) pushed(x *mcXfer) {
	if !m.ranks[x.rank].complete(x) {
		return
	}
	pull := x.pull // fixed once x is done
	in := m.in
	if in.faults.dropWrites() {
		in.ctr.writeDoneDropped.Add(1)
	} else if pull != nil {
		err := pull.reply(sidechan.Encode(sidechan.Reply{
			Type: sidechan.TypeMooncakeReply, RPCID: pull.msg.RPCID, OK: true,
			SimDigest: sidechan.FormatDigest(x.j.g.digest), SimNumTokens: len(x.j.g.promptIDs),
		}))
		if err == nil {
			in.ctr.pushesSent.Add(1)
		}
	}
	in.ctr.transfersCompleted.Add(1)
	x.j.handle().Release()
}

func (m *mooncake) finish(x *mcXfer, ok bool) {
	if !m.ranks[x.rank].finish(x) {
		return
	}
	m.in.links[x.rank].Cancel(x.id)
	if !ok && x.finished {
		m.in.ctr.transfersFailed.Add(1)
	}
	if h := x.j.handle(); h != nil {
		h.Release()
	}
}

func (m *mooncake) decode(j *job) *apiError {
	in := m.in
	p := j.g.kv
	if p == nil || !p.boolean("do_remote_prefill") {
		j.local() // Mooncake checks do_remote_prefill: plain requests run locally
		return nil
	}
	boot, okB := p.str("remote_bootstrap_addr")
	engineID, okE := p.str("remote_engine_id")
	tid, okT := p.str("transfer_id")
	var missing string
	switch {
	case !okB || boot == "":
		missing = "remote_bootstrap_addr"
	case !okE || engineID == "":
		missing = "remote_engine_id"
	case !okT || tid == "":
		missing = "transfer_id"
	}
	if missing != "" {
		if e := in.violation(j.g, "kv_transfer_params", "Mooncake decode needs "+missing+" in kv_transfer_params"); e != nil {
			return e
		}
		j.garbage("missing " + missing)
		return nil
	}
	if !strings.HasPrefix(boot, "http://") && !strings.HasPrefix(boot, "https://") {
		// vLLM queries remote_bootstrap_addr + "/query": without a scheme
		// the HTTP client refuses it and the request waits forever.
		if e := in.violation(j.g, "kv_transfer_params", "Mooncake decode: remote_bootstrap_addr "+strconv.Quote(boot)+
			" lacks the http:// scheme (vLLM requests remote_bootstrap_addr + \"/query\")"); e != nil {
			return e
		}
	}
	j.remote()
	j.req.OnAdmit = func(h *engine.Handle) {
		blocks := h.AdmittedBlocks()
		in.goBackground(func(context.Context) { m.pull(j, boot, engineID, tid, blocks) })
	}
	return nil
}

// pull resolves P's worker and waits for the push (no timeout of its own:
// --kv-wait-timeout applies, as the decode would otherwise wait).
func (m *mooncake) pull(j *job, boot, engineID, tid string, blocks []int) {
	in := m.in
	worker, err := m.resolve(j.ctx, boot, engineID)
	if err != nil {
		if j.ctx.Err() == nil {
			in.ctr.transfersFailed.Add(1)
			in.log.Warn("Mooncake: cannot resolve the prefill worker; the request waits", "bootstrap", boot, "engine_id", engineID, "err", err)
		}
		return
	}
	host, port, err := net.SplitHostPort(worker)
	pn, perr := strconv.Atoi(port)
	if err != nil || perr != nil {
		in.log.Warn("Mooncake: bad worker address", "worker_addr", worker)
		return
	}
	c, err := in.clients.Get(sidechan.Endpoint(host, pn))
	if err != nil {
		in.ctr.transfersFailed.Add(1)
		in.log.Warn("Mooncake: cannot reach the prefill worker", "worker_addr", worker, "err", err)
		return
	}
	id := "mc-" + strconv.FormatUint(m.rpcID.Add(1), 10)
	reply, err := c.Call(j.ctx, id, sidechan.Encode(sidechan.MooncakePull{Type: sidechan.TypeMooncakePull, RPCID: id, TransferID: tid, BlockIDs: blocks}))
	if err != nil || !reply.OK {
		if j.ctx.Err() == nil {
			in.ctr.transfersFailed.Add(1)
			in.log.Warn("Mooncake pull failed; the request waits", "transfer_id", tid, "err", err, "reply_error", reply.Error)
		}
		return
	}
	in.ctr.pushesReceived.Add(1)
	d, _ := sidechan.ParseDigest(reply.SimDigest)
	j.kvDelivered(d, reply.SimNumTokens, 0, false)
}

// resolve returns P's worker address for engineID via GET <boot>/query.
func (m *mooncake) resolve(ctx context.Context, boot, engineID string) (string, error) {
	find := func(q map[string]mcQueryEntry) (string, bool) {
		for _, e := range q {
			if e.EngineID == engineID {
				if w, ok := e.WorkerAddr["0"]["0"]; ok {
					return w, true
				}
			}
		}
		return "", false
	}
	m.queryMu.Lock()
	q := m.queries[boot]
	m.queryMu.Unlock()
	if w, ok := find(q); ok {
		return w, nil
	}
	if !strings.HasPrefix(boot, "http://") && !strings.HasPrefix(boot, "https://") {
		return "", fmt.Errorf("remote_bootstrap_addr %q has no http:// scheme", boot)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, boot+"/query", nil)
	if err != nil {
		return "", err
	}
	resp, err := m.httpc.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return "", fmt.Errorf("GET /query: %s", resp.Status)
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&q); err != nil {
		return "", fmt.Errorf("GET /query: %w", err)
	}
	m.queryMu.Lock()
	m.queries[boot] = q
	m.queryMu.Unlock()
	if w, ok := find(q); ok {
		return w, nil
	}
	return "", errors.New("remote_engine_id " + engineID + " not in /query")
}

func (m *mooncake) onHandshakeSocket(offset int, payload []byte, reply func([]byte) error) {
	in := m.in
	msg, err := sidechan.Decode(payload)
	if err != nil || msg.Type != sidechan.TypeMooncakePull {
		return
	}
	in.ctr.pullsReceived.Add(1)
	in.ctr.notePort(msg.Type, in.hsBase+offset)
	r := m.ranks[in.cfg.rankForOffset(offset)]
	pull := &mcPull{msg: msg, reply: reply, at: time.Now()}
	r.mu.Lock()
	defer r.mu.Unlock()
	x := r.xfers[msg.TransferID]
	if x == nil {
		r.early.stash(in, &r.mu, msg.TransferID, pull)
		return
	}
	if x.pull != nil || x.done {
		return
	}
	x.pull = pull
	x.disarm()
	if x.linkAdded {
		in.links[x.rank].Open(x.id, pull.at)
	}
}

func (m *mooncake) onNotifySocket(int, []byte) {}
func (m *mooncake) onKVSocket(int, []byte)     {}
