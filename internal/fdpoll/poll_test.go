package fdpoll

import (
	"net"
	"runtime"
	"syscall"
	"testing"
	"time"
)

type chanHandler chan struct{}

func (h chanHandler) PollEvent() { h <- struct{}{} }

func pair(t *testing.T) (client, server net.Conn, rc syscall.RawConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err = ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	rc, err = client.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	return client, server, rc
}

func expect(t *testing.T, h chanHandler, want bool, what string) {
	t.Helper()
	select {
	case <-h:
		if !want {
			t.Fatalf("%s: an event, want none", what)
		}
	case <-time.After(200 * time.Millisecond):
		if want {
			t.Fatalf("%s: no event within 200 ms", what)
		}
	}
}

func TestPoller(t *testing.T) {
	if runtime.GOOS != "linux" {
		if New() != nil {
			t.Fatal("New off Linux returned a poller")
		}
		t.Skip("epoll is Linux's")
	}
	p := New()
	if p == nil {
		t.Fatal("New returned nil on Linux")
	}
	defer p.Stop()
	_, server, rc := pair(t)
	h := make(chanHandler, 4)
	fd, ok := p.Add(rc, h)
	if !ok {
		t.Fatal("Add failed")
	}
	expect(t, h, false, "nothing sent")
	server.Write([]byte("x"))
	expect(t, h, true, "data")
	expect(t, h, false, "one-shot: the same data again") // disarmed until Rearm
	if !p.Rearm(rc, h) {
		t.Fatal("Rearm failed")
	}
	expect(t, h, true, "rearmed with data still unread")
	p.Remove(rc, fd, h)
	if _, ok := p.Add(rc, h); !ok {
		t.Fatal("Add after Remove failed")
	}
	expect(t, h, true, "added again with data unread")

	// a peer that closes is news too
	_, server2, rc2 := pair(t)
	h2 := make(chanHandler, 4)
	if _, ok := p.Add(rc2, h2); !ok {
		t.Fatal("Add failed")
	}
	server2.Close()
	expect(t, h2, true, "peer closed")
}

func TestStopTellsRegisteredHandlers(t *testing.T) {
	p := New()
	if p == nil {
		t.Skip("no epoll set on this system")
	}
	_, _, rc := pair(t)
	h := make(chanHandler, 4)
	if _, ok := p.Add(rc, h); !ok {
		t.Fatal("Add failed")
	}
	p.Stop()
	expect(t, h, true, "Stop")
	if _, ok := p.Add(rc, h); ok {
		t.Fatal("Add after Stop registered")
	}
	p.Stop() // a second Stop is a no-op
	var nilP *Poller
	if _, ok := nilP.Add(rc, h); ok {
		t.Fatal("a nil poller registered")
	}
	nilP.Stop()
}

// TestHangupPoller: a poller made for Hangup is not told of data, only of
// the peer's close (after data, too) and of a reset.
func TestHangupPoller(t *testing.T) {
	p := NewFor(Hangup)
	if p == nil {
		t.Skip("no epoll set on this system")
	}
	defer p.Stop()
	_, server, rc := pair(t)
	h := make(chanHandler, 4)
	if _, ok := p.Add(rc, h); !ok {
		t.Fatal("Add failed")
	}
	server.Write([]byte("x"))
	expect(t, h, false, "data")
	server.Close()
	expect(t, h, true, "peer closed with data unread")

	_, server2, rc2 := pair(t)
	h2 := make(chanHandler, 4)
	if _, ok := p.Add(rc2, h2); !ok {
		t.Fatal("Add failed")
	}
	server2.(*net.TCPConn).SetLinger(0) // the close resets the connection
	server2.Close()
	expect(t, h2, true, "peer reset")
}
