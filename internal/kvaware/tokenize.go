package kvaware

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"

	"github.com/switchyard-llm/switchyard/internal/chattmpl"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/tokenizer"
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
//
// With --tokenizer-path, a completions prompt that is one string is
// tokenized in-process instead (internal/tokenizer, exact for the
// byte-level BPE pipelines it loads, refusing the rest at startup). The
// first prompts tokenized so are also asked of the engine before their ids
// are used; once those agree, more are checked in the background (the
// next ones, then a sample), off the request's path. One difference
// switches the local tokenizer off for the life of the process. With the
// model's chat template (internal/chattmpl), plain chat requests (string
// contents, no tools, no template arguments) are rendered and tokenized
// in-process the same way, their first ones checked against /tokenize on
// their own; a difference switches in-process chat off. Other chat
// requests keep going to /tokenize.

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

	local  *LocalOptions          // nil: every prompt goes to /tokenize
	prefix *tokenizer.PrefixCache // local encodes, reusing resent history

	mu         sync.Mutex
	cache      map[uint64]*cacheEntry
	order      []uint64 // insertion order, for eviction
	max        int
	localModel []byte // the "model" of the first verified local prompt
	modelSet   bool

	encodes atomic.Uint64 // distinct prompts tokenized in-process
	inline  atomic.Uint64 // checks passed before use (or by a probe: Verify)
	probing atomic.Bool   // a probe is queued or under way
	checks  chan check    // background comparisons (nil: none)
	stop    context.CancelFunc
	wg      sync.WaitGroup

	// encodes and inline for chat requests rendered in-process: the
	// template is checked on its own.
	chatEncodes, chatInline atomic.Uint64
}

// check is one local result to compare with the engine's, off the path,
// or (probe) the probe corpus to run there.
type check struct {
	base  string
	req   localReq
	local []uint32
	probe bool
}

// localReq is a prompt tokenized in-process, and what asks the engine's
// /tokenize for the same ids: the text with or without special tokens
// (a completions prompt), or the chat request's fields (chat: its
// template is checked too).
type localReq struct {
	text   string
	add    bool
	model  []byte
	isChat bool
	chat   *rawjson.Object // the chat request, until detached
	body   []byte          // the /tokenize body, once built
}

// tokenizeBody is the /tokenize request for r.
func (r *localReq) tokenizeBody() ([]byte, error) {
	if r.body != nil {
		return r.body, nil
	}
	var edits []rawjson.Edit
	if r.isChat {
		edits = fieldEdits(r.chat, chatFields)
	} else {
		q, _ := json.Marshal(r.text)
		edits = []rawjson.Edit{rawjson.Set("prompt", q)}
		if r.model != nil {
			edits = append(edits, rawjson.Set("model", r.model))
		}
		if !r.add {
			edits = append(edits, rawjson.Set("add_special_tokens", []byte("false")))
		}
	}
	body, err := rawjson.Patch([]byte("{}"), edits...)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotTokenizable, err)
	}
	r.body = body
	return body, nil
}

// detach makes r independent of its request's body, which a background
// check outlives.
func (r localReq) detach() (localReq, error) {
	if _, err := r.tokenizeBody(); err != nil {
		return r, err
	}
	r.model, r.chat = bytes.Clone(r.model), nil
	return r, nil
}

func fieldEdits(o *rawjson.Object, fields []string) []rawjson.Edit {
	edits := make([]rawjson.Edit, 0, len(fields))
	for _, f := range fields {
		if v := o.Get(f); v != nil {
			edits = append(edits, rawjson.Set(f, v))
		}
	}
	return edits
}

// probeTexts are what Probe compares, each with and without special
// tokens: the pre-tokenizer's classes (letters, digits, punctuation,
// contractions, runs of spaces and newlines, tabs), accents, combining
// marks, CJK, emoji, code.
var probeTexts = []string{
	"Hello world, this is a prompt.",
	"It's we'll don't I'M THEY'RE you've",
	"digits 1 12 123 1234 1234567890 3.14159 1,000,000",
	"  leading and trailing spaces   ", "many     spaces	and		tabs",
	"line one\nline two\n\n\nline five\r\nend",
	"Ünïcödé café naïve résumé cafe\u0301 Русский ελληνικά",
	"日本語のテキストと中文文本 한국어 😀🎉👍🏽 👨‍👩‍👧",
	"def f(x):\n    return x**2  # comment\n", `{"json": [1, 2, {"k": null}]} <b>a &amp; b</b> $100 €200`,
}

