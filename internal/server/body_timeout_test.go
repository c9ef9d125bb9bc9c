package server

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/proxy"
)

// TestBodyReadTimeout: a client that sends its headers and then trickles a
// body that never completes gets a 408 JSON error once BodyReadTimeout has
// passed, and the router closes the connection shortly after (it used to
// answer nothing and keep the connection for as long as the client
// trickled: the timeout cancelled the request context, the handler took it
// for a client that left, and net/http then drained the body with no
// deadline before writing anything).
func TestBodyReadTimeout(t *testing.T) {
	const timeout = 300 * time.Millisecond
	cases := []struct {
		name, head, piece, route string
	}{
		{"generation, content-length",
			"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\":\"",
			"a", "/v1/completions"},
		{"passthrough, chunked",
			"POST /tokenize HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n",
			"1\r\na\r\n", "/tokenize"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(o *Options) { o.BodyReadTimeout = timeout })
			base, _ := serve(t, e.s)
			c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			start := time.Now()
			if _, err := io.WriteString(c, tc.head); err != nil {
				t.Fatal(err)
			}
			done := make(chan struct{})
			var wg sync.WaitGroup
			defer wg.Wait()
			defer close(done)
			wg.Go(func() { // one piece every 50 ms, until the router closes
				for {
					select {
					case <-done:
						return
					case <-time.After(50 * time.Millisecond):
					}
					if _, err := io.WriteString(c, tc.piece); err != nil {
						return
					}
				}
			})

			_ = c.SetReadDeadline(start.Add(10 * time.Second))
			br := bufio.NewReader(c)
			res, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("no response after %v: %v", time.Since(start), err)
			}
			took := time.Since(start)
			b, err := io.ReadAll(res.Body)
			res.Body.Close()
			if err != nil {
				t.Fatalf("read the 408 body: %v", err)
			}
			var eb openai.ErrorBody
			if res.StatusCode != http.StatusRequestTimeout || json.Unmarshal(b, &eb) != nil || eb.Error.Code != http.StatusRequestTimeout {
				t.Fatalf("got %d %s, want a 408 JSON error", res.StatusCode, b)
			}
			if !res.Close {
				t.Errorf("the 408 does not close the connection (headers %v)", res.Header)
			}
			if took < timeout || took > timeout+3*time.Second { // the upper bound is slack for a loaded runner
				t.Errorf("408 after %v, want just after the %v body timeout", took, timeout)
			}
			// then the router closes the connection (EOF, or a reset if a
			// trickled byte was in flight), not the client's read deadline
			_, err = br.ReadByte()
			if err == nil || isTimeout(err) {
				t.Fatalf("connection still open %v after the 408 was sent (%v)", time.Since(start)-took, err)
			}
			if closed := time.Since(start); closed > timeout+3*time.Second+bodyTimeoutLinger {
				t.Errorf("connection closed after %v", closed)
			}
			if n := e.gen.count() + e.pass.count(); n != 0 {
				t.Errorf("%d requests reached a dispatcher", n)
			}
			waitFor(t, "the access log/metrics of the 408", func() bool {
				return value(e.m.RequestErrors.WithLabelValues(tc.route, "body_read_timeout")) == 1
			})
		})
	}
}

// TestBodyReadTimeoutNotLeftOnConnection: a body received within the
// timeout is served, and its deadline does not fire later, during a
// response that lasts several times the body timeout.
func TestBodyReadTimeoutNotLeftOnConnection(t *testing.T) {
	// The body's pause is a twentieth of the timeout (a loaded machine
	// must not stretch it past the deadline); the response lasts twice
	// the timeout.
	const timeout = time.Second
	e := newEnv(t, func(o *Options) { o.BodyReadTimeout = timeout })
	e.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
		select {
		case <-time.After(2 * timeout):
			writeJSON(w, 200, map[string]any{"ok": true})
		case <-r.Context().Done():
			openai.WriteError(w, 500, "request context cancelled during the response")
		}
	}
	base, _ := serve(t, e.s)
	pr, pw := io.Pipe()
	go func() {
		_, _ = io.WriteString(pw, `{"prompt":`)
		time.Sleep(timeout / 20) // slow, but within the timeout
		_, _ = io.WriteString(pw, `"x"}`)
		_ = pw.Close()
	}()
	req, _ := http.NewRequestWithContext(t.Context(), "POST", base+"/v1/completions", pr)
	req.ContentLength = int64(len(`{"prompt":"x"}`))
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 {
		t.Fatalf("%d %s", res.StatusCode, b)
	}
}

// TestBodyReadDeadlineUnsupported: when the deadline cannot be set (a
// ResponseWriter that does not reach a connection), the body is still
// read, and the failure is logged once, not per request.
func TestBodyReadDeadlineUnsupported(t *testing.T) {
	var logs syncBuffer
	e := newEnv(t, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	for range 2 {
		rec := httptest.NewRecorder() // no SetReadDeadline: ErrNotSupported
		req := httptest.NewRequestWithContext(t.Context(), "POST", "/v1/completions", strings.NewReader(`{"prompt":"x"}`))
		e.s.Handler().ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Fatalf("%d %s", rec.Code, rec.Body)
		}
	}
	if n := strings.Count(logs.String(), "cannot set the request body read deadline"); n != 1 {
		t.Fatalf("warning logged %d times:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), http.ErrNotSupported.Error()) {
		t.Errorf("the warning does not carry the error:\n%s", logs.String())
	}
}
