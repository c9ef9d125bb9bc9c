package kvevents

import (
	"bytes"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"
)

// Payloads are built with an independent msgpack encoder (vmihailenco), in
// the two shapes msgspec produces for vLLM's event structs.

func enc(t testing.TB, v any) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	e.UseCompactInts(true)
	e.UseCompactFloats(false)
	if err := e.Encode(v); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func seq(from, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = from + i
	}
	return s
}

func u32(s []int) []uint32 {
	out := make([]uint32, len(s))
	for i, v := range s {
		out[i] = uint32(v)
	}
	return out
}

// positionalStored is msgspec's array_like tagged encoding.
func positionalStored(hashes []any, parent any, tokens []int, bs int, lora any, medium any) []any {
	return []any{"BlockStored", hashes, parent, tokens, bs, lora, medium}
}

// namedStored is the map encoding (defaults omitted, as msgspec does).
func namedStored(hashes []any, parent any, tokens []int, bs int, medium any) map[string]any {
	return map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
		"token_ids": tokens, "block_size": bs, "lora_id": nil, "medium": medium, "lora_name": nil}
}

// intHashes are n integer block hashes as vLLM publishes them by
// default (the low 64 bits of a sha256: large, 9 bytes of msgpack each).
func intHashes(from uint64, n int) []any {
	out := make([]any, n)
	for i := range out {
		out[i] = (from+uint64(i))*0x9E3779B97F4A7C15 | 1<<63
	}
	return out
}

