package zmq

import (
	"bytes"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// kv is one map entry for mp; binKey encodes the key as msgpack bin.
type kv struct {
	k      string
	v      any
	binKey bool
}

// mp encodes an ordered msgpack map. []byte values encode as bin, strings
// as str.
func mp(t testing.TB, entries ...kv) []byte {
	t.Helper()
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	if err := e.EncodeMapLen(len(entries)); err != nil {
		t.Fatal(err)
	}
	for _, en := range entries {
		var err error
		if en.binKey {
			err = e.EncodeBytes([]byte(en.k))
		} else {
			err = e.EncodeString(en.k)
		}
		if err == nil {
			err = e.Encode(en.v)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	return buf.Bytes()
}

func must(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const (
	moriZMQ = "host:10.0.0.1,handshake:6301,notify:61005"
)

func newFormat(typ, mode string) map[string]any {
	return map[string]any{
		"type": typ, "http_address": "10.0.0.1:20005", "zmq_address": moriZMQ,
		"dp_size": 2, "tp_size": 8, "transfer_mode": mode,
	}
}

func TestParseRegistration(t *testing.T) {
	moriZ := worker.ZMQAddr{Host: "10.0.0.1", Handshake: 6301, Notify: 61005}
	tests := []struct {
		name   string
		in     []byte
		want   Registration
		reason string
	}{
		{
			name: "p2pnccl",
			in:   must(t, map[string]any{"type": "P", "http_address": "10.0.0.2:8100", "zmq_address": "10.0.0.2:21001"}),
			want: Registration{Role: worker.RolePrefill, HTTPAddress: "10.0.0.2:8100", ZMQAddress: "10.0.0.2:21001",
				ZMQ: worker.ZMQAddr{Host: "10.0.0.2", Port: 21001}, DPSize: 1, TPSize: 1, Format: FormatP2PNCCL},
		},
		{
			name: "moriio new, str strings, int numbers",
			in:   must(t, newFormat("D", "WRITE")),
			want: Registration{Role: worker.RoleDecode, HTTPAddress: "10.0.0.1:20005", ZMQAddress: moriZMQ, ZMQ: moriZ,
				DPSize: 2, TPSize: 8, TransferMode: ModeWrite, Format: FormatMoRIIONew},
		},
		{
			name: "moriio new, bin keys and values, str numbers, lower-case mode",
			in: mp(t,
				kv{"type", []byte("P"), true}, kv{"http_address", []byte("10.0.0.1:20005"), true},
				kv{"zmq_address", []byte(moriZMQ), false}, kv{"dp_size", "2", true}, kv{"tp_size", []byte(" 8"), false},
				kv{"transfer_mode", []byte("read"), true}),
			want: Registration{Role: worker.RolePrefill, HTTPAddress: "10.0.0.1:20005", ZMQAddress: moriZMQ, ZMQ: moriZ,
				DPSize: 2, TPSize: 8, TransferMode: ModeRead, Format: FormatMoRIIONew},
		},
		{
			name: "moriio new, extra keys ignored (node_hosts), uint64 and float numbers",
			in: mp(t, kv{"type", "P", false}, kv{"http_address", "10.0.0.1:20005", false}, kv{"zmq_address", moriZMQ, false},
				kv{"dp_size", uint64(2), false}, kv{"tp_size", 8.0, false}, kv{"transfer_mode", "WRITE", false},
				kv{"node_hosts", []any{"a", map[string]any{"x": []int{1, 2}}}, false}),
			want: Registration{Role: worker.RolePrefill, HTTPAddress: "10.0.0.1:20005", ZMQAddress: moriZMQ, ZMQ: moriZ,
				DPSize: 2, TPSize: 8, TransferMode: ModeWrite, Format: FormatMoRIIONew},
		},
		{
			name: "moriio new, IPv6",
			in: must(t, map[string]any{"type": "D", "http_address": "[fd00::1]:20005", "zmq_address": "host:fd00::1,handshake:6301,notify:61005",
				"dp_size": 1, "tp_size": 1, "transfer_mode": "READ"}),
			want: Registration{Role: worker.RoleDecode, HTTPAddress: "[fd00::1]:20005", ZMQAddress: "host:fd00::1,handshake:6301,notify:61005",
				ZMQ: worker.ZMQAddr{Host: "fd00::1", Handshake: 6301, Notify: 61005}, DPSize: 1, TPSize: 1, TransferMode: ModeRead, Format: FormatMoRIIONew},
		},
		{
			name: "moriio old",
			in: must(t, map[string]any{"type": "register", "role": "P", "index": "17", "request_address": "http://10.0.0.3:20005/v1/completions",
				"handshake_port": 6301, "notify_port": 61005, "dp_size": 1, "tp_size": 4, "transfer_mode": "WRITE"}),
			want: Registration{Role: worker.RolePrefill, HTTPAddress: "10.0.0.3:20005", ZMQAddress: "host:10.0.0.3,handshake:6301,notify:61005",
				ZMQ: worker.ZMQAddr{Host: "10.0.0.3", Handshake: 6301, Notify: 61005}, DPSize: 1, TPSize: 4, TransferMode: ModeWrite, Format: FormatMoRIIOOld},
		},
		{
			name: "moriio old, IPv6 and str ports, no dp/tp",
			in: must(t, map[string]any{"type": "register", "role": "D", "request_address": "http://[::1]:20005/v1/completions",
				"handshake_port": "6301", "notify_port": "61005", "transfer_mode": "read"}),
			want: Registration{Role: worker.RoleDecode, HTTPAddress: "[::1]:20005", ZMQAddress: "host:::1,handshake:6301,notify:61005",
				ZMQ: worker.ZMQAddr{Host: "::1", Handshake: 6301, Notify: 61005}, DPSize: 1, TPSize: 1, TransferMode: ModeRead, Format: FormatMoRIIOOld},
		},
		{
			name: "moriio old, hostname",
			in: must(t, map[string]any{"type": "register", "role": "D", "request_address": "http://decode-0.vllm.svc:8000/v1/completions",
				"handshake_port": 6301, "notify_port": 61005, "transfer_mode": "WRITE"}),
			want: Registration{Role: worker.RoleDecode, HTTPAddress: "decode-0.vllm.svc:8000", ZMQAddress: "host:decode-0.vllm.svc,handshake:6301,notify:61005",
				ZMQ: worker.ZMQAddr{Host: "decode-0.vllm.svc", Handshake: 6301, Notify: 61005}, DPSize: 1, TPSize: 1, TransferMode: ModeWrite, Format: FormatMoRIIOOld},
		},
		{name: "hello", in: must(t, map[string]any{"type": "HELLO"}), reason: ReasonHello},
		{name: "empty", in: nil, reason: ReasonDecode},
		{name: "garbage", in: []byte("\xc1\xc1 not msgpack"), reason: ReasonDecode},
		{name: "json", in: []byte(`{"type":"P"}`), reason: ReasonDecode},
		{name: "trailing bytes", in: append(must(t, map[string]any{"type": "HELLO"}), 0x01), reason: ReasonDecode},
		{name: "truncated", in: must(t, newFormat("P", "READ"))[:20], reason: ReasonDecode},
		{name: "huge declared map", in: []byte{0xdf, 0xff, 0xff, 0xff, 0xff}, reason: ReasonDecode},
		{name: "huge declared nested array", in: []byte{0x81, 0xa1, 'x', 0xdd, 0xff, 0xff, 0xff, 0xff}, reason: ReasonDecode},
		{name: "array", in: must(t, []any{"P", "10.0.0.1:1"}), reason: ReasonNotMap},
		{name: "string", in: must(t, "P"), reason: ReasonNotMap},
		{name: "nil", in: must(t, nil), reason: ReasonNotMap},
		{name: "missing type", in: must(t, map[string]any{"http_address": "10.0.0.1:1"}), reason: ReasonMissingKey},
		{name: "nil type", in: must(t, map[string]any{"type": nil}), reason: ReasonMissingKey},
		{name: "missing http_address", in: must(t, map[string]any{"type": "P", "zmq_address": "10.0.0.1:2"}), reason: ReasonMissingKey},
		{name: "missing zmq_address", in: must(t, map[string]any{"type": "P", "http_address": "10.0.0.1:2"}), reason: ReasonMissingKey},
		{name: "partial moriio keys", in: must(t, map[string]any{"type": "P", "http_address": "10.0.0.1:2", "zmq_address": moriZMQ, "transfer_mode": "READ"}), reason: ReasonMissingKey},
		{name: "old missing notify_port", in: must(t, map[string]any{"type": "register", "role": "P", "request_address": "http://10.0.0.1:2/v1/completions", "handshake_port": 1}), reason: ReasonMissingKey},
		{name: "int type", in: must(t, map[string]any{"type": 1}), reason: ReasonBadType},
		{name: "array http_address", in: must(t, map[string]any{"type": "P", "http_address": []string{"x"}, "zmq_address": "10.0.0.1:2"}), reason: ReasonBadType},
		{name: "bool dp_size", in: func() []byte { m := newFormat("P", "READ"); m["dp_size"] = true; return must(t, m) }(), reason: ReasonBadType},
		{name: "non-numeric dp_size", in: func() []byte { m := newFormat("P", "READ"); m["dp_size"] = "eight"; return must(t, m) }(), reason: ReasonBadType},
		{name: "fractional tp_size", in: func() []byte { m := newFormat("P", "READ"); m["tp_size"] = 1.5; return must(t, m) }(), reason: ReasonBadType},
		{name: "int transfer_mode", in: func() []byte { m := newFormat("P", "READ"); m["transfer_mode"] = 1; return must(t, m) }(), reason: ReasonBadType},
		{name: "non-string key", in: append([]byte{0x82, 0x01, 0x02}, must(t, "type")[0:]...), reason: ReasonDecode},
		{name: "int key", in: append([]byte{0x82, 0x01, 0x02}, append(must(t, "type"), must(t, "HELLO")...)...), reason: ReasonBadType},
		{name: "dp_size 0", in: func() []byte { m := newFormat("P", "READ"); m["dp_size"] = 0; return must(t, m) }(), reason: ReasonBadValue},
		{name: "dp_size huge", in: func() []byte { m := newFormat("P", "READ"); m["dp_size"] = 1 << 40; return must(t, m) }(), reason: ReasonBadValue},
		{name: "negative tp_size", in: func() []byte { m := newFormat("P", "READ"); m["tp_size"] = -1; return must(t, m) }(), reason: ReasonBadValue},
		{name: "unknown type", in: must(t, map[string]any{"type": "X"}), reason: ReasonUnknownType},
		{name: "regular type", in: must(t, map[string]any{"type": "regular", "http_address": "10.0.0.1:2", "zmq_address": "10.0.0.1:3"}), reason: ReasonUnknownType},
		{name: "old bad role", in: must(t, map[string]any{"type": "register", "role": "X"}), reason: ReasonUnknownType},
		{name: "transfer_mode BOTH", in: must(t, newFormat("P", "BOTH")), reason: ReasonUnknownTransferMode},
		{name: "http_address with scheme", in: must(t, map[string]any{"type": "P", "http_address": "http://10.0.0.1:2", "zmq_address": "10.0.0.1:3"}), reason: ReasonBadAddress},
		{name: "http_address without port", in: must(t, map[string]any{"type": "P", "http_address": "10.0.0.1", "zmq_address": "10.0.0.1:3"}), reason: ReasonBadAddress},
		{name: "http_address port 0", in: must(t, map[string]any{"type": "P", "http_address": "10.0.0.1:0", "zmq_address": "10.0.0.1:3"}), reason: ReasonBadAddress},
		{name: "http_address unspecified", in: must(t, map[string]any{"type": "P", "http_address": "0.0.0.0:8000", "zmq_address": "10.0.0.1:3"}), reason: ReasonBadAddress},
		{name: "http_address bad host", in: must(t, map[string]any{"type": "P", "http_address": "a b:8000", "zmq_address": "10.0.0.1:3"}), reason: ReasonBadAddress},
		{name: "bad zmq_address", in: must(t, map[string]any{"type": "P", "http_address": "10.0.0.1:2", "zmq_address": "nonsense"}), reason: ReasonBadAddress},
		{name: "old https request_address", in: must(t, map[string]any{"type": "register", "role": "P", "request_address": "https://10.0.0.1:2/v1/completions", "handshake_port": 1, "notify_port": 2}), reason: ReasonBadAddress},
		{name: "old request_address without port", in: must(t, map[string]any{"type": "register", "role": "P", "request_address": "http://10.0.0.1/v1/completions", "handshake_port": 1, "notify_port": 2}), reason: ReasonBadAddress},
		{name: "old port out of range", in: must(t, map[string]any{"type": "register", "role": "P", "request_address": "http://10.0.0.1:2/v1/completions", "handshake_port": 70000, "notify_port": 2}), reason: ReasonBadAddress},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseRegistration(tt.in)
			if tt.reason != "" {
				if err == nil {
					t.Fatalf("got %+v, want drop %q", got, tt.reason)
				}
				if r := ReasonOf(err); r != tt.reason {
					t.Fatalf("reason %q (%v), want %q", r, err, tt.reason)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Fatalf("-want +got\n%s", d)
			}
		})
	}
}

func TestParseHTTPAddressCanonical(t *testing.T) {
	r, err := ParseRegistration(must(t, map[string]any{"type": "P", "http_address": "10.0.0.1:08000", "zmq_address": "10.0.0.1:3"}))
	if err != nil || r.HTTPAddress != "10.0.0.1:8000" {
		t.Fatalf("got %q %v", r.HTTPAddress, err)
	}
}

func TestParseDeepNestingDoesNotRecurse(t *testing.T) {
	// 60k nested one-element arrays under an ignored key, then the real keys.
	var b bytes.Buffer
	b.WriteByte(0x83)
	b.Write(must(t, "deep"))
	for range 60000 {
		b.WriteByte(0x91)
	}
	b.WriteByte(0x00)
	b.Write(must(t, "type")[0:])
	b.Write(must(t, "HELLO"))
	b.Write(must(t, "x"))
	b.Write(must(t, 1))
	if _, err := ParseRegistration(b.Bytes()); ReasonOf(err) != ReasonHello {
		t.Fatalf("err %v", err)
	}
}

func FuzzParseRegistration(f *testing.F) {
	f.Add(must(f, newFormat("P", "READ")))
	f.Add(must(f, map[string]any{"type": "D", "http_address": "10.0.0.2:8100", "zmq_address": "10.0.0.2:21001"}))
	f.Add(must(f, map[string]any{"type": "register", "role": "P", "index": "3", "request_address": "http://[::1]:20005/v1/completions",
		"handshake_port": 6301, "notify_port": "61005", "dp_size": 2, "tp_size": 1, "transfer_mode": "write"}))
	f.Add(must(f, map[string]any{"type": "HELLO"}))
	f.Add(mp(f, kv{"type", []byte("P"), true}, kv{"http_address", []byte("h:1"), true}, kv{"zmq_address", "h:2", false}))
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0xdb, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0x82, 0xa4, 't', 'y', 'p', 'e', 0xa5, 'H', 'E', 'L', 'L', 'O', 0xa1, 'x', 0xc9, 0x00, 0x00, 0x00, 0x10, 0x01})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRegistration(b)
		if err != nil {
			if ReasonOf(err) == "" {
				t.Fatalf("error without reason: %v", err)
			}
			return
		}
		// Anything accepted must be usable by the registry as is.
		if r.Role != worker.RolePrefill && r.Role != worker.RoleDecode {
			t.Fatalf("role %v", r.Role)
		}
		if r.DPSize < 1 || r.DPSize > maxDPSize || r.TPSize < 1 {
			t.Fatalf("sizes %d/%d", r.DPSize, r.TPSize)
		}
		if _, err := checkHTTPAddress(r.HTTPAddress); err != nil {
			t.Fatalf("accepted bad http_address %q", r.HTTPAddress)
		}
		if _, _, err := worker.NormalizeURL("http://" + r.HTTPAddress); err != nil {
			t.Fatalf("http_address %q makes a bad URL: %v", r.HTTPAddress, err)
		}
		if z, err := worker.ParseZMQAddress(r.ZMQAddress); err != nil || z != r.ZMQ {
			t.Fatalf("zmq_address %q: %v", r.ZMQAddress, err)
		}
		if r.TransferMode != "" && r.TransferMode != ModeRead && r.TransferMode != ModeWrite {
			t.Fatalf("mode %q", r.TransferMode)
		}
	})
}
