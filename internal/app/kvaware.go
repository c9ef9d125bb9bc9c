package app

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/switchyard-llm/switchyard/internal/chattmpl"
	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/kvaware"
	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// kvState is what every kv_aware policy of the router shares: one index
// fed by one subscription per worker, and one tokenizer cache.
type kvState struct {
	index    *kvevents.Index
	sub      *kvevents.Subscriber
	tok      *kvaware.Tokenizer
	explicit map[string]config.KVEndpoint // by worker base URL
	policies []*kvaware.Policy
	unsubReg func()
}

// kv returns the shared kv_aware state, building it on first use.
func (a *app) kv() (*kvState, error) {
	if a.kvs != nil {
		return a.kvs, nil
	}
	cfg := a.cfg
	eps, err := cfg.KVEndpointList()
	if err != nil {
		return nil, fmt.Errorf("--kv-events-endpoints: %w", err)
	}
	st := &kvState{
		index: kvevents.NewIndex(kvevents.IndexOptions{BlockSize: cfg.KVBlockSize, Seed: cfg.KVHashSeed, MaxEntries: cfg.KVIndexMaxEntries}),
		tok:   kvaware.NewTokenizer(a.client, 0, 0),
	}
	if cfg.TokenizerPath != "" {
		lt, err := tokenizer.Load(cfg.TokenizerPath)
		if err != nil {
			return nil, fmt.Errorf("--tokenizer-path: %w", err)
		}
		chat, err := a.chatTemplate()
		if err != nil {
			return nil, err
		}
		st.tok.SetLocal(kvaware.LocalOptions{Tokenizer: lt, Chat: chat, Logger: a.log})
		a.closers = append(a.closers, st.tok.Close)
		a.log.Info("kv_aware: completions prompts tokenized in-process", "tokenizer", lt.Path,
			"verified_first", kvaware.DefaultVerify, "then_in_background", kvaware.DefaultBackground, "then_one_in", kvaware.DefaultSampleEvery)
	}
	st.explicit = make(map[string]config.KVEndpoint, len(eps))
	for _, e := range eps {
		st.explicit[e.URL] = e
	}
	st.sub, err = kvevents.NewSubscriber(kvevents.Options{Index: st.index, Logger: a.log})
	if err != nil {
		return nil, err
	}
	a.kvs = st
	a.setLoRAIndex(st.index)
	a.closers = append(a.closers, st.sub.Close)
	st.unsubReg = a.reg.Subscribe(func(worker.Change) { a.syncKVSources() })
	a.closers = append(a.closers, st.unsubReg)
	a.registerKVMetrics(st)
	return st, nil
}

// chatTemplate loads the chat template kv_aware renders plain chat
// requests with: --chat-template, else the one beside --tokenizer-path.
// Without one, or one the router does not render, chat requests go to the
// engines' /tokenize (logged); a --chat-template that cannot be read or
// compiled is an error at startup.
func (a *app) chatTemplate() (*chattmpl.Template, error) {
	t, err := chattmpl.Load(a.cfg.TokenizerPath, a.cfg.ChatTemplate)
	switch {
	case err == nil:
		a.log.Info("kv_aware: plain chat requests rendered and tokenized in-process", "chat_template", t.Path, "content_as_parts", t.ContentParts())
		return t, nil
	case a.cfg.ChatTemplate != "" && !errors.Is(err, chattmpl.ErrUnsupported):
		return nil, fmt.Errorf("--chat-template: %w", err)
	}
	a.log.Info("kv_aware: chat requests tokenized by the engines' /tokenize", "reason", err.Error())
	return nil, nil
}