// TokenizeStats are a Tokenizer's running totals.
type TokenizeStats struct {
	CacheHits, Asks atomic.Uint64 // prompts found in the cache; /tokenize calls
	AskNanos        atomic.Uint64 // wall time of the /tokenize calls

	LocalEncodes     atomic.Uint64 // prompts tokenized in-process
	LocalNanos       atomic.Uint64 // wall time of those encodes
	VerifyChecks     atomic.Uint64 // local results compared with the engine's /tokenize
	VerifyMismatches atomic.Uint64 // comparisons that differed
	VerifyBackground atomic.Uint64 // of the checks, those made off the request's path
	VerifyDropped    atomic.Uint64 // background checks not made: the queue was full
	LocalOff         atomic.Bool   // a mismatch switched the local tokenizer off
	ChatLocal        atomic.Uint64 // of LocalEncodes, chat requests rendered in-process
	ChatOff          atomic.Bool   // a chat mismatch switched the chat template off
}

// Defaults of LocalOptions.
const (
	// DefaultVerify distinct prompts are checked against the engine
	// before local ids are used at all.
	DefaultVerify = 4
	// DefaultBackground more are then checked in the background.
	DefaultBackground = 28
	// DefaultSampleEvery: after those, one prompt in this many is.
	DefaultSampleEvery = 256
)

// LocalOptions enable the in-process tokenizer for completions prompts.
type LocalOptions struct {
	Tokenizer *tokenizer.Tokenizer
	// Verify distinct prompts are also asked of the engine, on the
	// request's path, before any local result is used (0: DefaultVerify).
	Verify int
	// Background distinct prompts after those are compared off the path,
	// and then one in SampleEvery (0: the defaults; < 0: none).
	Background, SampleEvery int
	// PrefixCacheBytes bounds the texts and ids kept so a prompt resending
	// an earlier one's text is encoded from where they part
	// (tokenizer.PrefixCache; 0: 32 MiB).
	PrefixCacheBytes int
	// Chat, when set, renders chat requests the router can render
	// exactly (chattmpl: string contents, no tools) for the local
	// tokenizer; nil: chat requests go to /tokenize.
	Chat   *chattmpl.Template
	Logger *slog.Logger
}

// PrefixStats are the local tokenizer's prefix reuse totals (zero without
// one).
func (t *Tokenizer) PrefixStats() tokenizer.PrefixStats {
	if t.prefix == nil {
		return tokenizer.PrefixStats{}
	}
	return t.prefix.Stats()
}

// SetLocal enables the in-process tokenizer; call it before the first
// Tokens, and Close when done.
func (t *Tokenizer) SetLocal(o LocalOptions) {
	if o.Verify <= 0 {
		o.Verify = DefaultVerify
	}
	if o.Background == 0 {
		o.Background = DefaultBackground
	}
	if o.SampleEvery == 0 {
		o.SampleEvery = DefaultSampleEvery
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	t.local = &o
	t.prefix = tokenizer.NewPrefixCache(o.Tokenizer, o.PrefixCacheBytes)
	ctx, cancel := context.WithCancel(context.Background())
	t.checks, t.stop = make(chan check, 16), cancel
	t.wg.Add(1)
	go t.checkLoop(ctx)
}

// Close stops the background checks; a check under way is cancelled.
func (t *Tokenizer) Close() {
	if t.stop != nil {
		t.stop()
		t.wg.Wait()
	}
}

// checkLoop compares queued local results with the engine's, one at a
// time, until Close.
func (t *Tokenizer) checkLoop(ctx context.Context) {
	defer t.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case c := <-t.checks:
			switch {
			case t.S.LocalOff.Load():
			case c.probe:
				t.runProbe(ctx, c.base)
			default:
				if _, err := t.verify(ctx, c.base, &c.req, c.local); err == nil {
					t.S.VerifyBackground.Add(1)
				}
			}
		}
	}
}

