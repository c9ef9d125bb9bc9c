package sim

import (
	"encoding/json"
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
)

// counters are the instance-wide event counts behind GET /sim/stats.
type counters struct {
	reqCompletions atomic.Int64
	reqChat        atomic.Int64
	reqResponses   atomic.Int64
	reqRetrieve    atomic.Int64 // GET /v1/responses/{id}
	reqCancel      atomic.Int64 // POST /v1/responses/{id}/cancel
	reqPrefillLeg  atomic.Int64 // prefill role, do_remote_decode requests
	reqDecodeLeg   atomic.Int64 // decode role, remote-prefilled requests
	reqPlain       atomic.Int64 // served without any KV handoff
	status4xx      atomic.Int64
	status5xx      atomic.Int64
	faultsInjected atomic.Int64
	rejected503    atomic.Int64
	aborted        atomic.Int64
	inflight       atomic.Int64
	peakInflight   atomic.Int64 // the most generation requests in flight at once
	started        atomic.Int64 // generation requests started (crash-after)

	transfersCompleted atomic.Int64
	transfersFailed    atomic.Int64
	writeDoneSent      atomic.Int64
	writeDoneDropped   atomic.Int64
	writeDoneReceived  atomic.Int64
	remoteBlocksSent   atomic.Int64
	remoteBlocksRecv   atomic.Int64
	releaseSent        atomic.Int64
	releaseReceived    atomic.Int64
	readsServed        atomic.Int64
	readsDone          atomic.Int64
	readsFailed        atomic.Int64
	tokensRead         atomic.Int64 // NIXL D: prompt tokens whose KV it read
	tokensReadLocal    atomic.Int64 // NIXL D: prompt tokens its own prefix cache held (not read)
	pullsReceived      atomic.Int64
	pushesSent         atomic.Int64
	pushesReceived     atomic.Int64
	handshakesStarted  atomic.Int64
	handshakesServed   atomic.Int64
	handshakeFailures  atomic.Int64
	sideChannelDrops   atomic.Int64
	kvDigestMismatch   atomic.Int64
	kvGarbage          atomic.Int64
	kvWaitTimeouts     atomic.Int64
	deferExpired       atomic.Int64
	readsUnmatched     atomic.Int64 // P: reads of a transfer not pinned on that rank
	protocolViolations atomic.Int64
	registrationsSent  atomic.Int64
	profileStarts      atomic.Int64
	profileStops       atomic.Int64
	promptTokens       atomic.Int64
	generationTokens   atomic.Int64

	mu             sync.Mutex
	lastRequestID  string
	lastDPRank     string
	lastKVParams   map[string]json.RawMessage
	lastNotifyPort map[string]int // message type -> port it arrived on
	lastViolation  string
}

func (c *counters) noteRequest(endpoint, xRequestID, dpRank string, kv json.RawMessage) {
	c.mu.Lock()
	c.lastRequestID = xRequestID
	c.lastDPRank = dpRank
	if c.lastKVParams == nil {
		c.lastKVParams = make(map[string]json.RawMessage)
	}
	if len(kv) == 0 {
		kv = json.RawMessage("null")
	}
	c.lastKVParams[endpoint] = append(json.RawMessage(nil), kv...)
	c.mu.Unlock()
}

func (c *counters) notePort(msgType string, port int) {
	c.mu.Lock()
	if c.lastNotifyPort == nil {
		c.lastNotifyPort = make(map[string]int)
	}
	c.lastNotifyPort[msgType] = port
	c.mu.Unlock()
}

// faults is the runtime-adjustable fault state (POST /sim/faults).
type faults struct {
	mu              sync.Mutex
	failNext        int
	failStatus      int
	crashAfter      int
	stallFirstToken time.Duration
	dropWriteDone   bool
	slowFactor      float64
	maxWaiting      int
	failReads       int
	cutAfterTokens  int
	crashAfterToks  int
}

