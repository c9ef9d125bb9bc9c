// Package admission bounds how much generation work the router accepts.
//
// Two independent mechanisms, unlike the Rust router's single token bucket
// that mixed them (REFERENCE §6.6, §10.4 #27):
//
//   - A concurrency limiter: MaxConcurrent slots. A slot is held by the caller
//     until it calls the release func, which the server does when the
//     response body has been fully written (the end of an SSE stream), not
//     when headers are sent. When every slot is busy, callers wait in a
//     bounded FIFO queue (QueueSize) for at most QueueTimeout. A freed slot
//     is handed directly to the oldest waiter, so order is strictly FIFO and
//     a newcomer can never overtake the queue.
//   - An optional token-bucket rate limit (RateLimitPerSecond, Burst) checked
//     before the limiter; a request over the rate is rejected at once and
//     never queued.
//
// Invariants: every successful Acquire returns a release func that frees the
// slot exactly once however often it is called; a waiter that gives up
// (timeout, client gone, shutdown) never holds a slot when Acquire returns,
// even if the slot was granted in the same instant; Close fails every queued
// waiter and all later Acquire calls with ErrClosed.
package admission

import (
	"container/list"
	"context"
	"errors"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Errors returned by Acquire. Status maps them to HTTP statuses.
var (
	ErrQueueFull    = errors.New("too many requests: the admission queue is full")
	ErrQueueTimeout = errors.New("timed out waiting for a free request slot")
	ErrRateLimited  = errors.New("rate limit exceeded")
	ErrClosed       = errors.New("the router is shutting down")
)

// Config configures a Limiter.
type Config struct {
	// MaxConcurrent is the number of requests served at once; <= 0 means no
	// concurrency limit (the rate limit still applies).
	MaxConcurrent int
	// QueueSize is how many requests may wait for a slot; 0 rejects at once
	// with ErrQueueFull when every slot is busy.
	QueueSize int
	// QueueTimeout bounds the wait in the queue; <= 0 waits until the
	// caller's context ends.
	QueueTimeout time.Duration
	// RateLimitPerSecond is the token refill rate; <= 0 disables the rate
	// limit.
	RateLimitPerSecond float64
	// Burst is the bucket capacity; <= 0 means max(1, ceil(rate)).
	Burst int
	// Metrics, when set, receives QueueDepth, QueueWait and AdmissionReject.
	Metrics *metrics.Metrics
	// Flow, when set, replaces the FIFO with the flow-control Scheduler
	// (MaxConcurrent, QueueSize and the rate limit still apply); build the
	// Limiter with NewWithFlow then.
	Flow *FlowConfig
}

// Limiter is a concurrency limiter with a FIFO queue plus an optional rate
// limit. The zero value is not usable; build one with New.
type Limiter struct {
	max     int
	qsize   int
	timeout time.Duration
	m       *metrics.Metrics
	bucket  *bucket

	mu     sync.Mutex
	inUse  int
	queue  list.List // of *waiter, oldest first
	closed bool

	// flow control (nil when off)
	flow *Scheduler
	cls  *classifier
	det  *Detector
	// enginePriority: FlowConfig.EnginePriority
	enginePriority bool
	// markTop: a prefill rule is on (Admit reports the highest band)
	markTop bool
	// free is releaseSlot as a func value, made once: a Slot holds it
	// without an allocation per request.
	free func()
}

type waiter struct {
	ready   chan struct{} // closed when granted or failed (under Limiter.mu)
	granted bool
	err     error
}

// New builds a Limiter.
func New(c Config) *Limiter {
	l := &Limiter{max: c.MaxConcurrent, qsize: max(c.QueueSize, 0), timeout: c.QueueTimeout, m: c.Metrics}
	l.free = l.releaseSlot
	if c.RateLimitPerSecond > 0 {
		burst := c.Burst
		if burst <= 0 {
			burst = max(1, int(math.Ceil(c.RateLimitPerSecond)))
		}
		l.bucket = newBucket(c.RateLimitPerSecond, burst)
	}
	l.queue.Init()
	return l
}

// NewWithFlow builds a Limiter, with flow control when c.Flow is set.
func NewWithFlow(c Config) (*Limiter, error) {
	l := New(c)
	if c.Flow == nil {
		return l, nil
	}
	cls, err := newClassifier(*c.Flow)
	if err != nil {
		return nil, err
	}
	sc := SchedulerConfig{
		Bands: c.Flow.Bands, MaxConcurrent: c.MaxConcurrent, QueueSize: l.qsize,
		OrderByDeadline: c.Flow.OrderByDeadline, Headroom: c.Flow.Headroom, Weights: c.Flow.Weights, Metrics: c.Metrics,
	}
	if c.Flow.Saturation != nil {
		sat := *c.Flow.Saturation
		if sat.Metrics == nil {
			sat.Metrics = c.Metrics
		}
		l.det = NewDetector(sat)
		sc.Gate = l.det.Open
		l.markTop = sat.AvoidPrefill || sat.IsolatePrefill || sat.PrefillReserve > 0
	}
	if l.flow, err = NewScheduler(sc); err != nil {
		return nil, err
	}
	l.cls = cls
	l.enginePriority = c.Flow.EnginePriority
	return l, nil
}

// FlowControl reports whether flow control is on.
func (l *Limiter) FlowControl() bool { return l.flow != nil }

// Admit admits one generation request: with flow control it is classified
// from its headers and parsed body (band, flow, deadline) and queued by
// the Scheduler; without, it is Acquire. An invalid flow-control header
// fails with an error wrapping ErrBadFlowRequest. top reports a request of
// the highest band when a prefill rule needs to know it (proxy.Call.Top).
func (l *Limiter) Admit(ctx context.Context, h http.Header, obj *rawjson.Object) (slot Slot, top bool, err error) {
	if l.flow == nil {
		slot.free, err = l.acquire(ctx)
		return slot, false, err
	}
	r, err := l.cls.classify(h, obj, time.Now())
	if err != nil {
		return Slot{}, false, err
	}
	if l.bucket != nil && !l.bucket.take() {
		l.reject("rate_limited")
		return Slot{}, false, ErrRateLimited
	}
	slot.free, err = l.flow.acquire(ctx, r)
	return slot, l.markTop && l.flow.Top(r.Band), err
}

// Slot is an admitted request's hold on the limiter, as Admit grants it.
// It belongs to the request's handler: one goroutine uses it.
type Slot struct {
	free func()
	done bool
}

// Release frees the slot once the response has been completely written;
// later calls do nothing, and so does the zero Slot's.
func (s *Slot) Release() {
	if !s.done && s.free != nil {
		s.done = true
		s.free()
	}
}

// EnginePriority returns the vLLM "priority" value that carries the
// request's band to the engine (FlowConfig.EnginePriority): minus the
// band's priority, as vLLM serves lower values first. ok is false when the
// option is off, the body already has a "priority" (forwarded untouched)
// or the value would be 0 (vLLM's default, nothing to add). Call it after
// Admit succeeded (the request classifies without error).
func (l *Limiter) EnginePriority(h http.Header, obj *rawjson.Object) (priority int64, ok bool) {
	if l.cls == nil || !l.enginePriority || obj == nil || obj.Has("priority") {
		return 0, false
	}
	r, err := l.cls.classify(h, obj, time.Time{})
	if err != nil {
		return 0, false
	}
	p := -int64(l.cls.bands[r.Band].Priority)
	return p, p != 0
}

// Run runs the saturation detector until ctx ends (a no-op without one).
func (l *Limiter) Run(ctx context.Context) {
	if l.det != nil {
		l.det.Run(ctx, l.flow.Kick)
	}
}

// Saturation returns w's saturation inputs, or nil without a detector.
func (l *Limiter) Saturation(w *worker.Worker) *WorkerSaturation {
	if l.det == nil {
		return nil
	}
	ws := l.det.Worker(w)
	return &ws
}

// FlowQueued returns the waiting requests per band (nil without flow control).
func (l *Limiter) FlowQueued() map[string]int {
	if l.flow == nil {
		return nil
	}
	return l.flow.BandQueued()
}

// Acquire admits one request. On success the caller must call release once
// the response has been completely written; release is idempotent. On
// failure it returns one of the package errors, or ctx.Err() when the
// caller's context ended while it was queued.
func (l *Limiter) Acquire(ctx context.Context) (release func(), err error) {
	free, err := l.acquire(ctx)
	if err != nil {
		return nil, err
	}
	return sync.OnceFunc(free), nil
}

// acquire is Acquire with a release to call exactly once (l.free).
func (l *Limiter) acquire(ctx context.Context) (free func(), err error) {
	if l.bucket != nil && !l.bucket.take() {
		l.reject("rate_limited")
		return nil, ErrRateLimited
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.reject("shutting_down")
		return nil, ErrClosed
	}
	if l.max <= 0 {
		l.inUse++
		l.mu.Unlock()
		return l.free, nil
	}
	if l.inUse < l.max && l.queue.Len() == 0 {
		l.inUse++
		l.mu.Unlock()
		return l.free, nil
	}
	if l.queue.Len() >= l.qsize {
		l.mu.Unlock()
		l.reject("queue_full")
		return nil, ErrQueueFull
	}
	w := &waiter{ready: make(chan struct{})}
	elem := l.queue.PushBack(w)
	l.setDepth()
	l.mu.Unlock()

	start := time.Now()
	var expired <-chan time.Time
	if l.timeout > 0 {
		t := time.NewTimer(l.timeout)
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-w.ready:
	case <-ctx.Done():
		err = ctx.Err()
	case <-expired:
		err = ErrQueueTimeout
	}
	l.mu.Lock()
	if err != nil {
		select {
		case <-w.ready:
			// Granted (or failed by Close) in the same instant: keep the
			// earlier outcome's bookkeeping consistent below.
		default:
			l.queue.Remove(elem)
			l.setDepth()
		}
	}
	granted, werr := w.granted, w.err
	l.mu.Unlock()
	l.observeWait(time.Since(start))

	switch {
	case err == nil && werr == nil:
		return l.free, nil
	case err == nil:
		l.reject("shutting_down")
		return nil, werr
	}
	if granted {
		l.releaseSlot() // pass the slot we no longer want to the next waiter
	}
	if errors.Is(err, ErrQueueTimeout) {
		l.reject("queue_timeout")
	}
	return nil, err
}

// releaseSlot frees one slot, handing it straight to the oldest waiter.
func (l *Limiter) releaseSlot() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.max > 0 && !l.closed {
		if front := l.queue.Front(); front != nil {
			w := l.queue.Remove(front).(*waiter)
			w.granted = true
			close(w.ready)
			l.setDepth()
			return // the slot moves to w: inUse unchanged
		}
	}
	l.inUse--
}

