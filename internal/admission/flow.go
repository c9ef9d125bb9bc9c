package admission

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/metrics"
)

// Flow control (--flow-control) replaces the Limiter's single FIFO with a
// Scheduler:
//
//   - Priority bands, named and configured. A higher band is always
//     dispatched before a lower one; within a band requests are ordered by
//     arrival, or by deadline (earliest first) with OrderByDeadline.
//   - Weighted fair sharing between the flows (tenants) of one band: start-
//     time fair queueing over request counts. A flow that sends ten times
//     more requests does not get ten times the slots; a flow of weight 2
//     gets twice the share of a flow of weight 1 while both are backlogged.
//     A flow that was idle re-enters at the band's virtual time, so it banks
//     no credit.
//   - A full queue sheds the lowest band first: a newcomer of a higher band
//     evicts the newest request of the largest flow of the lowest non-empty
//     band below it (ErrShed, 429); with none below, a newcomer whose flow
//     holds a smaller (weighted) share of its band's queue than the largest
//     flow evicts that flow's newest request (ErrShedFair, 429), so a heavy
//     tenant cannot fill the queue against a light one; otherwise the
//     newcomer is refused (ErrQueueFull, 429).
//   - The wait is bounded by the band's queue timeout (ErrQueueTimeout, 408)
//     and by the request's own deadline (ErrDeadline, 504), whichever is
//     first. A caller whose context ends leaves the queue at once.
//   - A Gate (the saturation detector) may hold dispatch while every
//     candidate worker is saturated; Kick re-evaluates it.
//
// The same invariants as the FIFO hold: a release frees its slot exactly
// once, a waiter that gives up never holds a slot, Close fails every waiter.

// Flow-control errors (Status maps them).
var (
	ErrShed     = fmt.Errorf("%w: shed to make room for a higher-priority request", ErrQueueFull)
	ErrShedFair = fmt.Errorf("%w: shed to make room for a request of a flow with a smaller share of the queue", ErrQueueFull)
	ErrDeadline = errors.New("the request deadline passed while it was queued")
)

// Band configures one priority band.
type Band struct {
	Name string
	// Priority orders the bands: higher values are dispatched first (the
	// Gateway API InferenceObjective convention).
	Priority int
	// QueueTimeout bounds a request's wait in this band; <= 0 waits until
	// the request's deadline or its client leaves.
	QueueTimeout time.Duration
	// Order within the band: OrderArrival, OrderDeadline, or "" for
	// SchedulerConfig.OrderByDeadline.
	Order string
}

// Orders within a band.
const (
	OrderArrival  = "arrival"
	OrderDeadline = "deadline"
)

// FlowRequest is one request's flow-control attributes.
type FlowRequest struct {
	Band     int       // index into SchedulerConfig.Bands
	Flow     string    // fairness id ("" = the default flow)
	Deadline time.Time // zero = none
}

// SchedulerConfig configures a Scheduler.
type SchedulerConfig struct {
	Bands           []Band
	MaxConcurrent   int // <= 0: no slot limit (the gate still applies)
	QueueSize       int // requests waiting in all bands together
	OrderByDeadline bool
	// Headroom is the number of slots (of MaxConcurrent and of the gate's
	// in-flight capacity) only the highest band may use: a lower band is
	// dispatched only while Headroom more slots would still be free, so a
	// high-band request finds a slot at once instead of waiting for one to
	// end. 0 = work-conserving (any band may take the last slot).
	Headroom int
	// Weights of flows by id; absent flows weigh 1.
	Weights map[string]float64
	// Gate reports whether another request may be dispatched now, given
	// the slots in use and whether it is of the highest band. nil =
	// always. It is called with the scheduler's lock held and must not
	// call back into the scheduler.
	Gate func(inUse int, top bool) bool
	// MaxFlowLabels bounds the per-flow metric labels (others are "other");
	// 0 → 32.
	MaxFlowLabels int
	Metrics       *metrics.Metrics
}

