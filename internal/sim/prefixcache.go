package sim

import (
	"fmt"
	"io"
	"net/http"
	"strings"
)

// outputToken is the id of generated token i, as the engine's prefix cache
// hashes it (the same id the response text is made of).
func (j *job) outputToken(i int) uint32 {
	return j.token(i)
}

// cachedTokens is what vLLM reports as num_cached_tokens for a response:
// the prompt tokens its (last) engine request found in the prefix cache.
func cachedTokens(jobs []*job) int {
	if h := jobs[len(jobs)-1].handle(); h != nil {
		return h.CachedTokens()
	}
	return 0
}

// promptTokensDetails is usage.prompt_tokens_details: vLLM sets it only
// with --enable-prompt-tokens-details and a non-zero cached count (its
// `if self.enable_prompt_tokens_details and num_cached_tokens`), else null.
func (in *Instance) promptTokensDetails(cached int) any {
	if !in.cfg.Cache.PromptTokensDetails || cached == 0 {
		return nil
	}
	return map[string]int{"cached_tokens": cached}
}

// appendPromptTokensDetails adds the streaming usage's prompt_tokens_details
// to a usage object just written by appendUsage (vLLM drops it when null).
func (in *Instance) appendPromptTokensDetails(b []byte, cached int) []byte {
	if !in.cfg.Cache.PromptTokensDetails || cached == 0 || len(b) == 0 || b[len(b)-1] != '}' {
		return b
	}
	b = b[:len(b)-1]
	return append(fmt.Appendf(b, `,"prompt_tokens_details":{"cached_tokens":%d}`, cached), '}')
}

// handleResetPrefixCache is vLLM's POST /reset_prefix_cache: every engine
// drops its cached blocks (an AllBlocksCleared event). As in vLLM the
// answer is 200 even when an engine refuses because blocks are in use (it
// logs a warning; /sim/stats counts resets_failed).
func (in *Instance) handleResetPrefixCache(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, maxBodyBytes))
	for rank, e := range in.engines {
		if !e.ResetPrefixCache() {
			in.log.Warn("failed to reset prefix cache because some blocks are not freed yet", "dp_rank", rank)
		}
	}
	w.WriteHeader(http.StatusOK)
}

// writePrefixCacheMetrics adds vLLM's prefix-cache counters, in tokens, per
// engine (vllm/v1/metrics/loggers.py: vllm:prefix_cache_queries and
// vllm:prefix_cache_hits, labels model_name and engine).
func (in *Instance) writePrefixCacheMetrics(b *strings.Builder, model string) {
	counter := func(name, help string, val func(i int) uint64) {
		fmt.Fprintf(b, "# HELP %s %s\n# TYPE %s counter\n", name, help, name)
		for i := range in.engines {
			fmt.Fprintf(b, "%s{engine=\"%d\",model_name=%s} %d\n", name, i, model, val(i))
		}
	}
	counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
		func(i int) uint64 { return in.engines[i].PrefixCacheStats().Queries })
	counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
		func(i int) uint64 { return in.engines[i].PrefixCacheStats().Hits })
}
