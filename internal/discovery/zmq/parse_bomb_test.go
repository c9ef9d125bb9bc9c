package zmq

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// lengthBombs are msgpack headers that declare far more bytes (or
// elements) than any payload holds.
var lengthBombs = []struct {
	name   string
	header []byte
}{
	{"fixstr", []byte{0xbf}},
	{"str8", []byte{0xd9, 0xff}},
	{"str16", []byte{0xda, 0xff, 0xff}},
	{"str32", []byte{0xdb, 0xff, 0xff, 0xff, 0xff}},
	{"bin8", []byte{0xc4, 0xff}},
	{"bin16", []byte{0xc5, 0xff, 0xff}},
	{"bin32", []byte{0xc6, 0xff, 0xff, 0xff, 0xff}},
	{"fixarray", []byte{0x9f}},
	{"array16", []byte{0xdc, 0xff, 0xff}},
	{"array32", []byte{0xdd, 0xff, 0xff, 0xff, 0xff}},
	{"fixmap", []byte{0x8f}},
	{"map16", []byte{0xde, 0xff, 0xff}},
	{"map32", []byte{0xdf, 0xff, 0xff, 0xff, 0xff}},
	{"map32 pairs", []byte{0xdf, 0x7f, 0xff, 0xff, 0xff}}, // count fits, 2*count does not
	{"fixext16", []byte{0xd8, 0x01}},
	{"ext8", []byte{0xc7, 0xff, 0x01}},
	{"ext16", []byte{0xc8, 0xff, 0xff, 0x01}},
	{"ext32", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01}},
	{"ext32 no type byte", []byte{0xc9, 0x00, 0x00, 0x00, 0x00}},
}

// bombPlacements put a bomb header somewhere in an otherwise valid
// registration; tail bytes (fewer than any bomb declares) follow it.
func bombPlacements(t testing.TB, bomb []byte) map[string][]byte {
	t.Helper()
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	tail := bytes.Repeat([]byte{0x00}, 8)
	typeHello := cat(must(t, "type"), must(t, "HELLO"))
	return map[string][]byte{
		"top level":                cat(bomb),
		"top level, tail":          cat(bomb, tail),
		"ignored key's value":      cat([]byte{0x82}, typeHello, must(t, "node_hosts"), bomb, tail),
		"wanted key's value":       cat([]byte{0x82}, must(t, "zmq_address"), bomb, typeHello),
		"type's value":             cat([]byte{0x81}, must(t, "type"), bomb),
		"map key":                  cat([]byte{0x82}, typeHello, bomb, tail),
		"in an array":              cat([]byte{0x82}, typeHello, must(t, "x"), []byte{0x93, 0x01, 0x02}, bomb, tail),
		"deep in maps and arrays":  cat([]byte{0x82}, typeHello, must(t, "x"), []byte{0x91, 0x81, 0xa1, 'k', 0x92, 0xc0}, bomb, tail),
		"under a non-string key":   cat([]byte{0x82}, typeHello, []byte{0x01}, bomb, tail),
		"in a top-level array":     cat([]byte{0x92, 0x01}, bomb, tail),
		"as a non-string key body": cat([]byte{0x82}, typeHello, []byte{0x91}, bomb, tail),
	}
}

// TestParseLengthBombs: every header that declares more than the payload
// holds is dropped as decode, wherever it is, and costs a bounded,
// payload-sized allocation (the msgpack.Decoder this replaced allocated
// towards the declared size: hundreds of MiB for db ff ff ff ff, and kept
// the grown buffer in its pool).
func TestParseLengthBombs(t *testing.T) {
	for _, bomb := range lengthBombs {
		for where, payload := range bombPlacements(t, bomb.header) {
			t.Run(bomb.name+"/"+where, func(t *testing.T) {
				_, err := ParseRegistration(payload)
				if r := ReasonOf(err); r != ReasonDecode {
					t.Fatalf("% x: reason %q (%v), want %q", payload, r, err, ReasonDecode)
				}
				allocs := testing.AllocsPerRun(20, func() { _, _ = ParseRegistration(payload) })
				if allocs > 12 {
					t.Fatalf("% x: %.0f allocations per message", payload, allocs)
				}
				if b := allocBytesPerRun(100, func() { _, _ = ParseRegistration(payload) }); b > 2048 {
					t.Fatalf("% x: %d bytes allocated per message", payload, b)
				}
			})
		}
	}
}

