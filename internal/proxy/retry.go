package proxy

import (
	"math"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"
)

// RetryConfig controls retries of generation requests.
type RetryConfig struct {
	// MaxAttempts is the total number of attempts including the first
	// (vllm-router's max_retries); values below 1 mean 1.
	MaxAttempts int
	// Backoff before attempt k+1 (k = failed attempts so far, from 0):
	// min(InitialBackoff·Multiplier^k, MaxBackoff), then jittered by a
	// uniform factor in [-Jitter, +Jitter].
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Jitter         float64
	// BudgetRatio caps retries at this fraction of the requests seen in the
	// last 10 s (plus BudgetMinPerSec), so a failing fleet sees at most
	// (1+BudgetRatio)× its normal load instead of MaxAttempts×. ≤ 0 turns
	// the budget off.
	BudgetRatio float64
	// BudgetMinPerSec is the retry rate always allowed, however few
	// requests there were (default 10/s).
	BudgetMinPerSec float64
}

// retryableStatus reports whether an upstream status may be retried on
// another worker (vllm-router's list).
func retryableStatus(code int) bool {
	switch code {
	case http.StatusRequestTimeout, http.StatusTooManyRequests, http.StatusInternalServerError,
		http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// backoff returns the jittered delay before the retry that follows the
// failed attempt number failed (1-based).
func (c *RetryConfig) backoff(failed int, rnd func() float64) time.Duration {
	d := float64(c.InitialBackoff)
	mult := c.Multiplier
	if mult < 1 {
		mult = 1
	}
	d *= math.Pow(mult, float64(failed-1))
	if c.MaxBackoff > 0 && d > float64(c.MaxBackoff) {
		d = float64(c.MaxBackoff)
	}
	if c.Jitter > 0 {
		d += d * c.Jitter * (2*rnd() - 1)
	}
	if d < 0 || math.IsNaN(d) {
		return 0
	}
	if d > float64(math.MaxInt64) {
		return time.Duration(math.MaxInt64)
	}
	return time.Duration(d)
}

const (
	budgetBuckets = 10
	budgetWidth   = time.Second
)

// retryBudget is a sliding-window retry budget: over the last
// budgetBuckets×budgetWidth, retries may not exceed
// ratio×requests + minPerSec×window.
type retryBudget struct {
	ratio, floor float64 // floor = retries always allowed per window
	now          func() time.Time

	mu         sync.Mutex
	bucketFrom time.Time
	idx        int
	reqs, rets [budgetBuckets]float64
}

func newRetryBudget(c RetryConfig, now func() time.Time) *retryBudget {
	if c.BudgetRatio <= 0 {
		return nil
	}
	minPerSec := c.BudgetMinPerSec
	if minPerSec <= 0 {
		minPerSec = 10
	}
	if now == nil {
		now = time.Now
	}
	return &retryBudget{ratio: c.BudgetRatio, floor: minPerSec * (budgetBuckets * budgetWidth).Seconds(), now: now, bucketFrom: now()}
}

// advance rotates buckets up to now; the caller holds mu.
func (b *retryBudget) advance() {
	now := b.now()
	for steps := 0; now.Sub(b.bucketFrom) >= budgetWidth; steps++ {
		if steps >= budgetBuckets { // idle longer than the window
			b.reqs, b.rets = [budgetBuckets]float64{}, [budgetBuckets]float64{}
			b.bucketFrom = now
			return
		}
		b.bucketFrom = b.bucketFrom.Add(budgetWidth)
		b.idx = (b.idx + 1) % budgetBuckets
		b.reqs[b.idx], b.rets[b.idx] = 0, 0
	}
}

// request records a first attempt (it earns ratio of a retry).
func (b *retryBudget) request() {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.advance()
	b.reqs[b.idx]++
	b.mu.Unlock()
}

// allow withdraws one retry if the budget has room.
func (b *retryBudget) allow() bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.advance()
	var reqs, rets float64
	for i := range budgetBuckets {
		reqs += b.reqs[i]
		rets += b.rets[i]
	}
	if rets+1 > b.ratio*reqs+b.floor {
		return false
	}
	b.rets[b.idx]++
	return true
}

func defaultRand() float64 { return rand.Float64() }
