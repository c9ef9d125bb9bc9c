package scenario

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
	"github.com/switchyard-llm/switchyard/internal/sim/oracle"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
)

// KVConfig is the KV-aware routing scenario: a shared-prefix workload over
// vllm-sims whose prefix caches are small enough that where a group's
// prompts go decides whether its prefix stays cached.
type KVConfig struct {
	Policies    []string // compared in every repetition, interleaved
	Concurrency []int    // load points: closed loops of this many streams
	// Rates, when set, replace Concurrency: each load point is Poisson
	// arrivals at that many requests per second (an open loop), with at
	// most RateMaxConcurrency requests in flight.
	Rates              []float64
	RateMaxConcurrency int
	Repeats            int
	Groups             int // shared system prompts
	PerGroup           int // distinct questions per group
	PrefixLen          int // tokens of a group's system prompt
	QuestionLen        int // tokens of a question
	OutputLen          int
	BlockSize          int  // vllm-sim --block-size = switchyard --kv-block-size
	NumBlocks          int  // vllm-sim --num-blocks of every worker
	Turns              int  // > 1: each group's requests are conversations of this many turns
	Unified            int  // unified workers
	NoUnified          bool // skip the unified fleet (run the PD fleet alone)
	// Routers > 1 puts that many router replicas with the same flags in
	// front of each fleet; requests alternate over them.
	Routers int
	PD      bool
	Seed    int64
	// SeedStep: repetition r (from 0) sends the dataset of seed Seed +
	// r×SeedStep (0: every repetition the same). One seed is one arrival
	// order, and so one assignment of groups to workers: which groups
	// share a worker decides how their requests queue there, alike for
	// every policy that keeps a group together, so a policy's luck with
	// one seed repeats in every repetition of it.
	SeedStep int64
	// Tokenizer, when set, is the tokenizer.json every vllm-sim tokenizes
	// prompts with (--tokenizer), and the best-achievable bound counts its
	// tokens; a kv_aware run given the same file (--tokenizer-path)
	// tokenizes in the router. "" = the sims' word tokenizer.
	Tokenizer string
	// Chat sends the workload as /v1/chat/completions requests (sybench
	// --backend openai-chat: one user message, the prompt as a text
	// part), which the sims render with their chat format
	// (internal/sim/chat_template.jinja for a router's --chat-template).
	Chat bool
	// PointTimeout bounds one measured run.
	PointTimeout time.Duration
}

// DefaultKVConfig: 16 groups of 512-token system prompts, each group 4
// conversations of 4 turns (64-token questions, 16-token answers resent):
// 1,728 distinct blocks of 16 tokens. 4 workers of 512 blocks hold them
// once (2,048), one worker a quarter of them: a policy that spreads a
// group over the workers evicts.
func DefaultKVConfig() KVConfig {
	return KVConfig{
		Policies:           []string{"round_robin", "cache_aware", "kv_aware"},
		Concurrency:        []int{4, 8, 16, 32},
		RateMaxConcurrency: 256,
		Repeats:            2,
		Groups:             16,
		PerGroup:           16,
		PrefixLen:          512,
		QuestionLen:        64,
		OutputLen:          16,
		Turns:              4,
		BlockSize:          16,
		NumBlocks:          512,
		Unified:            4,
		PD:                 true,
		Seed:               2026,
		SeedStep:           1,
		PointTimeout:       time.Minute,
	}
}

// QuickKVConfig is a smoke run: one load point, one repetition.
func QuickKVConfig() KVConfig {
	c := DefaultKVConfig()
	c.Concurrency = []int{8}
	c.Repeats = 1
	c.PerGroup = 8
	c.PointTimeout = 30 * time.Second
	return c
}

// kvLoad is one load point: a closed loop of Conc streams, or (Rate > 0)
// arrivals at Rate requests per second with at most Conc in flight.
type kvLoad struct {
	Conc int
	Rate float64
}

// String is the load point as the tables show it: "8" or "120/s".
func (l kvLoad) String() string {
	if l.Rate > 0 {
		return strconv.FormatFloat(l.Rate, 'g', -1, 64) + "/s"
	}
	return strconv.Itoa(l.Conc)
}

// label is the load point in prose: "C=8" or "120/s".
func (l kvLoad) label() string {
	if l.Rate > 0 {
		return l.String()
	}
	return "C=" + l.String()
}

// loads are the configured load points.
func (c KVConfig) loads() []kvLoad {
	var out []kvLoad
	if len(c.Rates) > 0 {
		for _, r := range c.Rates {
			out = append(out, kvLoad{Conc: c.RateMaxConcurrency, Rate: r})
		}
		return out
	}
	for _, n := range c.Concurrency {
		out = append(out, kvLoad{Conc: n})
	}
	return out
}

// loadColumn is the tables' header of the load point column.
func (c KVConfig) loadColumn() string {
	if len(c.Rates) > 0 {
		return "offered req/s"
	}
	return "C"
}

// prompts is the number of requests of one run.
func (c KVConfig) prompts() int { return c.Groups * c.PerGroup }

// KVBound is the best the workload allows: every request finds cached the
// longest full-block prefix it shares with any request sent before it
// (at most its prompt less one token, as vLLM computes the last token),
// as if the fleet kept every block and routing were perfect. Answers the
// model generated are not counted (a conversation resends a stand-in
// answer, so only earlier prompts can match). For single questions this
// is every group's prefix computed once: groups × (per-group − 1) ×
// full prefix blocks.
type KVBound struct {
	Queries, Hits uint64 // prompt tokens; best cached tokens
	// Capped is the capacity bound of each fleet's caches that count
	// (kvCaches), in cached tokens: the most hits with that many blocks
	// in all (pooledHits).
	Capped    [numKVCaches]uint64
	Blocks    int // distinct full blocks of the workload (its eviction-free footprint)
	MaxPrompt int // tokens of the longest prompt
}

// Rate is Hits/Queries.
func (b KVBound) Rate() float64 { return float64(b.Hits) / float64(b.Queries) }

// CappedRate is Capped[k]/Queries.
func (b KVBound) CappedRate(k kvCaches) float64 { return float64(b.Capped[k]) / float64(b.Queries) }

// kvCaches names a set of caches a run's hits can come from.
type kvCaches int

