// Package engine is the behavioural model of one vLLM engine (one DP rank):
// a step-driven continuous-batching scheduler with max_num_seqs slots, a KV
// block pool, a per-step token budget, FCFS or priority admission (vLLM's
// --scheduling-policy), recompute preemption,
// requests that wait for remote KV (PD decode), requests whose blocks stay
// pinned after they finish (PD prefill), and a serial transfer Link.
//
// Invariants:
//   - One goroutine (Run) drives all steps; there is no goroutine per request
//     or per token. A step's duration is slept on a single timer.
//   - Everything reads time through the time package, so unit tests run the
//     engine under testing/synctest with exact virtual time.
//   - State is guarded by one mutex. Callbacks (OnAdmit, OnForward) run on the
//     Run goroutine outside the lock and must not block.
//   - Handles publish progress through a counter and a 1-buffered notify
//     channel: the engine never blocks on a slow consumer, and a consumer that
//     wakes late still sees every token (it reads the counter).
package engine

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"
)

// FinishReason says why a request stopped.
type FinishReason int

const (
	// NotFinished means the request is still in progress.
	NotFinished FinishReason = iota
	// FinishLength means max_tokens was reached.
	FinishLength
	// FinishStop means EOS was sampled.
	FinishStop
	// FinishAbort means the request was aborted (client disconnect).
	FinishAbort
	// FinishError means the request failed (Fail was called).
	FinishError
)

func (r FinishReason) String() string {
	switch r {
	case FinishLength:
		return "length"
	case FinishStop:
		return "stop"
	case FinishAbort:
		return "abort"
	case FinishError:
		return "error"
	}
	return ""
}

// maxCatchUp bounds how late a step may start and still be backdated to the
// previous step's simulated end.
const maxCatchUp = 5 * time.Millisecond

// ErrQueueFull is returned by Submit when the waiting queue is at its limit.
var ErrQueueFull = errors.New("engine: waiting queue full")

// ErrTooLarge is returned by Submit when a request could never fit the
// block pool.
var ErrTooLarge = errors.New("engine: request needs more KV blocks than the engine has")

// ErrClosed is returned by Submit after Run has returned.
var ErrClosed = errors.New("engine: closed")

// Request describes one generation request.
type Request struct {
	ID           string
	PromptTokens int
	// Priority is vLLM's request priority: with PolicyPriority lower values
	// are scheduled first and preempted last. Ignored under FCFS.
	Priority  int
	MaxTokens int
	// Tokens are the prompt's token ids (len PromptTokens). Optional: a
	// request without them takes no part in prefix caching.
	Tokens []uint32
	// CacheSalt is vLLM's cache_salt ("" for none): part of the hash of the
	// request's first block, so requests share cached blocks only with
	// requests of the same salt.
	CacheSalt string
	// LoRA is the LoRA adapter the request names ("" for the base model),
	// LoRAID its id (vLLM's lora_int_id): the request's blocks are keyed
	// with the name (see FirstLoRABlockHash) and its events carry both.
	LoRA   string
	LoRAID int
	// ReportCachedBlocks is vLLM 0.32's kv_cache_report_mode "full"
	// (sampling_params.extra_args, sent as vllm_xargs): each prefix-cache
	// lookup that finds cached blocks for the request also publishes a
	// BlockStored event for those reused blocks (see reportHits).
	ReportCachedBlocks bool
	// OutputToken returns the id of generated token i (its blocks are
	// cached as they fill). Optional.
	OutputToken func(i int) uint32
	// EOS reports whether the token at index i is EOS. Optional.
	EOS func(i int) bool
	// RemoteKV: after admission the request holds its slot and blocks and
	// waits (WAITING_FOR_REMOTE_KVS) until Handle.KVReady.
	RemoteKV bool
	// KeepBlocks: on finish the blocks stay pinned until Handle.Release.
	KeepBlocks bool
	// ForwardNotBefore delays the compute of any step that carries this
	// request (P's handshake wait).
	ForwardNotBefore time.Time
	// OnAdmit runs once, right after blocks are first allocated.
	OnAdmit func(h *Handle)
	// OnForward runs for the step that computes the request's last prompt
	// chunk, with the compute start and compute duration of that step.
	OnForward func(h *Handle, computeStart time.Time, compute time.Duration)
}

