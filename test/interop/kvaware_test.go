package interop

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// kvBlockSize is the engines' --block-size (newEngine).
const kvBlockSize = 32

// kvEngine is a real vLLM engine publishing KV events over ZMQ.
type kvEngine struct {
	*engine
	pub, replay int    // ports of its PUB and replay ROUTER sockets
	adapter     string // the LoRA adapter's directory (kv-b's)
}

func (e *kvEngine) endpoints() string {
	return fmt.Sprintf("tcp://127.0.0.1:%d,tcp://127.0.0.1:%d", e.pub, e.replay)
}

// eventsConfig is e's --kv-events-config: the ZMQ publisher binds, as
// vLLM does for an endpoint with "*".
func (e *kvEngine) eventsConfig() string {
	return fmt.Sprintf(`{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:%d","replay_endpoint":"tcp://*:%d","topic":"kv"}`,
		e.pub, e.replay)
}

// kvBlocks is the block count the router's /workers reports for e (-1
// while it has no events from e).
func kvBlocks(t *testing.T, r *harness.Router, e *kvEngine) int {
	t.Helper()
	var ws struct {
		KV struct {
			Workers map[string]struct {
				Blocks int  `json:"blocks"`
				Events bool `json:"events"`
			} `json:"workers"`
		} `json:"kv_aware"`
	}
	if harness.GetJSON(t, http.DefaultClient, r.Base+"/workers", &ws) != 200 {
		t.Fatal("/workers")
	}
	w := ws.KV.Workers[e.URL()]
	if !w.Events {
		return -1
	}
	return w.Blocks
}

// startKVEngines starts two unified engines with --kv-events-config (the
// ZMQ publisher binds, as vLLM does for an endpoint with "*") and stops them
// when t ends.
// kvLoRA is the LoRA adapter the second KV engine serves (startKVEngines).
const kvLoRA = "sql"

