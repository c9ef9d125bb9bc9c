package app

import (
	"context"
	"log/slog"
	"slices"
	"sync"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// maxModelLookups bounds the /v1/models lookups in flight: registrations
// from more new instances at once wait for their next heartbeat.
const maxModelLookups = 32

// modelCache tells discovery which model a worker at host:port serves
// (--enable-igw; ZMQ registrations carry none, nor do pods without the
// vllm.ai/model annotation): the first id of its /v1/models, asked once in
// the background and remembered until no worker at that address is left in
// the registry. A lookup never blocks the caller: while it runs (or after
// it failed) the answer is "not known yet", and the worker's next
// registration (or pod event, or OnKnown callback) asks again.
type modelCache struct {
	ask    func(ctx context.Context, base string) (string, error)
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	onKnown []func()          // called (without mu) when a lookup answered
	known   map[string]string // host:port → model
	pending map[string]bool
	warned  map[string]bool
}

func newModelCache(ask func(ctx context.Context, base string) (string, error), log *slog.Logger) *modelCache {
	ctx, cancel := context.WithCancel(context.Background())
	return &modelCache{ask: ask, log: log, ctx: ctx, cancel: cancel,
		known: map[string]string{}, pending: map[string]bool{}, warned: map[string]bool{}}
}

// Model is zmq.Options.Model: addr is the instance's host:port.
func (c *modelCache) Model(addr string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m, ok := c.known[addr]; ok {
		return m, true
	}
	if c.pending[addr] || len(c.pending) >= maxModelLookups || c.ctx.Err() != nil {
		return "", false
	}
	c.pending[addr] = true
	c.wg.Go(func() { c.lookup(addr) })
	return "", false
}

// OnKnown adds fn, called whenever a lookup named a model (Kubernetes
// discovery re-evaluates its waiting pods then).
func (c *modelCache) OnKnown(fn func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.onKnown = append(c.onKnown, fn)
}

func (c *modelCache) lookup(addr string) {
	m, err := c.ask(c.ctx, "http://"+addr)
	c.mu.Lock()
	delete(c.pending, addr)
	if err != nil {
		if !c.warned[addr] && c.ctx.Err() == nil {
			c.warned[addr] = true
			c.log.Warn("--enable-igw: a discovered worker cannot tell its model yet; it is asked again at its next registration or pod event",
				"address", addr, "err", err)
		}
		c.mu.Unlock()
		return
	}
	delete(c.warned, addr)
	c.known[addr] = m
	fns := slices.Clone(c.onKnown)
	c.mu.Unlock()
	c.log.Info("--enable-igw: discovered worker serves its model", "address", addr, "model", m)
	for _, fn := range fns {
		fn()
	}
}

// onRegistryChange forgets the model of an instance none of whose workers
// is left (it expired or was removed): a new process at that address may
// serve another model.
func (c *modelCache) onRegistryChange(ch worker.Change) {
	if len(ch.Removed) == 0 {
		return
	}
	left := map[string]bool{}
	for _, w := range ch.Snap.All {
		left[w.HostPort()] = true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, w := range ch.Removed {
		if hp := w.HostPort(); !left[hp] {
			delete(c.known, hp)
		}
	}
}

// Close stops the lookups in flight and waits for them.
func (c *modelCache) Close() {
	c.cancel()
	c.wg.Wait()
}
