package kvaware

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// tokenizeServer answers POST /tokenize like vLLM: a completions prompt is
// split on spaces, each word's id its length*1000+position; chat messages
// render "role: content" per message first.
type tokenizeServer struct {
	*httptest.Server
	calls atomic.Int64
	last  atomic.Value // last request body
}

func newTokenizeServer(t *testing.T) *tokenizeServer {
	ts := &tokenizeServer{}
	ts.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ts.calls.Add(1)
		var req struct {
			Prompt   *string `json:"prompt"`
			Messages []struct {
				Role, Content string
			} `json:"messages"`
			AddGenerationPrompt *bool `json:"add_generation_prompt"`
		}
		if r.URL.Path != "/tokenize" || json.NewDecoder(r.Body).Decode(&req) != nil {
			http.Error(w, `{"error":{"message":"bad"}}`, 400)
			return
		}
		text := ""
		if req.Prompt != nil {
			text = *req.Prompt
		}
		for _, m := range req.Messages {
			text += m.Role + ": " + m.Content + " "
		}
		if req.AddGenerationPrompt == nil || *req.AddGenerationPrompt {
			if len(req.Messages) > 0 {
				text += "assistant:"
			}
		}
		ts.last.Store(req)
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": wordIDs(text)})
	}))
	t.Cleanup(ts.Close)
	return ts
}

func wordIDs(text string) []uint32 {
	var ids []uint32
	for i, f := range strings.Fields(text) {
		ids = append(ids, uint32(len(f)*1000+i))
	}
	return ids
}

func words(n int, prefix string) string {
	ws := make([]string, n)
	for i := range ws {
		ws[i] = fmt.Sprintf("%s%d", prefix, i)
	}
	return strings.Join(ws, " ")
}

func mkWorkers(urls ...string) []*worker.Worker {
	ws := make([]*worker.Worker, len(urls))
	for i, u := range urls {
		ws[i] = worker.New(worker.Spec{URL: u, DPRank: -1, Role: worker.RoleRegular}, worker.BreakerConfig{})
	}
	return ws
}

// storeFor publishes, into the index, the blocks a worker would report
// after serving tokens.
func storeFor(x *kvevents.Index, key string, tokens []uint32, blocks int) {
	bs := x.BlockSize()
	e := kvevents.BlockStored{BlockSize: bs, LoRAID: -1, TokenIDs: tokens[:blocks*bs]}
	for i := range blocks {
		e.BlockHashes = append(e.BlockHashes, kvevents.BytesHash(fmt.Appendf(nil, "%s/%d", key, i)))
	}
	x.Apply(key, []kvevents.Event{e})
}

func newPolicy(t *testing.T, x *kvevents.Index, mod func(*Options)) *Policy {
	t.Helper()
	fb, err := policy.New(policy.NameRoundRobin, policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Index: x, Tokenizer: NewTokenizer(http.DefaultClient, time.Second, 100), Fallback: fb,
		OverlapWeight: 1, LoadWeight: 0.5, Speculative: false}
	if mod != nil {
		mod(&o)
	}
	p, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// pickNew routes a completion of a 40-word prompt no worker holds.
func pickNew(t *testing.T, p *Policy, c policy.Candidates) *worker.Worker {
	t.Helper()
	req := &policy.Request{Path: "/v1/completions", Body: completion(words(40, "new"))}
	policy.Prepare(t.Context(), p, req, c)
	ch, err := p.Pick(req, c)
	if err != nil {
		t.Fatal(err)
	}
	return ch.Worker
}

func completion(prompt string) []byte {
	b, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 5})
	return b
}

