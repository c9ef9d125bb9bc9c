package config

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Flags of the kv_aware policy (docs/KV-ROUTING.md). The names of
// vllm-router PR #130 are kept: --kv-block-size, --kv-hash-seed,
// --kv-speculative-indexing, --kv-speculative-ttl-ms,
// --pd-uncached-token-threshold.
func kvFlagDefs(c *Config) []flagDef {
	return []flagDef{
		{extra: true, name: "kv-block-size", meta: "N", usage: "kv_aware: tokens per KV block; must equal the engines' --block-size", value: intValue{&c.KVBlockSize}},
		{extra: true, name: "kv-hash-seed", meta: "N", usage: "kv_aware: seed of the router's chained block hash", value: uintValue[uint64]{&c.KVHashSeed}},
		{extra: true, name: "kv-speculative-indexing", usage: "kv_aware: record a routed prompt's blocks on its worker until the engine's events confirm them (use =false to disable)", value: boolValue{&c.KVSpeculativeIndexing}},
		{extra: true, name: "kv-speculative-ttl-ms", meta: "MS", usage: "kv_aware: lifetime of a speculative entry", value: uintValue[uint64]{&c.KVSpeculativeTTLMS}},
		{extra: true, name: "kv-index-max-entries", meta: "N", usage: "kv_aware: blocks x workers the index keeps at most (stores past it are dropped and counted)", value: intValue{&c.KVIndexMaxEntries}},
		{extra: true, name: "kv-events-port", meta: "PORT", usage: "kv_aware: port of every worker's KV event publisher (vLLM --kv-events-config endpoint; DP rank r uses PORT+r)", value: uintValue[uint16]{&c.KVEventsPort}},
		{extra: true, name: "kv-events-replay-port", meta: "PORT", usage: "kv_aware: port of every worker's replay endpoint (0 = none: gaps reset the worker's entries)", value: uintValue[uint16]{&c.KVEventsReplayPort}},
		{extra: true, name: "kv-events-topic", meta: "TOPIC", usage: "kv_aware: topic prefix subscribed to (vLLM's default topic is empty)", value: stringValue{&c.KVEventsTopic}},
		{extra: true, name: "kv-events-endpoints", meta: "URL=ENDPOINT[,REPLAY]", multi: true, usage: "kv_aware: a worker's event endpoints, overriding the ports (e.g. http://p1:8000=tcp://p1:5557,tcp://p1:5558)", value: &listValue{p: &c.KVEventsEndpoints}},
		{extra: true, name: "kv-overlap-score-weight", meta: "W", usage: "kv_aware: weight of the prompt tokens a worker must compute", value: floatValue{&c.KVOverlapScoreWeight}},
		{extra: true, name: "kv-load-weight", meta: "W", usage: "kv_aware: weight of a worker's requests in flight, in prompts", value: floatValue{&c.KVLoadWeight}},
		{extra: true, name: "kv-tie-band", meta: "FRACTION", usage: "kv_aware: workers whose cost is within this fraction of the prompt of the cheapest are equal, and the one holding fewest blocks is taken (0 = exact ties only)", value: floatValue{&c.KVTieBand}},
		{extra: true, name: "kv-fallback-policy", meta: "POLICY", usage: "kv_aware: policy for prompts it cannot tokenize and fleets without events", value: enumValue{&c.KVFallbackPolicy, fallbackPolicyNames}},
		{extra: true, name: "tokenizer-path", meta: "PATH", usage: "kv_aware: tokenizer.json (or a model directory holding one) to tokenize string completions prompts, and plain chat requests with the directory's chat template, in-process; checked against the engines' /tokenize", value: stringValue{&c.TokenizerPath}},
		{extra: true, name: "chat-template", meta: "FILE", usage: "kv_aware with --tokenizer-path: the chat template the engines serve (their --chat-template), instead of the model directory's", value: stringValue{&c.ChatTemplate}},
		{extra: true, name: "pd-uncached-token-threshold", meta: "N", usage: "PD with kv_aware: send a request to the decode alone when fewer than N of its prompt tokens are uncached there (0 = always split)", value: intValue{&c.PDUncachedTokenThreshold}},
	}
}

var fallbackPolicyNames = []string{PolicyRandom, PolicyRoundRobin, PolicyCacheAware, PolicyPowerOfTwo, PolicyConsistentHash, PolicyRendezvousHash}

