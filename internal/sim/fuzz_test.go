package sim

import (
	"io"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/sim/sidechan"
)

// FuzzParseGen checks that no request body panics the parser.
func FuzzParseGen(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"a b","max_tokens":3}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],"max_completion_tokens":2}`,
		`{"prompt":[1,2,3],"kv_transfer_params":{"remote_block_ids":[[1],[2]],"do_remote_prefill":true}}`,
		`{"prompt":[[1]],"stream":true,"stream_options":{"include_usage":true}}`,
		`[]`, `null`, `{"prompt":null}`, `{"messages":[{"content":null}]}`, "\x00",
	} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	cfg, err := ParseArgs(nil, io.Discard)
	if err != nil {
		f.Fatal(err)
	}
	in := &Instance{cfg: cfg}
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		g, aerr := in.parseGen(body, chat, "id")
		if aerr == nil && (len(g.promptIDs) == 0 || g.maxTokens < 1) {
			t.Errorf("accepted an invalid request: %+v", g)
		}
		if aerr == nil && g.kv != nil {
			g.kv.ints("remote_block_ids")
			g.kv.int("remote_dp_rank")
			moriPeerFromParams(g.kv)
		}
	})
}

// FuzzSideChannel checks that no side-channel payload panics the decoders.
func FuzzSideChannel(f *testing.F) {
	f.Add(sidechan.Encode(sidechan.RemoteBlocks{Type: "remote_blocks", TransferID: "t", BlockNotifyList: []int{1}}))
	f.Add([]byte("tx-bare"))
	f.Add([]byte{0x81, 0xa4})
	f.Fuzz(func(t *testing.T, b []byte) {
		_, _ = sidechan.Decode(b)
		_, _ = parseMoRIZMQ(string(b))
		_, _ = moriPeerFromID(string(b), true)
		_, _ = moriPeerFromID(string(b), false)
	})
}
