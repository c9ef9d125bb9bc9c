package zmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

type lenv struct {
	l   *Listener
	reg *worker.Registry
	m   *metrics.Metrics
	log *logRec
}

// startListener binds on 127.0.0.1:0 and runs the listener until the test
// ends; cleanup waits for Run to return.
func startListener(t *testing.T, mod func(*Options)) *lenv {
	t.Helper()
	e := &lenv{reg: worker.NewRegistry(worker.BreakerConfig{}), m: metrics.NewForTest(), log: &logRec{}}
	o := Options{Address: "127.0.0.1:0", Registry: e.reg, Metrics: e.m, Logger: slog.New(e.log), Connector: ConnectorMoRIIO}
	if mod != nil {
		mod(&o)
	}
	l, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	e.l = l
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Run did not return after cancel")
		}
	})
	return e
}

func (e *lenv) dropped(t *testing.T, reason string) float64 {
	return metricValue(t, e.m.DiscoveryDropped.WithLabelValues(reason))
}

// processed is accepted plus dropped messages.
func (e *lenv) processed(t *testing.T) float64 {
	t.Helper()
	mfs, err := e.m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0.0
	for _, mf := range mfs {
		switch mf.GetName() {
		case "vllm_router_discovery_registrations_total", "vllm_router_discovery_dropped_total":
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// timingBound logs a wall-clock latency claim and fails only when
// SWITCHYARD_TIMING_TESTS=1: on a shared CI runner a scheduling stall is
// not a listener bug. The property itself is the caller's bounded wait.
func timingBound(t *testing.T, what string, took, bound time.Duration) {
	t.Helper()
	t.Logf("%s took %v (bound %v)", what, took, bound)
	if took > bound && os.Getenv("SWITCHYARD_TIMING_TESTS") != "" {
		t.Errorf("%s took %v, want <= %v", what, took, bound)
	}
}

func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(time.Millisecond)
	}
}

func dealer(t *testing.T, addr string, opts ...zmq4.Option) zmq4.Socket {
	t.Helper()
	opts = append([]zmq4.Option{zmq4.WithDialerRetry(10 * time.Millisecond), zmq4.WithTimeout(5 * time.Second)}, opts...)
	d := zmq4.NewDealer(context.Background(), opts...)
	if err := d.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	return d
}

func send(t *testing.T, s zmq4.Socket, frames ...[]byte) {
	t.Helper()
	if err := s.Send(zmq4.NewMsgFrom(frames...)); err != nil {
		t.Fatal(err)
	}
}

func moriMsg(t testing.TB, typ, httpAddr, mode string) []byte {
	return must(t, map[string]any{"type": typ, "http_address": httpAddr, "zmq_address": "host:127.0.0.1,handshake:6301,notify:61005",
		"dp_size": 1, "tp_size": 1, "transfer_mode": mode})
}

func TestNewErrors(t *testing.T) {
	r := worker.NewRegistry(worker.BreakerConfig{})
	for name, o := range map[string]Options{
		"no registry":   {Address: "127.0.0.1:0", Connector: ConnectorMoRIIO},
		"bad connector": {Address: "127.0.0.1:0", Registry: r, Connector: "sglang"},
		"no connector":  {Address: "127.0.0.1:0", Registry: r},
		"bad address":   {Address: "nonsense", Registry: r, Connector: ConnectorNIXL},
		"negative ttl":  {Address: "127.0.0.1:0", Registry: r, Connector: ConnectorNIXL, TTL: -time.Second},
	} {
		if l, err := New(o); err == nil {
			_ = l.Close()
			t.Errorf("%s: no error", name)
		}
	}

	// Bind failure is a startup error.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	_, err = New(Options{Address: busy.Addr().String(), Registry: r, Connector: ConnectorMoRIIO})
	if err == nil || !strings.Contains(err.Error(), "bind") {
		t.Fatalf("bind error = %v", err)
	}

	// Close without Run releases the port; Run after Close fails.
	l, err := New(Options{Address: "tcp://127.0.0.1:0", Registry: r, Connector: ConnectorMoRIIO})
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr()
	if strings.HasSuffix(addr, ":0") {
		t.Fatalf("Addr %q has no real port", addr)
	}
	_ = l.Close()
	_ = l.Close()
	if err := l.Run(context.Background()); err == nil {
		t.Fatal("Run after Close succeeded")
	}
	l2, err := New(Options{Address: addr, Registry: r, Connector: ConnectorMoRIIO})
	if err != nil {
		t.Fatalf("port not released by Close: %v", err)
	}
	_ = l2.Close()
}

func TestListenerRegistersWithin100ms(t *testing.T) {
	e := startListener(t, nil)
	added := make(chan time.Time, 4)
	e.reg.Subscribe(func(c worker.Change) {
		if len(c.Added) > 0 {
			added <- time.Now()
		}
	})
	d := dealer(t, e.l.Addr())
	start := time.Now()
	send(t, d, moriMsg(t, "P", "127.0.0.1:8100", ModeWrite))
	select {
	case at := <-added:
		timingBound(t, "registration after the send", at.Sub(start), 100*time.Millisecond)
	case <-time.After(10 * time.Second):
		t.Fatal("not registered")
	}
	w := e.reg.Get("http://127.0.0.1:8100")
	if w == nil || !w.Routable() || w.Role != worker.RolePrefill || e.l.FleetMode() != ModeWrite {
		t.Fatalf("worker %+v mode %q", w, e.l.FleetMode())
	}
	// The registry announces the worker from inside the registration, before
	// discovery publishes its own status snapshot: wait for that snapshot.
	st := e.l.Status()
	for deadline := time.Now().Add(time.Second); len(st.Instances) == 0 && time.Now().Before(deadline); st = e.l.Status() {
		time.Sleep(time.Millisecond)
	}
	if st.FleetMode != ModeWrite || len(st.Instances) != 1 || st.Instances[0].HTTPAddress != "127.0.0.1:8100" ||
		st.Instances[0].Held || st.Instances[0].LastSeen.IsZero() || st.TTLSeconds != 9 {
		t.Fatalf("status %+v", st)
	}
	if _, err := json.Marshal(st); err != nil {
		t.Fatal(err)
	}
}

func TestListenerDropsAndSurvives(t *testing.T) {
	e := startListener(t, nil)
	d := dealer(t, e.l.Addr())
	send(t, d, []byte("garbage"))                                            // decode
	send(t, d, must(t, []int{1, 2}))                                         // not_map
	send(t, d, moriMsg(t, "P", "127.0.0.1:8100", ModeWrite), []byte("more")) // frames: 3 at the ROUTER
	send(t, d, must(t, map[string]any{"type": "HELLO"}))                     // hello
	send(t, d, must(t, map[string]any{"type": "P", "http_address": "127.0.0.1:8101", "zmq_address": "127.0.0.1:9"}))
	send(t, d, moriMsg(t, "D", "127.0.0.1:8102", "FAST")) // unknown_transfer_mode
	send(t, d, make([]byte, 0))                           // decode (empty)
	send(t, d, moriMsg(t, "D", "127.0.0.1:8200", ModeWrite))
	waitFor(t, 5*time.Second, "the valid registration", func() bool { return e.reg.Get("http://127.0.0.1:8200") != nil })
	for reason, want := range map[string]float64{
		ReasonDecode: 2, ReasonNotMap: 1, ReasonFrames: 1, ReasonHello: 1, ReasonMissingKey: 1, ReasonUnknownTransferMode: 1,
	} {
		if got := e.dropped(t, reason); got != want {
			t.Errorf("dropped{%s} = %v, want %v", reason, got, want)
		}
	}
	if n := len(e.reg.Snapshot().All); n != 1 {
		t.Fatalf("%d workers", n)
	}
	if e.log.count("WARN", "message dropped") != 5 { // once per reason, never for hello
		t.Fatalf("warn lines %q", e.log.lines)
	}
}

func TestHandleSyntheticMessages(t *testing.T) {
	e := startListener(t, nil)
	e.l.handle([][]byte{[]byte("id")}, false)
	e.l.handle([][]byte{[]byte("id"), []byte("a"), []byte("b")}, false)
	e.l.handle([][]byte{[]byte("id"), []byte("\x04PING\x00\x00")}, true)
	e.l.handle([][]byte{[]byte("id"), make([]byte, DefaultMaxMessageBytes+1)}, false)
	if e.dropped(t, ReasonFrames) != 2 || e.dropped(t, ReasonCommand) != 1 || e.dropped(t, ReasonOversized) != 1 {
		t.Fatal("synthetic drops not counted")
	}
}

func TestListenerConnectorChecks(t *testing.T) {
	p2p := must(t, map[string]any{"type": "D", "http_address": "127.0.0.1:8300", "zmq_address": "127.0.0.1:21001"})
	t.Run("moriio needs transfer_mode", func(t *testing.T) {
		e := startListener(t, nil)
		e.l.handle([][]byte{[]byte("id"), p2p}, false)
		if e.dropped(t, ReasonMissingKey) != 1 || len(e.reg.Snapshot().All) != 0 {
			t.Fatal("p2pnccl registration accepted by the moriio listener")
		}
	})
	t.Run("p2pnccl needs ip:port zmq_address", func(t *testing.T) {
		e := startListener(t, func(o *Options) { o.Connector = ConnectorP2PNCCL })
		e.l.handle([][]byte{[]byte("id"), moriMsg(t, "D", "127.0.0.1:8301", ModeRead)}, false)
		e.l.handle([][]byte{[]byte("127.0.0.1:21001"), p2p}, false)
		if e.dropped(t, ReasonConnector) != 1 || e.reg.Get("http://127.0.0.1:8300") == nil || e.l.FleetMode() != "" {
			t.Fatal("connector checks wrong for p2pnccl")
		}
	})
}

func TestListenerTTLPrecision(t *testing.T) {
	const ttl = 500 * time.Millisecond
	e := startListener(t, func(o *Options) { o.TTL = ttl })
	type removal struct{ at, lastSeen time.Time }
	removed := make(chan removal, 1)
	e.reg.Subscribe(func(c worker.Change) {
		if len(c.Removed) > 0 {
			removed <- removal{time.Now(), c.Removed[0].LastSeen()}
		}
	})
	d := dealer(t, e.l.Addr())
	// Register, heartbeat well within the TTL, then go silent.
	for range 4 {
		send(t, d, moriMsg(t, "P", "127.0.0.1:8400", ModeRead))
		time.Sleep(ttl / 5)
	}
	select {
	case r := <-removed:
		silent := r.at.Sub(r.lastSeen)
		t.Logf("removed %v after the last heartbeat (TTL %v)", silent, ttl)
		if silent < ttl || silent > ttl+100*time.Millisecond {
			t.Fatalf("removed after %v, want %v (+100ms)", silent, ttl)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("not expired")
	}
	if a := metricValue(t, e.m.DiscoveryAdded); a != 1 {
		t.Fatalf("added %v: expired while heartbeating", a)
	}
	// The registry callback runs mid-expiry; the mode resets right after.
	waitFor(t, 5*time.Second, "mode reset", func() bool { return e.l.FleetMode() == "" })
}

func TestListenerOldFormatIndexIsNotAChange(t *testing.T) {
	e := startListener(t, nil)
	d := dealer(t, e.l.Addr())
	for i := range 5 {
		send(t, d, must(t, map[string]any{"type": "register", "role": "D", "index": fmt.Sprint(i),
			"request_address": "http://127.0.0.1:8500/v1/completions", "handshake_port": 6301, "notify_port": 61005,
			"dp_size": 2, "tp_size": 1, "transfer_mode": "READ"}))
	}
	waitFor(t, 5*time.Second, "five registrations", func() bool { return e.processed(t) == 5 })
	if n := metricValue(t, e.m.DiscoveryAdded); n != 1 {
		t.Fatalf("added %v, want 1 (index must not cause replacement)", n)
	}
	if ws := e.reg.Snapshot().Decode; len(ws) != 2 || ws[1].DPRank != 1 || ws[0].ZMQAddress != "host:127.0.0.1,handshake:6301,notify:61005" {
		t.Fatalf("workers %+v", ws)
	}
}

// TestListenerFlood sends 100k registrations (100 instances, plus garbage)
// from four connections at once.
func TestListenerFlood(t *testing.T) {
	if testing.Short() {
		t.Skip("flood")
	}
	e := startListener(t, nil)
	const senders, perSender, instances = 4, 25_000, 100
	payloads := make([][]byte, instances)
	for i := range payloads {
		role := "P"
		if i%2 == 1 {
			role = "D"
		}
		payloads[i] = moriMsg(t, role, fmt.Sprintf("127.0.0.1:%d", 10000+i), ModeWrite)
	}
	start := time.Now()
	var wg sync.WaitGroup
	var sendErr atomic.Value
	for s := range senders {
		d := dealer(t, e.l.Addr())
		wg.Go(func() {
			for i := range perSender {
				p := payloads[(s*perSender+i)%instances]
				if i%1000 == 999 {
					p = []byte("\xc1garbage")
				}
				if err := d.Send(zmq4.NewMsg(p)); err != nil {
					sendErr.Store(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err := sendErr.Load(); err != nil {
		t.Fatal(err)
	}
	const total = senders * perSender
	waitFor(t, 30*time.Second, "every message processed", func() bool { return e.processed(t) >= total })
	elapsed := time.Since(start)
	t.Logf("%d messages in %v (%.0f msg/s)", total, elapsed, total/elapsed.Seconds())
	if n := len(e.reg.Snapshot().All); n != instances {
		t.Fatalf("%d workers, want %d", n, instances)
	}
	if got, want := e.dropped(t, ReasonDecode), float64(senders*perSender/1000); got != want {
		t.Fatalf("dropped{decode} %v, want %v", got, want)
	}
	if n := metricValue(t, e.m.DiscoveryAdded); n != instances {
		t.Fatalf("added %v", n)
	}
	if e.log.count("INFO", "instance registered") != instances {
		t.Fatal("arrivals not logged exactly once each")
	}
	// Still alive and fast.
	d := dealer(t, e.l.Addr())
	t0 := time.Now()
	send(t, d, moriMsg(t, "D", "127.0.0.1:9999", ModeWrite))
	waitFor(t, 5*time.Second, "post-flood registration", func() bool { return e.reg.Get("http://127.0.0.1:9999") != nil })
	timingBound(t, "post-flood registration", time.Since(t0), 100*time.Millisecond)
}

// TestListenerCloseDuringFlood stops the listener while senders keep the
// socket's internal queue full; goleak (TestMain) checks that no go-zeromq
// reader goroutine is left blocked on it.
func TestListenerCloseDuringFlood(t *testing.T) {
	reg := worker.NewRegistry(worker.BreakerConfig{})
	l, err := New(Options{Address: "127.0.0.1:0", Registry: reg, Connector: ConnectorMoRIIO})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 6 {
		d := zmq4.NewDealer(context.Background(), zmq4.WithTimeout(time.Second))
		if err := d.Dial("tcp://" + l.Addr()); err != nil {
			t.Fatal(err)
		}
		p := moriMsg(t, "P", fmt.Sprintf("127.0.0.1:%d", 11000+i), ModeWrite)
		wg.Go(func() {
			defer d.Close()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if d.Send(zmq4.NewMsg(p)) != nil {
					return
				}
			}
		})
	}
	waitFor(t, 2*time.Second, "registrations", func() bool { return len(reg.Snapshot().All) == 6 })
	t0 := time.Now()
	cancel()
	select {
	case <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Run did not return")
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("shutdown took %v", d)
	}
	close(stop)
	wg.Wait()
}

// --- raw ZMTP peers, for what no well-behaved client sends ---

func zmtpGreeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xFF, 0x7F, 3, 1
	copy(g[12:], "NULL")
	return g
}

func zmtpReady(props ...[]byte) []byte {
	b := append([]byte{5}, "READY"...)
	for _, p := range props {
		b = append(b, p...)
	}
	return zmtp.AppendFrame(nil, zmtp.FlagCommand, b)
}

// rawPeer connects and exchanges greetings; it returns the conn after the
// server's greeting and READY have been read (when handshake is given).
func rawPeer(t *testing.T, addr string, ready []byte) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write(zmtpGreeting()); err != nil {
		t.Fatal(err)
	}
	greet := make([]byte, 64)
	if _, err := io.ReadFull(c, greet); err != nil {
		t.Fatal(err)
	}
	if ready == nil {
		return c
	}
	if _, err := c.Write(ready); err != nil {
		t.Fatal(err)
	}
	readFrame(t, c) // the server's READY
	return c
}

func readFrame(t *testing.T, c net.Conn) (byte, []byte) {
	t.Helper()
	h := make([]byte, 2)
	if _, err := io.ReadFull(c, h); err != nil {
		t.Fatalf("read frame: %v", err)
	}
	if h[0]&zmtp.FlagLong != 0 {
		t.Fatal("long frame from server")
	}
	body := make([]byte, h[1])
	if _, err := io.ReadFull(c, body); err != nil {
		t.Fatal(err)
	}
	return h[0], body
}

// expectClosed asserts the server closes c.
func expectClosed(t *testing.T, c net.Conn, within time.Duration) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	_, err := io.Copy(io.Discard, c) // nil at EOF; a reset is also a close
	if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
		t.Fatalf("connection not closed by the server within %v", within)
	}
}

var dealerReady = zmtpReady(zmtp.AppendProperty(nil, "Socket-Type", "DEALER"), zmtp.AppendProperty(nil, "Identity", ""))

func TestCloseStopsRun(t *testing.T) {
	l, err := New(Options{Address: "127.0.0.1:0", Registry: worker.NewRegistry(worker.BreakerConfig{}), Connector: ConnectorNIXL})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- l.Run(context.Background()) }()
	time.Sleep(10 * time.Millisecond)
	_ = l.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not return after Close")
	}
	if err := l.Run(context.Background()); err == nil {
		t.Fatal("second Run succeeded")
	}
}

func TestListenerStatusShowsHeld(t *testing.T) {
	e := startListener(t, nil)
	e.l.handle([][]byte{[]byte("a"), moriMsg(t, "P", "127.0.0.1:9101", ModeRead)}, false)
	e.l.handle([][]byte{[]byte("b"), moriMsg(t, "D", "127.0.0.1:9102", ModeWrite)}, false)
	st := e.l.Status()
	if st.FleetMode != ModeRead || len(st.Instances) != 2 {
		t.Fatalf("status %+v", st)
	}
	d := st.Instances[1]
	if d.Role != "decode" || !d.Held || d.Note != "held: transfer_mode WRITE differs from fleet READ" || d.TransferMode != ModeWrite {
		t.Fatalf("decode status %+v", d)
	}
	b, err := json.Marshal(st)
	if err != nil || !strings.Contains(string(b), `"held":true`) || !strings.Contains(string(b), `"fleet_transfer_mode":"READ"`) {
		t.Fatalf("json %s %v", b, err)
	}
	if w := e.reg.Get("http://127.0.0.1:9102"); w == nil || w.Available() {
		t.Fatal("held decode is available to policies")
	}
}

// pingPong sends a ZMTP 3.1 PING on a raw peer connection: the router (the
// guard, or libzmq itself) must answer PONG with the context, the stream
// must stay in sync (a registration right after is accepted) and no
// command may be counted as a dropped message. It returns the connection.
func pingPong(t *testing.T, e *lenv) net.Conn {
	t.Helper()
	c := rawPeer(t, e.l.Addr(), dealerReady)
	ping := append([]byte{4}, "PING"...)
	ping = append(ping, 0, 10) // TTL
	ping = append(ping, "ctx-123"...)
	if _, err := c.Write(zmtp.AppendFrame(nil, zmtp.FlagCommand, ping)); err != nil {
		t.Fatal(err)
	}
	flags, body := readFrame(t, c)
	if flags != zmtp.FlagCommand || string(body) != "\x04PONGctx-123" {
		t.Fatalf("got %x %q, want PONG with the context", flags, body)
	}
	if _, err := c.Write(zmtp.AppendFrame(nil, 0, moriMsg(t, "P", "127.0.0.1:8600", ModeRead))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "registration after PING", func() bool { return e.reg.Get("http://127.0.0.1:8600") != nil })
	if e.dropped(t, ReasonCommand) != 0 {
		t.Fatal("an answered PING was counted as a dropped message")
	}
	return c
}

// TestListenerModel: with Options.Model (--enable-igw) a registration
// whose model is not known yet is dropped (model_pending) and the next
// heartbeat registers the instance's Workers with that model; a model
// change is a replacement.
func TestListenerModel(t *testing.T) {
	var mu sync.Mutex
	models := map[string]string{}
	e := startListener(t, func(o *Options) {
		o.Model = func(addr string) (string, bool) {
			mu.Lock()
			defer mu.Unlock()
			m, ok := models[addr]
			return m, ok
		}
	})
	msg := moriMsg(t, "P", "127.0.0.1:8400", ModeWrite)
	e.l.handle([][]byte{[]byte("id"), msg}, false)
	if e.dropped(t, ReasonModelPending) != 1 || len(e.reg.Snapshot().All) != 0 {
		t.Fatal("a registration with an unknown model was not held back")
	}
	mu.Lock()
	models["127.0.0.1:8400"] = "big"
	mu.Unlock()
	e.l.handle([][]byte{[]byte("id"), msg}, false)
	w := e.reg.Get("http://127.0.0.1:8400")
	if w == nil || w.ModelID != "big" || w.Role != worker.RolePrefill {
		t.Fatalf("worker after the model became known: %+v", w)
	}
	e.l.handle([][]byte{[]byte("id"), msg}, false) // a heartbeat keeps the Worker
	if e.reg.Get("http://127.0.0.1:8400") != w {
		t.Fatal("a heartbeat replaced the worker")
	}
	mu.Lock()
	models["127.0.0.1:8400"] = "small"
	mu.Unlock()
	e.l.handle([][]byte{[]byte("id"), msg}, false)
	if w2 := e.reg.Get("http://127.0.0.1:8400"); w2 == nil || w2 == w || w2.ModelID != "small" {
		t.Fatalf("model change not applied: %+v", w2)
	}
}
