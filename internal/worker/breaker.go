package worker

import (
	"sync"
	"sync/atomic"
	"time"
)

// BreakerState is a circuit breaker state.
type BreakerState int32

// Breaker states; the numeric values are the vllm_router_cb_state gauge values.
const (
	BreakerClosed   BreakerState = 0
	BreakerOpen     BreakerState = 1
	BreakerHalfOpen BreakerState = 2
)

func (s BreakerState) String() string {
	switch s {
	case BreakerOpen:
		return "open"
	case BreakerHalfOpen:
		return "half_open"
	default:
		return "closed"
	}
}

// BreakerConfig configures a per-worker circuit breaker.
type BreakerConfig struct {
	Disabled         bool
	FailureThreshold int           // consecutive failures that open the circuit
	SuccessThreshold int           // consecutive half-open successes that close it
	OpenDuration     time.Duration // open → half-open delay
	Window           time.Duration // failure-rate window
	FailureRate      float64       // open when the windowed failure rate reaches this (0 = off)
	MinRequests      int           // minimum outcomes in the window before the rate counts
	HalfOpenMax      int           // concurrent probes allowed while half-open
	Now              func() time.Time
	OnTransition     func(from, to BreakerState)
	// OnTransitionFor, when set, is bound to each worker's key by New and
	// takes precedence over OnTransition. It is called with the breaker's
	// lock held: it must only record (metrics, logs), never call back in.
	OnTransitionFor func(key string, from, to BreakerState)
}

// DefaultBreakerConfig mirrors the vllm-router defaults plus our rate rule.
func DefaultBreakerConfig() BreakerConfig {
	return BreakerConfig{
		FailureThreshold: 10, SuccessThreshold: 3, OpenDuration: 60 * time.Second,
		Window: 120 * time.Second, FailureRate: 0.5, MinRequests: 20, HalfOpenMax: 1,
	}
}

const breakerBuckets = 10

// Breaker is a per-worker circuit breaker: it opens on N consecutive
// failures or on a failure rate over a sliding window, lets a bounded number
// of probes through when half-open, and closes after consecutive successes.
type Breaker struct {
	cfg BreakerConfig

	// fast mirrors state for the lock-free Allow fast path (closed).
	fast atomic.Int32

	mu          sync.Mutex
	state       BreakerState
	changed     time.Time
	consecFail  int
	consecOK    int
	probes      int
	bucketStart time.Time
	bucketIdx   int
	ok, fail    [breakerBuckets]int
}

