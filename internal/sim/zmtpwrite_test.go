package sim

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

// writeConn records every write.
type writeConn struct {
	net.Conn
	writes [][]byte
}

func (c *writeConn) Write(p []byte) (int, error) {
	c.writes = append(c.writes, bytes.Clone(p))
	return len(p), nil
}

// frame is a ZMTP frame header and body, as go-zeromq writes them: two
// writes.
func frame(flags byte, body []byte) [][]byte {
	var h []byte
	if len(body) > 255 {
		h = binary.BigEndian.AppendUint64([]byte{flags | 0x02}, uint64(len(body)))
	} else {
		h = []byte{flags, byte(len(body))}
	}
	return [][]byte{h, body}
}

func TestCoalescingConnWritesAMessageAtOnce(t *testing.T) {
	big := bytes.Repeat([]byte{7}, 300)
	var parts [][]byte
	var wantWrites [][]byte
	// The greeting, in two writes as a peer negotiating the version does:
	// passed through as written.
	g := bytes.Repeat([]byte{0xff}, zmtpGreeting)
	parts = append(parts, g[:11], g[11:])
	wantWrites = append(wantWrites, g[:11], g[11:])
	// A READY command: one write.
	ready := frame(0x04, []byte("\x05READY"))
	parts = append(parts, ready...)
	wantWrites = append(wantWrites, bytes.Join(ready, nil))
	// Three messages of three frames (topic, sequence, payload; one
	// payload long): one write each.
	for i, payload := range [][]byte{[]byte("batch-0"), big, {}} {
		var msg [][]byte
		msg = append(msg, frame(0x01, []byte("kv@"))...)
		msg = append(msg, frame(0x01, binary.BigEndian.AppendUint64(nil, uint64(i)))...)
		msg = append(msg, frame(0x00, payload)...)
		parts = append(parts, msg...)
		wantWrites = append(wantWrites, bytes.Join(msg, nil))
	}
	w := &writeConn{}
	c := newCoalescingConn(w)
	for _, p := range parts {
		if n, err := c.Write(p); n != len(p) || err != nil {
			t.Fatalf("Write of %d bytes: %d, %v", len(p), n, err)
		}
	}
	if len(w.writes) != len(wantWrites) {
		t.Fatalf("%d writes, want %d", len(w.writes), len(wantWrites))
	}
	for i := range wantWrites {
		if !bytes.Equal(w.writes[i], wantWrites[i]) {
			t.Errorf("write %d: %q, want %q", i, w.writes[i], wantWrites[i])
		}
	}
}

// TestCoalescingTransportDeliversMessages: a go-zeromq PUB bound through
// the coalescing transport, a plain SUB: every multipart message arrives
// whole and in order.
func TestCoalescingTransportDeliversMessages(t *testing.T) {
	if err := registerCoalescing(); err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	pub := zmq4.NewPub(ctx, zmq4.WithLogger(quietZMQLogger))
	defer pub.Close()
	if err := pub.Listen(coalescingTransport + "://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	sub := zmq4.NewSub(ctx, zmq4.WithLogger(quietZMQLogger))
	defer sub.Close()
	if err := sub.Dial("tcp://" + pub.Addr().String()); err != nil {
		t.Fatal(err)
	}
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	// The subscription reaches the PUB after the connection: publish
	// until the first message arrives, then a numbered run.
	got := make(chan zmq4.Msg, 256)
	go func() {
		for {
			m, err := sub.Recv()
			if err != nil {
				close(got)
				return
			}
			got <- m
		}
	}()
	deadline := time.After(10 * time.Second)
	for ready := false; !ready; {
		_ = pub.SendMulti(zmq4.NewMsgFrom([]byte("kv@"), []byte("probe")))
		select {
		case <-got:
			ready = true
		case <-time.After(20 * time.Millisecond):
		case <-deadline:
			t.Fatal("no message reached the subscriber")
		}
	}
	const n = 100
	for i := range n {
		payload := bytes.Repeat([]byte{byte(i)}, i*37) // short and long frames
		if err := pub.SendMulti(zmq4.NewMsgFrom([]byte("kv@"), []byte(fmt.Sprint(i)), payload)); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < n; {
		select {
		case m, ok := <-got:
			if !ok {
				t.Fatal("subscriber closed")
			}
			if len(m.Frames) == 2 { // a late probe
				continue
			}
			if len(m.Frames) != 3 || string(m.Frames[1]) != fmt.Sprint(i) || !bytes.Equal(m.Frames[2], bytes.Repeat([]byte{byte(i)}, i*37)) {
				t.Fatalf("message %d: %d frames, sequence %q, payload of %d bytes", i, len(m.Frames), m.Frames[1], len(m.Frames[2]))
			}
			i++
		case <-deadline:
			t.Fatalf("%d of %d messages arrived", i, n)
		}
	}
}