// Scheduler is the flow-control queue. Build it with NewScheduler.
type Scheduler struct {
	c      SchedulerConfig
	bands  []*band // by priority, highest first
	byIdx  []*band // by SchedulerConfig.Bands index
	labels flowLabels
	// free is releaseSlot as a func value, made once (no allocation per
	// admitted request).
	free func()

	mu     sync.Mutex
	inUse  int
	queued int
	seq    uint64
	closed bool
}

type band struct {
	cfg    Band
	flows  map[string]*flowQ // non-empty flows only
	vnow   float64           // start tag of the last dispatch
	queued int
	gauge  func(float64)
	wait   prometheus.Observer
	// byDeadline orders each flow's requests by deadline, else arrival
	byDeadline bool
}

type flowQ struct {
	id     string
	weight float64
	vt     float64 // virtual finish tag of its last dispatch
	items  itemHeap
	series *flowSeries // its metrics (bounded labels)
}

type item struct {
	ready    chan struct{} // closed when granted or failed (under mu)
	granted  bool
	err      error
	band     *band
	flow     *flowQ
	seq      uint64
	enq      time.Time
	deadline time.Time // zero = none
	index    int       // in flow.items; -1 once removed
}

// NewScheduler builds a Scheduler; Bands must not be empty.
func NewScheduler(c SchedulerConfig) (*Scheduler, error) {
	if len(c.Bands) == 0 {
		return nil, errors.New("flow control needs at least one band")
	}
	if c.MaxFlowLabels <= 0 {
		c.MaxFlowLabels = 32
	}
	s := &Scheduler{c: c, labels: flowLabels{max: c.MaxFlowLabels, m: c.Metrics, seen: map[string]*flowSeries{}}}
	s.free = s.releaseSlot
	names := map[string]bool{}
	for _, b := range c.Bands {
		if b.Name == "" || names[b.Name] {
			return nil, fmt.Errorf("flow control: band names must be unique and non-empty (%q)", b.Name)
		}
		names[b.Name] = true
		nb := &band{cfg: b, flows: map[string]*flowQ{}, byDeadline: c.OrderByDeadline}
		switch b.Order {
		case "":
		case OrderArrival:
			nb.byDeadline = false
		case OrderDeadline:
			nb.byDeadline = true
		default:
			return nil, fmt.Errorf("flow control: band %q: unknown order %q (want arrival or deadline)", b.Name, b.Order)
		}
		if c.Metrics != nil {
			g := c.Metrics.FlowQueueDepth.WithLabelValues(b.Name)
			nb.gauge = g.Set
			g.Set(0)
			nb.wait = c.Metrics.FlowQueueWait.WithLabelValues(b.Name)
		}
		s.byIdx = append(s.byIdx, nb)
	}
	s.bands = append([]*band(nil), s.byIdx...)
	sort.SliceStable(s.bands, func(i, j int) bool { return s.bands[i].cfg.Priority > s.bands[j].cfg.Priority })
	return s, nil
}

// Acquire admits one request as the FIFO's Acquire does, in flow order.
func (s *Scheduler) Acquire(ctx context.Context, r FlowRequest) (release func(), err error) {
	free, err := s.acquire(ctx, r)
	if err != nil {
		return nil, err
	}
	return sync.OnceFunc(free), nil
}

// acquire is Acquire with a release to call exactly once (s.free).
func (s *Scheduler) acquire(ctx context.Context, r FlowRequest) (free func(), err error) {
	if r.Band < 0 || r.Band >= len(s.byIdx) {
		return nil, fmt.Errorf("flow control: band index %d out of range", r.Band)
	}
	b := s.byIdx[r.Band]
	now := time.Now()
	if !r.Deadline.IsZero() && !now.Before(r.Deadline) {
		s.reject(b, "deadline")
		return nil, ErrDeadline
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.reject(b, "shutting_down")
		return nil, ErrClosed
	}
	if s.queued == 0 && s.canDispatch(b) {
		s.inUse++
		s.mu.Unlock()
		s.observeWait(b, r.Flow, 0, false)
		return s.free, nil
	}
	if s.queued >= s.c.QueueSize {
		victim, why := s.victimFor(b, r.Flow)
		if victim == nil {
			s.mu.Unlock()
			s.reject(b, "queue_full")
			return nil, ErrQueueFull
		}
		s.removeLocked(victim)
		victim.err = why
		close(victim.ready)
	}
	it := s.enqueueLocked(b, r, now)
	s.dispatchLocked() // the gate may have opened with nobody to kick it
	s.mu.Unlock()
	return s.wait(ctx, it, r)
}