// NewBreaker builds a breaker; zero fields take DefaultBreakerConfig values.
func NewBreaker(c BreakerConfig) *Breaker {
	d := DefaultBreakerConfig()
	if c.FailureThreshold <= 0 {
		c.FailureThreshold = d.FailureThreshold
	}
	if c.SuccessThreshold <= 0 {
		c.SuccessThreshold = d.SuccessThreshold
	}
	if c.OpenDuration <= 0 {
		c.OpenDuration = d.OpenDuration
	}
	if c.Window <= 0 {
		c.Window = d.Window
	}
	if c.HalfOpenMax <= 0 {
		c.HalfOpenMax = d.HalfOpenMax
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	b := &Breaker{cfg: c}
	b.changed = c.Now()
	b.bucketStart = b.changed
	return b
}

// State returns the current state, moving open → half-open when due.
func (b *Breaker) State() BreakerState {
	if b == nil || b.cfg.Disabled {
		return BreakerClosed
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tick(b.cfg.Now())
	return b.state
}

// Allow reports, without side effects, whether a request may be sent now.
func (b *Breaker) Allow() bool {
	if b == nil || b.cfg.Disabled || BreakerState(b.fast.Load()) == BreakerClosed {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tick(b.cfg.Now())
	switch b.state {
	case BreakerOpen:
		return false
	case BreakerHalfOpen:
		return b.probes < b.cfg.HalfOpenMax
	}
	return true
}

// Outcome is what a finished request tells its worker's breaker.
type Outcome uint8

// Outcomes.
const (
	OutcomeSuccess Outcome = iota
	OutcomeFailure
	// OutcomeNeutral records nothing: neither a success nor a failure
	// (consecutive counts, failure-rate window and state are left as they
	// are); it only gives back a half-open probe slot. For a request whose
	// end says nothing about this worker, e.g. a PD decode whose KV never
	// arrived from its prefill.
	OutcomeNeutral
)

func (o Outcome) String() string {
	switch o {
	case OutcomeFailure:
		return "failure"
	case OutcomeNeutral:
		return "neutral"
	default:
		return "success"
	}
}

// Start is called when a request is dispatched to the worker. It returns the
// function that records the outcome; a half-open probe slot is held until
// then. It reports ok=false if the breaker refuses the request.
func (b *Breaker) Start() (done func(success bool), ok bool) {
	d, ok := b.StartOutcome()
	return func(success bool) {
		if success {
			d(OutcomeSuccess)
		} else {
			d(OutcomeFailure)
		}
	}, ok
}

// StartOutcome is Start with a three-way outcome (OutcomeNeutral included).
// Only the first call of done counts.
func (b *Breaker) StartOutcome() (done func(Outcome), ok bool) {
	t, ok := b.Begin()
	if !ok || t.b == nil {
		return func(Outcome) {}, ok
	}
	var once sync.Once
	return func(o Outcome) {
		once.Do(func() { t.Finish(o) })
	}, true
}

// Ticket is a request the breaker let through (Begin): Finish records its
// outcome. Unlike Start's done func it costs no allocation, and the caller
// makes sure Finish runs at most once.
type Ticket struct {
	b     *Breaker // nil: nothing to record (disabled breaker)
	probe bool     // holds a half-open probe slot until Finish
}

// Begin is StartOutcome without the closure: ok=false if the breaker
// refuses the request; else the Ticket to Finish once.
func (b *Breaker) Begin() (Ticket, bool) {
	if b == nil || b.cfg.Disabled {
		return Ticket{}, true
	}
	b.mu.Lock()
	now := b.cfg.Now()
	b.tick(now)
	probe := false
	switch b.state {
	case BreakerOpen:
		b.mu.Unlock()
		return Ticket{}, false
	case BreakerHalfOpen:
		if b.probes >= b.cfg.HalfOpenMax {
			b.mu.Unlock()
			return Ticket{}, false
		}
		b.probes++
		probe = true
	}
	b.mu.Unlock()
	return Ticket{b: b, probe: probe}, true
}

// Finish records the ticket's outcome (OutcomeNeutral only gives back a
// probe slot). Call it at most once per ticket.
func (t Ticket) Finish(o Outcome) {
	if t.b == nil {
		return
	}
	if o == OutcomeNeutral {
		t.b.release(t.probe)
		return
	}
	t.b.record(o == OutcomeSuccess, t.probe)
}

// release gives back a half-open probe slot without recording an outcome.
func (b *Breaker) release(probe bool) {
	if !probe {
		return
	}
	b.mu.Lock()
	if b.probes > 0 {
		b.probes--
	}
	b.mu.Unlock()
}

// Record records an outcome that was not started with Start (e.g. a
// passive failure observed outside a dispatch).
func (b *Breaker) Record(success bool) {
	if b == nil || b.cfg.Disabled {
		return
	}
	b.record(success, false)
}

func (b *Breaker) record(success, probe bool) {
	b.mu.Lock()
	now := b.cfg.Now()
	b.tick(now)
	if probe && b.probes > 0 {
		b.probes--
	}
	if success {
		b.ok[b.bucketIdx]++
	} else {
		b.fail[b.bucketIdx]++
	}
	var from, to BreakerState
	moved := false
	switch b.state {
	case BreakerClosed:
		if success {
			b.consecFail = 0
			break
		}
		b.consecFail++
		if b.consecFail >= b.cfg.FailureThreshold || b.rateTripped() {
			from, to, moved = b.state, BreakerOpen, true
		}
	case BreakerHalfOpen:
		if !success {
			from, to, moved = b.state, BreakerOpen, true
			break
		}
		b.consecOK++
		if b.consecOK >= b.cfg.SuccessThreshold {
			from, to, moved = b.state, BreakerClosed, true
		}
	case BreakerOpen:
		// outcomes of requests started before the circuit opened
	}
	if moved {
		b.set(to, now)
	}
	b.mu.Unlock()
	if moved && b.cfg.OnTransition != nil {
		b.cfg.OnTransition(from, to)
	}
}

func (b *Breaker) rateTripped() bool {
	if b.cfg.FailureRate <= 0 {
		return false
	}
	var ok, fail int
	for i := range breakerBuckets {
		ok += b.ok[i]
		fail += b.fail[i]
	}
	n := ok + fail
	return n >= b.cfg.MinRequests && n > 0 && float64(fail)/float64(n) >= b.cfg.FailureRate
}

// set changes state; the caller holds mu.
func (b *Breaker) set(s BreakerState, now time.Time) {
	b.state = s
	b.fast.Store(int32(s))
	b.changed = now
	b.consecFail, b.consecOK = 0, 0
	if s == BreakerClosed {
		b.ok, b.fail = [breakerBuckets]int{}, [breakerBuckets]int{}
	}
	if s != BreakerHalfOpen {
		b.probes = 0
	}
}

// tick advances the window buckets and the lazy open → half-open move. The
// caller holds mu.
func (b *Breaker) tick(now time.Time) {
	width := b.cfg.Window / breakerBuckets
	if width <= 0 {
		width = time.Second
	}
	for steps := 0; now.Sub(b.bucketStart) >= width && steps <= breakerBuckets; steps++ {
		b.bucketStart = b.bucketStart.Add(width)
		b.bucketIdx = (b.bucketIdx + 1) % breakerBuckets
		b.ok[b.bucketIdx], b.fail[b.bucketIdx] = 0, 0
	}
	if now.Sub(b.bucketStart) >= width { // long idle: realign
		b.bucketStart = now
	}
	if b.state == BreakerOpen && now.Sub(b.changed) >= b.cfg.OpenDuration {
		from := b.state
		b.set(BreakerHalfOpen, now)
		if b.cfg.OnTransition != nil {
			// called with mu held; callbacks must not call back into the breaker
			b.cfg.OnTransition(from, BreakerHalfOpen)
		}
	}
}

// HalfOpen moves an open breaker to half-open at once (its failures were
// the previous process's: the health checker saw the worker come back)
// and reports whether it moved.
func (b *Breaker) HalfOpen() bool {
	if b == nil || b.cfg.Disabled {
		return false
	}
	b.mu.Lock()
	now := b.cfg.Now()
	b.tick(now)
	if b.state != BreakerOpen {
		b.mu.Unlock()
		return false
	}
	b.set(BreakerHalfOpen, now)
	b.mu.Unlock()
	if b.cfg.OnTransition != nil {
		b.cfg.OnTransition(BreakerOpen, BreakerHalfOpen)
	}
	return true
}
