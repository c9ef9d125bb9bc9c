package sim

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/switchyard-llm/switchyard/internal/freeport"
)

// discovery is a test stand-in for the router's ZMQ discovery ROUTER.
type discovery struct {
	sock zmq4.Socket
	msgs chan [2][]byte
	done chan struct{}
	addr string
}

func listenDiscovery(t *testing.T, ctx context.Context, addr string) *discovery {
	t.Helper()
	s := zmq4.NewRouter(ctx, zmq4.WithLogger(quietZMQLogger))
	if err := s.Listen("tcp://" + addr); err != nil {
		t.Fatalf("listen %s: %v", addr, err)
	}
	d := &discovery{sock: s, msgs: make(chan [2][]byte, 256), done: make(chan struct{}), addr: s.Addr().String()}
	go func() {
		defer close(d.done)
		for {
			m, err := s.Recv()
			if err != nil {
				return
			}
			if m.Type == zmq4.CmdMsg || len(m.Frames) != 2 {
				continue
			}
			select {
			case d.msgs <- [2][]byte{m.Frames[0], m.Frames[1]}:
			default:
			}
		}
	}()
	return d
}

func (d *discovery) close() {
	_ = d.sock.Close()
	<-d.done
}

// next returns the next registration from http_address (others skipped).
func (d *discovery) next(t *testing.T, httpAddr string, timeout time.Duration) (identity []byte, m map[string]any) {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case f := <-d.msgs:
			var v map[string]any
			if err := msgpack.Unmarshal(f[1], &v); err != nil {
				t.Fatalf("registration is not a msgpack map: %v (%x)", err, f[1])
			}
			ha, _ := v["http_address"].(string)
			ra, _ := v["request_address"].(string)
			if ha == httpAddr || ra == "http://"+httpAddr+"/v1/completions" {
				return f[0], v
			}
		case <-deadline:
			t.Fatalf("no registration from %s within %v", httpAddr, timeout)
			return nil, nil
		}
	}
}

func asInt(t *testing.T, v any) int {
	t.Helper()
	switch n := v.(type) {
	case int8:
		return int(n)
	case int16:
		return int(n)
	case int32:
		return int(n)
	case int64:
		return int(n)
	case uint8:
		return int(n)
	case uint16:
		return int(n)
	case uint32:
		return int(n)
	case uint64:
		return int(n)
	}
	t.Fatalf("%v (%T) is not an integer", v, v)
	return 0
}

func TestRegistrationFormats(t *testing.T) {
	ctx := testCtx(t)
	disc := listenDiscovery(t, ctx, "127.0.0.1:0")
	defer disc.close()
	proxy := disc.addr
	hb := []string{"--proxy-address", proxy, "--heartbeat-interval", "100ms"}

	p := startSim(t, append([]string{"--role", "prefill", "--data-parallel-size", "2", "--transfer-mode", "READ"}, hb...)...)
	_, m := disc.next(t, p.httpAddress(), 5*time.Second)
	want := map[string]any{"type": "P", "http_address": p.httpAddress(), "zmq_address": p.zmqAddress(), "transfer_mode": "READ"}
	for k, v := range want {
		if m[k] != v {
			t.Errorf("new format %s = %v, want %v", k, m[k], v)
		}
	}
	if asInt(t, m["dp_size"]) != 2 || asInt(t, m["tp_size"]) != 1 || len(m) != 6 {
		t.Errorf("new format payload %v", m)
	}
	if a, ok := parseMoRIZMQ(m["zmq_address"].(string)); !ok || a.handshake != p.hsBase || a.notify != p.notifyBase {
		t.Errorf("zmq_address %v does not parse as MoRI-IO", m["zmq_address"])
	}

	d := startSim(t, append([]string{"--role", "decode", "--registration-format", "old"}, hb...)...)
	_, m1 := disc.next(t, d.httpAddress(), 5*time.Second)
	_, m2 := disc.next(t, d.httpAddress(), 5*time.Second)
	if m1["type"] != "register" || m1["role"] != "D" || m1["request_address"] != "http://"+d.httpAddress()+"/v1/completions" ||
		asInt(t, m1["handshake_port"]) != d.hsBase || asInt(t, m1["notify_port"]) != d.notifyBase || m1["transfer_mode"] != "WRITE" {
		t.Errorf("old format payload %v", m1)
	}
	i1, _ := strconv.Atoi(m1["index"].(string))
	i2, _ := strconv.Atoi(m2["index"].(string))
	if i2 != i1+1 {
		t.Errorf("old-format index %v then %v, want a counter", m1["index"], m2["index"])
	}

	nc := startSim(t, append([]string{"--role", "decode", "--kv-connector", "p2pnccl"}, hb...)...)
	id, m := disc.next(t, nc.httpAddress(), 5*time.Second)
	if string(id) != nc.zmqAddress() || m["zmq_address"] != nc.zmqAddress() || m["type"] != "D" || len(m) != 3 {
		t.Errorf("p2p registration identity %q payload %v", id, m)
	}

	// Unified workers never register.
	startSim(t, hb...)
}

func TestRegistrationSurvivesRouterRestartAndToggle(t *testing.T) {
	ctx := testCtx(t)
	// Reserve a port for the discovery ROUTER.
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)

	// The worker starts before the router exists.
	p := startSim(t, "--role", "prefill", "--proxy-address", addr, "--heartbeat-interval", "200ms")
	time.Sleep(300 * time.Millisecond)
	disc := listenDiscovery(t, ctx, addr)
	disc.next(t, p.httpAddress(), 5*time.Second)
	disc.close()

	disc = listenDiscovery(t, ctx, addr)
	defer disc.close()
	start := time.Now()
	disc.next(t, p.httpAddress(), 5*time.Second)
	t.Logf("re-registered %v after the router restarted", time.Since(start))

	// Heartbeat off: nothing arrives; on again: it resumes.
	postJSON(t, ctx, p.url("/sim/faults"), map[string]any{"heartbeat": false}, nil)
	time.Sleep(100 * time.Millisecond)
	for len(disc.msgs) > 0 {
		<-disc.msgs
	}
	select {
	case f := <-disc.msgs:
		t.Errorf("registration while heartbeat is off: %x", f[1])
	case <-time.After(500 * time.Millisecond):
	}
	postJSON(t, ctx, p.url("/sim/faults"), map[string]any{"heartbeat": true}, nil)
	disc.next(t, p.httpAddress(), 2*time.Second)
	// The worker counts a registration once its send returned, which can
	// be after the router has it: wait for the count, do not race it.
	waitFor(t, "registrations_sent ≥ 3", func() bool { return statsOf(t, p).RegistrationsSent >= 3 })
}