func startKVEngines(t *testing.T) (a, b *kvEngine) {
	t.Helper()
	ports, err := freePorts(6)
	if err != nil {
		t.Fatal(err)
	}
	logDir := t.TempDir()
	adapter := writeLoRAAdapter(t, t.TempDir())
	var es []*kvEngine
	for i, name := range []string{"kv-a", "kv-b"} {
		e := &kvEngine{engine: newEngine(name, ports[3*i], 0, "", logDir), pub: ports[3*i+1], replay: ports[3*i+2]}
		e.args = append(e.args, "--kv-events-config", e.eventsConfig())
		if i == 1 {
			e.args = append(e.args, "--enable-lora", "--lora-modules", kvLoRA+"="+adapter, "--max-lora-rank", "8", "--max-loras", "1")
			// /v1/load_lora_adapter and /v1/unload_lora_adapter
			// (checkLoRAThroughRouter); kv-a serves neither.
			e.env = append(e.env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
			e.adapter = adapter
		}
		e.startFor(t)
		es = append(es, e)
	}
	for _, e := range es {
		waitServing(t, e.engine)
	}
	return es[0], es[1]
}

// rawEvents subscribes to e's PUB socket with a plain ZMQ SUB and decodes
// every message with internal/kvevents: its BlockStored events, until ctx
// ends.
func rawEvents(t *testing.T, ctx context.Context, e *kvEngine) <-chan kvevents.BlockStored {
	return subscribeEvents(t, ctx, e, func(ev kvevents.Event) (kvevents.BlockStored, bool) {
		bs, ok := ev.(kvevents.BlockStored)
		return bs, ok
	})
}

// subscribeEvents sends the events of e that pick keeps, in order, until
// ctx ends; the channel closes then. A message that is not three frames or
// a batch that does not decode fails t.
func subscribeEvents[E any](t *testing.T, ctx context.Context, e *kvEngine, pick func(kvevents.Event) (E, bool)) <-chan E {
	t.Helper()
	sub := zmq4.NewSub(ctx)
	if err := sub.Dial(fmt.Sprintf("tcp://127.0.0.1:%d", e.pub)); err != nil {
		t.Fatalf("dial %s events: %v", e.name, err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv"); err != nil {
		t.Fatal(err)
	}
	out := make(chan E, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(out)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return // ctx ended (or the engine went away)
			}
			if len(msg.Frames) != 3 || string(msg.Frames[0]) != "kv" || len(msg.Frames[1]) != 8 {
				t.Errorf("%s: message of %d frames, want topic, 8-byte sequence, payload", e.name, len(msg.Frames))
				continue
			}
			b, skipped, err := kvevents.DecodeBatch(msg.Frames[2])
			if err != nil || skipped != 0 {
				t.Errorf("%s: batch not decoded (%d skipped): %v", e.name, skipped, err)
				continue
			}
			for _, ev := range b.Events {
				v, ok := pick(ev)
				if !ok {
					continue
				}
				select {
				case out <- v:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	t.Cleanup(func() { _ = sub.Close(); <-done })
	return out
}

// complete sends a greedy completion straight to base and fails t unless
// it succeeds; it returns the route receipt header.
func complete(t *testing.T, base, prompt string, maxTokens int) string {
	t.Helper()
	return completeSalted(t, base, prompt, maxTokens, "")
}

// completeSalted is complete with a cache_salt ("" for none).
func completeSalted(t *testing.T, base, prompt string, maxTokens int, salt string) string {
	t.Helper()
	return completeAs(t, base, modelDir, prompt, maxTokens, salt)
}

// completeAs is complete for a model (the base model's or a LoRA
// adapter's name) with a cache_salt ("" for none).
func completeAs(t *testing.T, base, model, prompt string, maxTokens int, salt string) string {
	t.Helper()
	req := map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0}
	if salt != "" {
		req["cache_salt"] = salt
	}
	body, _ := json.Marshal(req)
	code, hdr, b := post(t, ctxT(t, 60*time.Second), base+"/v1/completions", string(body))
	if code != 200 {
		t.Fatalf("%s: %d %s", base, code, b)
	}
	return hdr.Get("X-Switchyard-Route")
}

func engineTokens(t *testing.T, e *kvEngine, prompt string) []uint32 {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": prompt})
	code, _, b := post(t, ctxT(t, 30*time.Second), e.URL()+"/tokenize", string(body))
	var out struct{ Tokens []uint32 }
	if code != 200 || json.Unmarshal(b, &out) != nil || len(out.Tokens) == 0 {
		t.Fatalf("%s /tokenize: %d %s", e.name, code, b)
	}
	return out.Tokens
}

// storedFor waits for the BlockStored events that cover the n full blocks
// of tokens (events of other prompts are skipped) and returns them in
// order.
func storedFor(t *testing.T, e *kvEngine, events <-chan kvevents.BlockStored, tokens []uint32, n int) []kvevents.BlockStored {
	t.Helper()
	var got []kvevents.BlockStored
	covered := 0
	timeout := time.After(60 * time.Second)
	for covered < n {
		select {
		case ev, ok := <-events:
			if !ok {
				t.Fatalf("%s: event stream ended", e.name)
			}
			at := covered * kvBlockSize
			if at+len(ev.TokenIDs) > len(tokens) || !slices.Equal(ev.TokenIDs, tokens[at:at+len(ev.TokenIDs)]) {
				continue // another prompt's blocks
			}
			got = append(got, ev)
			covered += len(ev.BlockHashes)
		case <-timeout:
			t.Fatalf("%s: %d of %d blocks of the prompt stored within 60 s", e.name, covered, n)
		}
	}
	return got
}

// TestKVEventsFromRealEngine: two real vLLM engines publish KV events
// (--kv-events-config, ZMQ). internal/kvevents decodes them; their token
// ids are the prompt's as /tokenize gives them, in full blocks of the
// engine's block size, chained by parent hash; the router's index built
// from them matches every full block of the prompt's own keys. vLLM 0.32's
// default prefix-caching hash (sha256, NONE_HASH from a fixed seed when
// PYTHONHASHSEED is unset) gives both engines the same block hashes for
// the same prompt. Then switchyard --policy kv_aware, following both
// engines' events, sends a prompt to the engine that holds it, and a
// repeated prompt to the engine that served it first.
func TestKVEventsFromRealEngine(t *testing.T) {
	kb := routerOnly(t)
	a, b := startKVEngines(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	evA, evB := rawEvents(t, ctx, a), rawEvents(t, ctx, b)
	// The SUB connects asynchronously: warm up until a batch arrives.
	for i, p := range []struct {
		e  *kvEngine
		ev <-chan kvevents.BlockStored
	}{{a, evA}, {b, evB}} {
		warm := strings.Repeat("warm up the prefix cache of this engine before the test ", 4)
		attempt := 0
		harness.WaitFor(t, 60*time.Second, 10*time.Millisecond, p.e.name+" publishing", func() bool {
			attempt++ // a new prompt each time: a cached one stores no block
			complete(t, p.e.URL(), fmt.Sprintf("%d %d %s", i, attempt, warm), 1)
			select {
			case <-p.ev:
				return true
			case <-time.After(time.Second):
				return false
			}
		})
	}

	prompt := strings.Repeat("Switchyard routes each request to the engine whose prefix cache already holds it. ", 6)
	toks := engineTokens(t, a, prompt)
	n := len(toks) / kvBlockSize
	if n < 2 {
		t.Fatalf("prompt is %d tokens: fewer than 2 blocks of %d", len(toks), kvBlockSize)
	}
	if tb := engineTokens(t, b, prompt); !slices.Equal(tb, toks) {
		t.Fatalf("the engines tokenize the prompt differently")
	}
	complete(t, a.URL(), prompt, 1)
	complete(t, b.URL(), prompt, 1)
	storedA := storedFor(t, a, evA, toks, n)
	storedB := storedFor(t, b, evB, toks, n)

	var hashesA, hashesB []kvevents.Hash
	var prev kvevents.Hash
	for i, ev := range storedA {
		if ev.BlockSize != kvBlockSize || len(ev.TokenIDs) != len(ev.BlockHashes)*kvBlockSize {
			t.Errorf("event %d: block size %d, %d tokens for %d hashes", i, ev.BlockSize, len(ev.TokenIDs), len(ev.BlockHashes))
		}
		if ev.Parent != prev {
			t.Errorf("event %d: parent %#x, want the previous block's hash %#x", i, ev.Parent, prev)
		}
		prev = ev.BlockHashes[len(ev.BlockHashes)-1]
		hashesA = append(hashesA, ev.BlockHashes...)
	}
	for _, ev := range storedB {
		hashesB = append(hashesB, ev.BlockHashes...)
	}
	if !slices.Equal(hashesA, hashesB) {
		t.Errorf("engine block hashes differ for the same prompt: %v vs %v", hashesA, hashesB)
	}
	idx := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: kvBlockSize})
	for name, evs := range map[string][]kvevents.BlockStored{a.name: storedA, b.name: storedB} {
		for _, ev := range evs {
			idx.Apply(name, []kvevents.Event{ev})
		}
	}
	keys := idx.BlockKeys(toks, "")
	var evToks []uint32
	for _, ev := range storedA {
		evToks = append(evToks, ev.TokenIDs...)
	}
	if got := idx.BlockKeys(evToks, ""); !slices.Equal(got, keys[:len(got)]) || len(got) != n {
		t.Errorf("router keys of the events' tokens %v, want the prompt's %v", got, keys)
	}
	if m := idx.Match(keys); m[a.name] != n || m[b.name] != n {
		t.Errorf("index match %v, want %d blocks on both engines", m, n)
	}
	t.Logf("prompt of %d tokens: %d blocks stored on each engine, engine hashes equal, router index matches all", len(toks), n)
	checkSaltedEvents(t, a, evA, prompt, toks, hashesA)
	checkLoRAEvents(t, b, evB, prompt, toks, hashesB)

	// The router follows both engines' events.
	r := kb.StartRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "kv_aware", "--route-receipt",
		"--kv-block-size", fmt.Sprint(kvBlockSize), "--kv-speculative-indexing=false",
		"--kv-events-endpoints", a.URL()+"="+a.endpoints(), b.URL()+"="+b.endpoints())
	r.WaitReady(t, 30*time.Second)
	blocks := func(e *kvEngine) int { return kvBlocks(t, r, e) }
	// Its SUB connects asynchronously too: prompts straight to the engines
	// until the router has seen a batch of each.
	for i, e := range []*kvEngine{a, b} {
		attempt := 0
		harness.WaitFor(t, 60*time.Second, 500*time.Millisecond, "the router receiving "+e.name+"'s events", func() bool {
			attempt++
			complete(t, e.URL(), fmt.Sprintf("%d %d %s", i, attempt, strings.Repeat("let the router see this engine publish ", 4)), 1)
			return blocks(e) >= 0
		})
	}
	routed := func(prompt string) string { return complete(t, r.Base, prompt, 1) }
	servedBy := func(receipt string, e *kvEngine) bool {
		return strings.Contains(receipt+";", "worker="+e.URL()+";") && strings.Contains(receipt, "kv match")
	}
	// A prompt one engine holds (sent to it directly) is routed there.
	for i, holder := range []*kvEngine{b, a} {
		q := fmt.Sprintf("Question %d: which engine holds the blocks of this long shared system prompt? %s", i, prompt)
		qn := len(engineTokens(t, holder, q)) / kvBlockSize
		before := blocks(holder)
		complete(t, holder.URL(), q, 1)
		harness.WaitFor(t, 60*time.Second, 50*time.Millisecond, "the router indexing "+holder.name+"'s blocks", func() bool {
			return blocks(holder) >= before+qn
		})
		rc := routed(q)
		if !servedBy(rc, holder) {
			t.Errorf("prompt held by %s routed %q", holder.name, rc)
		}
		t.Logf("prompt held by %s: %s", holder.name, rc)
	}
	// A salted prompt b holds draws the same salt there, and nothing else.
	qs := "A tenant's own system prompt, kept apart by its cache salt. " + prompt
	qsn := len(engineTokens(t, b, qs)) / kvBlockSize
	before0 := blocks(b)
	completeSalted(t, b.URL(), qs, 1, "tenant-9")
	harness.WaitFor(t, 60*time.Second, 50*time.Millisecond, "the router indexing b's salted blocks", func() bool {
		return blocks(b) >= before0+qsn
	})
	rc9 := completeSalted(t, r.Base, qs, 1, "tenant-9")
	if !servedBy(rc9, b) || !strings.Contains(rc9, fmt.Sprintf("kv match %d/", qsn)) {
		t.Errorf("salted prompt held by b routed %q, want b with %d blocks matched", rc9, qsn)
	}
	for _, salt := range []string{"", "tenant-8"} {
		if rc := completeSalted(t, r.Base, qs, 1, salt); !strings.Contains(rc, "kv match 0/") {
			t.Errorf("the prompt with salt %q matched blocks stored under tenant-9: %q", salt, rc)
		}
	}
	t.Logf("salted prompt held by kv-b, same salt: %s", rc9)

	// A prompt b stored for its LoRA adapter (events' lora_name) draws the
	// adapter's requests there; the base model's requests match nothing.
	ql := "An adapter's own prompt, keyed apart by the adapter's name. " + prompt
	qln := len(engineTokens(t, b, ql)) / kvBlockSize
	before1 := blocks(b)
	completeAs(t, b.URL(), kvLoRA, ql, 1, "")
	harness.WaitFor(t, 60*time.Second, 50*time.Millisecond, "the router indexing b's adapter blocks", func() bool {
		return blocks(b) >= before1+qln
	})
	rcl := completeAs(t, r.Base, kvLoRA, ql, 1, "")
	if !servedBy(rcl, b) || !strings.Contains(rcl, fmt.Sprintf("kv match %d/", qln)) {
		t.Errorf("the adapter's prompt held by b routed %q, want b with %d blocks matched", rcl, qln)
	}
	if rc := completeAs(t, r.Base, modelDir, ql, 1, ""); !strings.Contains(rc, "kv match 0/") {
		t.Errorf("the base model's request matched the adapter's blocks: %q", rc)
	}
	t.Logf("prompt held by kv-b for adapter %s: %s", kvLoRA, rcl)

	// A new prompt through the router, then again: the second goes where
	// the first went, for the blocks that engine reported.
	q := "A prompt nobody has seen: " + strings.Repeat("fresh tokens for the router to place and then find again ", 5)
	qn := len(engineTokens(t, a, q)) / kvBlockSize
	before := map[*kvEngine]int{a: blocks(a), b: blocks(b)}
	first := routed(q)
	var to *kvEngine
	for _, e := range []*kvEngine{a, b} {
		if strings.Contains(first+";", "worker="+e.URL()+";") {
			to = e
		}
	}
	if to == nil {
		t.Fatalf("first request's receipt %q names neither engine", first)
	}
	harness.WaitFor(t, 60*time.Second, 50*time.Millisecond, "the router indexing the first request's blocks", func() bool {
		return blocks(to) >= before[to]+qn
	})
	rc := routed(q)
	if !servedBy(rc, to) {
		t.Errorf("repeated prompt routed %q, want %s (first: %q)", rc, to.name, first)
	}
	t.Logf("new prompt first routed %q, repeated %q", first, rc)

	checkLoRAThroughRouter(t, kb, a, b)
}

// checkLoRAThroughRouter loads and unloads a LoRA adapter at run time
// through routers in front of the real engines: one in front of kv-b alone
// relays the engine's own answers (success lines, 400 for a second load,
// 404 for a second unload), and the adapter then serves completions
// through it; one in front of both reaches kv-b and reports kv-a, which
// has no such route, by its URL.
func checkLoRAThroughRouter(t *testing.T, kb *harness.Bins, a, b *kvEngine) {
	t.Helper()
	ctx := ctxT(t, 2*time.Minute)
	load := fmt.Sprintf(`{"lora_name": "sql2", "lora_path": %q}`, b.adapter)
	unload := `{"lora_name": "sql2"}`
	one := kb.StartRouter(t, "--worker-urls", b.URL(), "--policy", "round_robin")
	steps := []struct {
		path, body string
		status     int
		want       string
	}{
		{"/v1/load_lora_adapter", load, 200, "Success: LoRA adapter 'sql2' added successfully."},
		{"/v1/load_lora_adapter", load, 400, "The lora adapter 'sql2' has already been loaded."},
		{"/v1/unload_lora_adapter", unload, 200, "Success: LoRA adapter 'sql2' removed successfully."},
		{"/v1/unload_lora_adapter", unload, 404, "The lora adapter 'sql2' cannot be found."},
	}
	for i, st := range steps {
		code, _, body := post(t, ctx, one.Base+st.path, st.body)
		if code != st.status || !strings.Contains(string(body), st.want) {
			t.Fatalf("step %d %s: %d %s, want %d with %q", i, st.path, code, body, st.status, st.want)
		}
		if i == 0 {
			completeAs(t, one.Base, "sql2", "An adapter loaded through the router answers.", 2, "")
		}
	}

	both := kb.StartRouter(t, "--worker-urls", a.URL(), b.URL(), "--policy", "round_robin")
	code, _, body := post(t, ctx, both.Base+"/v1/load_lora_adapter", load)
	if code != 404 || !strings.Contains(string(body), "LoRA adapter load failed on 1 of 2 workers: ["+a.URL()+": 404 Not Found]") {
		t.Fatalf("load through both: %d %s, want 404 naming kv-a only", code, body)
	}
	completeAs(t, b.URL(), "sql2", "The adapter reached kv-b through the router.", 2, "")
	t.Logf("load through kv-a and kv-b: %d %s", code, body)
}

// checkSaltedEvents: the prompt sent again with a cache_salt is stored
// again under other hashes (vLLM mixes the salt into the first block's
// hash), its first event carries the salt in extra_keys on its first block
// only, and an index of those events matches the prompt's salted keys,
// not its plain ones.
func checkSaltedEvents(t *testing.T, e *kvEngine, events <-chan kvevents.BlockStored, prompt string, toks []uint32, plain []kvevents.Hash) {
	t.Helper()
	n := len(toks) / kvBlockSize
	completeSalted(t, e.URL(), prompt, 1, "tenant-1")
	salted := storedFor(t, e, events, toks, n)
	var hashes []kvevents.Hash
	for i, ev := range salted {
		hashes = append(hashes, ev.BlockHashes...)
		for j, x := range ev.Extra {
			want := kvevents.BlockExtra{}
			if i == 0 && j == 0 {
				want.Salt = "tenant-1"
			}
			if x != want {
				t.Errorf("salted event %d block %d: extra %+v, want %+v", i, j, x, want)
			}
		}
	}
	if len(salted[0].Extra) == 0 || salted[0].Parent != 0 {
		t.Fatalf("salted prompt's first event: parent %#x, extra %+v; want no parent and the salt", salted[0].Parent, salted[0].Extra)
	}
	if slices.Equal(hashes, plain) {
		t.Errorf("salted and plain prompt stored under the same hashes")
	}
	idx := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: kvBlockSize})
	for _, ev := range salted {
		idx.Apply(e.name, []kvevents.Event{ev})
	}
	if m := idx.Match(idx.SaltedBlockKeys(toks, "", "tenant-1")); m[e.name] != n {
		t.Errorf("salted keys match %v, want %d blocks", m, n)
	}
	if m := idx.Match(idx.BlockKeys(toks, "")); len(m) != 0 {
		t.Errorf("plain keys match the salted blocks: %v", m)
	}
	t.Logf("salted prompt: %d blocks stored under new hashes, the salt in the first block's extra_keys, index matches the salted keys only", n)
}

