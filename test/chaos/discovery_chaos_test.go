package chaos

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// TestDiscoveryFlood: while 256 clients are served, a DEALER floods the
// router's ZMQ discovery port with a mix of garbage, malformed
// registrations, identical re-registrations of the live workers and
// registrations of bogus READ-mode instances (held aside, since the live
// fleet is WRITE). The listener drops what is invalid, keeps the live
// workers untouched, and serving goes on without a single failure.
func TestDiscoveryFlood(t *testing.T) { discoveryFlood(t, false) }

// TestDiscoveryFloodLengthBombs is the same flood where the garbage is
// fully random bytes, so some messages are msgpack str/bin/ext headers that
// declare lengths far beyond the payload (e.g. the 5 bytes db ff ff ff ff,
// a "4 GiB string").
func TestDiscoveryFloodLengthBombs(t *testing.T) { discoveryFlood(t, true) }

func discoveryFlood(t *testing.T, bombs bool) {
	s := scaleFor()
	nMsgs := 100_000
	if s.long {
		nMsgs = 1_000_000
	}
	f := startPDFleet(t, 2, 2, nil)
	f.r.markBaseline(t)
	before := f.r.scrape(t)
	live := registrationsOf(t, f)

	l := startLoad(loadConfig{base: f.r.Base, conc: s.conc, dur: s.dur, deadline: s.deadline})
	time.Sleep(s.at(0.1))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	sock := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("chaos-flood")), zmq4.WithDialerMaxRetries(3))
	if err := sock.Dial("tcp://" + f.r.zmqAddr); err != nil {
		t.Fatalf("flood dial: %v", err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	perKind := map[string]int{}
	floodStart := time.Now()
	sent := 0
	for i := 0; i < nMsgs && ctx.Err() == nil; i++ {
		kind, frames := floodMessage(rng, i, live, bombs)
		perKind[kind]++
		var err error
		if len(frames) == 1 {
			err = sock.Send(zmq4.NewMsg(frames[0]))
		} else {
			err = sock.SendMulti(zmq4.NewMsgFrom(frames...))
		}
		if err != nil {
			t.Fatalf("flood send %d (%s): %v", i, kind, err)
		}
		sent++
		if i%1000 == 999 {
			if mb := f.r.rssMB(); mb > maxRouterRSSMB {
				f.r.Kill() // protect the shared machine
				t.Fatalf("router RSS %d MiB after %d discovery messages (limit %d MiB)", mb, i+1, maxRouterRSSMB)
			}
		}
	}
	floodTook := time.Since(floodStart)
	t.Logf("flood: %d messages in %v (%.0f/s): %v", sent, floodTook.Round(time.Millisecond), float64(sent)/floodTook.Seconds(), perKind)
	// the listener must have taken in (nearly) everything before we judge
	var after string
	waitFor(t, 30*time.Second, "the listener to process the flood", func() bool {
		if mb := f.r.rssMB(); mb > maxRouterRSSMB {
			f.r.Kill()
			t.Fatalf("router RSS %d MiB after the flood (limit %d MiB)", mb, maxRouterRSSMB)
		}
		after = f.r.scrape(t)
		return seen(after)-seen(before) >= 0.99*float64(sent)
	})
	t.Logf("router RSS after the flood: %d MiB", f.r.rssMB())
	_ = sock.Close()
	res := l.wait()
	f.r.alive(t)

	c := res.checkEnded(t)
	res.checkServedThroughout(t)
	res.checkSuccessRate(t, "whole run", time.Time{}, time.Time{}, 1)
	t.Logf("discovery: %.0f accepted, %.0f dropped (%s)", metricSum(after, "vllm_router_discovery_registrations_total")-metricSum(before, "vllm_router_discovery_registrations_total"),
		metricSum(after, "vllm_router_discovery_dropped_total")-metricSum(before, "vllm_router_discovery_dropped_total"), droppedByReason(after))
	// the live fleet is intact: same workers, none replaced or held
	ws := f.r.workers(t)
	for _, w := range append(append([]*sim{}, f.p...), f.d...) {
		if !ws.has(w.URL()) {
			t.Errorf("live worker %s lost from the registry after the flood", w.URL())
		}
	}
	for _, w := range ws.Workers {
		if strings.HasPrefix(w.URL, "http://127.0.0.1:") && w.Routable && !isFleet(f, w.URL) {
			t.Errorf("a bogus registration became routable: %s", w.URL)
		}
	}
	figures(t, fmt.Sprintf("%d discovery messages (%v)", sent, perKind), c)
	// bogus instances expire after the TTL; then resources return to baseline
	waitFor(t, 10*time.Second, "bogus instances to expire", func() bool { return len(f.r.workers(t).Workers) == 4 })
	f.r.checkNoLeak(t, 15*time.Second)
}

func isFleet(f *pdFleet, url string) bool {
	for _, w := range append(append([]*sim{}, f.p...), f.d...) {
		if w.URL() == url {
			return true
		}
	}
	return false
}

// seen is the number of discovery messages the listener has judged.
func seen(metrics string) float64 {
	return metricSum(metrics, "vllm_router_discovery_registrations_total") + metricSum(metrics, "vllm_router_discovery_dropped_total")
}

func droppedByReason(metrics string) string {
	var out []string
	for _, line := range strings.Split(metrics, "\n") {
		if strings.HasPrefix(line, "vllm_router_discovery_dropped_total{") {
			out = append(out, strings.TrimPrefix(line, "vllm_router_discovery_dropped_total"))
		}
	}
	return strings.Join(out, " ")
}

// registration is the current MoRI-IO heartbeat, as vLLM sends it.
type registration struct {
	Type         string `msgpack:"type"`
	HTTPAddress  string `msgpack:"http_address"`
	ZMQAddress   string `msgpack:"zmq_address"`
	DPSize       int    `msgpack:"dp_size"`
	TPSize       int    `msgpack:"tp_size"`
	TransferMode string `msgpack:"transfer_mode"`
}

// registrationsOf rebuilds the live workers' heartbeats from /workers, so
// the flood can repeat them byte-identically (a pure refresh).
func registrationsOf(t *testing.T, f *pdFleet) [][]byte {
	t.Helper()
	var ws struct {
		Workers []struct {
			URL          string `json:"url"`
			WorkerType   string `json:"worker_type"`
			ZMQAddress   string `json:"zmq_address"`
			DPSize       int    `json:"dp_size"`
			TPSize       int    `json:"tp_size"`
			TransferMode string `json:"transfer_mode"`
		} `json:"workers"`
	}
	getJSON(t, f.r.Base+"/workers", &ws)
	var out [][]byte
	for _, w := range ws.Workers {
		typ := "P"
		if w.WorkerType == "decode" {
			typ = "D"
		}
		out = append(out, encode(registration{Type: typ, HTTPAddress: strings.TrimPrefix(w.URL, "http://"), ZMQAddress: w.ZMQAddress,
			DPSize: max(w.DPSize, 1), TPSize: max(w.TPSize, 1), TransferMode: w.TransferMode}))
	}
	if len(out) != 4 {
		t.Fatalf("expected 4 live registrations, got %d", len(out))
	}
	return out
}

func encode(v any) []byte {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(v); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// maxRouterRSSMB bounds the router's memory during a flood; past it the
// router is killed so a runaway cannot starve the shared machine.
const maxRouterRSSMB = 512

// floodMessage returns the i-th flood message and its kind. Without bombs,
// garbage starts with a positive fixint byte, so it never declares a length.
func floodMessage(rng *rand.Rand, i int, live [][]byte, bombs bool) (string, [][]byte) {
	one := func(b []byte) [][]byte { return [][]byte{b} }
	switch i % 10 {
	case 0, 1:
		b := make([]byte, 1+rng.IntN(200))
		for j := range b {
			b[j] = byte(rng.UintN(256))
		}
		if !bombs {
			b[0] &= 0x7f
			return "garbage", one(b)
		}
		if i%100 == 0 {
			return "length_bomb", one([]byte{0xdb, 0xff, 0xff, 0xff, 0xff})
		}
		return "random_bytes", one(b)
	case 2:
		return "not_map", one(encode([]any{"P", "127.0.0.1:1", i}))
	case 3:
		return "missing_key", one(encode(map[string]any{"type": "D", "zmq_address": "host:127.0.0.1,handshake:1,notify:2"}))
	case 4:
		return "bad_type", one(encode(map[string]any{"type": 7, "http_address": []int{1, 2}, "zmq_address": 3.5}))
	case 5:
		return "hello", one(encode(map[string]any{"type": "HELLO"}))
	case 6:
		return "bad_value", one(encode(registration{Type: "P", HTTPAddress: "not an address", ZMQAddress: "host:127.0.0.1,handshake:1,notify:2",
			DPSize: 1, TPSize: 1, TransferMode: "SIDEWAYS"}))
	case 7:
		// a bogus READ instance: registered but held aside (the fleet is WRITE)
		port := 20000 + i%500
		return "bogus_read_instance", one(encode(registration{Type: "D", HTTPAddress: fmt.Sprintf("127.0.0.3:%d", port),
			ZMQAddress: fmt.Sprintf("host:127.0.0.3,handshake:%d,notify:%d", port, port+1000), DPSize: 1, TPSize: 1, TransferMode: "READ"}))
	case 8:
		return "multi_frame", [][]byte{[]byte("a"), encode(map[string]any{"type": "P"}), []byte("c")}
	}
	return "live_refresh", one(live[i%len(live)])
}