type state int

const (
	stQueued state = iota
	stRemoteWait
	stRunning
	stPinned // finished, blocks kept
	stDone
)

// Handle tracks one submitted request.
type Handle struct {
	e      *Engine
	req    *Request
	notify chan struct{}

	// guarded by e.mu
	st           state
	blocks       []int32
	computed     int // tokens whose KV exists
	generated    int
	kvArrived    bool
	loadPending  time.Duration
	admitted     bool
	admitBlocks  []int // the blocks of the first allocation (AdmittedBlocks)
	releaseEarly bool  // Release came before the finish: do not pin
	reason       FinishReason
	err          error
	stepSeq      uint64 // step in which it was last scheduled
	arrival      uint64 // Submit order: vLLM's arrival_time tie-break
	pc           handlePrefix
}

// Progress is a snapshot of a request's state.
type Progress struct {
	Generated int
	Admitted  bool
	Finished  bool
	Reason    FinishReason
	Err       error
}

// Engine is one simulated vLLM engine core.
type Engine struct {
	p          Params
	slowBits   atomic.Uint64 // float64 bits of the slow factor
	maxWaiting atomic.Int64

	mu       sync.Mutex
	closed   bool
	pool     blockPool
	waiting  []*Handle
	remote   []*Handle // admitted, waiting for KV
	running  []*Handle
	pinned   int
	readerAt time.Time // the engine's serial KV reader is busy until then
	lastEnd  time.Time // simulated end of the previous step
	stepSeq  uint64
	arrivals uint64
	wake     chan struct{}

	stats counters
	pc    engineCache
}

type counters struct {
	steps          uint64
	tokens         uint64
	prefillTokens  uint64
	preemptions    uint64
	finishedLength uint64
	finishedStop   uint64
	aborted        uint64
	failed         uint64
}

// New returns an engine; call Run to drive it.
func New(p Params) *Engine {
	e := &Engine{p: p, wake: make(chan struct{}, 1)}
	e.pool = newBlockPool(p.NumBlocks, p.PrefixCaching)
	e.SetSlowFactor(1)
	return e
}

// Params returns the engine's parameters.
func (e *Engine) Params() Params { return e.p }

// SetSlowFactor multiplies every following step's compute time by f (>0).
func (e *Engine) SetSlowFactor(f float64) {
	if f <= 0 {
		f = 1
	}
	e.slowBits.Store(floatBits(f))
}

// SlowFactor returns the current slow factor.
func (e *Engine) SlowFactor() float64 { return bitsFloat(e.slowBits.Load()) }

// SetMaxWaiting makes Submit fail with ErrQueueFull while n requests are
// queued (0 = unbounded).
func (e *Engine) SetMaxWaiting(n int) { e.maxWaiting.Store(int64(n)) }

// Submit queues a request (by arrival, or by priority then arrival).
func (e *Engine) Submit(req *Request) (*Handle, error) {
	if req.MaxTokens < 1 {
		req.MaxTokens = 1
	}
	need := e.p.BlocksFor(req.PromptTokens + req.MaxTokens)
	if need > e.p.NumBlocks {
		return nil, ErrTooLarge
	}
	if req.Tokens != nil && len(req.Tokens) != req.PromptTokens {
		return nil, fmt.Errorf("engine: request %s has %d token ids for %d prompt tokens", req.ID, len(req.Tokens), req.PromptTokens)
	}
	h := &Handle{e: e, req: req, notify: make(chan struct{}, 1)}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil, ErrClosed
	}
	if mw := e.maxWaiting.Load(); mw > 0 && int64(len(e.waiting)) >= mw {
		e.mu.Unlock()
		return nil, ErrQueueFull
	}
	e.arrivals++
	h.arrival = e.arrivals
	e.enqueue(h)
	e.mu.Unlock()
	e.kick()
	return h, nil
}