const (
	cachesUnified  kvCaches = iota // the unified workers
	cachesPrefills                 // the PD fleet's prefills (every request split)
	cachesPD                       // every PD worker (a policy that may send a request to a decode alone)
	numKVCaches
)

// capacity is the blocks the caches k hold together.
func (c KVConfig) capacity(k kvCaches) int {
	switch k {
	case cachesUnified:
		return c.Unified * c.NumBlocks
	case cachesPrefills:
		return 2 * c.pdNumBlocks()
	default:
		return 4 * c.pdNumBlocks()
	}
}

// cachesOf is the caches a policy's hits can come from on a fleet: with
// --pd-uncached-token-threshold a decode computes (and caches) the
// requests it serves alone, so its cache counts too.
func cachesOf(pd bool, spec string) kvCaches {
	if !pd {
		return cachesUnified
	}
	_, extra := policyFlags(spec)
	if slices.ContainsFunc(extra, func(f string) bool { return strings.HasPrefix(f, "--pd-uncached-token-threshold") }) {
		return cachesPD
	}
	return cachesPrefills
}

// repSeed is repetition r's dataset seed (r from 0).
func (c KVConfig) repSeed(r int) int64 { return c.Seed + int64(r)*c.SeedStep }

// Bounds computes every repetition's KVBound (its seed's) and their sum:
// hits and queries added, the largest block count and prompt.
func (c KVConfig) Bounds() (per []KVBound, sum KVBound, err error) {
	for r := range max(c.Repeats, 1) {
		cr := c
		cr.Seed = c.repSeed(r)
		b := KVBound{}
		if r > 0 && cr.Seed == c.Seed {
			b = per[0]
		} else if b, err = cr.Bound(); err != nil {
			return nil, KVBound{}, err
		}
		per = append(per, b)
		sum.Hits, sum.Queries = sum.Hits+b.Hits, sum.Queries+b.Queries
		for k := range sum.Capped {
			sum.Capped[k] += b.Capped[k]
		}
		sum.Blocks, sum.MaxPrompt = max(sum.Blocks, b.Blocks), max(sum.MaxPrompt, b.MaxPrompt)
	}
	return per, sum, nil
}

// Bound computes the KVBound of the run's prompts (those of Seed), in the
// order sybench sends them.
func (c KVConfig) Bound() (KVBound, error) {
	samples, err := bench.Samples(c.benchConfig("http://127.0.0.1:1", kvLoad{Conc: 1}, time.Minute))
	if err != nil {
		return KVBound{}, err
	}
	tokenize, err := c.tokenizeFunc()
	if err != nil {
		return KVBound{}, err
	}
	var b KVBound
	prompts := make([][]uint32, len(samples))
	for i, sm := range samples {
		w := tokenize(c.simPrompt(sm.Prompt()))
		prompts[i] = w
		b.Queries += uint64(len(w))
		b.MaxPrompt = max(b.MaxPrompt, len(w))
		best := 0
		for _, q := range prompts[:i] {
			n := 0
			for n < len(w) && n < len(q) && w[n] == q[n] {
				n++
			}
			best = max(best, min(n, len(w)-1)/c.BlockSize)
		}
		b.Hits += uint64(best * c.BlockSize)
	}
	refs, distinct := blockRefs(prompts, c.BlockSize)
	b.Blocks = distinct
	for k := range b.Capped {
		b.Capped[k] = uint64(pooledHits(refs, c.capacity(kvCaches(k))) * c.BlockSize)
	}
	return b, nil
}

// simPrompt is the text a sim tokenizes for a sample's prompt: the prompt,
// or with Chat the one-message conversation the sims render.
func (c KVConfig) simPrompt(p string) string {
	if c.Chat {
		return oracle.ChatPrompt([]oracle.Message{{Role: "user", Content: p}})
	}
	return p
}

// tokenizeFunc is how the sims tokenize a prompt: Tokenizer's ids (with
// special tokens for a completions prompt, without for a rendered chat, as
// vLLM), or one id per white-space word.
func (c KVConfig) tokenizeFunc() (func(string) []uint32, error) {
	if c.Tokenizer == "" {
		return oracle.Tokenize, nil
	}
	tok, err := tokenizer.Load(c.Tokenizer)
	if err != nil {
		return nil, fmt.Errorf("kv: --tokenizer: %w", err)
	}
	return func(s string) []uint32 { return tok.Encode(s, !c.Chat) }, nil
}

// KVRun is one measured run.
type KVRun struct {
	Fleet       string // "4 unified" or "2P2D NIXL"
	PD          bool
	Policy      string
	Concurrency int     // streams (closed loop), or the in-flight bound when Rate > 0
	Rate        float64 // offered requests per second (0: closed loop)
	Rep         int
	Row         bench.SweepRow
	// Queries and Hits are prompt tokens: on the unified fleet the
	// workers' prefix-cache counters; on the PD fleet the workload's
	// prompt tokens and those no worker computed (kvFleet.computed).
	Queries   uint64
	Hits      uint64
	Evictions uint64
	Bypassed  uint64 // PD requests the router sent to a decode alone
	// Computed is the prompt tokens each worker computed over the run, in
	// fleet order (the prefills, then the decodes): how evenly a policy
	// spread the prefill work.
	Computed []uint64
	// KVRead is the prompt tokens whose KV the decodes read from the
	// prefills (PD); a decode's own prefix cache spares the rest.
	KVRead uint64
	// EventTrouble is what the router's KV event subscriber repaired or
	// could not (kv_aware): sequence gaps, failed replays, index resets,
	// publisher restarts, orphan blocks, local tokenizer mismatches.
	EventTrouble map[string]uint64
	// The router's tokenizer over the run (kv_aware): /tokenize calls,
	// their wall time, and prompts found in its cache.
	TokenizeCalls, TokenizeCacheHits uint64
	TokenizeSeconds                  float64
	// In-process tokenizing (--tokenizer-path): prompts encoded, those
	// also asked of an engine to check the result, and of the checks
	// those made in the background (off the request's path).
	TokenizeLocal, TokenizeVerified, TokenizeBackground uint64
	// RouterCPU is the router's CPU seconds over the measured load
	// (process_cpu_seconds_total; NaN when not read).
	RouterCPU float64
	Requests  int // completed and failed
	Note      string
}

// load is the run's load point.
func (r KVRun) load() kvLoad { return kvLoad{Conc: r.Concurrency, Rate: r.Rate} }