// allocBytesPerRun is the average heap bytes f allocates.
func allocBytesPerRun(runs int, f func()) uint64 {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	f() // warm up
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		f()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
}

// TestParseLengthBombFlood is the chaos suite's flood in miniature: many
// 4-GiB-string headers in a row must not add up (no pooled buffer grows).
func TestParseLengthBombFlood(t *testing.T) {
	bomb := []byte{0xdb, 0xff, 0xff, 0xff, 0xff}
	start := time.Now()
	b := allocBytesPerRun(10000, func() {
		if _, err := ParseRegistration(bomb); ReasonOf(err) != ReasonDecode {
			t.Fatalf("err %v", err)
		}
	})
	if b > 1024 {
		t.Fatalf("%d bytes allocated per length bomb", b)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("10000 length bombs took %v", d)
	}
}

// TestParseExactLengths: the same headers with exactly the declared bytes
// (small declared sizes) are valid values that are skipped or decoded.
func TestParseExactLengths(t *testing.T) {
	be16 := func(n int) []byte { return binary.BigEndian.AppendUint16(nil, uint16(n)) }
	be32 := func(n int) []byte { return binary.BigEndian.AppendUint32(nil, uint32(n)) }
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	ones := func(n int) []byte { return bytes.Repeat([]byte{0x01}, n) }
	values := map[string][]byte{
		"fixstr 31":    cat([]byte{0xbf}, ones(31)),
		"str8 0":       {0xd9, 0x00},
		"str8 255":     cat([]byte{0xd9, 0xff}, ones(255)),
		"str16 300":    cat([]byte{0xda}, be16(300), ones(300)),
		"str32 70000":  cat([]byte{0xdb}, be32(70000), ones(70000)),
		"bin8 255":     cat([]byte{0xc4, 0xff}, ones(255)),
		"bin16 300":    cat([]byte{0xc5}, be16(300), ones(300)),
		"bin32 70000":  cat([]byte{0xc6}, be32(70000), ones(70000)),
		"fixarray 15":  cat([]byte{0x9f}, ones(15)),
		"array16 300":  cat([]byte{0xdc}, be16(300), ones(300)),
		"array32 3":    cat([]byte{0xdd}, be32(3), ones(3)),
		"fixmap 15":    cat([]byte{0x8f}, ones(30)),
		"map16 300":    cat([]byte{0xde}, be16(300), ones(600)),
		"map32 2":      cat([]byte{0xdf}, be32(2), ones(4)),
		"fixext1":      {0xd4, 0x05, 0x01},
		"fixext2":      {0xd5, 0x05, 0x01, 0x02},
		"fixext4":      cat([]byte{0xd6, 0x05}, ones(4)),
		"fixext8":      cat([]byte{0xd7, 0x05}, ones(8)),
		"fixext16":     cat([]byte{0xd8, 0x05}, ones(16)),
		"ext8 0":       {0xc7, 0x00, 0x05},
		"ext8 255":     cat([]byte{0xc7, 0xff, 0x05}, ones(255)),
		"ext16 300":    cat([]byte{0xc8}, be16(300), []byte{0x05}, ones(300)),
		"ext32 70000":  cat([]byte{0xc9}, be32(70000), []byte{0x05}, ones(70000)),
		"timestamp":    must(t, time.Unix(1, 2)),
		"float32":      must(t, float32(1.5)),
		"float64":      must(t, 1.5),
		"bools, nil":   must(t, []any{true, false, nil}),
		"ints":         must(t, []any{int8(-1), int16(-300), int32(-70000), int64(math.MinInt64), uint8(200), uint16(60000), uint32(1 << 31), uint64(math.MaxUint64), -32, 127}),
		"nested mix":   must(t, map[string]any{"a": []any{map[string]any{"b": []byte("x")}, "y", 1.25}}),
		"empty map":    {0x80},
		"empty array":  {0x90},
		"empty fixstr": {0xa0},
	}
	for name, v := range values {
		t.Run(name, func(t *testing.T) {
			// skipped under an ignored key
			in := bytes.Join([][]byte{{0x82}, must(t, "x"), v, must(t, "type"), must(t, "HELLO")}, nil)
			if _, err := ParseRegistration(in); ReasonOf(err) != ReasonHello {
				t.Fatalf("ignored key: %v", err)
			}
			// one byte short is truncated
			in = bytes.Join([][]byte{{0x82}, must(t, "type"), must(t, "HELLO"), must(t, "x"), v[:len(v)-1]}, nil)
			if _, err := ParseRegistration(in); ReasonOf(err) != ReasonDecode {
				t.Fatalf("one byte short: %v", err)
			}
			// at the top level: one valid value, so not a decode error (a
			// non-map is not_map; these maps lack "type" or have int keys)
			_, err := ParseRegistration(v)
			isMap := v[0]&0xf0 == 0x80 || v[0] == 0xde || v[0] == 0xdf
			if r := ReasonOf(err); r == ReasonDecode || (!isMap && r != ReasonNotMap) {
				t.Fatalf("top level: %v", err)
			}
		})
	}
}