// canDispatch reports whether a slot is free for band b and the gate open;
// the caller holds mu.
func (s *Scheduler) canDispatch(b *band) bool {
	used, top := s.inUse, b == s.bands[0]
	if !top {
		used += s.c.Headroom
	}
	if s.c.MaxConcurrent > 0 && used >= s.c.MaxConcurrent {
		return false
	}
	return s.c.Gate == nil || s.c.Gate(used, top)
}

// head returns the highest non-empty band; the caller holds mu.
func (s *Scheduler) head() *band {
	for _, b := range s.bands {
		if b.queued > 0 {
			return b
		}
	}
	return nil
}

func (s *Scheduler) enqueueLocked(b *band, r FlowRequest, now time.Time) *item {
	f := b.flows[r.Flow]
	if f == nil {
		w := s.c.Weights[r.Flow]
		if w <= 0 {
			w = 1
		}
		// A flow (re)entering starts at the band's virtual time: no credit
		// banked while idle.
		f = &flowQ{id: r.Flow, weight: w, vt: b.vnow, series: s.labels.of(r.Flow)}
		b.flows[r.Flow] = f
	}
	s.seq++
	it := &item{ready: make(chan struct{}), band: b, flow: f, seq: s.seq, enq: now, deadline: r.Deadline}
	f.items.byDeadline = b.byDeadline
	heap.Push(&f.items, it)
	b.queued++
	s.queued++
	s.publishDepth(b)
	s.flowDepth(f, 1)
	return it
}

// removeLocked takes a queued item out of its flow; the caller holds mu.
func (s *Scheduler) removeLocked(it *item) {
	if it.index < 0 {
		return
	}
	f, b := it.flow, it.band
	heap.Remove(&f.items, it.index)
	if f.items.Len() == 0 && b.flows[f.id] == f {
		delete(b.flows, f.id)
	}
	b.queued--
	s.queued--
	s.publishDepth(b)
	s.flowDepth(f, -1)
}

// victimFor picks the request to shed for a newcomer of band nb and flow
// id: the newest request of the largest flow of the lowest non-empty band
// below nb (ErrShed); else, in nb itself, the newest request of the flow
// with the largest weighted share of the queue when the newcomer's flow,
// with the newcomer, would still hold less (ErrShedFair); else nil.
func (s *Scheduler) victimFor(nb *band, id string) (*item, error) {
	for i := len(s.bands) - 1; i >= 0; i-- {
		b := s.bands[i]
		if b.cfg.Priority >= nb.cfg.Priority {
			break
		}
		if b.queued > 0 {
			return newestOf(b.largestFlow(false)), ErrShed
		}
	}
	if nb.queued == 0 {
		return nil, nil
	}
	big := nb.largestFlow(true)
	if big == nil || big.id == id {
		return nil, nil
	}
	mine := 1.0 // the newcomer
	w := s.c.Weights[id]
	if w <= 0 {
		w = 1
	}
	if f := nb.flows[id]; f != nil {
		mine += float64(f.items.Len())
	}
	if mine/w >= float64(big.items.Len())/big.weight {
		return nil, nil
	}
	return newestOf(big), ErrShedFair
}

// largestFlow is the flow with the most queued requests (divided by its
// weight when weighted); ties go by flow id.
func (b *band) largestFlow(weighted bool) *flowQ {
	var big *flowQ
	var bigN float64
	for _, f := range b.flows {
		n := float64(f.items.Len())
		if weighted {
			n /= f.weight
		}
		if big == nil || n > bigN || (n == bigN && f.id < big.id) {
			big, bigN = f, n
		}
	}
	return big
}