// tokenized is how many requests needed a prompt's ids: cache hits, local
// encodes, and /tokenize calls that were not a local encode's check.
func (r KVRun) tokenized() uint64 {
	return r.TokenizeCacheHits + r.TokenizeLocal + r.TokenizeCalls - min(r.TokenizeCalls, r.TokenizeVerified)
}

// TokenizeMeanMS is the mean /tokenize call in ms (NaN without calls).
func (r KVRun) TokenizeMeanMS() float64 {
	if r.TokenizeCalls == 0 {
		return math.NaN()
	}
	return 1000 * r.TokenizeSeconds / float64(r.TokenizeCalls)
}

// bypassShare is the share of the run's requests served by a decode
// alone (NaN on the unified fleet).
func (r KVRun) bypassShare() float64 {
	if !r.PD || r.Requests == 0 {
		return math.NaN()
	}
	return float64(r.Bypassed) / float64(r.Requests)
}

// readShare is the share of the workload's prompt tokens whose KV the
// decodes read from the prefills (NaN: not PD).
func (r KVRun) readShare() float64 {
	if !r.PD || r.Queries == 0 {
		return math.NaN()
	}
	return float64(r.KVRead) / float64(r.Queries)
}

// HitRate is Hits/Queries.
func (r KVRun) HitRate() float64 {
	if r.Queries == 0 {
		return math.NaN()
	}
	return float64(r.Hits) / float64(r.Queries)
}

// KVReport is the result of RunKV.
type KVReport struct {
	Config KVConfig
	// Bound is the sum of Bounds, the repetitions' own.
	Bound   KVBound
	Bounds  []KVBound
	Options Options
	Machine string
	Runs    []KVRun
	Notes   []string
	Elapsed time.Duration
}

func (r *KVReport) head() (*time.Duration, *[]string) { return &r.Elapsed, &r.Notes }

// RunKV runs the comparison on a unified fleet and then a 2P2D NIXL fleet.
// Every run starts from empty caches and a fresh router; the policies
// alternate within each repetition. It writes kv.md under OutDir.
func RunKV(ctx context.Context, o Options, c KVConfig) (*KVReport, error) {
	bounds, bound, err := c.Bounds()
	if err != nil {
		return nil, fmt.Errorf("kv: %w", err)
	}
	return runScenario(ctx, o, scenarioSpec[*KVReport]{
		name: "kv", defMax: 10 * time.Minute, skipped: "runs",
		report: func(e *env) *KVReport {
			return &KVReport{Config: c, Bound: bound, Bounds: bounds, Options: e.o, Machine: e.m.String()}
		},
		run:     func(ctx context.Context, e *env, rep *KVReport) error { return e.runKV(ctx, c, rep) },
		partial: func(rep *KVReport) bool { return len(rep.Runs) > 0 },
		files:   []scenarioFile[*KVReport]{{c.fileName(), (*KVReport).WriteMarkdown}},
	})
}

// fileName is the report's file: kv.md, kv-2routers.md with replicas.
func (c KVConfig) fileName() string {
	name := "kv"
	if c.Routers > 1 {
		name += fmt.Sprintf("-%drouters", c.Routers)
	}
	if len(c.Rates) > 0 {
		name += "-rates"
	}
	return name + ".md"
}

// kvFleet is the workers of one phase and how a router is put in front.
type kvFleet struct {
	name string
	sims []*sim
	// pd: the fleet has prefills to bypass. Its hits are the prompt tokens
	// no worker computed (prefill_tokens of every worker against the
	// workload's prompt tokens): a bypassed request is computed on a
	// decode, and a decode's own prefix-cache counters also count the
	// split requests it only received KV for.
	pd   bool
	args func(policy string) []string
}

// pdOnly reports whether a --policies entry carries a PD-only router flag
// (--pd-...); it runs on the PD fleet alone.
func pdOnly(spec string) bool {
	_, extra := policyFlags(spec)
	return slices.ContainsFunc(extra, func(f string) bool { return strings.HasPrefix(f, "--pd-") })
}

func (e *env) runKV(ctx context.Context, c KVConfig, rep *KVReport) error {
	if !c.NoUnified {
		uf, err := e.kvUnified(ctx, c)
		if err != nil {
			return err
		}
		if err := e.kvPhase(ctx, c, uf, rep); err != nil {
			return err
		}
		e.g.stop(simProcs(uf.sims)...)
	}
	if !c.PD {
		return nil
	}
	pf, err := e.kvPD(ctx, c)
	if err != nil {
		return err
	}
	defer e.g.stop(simProcs(pf.sims)...)
	return e.kvPhase(ctx, c, pf, rep)
}

func simProcs(ss []*sim) []*proc {
	var ps []*proc
	for _, s := range ss {
		ps = append(ps, s.proc)
	}
	return ps
}

// pdNumBlocks is the --num-blocks of the PD workers: the 2 prefills
// together hold what the unified workers hold.
func (c KVConfig) pdNumBlocks() int { return c.NumBlocks * c.Unified / 2 }

// kvSimArgs are the prefix-cache and KV-event flags of a worker of
// numBlocks blocks.
func (c KVConfig) kvSimArgs(numBlocks int) []string {
	args := []string{"--block-size", strconv.Itoa(c.BlockSize), "--num-blocks", strconv.Itoa(numBlocks),
		"--max-model-len", strconv.Itoa(numBlocks * c.BlockSize), "--enable-prompt-tokens-details",
		"--kv-events-config", `{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}`}
	if c.Tokenizer != "" {
		args = append(args, "--tokenizer", c.Tokenizer)
	}
	return args
}

// kvRouterArgs are the kv_aware flags for the workers' event endpoints.
func kvRouterArgs(ctx context.Context, c KVConfig, sims []*sim) ([]string, error) {
	args := []string{"--kv-block-size", strconv.Itoa(c.BlockSize), "--kv-events-endpoints"}
	for _, s := range sims {
		st, err := getSimKV(ctx, s)
		if err != nil {
			return nil, err
		}
		ev := st.Engines[0].KVEvents
		args = append(args, s.URL()+"="+ev.Endpoint+","+ev.ReplayEndpoint)
	}
	return args, nil
}