// chatProbes are the conversations a probe renders when chat requests are
// rendered in-process (each with and without the generation prompt): one
// turn, a system prompt, multi-turn, over the probe texts.
var chatProbes = [][]chattmpl.Message{
	{{Role: "user", Content: probeTexts[0]}},
	{{Role: "system", Content: probeTexts[1]}, {Role: "user", Content: probeTexts[2]}, {Role: "assistant", Content: probeTexts[3]}, {Role: "user", Content: probeTexts[4]}},
	{{Role: "user", Content: probeTexts[5]}, {Role: "assistant", Content: probeTexts[6]}, {Role: "user", Content: probeTexts[7]}},
	{{Role: "system", Content: probeTexts[8]}, {Role: "user", Content: probeTexts[9]}},
}

// ProbeChecks is how many comparisons a passing probe makes, with a chat
// template rendered in-process or without.
func ProbeChecks(chat bool) int {
	n := 2 * len(probeTexts)
	if chat {
		n += 2 * len(chatProbes)
	}
	return n
}

// probed reports whether nothing is left for a probe to verify.
func (t *Tokenizer) probed() bool {
	v := uint64(t.local.Verify)
	return t.S.LocalOff.Load() || (t.inline.Load() >= v && (!t.chatLocal() || t.chatInline.Load() >= v))
}

// Probe compares the local tokenizer with the engine at baseURL on a
// fixed corpus, in the background; when every text agrees, local ids are
// used without checking the first prompts on their request's path. Call
// it when an engine of the model becomes known; it does nothing once a
// probe passed, while one is under way, or without a local tokenizer.
func (t *Tokenizer) Probe(baseURL string) {
	if t.local == nil || t.probed() || !t.probing.CompareAndSwap(false, true) {
		return
	}
	select {
	case t.checks <- check{base: baseURL, probe: true}:
	default:
		t.probing.Store(false)
	}
}

// runProbe compares every probe text. An engine that cannot answer is
// asked again every second, up to probeTries times (an engine that is
// still starting); then the tokenizer stays unverified until a later
// Probe, and the first prompts are checked on their request's path.
func (t *Tokenizer) runProbe(ctx context.Context, base string) {
	defer t.probing.Store(false)
	retry := time.NewTimer(time.Second)
	defer retry.Stop()
	for try := 1; ; try++ {
		err := t.probeOnce(ctx, base)
		if err == nil || try == probeTries || t.probed() {
			return
		}
		retry.Reset(time.Second)
		select {
		case <-ctx.Done():
			return
		case <-retry.C:
		}
	}
}

const probeTries = 30

// probeOnce runs the corpus once; nil when it ran to its end (agreeing,
// or a mismatch that switched the tokenizer off).
func (t *Tokenizer) probeOnce(ctx context.Context, base string) error {
	for _, text := range probeTexts {
		for _, add := range []bool{true, false} {
			if _, err := t.verify(ctx, base, &localReq{text: text, add: add}, t.local.Tokenizer.Encode(text, add)); err != nil {
				return err
			}
			t.S.VerifyBackground.Add(1)
			if t.S.LocalOff.Load() {
				return nil
			}
		}
	}
	if t.chatLocal() {
		// An engine refusing the chat probes (no chat template of its
		// own) leaves chat requests checked on their path; the
		// tokenizer's probe stands.
		ok, err := t.probeChat(ctx, base)
		if err != nil && !errors.Is(err, ErrNotTokenizable) {
			return err
		}
		if ok {
			raiseTo(&t.chatInline, uint64(t.local.Verify))
		}
	}
	raiseTo(&t.inline, uint64(t.local.Verify))
	return nil
}

// probeChat compares the chat probes rendered and encoded here with the
// engine's /tokenize of the same messages; ok when at least one was
// compared and none differed. A probe the template refuses to render (a
// template raising on a role order) is passed over.
func (t *Tokenizer) probeChat(ctx context.Context, base string) (ok bool, err error) {
	for _, conv := range chatProbes {
		for _, gen := range []bool{true, false} {
			text, err := t.local.Chat.Render(conv, gen)
			if err != nil {
				continue
			}
			body, _ := json.Marshal(map[string]any{"messages": conv, "add_generation_prompt": gen})
			r := &localReq{text: text, isChat: true, body: body}
			if _, err := t.verify(ctx, base, r, t.local.Tokenizer.Encode(text, false)); err != nil {
				return false, err
			}
			t.S.VerifyBackground.Add(1)
			if t.S.ChatOff.Load() || t.S.LocalOff.Load() {
				return false, nil
			}
			ok = true
		}
	}
	return ok, nil
}