// before orders requests as vLLM's priority queue does: by (priority,
// arrival).
func before(a, b *Handle) bool {
	if a.req.Priority != b.req.Priority {
		return a.req.Priority < b.req.Priority
	}
	return a.arrival < b.arrival
}

// enqueue adds a new request to the waiting queue: at the tail (FCFS), or
// at its (priority, arrival) place. Called with e.mu held.
func (e *Engine) enqueue(h *Handle) {
	if !e.p.Priority() {
		e.waiting = append(e.waiting, h)
		return
	}
	i := sort.Search(len(e.waiting), func(i int) bool { return before(h, e.waiting[i]) })
	e.waiting = slices.Insert(e.waiting, i, h)
}

// victim is the running request vLLM preempts when blocks run out: the
// last admitted (FCFS), or the one with the largest (priority, arrival).
// Called with e.mu held and e.running non-empty.
func (e *Engine) victim() int {
	v := len(e.running) - 1
	if e.p.Priority() {
		for i, h := range e.running {
			if before(e.running[v], h) {
				v = i
			}
		}
	}
	return v
}

func (e *Engine) kick() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Updates is signalled (coalesced) whenever the request makes progress.
func (h *Handle) Updates() <-chan struct{} { return h.notify }

// ID returns the request id.
func (h *Handle) ID() string { return h.req.ID }

// Request returns the submitted request.
func (h *Handle) Request() *Request { return h.req }

func (h *Handle) signal() {
	select {
	case h.notify <- struct{}{}:
	default:
	}
}

// Progress returns the current state.
func (h *Handle) Progress() Progress {
	h.e.mu.Lock()
	defer h.e.mu.Unlock()
	return Progress{
		Generated: h.generated,
		Admitted:  h.admitted,
		Finished:  h.st == stPinned || h.st == stDone,
		Reason:    h.reason,
		Err:       h.err,
	}
}

// Blocks returns a copy of the request's block ids (empty once released).
func (h *Handle) Blocks() []int {
	h.e.mu.Lock()
	defer h.e.mu.Unlock()
	return blockIDs(h.blocks)
}

// AdmittedBlocks returns the block ids of the request's first allocation,
// as the scheduler step that allocated them saw them. vLLM builds a
// connector's metadata (update_state_after_alloc) in that step, so what a
// decode announces to its prefill keeps those ids even when the request is
// aborted before the worker sends them; Blocks would be empty by then.
// Nil before admission; the slice is shared and must not be modified.
func (h *Handle) AdmittedBlocks() []int {
	h.e.mu.Lock()
	defer h.e.mu.Unlock()
	return h.admitBlocks
}

func blockIDs(blocks []int32) []int {
	out := make([]int, len(blocks))
	for i, b := range blocks {
		out[i] = int(b)
	}
	return out
}

// KVReady marks the remote KV as present. load > 0 makes the first step
// that carries the request wait for a layer-wise read of that duration
// (READ mode); recompute discards the remote KV and prefills locally.
func (h *Handle) KVReady(load time.Duration, recompute bool) {
	e := h.e
	e.mu.Lock()
	if h.kvArrived || h.st == stPinned || h.st == stDone {
		e.mu.Unlock()
		return
	}
	h.kvArrived = true
	if recompute {
		h.computed = h.pc.hitTokens // its own cached prefix stays valid
	} else {
		h.computed = h.req.PromptTokens - 1
		h.loadPending = load
	}
	e.mu.Unlock()
	e.kick()
}

// Fail finishes the request with err, freeing its blocks.
func (h *Handle) Fail(err error) {
	h.finishExternal(FinishError, err)
}

// Abort finishes the request as aborted (client gone), freeing its blocks.
// Pinned blocks of a finished request are not touched; use Release.
func (h *Handle) Abort() {
	h.finishExternal(FinishAbort, nil)
}

func (h *Handle) finishExternal(reason FinishReason, err error) {
	e := h.e
	e.mu.Lock()
	switch h.st {
	case stPinned, stDone:
		e.mu.Unlock()
		return
	case stQueued:
		e.waiting = removeHandle(e.waiting, h)
	case stRemoteWait:
		e.remote = removeHandle(e.remote, h)
	case stRunning:
		e.running = removeHandle(e.running, h)
	}
	e.pool.release(h.blocks)
	h.blocks = nil
	h.st = stDone
	h.reason = reason
	h.err = err
	if reason == FinishAbort {
		e.stats.aborted++
	} else {
		e.stats.failed++
	}
	e.mu.Unlock()
	h.signal()
	e.kick()
}

