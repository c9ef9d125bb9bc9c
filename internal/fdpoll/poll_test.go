package fdpoll

import (
	"net"
	"runtime"
	"strings"
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

// TestWaitsInRuntimePoller checks that the poller's goroutine waits in Go's
// runtime poller ("IO wait"), not in a blocking epoll_wait ("syscall"),
// which keeps a thread and, for a while, a processor of the program's, and
// that it still delivers many events in a row and stops.
func TestWaitsInRuntimePoller(t *testing.T) {
	p := New()
	if p == nil {
		t.Skip("no epoll")
	}
	defer p.Stop()
	client, server, rc := pair(t)
	h := make(chanHandler, 1)
	if _, ok := p.Add(rc, h); !ok {
		t.Fatal("Add failed")
	}
	buf := make([]byte, 1)
	for i := range 50 { // each event re-armed: the set becomes readable anew each time
		if _, err := server.Write([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		expect(t, h, true, "a byte")
		if _, err := client.Read(buf); err != nil {
			t.Fatal(err)
		}
		if !p.Rearm(rc, h) {
			t.Fatal("Rearm failed")
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		state := pollerState()
		if state == "IO wait" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the poller's goroutine is in state %q, want IO wait", state)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// pollerState returns the state of the goroutine running a Poller's loop,
// as a goroutine dump shows it.
func pollerState() string {
	buf := make([]byte, 1<<20)
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if !strings.Contains(g, "fdpoll.(*Poller).run") {
			continue
		}
		head, _, _ := strings.Cut(g, "\n")
		_, st, _ := strings.Cut(head, "[")
		st, _, _ = strings.Cut(st, "]")
		st, _, _ = strings.Cut(st, ",")
		return st
	}
	return "none"
}
