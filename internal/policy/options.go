package policy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Policy names accepted by New.
const (
	NameRandom         = "random"
	NameRoundRobin     = "round_robin"
	NamePowerOfTwo     = "power_of_two"
	NameConsistentHash = "consistent_hash"
	NameRendezvousHash = "rendezvous_hash"
	NameCacheAware     = "cache_aware"
)

// Names returns every policy name New accepts.
func Names() []string {
	return []string{NameRandom, NameRoundRobin, NamePowerOfTwo, NameConsistentHash, NameRendezvousHash, NameCacheAware}
}

// ErrUnknownPolicy is wrapped by New for a name it does not know.
var ErrUnknownPolicy = errors.New("unknown policy")

// DefaultVirtualNodes is the consistent_hash ring's vnodes per worker.
const DefaultVirtualNodes = 160

// DefaultHashHeaders are the headers consulted for a session key, in order.
var DefaultHashHeaders = []string{"x-session-id", "x-user-id", "x-tenant-id", "x-correlation-id", "x-request-id", "x-trace-id"}

// Options configures every policy; each policy reads only its own fields.
// Start from DefaultOptions: thresholds are used as given, so the zero value
// of a threshold means zero, not "default".
type Options struct {
	// cache_aware
	CacheThreshold      float64       // match ratio above which the cached worker wins, in [0,1]
	BalanceAbsThreshold int           // imbalanced iff max-min > abs ...
	BalanceRelThreshold float64       // ... and max > min*rel (loads over usable workers)
	EvictionInterval    time.Duration // 0 = default 120s, < 0 = no eviction goroutine
	MaxTreeSize         int           // characters kept per worker; <= 0 = default 1<<26

	// consistent_hash
	VirtualNodes int // vnodes per worker; <= 0 = DefaultVirtualNodes

	// consistent_hash and rendezvous_hash: headers that carry a session key,
	// in priority order, matched case-insensitively. nil = DefaultHashHeaders;
	// an empty non-nil slice disables header keys.
	HashHeaders []string

	// power_of_two and cache_aware: use only the router's in-flight count,
	// ignoring the load a worker reports (Worker.PolledLoad).
	LocalLoadOnly bool

	// Metrics, when non-nil, receives per-decision metrics.
	Metrics *metrics.Metrics

	// Rand returns uniformly distributed 64-bit values and must be safe for
	// concurrent use. nil = math/rand/v2's global source. See SeededRand.
	Rand func() uint64
	// Now is the clock (nil = time.Now). cache_aware stamps evictions with it.
	Now func() time.Time

	// Context, when non-nil, also stops goroutines a policy owns when done.
	// Close stops them regardless.
	Context context.Context
	// Registry, when non-nil, lets cache_aware forget a worker's cached
	// prefixes as soon as the worker leaves (it subscribes; Close
	// unsubscribes). Without it the app must call RemoveWorker.
	Registry *worker.Registry
}

// DefaultOptions returns the router's defaults (REFERENCE §1.1/§3.5 CLI values).
func DefaultOptions() Options {
	return Options{
		CacheThreshold:      0.3,
		BalanceAbsThreshold: 64,
		BalanceRelThreshold: 1.5,
		EvictionInterval:    120 * time.Second,
		MaxTreeSize:         1 << 26,
		VirtualNodes:        DefaultVirtualNodes,
	}
}

// withDefaults validates o and fills structural defaults.
func (o Options) withDefaults() (Options, error) {
	var errs []error
	if math.IsNaN(o.CacheThreshold) || o.CacheThreshold < 0 || o.CacheThreshold > 1 {
		errs = append(errs, fmt.Errorf("cache threshold %v: must be in [0,1]", o.CacheThreshold))
	}
	if o.BalanceAbsThreshold < 0 {
		errs = append(errs, fmt.Errorf("balance abs threshold %d: must be >= 0", o.BalanceAbsThreshold))
	}
	if math.IsNaN(o.BalanceRelThreshold) || o.BalanceRelThreshold < 0 {
		errs = append(errs, fmt.Errorf("balance rel threshold %v: must be >= 0", o.BalanceRelThreshold))
	}
	if o.VirtualNodes > 1<<16 {
		errs = append(errs, fmt.Errorf("virtual nodes %d: must be <= 65536", o.VirtualNodes))
	}
	if len(errs) > 0 {
		return o, errors.Join(errs...)
	}
	if o.EvictionInterval == 0 {
		o.EvictionInterval = 120 * time.Second
	}
	if o.MaxTreeSize <= 0 {
		o.MaxTreeSize = 1 << 26
	}
	if o.VirtualNodes <= 0 {
		o.VirtualNodes = DefaultVirtualNodes
	}
	if o.HashHeaders == nil {
		o.HashHeaders = DefaultHashHeaders
	}
	if o.Rand == nil {
		o.Rand = rand.Uint64
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Context == nil {
		o.Context = context.Background()
	}
	return o, nil
}

// New builds the policy called name. A cache_aware policy starts its
// eviction goroutine here; release it with Close(p).
func New(name string, opts Options) (Policy, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", name, err)
	}
	switch name {
	case NameRandom:
		return newRandom(o), nil
	case NameRoundRobin:
		return newRoundRobin(o), nil
	case NamePowerOfTwo:
		return newPowerOfTwo(o), nil
	case NameConsistentHash:
		return newConsistentHash(o), nil
	case NameRendezvousHash:
		return newRendezvous(o), nil
	case NameCacheAware:
		return newCacheAware(o), nil
	}
	return nil, fmt.Errorf("%w %q (valid: %s)", ErrUnknownPolicy, name, strings.Join(Names(), ", "))
}

// Close releases what p owns (goroutines, subscriptions) if it implements
// io.Closer; otherwise it does nothing. It is safe to call more than once.
func Close(p Policy) error {
	if c, ok := p.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

// WorkerRemover is implemented by policies that keep per-worker state.
type WorkerRemover interface {
	RemoveWorker(key string)
}

// RemoveWorker tells p that the worker with key left the fleet, if p keeps
// per-worker state; otherwise it does nothing.
func RemoveWorker(p Policy, key string) {
	if r, ok := p.(WorkerRemover); ok {
		r.RemoveWorker(key)
	}
}

// SeededRand returns a deterministic, concurrency-safe random source for
// Options.Rand (tests, simulations).
func SeededRand(seed uint64) func() uint64 {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	return func() uint64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Uint64()
	}
}
