package sim

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"
)

// TestCacheSaltValidation pins vLLM 0.32's validate_cache_salt answers
// (entrypoints/generate/base/protocol.py, raised by a before-validator, so
// ahead of field type errors, missing fields and the model check) on every
// generation route.
func TestCacheSaltValidation(t *testing.T) {
	ctx := testCtx(t)
	in := startSim(t, "--profile-preset", "zero", "--model", "m1")
	const (
		notString = "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
		tooLong   = `Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\', or NUL. (parameter=cache_salt)`
	)
	bodies := map[string]map[string]any{
		"/v1/completions":      {"prompt": "hi there", "max_tokens": 1},
		"/v1/chat/completions": {"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 1},
		"/v1/responses":        {"input": "hi", "max_output_tokens": 1},
	}
	cases := []struct {
		name  string
		extra map[string]any // merged into the route's body
		want  string         // error message; "" = accepted
	}{
		{"empty string", map[string]any{"cache_salt": ""}, notString},
		{"number", map[string]any{"cache_salt": 5}, notString},
		{"bool", map[string]any{"cache_salt": true}, notString},
		{"list", map[string]any{"cache_salt": []any{"a"}}, notString},
		{"129 characters", map[string]any{"cache_salt": strings.Repeat("a", 129)}, tooLong},
		{"slash", map[string]any{"cache_salt": "a/b"}, tooLong},
		{"at", map[string]any{"cache_salt": "a@b"}, tooLong},
		{"backslash", map[string]any{"cache_salt": `a\b`}, tooLong},
		{"NUL", map[string]any{"cache_salt": "a\x00b"}, tooLong},
		{"before a type error", map[string]any{"cache_salt": "", "seed": "x"}, notString},
		{"before the model check", map[string]any{"cache_salt": "", "model": "other"}, notString},
		{"valid", map[string]any{"cache_salt": "tenant-1"}, ""},
		{"128 characters", map[string]any{"cache_salt": strings.Repeat("é", 128)}, ""},
		{"null", map[string]any{"cache_salt": nil}, ""},
	}
	for path, base := range bodies {
		for _, tc := range cases {
			t.Run(path+"/"+tc.name, func(t *testing.T) {
				body := map[string]any{}
				for k, v := range base {
					body[k] = v
				}
				for k, v := range tc.extra {
					body[k] = v
				}
				r := postJSON(t, ctx, in.url(path), body, nil)
				if tc.want == "" {
					if r.status != 200 {
						t.Fatalf("status %d %s, want 200", r.status, r.raw)
					}
					return
				}
				e, _ := r.body["error"].(map[string]any)
				if r.status != 400 || e["type"] != "BadRequestError" || e["param"] != "cache_salt" || e["message"] != tc.want || e["code"] != float64(400) {
					t.Fatalf("got %d %s\nwant 400 BadRequestError cache_salt %q", r.status, r.raw, tc.want)
				}
			})
		}
	}
	// A chat body without messages: the salt is checked first too.
	r := postJSON(t, ctx, in.url("/v1/chat/completions"), map[string]any{"cache_salt": 1}, nil)
	if e, _ := r.body["error"].(map[string]any); r.status != 400 || e["message"] != notString {
		t.Fatalf("chat without messages, bad salt: %d %s", r.status, r.raw)
	}
}

// TestCacheSaltCachedTokens: the reported cached tokens follow salted
// lookups: a request hits only blocks cached under its own salt (or, for
// an unsalted request, under none).
func TestCacheSaltCachedTokens(t *testing.T) {
	ctx := testCtx(t)
	in := startSim(t, "--profile-preset", "zero", "--enable-prompt-tokens-details", "--block-size", "16")
	prompt := words(50, "cs") // at most 3 full blocks hit
	input := words(40, "rs")
	steps := []struct {
		name, path, salt string
		want             float64 // cached tokens
	}{
		{"unsalted", "/v1/completions", "", 0},
		{"salted misses unsalted", "/v1/completions", "a", 0},
		{"same salt hits", "/v1/completions", "a", 48},
		{"other salt misses", "/v1/completions", "b", 0},
		{"unsalted hits its own", "/v1/completions", "", 48},
		{"responses salted", "/v1/responses", "a", 0},
		{"responses same salt hits", "/v1/responses", "a", 32},
		{"responses unsalted misses", "/v1/responses", "", 0},
	}
	for _, st := range steps {
		body := map[string]any{"prompt": prompt, "max_tokens": 1, "ignore_eos": true}
		if st.path == "/v1/responses" {
			body = map[string]any{"input": input, "max_output_tokens": 1, "ignore_eos": true}
		}
		if st.salt != "" {
			body["cache_salt"] = st.salt
		}
		r := postJSON(t, ctx, in.url(st.path), body, nil)
		if r.status != 200 {
			t.Fatalf("%s: %d %s", st.name, r.status, r.raw)
		}
		u := r.body["usage"].(map[string]any)
		got := cachedOf(u)
		if st.path == "/v1/responses" {
			got = u["input_tokens_details"].(map[string]any)["cached_tokens"].(float64)
		}
		if got != st.want {
			t.Errorf("%s: %v cached tokens, want %v", st.name, got, st.want)
		}
	}
}

// TestCacheSaltKVEvents: a salted request's BlockStored carries
// extra_keys, one entry per block, (salt,) on the sequence's first block
// and null on the others; an event without a salted first block has
// extra_keys of nulls, as vLLM 0.32 publishes them (block_pool.py
// _build_block_stored_event: to_event_extra_keys([None, ...]) is that
// list), then group_idx 0 and kv_cache_spec_kind.
func TestCacheSaltKVEvents(t *testing.T) {
	for _, encoding := range []string{EncodingNamed, EncodingPositional} {
		t.Run(encoding, func(t *testing.T) {
			ctx := testCtx(t)
			in := startSim(t, "--profile-preset", "zero", "--block-size", "16", "--kv-events-encoding", encoding,
				"--kv-events-config", `{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}`)
			tokens := make([]uint32, 48) // 3 full blocks
			for i := range tokens {
				tokens[i] = uint32(100 + i)
			}
			send := func(salt string) {
				body := map[string]any{"prompt": tokens, "max_tokens": 1, "ignore_eos": true}
				if salt != "" {
					body["cache_salt"] = salt
				}
				if r := postJSON(t, ctx, in.url("/v1/completions"), body, nil); r.status != 200 {
					t.Fatalf("completion: %d %s", r.status, r.raw)
				}
			}
			send("")
			send("salt")
			send("salt") // hits 2 blocks, stores the recomputed third
			var evs []storedEvent
			waitFor(t, "3 BlockStored events", func() bool {
				evs = storedEvents(t, in.kvPubs[0], encoding == EncodingNamed)
				return len(evs) == 3
			})
			plain, salted, repeat := evs[0], evs[1], evs[2]
			want := []struct {
				name      string
				ev        storedEvent
				hashes    int
				parentNil bool
				extra     any
			}{
				{"unsalted", plain, 3, true, []any{nil, nil, nil}},
				{"salted", salted, 3, true, []any{[]any{"salt"}, nil, nil}},
				{"salted repeat", repeat, 1, false, []any{nil}},
			}
			for _, w := range want {
				if len(w.ev.hashes) != w.hashes || (w.ev.parent == nil) != w.parentNil {
					t.Errorf("%s: %d hashes, parent %v", w.name, len(w.ev.hashes), w.ev.parent)
				}
				if diff := cmp.Diff(w.extra, w.ev.extraKeys); diff != "" || !w.ev.hasExtra {
					t.Errorf("%s: extra_keys present %v (-want +got):\n%s", w.name, w.ev.hasExtra, diff)
				}
				if encoding == EncodingPositional && w.ev.fields != 11 {
					t.Errorf("%s: positional event of %d elements, want 11 (tag, 7 fields, extra_keys, group_idx, kv_cache_spec_kind)", w.name, w.ev.fields)
				}
			}
			for _, h := range salted.hashes {
				if slices.Contains(plain.hashes, h) {
					t.Errorf("salted block hash %s is an unsalted block's too", h)
				}
			}
			if repeat.parent != salted.hashes[1] {
				t.Errorf("repeat's parent %v, want the salted chain's second block %s", repeat.parent, salted.hashes[1])
			}
		})
	}
}

// storedEvent is a BlockStored as decoded from the wire.
type storedEvent struct {
	hashes    []string // fmt'd
	parent    any      // fmt'd hash, or nil
	extraKeys any
	hasExtra  bool
	fields    int // positional: array length, tag included
	loraID    any
	loraName  any
}

// storedEvents decodes the BlockStored events of p's sent batches.
func storedEvents(t *testing.T, p *kvPublisher, named bool) []storedEvent {
	t.Helper()
	p.mu.Lock()
	sent := slices.Clone(p.buf)
	p.mu.Unlock()
	var out []storedEvent
	for _, b := range sent {
		var batch []any
		if err := msgpack.Unmarshal(b.payload, &batch); err != nil || len(batch) != 3 {
			t.Fatalf("batch %v: %v", batch, err)
		}
		for _, raw := range batch[1].([]any) {
			var ev storedEvent
			var hashes, parent any
			if named {
				m := raw.(map[string]any)
				if m["type"] != "BlockStored" {
					continue
				}
				hashes, parent = m["block_hashes"], m["parent_block_hash"]
				ev.extraKeys, ev.hasExtra = m["extra_keys"]
				ev.loraID, ev.loraName = m["lora_id"], m["lora_name"]
			} else {
				a := raw.([]any)
				if a[0] != "BlockStored" {
					continue
				}
				hashes, parent, ev.fields = a[1], a[2], len(a)
				ev.loraID, ev.loraName = a[5], a[7]
				if len(a) > 8 {
					ev.extraKeys, ev.hasExtra = a[8], true
				}
			}
			for _, h := range hashes.([]any) {
				ev.hashes = append(ev.hashes, fmt.Sprint(h))
			}
			if parent != nil {
				ev.parent = fmt.Sprint(parent)
			}
			out = append(out, ev)
		}
	}
	return out
}

// TestNIXLDecodeCacheLookupIsSalted: a NIXL decode reads only the blocks
// its prefix cache lacks, looked up under the request's cache_salt (the
// decode's body carries it too), so a salted prompt finds nothing cached
// under another salt or none.
func TestNIXLDecodeCacheLookupIsSalted(t *testing.T) {
	ctx := testCtx(t)
	p := startSim(t, "--role", "prefill", "--kv-connector", "nixl", "--strict")
	d := startSim(t, "--role", "decode", "--kv-connector", "nixl", "--strict")
	shared := words(300, "ns")
	steps := []struct {
		salt, suffix string
		local        bool // the shared prefix is found in D's cache
	}{
		{"", "first question", false},
		{"t1", "second question", false},
		{"t1", "third question", true},
		{"t2", "fourth question", false},
		{"", "fifth question", true},
	}
	var read0, local0 int64
	for _, st := range steps {
		prompt := shared + " " + st.suffix
		hdr := map[string]string{"X-Request-Id": uuid4()}
		pbody := prefillBody(prompt, map[string]any{
			"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
			"remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
		})
		dbody := clientBody(prompt, 2)
		if st.salt != "" {
			pbody["cache_salt"], dbody["cache_salt"] = st.salt, st.salt
		}
		pres := postJSON(t, ctx, p.url("/v1/completions"), pbody, hdr)
		pkv, ok := pres.body["kv_transfer_params"].(map[string]any)
		if pres.status != 200 || !ok {
			t.Fatalf("%s/%s prefill: %d %s", st.salt, st.suffix, pres.status, pres.raw)
		}
		res := doStream(t, ctx, d.url("/v1/completions"), withKV(dbody, pkv), hdr)
		if res.status != 200 || !res.done || res.usage == nil {
			t.Fatalf("%s/%s decode: status %d done %v", st.salt, st.suffix, res.status, res.done)
		}
		n := int64(res.usage["prompt_tokens"].(float64))
		tr := statsOf(t, d).Transfers
		read, local := tr.TokensRead-read0, tr.TokensReadLocal-local0
		read0, local0 = tr.TokensRead, tr.TokensReadLocal
		if read+local != n || (local >= 256) != st.local || (!st.local && local != 0) {
			t.Errorf("salt %q, %s: read %d, cached locally %d of %d prompt tokens; want the shared prefix local: %v",
				st.salt, st.suffix, read, local, n, st.local)
		}
	}
}
