package pd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// bootInfo is one successful answer of a Mooncake bootstrap server.
type bootInfo struct {
	engines map[int]string // dp_rank -> engine_id
	ranks   []int          // the keys of engines, ascending
}

// bootEntry tracks one bootstrap server (shared by the DP ranks of an
// instance) and the background goroutine that queries it.
type bootEntry struct {
	addr    string // http://host:port
	info    atomic.Pointer[bootInfo]
	lastErr atomic.Pointer[string]
	users   map[*worker.Worker]struct{}
	cancel  context.CancelFunc
}

// bootstrapper keeps Mooncake bootstrap info for every prefill worker. It
// subscribes to the registry, queries each prefill's bootstrap server in the
// background (retrying with backoff, refreshing periodically) and never
// blocks start-up or requests.
type bootstrapper struct {
	reg        *worker.Registry
	client     *http.Client
	port       int
	backoff    time.Duration
	maxBackoff time.Duration
	refresh    time.Duration
	timeout    time.Duration
	log        *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	unsub  func()

	mu      sync.Mutex
	closed  bool
	entries map[string]*bootEntry         // by addr
	byW     map[*worker.Worker]*bootEntry // worker -> entry
	rr      map[*worker.Worker]*atomic.Uint64
}

func newBootstrapper(o *Options, log *slog.Logger) *bootstrapper {
	ctx, cancel := context.WithCancel(context.Background())
	b := &bootstrapper{
		reg: o.Registry, client: o.Client, port: o.MooncakeBootstrapPort,
		backoff: o.BootstrapBackoff, maxBackoff: o.BootstrapMaxBackoff,
		refresh: o.BootstrapRefresh, timeout: o.BootstrapTimeout, log: log,
		ctx: ctx, cancel: cancel,
		entries: map[string]*bootEntry{}, byW: map[*worker.Worker]*bootEntry{},
		rr: map[*worker.Worker]*atomic.Uint64{},
	}
	return b
}

// start subscribes to the registry and tracks the current prefill workers.
func (b *bootstrapper) start() {
	b.unsub = b.reg.Subscribe(func(c worker.Change) {
		for _, w := range c.Removed {
			b.untrack(w)
		}
		for _, w := range c.Added {
			b.track(w)
		}
	})
	for _, w := range b.reg.Snapshot().Prefill {
		b.track(w)
	}
}

// close stops every background query and waits for them.
func (b *bootstrapper) close() {
	if b.unsub != nil {
		b.unsub()
	}
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	b.cancel()
	b.wg.Wait()
}

// addrFor is the bootstrap base URL of a prefill worker.
func (b *bootstrapper) addrFor(w *worker.Worker) string {
	port := w.BootstrapPort
	if port <= 0 {
		port = b.port
	}
	return "http://" + net.JoinHostPort(w.Hostname(), strconv.Itoa(port))
}

func (b *bootstrapper) track(w *worker.Worker) {
	if w.Role != worker.RolePrefill {
		return
	}
	addr := b.addrFor(w)
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	if _, ok := b.byW[w]; ok {
		b.mu.Unlock()
		return
	}
	e := b.entries[addr]
	if e == nil {
		ctx, cancel := context.WithCancel(b.ctx)
		e = &bootEntry{addr: addr, users: map[*worker.Worker]struct{}{}, cancel: cancel}
		pending := "bootstrap query pending"
		e.lastErr.Store(&pending)
		b.entries[addr] = e
		b.wg.Add(1)
		go b.loop(ctx, e)
	}
	e.users[w] = struct{}{}
	b.byW[w] = e
	b.mu.Unlock()
	// A removal published while we were scanning the snapshot may have
	// been processed before this track: drop a worker that already left.
	if b.reg.Get(w.Key()) != w {
		b.untrack(w)
	}
}

func (b *bootstrapper) untrack(w *worker.Worker) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e, ok := b.byW[w]
	if !ok {
		return
	}
	delete(b.byW, w)
	delete(b.rr, w)
	delete(e.users, w)
	if len(e.users) == 0 {
		e.cancel()
		delete(b.entries, e.addr)
	}
}