// UsesKVAware reports whether a policy in use is kv_aware.
func (c *Config) UsesKVAware() bool {
	if c.Mode() == ModeVLLMPD {
		return c.EffectivePrefillPolicy() == PolicyKVAware || c.EffectiveDecodePolicy() == PolicyKVAware
	}
	return c.Policy == PolicyKVAware
}

// KVSpeculativeTTL is --kv-speculative-ttl-ms.
func (c *Config) KVSpeculativeTTL() time.Duration {
	return time.Duration(c.KVSpeculativeTTLMS) * time.Millisecond
}

// KVEndpoint is one --kv-events-endpoints entry.
type KVEndpoint struct {
	URL, Endpoint, Replay string
}

// KVEndpointList parses --kv-events-endpoints.
func (c *Config) KVEndpointList() ([]KVEndpoint, error) {
	var out []KVEndpoint
	for _, e := range c.KVEventsEndpoints {
		u, eps, ok := strings.Cut(e, "=")
		if !ok || u == "" || eps == "" {
			return nil, fmt.Errorf("%q: want URL=tcp://HOST:PORT[,tcp://HOST:PORT]", e)
		}
		ep, replay, _ := strings.Cut(eps, ",")
		for _, z := range []string{ep, replay} {
			if z == "" {
				continue
			}
			zu, err := url.Parse(z)
			if err != nil || zu.Scheme != "tcp" || zu.Port() == "" {
				return nil, fmt.Errorf("%q: %q is not tcp://HOST:PORT", e, z)
			}
		}
		out = append(out, KVEndpoint{URL: strings.TrimRight(u, "/"), Endpoint: ep, Replay: replay})
	}
	return out, nil
}

// validateKV checks the kv_aware flags when the policy is in use.
func (c *Config) validateKV(add func(*Error)) {
	if !c.UsesKVAware() {
		if c.PDUncachedTokenThreshold > 0 && c.IsSet("pd-uncached-token-threshold") {
			add(invalid("--pd-uncached-token-threshold", strconv.Itoa(c.PDUncachedTokenThreshold), "needs --policy (or --prefill-policy) kv_aware"))
		}
		if c.TokenizerPath != "" {
			add(invalid("--tokenizer-path", c.TokenizerPath, "needs --policy (or --prefill-policy) kv_aware"))
		}
		if c.ChatTemplate != "" {
			add(invalid("--chat-template", c.ChatTemplate, "needs --policy (or --prefill-policy) kv_aware"))
		}
		return
	}
	if c.ChatTemplate != "" && c.TokenizerPath == "" {
		add(invalid("--chat-template", c.ChatTemplate, "needs --tokenizer-path"))
	}
	if c.KVBlockSize <= 0 || c.KVBlockSize > 1<<16 {
		add(invalid("--kv-block-size", strconv.Itoa(c.KVBlockSize), "Must be between 1 and 65536"))
	}
	if c.KVIndexMaxEntries <= 0 {
		add(invalid("--kv-index-max-entries", strconv.Itoa(c.KVIndexMaxEntries), "Must be > 0"))
	}
	if c.KVEventsPort == 0 {
		add(invalid("--kv-events-port", "0", "Port must be > 0"))
	}
	if !(c.KVOverlapScoreWeight >= 0) {
		add(invalid("--kv-overlap-score-weight", formatFloat(c.KVOverlapScoreWeight), "Must be >= 0"))
	}
	if !(c.KVLoadWeight >= 0) {
		add(invalid("--kv-load-weight", formatFloat(c.KVLoadWeight), "Must be >= 0"))
	}
	if !(c.KVTieBand >= 0 && c.KVTieBand <= 1) {
		add(invalid("--kv-tie-band", formatFloat(c.KVTieBand), "Must be between 0.0 and 1.0"))
	}
	switch {
	case c.PDUncachedTokenThreshold < 0:
		add(invalid("--pd-uncached-token-threshold", strconv.Itoa(c.PDUncachedTokenThreshold), "Must be >= 0"))
	case c.PDUncachedTokenThreshold > 0 && c.Mode() != ModeVLLMPD && c.Mode() != ModeIGW:
		// Only a PD fleet has a prefill to bypass.
		add(invalid("--pd-uncached-token-threshold", strconv.Itoa(c.PDUncachedTokenThreshold), "needs --vllm-pd-disaggregation (or --enable-igw with PD workers)"))
	}
	if _, err := c.KVEndpointList(); err != nil {
		add(invalid("--kv-events-endpoints", strings.Join(c.KVEventsEndpoints, " "), err.Error()))
	}
}