// FaultsJSON is the wire shape of /sim/faults (request and response). In a
// request every field is optional.
type FaultsJSON struct {
	FailNext          *int     `json:"fail_next,omitempty"`
	FailStatus        *int     `json:"fail_status,omitempty"`
	CrashAfter        *int     `json:"crash_after,omitempty"`
	StallFirstTokenMS *float64 `json:"stall_first_token_ms,omitempty"`
	DropWriteDone     *bool    `json:"drop_write_done,omitempty"`
	Heartbeat         *bool    `json:"heartbeat,omitempty"`
	SlowFactor        *float64 `json:"slow_factor,omitempty"`
	MaxWaiting        *int     `json:"max_waiting,omitempty"`
	FailReads         *int     `json:"fail_reads,omitempty"`
	CutAfterTokens    *int     `json:"cut_after_tokens,omitempty"`
	CrashAfterTokens  *int     `json:"crash_after_tokens,omitempty"`
}

func (f *faults) validateAndApply(in FaultsJSON) error {
	var errs []error
	if in.FailNext != nil && *in.FailNext < 0 {
		errs = append(errs, errors.New("fail_next must be >= 0"))
	}
	if in.FailStatus != nil && (*in.FailStatus < 400 || *in.FailStatus > 599) {
		errs = append(errs, errors.New("fail_status must be in [400, 599]"))
	}
	if in.CrashAfter != nil && *in.CrashAfter < 0 {
		errs = append(errs, errors.New("crash_after must be >= 0"))
	}
	if in.StallFirstTokenMS != nil && (*in.StallFirstTokenMS < 0 || math.IsNaN(*in.StallFirstTokenMS)) {
		errs = append(errs, errors.New("stall_first_token_ms must be >= 0"))
	}
	if in.SlowFactor != nil && !(*in.SlowFactor > 0) {
		errs = append(errs, errors.New("slow_factor must be > 0"))
	}
	if in.MaxWaiting != nil && *in.MaxWaiting < 0 {
		errs = append(errs, errors.New("max_waiting must be >= 0"))
	}
	if in.FailReads != nil && *in.FailReads < 0 {
		errs = append(errs, errors.New("fail_reads must be >= 0"))
	}
	if in.CutAfterTokens != nil && *in.CutAfterTokens < 0 {
		errs = append(errs, errors.New("cut_after_tokens must be >= 0"))
	}
	if in.CrashAfterTokens != nil && *in.CrashAfterTokens < 0 {
		errs = append(errs, errors.New("crash_after_tokens must be >= 0"))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if in.FailNext != nil {
		f.failNext = *in.FailNext
	}
	if in.FailStatus != nil {
		f.failStatus = *in.FailStatus
	}
	if in.CrashAfter != nil {
		f.crashAfter = *in.CrashAfter
	}
	if in.StallFirstTokenMS != nil {
		f.stallFirstToken = time.Duration(*in.StallFirstTokenMS * float64(time.Millisecond))
	}
	if in.DropWriteDone != nil {
		f.dropWriteDone = *in.DropWriteDone
	}
	if in.SlowFactor != nil {
		f.slowFactor = *in.SlowFactor
	}
	if in.MaxWaiting != nil {
		f.maxWaiting = *in.MaxWaiting
	}
	if in.FailReads != nil {
		f.failReads = *in.FailReads
	}
	if in.CutAfterTokens != nil {
		f.cutAfterTokens = *in.CutAfterTokens
	}
	if in.CrashAfterTokens != nil {
		f.crashAfterToks = *in.CrashAfterTokens
	}
	return nil
}

func (f *faults) snapshot(heartbeat bool) FaultsJSON {
	f.mu.Lock()
	defer f.mu.Unlock()
	ms := float64(f.stallFirstToken) / float64(time.Millisecond)
	failNext, failStatus, crash, drop, slow, mw, fr := f.failNext, f.failStatus, f.crashAfter, f.dropWriteDone, f.slowFactor, f.maxWaiting, f.failReads
	cut, crashToks := f.cutAfterTokens, f.crashAfterToks
	return FaultsJSON{
		FailNext: &failNext, FailStatus: &failStatus, CrashAfter: &crash,
		StallFirstTokenMS: &ms, DropWriteDone: &drop, Heartbeat: &heartbeat,
		SlowFactor: &slow, MaxWaiting: &mw, FailReads: &fr,
		CutAfterTokens: &cut, CrashAfterTokens: &crashToks,
	}
}

// takeFailure consumes one fail_next credit and returns its status.
func (f *faults) takeFailure() (int, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failNext <= 0 {
		return 0, false
	}
	f.failNext--
	return f.failStatus, true
}

// takeReadFailure consumes one fail_reads credit: the decode's next KV
// read fails like an RDMA error (release, then local recompute).
func (f *faults) takeReadFailure() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failReads <= 0 {
		return false
	}
	f.failReads--
	return true
}

