package kvaware

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
)

// The router needs a request's prompt as the engine's token ids, chat
// template included, or its block keys mean nothing. It asks the engine:
// vLLM's own POST /tokenize applies the same tokenizer and chat template
// the generation will, so the ids are exact by construction, whatever the
// model (an in-process tokenizer would have to reimplement every
// HuggingFace pre-tokenizer and a Jinja engine, and still drift with
// vLLM's template handling). The cost is one local HTTP round trip per new
// prompt, hidden by a cache keyed by the fields that decide the tokens.
// docs/KV-ROUTING.md has the measured latency.

// ErrNotTokenizable marks a request the router does not tokenize exactly
// (a batch of prompts, an unknown route, media inputs): it is routed by the
// fallback policy.
var ErrNotTokenizable = errors.New("prompt not tokenizable by the router")

// Tokenizer turns generation request bodies into token ids through an
// engine's /tokenize, with a bounded cache.
type Tokenizer struct {
	client  *http.Client
	timeout time.Duration

	// S counts the calls that found the prompt cached and those that
	// asked an engine, with the time spent asking.
	S TokenizeStats

	mu    sync.Mutex
	cache map[uint64]*cacheEntry
	order []uint64 // insertion order, for eviction
	max   int
}

// TokenizeStats are a Tokenizer's running totals.
type TokenizeStats struct {
	CacheHits, Asks atomic.Uint64 // prompts found in the cache; /tokenize calls
	AskNanos        atomic.Uint64 // wall time of the /tokenize calls
}

type cacheEntry struct {
	tokens []uint32
}

// NewTokenizer returns a tokenizer asking engines through client, each
// call bounded by timeout, caching up to maxEntries prompts.
func NewTokenizer(client *http.Client, timeout time.Duration, maxEntries int) *Tokenizer {
	if timeout <= 0 {
		timeout = 2 * time.Second
	}
	if maxEntries <= 0 {
		maxEntries = 4096
	}
	return &Tokenizer{client: client, timeout: timeout, cache: map[uint64]*cacheEntry{}, max: maxEntries}
}

// Fields of a chat request that change its tokens (vLLM's
// TokenizeChatRequest), and of a completions request.
var (
	chatFields       = []string{"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "documents"}
	completionFields = []string{"model", "prompt", "add_special_tokens"}
)

// Tokens returns the prompt's token ids for a request to path with body,
// asking the engine at baseURL when the prompt is not cached.
func (t *Tokenizer) Tokens(ctx context.Context, baseURL, path string, body []byte) ([]uint32, error) {
	o, err := rawjson.Parse(body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotTokenizable, err)
	}
	if o.Has("cache_salt") {
		// vLLM keys salted blocks apart (extra_keys) where the router's
		// chain cannot: predicting a hit would be a guess.
		return nil, fmt.Errorf("%w: cache_salt", ErrNotTokenizable)
	}
	var fields []string
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		fields = chatFields
		if hasMedia(o.Get("messages")) {
			return nil, fmt.Errorf("%w: messages carry media", ErrNotTokenizable)
		}
	case strings.HasSuffix(path, "/completions"):
		fields = completionFields
		p := bytes.TrimSpace(o.Get("prompt"))
		if len(p) == 0 {
			return nil, fmt.Errorf("%w: no prompt", ErrNotTokenizable)
		}
		if p[0] == '[' {
			return tokenIDPrompt(p)
		}
		if p[0] != '"' {
			return nil, fmt.Errorf("%w: prompt is not a string", ErrNotTokenizable)
		}
	default:
		return nil, fmt.Errorf("%w: route %s", ErrNotTokenizable, path)
	}
	req := []byte("{}")
	edits := make([]rawjson.Edit, 0, len(fields))
	d := xxhash.New()
	_, _ = d.WriteString(path)
	for _, f := range fields {
		if v := o.Get(f); v != nil {
			edits = append(edits, rawjson.Set(f, v))
			_, _ = d.WriteString("\x00" + f + "\x00")
			_, _ = d.Write(v)
		}
	}
	key := d.Sum64()
	if e := t.lookup(key); e != nil {
		t.S.CacheHits.Add(1)
		return e.tokens, nil
	}
	req, err = rawjson.Patch(req, edits...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotTokenizable, err)
	}
	start := time.Now()
	toks, err := t.ask(ctx, baseURL, req)
	t.S.Asks.Add(1)
	t.S.AskNanos.Add(uint64(time.Since(start)))
	if err != nil {
		return nil, err
	}
	t.store(key, toks)
	return toks, nil
}

// tokenIDPrompt takes a completions prompt given as token ids; a batch
// (array of arrays or of strings) is not one prompt.
func tokenIDPrompt(p []byte) ([]uint32, error) {
	var ids []uint32
	if err := json.Unmarshal(p, &ids); err != nil {
		return nil, fmt.Errorf("%w: prompt is a batch, not one prompt", ErrNotTokenizable)
	}
	return ids, nil
}

// hasMedia reports whether chat messages carry non-text parts, whose
// tokens depend on the engine's multimodal processor.
func hasMedia(messages []byte) bool {
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(messages, &msgs) != nil {
		return false // the engine will say what is wrong
	}
	for _, m := range msgs {
		c := bytes.TrimSpace(m.Content)
		if len(c) == 0 || c[0] != '[' {
			continue
		}
		var parts []struct {
			Type string `json:"type"`
		}
		if json.Unmarshal(c, &parts) != nil {
			return true
		}
		for _, p := range parts {
			if p.Type != "text" && p.Type != "" {
				return true
			}
		}
	}
	return false
}

func (t *Tokenizer) ask(ctx context.Context, baseURL string, body []byte) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, t.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := t.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", baseURL, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", baseURL, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%w: tokenize at %s: status %d: %.200s", ErrNotTokenizable, baseURL, resp.StatusCode, b)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", baseURL, err)
	}
	return out.Tokens, nil
}

func (t *Tokenizer) lookup(key uint64) *cacheEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.cache[key]
}

func (t *Tokenizer) store(key uint64, toks []uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.cache[key]; ok {
		return
	}
	for len(t.order) >= t.max {
		delete(t.cache, t.order[0])
		t.order = t.order[1:]
	}
	t.cache[key] = &cacheEntry{tokens: toks}
	t.order = append(t.order, key)
}
