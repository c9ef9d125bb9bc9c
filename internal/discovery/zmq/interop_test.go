package zmq

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// The interop tests drive real libzmq DEALERs (Debian python3-zmq) that
// register exactly as vLLM does; see testdata/register.py.

const python = "/usr/bin/python3"

func needPython(t *testing.T) {
	t.Helper()
	if out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput(); err != nil {
		t.Skipf("skipping libzmq interop: %s -c 'import zmq, msgpack' failed (%v: %s); "+
			"install with: apt-get install -y python3-zmq python3-msgpack", python, err, strings.TrimSpace(string(out)))
	}
}

type pyClient struct {
	name string
	args []string // register.py arguments besides --endpoint
	http string   // --http-address
}

type pyResult struct {
	first       time.Time // when the client's first send returned
	Sent        int       `json:"sent"`
	Connects    int       `json:"connects"`
	Disconnects int       `json:"disconnects"`
	err         error
}

// startPy starts one client; it reports on ready once the client is set
// up, connects when go is closed, and returns its result.
func startPy(ctx context.Context, endpoint string, c pyClient, ready chan<- struct{}, start <-chan struct{}) pyResult {
	args := append([]string{"testdata/register.py", "--endpoint", "tcp://" + endpoint, "--http-address", c.http}, c.args...)
	cmd := exec.CommandContext(ctx, python, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		return pyResult{err: err}
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return pyResult{err: err}
	}
	if err := cmd.Start(); err != nil {
		ready <- struct{}{}
		return pyResult{err: err}
	}
	var r pyResult
	sc := bufio.NewScanner(out)
	signalled := false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "ready":
			ready <- struct{}{}
			signalled = true
			<-start
			_, _ = io.WriteString(in, "go\n")
		case strings.HasPrefix(line, "first "):
			n, _ := strconv.ParseInt(strings.TrimPrefix(line, "first "), 10, 64)
			r.first = time.Unix(0, n)
		default:
			if err := json.Unmarshal([]byte(line), &r); err != nil {
				r.err = fmt.Errorf("bad output line %q", line)
			}
		}
	}
	if !signalled {
		ready <- struct{}{}
	}
	_ = in.Close()
	if err := cmd.Wait(); err != nil {
		r.err = fmt.Errorf("%v: %s", err, stderr.String())
	}
	return r
}

// addedAt records when each instance first appeared in the registry.
func addedAt(reg *worker.Registry) func(instance string) (time.Time, bool) {
	var mu sync.Mutex
	seen := map[string]time.Time{}
	reg.Subscribe(func(c worker.Change) {
		now := time.Now()
		mu.Lock()
		for _, w := range c.Added {
			if _, ok := seen[w.Instance]; !ok {
				seen[w.Instance] = now
			}
		}
		mu.Unlock()
	})
	return func(instance string) (time.Time, bool) {
		mu.Lock()
		defer mu.Unlock()
		t, ok := seen[instance]
		return t, ok
	}
}

func runClients(t *testing.T, endpoint string, clients []pyClient) []pyResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res := make([]pyResult, len(clients))
	ready, start := make(chan struct{}, len(clients)), make(chan struct{})
	var wg sync.WaitGroup
	for i, c := range clients {
		wg.Go(func() { res[i] = startPy(ctx, endpoint, c, ready, start) })
	}
	for range clients {
		<-ready
	}
	close(start)
	wg.Wait()
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("%s: %v", clients[i].name, r.err)
		}
	}
	return res
}

const (
	pyCount = "25"  // sends per client
	pyIvl   = "0.1" // seconds between sends: 2.5 s, 2.5 heartbeat timeouts
)

// A PING left unanswered drops the connection after the timeout, well
// before the clients finish; the timeout leaves room for a loaded machine
// (a 300 ms timeout flaked with the other core busy).
var heartbeats = []string{"--heartbeat-ivl", "100", "--heartbeat-timeout", "1000"}

