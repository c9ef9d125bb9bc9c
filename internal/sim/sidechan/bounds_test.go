package sidechan

import (
	"runtime"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// Every message the side channel carries passes the bounds check as the
// encoder writes it, and so do values of every msgpack kind.
func TestCheckBoundsAcceptsWellFormed(t *testing.T) {
	values := []any{
		RemoteBlocks{Type: "remote_blocks", TransferID: "t", BlockNotifyList: []int{1, 2, 70000}},
		AgentMetadata{EngineID: "e", AgentMetadata: make([]byte, 300), KVCachesBaseAddr: []int64{1 << 40, -1}, NumBlocks: 7},
		map[string]any{"s": strings.Repeat("x", 70000), "f": 1.5, "f32": float32(2), "n": nil, "b": true, "neg": -40000,
			"u": uint64(1 << 63), "nested": []any{map[string]any{"a": []any{1, "b"}}}},
		make([]any, 20), make([]int, 70000), strings.Repeat("y", 40), "",
		msgpack.RawMessage{0xd4, 0x01, 0x02},             // fixext1
		msgpack.RawMessage{0xc7, 0x02, 0x05, 0x01, 0x02}, // ext8
	}
	for i, v := range values {
		b := Encode(v)
		if b == nil {
			t.Fatalf("value %d: did not encode", i)
		}
		if err := checkBounds(b); err != nil {
			t.Errorf("value %d (%T, %d bytes): %v", i, v, len(b), err)
		}
	}
}

// A header declaring more than the payload holds is refused before the
// decoder allocates for it.
func TestCheckBoundsRefusesWhatCannotFit(t *testing.T) {
	cases := map[string][]byte{
		"str32 of 3.6 GB (fuzz)":   []byte("\x85\xa4000\xdb\xdb\xdb\xdb\xdb\xdb\xdb\xdbS\xc70"),
		"bin32 past the end":       {0xc6, 0, 0, 1, 0, 1, 2},
		"str8 one byte short":      {0xd9, 3, 'a', 'b'},
		"array32 of 2^32-1":        {0xdd, 0xff, 0xff, 0xff, 0xff, 1},
		"map16 more than present":  {0xde, 0, 3, 1, 1, 1, 1},
		"fixmap missing its value": {0x81, 0xa1, 'k'},
		"ext32 type byte missing":  {0xc9, 0, 0, 0, 0},
		"uint64 cut":               {0xcf, 1, 2},
		"never-used code 0xc1":     {0xc1},
		"empty":                    {},
		"nested too deep":          []byte(strings.Repeat("\x91", maxDepth+1) + "\x01"),
	}
	for name, b := range cases {
		if err := checkBounds(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if err := checkBounds([]byte(strings.Repeat("\x91", maxDepth-1) + "\x01")); err != nil {
		t.Errorf("nesting of %d refused: %v", maxDepth, err)
	}
}

// The fuzzer's findings: a few bytes that made the decoder allocate a
// megabyte or more each (a worker grew past 2.8 GB). Decoding them now
// allocates about what they hold.
func TestDecodeAllocatesAboutThePayload(t *testing.T) {
	for _, b := range [][]byte{
		[]byte("\x85\xa4000\xdb\xdb\xdb\xdb\xdb\xdb\xdb\xdbS\xc70"),
		[]byte("\x85\xa40000\x8c0000000000M\x9d\b\x91#\x9f[7\xa4G\r\xea\xf8\xbe\xdf\xff\xff\xff\xff"),
		{0x81, 0xa4, 't', 'y', 'p', 'e', 0xc6, 0x7f, 0xff, 0xff, 0xff},
	} {
		var m0, m1 runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m0)
		for range 10 {
			if _, err := Decode(b); err == nil {
				t.Errorf("%q: decoded", b)
			}
		}
		runtime.ReadMemStats(&m1)
		if per := (m1.TotalAlloc - m0.TotalAlloc) / 10; per > 16<<10 {
			t.Errorf("%q: %d bytes allocated per decode", b, per)
		}
	}
}
