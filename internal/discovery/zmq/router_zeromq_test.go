//go:build !czmq

package zmq

// Tests of the default backend's guarded go-zeromq transport and of bare
// go-zeromq (Options.rawTCP); the czmq build has neither.

import (
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

func TestGuardPingPong(t *testing.T) {
	e := startListener(t, nil)
	c := pingPong(t, e)
	// Other commands are passed up and dropped by the listener.
	if _, err := c.Write(zmtp.AppendFrame(nil, zmtp.FlagCommand, append([]byte{5}, "HELLO"...))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "command drop", func() bool { return e.dropped(t, ReasonCommand) == 1 })
}

func TestGuardRejectsHostilePeers(t *testing.T) {
	e := startListener(t, func(o *Options) { o.HandshakeTimeout = 300 * time.Millisecond })
	addr := e.l.Addr()
	cases := []struct {
		name   string
		ready  []byte
		then   []byte
		reason string
	}{
		// Each of these crashes or wedges bare go-zeromq v0.17.0.
		{"unknown socket type", zmtpReady(zmtp.AppendProperty(nil, "Socket-Type", "FOO")), nil, ReasonHandshake},
		{"no socket type", zmtpReady(zmtp.AppendProperty(nil, "Identity", "x")), nil, ReasonHandshake},
		{"truncated property", zmtp.AppendFrame(nil, zmtp.FlagCommand, append(append([]byte{5}, "READY"...), 1)), nil, ReasonHandshake},
		{"incompatible socket type", zmtpReady(zmtp.AppendProperty(nil, "Socket-Type", "PUB")), nil, ReasonHandshake},
		{"data before READY", zmtp.AppendFrame(nil, 0, []byte("hi")), nil, ReasonHandshake},
		{"huge frame header", dealerReady, func() []byte {
			h := make([]byte, 9)
			h[0] = zmtp.FlagLong
			binary.BigEndian.PutUint64(h[1:], 1<<62)
			return h
		}(), ReasonOversized},
		{"oversized message", dealerReady, zmtp.AppendFrame(nil, 0, make([]byte, DefaultMaxMessageBytes+1)), ReasonOversized},
		{"too many frames", dealerReady, func() []byte {
			var b []byte
			for range maxFramesPerMsg + 1 {
				b = append(b, zmtp.AppendFrame(nil, zmtp.FlagMore, []byte("x"))...)
			}
			return b
		}(), ReasonFrames},
		{"bad flags", dealerReady, []byte{0x80, 0}, ReasonDecode},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := e.dropped(t, tc.reason)
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(3 * time.Second))
			_, _ = c.Write(zmtpGreeting())
			_, _ = io.ReadFull(c, make([]byte, 64))
			_, _ = c.Write(tc.ready)
			_, _ = c.Write(tc.then)
			expectClosed(t, c, 2*time.Second)
			waitFor(t, 5*time.Second, "drop counted", func() bool { return e.dropped(t, tc.reason) == before+1 })
		})
	}
	// The listener survived all of it.
	d := dealer(t, addr)
	send(t, d, moriMsg(t, "D", "127.0.0.1:8700", ModeRead))
	waitFor(t, 5*time.Second, "registration", func() bool { return e.reg.Get("http://127.0.0.1:8700") != nil })
}