// Release frees the blocks of a finished request that kept them. Called
// before the request finished (a transfer can complete a moment before the
// step that produced it is applied), it makes the finish free the blocks
// instead of pinning them. It reports whether blocks were released now.
func (h *Handle) Release() bool {
	e := h.e
	e.mu.Lock()
	if h.st != stPinned {
		if h.st != stDone {
			h.releaseEarly = true
		}
		e.mu.Unlock()
		return false
	}
	e.pool.release(h.blocks)
	h.blocks = nil
	h.st = stDone
	e.pinned--
	e.mu.Unlock()
	e.kick()
	return true
}

func removeHandle(s []*Handle, h *Handle) []*Handle {
	for i, x := range s {
		if x == h {
			copy(s[i:], s[i+1:])
			s[len(s)-1] = nil
			return s[:len(s)-1]
		}
	}
	return s
}

// Snapshot is a point-in-time view of the engine.
type Snapshot struct {
	Running        int    `json:"running"`
	Waiting        int    `json:"waiting"`
	WaitingRemote  int    `json:"waiting_for_remote_kv"`
	PinnedFinished int    `json:"pinned_finished"`
	BlocksUsed     int    `json:"kv_blocks_used"`
	BlocksTotal    int    `json:"kv_blocks_total"`
	Steps          uint64 `json:"steps"`
	Tokens         uint64 `json:"generated_tokens"`
	PrefillTokens  uint64 `json:"prefill_tokens"`
	Preemptions    uint64 `json:"preemptions"`
	FinishedLength uint64 `json:"finished_length"`
	FinishedStop   uint64 `json:"finished_stop"`
	Aborted        uint64 `json:"aborted"`
	Failed         uint64 `json:"failed"`
}

// WaitingIDs returns the ids of the waiting requests in the order they will
// be scheduled.
func (e *Engine) WaitingIDs() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	ids := make([]string, len(e.waiting))
	for i, h := range e.waiting {
		ids[i] = h.req.ID
	}
	return ids
}

// Snapshot returns the engine's counters and occupancy.
func (e *Engine) Snapshot() Snapshot {
	e.mu.Lock()
	defer e.mu.Unlock()
	return Snapshot{
		Running:        len(e.running),
		Waiting:        len(e.waiting),
		WaitingRemote:  len(e.remote),
		PinnedFinished: e.pinned,
		BlocksUsed:     e.pool.used,
		BlocksTotal:    e.pool.total,
		Steps:          e.stats.steps,
		Tokens:         e.stats.tokens,
		PrefillTokens:  e.stats.prefillTokens,
		Preemptions:    e.stats.preemptions,
		FinishedLength: e.stats.finishedLength,
		FinishedStop:   e.stats.finishedStop,
		Aborted:        e.stats.aborted,
		Failed:         e.stats.failed,
	}
}

type entry struct {
	h        *Handle
	n        int  // tokens computed in this step
	decode   bool // a one-token step of a sequence whose prompt is done
	lastFill bool // this step computes the last prompt chunk
}

// newEntry classifies a scheduled chunk. A one-token chunk that completes the
// sequence (a decode, or D's local recompute of the last prompt token) costs
// a decode slot; anything else is prefill.
func newEntry(h *Handle, n, total int) entry {
	return entry{
		h:        h,
		n:        n,
		decode:   n == 1 && h.computed+1 == total,
		lastFill: h.computed < h.req.PromptTokens && h.computed+n >= h.req.PromptTokens,
	}
}

type hook struct {
	admit   *Handle
	forward *Handle
}

