package kvevents

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/switchyard-llm/switchyard/internal/kvevents/kvtest"
)

func jb(s string) map[string]string { return map[string]string{"bytes": hex.EncodeToString([]byte(s))} }

// storedJSON is a BlockStored in the named encoding (current vLLM) or the
// positional one, for blocks [from, to) of tokens, engine hashes name/i.
func storedJSON(named bool, name string, tokens []int, bs, from, to int) any {
	var hs []any
	for i := from; i < to; i++ {
		hs = append(hs, jb(fmt.Sprintf("%s/%d", name, i)))
	}
	var parent any
	if from > 0 {
		parent = jb(fmt.Sprintf("%s/%d", name, from-1))
	}
	toks := tokens[from*bs : to*bs]
	if named {
		return map[string]any{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent,
			"token_ids": toks, "block_size": bs, "lora_id": nil, "medium": "GPU", "lora_name": nil}
	}
	return []any{"BlockStored", hs, parent, toks, bs, nil, "GPU"}
}

func batch(events ...any) []any { return []any{float64(time.Now().Unix()), events, 0} }

func waitMatch(t *testing.T, x *Index, tokens []int, want map[string]int, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := x.Match(x.BlockKeys(u32(tokens), ""))
		if len(got) == 0 {
			got = nil
		}
		if cmp.Equal(want, got) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: match %v, want %v", what, got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestSubscriberAgainstLibzmqPublisher(t *testing.T) {
	for _, named := range []bool{true, false} {
		t.Run(fmt.Sprintf("named=%v", named), func(t *testing.T) {
			const bs = 4
			p := kvtest.Start(t, "kv@w1")
			x := NewIndex(IndexOptions{BlockSize: bs})
			s, err := NewSubscriber(Options{Index: x, Redial: 50 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(s.Close)
			s.Set([]Source{{Worker: "w1", Endpoint: p.Pub, ReplayEndpoint: p.Replay, Topic: "kv@"}})
			prompt, other := seq(1, 24), seq(500, 16)

			// Published before the subscription may be connected: what the
			// SUB socket missed comes back through the replay endpoint.
			p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(named, "a", prompt, bs, 0, 4))})
			waitMatch(t, x, prompt, map[string]int{"w1": 4}, "first store")

			// A batch the SUB never sees (a high-water-mark drop): the next
			// one reveals the gap and the replay brings the removal.
			p.Do(map[string]any{"op": "publish", "hide": true, "batch": batch(
				[]any{"BlockRemoved", []any{jb("a/2")}, "GPU"})})
			p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(named, "o", other, bs, 0, 4))})
			waitMatch(t, x, other, map[string]int{"w1": 4}, "store after the gap")
			waitMatch(t, x, prompt, map[string]int{"w1": 2}, "replayed removal")
			if s.C.Gaps.Load() == 0 || s.C.Replayed.Load() == 0 {
				t.Fatalf("gaps %d replayed %d", s.C.Gaps.Load(), s.C.Replayed.Load())
			}

			// The engine restarts: a new sequence from 0, an empty cache.
			p.Do(map[string]any{"op": "restart"})
			p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(named, "r", prompt, bs, 0, 1))})
			waitMatch(t, x, prompt, map[string]int{"w1": 1}, "after restart")
			waitMatch(t, x, other, nil, "old entries after restart")
			if s.C.Restarts.Load()+s.C.Resets.Load() == 0 {
				t.Fatalf("restart not seen: restarts %d resets %d", s.C.Restarts.Load(), s.C.Resets.Load())
			}

			// AllBlocksCleared; then the worker leaves the fleet.
			p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(named, "o", other, bs, 0, 2), []any{"AllBlocksCleared"})})
			waitMatch(t, x, prompt, nil, "after clear")
			p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(named, "o", other, bs, 0, 2))})
			waitMatch(t, x, other, map[string]int{"w1": 2}, "store after clear")
			s.Set(nil)
			if got := x.Match(x.BlockKeys(u32(other), "")); len(got) != 0 {
				t.Fatalf("entries of a removed worker: %v", got)
			}
		})
	}
}

