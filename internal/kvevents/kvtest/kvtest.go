// Package kvtest runs publisher.py, a KV event publisher speaking vLLM's
// protocol on libzmq (a PUB socket and a ROUTER replay socket, driven by
// JSON commands on stdin), for the tests of the subscriber and of the
// kv_aware policy end to end.
package kvtest

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// Publisher is one running publisher.py.
type Publisher struct {
	t     testing.TB
	in    io.WriteCloser
	lines chan string
	// Pub and Replay are its PUB and replay endpoints (tcp://127.0.0.1:N).
	Pub, Replay string
}

// script is publisher.py beside this file.
func script() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "publisher.py")
}

// Start runs a publisher on topic ("" = none) with Debian's python3 and
// its python3-zmq (scripts/install-deps.sh installs them). The process ends
// with the test.
func Start(t testing.TB, topic string) *Publisher {
	t.Helper()
	cmd := exec.Command("/usr/bin/python3", script(), topic)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &lockedBuffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("python3 publisher (scripts/install-deps.sh installs python3-zmq): %v", err)
	}
	p := &Publisher{t: t, in: in, lines: make(chan string, 16)}
	go func() { // ends when the process closes its stdout
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		_ = in.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		timer := time.NewTimer(5 * time.Second)
		defer timer.Stop()
		select {
		case <-done:
		case <-timer.C:
			_ = cmd.Process.Kill()
			<-done
		}
	})
	var pub, rep int
	line := p.line()
	if _, err := fmt.Sscanf(line, "ready %d %d", &pub, &rep); err != nil {
		t.Fatalf("publisher said %q (%v); stderr: %s", line, err, stderr.String())
	}
	p.Pub = fmt.Sprintf("tcp://127.0.0.1:%d", pub)
	p.Replay = fmt.Sprintf("tcp://127.0.0.1:%d", rep)
	return p
}

// Endpoints is the --kv-events-endpoints form: "PUB,REPLAY".
func (p *Publisher) Endpoints() string { return p.Pub + "," + p.Replay }

// Do sends one command ({"op":"publish","batch":…}, {"op":"restart"},
// {"op":"raw","size":N}, …) and waits for its "ok".
func (p *Publisher) Do(cmd map[string]any) {
	p.t.Helper()
	b, _ := json.Marshal(cmd)
	if _, err := p.in.Write(append(b, '\n')); err != nil {
		p.t.Fatal(err)
	}
	if l := p.line(); !strings.HasPrefix(l, "ok") {
		p.t.Fatalf("publisher: %q", l)
	}
}

// Publish sends one KVEventBatch of events (named-field encoding).
func (p *Publisher) Publish(events ...any) {
	p.t.Helper()
	p.Do(map[string]any{"op": "publish", "batch": []any{float64(time.Now().Unix()), events, 0}})
}

func (p *Publisher) line() string {
	p.t.Helper()
	timer := time.NewTimer(20 * time.Second)
	defer timer.Stop()
	select {
	case l, ok := <-p.lines:
		if !ok {
			p.t.Fatal("publisher exited")
		}
		return l
	case <-timer.C:
		p.t.Fatal("publisher did not answer")
	}
	return ""
}

type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