func TestInteropLibzmqDealers(t *testing.T) {
	needPython(t)
	common := []string{"--count", pyCount, "--interval", pyIvl}
	// Clients with an identity get distinct zmq_addresses, as real instances
	// have: P2P-NCCL's identity is its zmq_address, and a libzmq ROUTER (the
	// czmq build) takes one connection per identity.
	withZMQ := func(zmqAddr string) []string { return append([]string{"--zmq-address", zmqAddr}, common...) }
	for _, tc := range []struct {
		connector string
		clients   []pyClient
	}{
		{ConnectorMoRIIO, []pyClient{
			{"moriio-new, no identity", append([]string{"--format", "moriio-new", "--role", "P", "--identity", "none"}, common...), "127.0.0.1:7001"},
			{"moriio-new, identity", append([]string{"--format", "moriio-new", "--role", "D", "--identity", "zmq"}, withZMQ("host:127.0.0.1,handshake:6302,notify:61002")...), "127.0.0.1:7002"},
			{"moriio-new, no identity, heartbeats", append(append([]string{"--format", "moriio-new", "--role", "D", "--identity", "none"}, heartbeats...), common...), "127.0.0.1:7003"},
			{"moriio-new, identity, heartbeats", append(append([]string{"--format", "moriio-new", "--role", "P", "--identity", "zmq"}, heartbeats...), withZMQ("host:127.0.0.1,handshake:6304,notify:61004")...), "127.0.0.1:7004"},
			{"moriio-old, IPv6, heartbeats", append(append([]string{"--format", "moriio-old", "--role", "D"}, heartbeats...), common...), "[::1]:7005"},
		}},
		{ConnectorP2PNCCL, []pyClient{
			{"p2pnccl, identity", append([]string{"--format", "p2pnccl", "--role", "P"}, withZMQ("127.0.0.1:21101")...), "127.0.0.1:7101"},
			{"p2pnccl, identity, heartbeats", append(append([]string{"--format", "p2pnccl", "--role", "D"}, heartbeats...), withZMQ("127.0.0.1:21102")...), "127.0.0.1:7102"},
			{"p2pnccl, no identity, heartbeats", append(append([]string{"--format", "p2pnccl", "--role", "D", "--identity", "none"}, heartbeats...), common...), "127.0.0.1:7103"},
		}},
	} {
		t.Run(tc.connector, func(t *testing.T) {
			e := startListener(t, func(o *Options) { o.Connector = tc.connector })
			added := addedAt(e.reg)
			res := runClients(t, e.l.Addr(), tc.clients)
			total := 0
			for i, c := range tc.clients {
				r := res[i]
				total += r.Sent
				at, ok := added(c.http)
				if !ok {
					t.Errorf("%s: never registered", c.name)
					continue
				}
				lat := max(at.Sub(r.first), 0)
				t.Logf("%-36s sent %d, registered %v after the first send, connects %d, disconnects %d",
					c.name, r.Sent, lat.Round(time.Microsecond), r.Connects, r.Disconnects)
				// Registered by its first messages, not at the end (a loaded
				// machine delays it by hundreds of milliseconds).
				if lat > time.Second {
					t.Errorf("%s: registered %v after the first message", c.name, lat)
				}
				if r.Connects != 1 || r.Disconnects != 0 {
					t.Errorf("%s: %d connects, %d disconnects; want one stable connection", c.name, r.Connects, r.Disconnects)
				}
				if ws := e.reg.Instance(c.http); len(ws) != 1 || !ws[0].Routable() {
					t.Errorf("%s: workers %v", c.name, ws)
				}
			}
			// Every message arrived and was accepted; nothing was replaced.
			waitFor(t, 10*time.Second, "all registrations counted", func() bool { return e.processed(t) >= float64(total) })
			if p := e.processed(t); p != float64(total) {
				t.Errorf("processed %v messages, sent %d", p, total)
			}
			if a := metricValue(t, e.m.DiscoveryAdded); a != float64(len(tc.clients)) {
				t.Errorf("added %v, want %d (no replacements)", a, len(tc.clients))
			}
			if d := e.dropped(t, ReasonCommand); d != 0 {
				t.Errorf("%v command frames reached the listener", d)
			}
		})
	}
}