func newestOf(f *flowQ) *item {
	var newest *item
	for _, it := range f.items.items {
		if newest == nil || it.seq > newest.seq {
			newest = it
		}
	}
	return newest
}

// next pops the item to dispatch: highest non-empty band, then the flow
// with the smallest virtual finish tag; the caller holds mu.
func (s *Scheduler) next() *item {
	for _, b := range s.bands {
		if b.queued == 0 {
			continue
		}
		var best *flowQ
		var bestTag float64
		for _, f := range b.flows {
			tag := f.vt + 1/f.weight
			if best == nil || tag < bestTag || (tag == bestTag && f.items.items[0].seq < best.items.items[0].seq) {
				best, bestTag = f, tag
			}
		}
		it := best.items.items[0]
		b.vnow = best.vt
		best.vt = bestTag
		s.removeLocked(it)
		return it
	}
	return nil
}

// dispatchLocked grants queued requests while slots are free and the gate
// is open; the caller holds mu.
func (s *Scheduler) dispatchLocked() {
	for s.queued > 0 && !s.closed && s.canDispatch(s.head()) {
		it := s.next()
		it.granted = true
		s.inUse++
		close(it.ready)
	}
}

// Top reports whether band index i is the highest band.
func (s *Scheduler) Top(i int) bool { return i >= 0 && i < len(s.byIdx) && s.byIdx[i] == s.bands[0] }

// Kick re-evaluates the gate (the saturation state changed).
func (s *Scheduler) Kick() {
	s.mu.Lock()
	s.dispatchLocked()
	s.mu.Unlock()
}

func (s *Scheduler) wait(ctx context.Context, it *item, r FlowRequest) (func(), error) {
	limit, limitErr := time.Time{}, error(nil)
	if t := it.band.cfg.QueueTimeout; t > 0 {
		limit, limitErr = it.enq.Add(t), ErrQueueTimeout
	}
	if !r.Deadline.IsZero() && (limit.IsZero() || r.Deadline.Before(limit)) {
		limit, limitErr = r.Deadline, ErrDeadline
	}
	var expired <-chan time.Time
	if !limit.IsZero() {
		t := time.NewTimer(time.Until(limit))
		defer t.Stop()
		expired = t.C
	}
	var err error
	select {
	case <-it.ready:
	case <-ctx.Done():
		err = ctx.Err()
	case <-expired:
		err = limitErr
	}
	s.mu.Lock()
	if err != nil {
		select {
		case <-it.ready: // granted or failed in the same instant
		default:
			s.removeLocked(it)
		}
	}
	granted, werr := it.granted, it.err
	s.mu.Unlock()
	s.observeWait(it.band, r.Flow, time.Since(it.enq), true)

	switch {
	case err == nil && werr == nil:
		return s.free, nil
	case err == nil:
		s.reject(it.band, reasonOf(werr))
		return nil, werr
	}
	if granted {
		s.releaseSlot() // hand the slot we no longer want on
	}
	s.reject(it.band, reasonOf(err))
	return nil, err
}

func reasonOf(err error) string {
	switch {
	case errors.Is(err, ErrShed):
		return "shed"
	case errors.Is(err, ErrShedFair):
		return "shed_fairness"
	case errors.Is(err, ErrQueueTimeout):
		return "queue_timeout"
	case errors.Is(err, ErrDeadline):
		return "deadline"
	case errors.Is(err, ErrClosed):
		return "shutting_down"
	}
	return "client_gone"
}

func (s *Scheduler) releaseSlot() {
	s.mu.Lock()
	s.inUse--
	s.dispatchLocked()
	s.mu.Unlock()
}

// Close fails every queued request and all later Acquire calls with
// ErrClosed.
func (s *Scheduler) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	s.closed = true
	for _, b := range s.bands {
		for _, f := range b.flows {
			s.flowDepth(f, -float64(f.items.Len()))
			for _, it := range f.items.items {
				it.err = ErrClosed
				it.index = -1
				close(it.ready)
			}
		}
		clear(b.flows)
		b.queued = 0
		s.publishDepth(b)
	}
	s.queued = 0
}

