package sim

import (
	"fmt"
	"slices"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/switchyard-llm/switchyard/internal/kvevents"
)

// publishedEvents decodes every batch p has sent.
func publishedEvents(t *testing.T, p *kvPublisher) []kvevents.Event {
	t.Helper()
	p.mu.Lock()
	sent := slices.Clone(p.buf)
	p.mu.Unlock()
	var out []kvevents.Event
	for _, s := range sent {
		b, skipped, err := kvevents.DecodeBatch(s.payload)
		if err != nil || skipped != 0 {
			t.Fatalf("batch %d: %d skipped, %v", s.seq, skipped, err)
		}
		out = append(out, b.Events...)
	}
	return out
}

// TestReuseReportOnTheWire: vLLM 0.32's kv_cache_report_mode "full", sent
// as vllm_xargs on /v1/completions, /v1/chat/completions or /v1/responses,
// makes a request whose prefix-cache lookup hits publish a BlockStored of
// the hit blocks: the same hashes as when they were first stored, parent
// null, their token ids, the salt on block 0 (v1/core/block_pool.py
// emit_cached_block_events). Any other value, or none, reports nothing
// for hits. Each step is followed by a marker request (one new block) so
// that every event of the step has arrived when the marker's has.
func TestReuseReportOnTheWire(t *testing.T) {
	full := map[string]any{"kv_cache_report_mode": "full"}
	prompt := make([]uint32, 48) // 3 full blocks
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	ext := append(slices.Clone(prompt), 200, 201, 202, 203, 204, 205, 206, 207, 208, 209) // hits prompt's 3 blocks, no new full block
	msgs := []any{map[string]any{"role": "user", "content": words(60, "rr")}}
	input := words(60, "rp")
	type step struct {
		name   string
		path   string
		body   map[string]any
		salt   string
		xargs  any    // vllm_xargs; nil: absent
		warm   bool   // stores its prompt's blocks, which later steps hit
		report string // the warm step whose blocks this one reports ("" for none)
	}
	steps := []step{
		{name: "warm", path: "/v1/completions", body: map[string]any{"prompt": prompt}, warm: true},
		{name: "full", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: full, report: "warm"},
		{name: "absent", path: "/v1/completions", body: map[string]any{"prompt": ext}},
		{name: "null", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: nil},
		{name: "incremental", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: map[string]any{"kv_cache_report_mode": "incremental"}},
		{name: "other case", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: map[string]any{"kv_cache_report_mode": "FULL"}},
		{name: "not a string", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: map[string]any{"kv_cache_report_mode": []any{"full"}}},
		{name: "other keys", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: map[string]any{"session_id": "full"}},
		{name: "full with other keys", path: "/v1/completions", body: map[string]any{"prompt": ext}, xargs: map[string]any{"x": 1, "kv_cache_report_mode": "full"}, report: "warm"},
		{name: "salted warm", path: "/v1/completions", body: map[string]any{"prompt": prompt}, salt: "t1", warm: true},
		{name: "salted full", path: "/v1/completions", body: map[string]any{"prompt": ext}, salt: "t1", xargs: full, report: "salted warm"},
		{name: "chat warm", path: "/v1/chat/completions", body: map[string]any{"messages": msgs}, warm: true},
		{name: "chat full", path: "/v1/chat/completions", body: map[string]any{"messages": msgs}, xargs: full, report: "chat warm"},
		{name: "chat absent", path: "/v1/chat/completions", body: map[string]any{"messages": msgs}},
		{name: "responses warm", path: "/v1/responses", body: map[string]any{"input": input}, warm: true},
		{name: "responses full", path: "/v1/responses", body: map[string]any{"input": input}, xargs: full, report: "responses warm"},
	}
	for _, encoding := range []string{EncodingNamed, EncodingPositional} {
		t.Run(encoding, func(t *testing.T) {
			ctx := testCtx(t)
			in := startSim(t, "--profile-preset", "zero", "--block-size", "16", "--kv-events-encoding", encoding,
				"--kv-events-config", `{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}`)
			seen := 0 // events of earlier steps
			stored := map[string]kvevents.BlockStored{}
			promptLen := map[string]int{}
			for i, st := range steps {
				body := map[string]any{"max_tokens": 1, "ignore_eos": true}
				if st.path == "/v1/responses" {
					body = map[string]any{"max_output_tokens": 1, "ignore_eos": true}
				}
				for k, v := range st.body {
					body[k] = v
				}
				if st.salt != "" {
					body["cache_salt"] = st.salt
				}
				if st.xargs != nil || st.name == "null" {
					body["vllm_xargs"] = st.xargs
				}
				r := postJSON(t, ctx, in.url(st.path), body, nil)
				if r.status != 200 {
					t.Fatalf("%s: %d %s", st.name, r.status, r.raw)
				}
				u := r.body["usage"].(map[string]any)
				n, ok := u["prompt_tokens"].(float64)
				if !ok {
					n = u["input_tokens"].(float64)
				}
				promptLen[st.name] = int(n)

				marker := uint32(60000 + 100*i)
				mtok := []uint32{marker}
				for k := range 16 {
					mtok = append(mtok, marker+1+uint32(k))
				}
				if r := postJSON(t, ctx, in.url("/v1/completions"), map[string]any{"prompt": mtok, "max_tokens": 1, "ignore_eos": true}, nil); r.status != 200 {
					t.Fatalf("%s marker: %d %s", st.name, r.status, r.raw)
				}
				var evs []kvevents.Event
				waitFor(t, st.name+"'s marker block", func() bool {
					all := publishedEvents(t, in.kvPubs[0])
					for j := seen; j < len(all); j++ {
						if s, ok := all[j].(kvevents.BlockStored); ok && len(s.TokenIDs) > 0 && s.TokenIDs[0] == marker {
							evs, seen = all[seen:j], j+1
							return true
						}
					}
					return false
				})

				switch {
				case st.warm:
					s, ok := onlyStore(evs)
					if !ok || s.Parent != 0 || len(s.BlockHashes) != promptLen[st.name]/16 {
						t.Fatalf("%s: events %+v, want the store of its %d full blocks", st.name, evs, promptLen[st.name]/16)
					}
					stored[st.name] = s
				case st.report != "":
					w := stored[st.report]
					k := (promptLen[st.name] - 1) / 16 // the lookup's hit: at most prompt-1 tokens
					// The shape of a normal store: every other field (block
					// size, medium, LoRA, group) as in the warm store.
					want := w
					want.BlockHashes, want.TokenIDs = w.BlockHashes[:k], w.TokenIDs[:16*k]
					if w.Extra != nil {
						want.Extra = w.Extra[:k]
					}
					got, ok := onlyStore(evs)
					if !ok {
						t.Fatalf("%s: events %+v, want one BlockStored of %d reused blocks", st.name, evs, k)
					}
					if diff := cmp.Diff(want, got); diff != "" {
						t.Fatalf("%s: reuse report (-want +got):\n%s", st.name, diff)
					}
					if got.Parent != 0 || got.BlockSize != 16 || len(got.BlockHashes) != k || k == 0 {
						t.Fatalf("%s: report %+v, want %d blocks of 16, parent null", st.name, got, k)
					}
					if st.salt != "" && (len(got.Extra) == 0 || got.Extra[0].Salt != st.salt) {
						t.Fatalf("%s: extra keys %+v, want the salt on block 0", st.name, got.Extra)
					}
				default:
					if len(evs) != 0 {
						t.Fatalf("%s: events %+v, want none (hits are not reported)", st.name, evs)
					}
				}
			}
		})
	}
}