func TestKVAwarePicksTheWorkerHoldingThePrefix(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1", "http://c:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	p := newPolicy(t, x, nil)
	prompt := words(40, "w")
	toks := wordIDs(prompt)
	storeFor(x, ws[0].Key(), toks, 2)     // A: 2 blocks
	storeFor(x, ws[1].Key(), toks, 8)     // B: 8 blocks
	storeFor(x, ws[2].Key(), toks[4:], 8) // C: other tokens

	pick := func(body []byte, path string) (policy.Choice, *policy.Request) {
		t.Helper()
		req := &policy.Request{Path: path, Body: body}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		return ch, req
	}
	ch, req := pick(completion(prompt), "/v1/completions")
	if ch.Worker != ws[1] || !strings.HasPrefix(ch.Reason, "kv match 8/10 blocks, load 0, elsewhere "+ws[0].Key()+"=2") ||
		strings.Contains(ch.Reason, ws[2].Key()) {
		t.Fatalf("picked %v (%s), want B with A's 2 blocks listed and C's none", ch.Worker, ch.Reason)
	}
	if got := p.CachedBlocks(req); got[ws[0].Key()] != 2 || got[ws[1].Key()] != 8 || got[ws[2].Key()] != 0 {
		t.Fatalf("cached %v", got)
	}
	// The same prompt again is served from the tokenizer cache.
	before := ts.calls.Load()
	pick(completion(prompt), "/v1/completions")
	if ts.calls.Load() != before {
		t.Fatal("a repeated prompt was tokenized again")
	}

	// Load outweighs a small cache advantage: B busy with 3 requests
	// costs 0.5×40×3 = 60 tokens, more than A's 32 uncached.
	rel := []func(){ws[1].Acquire(), ws[1].Acquire(), ws[1].Acquire()}
	ch, _ = pick(completion(prompt), "/v1/completions")
	if ch.Worker != ws[0] {
		t.Fatalf("with B busy picked %v (%s)", ch.Worker, ch.Reason)
	}
	for _, r := range rel {
		r()
	}

	// Token-id prompts need no tokenizer call.
	ids, _ := json.Marshal(map[string]any{"prompt": toks})
	before = ts.calls.Load()
	if ch, _ := pick(ids, "/v1/completions"); ch.Worker != ws[1] || ts.calls.Load() != before {
		t.Fatalf("token-id prompt: %v, %d calls", ch.Worker, ts.calls.Load()-before)
	}

	// After B evicts its blocks (events), it no longer attracts the prompt.
	x.Apply(ws[1].Key(), []kvevents.Event{kvevents.AllBlocksCleared{}})
	if ch, _ := pick(completion(prompt), "/v1/completions"); ch.Worker != ws[0] {
		t.Fatalf("after B cleared: %v (%s)", ch.Worker, ch.Reason)
	}
}

// TestKVAwareCacheSalt: a salted prompt is drawn to the worker whose
// events stored it under the same salt (vLLM mixes the salt into the
// first block's hash), never to one holding the same tokens unsalted or
// under another salt, and an unsalted prompt not to the salted blocks.
func TestKVAwareCacheSalt(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1", "http://c:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	p := newPolicy(t, x, func(o *Options) { o.HasEvents = func(string) bool { return true } })
	prompt := words(40, "w")
	toks := wordIDs(prompt)
	storeFor(x, ws[0].Key(), toks, 8) // A: unsalted
	salted := func(key, salt string) {
		e := kvevents.BlockStored{BlockSize: 4, LoRAID: -1, TokenIDs: toks[:32], Extra: make([]kvevents.BlockExtra, 8)}
		e.Extra[0].Salt = salt
		for i := range 8 {
			e.BlockHashes = append(e.BlockHashes, kvevents.BytesHash(fmt.Appendf(nil, "%s/%s/%d", key, salt, i)))
		}
		x.Apply(key, []kvevents.Event{e})
	}
	salted(ws[1].Key(), "tenant-1") // B
	salted(ws[2].Key(), "tenant-2") // C
	for _, tc := range []struct {
		salt string // JSON value, "" for none
		want *worker.Worker
	}{
		{"", ws[0]},
		{`"tenant-1"`, ws[1]},
		{`"tenant-2"`, ws[2]},
		{"null", ws[0]},
	} {
		body := completion(prompt)
		if tc.salt != "" {
			body = append(body[:len(body)-1], `,"cache_salt":`+tc.salt+`}`...)
		}
		req := &policy.Request{Path: "/v1/completions", Body: body}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		if ch.Worker != tc.want || !strings.HasPrefix(ch.Reason, "kv match 8/10 blocks") {
			t.Errorf("salt %s: picked %v (%s), want %v", tc.salt, ch.Worker.Key(), ch.Reason, tc.want.Key())
		}
	}
	// A salt no worker stored matches nothing.
	req := &policy.Request{Path: "/v1/completions", Body: append(completion(prompt)[:len(completion(prompt))-1], `,"cache_salt":"tenant-3"}`...)}
	policy.Prepare(t.Context(), p, req, c)
	if got := p.CachedBlocks(req); len(got) != 0 {
		t.Fatalf("tenant-3 matched %v", got)
	}
}

// loraFixture is two workers, A holding the base model's 8 blocks of a
// 40-word prompt; pick routes a completion of that prompt for model.
type loraFixture struct {
	x    *kvevents.Index
	ws   []*worker.Worker
	toks []uint32
	pick func(model string) policy.Choice
}

func newLoRAFixture(t *testing.T) *loraFixture {
	t.Helper()
	ts := newTokenizeServer(t)
	f := &loraFixture{x: kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4}), ws: mkWorkers(ts.URL, "http://b:1")}
	c := policy.Candidates{Gen: 1, Workers: f.ws}
	p := newPolicy(t, f.x, func(o *Options) { o.HasEvents = func(string) bool { return true } })
	prompt := words(40, "w")
	f.toks = wordIDs(prompt)
	storeFor(f.x, f.ws[0].Key(), f.toks, 8)
	f.pick = func(model string) policy.Choice {
		t.Helper()
		b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": 5})
		req := &policy.Request{Path: "/v1/completions", Body: b}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}
	return f
}

