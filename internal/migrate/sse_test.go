package migrate

import (
	"bytes"
	"testing"
)

// FuzzEventData: the one-line fast path agrees with reading every line.
func FuzzEventData(f *testing.F) {
	for _, s := range []string{"data: {}\n\n", "data:{}\r\n\r\n", "data: a\ndata: b\n\n", ": ping\n\n", "data: x\n", "data: a\rb\n\n",
		"data:  two spaces\n\n", "event: e\ndata: d\n\n", "data: d\nid: 1\n\n", "data:\n\n", "data"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, ev []byte) {
		got, want := eventData(ev), eventDataLines(ev)
		if (got == nil) != (want == nil) || !bytes.Equal(got, want) {
			t.Fatalf("eventData(%q) = %q, every line read gives %q", ev, got, want)
		}
	})
}

// TestSplitterKeepsPartialEvents: events complete across Feed calls, in
// place or from the pending bytes, arrive whole and in order.
func TestSplitterKeepsPartialEvents(t *testing.T) {
	stream := "data: 1\n\ndata: 22\n\n: c\n\ndata: 333\r\n\r\ndata: 4444\n\n"
	for cut := 1; cut < len(stream); cut++ {
		for _, step := range []int{1, 3, 7, len(stream)} {
			var sp Splitter
			var got []string
			parts := []string{stream[:cut]}
			for rest := stream[cut:]; len(rest) > 0; rest = rest[min(step, len(rest)):] {
				parts = append(parts, rest[:min(step, len(rest))])
			}
			for _, p := range parts {
				buf := []byte(p) // the caller reuses its buffer after Feed
				sp.Feed(buf, func(ev []byte) { got = append(got, string(ev)) })
				clear(buf)
			}
			want := []string{"data: 1\n\n", "data: 22\n\n", ": c\n\n", "data: 333\r\n\r\n", "data: 4444\n\n"}
			if len(got) != len(want) || len(sp.Pending()) != 0 || sp.bp != nil {
				t.Fatalf("cut %d step %d: %q, pending %q (a buffer held: %v)", cut, step, got, sp.Pending(), sp.bp != nil)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("cut %d step %d: event %d %q, want %q", cut, step, i, got[i], want[i])
				}
			}
		}
	}
}

// TestSplitterHoldsABufferOnlyWhileAnEventIsCut: reads that end on event
// boundaries (a paced stream) hold no buffer; a read that cuts an event
// takes one from the pool, keeps it while events stay cut (a burst), and
// gives it back once none is pending, or on Reset.
func TestSplitterHoldsABufferOnlyWhileAnEventIsCut(t *testing.T) {
	var sp Splitter
	n := 0
	count := func([]byte) { n++ }
	for range 3 {
		sp.Feed([]byte("data: {\"t\":1}\n\n"), count)
		if sp.bp != nil || sp.pend != nil {
			t.Fatal("a whole event left a buffer held")
		}
	}
	sp.Feed([]byte("data: {\"t\":2}\n\ndata: {\"t"), count)
	if sp.bp == nil || string(sp.Pending()) != "data: {\"t" {
		t.Fatalf("a cut event: pending %q, pooled %v", sp.Pending(), sp.bp != nil)
	}
	held := sp.bp
	sp.Feed([]byte("\":3}\n\ndata: {\"t\":4"), count)
	if sp.bp != held || string(sp.Pending()) != "data: {\"t\":4" {
		t.Fatalf("the next cut event: pending %q, same buffer %v", sp.Pending(), sp.bp == held)
	}
	sp.Feed([]byte("}\n\n"), count)
	if sp.bp != nil || sp.pend != nil || n != 6 {
		t.Fatalf("all events whole: %d events, buffer held %v, pending %q", n, sp.bp != nil, sp.pend)
	}
	sp.Feed([]byte("data: {"), count)
	sp.Reset()
	if sp.bp != nil || sp.pend != nil {
		t.Fatal("Reset kept the buffer")
	}
}