// checkLoRAEvents: the prompt sent to the engine's LoRA adapter is stored
// under other hashes, its events name the adapter (lora_name, and
// extra_keys holding only that name, which is no salt), and an index of
// them matches the adapter's keys, not the base model's.
func checkLoRAEvents(t *testing.T, e *kvEngine, events <-chan kvevents.BlockStored, prompt string, toks []uint32, base []kvevents.Hash) {
	t.Helper()
	n := len(toks) / kvBlockSize
	completeAs(t, e.URL(), kvLoRA, prompt, 1, "")
	stored := storedFor(t, e, events, toks, n)
	var hashes []kvevents.Hash
	for i, ev := range stored {
		hashes = append(hashes, ev.BlockHashes...)
		if ev.LoRAName != kvLoRA {
			t.Errorf("adapter event %d: lora_name %q, want %q", i, ev.LoRAName, kvLoRA)
		}
		for j, x := range ev.Extra {
			if x != (kvevents.BlockExtra{}) {
				t.Errorf("adapter event %d block %d: extra %+v, want none beyond the adapter's name", i, j, x)
			}
		}
	}
	if slices.Equal(hashes, base) {
		t.Errorf("the adapter's and the base model's blocks have the same hashes")
	}
	idx := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: kvBlockSize})
	for _, ev := range stored {
		idx.Apply(e.name, []kvevents.Event{ev})
	}
	if m := idx.Match(idx.BlockKeys(toks, kvLoRA)); m[e.name] != n || !idx.IsLoRA(kvLoRA) {
		t.Errorf("adapter keys match %v (IsLoRA %v), want %d blocks", m, idx.IsLoRA(kvLoRA), n)
	}
	if m := idx.Match(idx.BlockKeys(toks, "")); len(m) != 0 {
		t.Errorf("base keys match the adapter's blocks: %v", m)
	}
	t.Logf("adapter %s: %d blocks stored under new hashes with its name, index matches its keys only", kvLoRA, n)
}