// newKVAware builds a kv_aware policy over the shared state.
func (a *app) newKVAware() (policy.Policy, error) {
	st, err := a.kv()
	if err != nil {
		return nil, err
	}
	fb, err := policy.New(a.cfg.KVFallbackPolicy, a.policyOptions())
	if err != nil {
		return nil, fmt.Errorf("--kv-fallback-policy: %w", err)
	}
	p, err := kvaware.New(kvaware.Options{
		Index:          st.index,
		Tokenizer:      st.tok,
		Fallback:       fb,
		Metrics:        a.m,
		HasEvents:      a.kvHasEvents,
		OverlapWeight:  a.cfg.KVOverlapScoreWeight,
		LoadWeight:     a.cfg.KVLoadWeight,
		TieBand:        a.cfg.KVTieBand,
		Speculative:    a.cfg.KVSpeculativeIndexing,
		SpeculativeTTL: a.cfg.KVSpeculativeTTL(),
	})
	if err != nil {
		_ = policy.Close(fb)
		return nil, err
	}
	st.policies = append(st.policies, p)
	a.syncKVSources()
	return p, nil
}

// noteLoRA tells kv_aware's index (now, or once it is built) that name is
// a LoRA adapter: loaded through the router, or listed by an engine's
// /v1/models with the engine's model as its parent. vLLM keys an adapter's
// blocks with its name, so its requests are keyed so from the first one,
// not matched against the base model's blocks until the adapter's own
// events arrive.
func (a *app) noteLoRA(name string) {
	a.loraMu.Lock()
	defer a.loraMu.Unlock()
	switch {
	case a.loraIndex != nil:
		a.loraIndex.NoteLoRA(name)
	case !slices.Contains(a.loraNames, name) && len(a.loraNames) < kvevents.MaxLoRANames:
		a.loraNames = append(a.loraNames, name)
	}
}

// setLoRAIndex hands noteLoRA's names to kv_aware's index, and later ones
// straight to it.
func (a *app) setLoRAIndex(x *kvevents.Index) {
	a.loraMu.Lock()
	defer a.loraMu.Unlock()
	a.loraIndex = x
	for _, n := range a.loraNames {
		x.NoteLoRA(n)
	}
	a.loraNames = nil
}

// kvHasEvents: a worker counts as publishing once its subscription has
// applied a batch or the index holds blocks of it.
func (a *app) kvHasEvents(key string) bool {
	return a.kvs != nil && (a.kvs.sub.Seen(key) || a.kvs.index.WorkerBlocks(key) > 0)
}

// syncKVSources makes the subscriber follow every registered worker.
func (a *app) syncKVSources() {
	st := a.kvs
	if st == nil {
		return
	}
	snap := a.reg.Snapshot()
	srcs := make([]kvevents.Source, 0, len(snap.All))
	for _, w := range snap.All {
		if src, ok := a.kvSource(w); ok {
			srcs = append(srcs, src)
		}
	}
	st.sub.Set(srcs)
	// Check --tokenizer-path against the first engine known, before any
	// request needs it (a no-op once checked).
	for _, w := range snap.All {
		if w.Healthy() {
			st.tok.Probe(w.URL)
			break
		}
	}
}

// kvSource derives a worker's event endpoints: an explicit
// --kv-events-endpoints entry, or the worker's host with its source's port
// (the vllm.ai/kv-events-port pod annotation) or --kv-events-port, plus
// its DP rank, as vLLM offsets each rank's publisher.
func (a *app) kvSource(w *worker.Worker) (kvevents.Source, bool) {
	src := kvevents.Source{Worker: w.Key(), Topic: a.cfg.KVEventsTopic}
	if e, ok := a.kvs.explicit[w.URL]; ok {
		src.Endpoint, src.ReplayEndpoint = e.Endpoint, e.Replay
		return src, true
	}
	u, err := url.Parse(w.URL)
	if err != nil || u.Hostname() == "" {
		return src, false
	}
	rank := max(w.DPRank, 0)
	port := func(p uint16) string { return strconv.Itoa(int(p) + rank) }
	pub := a.cfg.KVEventsPort
	if w.KVEventsPort > 0 {
		pub = uint16(w.KVEventsPort)
	}
	src.Endpoint = "tcp://" + net.JoinHostPort(u.Hostname(), port(pub))
	if a.cfg.KVEventsReplayPort != 0 {
		src.ReplayEndpoint = "tcp://" + net.JoinHostPort(u.Hostname(), port(a.cfg.KVEventsReplayPort))
	}
	return src, true
}

