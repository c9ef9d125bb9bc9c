package sidechan

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkCall: read RPCs (the PD simulation's per-request KV read) from
// many concurrent callers over one client to one server whose handler
// answers at once; both ends in this process, so ns/op is the two ends'
// cost together at full concurrency.
func BenchmarkCall(b *testing.B) {
	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	srv, err := Listen(ctx, "127.0.0.1", 0, func(_ []byte, payload []byte, reply func([]byte) error) {
		m, _ := Decode(payload)
		_ = reply(Encode(Reply{Type: TypeReadReply, RPCID: m.RPCID, OK: true, SimNumTokens: 7}))
	})
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	cs := NewClients(ctx, time.Second)
	defer cs.Close()
	c, err := cs.Get(Endpoint("127.0.0.1", srv.Port()))
	if err != nil {
		b.Fatal(err)
	}
	var seq atomic.Uint64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := strconv.FormatUint(seq.Add(1), 10)
			if _, err := c.Call(ctx, id, Encode(ReadRequest{Type: TypeRead, RPCID: id, TransferID: "tx", BlockIDs: []int{1, 2, 3}})); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
