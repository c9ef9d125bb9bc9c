package kvevents

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

// countingConn serves data in reads of at most chunk bytes and counts
// them; what is written to it is kept.
type countingConn struct {
	net.Conn
	data    []byte
	chunk   int
	reads   int
	written []byte
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.written = append(c.written, p...)
	return len(p), nil
}

func (c *countingConn) SetWriteDeadline(time.Time) error { return nil }

func (c *countingConn) Read(p []byte) (int, error) {
	c.reads++
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.chunk)], c.data)
	c.data = c.data[n:]
	return n, nil
}

// batchMessage is a published message: topic, 8-byte sequence, payload.
func batchMessage(topic string, seq int, payload []byte) []byte {
	b := zmtp.AppendFrame(nil, 0x01, []byte(topic))
	b = append(b, zmtp.AppendFrame(nil, 0x01, binary.BigEndian.AppendUint64(nil, uint64(seq)))...)
	return append(b, zmtp.AppendFrame(nil, 0x00, payload)...)
}

func TestZMTPSubNext(t *testing.T) {
	long := bytes.Repeat([]byte{9}, 70<<10) // over the read-ahead
	ping := command("PING", []byte{0, 0})
	tests := []struct {
		name      string
		stream    []byte
		chunk     int
		want      [][][]byte // messages' frames
		wantErr   string     // the error after them ("" = io.EOF)
		maxReads  int        // of the connection (0 = unchecked)
		frameSize int        // the limit (0 = 1 MiB)
		written   []byte     // what the subscriber answers
	}{
		{
			name:     "fifty batches from two reads",
			stream:   bytes.Repeat(batchMessage("kv@", 7, bytes.Repeat([]byte{1}, 200)), 50),
			chunk:    1 << 20,
			want:     repeatMsg([][]byte{[]byte("kv@"), seqBytes(7), bytes.Repeat([]byte{1}, 200)}, 50),
			maxReads: 2,
		},
		{
			name:   "a long frame, and bytes trickling in",
			stream: append(batchMessage("", 1, long), batchMessage("", 2, []byte("x"))...),
			chunk:  7,
			want:   [][][]byte{{{}, seqBytes(1), long}, {{}, seqBytes(2), []byte("x")}},
		},
		{
			name: "heartbeats between messages are answered, other commands skipped",
			stream: slices.Concat(batchMessage("t", 1, []byte("a")), ping, command("PING", []byte("\x00\x0actx1")),
				command("SUBSCRIBE", []byte("x")), batchMessage("t", 2, []byte("b"))),
			chunk:   1 << 20,
			want:    [][][]byte{{[]byte("t"), seqBytes(1), []byte("a")}, {[]byte("t"), seqBytes(2), []byte("b")}},
			written: slices.Concat(command("PONG", nil), command("PONG", []byte("ctx1"))),
		},
		{
			name:      "a frame over the limit",
			stream:    append(batchMessage("t", 1, []byte("a")), 0x02, 0, 0, 0, 1, 0, 0, 0, 0), // claims 4 GiB
			chunk:     1 << 20,
			want:      [][][]byte{{[]byte("t"), seqBytes(1), []byte("a")}},
			wantErr:   "frame of 4294967296 bytes (limit 1024)",
			frameSize: 1024,
		},
		{
			name:    "a command inside a message",
			stream:  append(zmtp.AppendFrame(nil, 0x01, []byte("t")), ping...),
			chunk:   1 << 20,
			wantErr: "a command inside a message",
		},
		{
			name:    "reserved flag bits",
			stream:  []byte{0x80, 0},
			chunk:   1 << 20,
			wantErr: "frame flags 0x80",
		},
		{
			name:    "too many frames",
			stream:  bytes.Repeat(zmtp.AppendFrame(nil, 0x01, []byte("f")), maxMessageFrames+1),
			chunk:   1 << 20,
			wantErr: fmt.Sprintf("more than %d frames", maxMessageFrames),
		},
		{
			name:    "cut inside a frame",
			stream:  batchMessage("t", 1, []byte("abc"))[:12],
			chunk:   1 << 20,
			wantErr: io.ErrUnexpectedEOF.Error(),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			max := tc.frameSize
			if max == 0 {
				max = 1 << 20
			}
			c := &countingConn{data: tc.stream, chunk: tc.chunk}
			z := &zmtpSub{conn: c, r: bufio.NewReaderSize(c, zmtpReadBuf), max: uint64(max)}
			var got [][][]byte
			var err error
			for {
				var m [][]byte
				if m, err = z.next(); err != nil {
					break
				}
				cp := make([][]byte, len(m))
				for i, f := range m {
					cp[i] = bytes.Clone(f)
				}
				got = append(got, cp)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("%d messages, want %d (then %v)", len(got), len(tc.want), err)
			}
			for i := range got {
				if len(got[i]) != len(tc.want[i]) {
					t.Fatalf("message %d: %d frames, want %d", i, len(got[i]), len(tc.want[i]))
				}
				for j := range got[i] {
					if !bytes.Equal(got[i][j], tc.want[i][j]) {
						t.Fatalf("message %d frame %d: %d bytes differ from the %d sent", i, j, len(got[i][j]), len(tc.want[i][j]))
					}
				}
			}
			switch {
			case tc.wantErr == "" && !errors.Is(err, io.EOF):
				t.Errorf("ended with %v, want EOF", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("ended with %v, want %q", err, tc.wantErr)
			}
			if !bytes.Equal(c.written, tc.written) {
				t.Errorf("the subscriber wrote %q, want %q", c.written, tc.written)
			}
			if tc.maxReads > 0 && c.reads > tc.maxReads {
				t.Errorf("%d reads of the connection, want at most %d", c.reads, tc.maxReads)
			}
		})
	}
}