func TestDecodeBatch(t *testing.T) {
	h1, h2 := []byte("\x01\x02sha256-a"), []byte("\x03sha256-b")
	cases := []struct {
		name    string
		payload []any
		want    Batch
		skipped int
	}{
		{"positional, bytes hashes, dp rank",
			[]any{1.5, []any{
				positionalStored([]any{h1, h2}, nil, seq(0, 8), 4, nil, "GPU"),
				[]any{"BlockRemoved", []any{h1}, "GPU"},
				[]any{"AllBlocksCleared"},
			}, 3},
			Batch{TS: 1.5, DPRank: 3, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1), BytesHash(h2)}, TokenIDs: u32(seq(0, 8)), BlockSize: 4, LoRAID: -1, Medium: "GPU", Group: -1},
				BlockRemoved{BlockHashes: []Hash{BytesHash(h1)}, Medium: "GPU", Group: -1},
				AllBlocksCleared{},
			}}, 0},
		{"positional, int hashes with parent, no dp rank, trailing defaults omitted",
			[]any{2.0, []any{[]any{"BlockStored", []any{uint64(1 << 63), -5}, 42, seq(100, 4), 2}}},
			Batch{TS: 2, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{9223372036854775808, Hash(^uint64(4))}, Parent: 42, TokenIDs: u32(seq(100, 4)), BlockSize: 2, LoRAID: -1, Group: -1},
			}}, 0},
		{"named maps, unknown fields skipped, a multimodal block opaque",
			[]any{3.25, []any{
				func() map[string]any {
					m := namedStored([]any{h1}, h2, seq(7, 4), 4, "CPU")
					m["extra_keys"] = []any{[]any{[]any{"image-digest", 3}}}
					m["group_idx"] = 1
					return m
				}(),
				map[string]any{"type": "BlockRemoved", "block_hashes": []any{h1}, "medium": "CPU"},
				map[string]any{"type": "AllBlocksCleared"},
			}, nil},
			Batch{TS: 3.25, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, Parent: BytesHash(h2), TokenIDs: u32(seq(7, 4)), BlockSize: 4, LoRAID: -1, Medium: "CPU",
					Extra: []BlockExtra{{Opaque: true}}, Group: 1},
				BlockRemoved{BlockHashes: []Hash{BytesHash(h1)}, Medium: "CPU", Group: -1},
				AllBlocksCleared{},
			}}, 0},
		// extra_keys as vLLM 0.32 publishes them (to_event_extra_keys):
		// untagged, the LoRA name first when lora_name is set, the salt on
		// the block at token 0 only, multimodal pairs and embedding digests.
		{"positional, a salted sequence's first block, trailing group fields",
			[]any{1.0, []any{append(positionalStored([]any{h1, h2}, nil, seq(0, 8), 4, nil, "GPU"), nil, []any{[]any{"tenant-a"}, nil}, 0)}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1), BytesHash(h2)}, TokenIDs: u32(seq(0, 8)), BlockSize: 4, LoRAID: -1, Medium: "GPU",
					Extra: []BlockExtra{{Salt: "tenant-a"}, {}}, Group: 0},
			}}, 0},
		{"named, LoRA name then salt; the LoRA name alone is no salt",
			[]any{1.0, []any{func() map[string]any {
				m := namedStored([]any{h1, h2}, nil, seq(0, 8), 4, "GPU")
				m["lora_name"], m["lora_id"] = "sql", 3
				m["extra_keys"] = []any{[]any{"sql", "tenant-b"}, []any{"sql"}}
				return m
			}()}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1), BytesHash(h2)}, TokenIDs: u32(seq(0, 8)), BlockSize: 4, LoRAID: 3, LoRAName: "sql", Medium: "GPU",
					Extra: []BlockExtra{{Salt: "tenant-b"}, {}}, Group: -1},
			}}, 0},
		{"named, extra_keys before lora_name in the map",
			[]any{1.0, []any{map[string]any{"type": "BlockStored", "extra_keys": []any{[]any{"sql"}}, "block_hashes": []any{h1},
				"parent_block_hash": nil, "token_ids": seq(0, 4), "block_size": 4, "lora_name": "sql"}}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: u32(seq(0, 4)), BlockSize: 4, LoRAID: -1, LoRAName: "sql",
					Extra: []BlockExtra{{}}, Group: -1},
			}}, 0},
		{"opaque: a digest, a salt after the first block, two strings, a pair beside a salt",
			[]any{1.0, []any{append(positionalStored([]any{h1, h2, h1, h2}, 9, seq(0, 16), 4, nil, nil), nil,
				[]any{[]any{[]byte{1, 2}}, []any{"late-salt"}, []any{"a", "b"}, []any{[]any{"img", 0}, "s"}})}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1), BytesHash(h2), BytesHash(h1), BytesHash(h2)}, Parent: 9, TokenIDs: u32(seq(0, 16)), BlockSize: 4, LoRAID: -1,
					Extra: []BlockExtra{{Opaque: true}, {Opaque: true}, {Opaque: true}, {Opaque: true}}, Group: -1},
			}}, 0},
		{"extra_keys null, or every entry null",
			[]any{1.0, []any{
				append(positionalStored([]any{h1}, nil, seq(0, 4), 4, nil, nil), nil, nil),
				append(positionalStored([]any{h1}, nil, seq(0, 4), 4, nil, nil), nil, []any{nil}),
			}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: u32(seq(0, 4)), BlockSize: 4, LoRAID: -1, Group: -1},
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: u32(seq(0, 4)), BlockSize: 4, LoRAID: -1, Group: -1},
			}}, 0},
		// A hybrid model as vLLM 0.32 publishes it (checked on a real engine
		// with full-attention and sliding-window layers): every block is
		// stored once per KV cache group under the same hash; the
		// sliding-window group stores only the blocks a hit can use, its
		// token_ids still spanning the whole range (Masked).
		{"named, a hybrid model's groups: the sliding-window store masked, a removal in group 1",
			[]any{1.0, []any{
				func() map[string]any {
					m := namedStored([]any{h1, h2, h1}, nil, seq(0, 12), 4, "GPU")
					m["extra_keys"] = []any{nil, nil, nil}
					m["group_idx"], m["kv_cache_spec_kind"] = 0, "full_attention"
					return m
				}(),
				func() map[string]any {
					m := namedStored([]any{h1}, nil, seq(0, 12), 4, "GPU")
					m["extra_keys"] = []any{nil}
					m["group_idx"], m["kv_cache_spec_kind"], m["kv_cache_spec_sliding_window"] = 1, "sliding_window", 8
					m["session_id"] = "s-1"
					return m
				}(),
				map[string]any{"type": "BlockRemoved", "block_hashes": []any{h2}, "medium": "GPU", "group_idx": 1},
			}, nil},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1), BytesHash(h2), BytesHash(h1)}, TokenIDs: u32(seq(0, 12)), BlockSize: 4, LoRAID: -1, Medium: "GPU",
					Group: 0, Kind: "full_attention"},
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: u32(seq(0, 12)), BlockSize: 4, LoRAID: -1, Medium: "GPU",
					Group: 1, Kind: "sliding_window"},
				BlockRemoved{BlockHashes: []Hash{BytesHash(h2)}, Medium: "GPU", Group: 1},
			}}, 0},
		{"positional, every field vLLM 0.32 declares",
			[]any{1.0, []any{
				append(positionalStored([]any{h1}, nil, seq(0, 4), 4, nil, "GPU"), nil, []any{nil}, 2, "mamba", nil, "LOCAL", nil, "s-2"),
				[]any{"BlockRemoved", []any{h1}, "GPU", 2, "LOCAL", nil},
			}},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: u32(seq(0, 4)), BlockSize: 4, LoRAID: -1, Medium: "GPU",
					Group: 2, Kind: "mamba"},
				BlockRemoved{BlockHashes: []Hash{BytesHash(h1)}, Medium: "GPU", Group: 2},
			}}, 0},
		// vLLM 0.32's offloading connector, lacking a block's metadata,
		// publishes a placeholder store (events.py _placeholder_stored): one
		// hash, no token ids, block size 0; its removal names the hash.
		{"named, an offloading tier's placeholder store and its removal",
			[]any{1.0, []any{
				map[string]any{"type": "BlockStored", "block_hashes": []any{h1}, "parent_block_hash": nil, "token_ids": []any{},
					"block_size": 0, "lora_id": nil, "medium": "CPU", "lora_name": nil, "group_idx": 1, "locality": "LOCAL", "ownership": "kvcr"},
				map[string]any{"type": "BlockRemoved", "block_hashes": []any{h1}, "medium": "CPU", "group_idx": 1, "locality": "LOCAL"},
			}, nil},
			Batch{TS: 1, DPRank: -1, Events: []Event{
				BlockStored{BlockHashes: []Hash{BytesHash(h1)}, TokenIDs: []uint32{}, LoRAID: -1, Medium: "CPU", Group: 1},
				BlockRemoved{BlockHashes: []Hash{BytesHash(h1)}, Medium: "CPU", Group: 1},
			}}, 0},
		{"unknown event types are skipped, the rest kept",
			[]any{1.0, []any{[]any{"SomethingNew", 1, 2}, map[string]any{"type": "AlsoNew"}, []any{"AllBlocksCleared"}}},
			Batch{TS: 1, DPRank: -1, Events: []Event{AllBlocksCleared{}}}, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, skipped, err := DecodeBatch(enc(t, tc.payload))
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Fatalf("batch (-want +got):\n%s", d)
			}
			if skipped != tc.skipped {
				t.Fatalf("skipped %d want %d", skipped, tc.skipped)
			}
		})
	}
}