// writeLoRAAdapter writes a PEFT LoRA adapter for the tiny model (rank 8
// on q_proj and v_proj of its 2 layers, random weights) into dir and
// returns dir: adapter_config.json and adapter_model.safetensors (an
// 8-byte header length, a JSON header, the float32 tensors).
func writeLoRAAdapter(t *testing.T, dir string) string {
	t.Helper()
	const rank, hidden = 8, 128
	cfg := `{"peft_type":"LORA","r":8,"lora_alpha":16,"target_modules":["q_proj","v_proj"],"lora_dropout":0.0,"bias":"none","task_type":"CAUSAL_LM"}`
	if err := os.WriteFile(filepath.Join(dir, "adapter_config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	type tensor struct {
		DType   string `json:"dtype"`
		Shape   []int  `json:"shape"`
		Offsets [2]int `json:"data_offsets"`
	}
	header := map[string]tensor{}
	var data []byte
	rng := rand.New(rand.NewPCG(1, 2))
	add := func(name string, rows, cols int) {
		start := len(data)
		for range rows * cols {
			data = binary.LittleEndian.AppendUint32(data, math.Float32bits(float32(rng.NormFloat64()*0.1)))
		}
		header[name] = tensor{"F32", []int{rows, cols}, [2]int{start, len(data)}}
	}
	for layer := range 2 {
		for _, m := range []string{"q_proj", "v_proj"} {
			p := fmt.Sprintf("base_model.model.model.layers.%d.self_attn.%s", layer, m)
			add(p+".lora_A.weight", rank, hidden)
			add(p+".lora_B.weight", hidden, rank)
		}
	}
	h, err := json.Marshal(header)
	if err != nil {
		t.Fatal(err)
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	out = append(append(out, h...), data...)
	if err := os.WriteFile(filepath.Join(dir, "adapter_model.safetensors"), out, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}