func (e *env) kvUnified(ctx context.Context, c KVConfig) (*kvFleet, error) {
	f := &kvFleet{name: fmt.Sprintf("%d unified", c.Unified)}
	for i := range c.Unified {
		s, err := e.g.startSim(ctx, fmt.Sprintf("sim-kv-unified-%d", i), append([]string{"--role", "unified"}, c.kvSimArgs(c.NumBlocks)...)...)
		if err != nil {
			e.g.stop(simProcs(f.sims)...)
			return nil, err
		}
		f.sims = append(f.sims, s)
	}
	kv, err := kvRouterArgs(ctx, c, f.sims)
	if err != nil {
		e.g.stop(simProcs(f.sims)...)
		return nil, err
	}
	f.args = func(policy string) []string {
		policy, extra := policyFlags(policy)
		a := append([]string{"--policy", policy}, extra...)
		a = append(a, "--worker-urls")
		for _, s := range f.sims {
			a = append(a, s.URL())
		}
		return append(a, kv...)
	}
	return f, nil
}

func (e *env) kvPD(ctx context.Context, c KVConfig) (*kvFleet, error) {
	f := &kvFleet{name: "2P2D NIXL", pd: true}
	var ps, ds []*sim
	for _, role := range []string{"prefill", "prefill", "decode", "decode"} {
		s, err := e.g.startSim(ctx, fmt.Sprintf("sim-kv-%s-%d", role, len(f.sims)),
			append([]string{"--role", role, "--kv-connector", "nixl"}, c.kvSimArgs(c.pdNumBlocks())...)...)
		if err != nil {
			e.g.stop(simProcs(f.sims)...)
			return nil, err
		}
		f.sims = append(f.sims, s)
		if role == "prefill" {
			ps = append(ps, s)
		} else {
			ds = append(ds, s)
		}
	}
	kv, err := kvRouterArgs(ctx, c, f.sims)
	if err != nil {
		e.g.stop(simProcs(f.sims)...)
		return nil, err
	}
	f.args = func(policy string) []string {
		policy, extra := policyFlags(policy)
		a := append([]string{"--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", policy}, extra...)
		for _, s := range ps {
			a = append(a, "--prefill", s.URL())
		}
		for _, s := range ds {
			a = append(a, "--decode", s.URL())
		}
		return append(a, kv...)
	}
	return f, nil
}

// policyFlags splits a --policies entry "NAME+FLAG+FLAG..." (for example
// "kv_aware+--kv-load-weight=0.1") into the policy and extra router flags.
func policyFlags(spec string) (string, []string) {
	parts := strings.Split(spec, "+")
	return parts[0], parts[1:]
}

// kvPhase runs every (repetition, load point, policy) on one fleet, each
// repetition with its own dataset seed.
func (e *env) kvPhase(ctx context.Context, c0 KVConfig, f *kvFleet, rep *KVReport) error {
	for r := range c0.Repeats {
		c := c0
		c.Seed = c0.repSeed(r)
		for _, load := range c.loads() {
			for _, pol := range c.Policies {
				if !f.pd && pdOnly(pol) {
					continue
				}
				d, err := e.budget(c.PointTimeout, 15*time.Second)
				if err != nil {
					return err
				}
				run, err := e.kvRun(ctx, c, f, pol, load, d, rep.Bounds[r].Queries)
				if ctx.Err() != nil {
					return ctx.Err()
				}
				run.Rep = r + 1
				if err != nil {
					run.Note = firstLine(err.Error())
					rep.Notes = append(rep.Notes, fmt.Sprintf("%s %s %s rep %d: %s", f.name, pol, load.label(), r+1, firstLine(err.Error())))
				}
				rep.Runs = append(rep.Runs, run)
				e.printf("%-10s %-12s %-7s rep %d hit %5.1f%% %s\n", f.name, pol, load.label(), r+1, 100*run.HitRate(), rowSummary(run.Row))
			}
		}
	}
	return nil
}

// kvRun is one measured run: empty caches, a fresh router, the load.
// prompt is the workload's prompt tokens (the PD fleet's hit base).
func (e *env) kvRun(ctx context.Context, c KVConfig, f *kvFleet, policy string, load kvLoad, d time.Duration, prompt uint64) (KVRun, error) {
	run := KVRun{Fleet: f.name, PD: f.pd, Policy: policy, Concurrency: load.Conc, Rate: load.Rate}
	run.Row = failedRow("switchyard", policy, load.Conc, c.prompts())
	for _, s := range f.sims {
		if err := resetPrefixCache(ctx, s); err != nil {
			return run, err
		}
	}
	rs, err := e.startKVRouters(ctx, c, f, policy)
	defer func() {
		for _, r := range rs {
			e.g.stop(r.proc)
		}
	}()
	if err != nil {
		return run, err
	}
	before, err := prefixTotals(ctx, f.sims)
	if err != nil {
		return run, err
	}
	run.RouterCPU = math.NaN()
	cpu0 := math.NaN()
	if m, err := scrapeRouters(ctx, rs); err == nil {
		if v, ok := m["process_cpu_seconds_total"]; ok {
			cpu0 = v
		}
	}
	cfg := c.benchConfig(rs[0].base, load, d)
	for _, r := range rs[1:] {
		cfg.MoreBaseURLs = append(cfg.MoreBaseURLs, r.base)
	}
	res, err := bench.Run(ctx, cfg)
	if err != nil {
		return run, err
	}
	after, err := prefixTotals(ctx, f.sims)
	if err != nil {
		return run, err
	}
	run.Row = sweepRow("switchyard", policy, res)
	run.Requests = res.Metrics.Completed + res.Metrics.Failed
	if m, err := scrapeRouters(ctx, rs); err == nil {
		run.TokenizeCalls = uint64(m["vllm_router_kv_tokenize_requests_total"])
		run.TokenizeCacheHits = uint64(m["vllm_router_kv_tokenize_cache_hits_total"])
		run.TokenizeSeconds = m["vllm_router_kv_tokenize_seconds_total"]
		run.TokenizeLocal = uint64(m["vllm_router_kv_tokenize_local_total"])
		run.TokenizeVerified = uint64(m["vllm_router_kv_tokenize_verify_checks_total"])
		run.TokenizeBackground = uint64(m["vllm_router_kv_tokenize_verify_background_total"])
		run.Bypassed = uint64(m["vllm_router_kv_pd_bypass_total"])
		for _, k := range eventTroubleMetrics {
			if v := uint64(m["vllm_router_kv_"+k]); v > 0 {
				if run.EventTrouble == nil {
					run.EventTrouble = map[string]uint64{}
				}
				run.EventTrouble[k] = v
			}
		}
		if v, ok := m["process_cpu_seconds_total"]; ok {
			run.RouterCPU = v - cpu0
		}
	}
	run.Queries, run.Hits, run.Evictions = after.Queries-before.Queries, after.Hits-before.Hits, after.Evictions-before.Evictions
	var computed uint64
	for i := range min(len(after.Computed), len(before.Computed)) {
		run.Computed = append(run.Computed, after.Computed[i]-before.Computed[i])
		computed += run.Computed[i]
	}
	run.KVRead = after.KVRead - before.KVRead
	if f.pd {
		run.Queries, run.Hits = prompt, prompt-min(prompt, computed)
	}
	if errs := failureReasons(res, 3); len(errs) > 0 {
		return run, fmt.Errorf("%d failed: %s", res.Metrics.Failed, strings.Join(errs, " | "))
	}
	if res.Stopped {
		return run, errors.New("stopped by its max duration")
	}
	return run, nil
}

