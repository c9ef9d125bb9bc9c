package sidechan

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestNotifyRoundTrip(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	got := make(chan Any, 4)
	srv, err := Listen(ctx, "127.0.0.1", 0, func(_ []byte, payload []byte, _ func([]byte) error) {
		m, err := Decode(payload)
		if err != nil {
			t.Errorf("decode: %v", err)
		}
		got <- m
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()

	pool := NewPool(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), time.Second)
	defer pool.Close()
	ep := Endpoint("127.0.0.1", srv.Port())
	pool.Send(ep, "", Encode(RemoteBlocks{Type: TypeRemoteBlocks, ReqID: "r", TransferID: "tx-1", BlockNotifyList: []int{3, 4, 500}, DecodeRank: 0}))
	pool.Send(ep, "", []byte("tx-bare"))
	m := <-got
	want := Any{Type: TypeRemoteBlocks, ReqID: "r", TransferID: "tx-1", BlockNotifyList: []int{3, 4, 500}}
	if d := cmp.Diff(want, m); d != "" {
		t.Errorf("remote_blocks (-want +got):\n%s", d)
	}
	if m := <-got; m.Bare != "tx-bare" {
		t.Errorf("bare = %q", m.Bare)
	}
}

func TestClientCallAndHandshake(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	meta := AgentMetadata{EngineID: "127.0.0.1:6301", AgentMetadata: []byte{1, 2}, KVCachesBaseAddr: []int64{1 << 40}, NumBlocks: 10, BlockLen: 64, AttnBackendName: "SIM"}
	srv, err := Listen(ctx, "127.0.0.1", 0, func(_ []byte, payload []byte, reply func([]byte) error) {
		if string(payload) == GetMetaMsg {
			_ = ServeHandshake(meta, map[string][][]byte{"layer.0": {{0}}}, reply)
			return
		}
		m, _ := Decode(payload)
		_ = reply(Encode(Reply{Type: TypeReadReply, RPCID: m.RPCID, OK: true, SimDigest: FormatDigest(42), SimNumTokens: 7}))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ep := Endpoint("127.0.0.1", srv.Port())

	got, err := Handshake(ctx, ep, 2*time.Second)
	if err != nil {
		t.Fatalf("Handshake: %v", err)
	}
	if d := cmp.Diff(meta, got); d != "" {
		t.Errorf("metadata (-want +got):\n%s", d)
	}

	cs := NewClients(ctx, time.Second)
	defer cs.Close()
	c, err := cs.Get(ep)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		r, err := c.Call(ctx, id, Encode(ReadRequest{Type: TypeRead, RPCID: id, TransferID: "tx"}))
		if err != nil {
			t.Fatalf("Call: %v", err)
		}
		if d, ok := ParseDigest(r.SimDigest); !ok || d != 42 || r.RPCID != id || !r.OK {
			t.Errorf("reply %+v", r)
		}
	}
}

func TestDialFailure(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := Handshake(ctx, Endpoint("127.0.0.1", 1), 500*time.Millisecond); err == nil {
		t.Error("handshake to a closed port succeeded")
	}
	dropped := make(chan string, 1)
	pool := NewPool(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), 500*time.Millisecond)
	pool.OnDrop = func(ep string, _ error) { dropped <- ep }
	pool.Send(Endpoint("127.0.0.1", 1), "", []byte("x"))
	select {
	case <-dropped:
	case <-ctx.Done():
		t.Error("no drop reported")
	}
	pool.Close()
}
