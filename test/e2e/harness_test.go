// Package e2e starts the real binaries (switchyard, vllm-sim) as child
// processes and talks to them over real sockets.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var binDir string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "switchyard-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	cmd := exec.Command("go", "build", "-o", dir+string(os.PathSeparator), "../../cmd/switchyard", "../../cmd/vllm-sim", "../../cmd/sybench")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// proc is a started child process.
type proc struct {
	t    *testing.T
	name string
	cmd  *exec.Cmd
	logs *syncBuffer
	done chan struct{}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func start(t *testing.T, name string, args ...string) (*proc, io.Reader) {
	t.Helper()
	cmd := exec.Command(filepath.Join(binDir, name), args...)
	logs := &syncBuffer{}
	cmd.Stderr = logs
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, name: name, cmd: cmd, logs: logs, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		p.stop()
		if t.Failed() {
			t.Logf("--- %s %v logs:\n%s", name, args, tail(logs.String(), 4000))
		}
	})
	return p, out
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// stop sends SIGTERM then SIGKILL after 5 s.
func (p *proc) stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// kill sends SIGKILL and waits.
func (p *proc) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
}

// simInfo is vllm-sim's ready line.
type simInfo struct {
	Event         string `json:"event"`
	HTTPAddress   string `json:"http_address"`
	ZMQAddress    string `json:"zmq_address"`
	Role          string `json:"role"`
	KVConnector   string `json:"kv_connector"`
	TransferMode  string `json:"transfer_mode"`
	DPSize        int    `json:"dp_size"`
	BootstrapPort int    `json:"bootstrap_port"`
}

type sim struct {
	*proc
	info simInfo
}

func (s *sim) URL() string { return "http://" + s.info.HTTPAddress }

func startSim(t *testing.T, args ...string) *sim {
	t.Helper()
	p, out := start(t, "vllm-sim", append([]string{"--port", "0"}, args...)...)
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
	}()
	select {
	case l := <-lines:
		var info simInfo
		if err := json.Unmarshal([]byte(l), &info); err != nil || info.Event != "ready" {
			t.Fatalf("vllm-sim ready line %q: %v", l, err)
		}
		return &sim{proc: p, info: info}
	case <-p.done:
		t.Fatalf("vllm-sim exited: %s", p.logs.String())
	case <-time.After(15 * time.Second):
		t.Fatalf("vllm-sim not ready: %s", p.logs.String())
	}
	return nil
}

type router struct {
	*proc
	base    string
	metrics string
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// startRouter starts switchyard with args and waits until /liveness answers.
func startRouter(t *testing.T, args ...string) *router {
	t.Helper()
	port, mport := freePort(t), freePort(t)
	all := append([]string{"--host", "127.0.0.1", "--port", fmt.Sprint(port), "--prometheus-port", fmt.Sprint(mport)}, args...)
	p, out := start(t, "switchyard", all...)
	go func() { _, _ = io.Copy(p.logs, out) }()
	r := &router{proc: p, base: fmt.Sprintf("http://127.0.0.1:%d", port), metrics: fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)}
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-p.done:
			t.Fatalf("switchyard exited early: %s", p.logs.String())
		default:
		}
		resp, err := http.Get(r.base + "/liveness")
		if err == nil {
			resp.Body.Close()
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("switchyard not live: %s", p.logs.String())
	return nil
}

// waitReady polls /readiness until 200.
func (r *router) waitReady(t *testing.T, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var last string
	for time.Now().Before(deadline) {
		resp, err := http.Get(r.base + "/readiness")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
			last = string(b)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("router not ready within %v: %s", within, last)
}

// post sends a JSON body and returns status, headers and the full body.
func post(t *testing.T, ctx context.Context, url, body string, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp.StatusCode, resp.Header, b
}

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if v != nil {
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatalf("GET %s: %v: %s", url, err, b)
		}
	}
	return resp.StatusCode
}

// sseText concatenates the generated text of an SSE completion/chat stream
// and checks its framing: every event is "data: ...\n\n" and it ends with
// [DONE].
func sseText(t *testing.T, body []byte) (text string, events int) {
	t.Helper()
	s := string(body)
	if !strings.HasSuffix(s, "data: [DONE]\n\n") {
		t.Fatalf("stream does not end with [DONE]: %q", tail(s, 300))
	}
	for _, ev := range strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n") {
		if !strings.HasPrefix(ev, "data: ") {
			t.Fatalf("bad SSE event %q", ev)
		}
		data := strings.TrimPrefix(ev, "data: ")
		if data == "[DONE]" {
			continue
		}
		var chunk struct {
			Error   any `json:"error"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("bad chunk %q: %v", data, err)
		}
		if chunk.Error != nil {
			t.Fatalf("error event in stream: %s", data)
		}
		for _, c := range chunk.Choices {
			text += c.Text + c.Delta.Content
			events++
		}
	}
	return text, events
}

// completionText extracts the text of a non-streaming response.
func completionText(t *testing.T, body []byte) string {
	t.Helper()
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) == 0 {
		t.Fatalf("bad completion %s: %v", body, err)
	}
	return r.Choices[0].Text + r.Choices[0].Message.Content
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