func TestSubscriberDropsOversizedAndMalformed(t *testing.T) {
	p := kvtest.Start(t, "")
	x := NewIndex(IndexOptions{BlockSize: 4})
	s, err := NewSubscriber(Options{Index: x, MaxFrame: 4096, Redial: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	s.Set([]Source{{Worker: "w", Endpoint: p.Pub, ReplayEndpoint: p.Replay}})
	prompt := seq(1, 8)
	p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(true, "a", prompt, 4, 0, 1))})
	defer func() {
		t.Logf("counters: malformed %d gaps %d replayed %d failed %d reconnects %d batches %d", s.C.Malformed.Load(), s.C.Gaps.Load(), s.C.Replayed.Load(), s.C.ReplayFailed.Load(), s.C.Reconnects.Load(), s.C.Batches.Load())
	}()
	waitMatch(t, x, prompt, map[string]int{"w": 1}, "first")
	// A garbage payload is dropped and counted; the connection stays.
	p.Do(map[string]any{"op": "raw", "size": 100})
	// A frame over the limit closes the connection; the subscriber dials
	// again and later batches are applied.
	p.Do(map[string]any{"op": "raw", "size": 100_000})
	deadline := time.Now().Add(20 * time.Second)
	for s.C.Reconnects.Load() == 0 || s.C.Malformed.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("reconnects %d malformed %d", s.C.Reconnects.Load(), s.C.Malformed.Load())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Keep publishing until one lands on the new connection (a PUB drops
	// what it sends before the subscriber has reconnected).
	deadline = time.Now().Add(20 * time.Second)
	for i := 1; ; i++ {
		// The replay after the reconnect fails on the oversized batch it
		// still buffers, so the worker's entries were reset: store both.
		p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(true, "a", prompt, 4, 0, 2))})
		if x.Match(x.BlockKeys(u32(prompt), ""))["w"] == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no batch applied after the reconnect (%d sent)", i)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// newTestSubscription is a subscription of worker "w" over a fresh index
// of 4-token blocks, driven by the test instead of a socket.
func newTestSubscription(t *testing.T) (*Index, *Subscriber, *subscription) {
	t.Helper()
	x := NewIndex(IndexOptions{BlockSize: 4})
	s, err := NewSubscriber(Options{Index: x})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return x, s, &subscription{s: s, src: Source{Worker: "w"}, last: -1}
}

// TestHandleGapWithoutReplay: a gap that cannot be repaired resets the
// worker's entries rather than keep blocks that may be gone.
func TestHandleGapWithoutReplay(t *testing.T) {
	x, s, c := newTestSubscription(t)
	prompt := u32(seq(1, 8))
	frame := func(seq uint64, events ...any) [][]byte {
		var b [8]byte
		for i := range 8 {
			b[7-i] = byte(seq >> (8 * i))
		}
		return [][]byte{nil, b[:], enc(t, []any{1.0, events})}
	}
	c.handle(t.Context(), frame(0, positionalStored([]any{[]byte("a/0"), []byte("a/1")}, nil, seq(1, 8), 4, nil, nil)))
	if got := x.Match(x.BlockKeys(prompt, "")); got["w"] != 2 {
		t.Fatalf("before the gap: %v", got)
	}
	c.handle(t.Context(), frame(5, []any{"AllBlocksCleared"}))
	if got := x.Match(x.BlockKeys(prompt, "")); len(got) != 0 || s.C.ReplayFailed.Load() != 1 {
		t.Fatalf("after an unrepaired gap: %v (failed %d)", got, s.C.ReplayFailed.Load())
	}
	c.handle(t.Context(), [][]byte{nil, {1, 2}, nil})
	if s.C.Malformed.Load() != 1 {
		t.Fatal("a message with a short sequence frame was not counted")
	}
}