// raiseTo sets n to at least v.
func raiseTo(n *atomic.Uint64, v uint64) {
	for {
		cur := n.Load()
		if cur >= v || n.CompareAndSwap(cur, v) {
			return
		}
	}
}

// checkDue reports whether the n-th distinct local result is to be
// compared with the engine's in the background.
func (t *Tokenizer) checkDue(n uint64) bool {
	o := t.local
	v := uint64(o.Verify)
	return (o.Background > 0 && n <= v+uint64(o.Background)) ||
		(o.SampleEvery > 0 && n%uint64(o.SampleEvery) == 0)
}

// queueCheck hands a local result to the background checker; a full
// queue drops it (counted).
func (t *Tokenizer) queueCheck(c check) {
	select {
	case t.checks <- c:
	default:
		t.S.VerifyDropped.Add(1)
	}
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

// CacheSalt returns the request's cache_salt ("" when it has none), which
// vLLM mixes into the hash of the prompt's first block (and so of every
// block after it): ok is false for a value vLLM refuses with a 400 (not a
// non-empty string, more than 128 characters, '@', '/', '\\' or NUL:
// vllm/entrypoints/generate/base/protocol.py validate_cache_salt), whose
// blocks no engine will store.
func CacheSalt(o *rawjson.Object) (salt string, ok bool) {
	if !o.Has("cache_salt") || o.IsNull("cache_salt") {
		return "", true
	}
	s, ok := o.String("cache_salt")
	if !ok || s == "" || utf8.RuneCountInString(s) > 128 || strings.ContainsAny(s, "@/\\\x00") {
		return "", false
	}
	return s, true
}

// Tokens returns the prompt's token ids for a request to path with body,
// asking the engine at baseURL when the prompt is not cached.
func (t *Tokenizer) Tokens(ctx context.Context, baseURL, path string, body []byte) ([]uint32, error) {
	o, err := rawjson.Parse(body)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotTokenizable, err)
	}
	return t.TokensOf(ctx, baseURL, path, o)
}