func TestDecodeBatchRejects(t *testing.T) {
	cases := []struct {
		name    string
		payload []byte
		wantErr string
	}{
		{"not an array", enc(t, map[string]any{"ts": 1}), "want array"},
		{"one field", enc(t, []any{1.0}), "at least 2"},
		{"token count does not match blocks", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, seq(0, 3), 4, nil, nil)}}), "3 token ids for 1 blocks"},
		{"token ids not whole blocks", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, seq(0, 6), 4, nil, nil)}}), "6 token ids for 1 blocks"},
		{"fewer token ids than hashes", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a"), []byte("b")}, nil, seq(0, 4), 4, nil, nil)}}), "4 token ids for 2 blocks"},
		{"negative group_idx", enc(t, []any{1.0, []any{[]any{"BlockRemoved", []any{[]byte("a")}, nil, -1}}}), "group_idx -1"},
		{"group_idx not an integer", enc(t, []any{1.0, []any{[]any{"BlockRemoved", []any{[]byte("a")}, nil, "0"}}}), "group_idx"},
		{"kv_cache_spec_kind not a string", enc(t, []any{1.0, []any{append(positionalStored([]any{[]byte("a")}, nil, seq(0, 4), 4, nil, nil), nil, nil, 0, 7)}}), "kv_cache_spec_kind"},
		{"block size 0 with token ids", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, seq(0, 4), 0, nil, nil)}}), "4 token ids for 1 blocks of 0"},
		{"negative block size", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, []int{}, -1, nil, nil)}}), "block_size -1"},
		{"negative token", enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, []int{-1}, 1, nil, nil)}}), "token id"},
		{"stored without hashes", enc(t, []any{1.0, []any{positionalStored([]any{}, nil, []int{}, 4, nil, nil)}}), "without block hashes"},
		{"map without type", enc(t, []any{1.0, []any{map[string]any{"block_hashes": []any{}}}}), "without a type"},
		{"named stored missing fields", enc(t, []any{1.0, []any{map[string]any{"type": "BlockStored", "block_hashes": []any{[]byte("a")}}}}), "BlockStored without"},
		{"trailing bytes", append(enc(t, []any{1.0, []any{}}), 0x01), "trailing"},
		{"extra_keys entries do not match blocks", enc(t, []any{1.0, []any{append(positionalStored([]any{[]byte("a")}, nil, seq(0, 4), 4, nil, nil), nil,
			[]any{[]any{"s"}, nil})}}), "2 extra_keys entries for 1 blocks"},
		{"too many extra keys in a block", enc(t, []any{1.0, []any{append(positionalStored([]any{[]byte("a")}, nil, seq(0, 4), 4, nil, nil), nil,
			[]any{make([]any, 65)})}}), "65 extra keys"},
		{"extra_keys entry not an array", enc(t, []any{1.0, []any{append(positionalStored([]any{[]byte("a")}, nil, seq(0, 4), 4, nil, nil), nil,
			[]any{"s"})}}), "extra_keys"},
		// An array header claiming 2^32-1 elements in a few bytes.
		{"hostile array length", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff}, "truncated"},
		{"hostile string length", []byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xdb, 0xff, 0xff, 0xff, 0xff}, "truncated"},
		{"deep nesting", enc(t, []any{1.0, []any{[]any{"X", nest(40)}}}), "too deep"},
		{"empty", nil, "truncated"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := DecodeBatch(tc.payload)
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
}