func (f *faults) stall() time.Duration {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stallFirstToken
}

func (f *faults) dropWrites() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.dropWriteDone
}

// tokenCut returns the cut_after_tokens and crash_after_tokens faults: a
// response is cut (connection closed, no [DONE]) or the process exits once
// that many tokens of one request were generated (0 = off).
func (f *faults) tokenCut() (cut, crash int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.cutAfterTokens, f.crashAfterToks
}

func (f *faults) crashLimit() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.crashAfter
}

// Stats is the JSON shape of GET /sim/stats.
type Stats struct {
	Role         string `json:"role"`
	KVConnector  string `json:"kv_connector"`
	TransferMode string `json:"transfer_mode"`

	Requests struct {
		Completions     int64 `json:"completions"`
		ChatCompletions int64 `json:"chat_completions"`
		Responses       int64 `json:"responses"`
		ResponsesGet    int64 `json:"responses_retrieve"`
		ResponsesCancel int64 `json:"responses_cancel"`
		PrefillLeg      int64 `json:"prefill_leg"`
		DecodeLeg       int64 `json:"decode_leg"`
		Plain           int64 `json:"plain"`
		Status4xx       int64 `json:"status_4xx"`
		Status5xx       int64 `json:"status_5xx"`
		FaultsInjected  int64 `json:"faults_injected"`
		Rejected503     int64 `json:"rejected_503"`
		Aborted         int64 `json:"aborted"`
		InFlight        int64 `json:"in_flight"`
		PeakInFlight    int64 `json:"peak_in_flight"`
	} `json:"requests"`

	Running       int `json:"running"`
	Waiting       int `json:"waiting"`
	WaitingRemote int `json:"waiting_for_remote_kv"`
	KVBlocksUsed  int `json:"kv_blocks_used"`
	KVBlocksTotal int `json:"kv_blocks_total"`

	Transfers struct {
		Completed         int64 `json:"completed"`
		Failed            int64 `json:"failed"`
		Pending           int   `json:"pending"`
		WriteDoneSent     int64 `json:"write_done_sent"`
		WriteDoneDropped  int64 `json:"write_done_dropped"`
		WriteDoneReceived int64 `json:"write_done_received"`
		RemoteBlocksSent  int64 `json:"remote_blocks_sent"`
		RemoteBlocksRecv  int64 `json:"remote_blocks_received"`
		ReleaseSent       int64 `json:"release_sent"`
		ReleaseReceived   int64 `json:"release_received"`
		ReadsServed       int64 `json:"reads_served"`
		ReadsDone         int64 `json:"reads_done"`
		ReadsFailed       int64 `json:"reads_failed"`
		TokensRead        int64 `json:"tokens_read"`
		TokensReadLocal   int64 `json:"tokens_cached_locally"`
		PullsReceived     int64 `json:"mooncake_pulls_received"`
		PushesSent        int64 `json:"pushes_sent"`
		PushesReceived    int64 `json:"pushes_received"`
		HandshakesStarted int64 `json:"handshakes_started"`
		HandshakesServed  int64 `json:"handshakes_served"`
		HandshakeFailures int64 `json:"handshake_failures"`
		SideChannelDrops  int64 `json:"side_channel_drops"`
		DeferExpired      int64 `json:"defer_expired"`
		KVWaitTimeouts    int64 `json:"kv_wait_timeouts"`
		KVDigestMismatch  int64 `json:"kv_digest_mismatch"`
		KVGarbage         int64 `json:"kv_garbage"`
		ReadsUnmatched    int64 `json:"reads_unmatched"`
		// ProtocolViolations counts PD contract violations by the caller
		// (the router), in both modes; --strict also answers them with 400.
		ProtocolViolations    int64  `json:"protocol_violations"`
		LastProtocolViolation string `json:"last_protocol_violation"`
	} `json:"transfers"`

	RegistrationsSent int64 `json:"registrations_sent"`
	ProfileStarts     int64 `json:"profile_starts"`
	ProfileStops      int64 `json:"profile_stops"`
	PromptTokens      int64 `json:"prompt_tokens"`
	GenerationTokens  int64 `json:"generation_tokens"`

	LastRequestID    string                     `json:"last_x_request_id"`
	LastDPRankHeader string                     `json:"last_x_data_parallel_rank"`
	LastKVParams     map[string]json.RawMessage `json:"last_kv_transfer_params"`
	LastSideChannel  map[string]int             `json:"last_side_channel_port"`

	Engines []EngineStats `json:"engines"`
	Faults  FaultsJSON    `json:"faults"`
}