// Run drives the engine until ctx is done. Queued and running requests are
// then failed with ErrClosed.
func (e *Engine) Run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var hooks []hook
	var batch []entry
	for {
		now := time.Now()
		e.mu.Lock()
		batch, hooks = e.schedule(batch[:0], hooks[:0])
		if len(batch) == 0 {
			e.lastEnd = time.Time{} // idle: the next step starts when it starts
			sink, evs := e.takeEvents()
			e.mu.Unlock()
			publish(sink, evs)
			e.runHooks(hooks, time.Time{}, 0)
			select {
			case <-ctx.Done():
				e.shutdown()
				return
			case <-e.wake:
			}
			continue
		}
		e.stepSeq++
		seq := e.stepSeq
		nDecode, pTok, quad := 0, 0, 0.0
		// Back-to-back steps chain on the simulated end of the previous
		// one, so timer wake-up latency does not accumulate into TPOT.
		if lag := now.Sub(e.lastEnd); !e.lastEnd.IsZero() && lag > 0 && lag < maxCatchUp {
			now = e.lastEnd
		}
		computeStart := now
		for _, en := range batch {
			en.h.stepSeq = seq
			if en.decode {
				nDecode++
			} else {
				pTok += en.n
				s, f := float64(en.h.computed), float64(en.h.computed+en.n)
				quad += f*f - s*s
			}
			if nb := en.h.req.ForwardNotBefore; nb.After(computeStart) {
				computeStart = nb
			}
		}
		compute := e.p.StepTime(nDecode) + e.p.prefillStep(pTok, quad)
		compute = time.Duration(float64(compute) * e.SlowFactor())
		end := computeStart.Add(compute)
		layer := compute / time.Duration(max(e.p.NumLayers, 1))
		for _, en := range batch {
			if en.h.loadPending > 0 {
				rs := computeStart
				if e.readerAt.After(rs) {
					rs = e.readerAt
				}
				re := rs.Add(en.h.loadPending)
				e.readerAt = re
				if t := re.Add(layer); t.After(end) {
					end = t
				}
				en.h.loadPending = 0
			}
			if en.lastFill && en.h.req.OnForward != nil {
				hooks = append(hooks, hook{forward: en.h})
			}
		}
		e.lastEnd = end
		e.stats.steps++
		e.stats.prefillTokens += uint64(pTok)
		e.mu.Unlock()
		e.runHooks(hooks, computeStart, compute)

		if d := time.Until(end); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				e.shutdown()
				return
			case <-timer.C:
			}
		} else if ctx.Err() != nil {
			e.shutdown()
			return
		}
		e.complete(batch, seq)
	}
}

func (e *Engine) runHooks(hooks []hook, computeStart time.Time, compute time.Duration) {
	for _, hk := range hooks {
		if hk.admit != nil && hk.admit.req.OnAdmit != nil {
			hk.admit.req.OnAdmit(hk.admit)
		}
		if hk.forward != nil {
			hk.forward.req.OnForward(hk.forward, computeStart, compute)
		}
	}
}