func nest(n int) any {
	var v any = 1
	for range n {
		v = []any{v}
	}
	return v
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add(enc(f, []any{1.5, []any{positionalStored([]any{[]byte("a"), 7}, nil, seq(0, 8), 4, nil, "GPU"), []any{"AllBlocksCleared"}}, 0}))
	f.Add(enc(f, []any{1.5, []any{namedStored([]any{[]byte("a")}, 3, seq(0, 4), 4, nil)}}))
	f.Add(enc(f, []any{1.5, []any{append(positionalStored([]any{[]byte("a"), 7}, nil, seq(0, 8), 4, nil, "GPU"), "l",
		[]any{[]any{"l", "salt"}, []any{[]any{"img", 0}}})}}))
	f.Add(enc(f, []any{1.5, []any{append(positionalStored([]any{[]byte("a")}, nil, seq(0, 8), 4, nil, "GPU"), nil, []any{nil}, 1, "sliding_window", 8),
		[]any{"BlockRemoved", []any{[]byte("a")}, "GPU", 1}}}))
	f.Add(enc(f, []any{1.5, []any{positionalStored([]any{[]byte("a")}, nil, []int{}, 0, nil, "CPU")}}))
	f.Add([]byte{0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		batch, _, err := DecodeBatch(b)
		if err != nil {
			return
		}
		// Whatever decodes must be internally consistent and indexable.
		for _, e := range batch.Events {
			if s, ok := e.(BlockStored); ok && (s.BlockSize == 0 && len(s.TokenIDs) != 0 ||
				s.BlockSize != 0 && (len(s.TokenIDs)%s.BlockSize != 0 || len(s.TokenIDs) < len(s.BlockHashes)*s.BlockSize)) {
				t.Fatalf("inconsistent BlockStored %+v", s)
			}
		}
		x := NewIndex(IndexOptions{BlockSize: 4, MaxEntries: 1000})
		x.Apply("w", batch.Events)
		if _, n := x.Stats(); n < 0 || n > 1000 {
			t.Fatalf("index size %d", n)
		}
	})
}

// BenchmarkDecodeBatch decodes a batch as an engine publishes it for one
// request: a BlockStored of 36 blocks of 16 tokens (a 576-token prompt),
// a BlockRemoved of 8, in both encodings vLLM has shipped; and ("full
// cache") what an engine whose cache is full publishes for a request of
// the kv scenario's (vllm-sim's batches there, as vLLM's): 20 blocks
// stored and, as each evicts one, 20 BlockRemoved of one integer hash
// each (block_pool.py removes blocks one by one), named encoding.
//
//	go test -run '^$' -bench DecodeBatch -benchmem ./internal/kvevents
func BenchmarkDecodeBatch(b *testing.B) {
	hashes := make([]any, 36)
	for i := range hashes {
		hashes[i] = []byte("sha256-block-hash-" + strings.Repeat("x", i%7))
	}
	full := []any{map[string]any{"type": "BlockStored", "block_hashes": intHashes(1000, 20), "parent_block_hash": intHashes(999, 1)[0],
		"token_ids": seq(0, 20*16), "block_size": 16, "lora_id": nil, "medium": "GPU", "lora_name": nil}}
	for i := range 20 {
		full = append(full, map[string]any{"type": "BlockRemoved", "block_hashes": intHashes(uint64(i), 1), "medium": "GPU"})
	}
	for _, tc := range []struct {
		name  string
		batch []any
	}{
		{"positional", []any{1.5, []any{
			positionalStored(hashes, hashes[0], seq(0, 36*16), 16, nil, "GPU"),
			[]any{"BlockRemoved", hashes[:8], "GPU"},
		}, 0}},
		{"named", []any{1.5, []any{
			namedStored(hashes, hashes[0], seq(0, 36*16), 16, "GPU"),
			map[string]any{"type": "BlockRemoved", "block_hashes": hashes[:8], "medium": "GPU"},
		}, nil}},
		{"full-cache", []any{1.5, full, nil}},
	} {
		payload := enc(b, tc.batch)
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := DecodeBatch(payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