// onlyStore returns evs' event when it is a lone BlockStored.
func onlyStore(evs []kvevents.Event) (kvevents.BlockStored, bool) {
	if len(evs) != 1 {
		return kvevents.BlockStored{}, false
	}
	s, ok := evs[0].(kvevents.BlockStored)
	return s, ok
}

// TestVLLMXargsMustBeAnObject: vLLM's vllm_xargs is a dict field, so
// anything but an object (or null) is a 400 on every generation route.
func TestVLLMXargsMustBeAnObject(t *testing.T) {
	ctx := testCtx(t)
	in := startSim(t, "--profile-preset", "zero")
	bodies := map[string]map[string]any{
		"/v1/completions":      {"prompt": "hi there", "max_tokens": 1},
		"/v1/chat/completions": {"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 1},
		"/v1/responses":        {"input": "hi", "max_output_tokens": 1},
	}
	cases := []struct {
		xargs any
		ok    bool
	}{
		{map[string]any{"kv_cache_report_mode": "full"}, true},
		{map[string]any{}, true},
		{nil, true},
		{"full", false},
		{5, false},
		{[]any{"kv_cache_report_mode", "full"}, false},
	}
	for path, base := range bodies {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/%v", path, tc.xargs), func(t *testing.T) {
				body := map[string]any{"vllm_xargs": tc.xargs}
				for k, v := range base {
					body[k] = v
				}
				r := postJSON(t, ctx, in.url(path), body, nil)
				if tc.ok {
					if r.status != 200 {
						t.Fatalf("status %d %s, want 200", r.status, r.raw)
					}
					return
				}
				if e, _ := r.body["error"].(map[string]any); r.status != 400 || e["param"] != "vllm_xargs" {
					t.Fatalf("got %d %s, want a 400 on vllm_xargs", r.status, r.raw)
				}
			})
		}
	}
}
