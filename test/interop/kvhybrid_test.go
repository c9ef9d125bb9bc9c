package interop

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// hybridWindow is the sliding window of the hybrid model's second layer.
const hybridWindow = 64

// writeHybridModel writes a copy of the tiny model whose second layer
// attends to a sliding window (config layer_types, as Gemma 3 and gpt-oss
// declare theirs): vLLM gives such a model two KV cache groups, one of
// full attention and one of sliding-window attention.
func writeHybridModel(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(modelDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		src := filepath.Join(modelDir, e.Name())
		if e.Name() != "config.json" {
			if err := os.Symlink(src, filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
			continue
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		var cfg map[string]any
		if err := json.Unmarshal(b, &cfg); err != nil {
			t.Fatal(err)
		}
		cfg["layer_types"] = []string{"full_attention", "sliding_attention"}
		cfg["sliding_window"] = hybridWindow
		if b, err = json.Marshal(cfg); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// startHybridEngine starts one engine serving the hybrid model (under the
// tiny model's name) with KV events and a prefix cache of 128 blocks, small
// enough for a few prompts to evict one.
func startHybridEngine(t *testing.T) *kvEngine {
	t.Helper()
	ports, err := freePorts(3)
	if err != nil {
		t.Fatal(err)
	}
	e := &kvEngine{engine: newEngine("kv-hybrid", ports[0], 0, "", t.TempDir()), pub: ports[1], replay: ports[2]}
	e.args[1] = writeHybridModel(t, t.TempDir())
	e.args = append(e.args, "--served-model-name", modelDir, "--num-gpu-blocks-override", "128", "--kv-events-config", e.eventsConfig())
	e.startFor(t)
	waitServing(t, e.engine)
	return e
}

// tokensAt reports whether ids are toks's from a block boundary on.
func tokensAt(toks, ids []uint32) bool {
	for at := 0; at+len(ids) <= len(toks); at += kvBlockSize {
		if slices.Equal(toks[at:at+len(ids)], ids) {
			return true
		}
	}
	return false
}

// TestKVEventsHybridModel: a real vLLM engine serving a model with a
// full-attention layer and a sliding-window layer publishes every block
// once per KV cache group, in one batch per step; the sliding-window
// group's store lists only the blocks its window can serve a hit from
// while its token_ids span the whole prompt. The router decodes such a
// batch (it used to drop it whole as malformed, the full-attention blocks
// with it), follows the full-attention group, and routes onto it. With
// vllm_xargs kv_cache_report_mode "full" the engine restates a hit prefix
// as a new BlockStored (a reuse report); when vLLM then evicts those
// blocks once, they leave the router's index (counted as copies, they
// stayed in it for good).
func TestKVEventsHybridModel(t *testing.T) {
	kb := routerOnly(t)
	h := startHybridEngine(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	events := subscribeEvents(t, ctx, h, func(ev kvevents.Event) (kvevents.Event, bool) { return ev, true })
	// The library's own index, fed every event the engine publishes.
	idx := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: kvBlockSize})
	var seen []kvevents.Event
	next := func(within time.Duration) (kvevents.Event, bool) {
		select {
		case ev, ok := <-events:
			if !ok {
				t.Fatal("event stream ended")
			}
			idx.Apply(h.name, []kvevents.Event{ev})
			seen = append(seen, ev)
			return ev, true
		case <-time.After(within):
			return nil, false
		}
	}
	attempt := 0
	harness.WaitFor(t, 60*time.Second, 10*time.Millisecond, h.name+" publishing", func() bool {
		attempt++
		complete(t, h.URL(), fmt.Sprintf("%d %s", attempt, strings.Repeat("warm up the prefix cache of this engine before the test ", 4)), 1)
		_, ok := next(time.Second)
		return ok
	})

	r := kb.StartRouter(t, "--worker-urls", h.URL(), "--policy", "kv_aware", "--route-receipt",
		"--kv-block-size", fmt.Sprint(kvBlockSize), "--kv-speculative-indexing=false",
		"--kv-events-endpoints", h.URL()+"="+h.endpoints())
	r.WaitReady(t, 30*time.Second)
	harness.WaitFor(t, 60*time.Second, 500*time.Millisecond, "the router receiving the engine's events", func() bool {
		attempt++
		complete(t, h.URL(), fmt.Sprintf("%d %s", attempt, strings.Repeat("let the router see this engine publish ", 4)), 1)
		return kvBlocks(t, r, h) >= 0
	})

	// A prompt of n full blocks: stored in both groups, the window's masked.
	prompt := strings.Repeat("A hybrid model caches every block once per group of its layers. ", 16)
	toks := engineTokens(t, h, prompt)
	n := len(toks) / kvBlockSize
	keys := idx.BlockKeys(toks, "")
	complete(t, h.URL(), prompt, 1)
	var full, window []kvevents.BlockStored
	deadline := time.Now().Add(60 * time.Second)
	for covered := 0; covered < n || len(window) == 0; {
		ev, ok := next(time.Until(deadline))
		if !ok {
			t.Fatalf("within 60 s: %d of %d full-attention blocks, %d sliding-window stores of the prompt", covered, n, len(window))
		}
		bs, ok := ev.(kvevents.BlockStored)
		if !ok || !tokensAt(toks, bs.TokenIDs) {
			continue // another prompt's
		}
		switch bs.Kind {
		case "full_attention":
			full = append(full, bs)
			covered += len(bs.BlockHashes)
		case "sliding_window":
			window = append(window, bs)
		default:
			t.Errorf("a store of group %d kind %q", bs.Group, bs.Kind)
		}
	}
	if full[0].Group == window[0].Group || !window[0].Masked() || full[0].Masked() {
		t.Errorf("groups %d (full) and %d (window), window store masked %v (%d hashes, %d tokens), full store masked %v",
			full[0].Group, window[0].Group, window[0].Masked(), len(window[0].BlockHashes), len(window[0].TokenIDs), full[0].Masked())
	}
	if m := idx.Match(keys)[h.name]; m != n {
		t.Errorf("library index matches %d of the prompt's %d blocks", m, n)
	}
	// Routed again and again (each a cache hit, publishing nothing) until
	// the router has the blocks: it decoded the batch.
	var rc string
	harness.WaitFor(t, 30*time.Second, 100*time.Millisecond, "the router matching the prompt's blocks", func() bool {
		rc = complete(t, r.Base, prompt, 1)
		return strings.Contains(rc, fmt.Sprintf("kv match %d/", n))
	})
	t.Logf("prompt of %d blocks: full-attention group %d stored %d hashes; sliding-window group %d stored %d hashes over %d tokens; routed %q",
		n, full[0].Group, n, window[0].Group, len(window[0].BlockHashes), len(window[0].TokenIDs), rc)

	// A reuse report of the prefix the prompt hits.
	body, _ := json.Marshal(map[string]any{"model": modelDir, "prompt": prompt, "max_tokens": 1, "temperature": 0,
		"vllm_xargs": map[string]any{"kv_cache_report_mode": "full"}})
	if code, _, b := post(t, ctxT(t, 60*time.Second), h.URL()+"/v1/completions", string(body)); code != 200 {
		t.Fatalf("completion with kv_cache_report_mode full: %d %s", code, b)
	}
	var held []kvevents.Hash // the prompt's full-attention blocks, in order
	for _, bs := range full {
		held = append(held, bs.BlockHashes...)
	}
	var report *kvevents.BlockStored
	for report == nil {
		ev, ok := next(30 * time.Second)
		if !ok {
			t.Fatal("no reuse report within 30 s")
		}
		if bs, ok := ev.(kvevents.BlockStored); ok && bs.Kind == "full_attention" && bs.Parent == 0 &&
			len(bs.BlockHashes) <= len(held) && slices.Equal(bs.BlockHashes, held[:len(bs.BlockHashes)]) {
			report = &bs
		}
	}
	if st, _ := idx.Stats(); st.Restated < uint64(len(report.BlockHashes)) {
		t.Errorf("reuse report of %d blocks: %d restated", len(report.BlockHashes), st.Restated)
	}

	// Other prompts until vLLM has evicted every full-attention block of it.
	gone := map[kvevents.Hash]bool{}
	for i := 0; len(gone) < len(held); i++ {
		if i == 40 {
			t.Fatalf("%d of the prompt's %d blocks evicted after %d other prompts", len(gone), len(held), i)
		}
		complete(t, h.URL(), fmt.Sprintf("%d %s", i, strings.Repeat(fmt.Sprintf("other prompt %d fills the cache. ", i), 20)), 1)
		for {
			ev, ok := next(2 * time.Second)
			if !ok {
				break
			}
			if rm, ok := ev.(kvevents.BlockRemoved); ok && rm.Group == full[0].Group {
				for _, x := range rm.BlockHashes {
					if slices.Contains(held, x) {
						gone[x] = true
					}
				}
			}
		}
	}
	if m := idx.Match(keys)[h.name]; m != 0 {
		t.Errorf("every block of the prompt evicted, reuse report seen: library index still matches %d", m)
	}
	// A marker prompt stored after the evictions: once the router matches
	// it, it has applied every event before it.
	marker := strings.Repeat("the marker prompt comes after every eviction. ", 10)
	complete(t, h.URL(), marker, 1)
	mn := len(engineTokens(t, h, marker)) / kvBlockSize
	harness.WaitFor(t, 30*time.Second, 100*time.Millisecond, "the router matching the marker", func() bool {
		return strings.Contains(complete(t, r.Base, marker, 1), fmt.Sprintf("kv match %d/", mn))
	})
	if rc := complete(t, r.Base, prompt, 1); !strings.Contains(rc, "kv match 0/") {
		t.Errorf("the evicted prompt routed %q, want 0 blocks matched", rc)
	}
	st, _ := idx.Stats()
	t.Logf("%d events; reuse report of %d blocks; prompt evicted: index stats %+v", len(seen), len(report.BlockHashes), st)
}