// kvStatus is the "kv_aware" section of /workers.
func (a *app) kvStatus() any {
	st := a.kvs
	if st == nil {
		return nil
	}
	stats, size := st.index.Stats()
	workers := map[string]any{}
	for _, w := range a.reg.Snapshot().All {
		src, _ := a.kvSource(w)
		workers[w.Key()] = map[string]any{
			"endpoint":  src.Endpoint,
			"replay":    src.ReplayEndpoint,
			"blocks":    st.index.WorkerBlocks(w.Key()),
			"events":    st.sub.Seen(w.Key()),
			"routed_by": map[bool]string{true: "kv_aware", false: "fallback (" + a.cfg.KVFallbackPolicy + "): no events received yet"}[a.kvHasEvents(w.Key())],
		}
	}
	out := map[string]any{
		"index_entries": size,
		"block_size":    st.index.BlockSize(),
		"stored":        stats.Stored,
		"removed":       stats.Removed,
		"orphans":       stats.Orphans,
		"dropped_full":  stats.Full,
		"unindexed":     stats.Unindexed,
		"restated":      stats.Restated,
		"workers":       workers,
	}
	if a.cfg.TokenizerPath != "" {
		ts := &st.tok.S
		out["tokenizer"] = map[string]any{
			"path":              a.cfg.TokenizerPath,
			"enabled":           !ts.LocalOff.Load(),
			"local_encodes":     ts.LocalEncodes.Load(),
			"verify_checks":     ts.VerifyChecks.Load(),
			"verify_mismatches": ts.VerifyMismatches.Load(),
			"verify_background": ts.VerifyBackground.Load(),
			"verify_dropped":    ts.VerifyDropped.Load(),
			"chat_in_process":   st.tok.ChatLocal(),
			"chat_encodes":      ts.ChatLocal.Load(),
		}
	}
	return out
}