// Close fails every queued request and all later Acquire calls with
// ErrClosed. Slots already granted stay valid until released.
func (l *Limiter) Close() {
	if l.flow != nil {
		l.flow.Close()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return
	}
	l.closed = true
	for e := l.queue.Front(); e != nil; e = e.Next() {
		w := e.Value.(*waiter)
		w.err = ErrClosed
		close(w.ready)
	}
	l.queue.Init()
	l.setDepth()
}

// InUse returns the number of granted slots not yet released.
func (l *Limiter) InUse() int {
	if l.flow != nil {
		return l.flow.InUse()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.inUse
}

// Queued returns the number of waiting requests.
func (l *Limiter) Queued() int {
	if l.flow != nil {
		return l.flow.Queued()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.queue.Len()
}

// MaxConcurrent returns the configured slot count (<= 0 = unlimited).
func (l *Limiter) MaxConcurrent() int { return l.max }

// Status maps an Acquire error to the HTTP status the client gets:
// 429 queue full, shed or rate limited, 408 queue timeout, 504 request
// deadline passed in the queue, 400 invalid flow-control headers, 503
// shutting down, 499 (client closed request, logged only) for a cancelled
// context.
func Status(err error) int {
	switch {
	case errors.Is(err, ErrBadFlowRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrDeadline):
		return http.StatusGatewayTimeout
	case errors.Is(err, ErrQueueFull), errors.Is(err, ErrRateLimited):
		return http.StatusTooManyRequests
	case errors.Is(err, ErrQueueTimeout):
		return http.StatusRequestTimeout
	case errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return 499
	}
	return http.StatusInternalServerError
}

// setDepth publishes the queue length; the caller holds mu.
func (l *Limiter) setDepth() {
	if l.m != nil {
		l.m.QueueDepth.Set(float64(l.queue.Len()))
	}
}

func (l *Limiter) observeWait(d time.Duration) {
	if l.m != nil {
		l.m.QueueWait.Observe(d.Seconds())
	}
}

func (l *Limiter) reject(reason string) {
	if l.m != nil {
		l.m.AdmissionReject.WithLabelValues(reason).Inc()
	}
}

// bucket is a token bucket refilled continuously at rate tokens per second.
type bucket struct {
	rate float64
	cap  float64

	mu     sync.Mutex
	tokens float64
	last   time.Time
}

func newBucket(rate float64, burst int) *bucket {
	return &bucket{rate: rate, cap: float64(burst), tokens: float64(burst), last: time.Now()}
}

func (b *bucket) take() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if el := now.Sub(b.last); el > 0 {
		b.tokens = math.Min(b.cap, b.tokens+el.Seconds()*b.rate)
		b.last = now
	}
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