// startKVRouters starts c.Routers routers with the same flags in front of
// f (replicas: the load alternates over them) and waits until each is
// ready and, for kv_aware, follows every worker's events. The routers
// started are returned with any error.
func (e *env) startKVRouters(ctx context.Context, c KVConfig, f *kvFleet, policy string) ([]*router, error) {
	// The process (and log file) name: a flag's value may hold a path.
	name := "switchyard-kv-" + strings.NewReplacer("/", "_", "=", "_").Replace(policy)
	pname, _ := policyFlags(policy)
	var rs []*router
	for i := range max(c.Routers, 1) {
		n := name
		if i > 0 {
			n += "-replica" + strconv.Itoa(i+1)
		}
		r, mport, err := e.g.startRouter(ctx, n, func(extra int) []string {
			return append(f.args(policy), "--prometheus-port", strconv.Itoa(extra)) // the later flag wins
		})
		if err != nil {
			return rs, err
		}
		r.metrics = fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)
		rs = append(rs, r)
	}
	for _, r := range rs {
		if err := r.waitReady(ctx); err != nil {
			return rs, err
		}
		if pname == "kv_aware" {
			if err := waitKVEvents(ctx, r, len(f.sims)); err != nil {
				return rs, err
			}
		}
	}
	return rs, nil
}

// scrapeRouters sums the unlabelled /metrics samples of every router.
func scrapeRouters(ctx context.Context, rs []*router) (map[string]float64, error) {
	sum := map[string]float64{}
	for _, r := range rs {
		m, err := scrapeMetrics(ctx, r.metrics)
		if err != nil {
			return nil, err
		}
		for k, v := range m {
			sum[k] += v
		}
	}
	return sum, nil
}

// eventTroubleMetrics are the kv_aware counters (vllm_router_kv_...) a
// run reports when not zero.
var eventTroubleMetrics = []string{"event_gaps_total", "replay_failures_total", "index_resets_total",
	"publisher_restarts_total", "orphan_blocks_total", "events_malformed_total", "tokenize_verify_mismatches_total"}

// trouble formats EventTrouble for the every-run table.
func (r KVRun) trouble() string {
	var parts []string
	for _, k := range eventTroubleMetrics {
		if v := r.EventTrouble[k]; v > 0 {
			parts = append(parts, fmt.Sprintf("%s %d", strings.TrimSuffix(k, "_total"), v))
		}
	}
	return strings.Join(parts, ", ")
}

// scrapeMetrics reads the unlabelled samples of a Prometheus /metrics page.
func scrapeMetrics(ctx context.Context, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, l := range strings.Split(string(b), "\n") {
		name, v, ok := strings.Cut(l, " ")
		if !ok || strings.HasPrefix(l, "#") || strings.Contains(name, "{") {
			continue
		}
		if f, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil {
			out[name] = f
		}
	}
	return out, nil
}

// benchConfig is sybench's shared-prefix load of one run.
func (c KVConfig) benchConfig(base string, load kvLoad, d time.Duration) bench.Config {
	cfg := bench.DefaultConfig()
	cfg.BaseURL = base
	cfg.Backend = bench.BackendVLLM
	if c.Chat {
		cfg.Backend = bench.BackendOpenAIChat
	}
	cfg.Model = simModel
	cfg.DatasetName = bench.DatasetSharedPrefix
	cfg.SharedPrefixGroups, cfg.SharedPrefixPromptsPerGroup, cfg.SharedPrefixLen = c.Groups, c.PerGroup, c.PrefixLen
	cfg.SharedPrefixTurns = c.Turns
	cfg.InputLen, cfg.OutputLen, cfg.RangeRatio = c.QuestionLen, c.OutputLen, 0
	cfg.NumPrompts = c.prompts()
	cfg.NumWarmups = 0
	cfg.MaxConcurrency = load.Conc
	if load.Rate > 0 {
		cfg.RequestRate = load.Rate // Poisson arrivals (burstiness 1)
	}
	cfg.IgnoreEOS = true
	cfg.Seed = c.Seed
	cfg.MaxDuration = d
	cfg.DiscardText = true
	cfg.MetricPercentiles = []float64{50, 99}
	return cfg
}

// flags is the equivalent sybench command line of one run (for docs).
func (c KVConfig) flags(load kvLoad) string {
	backend := "vllm"
	if c.Chat {
		backend = "openai-chat"
	}
	rate := ""
	if load.Rate > 0 {
		rate = " --request-rate " + strconv.FormatFloat(load.Rate, 'g', -1, 64)
	}
	return fmt.Sprintf("--backend %s --dataset-name shared-prefix --shared-prefix-groups %d --shared-prefix-prompts-per-group %d --shared-prefix-len %d --random-input-len %d --random-range-ratio 0 --random-output-len %d --shared-prefix-turns %d --num-prompts %d --num-warmups 0%s --max-concurrency %d --ignore-eos --seed %d",
		backend, c.Groups, c.PerGroup, c.PrefixLen, c.QuestionLen, c.OutputLen, c.Turns, c.prompts(), rate, load.Conc, c.Seed)
}