func seqBytes(n int) []byte { return binary.BigEndian.AppendUint64(nil, uint64(n)) }

func repeatMsg(m [][]byte, n int) [][][]byte {
	out := make([][][]byte, n)
	for i := range out {
		out[i] = m
	}
	return out
}

// fakePub accepts one connection and answers the handshake with greeting
// and reply; it returns what the subscriber sent before it went quiet.
func fakePub(t *testing.T, greeting, reply []byte) (endpoint string, sent <-chan []byte) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	ch := make(chan []byte, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			ch <- nil
			return
		}
		defer c.Close()
		_, _ = c.Write(greeting)
		_, _ = c.Write(reply)
		var got []byte
		buf := make([]byte, 4096)
		for {
			_ = c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
			n, err := c.Read(buf)
			got = append(got, buf[:n]...)
			if err != nil {
				break
			}
		}
		ch <- got
	}()
	return "tcp://" + l.Addr().String(), ch
}

func TestZMTPSubHandshake(t *testing.T) {
	ready := command("READY", zmtp.AppendProperty(nil, "Socket-Type", "PUB"))
	tests := []struct {
		name     string
		greeting []byte
		reply    []byte
		wantErr  string
	}{
		{"a PUB", greeting(), ready, ""},
		{"ZMTP 3.1", append(greeting()[:10:10], append([]byte{3, 1}, greeting()[12:]...)...), ready, ""},
		{"ZMTP 2", append(greeting()[:10:10], append([]byte{2, 0}, greeting()[12:]...)...), ready, "not a ZMTP 3 peer"},
		{"another mechanism", append(greeting()[:12:12], append([]byte("PLAIN"), make([]byte, 64-17)...)...), ready, `security mechanism "PLAIN"`},
		{"an ERROR", greeting(), command("ERROR", []byte("\x07refused")), "the publisher refused"},
		{"a message for a READY", greeting(), zmtp.AppendFrame(nil, 0x00, []byte("hello")), "no READY"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ep, sent := fakePub(t, tc.greeting, tc.reply)
			z, err := dialSub(t.Context(), ep, "kv@", 1<<20, 5*time.Second)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("dial: %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("dial: %v", err)
			}
			defer z.Close()
			got := <-sent
			want := append(append(greeting(), command("READY", zmtp.AppendProperty(nil, "Socket-Type", "SUB"))...), zmtp.AppendFrame(nil, 0x00, []byte("\x01kv@"))...)
			if !bytes.Equal(got, want) {
				t.Errorf("the subscriber sent %q, want %q", got, want)
			}
		})
	}
}

func TestZMTPSubDialErrors(t *testing.T) {
	if _, err := dialSub(t.Context(), "inproc://x", "", 1024, time.Second); err == nil || !strings.Contains(err.Error(), "only tcp:// and ipc://") {
		t.Errorf("inproc: %v", err)
	}
	// A listener that never answers: the handshake ends with the context.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := dialSub(ctx, "tcp://"+l.Addr().String(), "", 1024, time.Minute); err == nil {
		t.Error("a silent peer: no error")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("a silent peer held the dial %v", d)
	}
}

// FuzzZMTPSubNext: any byte stream ends in an error, never a panic, and
// every message read is made of bytes that were sent, within the frame
// limit and the frame count.
func FuzzZMTPSubNext(f *testing.F) {
	f.Add(batchMessage("kv@", 1, []byte("payload")))
	f.Add(append(command("PING", nil), batchMessage("", 2, bytes.Repeat([]byte{3}, 300))...))
	f.Add([]byte{0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, stream []byte) {
		const limit = 4096
		c := &countingConn{data: stream, chunk: 13}
		z := &zmtpSub{conn: c, r: bufio.NewReaderSize(c, zmtpReadBuf), max: limit}
		total := 0
		for range len(stream) + 1 {
			m, err := z.next()
			if err != nil {
				return
			}
			if len(m) == 0 || len(m) > maxMessageFrames {
				t.Fatalf("a message of %d frames", len(m))
			}
			for _, fr := range m {
				if len(fr) > limit {
					t.Fatalf("a frame of %d bytes over the limit", len(fr))
				}
				total += len(fr)
			}
			if total > len(stream) {
				t.Fatalf("%d bytes of frames from a stream of %d", total, len(stream))
			}
		}
		t.Fatal("the stream never ended")
	})
}