// TestParseNumberEncodings: every msgpack number encoding of a wanted
// value decodes to the same integer (sign-extended for int codes).
func TestParseNumberEncodings(t *testing.T) {
	enc := map[string][]byte{
		"fixint":  {0x02},
		"uint8":   {0xcc, 0x02},
		"uint16":  {0xcd, 0x00, 0x02},
		"uint32":  {0xce, 0, 0, 0, 0x02},
		"uint64":  {0xcf, 0, 0, 0, 0, 0, 0, 0, 0x02},
		"int8":    {0xd0, 0x02},
		"int16":   {0xd1, 0x00, 0x02},
		"int32":   {0xd2, 0, 0, 0, 0x02},
		"int64":   {0xd3, 0, 0, 0, 0, 0, 0, 0, 0x02},
		"float32": {0xca, 0x40, 0, 0, 0},
		"float64": {0xcb, 0x40, 0, 0, 0, 0, 0, 0, 0},
		"str":     {0xa1, '2'},
		"bin":     {0xc4, 0x01, '2'},
	}
	for name, dp := range enc {
		t.Run(name, func(t *testing.T) {
			in := bytes.Clone(must(t, newFormat("P", "READ")))
			two := must(t, "dp_size")
			i := bytes.Index(in, two) + len(two)
			in = bytes.Join([][]byte{in[:i], dp, in[i+1:]}, nil) // newFormat's dp_size is fixint 2
			r, err := ParseRegistration(in)
			if err != nil || r.DPSize != 2 {
				t.Fatalf("% x: %+v %v", in, r, err)
			}
		})
	}
	for _, neg := range []struct {
		name string
		b    []byte
		want int64
	}{
		{"negative fixint", []byte{0xff}, -1},
		{"int8", []byte{0xd0, 0x80}, -128},
		{"int16", []byte{0xd1, 0xff, 0xfe}, -2},
		{"int32", []byte{0xd2, 0xff, 0xff, 0xff, 0xfd}, -3},
		{"int64", []byte{0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfc}, -4},
		{"uint64 max", []byte{0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, math.MaxInt64},
	} {
		in := bytes.Clone(must(t, newFormat("P", "READ")))
		key := must(t, "tp_size")
		i := bytes.Index(in, key) + len(key)
		in = bytes.Join([][]byte{in[:i], neg.b, in[i+1:]}, nil)
		_, err := ParseRegistration(in)
		if ReasonOf(err) != ReasonBadValue || !strings.Contains(err.Error(), fmt.Sprintf("tp_size %d ", neg.want)) {
			t.Errorf("%s: %v, want tp_size %d out of range", neg.name, err, neg.want)
		}
	}
}

// TestParseMatchesMsgpack: for payloads built by the msgpack library the
// reader agrees with msgpack.Unmarshal on the wanted fields.
func TestParseMatchesMsgpack(t *testing.T) {
	in := must(t, map[string]any{"type": "register", "role": "D", "index": uint64(1 << 63), "request_address": "http://10.0.0.9:7/v1/completions",
		"handshake_port": int64(6301), "notify_port": uint16(61005), "dp_size": int8(3), "tp_size": float32(2), "transfer_mode": []byte("Write"),
		"extra": map[string]any{"t": time.Unix(5, 0), "f": []any{1.5, nil, true, bytes.Repeat([]byte("z"), 70000)}}})
	var m map[string]any
	if err := msgpack.Unmarshal(in, &m); err != nil {
		t.Fatal(err)
	}
	r, err := ParseRegistration(in)
	if err != nil {
		t.Fatal(err)
	}
	if r.HTTPAddress != "10.0.0.9:7" || r.ZMQ.Handshake != 6301 || r.ZMQ.Notify != 61005 || r.DPSize != 3 || r.TPSize != 2 || r.TransferMode != ModeWrite {
		t.Fatalf("%+v (msgpack: %v)", r, m)
	}
}
