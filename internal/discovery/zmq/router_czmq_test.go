//go:build czmq

package zmq

// Tests of the -tags czmq backend (libzmq through cgo): what it does
// differently from the guarded go-zeromq one.

import (
	"context"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

func TestCZMQAddressForms(t *testing.T) {
	// A free port for the fixed-port forms.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	free := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()

	type form struct{ address, dial string }
	forms := []form{
		{"127.0.0.1:0", "127.0.0.1"},
		{"tcp://127.0.0.1:0", "127.0.0.1"},
		{"127.0.0.1:*", "127.0.0.1"},
		{"localhost:0", "127.0.0.1"},
		{":0", "127.0.0.1"},
		{"*:0", "127.0.0.1"},
		{"0.0.0.0:0", "127.0.0.1"},
		{net.JoinHostPort("127.0.0.1", strconv.Itoa(free)), "127.0.0.1"},
	}
	if c, err := net.Listen("tcp", "[::1]:0"); err == nil {
		_ = c.Close()
		forms = append(forms, form{"[::1]:0", "::1"}, form{"tcp://[::1]:0", "::1"}, form{":0", "::1"}, form{"0.0.0.0:0", "::1"})
	}
	for i, f := range forms {
		t.Run(f.address, func(t *testing.T) {
			e := startListener(t, func(o *Options) { o.Address = f.address })
			host, port, err := net.SplitHostPort(e.l.Addr())
			if err != nil || port == "0" || port == "*" || port == "" {
				t.Fatalf("Addr %q: no real port (%v)", e.l.Addr(), err)
			}
			if strings.HasSuffix(f.address, strconv.Itoa(free)) && port != strconv.Itoa(free) {
				t.Fatalf("Addr %q, want port %d", e.l.Addr(), free)
			}
			if e.l.Status().Address != e.l.Addr() {
				t.Fatalf("status address %q", e.l.Status().Address)
			}
			t.Logf("%s bound %s (host %q)", f.address, e.l.Addr(), host)
			d := dealer(t, net.JoinHostPort(f.dial, port))
			http := "127.0.0.1:" + strconv.Itoa(8000+i)
			send(t, d, moriMsg(t, "P", http, ModeWrite))
			waitFor(t, 5*time.Second, "registration", func() bool { return e.reg.Get("http://"+http) != nil })
		})
	}
}

// TestCZMQAnswersPing: libzmq answers a ZMTP 3.1 PING itself (with the
// context), and no command reaches the listener.
func TestCZMQAnswersPing(t *testing.T) {
	pingPong(t, startListener(t, nil))
}

// TestCZMQOversizedMessage: ZMQ_MAXMSGSIZE is MaxMessageBytes; libzmq
// closes the sender's connection (uncounted) and the listener goes on.
func TestCZMQOversizedMessage(t *testing.T) {
	e := startListener(t, func(o *Options) { o.MaxMessageBytes = 1024 })
	c := rawPeer(t, e.l.Addr(), dealerReady)
	big := moriMsg(t, "P", "127.0.0.1:8601", ModeRead)
	big = append(big, make([]byte, 1024)...) // trailing bytes: a decode drop if it got through
	if _, err := c.Write(zmtp.AppendFrame(nil, 0, big)); err != nil {
		t.Fatal(err)
	}
	expectClosed(t, c, 2*time.Second)
	d := dealer(t, e.l.Addr())
	send(t, d, moriMsg(t, "P", "127.0.0.1:8602", ModeRead))
	waitFor(t, 5*time.Second, "registration", func() bool { return e.reg.Get("http://127.0.0.1:8602") != nil })
	if e.processed(t) != 1 {
		t.Fatalf("processed %v messages, want only the small one", e.processed(t))
	}
}

// TestCZMQIdentityHandover: an instance that reconnects with its identity
// while its old connection is still open takes over (ZMQ_ROUTER_HANDOVER).
// libzmq detaches the old connection (it is not read any more) but leaves
// it open; TCP keep-alive ends it if its peer is gone.
func TestCZMQIdentityHandover(t *testing.T) {
	e := startListener(t, func(o *Options) { o.Connector = ConnectorP2PNCCL })
	ready := zmtpReady(zmtp.AppendProperty(nil, "Socket-Type", "DEALER"), zmtp.AppendProperty(nil, "Identity", "127.0.0.1:21001"))
	reg := func(http string) []byte {
		return zmtp.AppendFrame(nil, 0, must(t, map[string]any{"type": "P", "http_address": http, "zmq_address": "127.0.0.1:21001"}))
	}
	old := rawPeer(t, e.l.Addr(), ready)
	if _, err := old.Write(reg("127.0.0.1:8610")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "first registration", func() bool { return e.reg.Get("http://127.0.0.1:8610") != nil })
	c := rawPeer(t, e.l.Addr(), ready)
	if _, err := c.Write(reg("127.0.0.1:8611")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "registration by the same identity", func() bool { return e.reg.Get("http://127.0.0.1:8611") != nil })
}

// TestCZMQCloseWithPeersConnected: Close wakes the socket's goroutine at
// once (no receive timeout) while peers are connected and sending, releases
// the port, and leaves no goroutine behind (TestMain's goleak).
func TestCZMQCloseWithPeersConnected(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	l, err := New(Options{Address: "127.0.0.1:0", Registry: reg, Connector: ConnectorMoRIIO})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Run(context.Background()) }()
	idle := rawPeer(t, l.Addr(), dealerReady) // connected, silent
	d := dealer(t, l.Addr())
	send(t, d, moriMsg(t, "P", "127.0.0.1:8620", ModeRead))
	waitFor(t, 5*time.Second, "registration", func() bool { return reg.Get("http://127.0.0.1:8620") != nil })
	t0 := time.Now()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	// No receive timeout to wait out: Close is immediate. The bound is
	// loose so a loaded CI machine cannot fail it; a polling loop or a
	// wait for the peer would take seconds.
	if took := time.Since(t0); took > time.Second {
		t.Fatalf("Close took %v", took)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not return after Close")
	}
	expectClosed(t, idle, time.Second)
	// The port is free as soon as Close returns.
	l2, err := New(Options{Address: l.Addr(), Registry: reg, Connector: ConnectorMoRIIO})
	if err != nil {
		t.Fatalf("port not released by Close: %v", err)
	}
	_ = l2.Close()
	if err := l.Run(context.Background()); err == nil {
		t.Fatal("Run after Close succeeded")
	}
}

// TestCZMQIdleCloseIsImmediate: an idle listener (Run never called, or
// running) closes in well under the 250 ms a receive timeout would cost.
func TestCZMQIdleCloseIsImmediate(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	for _, run := range []bool{false, true} {
		l, err := New(Options{Address: "127.0.0.1:0", Registry: reg, Connector: ConnectorNIXL})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		if run {
			go func() { done <- l.Run(context.Background()) }()
		} else {
			done <- nil
		}
		time.Sleep(300 * time.Millisecond)
		t0 := time.Now()
		_ = l.Close()
		if took := time.Since(t0); took > time.Second { // loose on purpose, as above
			t.Fatalf("run=%v: Close took %v", run, took)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}