// TestKVAwareLoRA: a request naming a LoRA adapter the engines have
// stored blocks for (events' lora_name) is keyed with the adapter, as vLLM
// keys its blocks: drawn to the adapter's blocks, not the base model's
// with the same tokens, and the base model's requests the other way.
func TestKVAwareLoRA(t *testing.T) {
	f := newLoRAFixture(t) // A: the base model's blocks
	e := kvevents.BlockStored{BlockSize: 4, LoRAID: 1, LoRAName: "sql", TokenIDs: f.toks[:32]}
	for i := range 8 {
		e.BlockHashes = append(e.BlockHashes, kvevents.BytesHash(fmt.Appendf(nil, "lora/%d", i)))
	}
	f.x.Apply(f.ws[1].Key(), []kvevents.Event{e}) // B: the adapter's
	for _, tc := range []struct {
		model string
		want  *worker.Worker
	}{{"m", f.ws[0]}, {"sql", f.ws[1]}} {
		ch := f.pick(tc.model)
		if ch.Worker != tc.want || !strings.HasPrefix(ch.Reason, "kv match 8/10 blocks") || strings.Contains(ch.Reason, "elsewhere") {
			t.Errorf("model %s: picked %v (%s), want %v and no blocks elsewhere", tc.model, ch.Worker.Key(), ch.Reason, tc.want.Key())
		}
	}
}

// TestKVAwareAdapterKnownBeforeItsBlocks: an adapter no engine has stored
// blocks for yet would be keyed as the base model and matched against the
// base model's blocks, which vLLM does not reuse for it; once the router
// knows the name (Index.NoteLoRA: a load through it, an engine's
// /v1/models), its requests match nothing until its own blocks exist.
func TestKVAwareAdapterKnownBeforeItsBlocks(t *testing.T) {
	f := newLoRAFixture(t)
	if ch := f.pick("fresh"); !strings.HasPrefix(ch.Reason, "kv match 8/10 blocks") {
		t.Fatalf("unknown adapter: %s, want the base model's blocks matched (the guess NoteLoRA prevents)", ch.Reason)
	}
	f.x.NoteLoRA("fresh")
	if ch := f.pick("fresh"); !strings.HasPrefix(ch.Reason, "kv match 0/10 blocks") {
		t.Fatalf("known adapter: %s, want no blocks matched", ch.Reason)
	}
}

// TestKVAwareTokenizesWhereTheModelIsServed: an engine answering 404 to
// /tokenize does not serve the request's model (an adapter loaded on some
// engines only): the next candidate is asked, whichever the rotation
// starts with.
func TestKVAwareTokenizesWhereTheModelIsServed(t *testing.T) {
	var asked404 atomic.Int64
	missing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked404.Add(1)
		http.Error(w, `{"error":{"message":"The model `+"`sql`"+` does not exist.","code":404}}`, http.StatusNotFound)
	}))
	t.Cleanup(missing.Close)
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(missing.URL, ts.URL)
	c := policy.Candidates{Gen: 1, Workers: ws}
	p := newPolicy(t, x, nil)
	for i := range 4 { // the rotation starts at each worker in turn
		b, _ := json.Marshal(map[string]any{"model": "sql", "prompt": words(8+i, "w"), "max_tokens": 5})
		req := &policy.Request{Path: "/v1/completions", Body: b}
		policy.Prepare(t.Context(), p, req, c)
		if req.TokenErr != nil || len(req.Tokens) != 8+i {
			t.Fatalf("request %d: tokens %v, err %v", i, req.Tokens, req.TokenErr)
		}
	}
	if asked404.Load() != 2 || p.S.TokenizeErrors.Load() != 2 {
		t.Fatalf("the 404 engine asked %d times, %d tokenize errors; want 2 and 2", asked404.Load(), p.S.TokenizeErrors.Load())
	}
}

