package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"testing"
)

// chunkConn serves data in reads of at most chunk bytes and counts them.
type chunkConn struct {
	net.Conn
	data   []byte
	chunk  int
	reads  int
	closed bool
}

func (c *chunkConn) Read(p []byte) (int, error) {
	c.reads++
	if c.closed {
		return 0, net.ErrClosed
	}
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), c.chunk)], c.data)
	c.data = c.data[n:]
	return n, nil
}

func (c *chunkConn) Close() error { c.closed = true; return nil }

// zmtpStream is a 64-byte greeting, then count messages of three frames
// (topic, an 8-byte sequence, a body of bodyLen bytes) as a publisher
// sends them.
func zmtpStream(count, bodyLen int) []byte {
	b := bytes.Repeat([]byte{0xff}, 64)
	for i := range count {
		b = append(b, 0x01, 3)
		b = append(b, "kv@"...)
		b = append(b, 0x01, 8)
		b = binary.BigEndian.AppendUint64(b, uint64(i))
		if bodyLen > 255 {
			b = append(b, 0x02)
			b = binary.BigEndian.AppendUint64(b, uint64(bodyLen))
		} else {
			b = append(b, 0x00, byte(bodyLen))
		}
		b = append(b, bytes.Repeat([]byte{byte(i)}, bodyLen)...)
	}
	return b
}

// readLikeZMQ reads the stream as go-zeromq does: the greeting, then each
// frame's header and body with its own io.ReadFull.
func readLikeZMQ(r io.Reader) ([]byte, error) {
	var out bytes.Buffer
	greeting := make([]byte, 64)
	if _, err := io.ReadFull(r, greeting); err != nil {
		return nil, err
	}
	out.Write(greeting)
	for {
		var h [2]byte
		if _, err := io.ReadFull(r, h[:]); err != nil {
			if errors.Is(err, io.EOF) {
				return out.Bytes(), nil
			}
			return out.Bytes(), err
		}
		out.Write(h[:])
		size := uint64(h[1])
		if h[0]&0x02 != 0 {
			var l [8]byte
			l[0] = h[1]
			if _, err := io.ReadFull(r, l[1:]); err != nil {
				return out.Bytes(), err
			}
			out.Write(l[1:])
			size = binary.BigEndian.Uint64(l[:])
		}
		body := make([]byte, size)
		if _, err := io.ReadFull(r, body); err != nil {
			return out.Bytes(), err
		}
		out.Write(body)
	}
}

func TestFrameLimitConnReadsAhead(t *testing.T) {
	for _, tc := range []struct {
		name           string
		count, bodyLen int
		chunk          int
		maxReads       int
	}{
		// Every frame of 50 small messages from one read of the socket
		// (one more finds the end).
		{name: "small messages, one segment", count: 50, bodyLen: 200, chunk: 1 << 20, maxReads: 2},
		// Bodies larger than the read-ahead go straight through.
		{name: "a body over the buffer", count: 3, bodyLen: 100 << 10, chunk: 1 << 20, maxReads: 12},
		// Bytes arriving a few at a time still come out whole and in order.
		{name: "trickle", count: 20, bodyLen: 300, chunk: 7, maxReads: 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := zmtpStream(tc.count, tc.bodyLen)
			src := &chunkConn{data: bytes.Clone(data), chunk: tc.chunk}
			c := &frameLimitConn{Conn: src, limit: 1 << 20, skip: 64}
			got, err := readLikeZMQ(c)
			if err != nil {
				t.Fatalf("read: %v", err)
			}
			if !bytes.Equal(got, data) {
				t.Fatalf("read %d bytes differing from the %d sent", len(got), len(data))
			}
			if src.reads > tc.maxReads {
				t.Errorf("%d reads of the connection, want at most %d", src.reads, tc.maxReads)
			}
		})
	}
}

func TestFrameLimitConnRejectsOversizedFrame(t *testing.T) {
	lost := 0
	data := append(zmtpStream(2, 10), 0x02, 0, 0, 0, 0, 0, 0x10, 0, 0) // a 1 MiB frame header
	src := &chunkConn{data: data, chunk: 1 << 20}
	c := &frameLimitConn{Conn: src, limit: 64 << 10, skip: 64, lost: func() { lost++ }}
	_, err := readLikeZMQ(c)
	if err == nil || !src.closed || lost != 1 {
		t.Fatalf("err %v, closed %v, lost called %d times; want an error, the connection closed, lost once", err, src.closed, lost)
	}
}