// TokensOf is Tokens for a body the caller has already parsed.
func (t *Tokenizer) TokensOf(ctx context.Context, baseURL, path string, o *rawjson.Object) ([]uint32, error) {
	var fields []string
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		fields = chatFields
		if hasMedia(o.Get("messages")) {
			return nil, fmt.Errorf("%w: messages carry media", ErrNotTokenizable)
		}
		if t.chatLocal() && t.sameModel(o.Get("model")) {
			key := t.key(path, o, fields)
			if e := t.lookup(key); e != nil {
				t.S.CacheHits.Add(1)
				return e.tokens, nil
			}
			if text, ok := t.renderChat(o); ok {
				return t.tokensLocal(ctx, baseURL, key, localReq{text: text, model: o.Get("model"), isChat: true, chat: o})
			}
		}
	case strings.HasSuffix(path, "/completions"):
		fields = completionFields
		p := bytes.TrimSpace(o.Get("prompt"))
		if len(p) == 0 {
			return nil, fmt.Errorf("%w: no prompt", ErrNotTokenizable)
		}
		if t.local != nil && !t.S.LocalOff.Load() {
			if text, add, ok := localPrompt(p, o.Get("add_special_tokens")); ok && t.sameModel(o.Get("model")) {
				return t.tokensLocal(ctx, baseURL, t.key(path, o, fields), localReq{text: text, add: add, model: o.Get("model")})
			}
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
	key := t.key(path, o, fields)
	if e := t.lookup(key); e != nil {
		t.S.CacheHits.Add(1)
		return e.tokens, nil
	}
	req, err := rawjson.Patch([]byte("{}"), fieldEdits(o, fields)...)
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

// key is the cache key of a request: its route and the fields that decide
// its tokens.
func (t *Tokenizer) key(path string, o *rawjson.Object, fields []string) uint64 {
	d := xxhash.New()
	_, _ = d.WriteString(path)
	for _, f := range fields {
		if v := o.Get(f); v != nil {
			_, _ = d.WriteString("\x00" + f + "\x00")
			_, _ = d.Write(v)
		}
	}
	return d.Sum64()
}

// localPrompt takes a completions prompt the local tokenizer handles: a
// string or a list of one string, with add_special_tokens absent (vLLM's
// default, true) or a bool.
func localPrompt(p, addSpecial []byte) (text string, add bool, ok bool) {
	add = true
	if a := bytes.TrimSpace(addSpecial); a != nil {
		switch string(a) {
		case "true":
		case "false":
			add = false
		default:
			return "", false, false
		}
	}
	if p[0] == '[' {
		var one []string
		if json.Unmarshal(p, &one) != nil || len(one) != 1 {
			return "", false, false
		}
		return one[0], add, true
	}
	if text, ok := plainString(p); ok {
		return text, add, true
	}
	if json.Unmarshal(p, &text) != nil {
		return "", false, false
	}
	return text, add, true
}

// plainString decodes a JSON string without escapes, the common case of
// a long prompt, in one copy; ok is false for anything else (escapes,
// control characters, invalid UTF-8: json.Unmarshal decides those).
func plainString(p []byte) (string, bool) {
	if len(p) < 2 || p[0] != '"' || p[len(p)-1] != '"' {
		return "", false
	}
	in := p[1 : len(p)-1]
	// Eight bytes at a time while none is special; the rest byte by byte.
	i := 0
	for ; i+8 <= len(in); i += 8 {
		if special(binary.LittleEndian.Uint64(in[i:])) {
			break
		}
	}
	ascii := true
	for _, c := range in[i:] {
		if c == '\\' || c == '"' || c < 0x20 {
			return "", false
		}
		if c >= utf8.RuneSelf {
			ascii = false
		}
	}
	if !ascii && !utf8.Valid(in) {
		return "", false
	}
	return string(in), true
}

// special reports whether a byte of w is a quote, a backslash, a control
// character or not ASCII (the bit tricks of "Bit Twiddling Hacks":
// hasless and haszero, exact as a whole-word test).
func special(w uint64) bool {
	const ones, high = 0x0101010101010101, 0x8080808080808080
	ctl := (w - 0x20*ones) &^ w & high
	q := w ^ ('"' * ones)
	quote := (q - ones) &^ q & high
	b := w ^ ('\\' * ones)
	backslash := (b - ones) &^ b & high
	return ctl|quote|backslash|w&high != 0
}

// sameModel: once a local result was verified for a model, requests for
// another model (another tokenizer, maybe) go to /tokenize.
func (t *Tokenizer) sameModel(model []byte) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return !t.modelSet || bytes.Equal(t.localModel, model)
}

// tokensLocal tokenizes a completions prompt in-process. While fewer than
// Verify prompts have been checked, the engine at baseURL is asked too,
// before the ids are used: a difference is logged and counted, switches
// the local tokenizer off and the engine's ids are used. Later results
// are used at once, and some are checked in the background
// (queueCheck): a difference found there switches the tokenizer off for
// the requests that follow.
func (t *Tokenizer) tokensLocal(ctx context.Context, baseURL string, key uint64, r localReq) ([]uint32, error) {
	if e := t.lookup(key); e != nil {
		t.S.CacheHits.Add(1)
		return e.tokens, nil
	}
	start := time.Now()
	toks := t.prefix.Encode(r.text, r.add)
	t.S.LocalEncodes.Add(1)
	t.S.LocalNanos.Add(uint64(time.Since(start)))
	encodes, inline := &t.encodes, &t.inline
	if r.isChat {
		// The template is checked on its own: a probe of the tokenizer
		// says nothing of it.
		encodes, inline = &t.chatEncodes, &t.chatInline
		t.S.ChatLocal.Add(1)
	}
	n := encodes.Add(1)
	if inline.Load() < uint64(t.local.Verify) {
		var err error
		if toks, err = t.verify(ctx, baseURL, &r, toks); err != nil {
			return nil, err
		}
		inline.Add(1)
	} else if t.checkDue(n) {
		// r refers to the request's body: the check outlives it.
		if d, err := r.detach(); err == nil {
			t.queueCheck(check{base: baseURL, req: d, local: toks})
		}
	}
	t.store(key, toks)
	return toks, nil
}

// verify asks the engine for the prompt's ids and compares them with the
// local ones; it returns the ids to use. A difference switches off what
// produced it: the chat template (chat requests go to /tokenize), or the
// tokenizer (every prompt does).
func (t *Tokenizer) verify(ctx context.Context, baseURL string, r *localReq, local []uint32) ([]uint32, error) {
	body, err := r.tokenizeBody()
	if err != nil {
		return nil, err
	}
	start := time.Now()
	remote, err := t.ask(ctx, baseURL, body)
	t.S.Asks.Add(1)
	t.S.AskNanos.Add(uint64(time.Since(start)))
	if err != nil {
		return nil, err
	}
	t.S.VerifyChecks.Add(1)
	if slices.Equal(local, remote) {
		if r.model != nil { // a probe names no model
			t.mu.Lock()
			if !t.modelSet {
				t.localModel, t.modelSet = bytes.Clone(r.model), true
			}
			t.mu.Unlock()
		}
		return local, nil
	}
	t.S.VerifyMismatches.Add(1)
	off, what := &t.S.LocalOff, "local tokenizer differs from the engine's /tokenize; switched off, every prompt now goes to /tokenize"
	if r.isChat {
		off, what = &t.S.ChatOff, "chat template rendered by the router differs from the engine's /tokenize; switched off, chat requests now go to /tokenize"
	}
	if off.CompareAndSwap(false, true) {
		t.local.Logger.Error(what,
			"tokenizer", t.local.Tokenizer.Path, "engine", baseURL, "add_special_tokens", r.add,
			"local_ids", prefix(local, 16), "engine_ids", prefix(remote, 16), "local_len", len(local), "engine_len", len(remote))
		t.mu.Lock()
		clear(t.cache) // may hold unverified local results
		t.order = t.order[:0]
		t.mu.Unlock()
	}
	return remote, nil
}

func prefix(ids []uint32, n int) []uint32 { return ids[:min(n, len(ids))] }

// tokenIDPrompt takes a completions prompt given as token ids; a batch
// (array of arrays or of strings) is not one prompt.
func tokenIDPrompt(p []byte) ([]uint32, error) {
	if ids, ok := rawjson.Uint32s(p); ok {
		return ids, nil
	}
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
	switch {
	case resp.StatusCode == http.StatusNotFound:
		// This engine does not serve the model (a LoRA adapter loaded on
		// some engines only): another may.
		return nil, fmt.Errorf("tokenize at %s: status %d: %.200s", baseURL, resp.StatusCode, b)
	case resp.StatusCode != http.StatusOK:
		return nil, fmt.Errorf("%w: tokenize at %s: status %d: %.200s", ErrNotTokenizable, baseURL, resp.StatusCode, b)
	}
	ids, err := answerIDs(b)
	if err != nil {
		return nil, fmt.Errorf("tokenize at %s: %w", baseURL, err)
	}
	return ids, nil
}

// answerIDs reads the ids of a /tokenize answer: found and read without
// reflection when they are plain digits (3.4× faster than encoding/json
// on a 2,300-token answer, BenchmarkTokenIDs), else by encoding/json,
// which also gives the error.
func answerIDs(b []byte) ([]uint32, error) {
	if v, err := rawjson.Lookup(b, "tokens"); err == nil && v != nil {
		if ids, ok := rawjson.Uint32s(v); ok {
			return ids, nil
		}
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, err
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

// ChatLocal reports whether plain chat requests are rendered and
// tokenized in-process (a chat template was set and no difference with
// the engine switched it off).
func (t *Tokenizer) ChatLocal() bool { return t.chatLocal() }

func (t *Tokenizer) chatLocal() bool {
	return t.local != nil && t.local.Chat != nil && !t.S.LocalOff.Load() && !t.S.ChatOff.Load()
}

// renderChat renders a chat request the router renders exactly (plainChat)
// with the model's template; ok is false for any other request, and when
// the template fails (the engine will say why).
func (t *Tokenizer) renderChat(o *rawjson.Object) (string, bool) {
	msgs, gen, ok := plainChat(o)
	if !ok {
		return "", false
	}
	text, err := t.local.Chat.Render(msgs, gen)
	return text, err == nil
}

// chatFieldsRendered are request fields that change what vLLM gives the
// template (beyond messages and add_generation_prompt): a request with
// any of them (not null) goes to /tokenize.
var chatFieldsRendered = []string{"tools", "documents", "chat_template", "chat_template_kwargs", "reasoning_effort"}

// plainChat reads a chat request vLLM renders from its messages and
// add_generation_prompt alone: every message has a role the router
// renders and a text content (textContent) and nothing else, continue_final_message
// and add_special_tokens are false (or absent), and none of
// chatFieldsRendered is set. It returns the messages and
// add_generation_prompt (default true).
func plainChat(o *rawjson.Object) (msgs []chattmpl.Message, addGen, ok bool) {
	for _, f := range chatFieldsRendered {
		if v := bytes.TrimSpace(o.Get(f)); v != nil && string(v) != "null" {
			return nil, false, false
		}
	}
	if v, ok := jsonBool(o.Get("continue_final_message"), false); !ok || v {
		return nil, false, false
	}
	if v, ok := jsonBool(o.Get("add_special_tokens"), false); !ok || v {
		return nil, false, false
	}
	addGen, ok = jsonBool(o.Get("add_generation_prompt"), true)
	if !ok {
		return nil, false, false
	}
	var raw []map[string]json.RawMessage
	if json.Unmarshal(o.Get("messages"), &raw) != nil || len(raw) == 0 {
		return nil, false, false
	}
	msgs = make([]chattmpl.Message, len(raw))
	for i, m := range raw {
		var content bool
		if len(m) == 2 && json.Unmarshal(m["role"], &msgs[i].Role) == nil && chattmpl.Roles[msgs[i].Role] {
			msgs[i].Content, msgs[i].Parts, content = textContent(m["content"])
		}
		if !content {
			return nil, false, false
		}
		if msgs[i].Role == "system" && strings.HasPrefix(msgs[i].Content, claudeBillingHeader) {
			return nil, false, false // vLLM drops that line first
		}
	}
	return msgs, addGen, true
}

// claudeBillingHeader starts a system line vLLM strips before rendering
// (renderers/chat_utils.py, _strip_claude_code_billing_header).
const claudeBillingHeader = "x-anthropic-billing-header"

// jsonBool reads an optional JSON bool: def when absent, ok false when it
// is anything but true or false.
func jsonBool(v []byte, def bool) (val, ok bool) {
	switch string(bytes.TrimSpace(v)) {
	case "":
		return def, v == nil
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// textContent reads a message's text content: a string, or a list of text
// parts, whose texts it also returns, and whose non-empty texts joined
// with newlines are what vLLM gives a template taking string content
// (renderers/chat_utils.py, _parse_chat_message_content_parts). ok is
// false for anything else (null, other part types, parts with more
// fields).
func textContent(v json.RawMessage) (content string, parts []string, ok bool) {
	v = bytes.TrimSpace(v)
	if len(v) == 0 {
		return "", nil, false
	}
	if v[0] == '"' {
		return content, nil, json.Unmarshal(v, &content) == nil
	}
	var raw []map[string]json.RawMessage
	if v[0] != '[' || json.Unmarshal(v, &raw) != nil {
		return "", nil, false
	}
	parts = make([]string, len(raw))
	nonEmpty := make([]string, 0, len(raw))
	for i, p := range raw {
		var typ string
		if len(p) != 2 || json.Unmarshal(p["type"], &typ) != nil || typ != "text" ||
			!isJSONString(p["text"]) || json.Unmarshal(p["text"], &parts[i]) != nil {
			return "", nil, false
		}
		if parts[i] != "" {
			nonEmpty = append(nonEmpty, parts[i])
		}
	}
	return strings.Join(nonEmpty, "\n"), parts, true
}

func isJSONString(v json.RawMessage) bool {
	v = bytes.TrimSpace(v)
	return len(v) >= 2 && v[0] == '"'
}