// InUse returns the granted slots not yet released.
func (s *Scheduler) InUse() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.inUse
}

// Queued returns the number of waiting requests.
func (s *Scheduler) Queued() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.queued
}

// BandQueued returns the waiting requests per band name.
func (s *Scheduler) BandQueued() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.bands))
	for _, b := range s.bands {
		out[b.cfg.Name] = b.queued
	}
	return out
}

// publishDepth publishes band b's and the total queue length; the caller
// holds mu.
func (s *Scheduler) publishDepth(b *band) {
	if s.c.Metrics == nil {
		return
	}
	b.gauge(float64(b.queued))
	s.c.Metrics.QueueDepth.Set(float64(s.queued))
}

func (s *Scheduler) flowDepth(f *flowQ, d float64) {
	if f.series != nil {
		f.series.depth.Add(d)
	}
}

// observeWait records a wait in the band and flow histograms, and, for a
// request that was queued, in the FIFO's vllm_router_queue_wait_seconds
// (which, as without flow control, counts queued requests only).
func (s *Scheduler) observeWait(b *band, flow string, d time.Duration, queued bool) {
	if m := s.c.Metrics; m != nil {
		if queued {
			m.QueueWait.Observe(d.Seconds())
		}
		b.wait.Observe(d.Seconds())
		s.labels.of(flow).wait.Observe(d.Seconds())
	}
}

func (s *Scheduler) reject(b *band, reason string) {
	if m := s.c.Metrics; m != nil {
		m.FlowShed.WithLabelValues(b.cfg.Name, reason).Inc()
		if reason != "client_gone" {
			m.AdmissionReject.WithLabelValues(reason).Inc()
		}
	}
}

// DefaultFlow is the fairness id of requests that carry none (llm-d's
// default-flow).
const DefaultFlow = "default-flow"

// flowLabels bounds the per-flow metric label set: the first max flows
// seen keep their id, later ones share "other".
type flowLabels struct {
	mu    sync.Mutex
	max   int
	m     *metrics.Metrics
	seen  map[string]*flowSeries
	other *flowSeries
}

type flowSeries struct {
	depth prometheus.Gauge
	wait  prometheus.Observer
}

// of returns flow's series, nil without metrics.
func (l *flowLabels) of(flow string) *flowSeries {
	if l.m == nil {
		return nil
	}
	if flow == "" {
		flow = DefaultFlow
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if fs, ok := l.seen[flow]; ok {
		return fs
	}
	label := flow
	if len(l.seen) >= l.max {
		if l.other != nil {
			return l.other
		}
		label = "other"
	}
	fs := &flowSeries{depth: l.m.FlowFlowDepth.WithLabelValues(label), wait: l.m.FlowFlowWait.WithLabelValues(label)}
	if label == "other" {
		l.other = fs
	} else {
		l.seen[flow] = fs
	}
	return fs
}

// itemHeap orders one flow's requests by arrival, or by deadline first
// (requests without one after those with one, by arrival).
type itemHeap struct {
	items      []*item
	byDeadline bool
}

func (h *itemHeap) Len() int { return len(h.items) }
func (h *itemHeap) Less(i, j int) bool {
	a, b := h.items[i], h.items[j]
	if h.byDeadline && !a.deadline.Equal(b.deadline) {
		switch {
		case a.deadline.IsZero():
			return false
		case b.deadline.IsZero():
			return true
		}
		return a.deadline.Before(b.deadline)
	}
	return a.seq < b.seq
}
func (h *itemHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].index, h.items[j].index = i, j
}
func (h *itemHeap) Push(x any) {
	it := x.(*item)
	it.index = len(h.items)
	h.items = append(h.items, it)
}
func (h *itemHeap) Pop() any {
	n := len(h.items) - 1
	it := h.items[n]
	h.items[n] = nil
	h.items = h.items[:n]
	it.index = -1
	return it
}
