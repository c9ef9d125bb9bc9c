package zmtp

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

func TestAppendFrame(t *testing.T) {
	for _, tc := range []struct {
		name  string
		flags byte
		n     int
		head  []byte
	}{
		{"empty", 0, 0, []byte{0, 0}},
		{"short, more", FlagMore, 3, []byte{FlagMore, 3}},
		{"255 is short", 0, 255, []byte{0, 255}},
		{"256 is long", FlagCommand, 256, []byte{FlagCommand | FlagLong, 0, 0, 0, 0, 0, 0, 1, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := bytes.Repeat([]byte{'x'}, tc.n)
			got := AppendFrame([]byte("pre"), tc.flags, body)
			want := slices.Concat([]byte("pre"), tc.head, body)
			if !bytes.Equal(got, want) {
				t.Fatalf("AppendFrame = %x, want %x", got, want)
			}
		})
	}
}

func TestAppendPropertyAndIsCommand(t *testing.T) {
	got := AppendProperty([]byte{5, 'R', 'E', 'A', 'D', 'Y'}, "Socket-Type", "SUB")
	want := append([]byte("\x05READY\x0bSocket-Type"), 0, 0, 0, 3, 'S', 'U', 'B')
	if !bytes.Equal(got, want) {
		t.Fatalf("AppendProperty = %q, want %q", got, want)
	}
	for _, tc := range []struct {
		body string
		name string
		want bool
	}{
		{"\x05READY\x0bSocket-Type", "READY", true},
		{"\x04PING\x00\x01", "PING", true},
		{"\x04PONG", "PING", false},
		{"\x05READ", "READY", false}, // cut
		{"\x06READYX", "READY", false},
		{"", "PING", false},
	} {
		if got := IsCommand([]byte(tc.body), tc.name); got != tc.want {
			t.Errorf("IsCommand(%q, %q) = %v, want %v", tc.body, tc.name, got, tc.want)
		}
	}
}

type hdr struct {
	flags byte
	size  uint64
}

// TestScannerAtEveryCut: a stream of a greeting, a two-frame message, a
// command, a long frame and an empty last frame is fed cut in two at every
// offset, and byte by byte; the headers come out the same, and
// AtMessageEnd holds exactly at the ends of messages and commands.
func TestScannerAtEveryCut(t *testing.T) {
	greeting := bytes.Repeat([]byte{0xaa}, 64)
	parts := [][]byte{
		AppendFrame(nil, FlagMore, []byte("topic")),
		AppendFrame(nil, 0, []byte("payload")),
		AppendFrame(nil, FlagCommand, []byte("\x04PING\x00\x00")),
		AppendFrame(nil, FlagMore, bytes.Repeat([]byte{1}, 300)),
		AppendFrame(nil, 0, nil),
	}
	want := []hdr{{FlagMore, 5}, {0, 7}, {FlagCommand, 7}, {FlagMore | FlagLong, 300}, {0, 0}}
	ends := map[int]bool{64: true} // offsets where the greeting, a message or a command ends
	stream := slices.Clone(greeting)
	for i, p := range parts {
		stream = append(stream, p...)
		if i != 0 && i != 3 {
			ends[len(stream)] = true
		}
	}
	run := func(t *testing.T, pieces [][]byte) {
		t.Helper()
		var s Scanner
		s.Skip(64)
		var got []hdr
		off := 0
		for _, p := range pieces {
			if err := s.Feed(p, func(f byte, n uint64) error { got = append(got, hdr{f, n}); return nil }); err != nil {
				t.Fatal(err)
			}
			off += len(p)
			if e := s.AtMessageEnd(); e != ends[off] {
				t.Fatalf("at %d: AtMessageEnd %v, want %v", off, e, ends[off])
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("headers %v, want %v", got, want)
		}
	}
	for cut := range len(stream) + 1 {
		run(t, [][]byte{stream[:cut], stream[cut:]})
	}
	var bytewise [][]byte
	for i := range stream {
		bytewise = append(bytewise, stream[i:i+1])
	}
	run(t, bytewise)
}

func TestScannerHeaderErrorStops(t *testing.T) {
	var s Scanner
	stop := errors.New("too big")
	stream := slices.Concat(AppendFrame(nil, FlagMore, []byte("ok")), AppendFrameHeader(nil, 0, 1<<20))
	calls := 0
	err := s.Feed(stream, func(_ byte, n uint64) error {
		calls++
		if n > 100 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || calls != 2 {
		t.Fatalf("Feed = %v after %d headers, want the header's error after 2", err, calls)
	}
}