// TestReplayIsAppliedAsOneStep: a replay after a connect carries the
// publisher's history (blocks stored, then all cleared), and the index
// must go from before to after in one step. A reader polling the index
// while 2,000 replayed batches are applied never sees the history's
// blocks; applied one batch at a time, it did (the router routed a
// benchmark's first requests by blocks cleared long ago).
func TestReplayIsAppliedAsOneStep(t *testing.T) {
	x, s, c := newTestSubscription(t)
	prompt := x.BlockKeys(u32(seq(1, 8)), "")
	var got []replayed
	for i := range 2000 {
		ev := positionalStored([]any{[]byte("a/0"), []byte("a/1")}, nil, seq(1, 8), 4, nil, nil)
		if i%2 == 1 {
			ev = []any{"AllBlocksCleared"}
		}
		got = append(got, replayed{seq: int64(i), payload: enc(t, []any{1.0, []any{ev}})})
	}
	stop := make(chan struct{})
	seen := make(chan int, 1)
	go func() {
		most := 0
		defer func() { seen <- most }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			most = max(most, x.Match(prompt)["w"])
		}
	}()
	c.applyReplayed(got, -1)
	close(stop)
	if most := <-seen; most != 0 {
		t.Fatalf("a reader saw %d blocks of the replayed history, which ends cleared", most)
	}
	if c.last != 1999 || !c.seen.Load() || s.C.Replayed.Load() != 2000 || s.C.Cleared.Load() != 1000 {
		t.Fatalf("last %d seen %v replayed %d cleared %d", c.last, c.seen.Load(), s.C.Replayed.Load(), s.C.Cleared.Load())
	}
	// History an AllBlocksCleared of the replay voids is not applied: its
	// blocks with parents the buffer no longer holds are not orphans.
	x2, _, c2 := newTestSubscription(t)
	orphan := []any{"BlockStored", []any{[]byte("o/1")}, []byte("o/0"), seq(5, 4), 4, nil, nil}
	c2.applyReplayed([]replayed{
		{seq: 7, payload: enc(t, []any{1.0, []any{orphan}})},
		{seq: 8, payload: enc(t, []any{1.0, []any{orphan, []any{"AllBlocksCleared"}, positionalStored([]any{[]byte("a/0"), []byte("a/1")}, nil, seq(1, 8), 4, nil, nil)}})},
	}, -1)
	p2 := x2.BlockKeys(u32(seq(1, 8)), "")
	if st, _ := x2.Stats(); st.Orphans != 0 || x2.Match(p2)["w"] != 2 || c2.last != 8 {
		t.Fatalf("replay ending in a clear: %d orphans, match %v, last %d; want 0, 2 blocks, 8", st.Orphans, x2.Match(p2), c2.last)
	}
	// A hole in a replay voids what came before it.
	c.applyReplayed([]replayed{{seq: 2000, payload: enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a/0"), []byte("a/1")}, nil, seq(1, 8), 4, nil, nil)}})}}, -1)
	if x.Match(prompt)["w"] != 2 {
		t.Fatal("the next replayed batch was not applied")
	}
	c.applyReplayed([]replayed{{seq: 2005, payload: enc(t, []any{1.0, []any{[]any{"BlockStored", []any{[]byte("b/0")}, nil, seq(20, 23), 4, nil, nil}}})}}, -1)
	if x.Match(prompt)["w"] != 0 || s.C.Resets.Load() != 1 {
		t.Fatalf("after a hole: match %v, resets %d", x.Match(prompt), s.C.Resets.Load())
	}
}

// TestSubscriberAnswersHeartbeats: a libzmq publisher with
// ZMQ_HEARTBEAT_IVL 100 ms and ZMQ_HEARTBEAT_TIMEOUT 300 ms drops a
// subscriber that does not answer its PINGs; the subscriber answers, so
// its one connection lasts and carries the events.
func TestSubscriberAnswersHeartbeats(t *testing.T) {
	t.Setenv("KVTEST_HEARTBEAT_MS", "100")
	const bs = 4
	p := kvtest.Start(t, "")
	x := NewIndex(IndexOptions{BlockSize: bs})
	s, err := NewSubscriber(Options{Index: x, Redial: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	s.Set([]Source{{Worker: "w1", Endpoint: p.Pub, ReplayEndpoint: p.Replay}})
	first, second := seq(1, 8), seq(100, 8)
	p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(true, "a", first, bs, 0, 2))})
	waitMatch(t, x, first, map[string]int{"w1": 2}, "first store")
	time.Sleep(1200 * time.Millisecond) // four heartbeat timeouts
	p.Do(map[string]any{"op": "publish", "batch": batch(storedJSON(true, "b", second, bs, 0, 2))})
	waitMatch(t, x, second, map[string]int{"w1": 2}, "store after the heartbeats")
	if n := s.C.Reconnects.Load(); n != 0 {
		t.Errorf("%d reconnects: the publisher dropped the subscriber", n)
	}
}

// TestUndecodableBatchesWarn: a batch that does not decode is counted and
// said at warn level the first time and every 1,000th after, so an engine
// whose events the router cannot read is visible in its log, not only in
// a counter.
func TestUndecodableBatchesWarn(t *testing.T) {
	var buf bytes.Buffer
	x := NewIndex(IndexOptions{BlockSize: 4})
	s, err := NewSubscriber(Options{Index: x, Logger: slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	c := &subscription{s: s, src: Source{Worker: "w", Endpoint: "tcp://e:1"}, last: -1}
	bad := enc(t, []any{1.0, []any{positionalStored([]any{[]byte("a")}, nil, seq(0, 3), 4, nil, nil)}})
	for i := range 1001 {
		if _, ok := c.decode(bad); ok {
			t.Fatalf("batch %d decoded", i)
		}
	}
	if n := s.C.Malformed.Load(); n != 1001 {
		t.Fatalf("%d batches counted malformed, want 1001", n)
	}
	out := buf.String()
	if n := strings.Count(out, "kv event batch dropped"); n != 2 || !strings.Contains(out, "3 token ids for 1 blocks") || !strings.Contains(out, "dropped=1001") {
		t.Fatalf("%d warnings, want 2 (the first and the 1001st) with the error:\n%s", n, out)
	}
}
