package sim

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// go-zeromq v0.17.0's PUB socket never stops its writer goroutine
// (socket.Close does not close the pubMWriter): one per KV event publisher.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}

const testTimeout = 20 * time.Second

func testLogger() *slog.Logger {
	if os.Getenv("SIM_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// startSim starts an in-process instance on free ports; it is closed when
// the test ends.
func startSim(t *testing.T, args ...string) *Instance {
	t.Helper()
	args = append([]string{"--port", "0"}, args...)
	cfg, err := ParseArgs(args, io.Discard)
	if err != nil {
		t.Fatalf("ParseArgs(%q): %v", args, err)
	}
	in, err := Start(t.Context(), cfg, Options{Logger: testLogger(), Exit: func(code int) { t.Errorf("unexpected exit(%d)", code) }})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(in.Close)
	return in
}

var testClient = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}}

func (in *Instance) url(path string) string { return "http://" + in.HTTPAddr() + path }

func newReq(t *testing.T, ctx context.Context, method, url string, body any, hdr map[string]string) *http.Request {
	t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		buf, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(buf)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	return req
}

type jsonResult struct {
	status int
	body   map[string]any
	raw    []byte
}

// postJSON sends a request and decodes a JSON response.
func postJSON(t *testing.T, ctx context.Context, url string, body any, hdr map[string]string) jsonResult {
	t.Helper()
	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, url, body, hdr))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	r := jsonResult{status: resp.StatusCode, raw: raw}
	if len(raw) > 0 {
		if err := json.Unmarshal(raw, &r.body); err != nil {
			t.Fatalf("POST %s: status %d, non-JSON body %q", url, resp.StatusCode, raw)
		}
	}
	return r
}

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	resp, err := testClient.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if v != nil {
		if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
			t.Fatalf("GET %s: %v", url, err)
		}
	}
	return resp.StatusCode
}

func statsOf(t *testing.T, in *Instance) Stats {
	t.Helper()
	var s Stats
	getJSON(t, in.url("/sim/stats"), &s)
	return s
}

// streamResult is a parsed SSE response.
type streamResult struct {
	status      int
	contentType string
	text        string
	tokens      int
	ttft        time.Duration // first token event (choices non-empty) since start
	events      []map[string]any
	usage       map[string]any
	errEvent    map[string]any
	done        bool
	finish      string
}

// readStream consumes an SSE body like `vllm bench serve` does.
func readStream(t *testing.T, resp *http.Response, start time.Time) streamResult {
	t.Helper()
	defer resp.Body.Close()
	r := streamResult{status: resp.StatusCode, contentType: resp.Header.Get("Content-Type")}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Errorf("unexpected SSE line %q", line)
			continue
		}
		if data == "[DONE]" {
			r.done = true
			continue
		}
		var ev map[string]any
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			t.Errorf("bad SSE JSON %q: %v", data, err)
			continue
		}
		r.events = append(r.events, ev)
		if e, ok := ev["error"].(map[string]any); ok {
			r.errEvent = e
			continue
		}
		choices, _ := ev["choices"].([]any)
		if len(choices) > 0 {
			if r.ttft == 0 {
				r.ttft = time.Since(start)
			}
			c := choices[0].(map[string]any)
			if txt, ok := c["text"].(string); ok {
				r.text += txt
				r.tokens++
			}
			if d, ok := c["delta"].(map[string]any); ok {
				if _, isRole := d["role"]; !isRole {
					r.tokens++
				}
				if txt, ok := d["content"].(string); ok {
					r.text += txt
				}
			}
			if f, ok := c["finish_reason"].(string); ok {
				r.finish = f
			}
		} else if u, ok := ev["usage"].(map[string]any); ok {
			r.usage = u
		}
	}
	return r
}

func doStream(t *testing.T, ctx context.Context, url string, body any, hdr map[string]string) streamResult {
	t.Helper()
	start := time.Now()
	resp, err := testClient.Do(newReq(t, ctx, http.MethodPost, url, body, hdr))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	return readStream(t, resp, start)
}

func hex32() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func uuid4() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return fmt.Sprintf("%s-%s-%s-%s-%s", h[:8], h[8:12], h[12:16], h[16:20], h[20:])
}

// words returns a deterministic n-word prompt.
func words(n int, salt string) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "w%s%d", salt, i%997)
	}
	return b.String()
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// waitFor polls cond until it holds or the test context ends.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func contextWithCancel(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithCancel(ctx)
}