// registerKVMetrics exposes the index, subscriber and policy counters.
func (a *app) registerKVMetrics(st *kvState) {
	c := &st.sub.C
	counter := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "vllm_router_kv_" + name, Help: help}, f)
	}
	sum := func(f func(p *kvaware.Policy) uint64) func() float64 {
		return func() float64 {
			var n uint64
			for _, p := range st.policies {
				n += f(p)
			}
			return float64(n)
		}
	}
	ld := func(v interface{ Load() uint64 }) func() float64 { return func() float64 { return float64(v.Load()) } }
	cs := []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm_router_kv_index_entries", Help: "Blocks x workers in the KV index"},
			func() float64 { _, n := st.index.Stats(); return float64(n) }),
		counter("event_batches_total", "KV event batches applied", ld(&c.Batches)),
		counter("events_stored_total", "BlockStored events applied", ld(&c.Stored)),
		counter("events_removed_total", "BlockRemoved events applied", ld(&c.Removed)),
		counter("events_cleared_total", "AllBlocksCleared events applied", ld(&c.Cleared)),
		counter("events_malformed_total", "KV event messages dropped as malformed", ld(&c.Malformed)),
		counter("event_gaps_total", "Sequence gaps in a worker's KV events", ld(&c.Gaps)),
		counter("replayed_batches_total", "KV event batches recovered from a replay endpoint", ld(&c.Replayed)),
		counter("replay_failures_total", "Replays that could not recover missed batches", ld(&c.ReplayFailed)),
		counter("publisher_restarts_total", "Publishers seen restarting (new sequence)", ld(&c.Restarts)),
		counter("index_resets_total", "Workers whose entries were dropped after lost events", ld(&c.Resets)),
		counter("index_evictions_total", "Stores dropped at --kv-index-max-entries",
			func() float64 { s, _ := st.index.Stats(); return float64(s.Full) }),
		counter("orphan_blocks_total", "Stored blocks whose parent the index never saw",
			func() float64 { s, _ := st.index.Stats(); return float64(s.Orphans) }),
		counter("block_size_mismatch_total", "Stored blocks of another block size than --kv-block-size",
			func() float64 { s, _ := st.index.Stats(); return float64(s.BlockSizeMismatch) }),
		counter("unindexed_blocks_total", "Stored blocks the index leaves out: KV cache groups it does not follow (sliding-window, Mamba), stores that do not say which tokens a hash is for",
			func() float64 { s, _ := st.index.Stats(); return float64(s.Unindexed) }),
		counter("restated_blocks_total", "Held blocks restated by a store from a sequence's first block (reuse reports), not counted as copies",
			func() float64 { s, _ := st.index.Stats(); return float64(s.Restated) }),
		counter("picks_total", "kv_aware decisions", sum(func(p *kvaware.Policy) uint64 { return p.S.Picks.Load() })),
		counter("cache_hits_total", "kv_aware decisions onto a cached prefix", sum(func(p *kvaware.Policy) uint64 { return p.S.Hits.Load() })),
		counter("predicted_cached_tokens_total", "Prompt tokens predicted cached on the chosen worker", sum(func(p *kvaware.Policy) uint64 { return p.S.MatchedTokens.Load() })),
		counter("prompt_tokens_total", "Prompt tokens routed by kv_aware", sum(func(p *kvaware.Policy) uint64 { return p.S.PromptTokens.Load() })),
		counter("fallback_not_tokenized_total", "Requests routed by the fallback policy: prompt not tokenized", sum(func(p *kvaware.Policy) uint64 { return p.S.FallbackNoTokens.Load() })),
		counter("fallback_no_events_total", "Requests routed by the fallback policy: no candidate publishes events", sum(func(p *kvaware.Policy) uint64 { return p.S.FallbackNoEvents.Load() })),
		counter("tokenize_errors_total", "Failed /tokenize calls", sum(func(p *kvaware.Policy) uint64 { return p.S.TokenizeErrors.Load() })),
		counter("tokenize_cache_hits_total", "Prompts whose token ids the router had cached", ld(&st.tok.S.CacheHits)),
		counter("tokenize_requests_total", "/tokenize calls to an engine (prompts not cached)", ld(&st.tok.S.Asks)),
		counter("tokenize_seconds_total", "Wall time of the /tokenize calls",
			func() float64 { return float64(st.tok.S.AskNanos.Load()) / 1e9 }),
		counter("tokenize_local_total", "Prompts tokenized in-process (--tokenizer-path)", ld(&st.tok.S.LocalEncodes)),
		counter("tokenize_local_seconds_total", "Wall time of the in-process encodes",
			func() float64 { return float64(st.tok.S.LocalNanos.Load()) / 1e9 }),
		counter("tokenize_verify_checks_total", "In-process results compared with an engine's /tokenize", ld(&st.tok.S.VerifyChecks)),
		counter("tokenize_verify_mismatches_total", "In-process results that differed from the engine's (the first one switches it off)", ld(&st.tok.S.VerifyMismatches)),
		counter("tokenize_verify_background_total", "Of the checks, those made off the request's path", ld(&st.tok.S.VerifyBackground)),
		counter("tokenize_verify_dropped_total", "Background checks not made because the queue was full", ld(&st.tok.S.VerifyDropped)),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm_router_kv_tokenize_local_enabled", Help: "1 while the in-process tokenizer is in use"},
			func() float64 {
				if a.cfg.TokenizerPath == "" || st.tok.S.LocalOff.Load() {
					return 0
				}
				return 1
			}),
		counter("tokenize_local_chat_total", "Of the in-process encodes, chat requests rendered with the chat template", ld(&st.tok.S.ChatLocal)),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "vllm_router_kv_tokenize_local_chat_enabled", Help: "1 while plain chat requests are rendered and tokenized in-process"},
			func() float64 {
				if st.tok.ChatLocal() {
					return 1
				}
				return 0
			}),
		counter("pd_bypass_total", "PD requests sent to the decode alone (prompt cached there)", sum(func(p *kvaware.Policy) uint64 { return p.S.Bypass.Load() })),
		counter("pd_bypass_deferred_total", "PD requests split although fewer of their prompt tokens than the bypass threshold were uncached on the decode: it was computing other bypassed requests' prompts", sum(func(p *kvaware.Policy) uint64 { return p.S.BypassDeferred.Load() })),
	}
	for _, col := range cs {
		if err := a.m.Registry.Register(col); err != nil {
			a.log.Warn("kv metric not registered", "err", err)
		}
	}
}