func TestGuardSilentPeerDoesNotBlockAccept(t *testing.T) {
	const handshake = 500 * time.Millisecond
	e := startListener(t, func(o *Options) { o.HandshakeTimeout = handshake })
	t0 := time.Now()
	var silent []net.Conn
	for range 3 { // silent TCP clients: scanners, half-open connections
		c, err := net.Dial("tcp", e.l.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		silent = append(silent, c)
	}
	time.Sleep(20 * time.Millisecond) // let them be accepted
	t1 := time.Now()
	d := dealer(t, e.l.Addr()) // the ZMTP handshake happens in Dial
	send(t, d, moriMsg(t, "D", "127.0.0.1:8800", ModeRead))
	waitFor(t, 5*time.Second, "registration past silent peers", func() bool { return e.reg.Get("http://127.0.0.1:8800") != nil })
	timingBound(t, "dial+registration with silent peers connected", time.Since(t1), 100*time.Millisecond)
	// The silent peers are cut off at the handshake deadline.
	for _, c := range silent {
		expectClosed(t, c, 2*time.Second)
	}
	waited := time.Since(t0)
	if waited < handshake {
		t.Fatalf("silent peers closed after %v, before the %v handshake deadline", waited, handshake)
	}
	timingBound(t, "closing the silent peers", waited, handshake+time.Second)
	waitFor(t, 5*time.Second, "handshake drops", func() bool { return e.dropped(t, ReasonHandshake) == 3 })
}

func TestGuardMaxConnections(t *testing.T) {
	e := startListener(t, func(o *Options) { o.MaxConnections = 2 })
	rawPeer(t, e.l.Addr(), dealerReady)
	rawPeer(t, e.l.Addr(), dealerReady)
	c, err := net.Dial("tcp", e.l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	expectClosed(t, c, 2*time.Second)
	waitFor(t, 5*time.Second, "drop counted", func() bool { return e.dropped(t, ReasonConnections) == 1 })
}

// TestRawGoZeroMQCommandFrames documents bare go-zeromq: a PING reaches
// Recv as a CmdMsg (and is never answered); the listener drops it.
func TestRawGoZeroMQCommandFrames(t *testing.T) {
	e := startListener(t, func(o *Options) { o.rawTCP = true })
	c := rawPeer(t, e.l.Addr(), dealerReady)
	ping := append(append([]byte{4}, "PING"...), 0, 10)
	if _, err := c.Write(zmtp.AppendFrame(nil, zmtp.FlagCommand, ping)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(zmtp.AppendFrame(nil, 0, moriMsg(t, "P", "127.0.0.1:8900", ModeRead))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "registration", func() bool { return e.reg.Get("http://127.0.0.1:8900") != nil })
	if e.dropped(t, ReasonCommand) != 1 {
		t.Fatal("PING not dropped as a command")
	}
	_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _ := c.Read(make([]byte, 16)); n != 0 {
		t.Fatal("bare go-zeromq answered a PING")
	}
}

// TestInteropBareGoZeroMQHeartbeats measures what bare go-zeromq v0.17.0 (no
// guard) does with libzmq peers that enable ZMTP heartbeats, for the record:
// it never answers PINGs, so each peer drops and re-establishes its
// connection every HEARTBEAT_TIMEOUT, and the PINGs surface as command
// messages. The registry stays stable because re-registrations after a
// reconnect are identical heartbeats.
func TestInteropBareGoZeroMQHeartbeats(t *testing.T) {
	needPython(t)
	e := startListener(t, func(o *Options) { o.rawTCP = true })
	added := addedAt(e.reg)
	clients := []pyClient{
		{"heartbeats, no identity", append(append([]string{"--format", "moriio-new", "--identity", "none"}, heartbeats...), "--count", pyCount, "--interval", pyIvl), "127.0.0.1:7201"},
		{"heartbeats, identity", append(append([]string{"--format", "moriio-new", "--identity", "zmq", "--role", "D"}, heartbeats...), "--count", pyCount, "--interval", pyIvl), "127.0.0.1:7202"},
	}
	res := runClients(t, e.l.Addr(), clients)
	time.Sleep(50 * time.Millisecond)
	for i, c := range clients {
		r := res[i]
		_, ok := added(c.http)
		t.Logf("bare go-zeromq, %s: sent %d, connects %d, disconnects %d, registered %v",
			c.name, r.Sent, r.Connects, r.Disconnects, ok)
		if !ok || len(e.reg.Instance(c.http)) != 1 {
			t.Errorf("%s: not registered", c.name)
		}
	}
	accepted := metricValue(t, e.m.DiscoveryRegistrations.WithLabelValues("prefill", FormatMoRIIONew)) +
		metricValue(t, e.m.DiscoveryRegistrations.WithLabelValues("decode", FormatMoRIIONew))
	t.Logf("bare go-zeromq: %v of %d registrations delivered, %v PING command frames dropped, %v instances added",
		accepted, res[0].Sent+res[1].Sent, e.dropped(t, ReasonCommand), metricValue(t, e.m.DiscoveryAdded))
	if a := metricValue(t, e.m.DiscoveryAdded); a != 2 {
		t.Errorf("added %v: registry churned", a)
	}
}