// simKV is the prefix-cache part of vllm-sim's /sim/stats.
type simKV struct {
	Engines []struct {
		PrefillTokens uint64 `json:"prefill_tokens"`
		PrefixCache   struct {
			Queries      uint64 `json:"queries"`
			Hits         uint64 `json:"hits"`
			CachedBlocks int    `json:"cached_blocks"`
			Evictions    uint64 `json:"evictions"`
			ResetsFailed uint64 `json:"resets_failed"`
		} `json:"prefix_cache"`
		KVEvents *struct {
			Endpoint       string `json:"endpoint"`
			ReplayEndpoint string `json:"replay_endpoint"`
		} `json:"kv_events"`
	} `json:"engines"`
	Transfers struct {
		TokensRead uint64 `json:"tokens_read"`
	} `json:"transfers"`
}

func getJSON(ctx context.Context, url string, v any) error {
	client := &http.Client{Timeout: httpGetTimeout}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: HTTP %d", url, resp.StatusCode)
	}
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		return fmt.Errorf("GET %s: %w", url, err)
	}
	return nil
}

func getSimKV(ctx context.Context, s *sim) (simKV, error) {
	var st simKV
	if err := getJSON(ctx, s.URL()+"/sim/stats", &st); err != nil {
		return st, err
	}
	if len(st.Engines) == 0 || st.Engines[0].KVEvents == nil {
		return st, fmt.Errorf("%s publishes no KV events", s.name)
	}
	return st, nil
}

type prefixTotal struct {
	Queries, Hits, Evictions uint64
	Computed                 []uint64 // prompt tokens each sim computed
	KVRead                   uint64   // tokens the decodes read (NIXL)
}

func prefixTotals(ctx context.Context, ss []*sim) (prefixTotal, error) {
	var t prefixTotal
	for _, s := range ss {
		st, err := getSimKV(ctx, s)
		if err != nil {
			return t, err
		}
		var computed uint64
		for _, en := range st.Engines {
			t.Queries += en.PrefixCache.Queries
			t.Hits += en.PrefixCache.Hits
			t.Evictions += en.PrefixCache.Evictions
			computed += en.PrefillTokens
		}
		t.Computed = append(t.Computed, computed)
		t.KVRead += st.Transfers.TokensRead
	}
	return t, nil
}

// resetPrefixCache empties s's prefix cache (POST /reset_prefix_cache) and
// waits until /sim/stats shows no cached block; an engine with blocks in
// use refuses, so it retries until the deadline.
func resetPrefixCache(ctx context.Context, s *sim) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	client := &http.Client{Timeout: httpGetTimeout}
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/reset_prefix_cache", nil)
		if resp, err := client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		st, err := getSimKV(ctx, s)
		if err == nil && st.Engines[0].PrefixCache.CachedBlocks == 0 {
			return nil
		}
		if err := pause(ctx); err != nil {
			return fmt.Errorf("%s: prefix cache not emptied: %w", s.name, err)
		}
	}
}