func TestCacheSalt(t *testing.T) {
	for _, tc := range []struct {
		body, salt string
		ok         bool
	}{
		{`{}`, "", true},
		{`{"cache_salt":null}`, "", true},
		{`{"cache_salt":"t1"}`, "t1", true},
		{`{"cache_salt":"\u00e9t\u00e9"}`, "été", true},
		{`{"cache_salt":"` + strings.Repeat("é", 128) + `"}`, strings.Repeat("é", 128), true},
		{`{"cache_salt":"` + strings.Repeat("a", 129) + `"}`, "", false},
		{`{"cache_salt":""}`, "", false},
		{`{"cache_salt":7}`, "", false},
		{`{"cache_salt":["a"]}`, "", false},
		{`{"cache_salt":"a@b"}`, "", false},
		{`{"cache_salt":"a\\b"}`, "", false},
		{`{"cache_salt":"a\u0000"}`, "", false},
		{`{"cache_salt":"a\u002fb"}`, "", false},
	} {
		o, err := rawjson.Parse([]byte(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		if salt, ok := CacheSalt(o); salt != tc.salt || ok != tc.ok {
			t.Errorf("%s: %q %v, want %q %v", tc.body, salt, ok, tc.salt, tc.ok)
		}
	}
}

// TestKVAwareTieBreak: costs within the tie band count as equal, and
// among those a new prefix goes to the worker holding fewer blocks (where
// it evicts least); a worker whose load puts it outside the band is passed
// over.
func TestKVAwareTieBreak(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1", "http://c:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	p := newPolicy(t, x, func(o *Options) { o.LoadWeight, o.TieBand = 0.02, DefaultTieBand })
	other := wordIDs(words(40, "other"))
	storeFor(x, ws[0].Key(), other, 9)
	storeFor(x, ws[1].Key(), other, 3)
	storeFor(x, ws[2].Key(), other, 6)
	pick := func() *worker.Worker { t.Helper(); return pickNew(t, p, c) }
	for range 5 {
		if w := pick(); w != ws[1] {
			t.Fatalf("equal cost and load: picked %s, want the one holding fewest blocks %s", w.Key(), ws[1].Key())
		}
	}
	var rel []func()
	defer func() {
		for _, r := range rel {
			r()
		}
	}()
	rel = append(rel, ws[1].Acquire()) // 0.02 of the prompt more: inside the band
	if w := pick(); w != ws[1] {
		t.Fatalf("B one request busier: picked %s, want %s (inside the band, fewest blocks)", w.Key(), ws[1].Key())
	}
	for range 5 { // 0.12 of the prompt more: outside
		rel = append(rel, ws[1].Acquire())
	}
	if w := pick(); w != ws[2] {
		t.Fatalf("B six requests busier: picked %s, want %s (in the band, fewer blocks than A)", w.Key(), ws[2].Key())
	}
}

// TestKVAwareFullWorkersDecideByLoad: a worker whose engine has evicted
// has no room to offer a new prefix, whatever it holds: a worker with room
// comes first, and among full workers the cost and the load decide, not
// the block counts.
func TestKVAwareFullWorkersDecideByLoad(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1", "http://c:1")
	p := newPolicy(t, x, func(o *Options) { o.LoadWeight, o.TieBand = 0.02, DefaultTieBand })
	other := wordIDs(words(160, "other"))
	storeFor(x, ws[0].Key(), other, 36)
	storeFor(x, ws[1].Key(), other, 3)
	storeFor(x, ws[2].Key(), other, 16)
	evict := func(w *worker.Worker) {
		x.Apply(w.Key(), []kvevents.Event{kvevents.BlockRemoved{BlockHashes: []kvevents.Hash{kvevents.BytesHash([]byte(w.Key() + "/0"))}}})
	}
	evict(ws[1])
	evict(ws[2])
	release := ws[1].Acquire() // inside the band: 0.02 of the prompt
	defer release()
	pick := func(c policy.Candidates) *worker.Worker { t.Helper(); return pickNew(t, p, c) }
	if w := pick(policy.Candidates{Gen: 1, Workers: ws}); w != ws[0] {
		t.Fatalf("picked %s, want %s: the one worker with room, though it holds the most blocks", w.Key(), ws[0].Key())
	}
	if w := pick(policy.Candidates{Gen: 2, Workers: ws[1:]}); w != ws[2] {
		t.Fatalf("both full: picked %s, want the less loaded %s, not the one holding fewer blocks", w.Key(), ws[2].Key())
	}
}

// fullWorkers returns two workers whose engines have evicted (so no room
// decides between them) and a policy with the default weights.
func fullWorkers(t *testing.T) (*Policy, []*worker.Worker) {
	t.Helper()
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1")
	for _, w := range ws {
		storeFor(x, w.Key(), wordIDs(words(160, "other")), 8)
		x.Apply(w.Key(), []kvevents.Event{kvevents.BlockRemoved{BlockHashes: []kvevents.Hash{kvevents.BytesHash([]byte(w.Key() + "/0"))}}})
	}
	return newPolicy(t, x, nil), ws
}

// TestKVAwareAvoidsAWorkerInItsPrefill: a request still awaiting its first
// byte (in the engine's prefill, which a new prompt would queue behind)
// weighs more than one already streaming.
func TestKVAwareAvoidsAWorkerInItsPrefill(t *testing.T) {
	p, ws := fullWorkers(t)
	var streaming, prefilling worker.Slot
	streaming.Start(ws[0], false)
	streaming.FirstByte()
	defer streaming.Release()
	prefilling.Start(ws[1], false)
	defer prefilling.Release()
	for i := range 16 {
		if w := pickNew(t, p, policy.Candidates{Gen: 1, Workers: ws}); w != ws[0] {
			t.Fatalf("pick %d: %s, want %s: both run one request, %s's is still in its prefill", i, w.Key(), ws[0].Key(), ws[1].Key())
		}
	}
}

// TestKVAwareTiesGoToTheLessUsedWorker: equal in cost, load and prefills,
// the worker sent fewer requests so far wins (round-robin's even spread),
// not one at random.
func TestKVAwareTiesGoToTheLessUsedWorker(t *testing.T) {
	p, ws := fullWorkers(t)
	for range 3 {
		ws[0].Acquire()()
	}
	ws[1].Acquire()()
	for i := range 16 {
		if w := pickNew(t, p, policy.Candidates{Gen: 1, Workers: ws}); w != ws[1] {
			t.Fatalf("pick %d: %s, want %s (1 request so far against 3)", i, w.Key(), ws[1].Key())
		}
	}
}

// TestKVAwareCountsItsDecisions: kv_aware's picks count in the per-worker
// decision metrics, as every policy's do.
func TestKVAwareCountsItsDecisions(t *testing.T) {
	m := metrics.NewForTest()
	p, ws := fullWorkers(t)
	p.o.Metrics = m
	for range 4 {
		pickNew(t, p, policy.Candidates{Gen: 1, Workers: ws})
	}
	var decisions, processed float64
	for _, w := range ws {
		decisions += testutil.ToFloat64(m.PolicyDecisions.WithLabelValues(Name, w.Key()))
		processed += testutil.ToFloat64(m.Processed.WithLabelValues(w.Key()))
	}
	if decisions != 4 || processed != 4 {
		t.Fatalf("kv_aware decisions %v, processed %v; want 4 and 4", decisions, processed)
	}
}

func TestKVAwareChatTokenizedWithTheTemplateFields(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 2})
	ws := mkWorkers(ts.URL)
	p := newPolicy(t, x, nil)
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"a b c d e f"}],"temperature":0,"add_generation_prompt":false}`)
	req := &policy.Request{Path: "/v1/chat/completions", Body: body}
	policy.Prepare(t.Context(), p, req, policy.Candidates{Workers: ws})
	want := wordIDs("user: a b c d e f ")
	if fmt.Sprint(req.Tokens) != fmt.Sprint(want) {
		t.Fatalf("tokens %v want %v (err %v)", req.Tokens, want, req.TokenErr)
	}
}

func TestKVAwareFallsBack(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	p := newPolicy(t, x, nil)
	cases := []struct {
		name, path, body, reason string
	}{
		{"batch of prompts", "/v1/completions", `{"prompt":["a b","c d"]}`, "not tokenized"},
		{"media in chat", "/v1/chat/completions", `{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}`, "not tokenized"},
		{"unknown route", "/v1/embeddings", `{"input":"x"}`, "not tokenized"},
		{"a cache salt the engine refuses", "/v1/completions", `{"prompt":"a b c d","cache_salt":"a/b"}`, "not tokenized"},
		{"no worker has events", "/v1/completions", `{"prompt":"a b c d e f g h"}`, "no candidate publishes KV events"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := &policy.Request{Path: tc.path, Body: []byte(tc.body)}
			policy.Prepare(t.Context(), p, req, c)
			ch, err := p.Pick(req, c)
			if err != nil || ch.Worker == nil || !strings.Contains(ch.Reason, "kv_aware fallback ("+tc.reason+")") {
				t.Fatalf("choice %+v err %v", ch, err)
			}
		})
	}
	if p.S.FallbackNoTokens.Load() != 4 || p.S.FallbackNoEvents.Load() != 1 {
		t.Fatalf("fallback counts %d %d", p.S.FallbackNoTokens.Load(), p.S.FallbackNoEvents.Load())
	}
}

func TestKVAwareSpeculativeKeepsABurstTogether(t *testing.T) {
	ts := newTokenizeServer(t)
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers(ts.URL, "http://b:1", "http://c:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	now := time.Unix(1000, 0)
	p := newPolicy(t, x, func(o *Options) {
		o.Speculative, o.SpeculativeTTL = true, 2*time.Second
		o.Now = func() time.Time { return now }
		o.HasEvents = func(string) bool { return true }
	})
	prompt := completion(words(32, "s"))
	var first *worker.Worker
	for i := range 5 {
		req := &policy.Request{Path: "/v1/completions", Body: prompt}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = ch.Worker
		} else if ch.Worker != first {
			t.Fatalf("request %d of a burst went to %v, not %v (%s)", i, ch.Worker, first, ch.Reason)
		}
	}
	// Unconfirmed by events, the entries expire.
	now = now.Add(3 * time.Second)
	req := &policy.Request{Path: "/v1/completions", Body: prompt}
	policy.Prepare(t.Context(), p, req, c)
	if got := p.CachedBlocks(req); len(got) != 0 {
		t.Fatalf("speculative entries after the TTL: %v", got)
	}
}

// BenchmarkTokenize measures what kv_aware adds before a pick: a /tokenize
// round trip on loopback (miss) or the cache (hit), for 1k and 8k-word
// prompts. The tokenize server here splits on spaces, so the figure is the
// router's side plus HTTP and JSON, not a real tokenizer's work.
func BenchmarkTokenize(b *testing.B) {
	for _, n := range []int{1000, 8000} {
		prompt := words(n, "w")
		for _, hit := range []bool{false, true} {
			b.Run(fmt.Sprintf("words=%d/cached=%v", n, hit), func(b *testing.B) {
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					var req struct{ Prompt string }
					_ = json.NewDecoder(r.Body).Decode(&req)
					_ = json.NewEncoder(w).Encode(map[string]any{"tokens": wordIDs(req.Prompt)})
				}))
				defer srv.Close()
				// A one-entry cache alternating between two prompts misses
				// every time.
				tok := NewTokenizer(srv.Client(), 5*time.Second, 1)
				bodies := [][]byte{completion(prompt), completion("x " + prompt)}
				i := 0
				for b.Loop() {
					body := bodies[0]
					if !hit {
						i++
						body = bodies[i%2]
					}
					if _, err := tok.Tokens(b.Context(), srv.URL, "/v1/completions", body); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkKVAwarePick is one routing decision for a prompt whose ids are
// known (a tokenizer cache hit): block keys, the index and speculative
// matches on 4 workers, the pick and the speculative insertion.
func BenchmarkKVAwarePick(b *testing.B) {
	for _, n := range []int{2048, 8192} {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 16})
			ws := mkWorkers("http://a:1", "http://b:1", "http://c:1", "http://d:1")
			c := policy.Candidates{Gen: 1, Workers: ws}
			fb, err := policy.New(policy.NameRoundRobin, policy.DefaultOptions())
			if err != nil {
				b.Fatal(err)
			}
			p, err := New(Options{Index: x, Tokenizer: NewTokenizer(http.DefaultClient, time.Second, 100), Fallback: fb,
				OverlapWeight: 1, LoadWeight: 0.02, Speculative: true})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			toks := make([]uint32, n)
			for i := range toks {
				toks[i] = uint32(i)
			}
			storeFor(x, ws[1].Key(), toks, n/16/2)
			for b.Loop() {
				req := &policy.Request{Path: "/v1/completions", Tokens: toks}
				policy.Prepare(b.Context(), p, req, c)
				if _, err := p.Pick(req, c); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestSpeculativeEntries: entries match as a chain per worker, a renewed
// entry outlives the batch that first inserted it, expired and
// over-capacity batches are dropped oldest first, and a removed worker's
// entries are gone.
func TestSpeculativeEntries(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := newSpeculative(6)
	ttl := 10 * time.Second
	s.insert([]uint64{1, 2, 3}, "a", t0, ttl, 0, 0)
	s.insert([]uint64{1, 2}, "b", t0.Add(time.Second), ttl, 0, 0)
	s.insert([]uint64{1}, "a", t0.Add(2*time.Second), ttl, 0, 0) // renews a's key 1
	check := func(name string, keys []uint64, now time.Time, want map[string]int) {
		t.Helper()
		if got := s.match(keys, nil, now); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s: match %v = %v, want %v", name, keys, got, want)
		}
	}
	check("all alive", []uint64{1, 2, 3}, t0, map[string]int{"a": 3, "b": 2})
	check("a's first batch expired, key 1 renewed", []uint64{1, 2, 3}, t0.Add(10500*time.Millisecond), map[string]int{"a": 1, "b": 2})
	check("chain broken at an unknown key", []uint64{9, 1}, t0, nil)

	// 6 keys at most: a batch of 3 pushes out the oldest ones.
	s.insert([]uint64{7, 8, 9}, "c", t0.Add(3*time.Second), ttl, 0, 0)
	if s.count > 6 {
		t.Errorf("count %d > max 6", s.count)
	}
	check("oldest batch dropped for room", []uint64{1, 2, 3}, t0.Add(3*time.Second), map[string]int{"a": 1, "b": 2})
	check("new batch", []uint64{7, 8, 9}, t0.Add(3*time.Second), map[string]int{"c": 3})

	s.removeWorker("b")
	check("b removed", []uint64{1, 2}, t0.Add(3*time.Second), map[string]int{"a": 1})
	// Everything expires: the next insertion prunes it all.
	s.insert([]uint64{5}, "a", t0.Add(time.Minute), ttl, 0, 0)
	if len(s.m) != 1 || s.count != 1 || len(s.q)-s.head != 1 {
		t.Errorf("after expiry: %d keys, count %d, %d batches; want 1, 1, 1", len(s.m), s.count, len(s.q)-s.head)
	}
}

func TestElsewhere(t *testing.T) {
	for _, tc := range []struct {
		cached map[string]int
		want   string
	}{
		{nil, ""},
		{map[string]int{"a": 3, "b": 0}, ""},
		{map[string]int{"a": 3, "b": 2, "c": 5, "d": 2}, ", elsewhere c=5 b=2 d=2"},
		{map[string]int{"b": 1, "c": 2, "d": 3, "e": 4, "f": 5, "g": 6}, ", elsewhere g=6 f=5 e=4 d=3 (+2 more)"},
	} {
		if got := elsewhere(tc.cached, "a"); got != tc.want {
			t.Errorf("elsewhere(%v) = %q, want %q", tc.cached, got, tc.want)
		}
	}
}

// TestKVAwareSpreadsABurstOfNewPrefixes is the mechanism behind the hit
// rate kv_aware lost at concurrency 32 on a loaded machine: new prefixes
// routed before any of their events arrive, and before the requests are
// counted in flight (the proxy counts a request once it is sent, after the
// pick), all cost the same everywhere and, as far as the index knows, every
// worker holds the same blocks. Counting the new blocks routed to each
// worker until its events confirm them, 16 prefixes over 4 workers go 4 to
// each, as cache_aware's synchronous tree spreads them; picked at random
// they pile up (P(4/4/4/4) ≈ 1.5 %) and the fuller workers evict. Once the
// events arrive the routed blocks are not counted twice; after the TTL
// unconfirmed ones are not counted at all.
func TestKVAwareSpreadsABurstOfNewPrefixes(t *testing.T) {
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers("http://a:1", "http://b:1", "http://c:1", "http://d:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	now := time.Unix(1000, 0)
	p := newPolicy(t, x, func(o *Options) {
		o.LoadWeight, o.TieBand, o.Speculative = 0.02, DefaultTieBand, true
		o.Now = func() time.Time { return now }
		o.HasEvents = func(string) bool { return true } // subscribed, nothing heard yet
	})
	type routed struct {
		w    *worker.Worker
		toks []uint32
	}
	var sent []routed
	for g := range 16 {
		req := &policy.Request{Path: "/v1/completions", Tokens: wordIDs(words(40, strings.Repeat("g", g+1)))}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(ch.Reason, "kv match 0/10") {
			t.Fatalf("prefix %d: reason %q, want a kv_aware pick of a new prefix", g, ch.Reason)
		}
		sent = append(sent, routed{ch.Worker, req.Tokens})
	}
	per := map[string]int{}
	for _, r := range sent {
		per[r.w.Key()]++
	}
	for _, w := range ws {
		if per[w.Key()] != 4 {
			t.Fatalf("16 new prefixes over 4 workers: %v, want 4 each", per)
		}
		if got := p.spec.pending(w.Key(), 0, now); got != 40 {
			t.Errorf("%s: %d blocks pending, want 4 prompts × 10", w.Key(), got)
		}
	}
	// The events arrive: nothing is pending any more.
	for i, r := range sent {
		e := kvevents.BlockStored{BlockSize: 4, LoRAID: -1, TokenIDs: r.toks[:40]}
		for j := range 10 {
			e.BlockHashes = append(e.BlockHashes, kvevents.BytesHash(fmt.Appendf(nil, "p%d/%d", i, j)))
		}
		x.Apply(r.w.Key(), []kvevents.Event{e})
	}
	for _, w := range ws {
		blocks, stored := x.WorkerState(w.Key())
		if blocks != 40 || stored != 40 {
			t.Fatalf("%s: index holds %d blocks (%d stored), want 40", w.Key(), blocks, stored)
		}
		if got := p.spec.pending(w.Key(), stored, now); got != 0 {
			t.Errorf("%s: %d blocks pending after its events, want 0", w.Key(), got)
		}
	}
	// Unconfirmed blocks stop counting at the TTL.
	req := &policy.Request{Path: "/v1/completions", Tokens: wordIDs(words(40, strings.Repeat("l", 20)))}
	policy.Prepare(t.Context(), p, req, c)
	ch, err := p.Pick(req, c)
	if err != nil {
		t.Fatal(err)
	}
	_, stored := x.WorkerState(ch.Worker.Key())
	if got := p.spec.pending(ch.Worker.Key(), stored, now); got != 10 {
		t.Errorf("pending after one more prompt: %d, want 10", got)
	}
	now = now.Add(3 * time.Second)
	if got := p.spec.pending(ch.Worker.Key(), stored, now); got != 0 {
		t.Errorf("pending after the TTL: %d, want 0", got)
	}
}

// TestKVAwareRemembersItsFallbackPicks: engines that have published
// nothing yet (a fresh fleet) are routed by the fallback policy, and those
// picks are recorded like kv_aware's own: once the events flow, a prompt
// that shares a prefix routed before them goes where that prefix went, and
// new prefixes go to the workers the fallback gave fewer blocks.
func TestKVAwareRemembersItsFallbackPicks(t *testing.T) {
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 4})
	ws := mkWorkers("http://a:1", "http://b:1", "http://c:1", "http://d:1")
	c := policy.Candidates{Gen: 1, Workers: ws}
	now := time.Unix(1000, 0)
	publishing := false
	p := newPolicy(t, x, func(o *Options) {
		o.LoadWeight, o.TieBand, o.Speculative, o.SpeculativeTTL = 0.02, DefaultTieBand, true, 2*time.Second
		o.Now = func() time.Time { return now }
		o.HasEvents = func(string) bool { return publishing }
	})
	pick := func(prompt string) policy.Choice {
		t.Helper()
		req := &policy.Request{Path: "/v1/completions", Tokens: wordIDs(prompt)}
		policy.Prepare(t.Context(), p, req, c)
		ch, err := p.Pick(req, c)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}
	// Round robin (the test's fallback) sends prefixes 0-5 to a, b, c, d, a, b.
	first := map[int]*worker.Worker{}
	for g := range 6 {
		ch := pick(words(40, strings.Repeat("g", g+1)))
		if !strings.Contains(ch.Reason, "kv_aware fallback (no candidate publishes KV events)") {
			t.Fatalf("prefix %d: reason %q, want the fallback", g, ch.Reason)
		}
		first[g] = ch.Worker
	}
	publishing = true // subscribed, no block heard of yet
	for g := range 6 {
		ch := pick(words(40, strings.Repeat("g", g+1)) + " a follow-up question")
		if ch.Worker != first[g] || !strings.HasPrefix(ch.Reason, "kv match 10/") {
			t.Errorf("follower of prefix %d went to %s (%s), its prefix to %s", g, ch.Worker.Key(), ch.Reason, first[g].Key())
		}
	}
	// a and b hold two prefixes each, c and d one: the next two new
	// prefixes go to c and d.
	got := map[string]bool{}
	for g := 6; g < 8; g++ {
		got[pick(words(40, strings.Repeat("g", g+1))).Worker.Key()] = true
	}
	if !got[ws[2].Key()] || !got[ws[3].Key()] {
		t.Errorf("new prefixes went to %v, want c and d", got)
	}
}

// TestSpeculativeContinuesTheIndex: entries inserted past the blocks the
// index holds extend the index's depth, and only from it.
func TestSpeculativeContinuesTheIndex(t *testing.T) {
	t0 := time.Unix(1000, 0)
	s := newSpeculative(100)
	s.insert([]uint64{3, 4}, "z", t0, time.Second, 2, 0)
	for _, tc := range []struct {
		from map[string]int
		want string
	}{
		{map[string]int{"z": 2}, "map[z:4]"},
		{map[string]int{"z": 1}, "map[]"}, // block 2 neither indexed nor speculative
		{nil, "map[]"},
		{map[string]int{"y": 2}, "map[]"},
	} {
		if got := fmt.Sprint(s.match([]uint64{1, 2, 3, 4, 5}, tc.from, t0)); got != tc.want {
			t.Errorf("match from %v = %s, want %s", tc.from, got, tc.want)
		}
	}
	if got := fmt.Sprint(s.match([]uint64{1, 2, 3, 4}, map[string]int{"z": 2}, t0.Add(time.Second))); got != "map[]" {
		t.Errorf("after the TTL: %s, want map[]", got)
	}
	// A key's first holder removed, the second stays; then none.
	s.insert([]uint64{7}, "p", t0, time.Second, 1, 0)
	s.insert([]uint64{7}, "q", t0, time.Second, 1, 0)
	s.insert([]uint64{7}, "r", t0, time.Second, 1, 0)
	s.removeWorker("p")
	if got := fmt.Sprint(s.match([]uint64{7}, nil, t0)); got != "map[q:1 r:1]" {
		t.Errorf("after removing the first holder: %s, want map[q:1 r:1]", got)
	}
	s.removeWorker("r")
	s.removeWorker("q")
	if _, ok := s.m[7]; ok || len(s.pend) != 1 {
		t.Errorf("after removing every holder: key kept %v, %d workers pending (want only z)", ok, len(s.pend))
	}
}