// lookup returns the bootstrap address and the engine id for w's rank.
func (b *bootstrapper) lookup(w *worker.Worker, rank int) (addr, engine string, err error) {
	b.mu.Lock()
	e := b.byW[w]
	b.mu.Unlock()
	if e == nil {
		return "", "", fmt.Errorf("no Mooncake bootstrap info for prefill %s (not tracked)", w.Key())
	}
	info := e.info.Load()
	if info == nil {
		msg := "pending"
		if p := e.lastErr.Load(); p != nil {
			msg = *p
		}
		return "", "", fmt.Errorf("no Mooncake bootstrap info for prefill %s yet (GET %s/query: %s)", w.Key(), e.addr, msg)
	}
	if rank < 0 {
		rank = 0
	}
	if id, ok := info.engines[rank]; ok {
		return e.addr, id, nil
	}
	if len(info.engines) == 1 && w.DPSize <= 1 {
		for _, id := range info.engines {
			return e.addr, id, nil
		}
	}
	return "", "", fmt.Errorf("Mooncake bootstrap server %s has no engine_id for dp_rank %d of prefill %s", e.addr, rank, w.Key())
}

// pickRank chooses the dp rank of one request to a prefill the router does
// not pin to a rank (no --intra-node-data-parallel-size, no @rank) whose
// bootstrap server lists several ranks: round-robin over the listed ranks,
// per worker, as vLLM's Mooncake proxy cycles (instance, dp_rank) with
// dp_size = len(/query). -1 = no choice to make (one rank, or no info yet).
func (b *bootstrapper) pickRank(w *worker.Worker) int {
	if w.DPRank >= 0 || w.DPSize > 1 {
		return -1
	}
	b.mu.Lock()
	e := b.byW[w]
	c := b.rr[w]
	if e != nil && c == nil {
		c = new(atomic.Uint64)
		b.rr[w] = c
	}
	b.mu.Unlock()
	if e == nil {
		return -1
	}
	info := e.info.Load()
	if info == nil || len(info.ranks) <= 1 {
		return -1
	}
	return info.ranks[(c.Add(1)-1)%uint64(len(info.ranks))]
}

func (b *bootstrapper) loop(ctx context.Context, e *bootEntry) {
	defer b.wg.Done()
	wait := b.backoff
	have := false
	for {
		info, err := b.query(ctx, e.addr)
		if ctx.Err() != nil {
			return
		}
		var next time.Duration
		if err == nil {
			if !have {
				b.log.Info("mooncake bootstrap info", "addr", e.addr, "ranks", len(info.engines))
			}
			e.info.Store(info)
			have = true
			wait = b.backoff
			next = b.refresh
		} else {
			msg := err.Error()
			e.lastErr.Store(&msg)
			if have {
				// keep serving the last good answer; retry at the refresh rate
				b.log.Warn("mooncake bootstrap refresh failed", "addr", e.addr, "err", err)
				next = b.refresh
			} else {
				b.log.Warn("mooncake bootstrap query failed, retrying", "addr", e.addr, "err", err, "retry_in", wait)
				next = wait
				wait *= 2
				if wait > b.maxBackoff {
					wait = b.maxBackoff
				}
			}
		}
		t := time.NewTimer(next)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// query does GET {addr}/query and parses {"<dp_rank>": {"engine_id": ...}}.
func (b *bootstrapper) query(ctx context.Context, addr string) (*bootInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, b.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, addr+"/query", nil)
	if err != nil {
		return nil, err
	}
	resp, err := b.client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 != 2 {
		return nil, fmt.Errorf("status %d: %s", resp.StatusCode, snippet(body))
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, fmt.Errorf("response is not a JSON object: %v", err)
	}
	if len(raw) == 0 {
		return nil, errors.New("no engines registered yet")
	}
	info := &bootInfo{engines: make(map[int]string, len(raw))}
	for k, v := range raw {
		r, err := strconv.Atoi(k)
		if err != nil || r < 0 {
			return nil, fmt.Errorf("invalid dp_rank %q", k)
		}
		var ent struct {
			EngineID *string `json:"engine_id"`
		}
		if err := json.Unmarshal(v, &ent); err != nil || ent.EngineID == nil || *ent.EngineID == "" {
			return nil, fmt.Errorf("missing engine_id for dp_rank %d", r)
		}
		info.engines[r] = *ent.EngineID
		info.ranks = append(info.ranks, r)
	}
	sort.Ints(info.ranks)
	return info, nil
}

// pendingAddrs lists bootstrap servers without info, for readiness reasons.
func (b *bootstrapper) pending() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for _, e := range b.entries {
		if e.info.Load() == nil {
			msg := ""
			if p := e.lastErr.Load(); p != nil {
				msg = *p
			}
			out = append(out, e.addr+" ("+msg+")")
		}
	}
	return out
}