// schedule builds the next step's batch (vLLM V1 order: running first, then
// the waiting queue in its order). Called with e.mu held.
func (e *Engine) schedule(batch []entry, hooks []hook) ([]entry, []hook) {
	// Requests whose remote KV arrived join the running set (they already
	// hold a slot and blocks).
	if len(e.remote) > 0 {
		kept := e.remote[:0]
		for _, h := range e.remote {
			if h.kvArrived {
				h.st = stRunning
				e.running = append(e.running, h)
			} else {
				kept = append(kept, h)
			}
		}
		for i := len(kept); i < len(e.remote); i++ {
			e.remote[i] = nil
		}
		e.remote = kept
	}

	budget := e.p.MaxNumBatchedTokens
	for i := 0; i < len(e.running) && budget > 0; i++ {
		h := e.running[i]
		total := h.req.PromptTokens + h.generated
		need := e.p.BlocksFor(total)
		scheduled := true
		for len(h.blocks) < need {
			if b, ok := e.pool.alloc(need - len(h.blocks)); ok {
				h.blocks = append(h.blocks, b...)
				break
			}
			vi := e.victim()
			victim := e.running[vi]
			e.preempt(victim)
			if victim == h {
				scheduled = false
				break
			}
			if vi < i {
				// Already scheduled in this step (priority policy only):
				// unschedule it and give its tokens back.
				i--
				batch, budget = unschedule(batch, victim, budget)
			}
		}
		if !scheduled {
			break
		}
		n := min(total-h.computed, budget)
		batch = append(batch, newEntry(h, n, total))
		e.cacheBlocks(h, h.computed+n)
		budget -= n
	}

	for len(e.waiting) > 0 {
		h := e.waiting[0]
		if len(e.running)+len(e.remote) >= e.p.MaxNumSeqs {
			break
		}
		remoteWait := h.req.RemoteKV && !h.kvArrived
		if !remoteWait && budget <= 0 {
			break
		}
		total := h.req.PromptTokens + h.generated
		if !e.admitBlocks(h, total) {
			break
		}
		e.waiting[0] = nil
		e.waiting = e.waiting[1:]
		first := !h.admitted
		h.admitted = true
		if first {
			h.admitBlocks = blockIDs(h.blocks)
			hooks = append(hooks, hook{admit: h})
		}
		if remoteWait {
			h.st = stRemoteWait
			e.remote = append(e.remote, h)
			continue
		}
		h.st = stRunning
		e.running = append(e.running, h)
		n := min(total-h.computed, budget)
		batch = append(batch, newEntry(h, n, total))
		e.cacheBlocks(h, h.computed+n)
		budget -= n
	}
	if len(e.waiting) == 0 && cap(e.waiting) > 1024 {
		e.waiting = nil
	}
	return batch, hooks
}

// unschedule drops h's entry from batch and returns its tokens to budget.
func unschedule(batch []entry, h *Handle, budget int) ([]entry, int) {
	for k, en := range batch {
		if en.h == h {
			return slices.Delete(batch, k, k+1), budget + en.n
		}
	}
	return batch, budget
}

// preempt evicts a running request back to the waiting queue (its head
// under FCFS, its (priority, arrival) place under priority, as vLLM's
// prepend_request does); its KV is dropped and recomputed on re-admission
// (vLLM recompute preemption).
func (e *Engine) preempt(h *Handle) {
	e.running = removeHandle(e.running, h)
	e.pool.release(h.blocks)
	h.blocks = nil
	h.forgetBlocks()
	h.computed = 0
	h.loadPending = 0
	h.kvArrived = true // its KV, remote or not, is now recomputed locally
	h.st = stQueued
	if e.p.Priority() {
		e.enqueue(h)
	} else {
		e.waiting = append([]*Handle{h}, e.waiting...)
	}
	e.stats.preemptions++
}

// complete applies the results of a finished step.
func (e *Engine) complete(batch []entry, seq uint64) {
	var signal []*Handle
	e.mu.Lock()
	for _, en := range batch {
		h := en.h
		if h.st != stRunning || h.stepSeq != seq {
			continue // aborted, failed or preempted meanwhile
		}
		h.computed += en.n
		total := h.req.PromptTokens + h.generated
		if h.computed < total {
			continue // partial prefill chunk
		}
		idx := h.generated
		h.generated++
		e.stats.tokens++
		signal = append(signal, h)
		var reason FinishReason
		switch {
		case h.req.EOS != nil && h.req.EOS(idx):
			reason = FinishStop
			e.stats.finishedStop++
		case h.generated >= h.req.MaxTokens:
			reason = FinishLength
			e.stats.finishedLength++
		default:
			continue
		}
		h.reason = reason
		e.running = removeHandle(e.running, h)
		if h.req.KeepBlocks && !h.releaseEarly {
			h.st = stPinned
			e.pinned++
		} else {
			e.pool.release(h.blocks)
			h.blocks = nil
			h.st = stDone
		}
	}
	sink, evs := e.takeEvents()
	e.mu.Unlock()
	publish(sink, evs)
	for _, h := range signal {
		h.signal()
	}
}

func (e *Engine) shutdown() {
	e.mu.Lock()
	e.closed = true
	var all []*Handle
	all = append(all, e.waiting...)
	all = append(all, e.remote...)
	all = append(all, e.running...)
	e.mu.Unlock()
	for _, h := range all {
		h.Fail(ErrClosed)
	}
}