// pause waits pollInterval, or returns ctx's error first.
func pause(ctx context.Context) error {
	t := time.NewTimer(pollInterval)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// waitKVEvents waits until the router has applied events of n workers
// (the reset's AllBlocksCleared, replayed), so kv_aware routes by them.
func waitKVEvents(ctx context.Context, r *router, n int) error {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for {
		var ws struct {
			KV struct {
				Workers map[string]struct {
					Events bool `json:"events"`
				} `json:"workers"`
			} `json:"kv_aware"`
		}
		if err := getJSON(ctx, r.base+"/workers", &ws); err == nil {
			k := 0
			for _, w := range ws.KV.Workers {
				if w.Events {
					k++
				}
			}
			if k >= n {
				return nil
			}
		}
		if err := pause(ctx); err != nil {
			return fmt.Errorf("router has no KV events of every worker: %w", err)
		}
	}
}

// kvAgg is the median over repetitions of one (fleet, C, policy).
type kvAgg struct {
	Fleet              string
	PD                 bool
	Policy             string
	Load               kvLoad
	N                  int
	HitRate, TTFT50    float64
	TTFT99, Throughput float64
	TPOT50             float64
	Evictions, Failed  float64
	CPUPer1k           float64 // router CPU s per 1000 requests
	Bypassed           float64 // share of requests sent to a decode alone (NaN: not PD)
	KVRead             float64 // share of prompt tokens the decodes read (NaN: not PD)
}

func median(xs []float64) float64 {
	ys := slices.Clone(xs)
	ys = slices.DeleteFunc(ys, math.IsNaN)
	if len(ys) == 0 {
		return math.NaN()
	}
	slices.Sort(ys)
	if len(ys)%2 == 1 {
		return ys[len(ys)/2]
	}
	return (ys[len(ys)/2-1] + ys[len(ys)/2]) / 2
}

// aggregate returns the medians per (fleet, C, policy) in the order of
// their first run (fleet, then C, then policy).
func (r *KVReport) aggregate() []kvAgg {
	var out []kvAgg
	idx := map[string]int{}
	type acc struct{ hit, t50, t99, tpot, thr, ev, failed, cpu, byp, read []float64 }
	accs := []acc{}
	for _, run := range r.Runs {
		k := fmt.Sprintf("%s|%s|%s", run.Fleet, run.load(), run.Policy)
		i, ok := idx[k]
		if !ok {
			i = len(out)
			idx[k] = i
			out = append(out, kvAgg{Fleet: run.Fleet, PD: run.PD, Policy: run.Policy, Load: run.load()})
			accs = append(accs, acc{})
		}
		a := &accs[i]
		a.hit = append(a.hit, run.HitRate())
		a.t50 = append(a.t50, run.Row.TTFTP50)
		a.t99 = append(a.t99, run.Row.TTFTP99)
		a.tpot = append(a.tpot, run.Row.TPOTP50)
		a.thr = append(a.thr, run.Row.RequestThroughput)
		a.ev = append(a.ev, float64(run.Evictions))
		a.failed = append(a.failed, float64(run.Row.Failed))
		a.cpu = append(a.cpu, 1000*run.RouterCPU/float64(run.Requests))
		a.byp = append(a.byp, run.bypassShare())
		a.read = append(a.read, run.readShare())
		out[i].N++
	}
	for i := range out {
		a := accs[i]
		out[i].HitRate, out[i].TTFT50, out[i].TTFT99 = median(a.hit), median(a.t50), median(a.t99)
		out[i].Throughput, out[i].Evictions, out[i].Failed = median(a.thr), median(a.ev), median(a.failed)
		out[i].TPOT50 = median(a.tpot)
		out[i].CPUPer1k, out[i].Bypassed, out[i].KVRead = median(a.cpu), median(a.byp), median(a.read)
	}
	return out
}

// pairedBelow compares policy with other run by run at one fleet and
// load point, the two runs of a repetition paired (they sent the same
// dataset): in how many of the n pairs policy's TTFT P50 was the lower.
func (r *KVReport) pairedBelow(fleet string, load kvLoad, policy, other string) (below, n int) {
	ttft := map[string]map[int]float64{policy: {}, other: {}}
	for _, run := range r.Runs {
		if m, ok := ttft[run.Policy]; ok && run.Fleet == fleet && run.load() == load {
			m[run.Rep] = run.Row.TTFTP50
		}
	}
	for rep, t := range ttft[policy] {
		if o, ok := ttft[other][rep]; ok {
			n++
			if t < o {
				below++
			}
		}
	}
	return below, n
}

// writeTokenize writes the router tokenizer's cost in the kv_aware runs
// (medians over repetitions) next to the TTFT P50 gap to cache_aware.
func (r *KVReport) writeTokenize(b *bytes.Buffer) {
	type key struct {
		fleet, policy string
		load          kvLoad
	}
	calls, bg, local, mean := map[key][]float64{}, map[key][]float64{}, map[key][]float64{}, map[key][]float64{}
	var order []key
	for _, run := range r.Runs {
		if name, _ := policyFlags(run.Policy); name != "kv_aware" || run.tokenized() == 0 {
			continue
		}
		k := key{run.Fleet, run.Policy, run.load()}
		if _, ok := calls[k]; !ok {
			order = append(order, k)
		}
		n := float64(run.tokenized())
		inline := run.TokenizeCalls - min(run.TokenizeCalls, run.TokenizeBackground)
		calls[k] = append(calls[k], float64(inline)/n)
		bg[k] = append(bg[k], float64(run.TokenizeBackground)/n)
		local[k] = append(local[k], float64(run.TokenizeLocal)/n)
		mean[k] = append(mean[k], run.TokenizeMeanMS())
	}
	if len(order) == 0 {
		return
	}
	t50 := map[key]float64{}
	for _, a := range r.aggregate() {
		t50[key{a.Fleet, a.Policy, a.Load}] = a.TTFT50
	}
	fmt.Fprintf(b, "\n## The router's /tokenize calls (kv_aware)\n\nShare of requests that waited for an engine's /tokenize before being routed (with `--tokenizer-path`: the first prompts' checks), whose local ids were checked at an engine in the background, after they were routed, and tokenized in-process (the rest hit its cache), the mean wall time of one /tokenize call as the router measured it (`vllm_router_kv_tokenize_seconds_total` / `vllm_router_kv_tokenize_requests_total`), and kv_aware's TTFT P50 minus cache_aware's.\n\n| fleet | %s | policy | requests waiting for /tokenize | checked in the background | tokenized in the router | mean /tokenize ms | TTFT P50 − cache_aware's ms |\n|---|---|---|---|---|---|---|---|\n", r.Config.loadColumn())
	for _, k := range order {
		gap := math.NaN()
		if ca, ok := t50[key{k.fleet, "cache_aware", k.load}]; ok {
			gap = t50[k] - ca
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", k.fleet, k.load, k.policy, pct(median(calls[k])), pct(median(bg[k])), pct(median(local[k])), ms(median(mean[k])), ms(gap))
	}
}

// cpu3 is seconds with 3 decimals, "–" when unknown.
func cpu3(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "–"
	}
	return fmt.Sprintf("%.3f", v)
}

// pctDash is pct with "–" for NaN (not applicable).
func pctDash(v float64) string {
	if math.IsNaN(v) {
		return "–"
	}
	return pct(v)
}

func pct(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.1f %%", 100*v)
}

// points formats a difference of rates in percentage points.
func points(v float64) string {
	if math.IsNaN(v) {
		return "n/a"
	}
	return fmt.Sprintf("%.1f", 100*v)
}

// datasets says, for the bound, that it sums several datasets ("" when
// every repetition sent the same).
func (r *KVReport) datasets() string {
	if len(r.Bounds) > 1 && r.Config.SeedStep != 0 {
		return fmt.Sprintf(", the %d repetitions' datasets together", len(r.Bounds))
	}
	return ""
}

// WriteMarkdown writes the report.
func (r *KVReport) WriteMarkdown(w io.Writer) error {
	c := r.Config
	var b bytes.Buffer
	best := r.Bound.Rate()
	fmt.Fprintf(&b, "# KV-aware routing: shared-prefix workload\n\n")
	fmt.Fprintf(&b, "`%s` on %s, %s.\n\n", r.Options.Command, r.Machine, sec(r.Elapsed))
	conv := "each prompt its group's system prompt and a distinct question"
	if c.Turns > 1 {
		conv = fmt.Sprintf("each group's requests are conversations of %d turns; turn t resends the system prompt, the earlier questions and an answer of %d words for each, then its question; requests are sent turn by turn (every conversation's first turn, then every second turn, ...)", c.Turns, c.OutputLen)
	}
	fmt.Fprintf(&b, "Workload: %d groups × %d requests, %d-token system prompts, %d-token questions, %d output tokens; %s; groups interleaved (sybench `%s`).\n",
		c.Groups, c.PerGroup, c.PrefixLen, c.QuestionLen, c.OutputLen, conv, c.flags(c.loads()[0]))
	seeds := ""
	if c.SeedStep != 0 && c.Repeats > 1 {
		seeds = fmt.Sprintf(", repetition r sending the dataset of seed %d + (r − 1) × %d (the same for every policy and fleet)", c.Seed, c.SeedStep)
	}
	fmt.Fprintf(&b, "Workers: %d unified vllm-sims `%s`, then 2 prefill + 2 decode (NIXL) `%s` (the prefills together hold what the unified workers hold), preset default, KV events on. Each run starts with every worker's prefix cache reset and a new router; policies interleaved within each repetition; repetitions: %d%s (tables: medians).\n\n",
		c.Unified, strings.Join(c.kvSimArgs(c.NumBlocks)[:7], " "), strings.Join(c.kvSimArgs(c.pdNumBlocks())[:7], " "), c.Repeats, seeds)
	if c.Routers > 1 {
		fmt.Fprintf(&b, "Routers: %d replicas with the same flags in front of each fleet; request i goes to replica i mod %d (as behind a load balancer). Each kv_aware replica follows every worker's events; each cache_aware replica grows its own tree from the requests it sees. Router CPU: the replicas' sum.\n\n", c.Routers, c.Routers)
	}
	fmt.Fprintf(&b, "**Best achievable hit rate: %s** (%d of %d prompt tokens%s). Each request is credited with the longest full-block prefix (at most its prompt less one token) it shares with any request sent before it, as if every block stayed cached and every request went where its prefix is; generated tokens never match (the resent answers are stand-ins). The workload has %d distinct blocks; the longest prompt is %d tokens.\n\n",
		pct(best), r.Bound.Hits, r.Bound.Queries, r.datasets(), r.Bound.Blocks, r.Bound.MaxPrompt)
	fmt.Fprintf(&b, "**Best achievable with the fleet's caches** (the bound the targets use): %s with the unified workers' %d blocks (%d × %d); %s with the PD prefills' %d (2 × %d), for a policy that splits every request; %s with all four PD workers' %d, for one that may send a request to a decode alone. Each is the most hits one cache of that many blocks could get, played with perfect foresight over the requests in the order sent: a reference to a block stores it, any block can be dropped at any time, and the blocks kept are those wanted again soonest (Belady's rule, with the option not to store). No fleet of that capacity can do better whatever its routing and eviction: at every moment the union of its caches is a set a single cache could hold, a block held twice counts once, and a hit is counted block by block without asking that the blocks before it hit. It assumes a request's blocks are stored the moment it is sent, which only helps.\n\n",
		pct(r.Bound.CappedRate(cachesUnified)), c.capacity(cachesUnified), c.Unified, c.NumBlocks,
		pct(r.Bound.CappedRate(cachesPrefills)), c.capacity(cachesPrefills), c.pdNumBlocks(),
		pct(r.Bound.CappedRate(cachesPD)), c.capacity(cachesPD))
	fmt.Fprintf(&b, "Hit rate, unified fleet = Δ`vllm:prefix_cache_hits` / Δ`vllm:prefix_cache_queries` over the run, read from the workers (`/sim/stats` `prefix_cache`, the same counters). PD fleet = 1 − (prompt tokens computed by any worker, Δ`/sim/stats` `prefill_tokens` of the prefills and the decodes) / (the workload's prompt tokens): a request the router sends to a decode alone (prefill bypass, `--pd-uncached-token-threshold`) is computed there, and a decode's own counters also count the split requests it only receives KV for. Evictions: every worker of the fleet. KV read by decodes = Δ`/sim/stats` `transfers.tokens_read` of the decodes / the workload's prompt tokens: as vLLM's NIXL connector, a decode reads only the blocks its own prefix cache lacks. A policy entry with a `--pd-` flag runs on the PD fleet only.\n\n")
	fmt.Fprintf(&b, "| fleet | %s | policy | hit rate | bound | bound − hit (points) | TTFT P50 ms | TTFT P99 ms | TPOT P50 ms | req/s | evictions | failed | prefill bypassed | KV read by decodes | router CPU s / 1k req |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", c.loadColumn())
	aggs := r.aggregate()
	for _, a := range aggs {
		bound := r.Bound.CappedRate(cachesOf(a.PD, a.Policy))
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.2f | %.0f | %.0f | %s | %s | %s |\n", a.Fleet, a.Load, a.Policy,
			pct(a.HitRate), pct(bound), points(bound-a.HitRate), ms(a.TTFT50), ms(a.TTFT99), ms(a.TPOT50), a.Throughput, a.Evictions, a.Failed, pctDash(a.Bypassed), pctDash(a.KVRead), cpu3(a.CPUPer1k))
	}
	fmt.Fprintf(&b, "\n## Targets\n\n")
	for _, a := range aggs {
		if name, _ := policyFlags(a.Policy); name != "kv_aware" {
			continue
		}
		bound := r.Bound.CappedRate(cachesOf(a.PD, a.Policy))
		line := fmt.Sprintf("- %s %s: %s hit rate %s, %s points below the fleet's bound %s (target ≤ 5 points: %s)", a.Fleet, a.Load.label(), a.Policy,
			pct(a.HitRate), points(bound-a.HitRate), pct(bound), map[bool]string{true: "met", false: "missed"}[bound-a.HitRate <= 0.05])
		for _, o := range aggs {
			if o.Fleet == a.Fleet && o.Load == a.Load && o.Policy == "cache_aware" {
				below, n := r.pairedBelow(a.Fleet, a.Load, a.Policy, "cache_aware")
				line += fmt.Sprintf("; TTFT P50 %s ms vs cache_aware %s ms (%s; lower in %d of %d repetitions)", ms(a.TTFT50), ms(o.TTFT50),
					map[bool]string{true: "below", false: "not below"}[a.TTFT50 < o.TTFT50], below, n)
			}
		}
		fmt.Fprintln(&b, line+".")
	}
	r.writeTokenize(&b)
	fmt.Fprintf(&b, "\n## Every run\n\n| fleet | %s | rep | policy | queries | hits | hit rate | TTFT P50 ms | req/s | bypassed | /tokenize calls, mean ms | tokens computed per worker, k | note |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n", c.loadColumn())
	for _, run := range r.Runs {
		tok := ""
		if run.TokenizeCalls > 0 {
			tok = fmt.Sprintf("%d, %s", run.TokenizeCalls, ms(run.TokenizeMeanMS()))
		}
		byp := ""
		if run.Bypassed > 0 {
			byp = strconv.FormatUint(run.Bypassed, 10)
		}
		per := make([]string, len(run.Computed))
		for i, t := range run.Computed {
			per[i] = fmt.Sprintf("%.0f", float64(t)/1000)
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s | %d | %d | %s | %s | %.2f | %s | %s | %s | %s |\n", run.Fleet, run.load(), run.Rep, run.Policy,
			run.Queries, run.Hits, pct(run.HitRate()), ms(run.Row.TTFTP50), run.Row.RequestThroughput, byp, tok, strings.Join(per, " / "), strings.TrimPrefix(strings.Join([]string{run.Note, run.trouble()}, "; "), "; "))
	}
	if len(r.Notes) > 0 {
		fmt.Fprintf(&b, "\n## Notes\n\n")
		for _, n := range r.Notes {
			fmt.Fprintf(&b, "- %s\n", n)
		}
	}
	_, err := w.Write(b.Bytes())
	return err
}