// EngineStats is one DP engine's part of Stats.
type EngineStats struct {
	DPRank        int    `json:"dp_rank"`
	Running       int    `json:"running"`
	Waiting       int    `json:"waiting"`
	WaitingRemote int    `json:"waiting_for_remote_kv"`
	Pinned        int    `json:"pinned_finished"`
	KVBlocksUsed  int    `json:"kv_blocks_used"`
	KVBlocksTotal int    `json:"kv_blocks_total"`
	Steps         uint64 `json:"steps"`
	PrefillTokens uint64 `json:"prefill_tokens"` // prompt tokens computed (not cached, not received)
	Preemptions   uint64 `json:"preemptions"`

	PrefixCache engine.PrefixStats `json:"prefix_cache"`
	KVEvents    *KVEventsStats     `json:"kv_events,omitempty"`
}

func (in *Instance) stats() Stats {
	var s Stats
	c := &in.ctr
	s.Role = in.cfg.Role
	if in.cfg.pd() {
		s.KVConnector = in.cfg.KVConnector
		if in.cfg.KVConnector == ConnMoRIIO {
			s.TransferMode = in.cfg.TransferMode
		}
	}
	r := &s.Requests
	r.Completions = c.reqCompletions.Load()
	r.ChatCompletions = c.reqChat.Load()
	r.Responses = c.reqResponses.Load()
	r.ResponsesGet = c.reqRetrieve.Load()
	r.ResponsesCancel = c.reqCancel.Load()
	r.PrefillLeg = c.reqPrefillLeg.Load()
	r.DecodeLeg = c.reqDecodeLeg.Load()
	r.Plain = c.reqPlain.Load()
	r.Status4xx = c.status4xx.Load()
	r.Status5xx = c.status5xx.Load()
	r.FaultsInjected = c.faultsInjected.Load()
	r.Rejected503 = c.rejected503.Load()
	r.Aborted = c.aborted.Load()
	r.InFlight = c.inflight.Load()
	r.PeakInFlight = c.peakInflight.Load()
	for i, e := range in.engines {
		es := e.Snapshot()
		s.Running += es.Running
		s.Waiting += es.Waiting
		s.WaitingRemote += es.WaitingRemote
		s.KVBlocksUsed += es.BlocksUsed
		s.KVBlocksTotal += es.BlocksTotal
		s.Engines = append(s.Engines, EngineStats{
			DPRank: i, Running: es.Running, Waiting: es.Waiting, WaitingRemote: es.WaitingRemote,
			Pinned: es.PinnedFinished, KVBlocksUsed: es.BlocksUsed, KVBlocksTotal: es.BlocksTotal,
			Steps: es.Steps, PrefillTokens: es.PrefillTokens, Preemptions: es.Preemptions,
			PrefixCache: e.PrefixCacheStats(), KVEvents: in.kvEventStats(i),
		})
	}
	t := &s.Transfers
	t.Completed = c.transfersCompleted.Load()
	t.Failed = c.transfersFailed.Load()
	t.Pending = in.pendingTransfers()
	t.WriteDoneSent = c.writeDoneSent.Load()
	t.WriteDoneDropped = c.writeDoneDropped.Load()
	t.WriteDoneReceived = c.writeDoneReceived.Load()
	t.RemoteBlocksSent = c.remoteBlocksSent.Load()
	t.RemoteBlocksRecv = c.remoteBlocksRecv.Load()
	t.ReleaseSent = c.releaseSent.Load()
	t.ReleaseReceived = c.releaseReceived.Load()
	t.ReadsServed = c.readsServed.Load()
	t.ReadsDone = c.readsDone.Load()
	t.ReadsFailed = c.readsFailed.Load()
	t.TokensRead = c.tokensRead.Load()
	t.TokensReadLocal = c.tokensReadLocal.Load()
	t.PullsReceived = c.pullsReceived.Load()
	t.PushesSent = c.pushesSent.Load()
	t.PushesReceived = c.pushesReceived.Load()
	t.HandshakesStarted = c.handshakesStarted.Load()
	t.HandshakesServed = c.handshakesServed.Load()
	t.HandshakeFailures = c.handshakeFailures.Load()
	t.SideChannelDrops = c.sideChannelDrops.Load()
	t.DeferExpired = c.deferExpired.Load()
	t.KVWaitTimeouts = c.kvWaitTimeouts.Load()
	t.KVDigestMismatch = c.kvDigestMismatch.Load()
	t.KVGarbage = c.kvGarbage.Load()
	t.ReadsUnmatched = c.readsUnmatched.Load()
	t.ProtocolViolations = c.protocolViolations.Load()
	s.RegistrationsSent = c.registrationsSent.Load()
	s.ProfileStarts = c.profileStarts.Load()
	s.ProfileStops = c.profileStops.Load()
	s.PromptTokens = c.promptTokens.Load()
	s.GenerationTokens = c.generationTokens.Load()
	c.mu.Lock()
	t.LastProtocolViolation = c.lastViolation
	s.LastRequestID = c.lastRequestID
	s.LastDPRankHeader = c.lastDPRank
	s.LastKVParams = make(map[string]json.RawMessage, len(c.lastKVParams))
	for k, v := range c.lastKVParams {
		s.LastKVParams[k] = v
	}
	s.LastSideChannel = make(map[string]int, len(c.lastNotifyPort))
	for k, v := range c.lastNotifyPort {
		s.LastSideChannel[k] = v
	}
	c.mu.Unlock()
	s.Faults = in.faults.snapshot(in.heartbeatOn.Load())
	return s
}

func (f FaultsJSON) String() string {
	b, _ := json.Marshal(f)
	return string(b)
}

// enter counts a generation request in flight and raises the peak; the
// caller defers the returned func, which counts it out.
func (c *counters) enter() func() {
	n := c.inflight.Add(1)
	for p := c.peakInflight.Load(); n > p && !c.peakInflight.CompareAndSwap(p, n); p = c.peakInflight.Load() {
	}
	return func() { c.inflight.Add(-1) }
}
