package h1server

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

// readResponse reads one response from br and returns its body.
func readResponse(t *testing.T, br *bufio.Reader) string {
	t.Helper()
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading response: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading body: %v", err)
	}
	return string(b)
}

// expectEOF asserts the server closes c within d without sending anything.
func expectEOF(t *testing.T, c net.Conn, d time.Duration) {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(d))
	n, err := c.Read(make([]byte, 1))
	if n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("read = %d, %v; want the server to close the connection", n, err)
	}
}

func TestDisconnectCancelsContext(t *testing.T) {
	cases := []struct {
		name, req string
	}{
		{"no body", get("/wait", "")},
		{"body read", post("/wait", strings.Repeat("b", 5000))},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cause := make(chan error, 1)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.Copy(io.Discard, r.Body)
				<-r.Context().Done()
				cause <- context.Cause(r.Context())
			})
			_, addr := startH1(t, h, nil)
			c := dial(t, addr)
			io.WriteString(c, tc.req)
			time.Sleep(50 * time.Millisecond) // let the handler start and the watch back off
			c.Close()
			select {
			case err := <-cause:
				if !errors.Is(err, context.Canceled) {
					t.Errorf("cause = %v, want context.Canceled", err)
				}
			case <-time.After(time.Second):
				t.Fatal("context not cancelled within 1s of the client closing")
			}
		})
	}
}

// TestDisconnectOnAWatchedConnection: a connection stays in the poller's
// set after a request that ran long enough to put it there; its next
// request is still cancelled when the client closes the connection, or
// half-closes it after the request (as net/http's background read takes
// it), and a slow request meanwhile is not.
func TestDisconnectOnAWatchedConnection(t *testing.T) {
	for _, half := range []bool{false, true} {
		t.Run(map[bool]string{false: "close", true: "half-close"}[half], func(t *testing.T) {
			cause := make(chan error, 1)
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/slow" {
					select {
					case <-r.Context().Done():
						io.WriteString(w, "cancelled")
					case <-time.After(60 * time.Millisecond):
						io.WriteString(w, "done")
					}
					return
				}
				<-r.Context().Done()
				cause <- context.Cause(r.Context())
			})
			_, addr := startH1(t, h, nil)
			c := dial(t, addr)
			br := bufio.NewReader(c)
			for range 2 { // long enough to be registered, then served registered
				io.WriteString(c, get("/slow", ""))
				if got := readResponse(t, br); got != "done" {
					t.Fatalf("/slow: %q", got)
				}
			}
			io.WriteString(c, get("/wait", ""))
			if half {
				c.CloseWrite()
			} else {
				time.Sleep(20 * time.Millisecond) // the handler is waiting
				c.Close()
			}
			select {
			case err := <-cause:
				if !errors.Is(err, context.Canceled) {
					t.Errorf("cause = %v, want context.Canceled", err)
				}
			case <-time.After(2 * time.Second):
				t.Fatal("context not cancelled within 2s of the client closing")
			}
		})
	}
}

func TestPipelinedRequestDoesNotCancel(t *testing.T) {
	// The second request comes in the first's write (already buffered), or
	// while the first handler runs (seen by the watch's peek).
	for _, delay := range []time.Duration{0, 50 * time.Millisecond} {
		t.Run(delay.String(), func(t *testing.T) { testPipelined(t, delay) })
	}
}

func testPipelined(t *testing.T, delay time.Duration) {
	var mu sync.Mutex
	var cancelled []string
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			mu.Lock()
			cancelled = append(cancelled, r.URL.Path)
			mu.Unlock()
		case <-time.After(300 * time.Millisecond):
		}
		io.WriteString(w, r.URL.Path)
	})
	_, addr := startH1(t, h, nil)
	c := dial(t, addr)
	if delay == 0 {
		io.WriteString(c, get("/first", "")+get("/second", ""))
	} else {
		io.WriteString(c, get("/first", ""))
		time.Sleep(delay)
		io.WriteString(c, get("/second", ""))
	}
	br := bufio.NewReader(c)
	for _, want := range []string{"/first", "/second"} {
		if got := readResponse(t, br); got != want {
			t.Errorf("body = %q, want %q", got, want)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(cancelled) > 0 {
		t.Errorf("contexts of %v were cancelled", cancelled)
	}
}

func TestRequestContextValues(t *testing.T) {
	type key struct{}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		_, isSrv := ctx.Value(http.ServerContextKey).(*http.Server)
		la, _ := ctx.Value(http.LocalAddrContextKey).(net.Addr)
		io.WriteString(w, strings.Join([]string{
			ctx.Value(key{}).(string), boolStr(isSrv), boolStr(la != nil && strings.HasPrefix(la.String(), "127.0.0.1:")),
			boolStr(r.RemoteAddr != "" && r.TLS == nil),
		}, ","))
	})
	_, addr := startH1(t, h, func(s *Server) {
		s.BaseContext = func(net.Listener) context.Context { return context.WithValue(context.Background(), key{}, "base") }
	})
	for _, req := range []string{
		get("/", ""),
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", // the fallback's
	} {
		c := dial(t, addr)
		io.WriteString(c, req)
		if got, want := readResponse(t, bufio.NewReader(c)), "base,true,true,true"; got != want {
			t.Errorf("%q: got %q, want %q", req, got, want)
		}
	}
}

func boolStr(b bool) string {
	if b {
		return "true"
	}
	return "false"
}

// TestBuffersReleased checks that a request without a body runs its handler
// with no read buffer held, and that a flush with nothing pending gives the
// write buffer back.
func TestBuffersReleased(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rw := w.(*response)
		if r.Body != http.NoBody {
			io.ReadAll(r.Body)
		}
		readHeld := rw.c.buf != nil
		io.WriteString(w, "data: 1\n\n")
		writeHeldBeforeFlush := rw.wb != nil
		w.(http.Flusher).Flush()
		writeHeld := rw.wb != nil
		io.WriteString(w, strings.Join([]string{boolStr(readHeld), boolStr(writeHeldBeforeFlush), boolStr(writeHeld)}, ","))
	})
	_, addr := startH1(t, h, nil)
	for _, req := range []string{get("/", ""), post("/", "some body")} {
		c := dial(t, addr)
		io.WriteString(c, req)
		if got, want := readResponse(t, bufio.NewReader(c)), "data: 1\n\nfalse,true,false"; got != want {
			t.Errorf("%q: got %q, want %q (read buffer held, write buffer before/after flush)", req, got, want)
		}
	}
}

func TestShutdown(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/stream" {
			io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
			close(started)
			<-release
			io.WriteString(w, "data: 2\n\n")
			return
		}
		io.WriteString(w, "ok")
	})
	s, addr := startH1(t, h, nil)
	idle := dial(t, addr)
	io.WriteString(idle, get("/", ""))
	readResponse(t, bufio.NewReader(idle))
	active := dial(t, addr)
	io.WriteString(active, get("/stream", ""))
	<-started

	shut := make(chan error, 1)
	go func() { shut <- s.Shutdown(context.Background()) }()
	expectEOF(t, idle, time.Second)
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned %v with a handler still active", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	select {
	case err := <-shut:
		if err != nil {
			t.Fatalf("Shutdown = %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Shutdown did not return after the handler finished")
	}
	active.SetReadDeadline(time.Now().Add(time.Second))
	got, _ := io.ReadAll(active)
	if !bytes.Contains(got, []byte("data: 2")) || !bytes.HasSuffix(got, []byte("0\r\n\r\n")) {
		t.Errorf("stream = %q, want the whole stream", got)
	}
}

func TestShutdownExpiredContext(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
	})
	s, addr := startH1(t, h, nil)
	c := dial(t, addr)
	io.WriteString(c, get("/", ""))
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := s.Shutdown(ctx)
	close(release)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown = %v, want context.DeadlineExceeded", err)
	}
}

func TestCloseClosesEverything(t *testing.T) {
	started := make(chan struct{})
	release := make(chan struct{})
	defer close(release)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/block" {
			close(started)
			select {
			case <-r.Context().Done():
			case <-release:
			}
			return
		}
		io.WriteString(w, "ok")
	})
	s, addr := startH1(t, h, nil)
	idle := dial(t, addr)
	io.WriteString(idle, get("/", ""))
	readResponse(t, bufio.NewReader(idle))
	active := dial(t, addr)
	io.WriteString(active, get("/block", ""))
	<-started
	fb := dial(t, addr) // served by the fallback
	io.WriteString(fb, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
	readResponse(t, bufio.NewReader(fb))
	if err := s.Close(); err != nil {
		t.Fatalf("Close = %v", err)
	}
	for _, c := range []net.Conn{idle, active, fb} {
		expectEOF(t, c, time.Second)
	}
	if _, err := net.Dial("tcp", addr); err == nil {
		t.Error("listener still accepting after Close")
	}
}

func TestTimeouts(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	cases := []struct {
		name  string
		cfg   func(*Server)
		first string // a whole request to send first, if any
		then  string // bytes to send and leave hanging
	}{
		{"idle timeout", func(s *Server) { s.IdleTimeout = 100 * time.Millisecond }, get("/", ""), ""},
		{"idle falls back to read header timeout", func(s *Server) { s.ReadHeaderTimeout = 100 * time.Millisecond }, get("/", ""), ""},
		{"half a head", func(s *Server) { s.ReadHeaderTimeout = 100 * time.Millisecond }, "", "GET / HTTP/1.1\r\nHost: a\r\n"},
		{"half a head after idle", func(s *Server) {
			s.ReadHeaderTimeout = 100 * time.Millisecond
			s.IdleTimeout = time.Minute
		}, get("/", ""), "GET / HT"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, addr := startH1(t, h, tc.cfg)
			c := dial(t, addr)
			br := bufio.NewReader(c)
			if tc.first != "" {
				io.WriteString(c, tc.first)
				readResponse(t, br)
			}
			io.WriteString(c, tc.then)
			start := time.Now()
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			n, err := br.Read(make([]byte, 1))
			if n != 0 || !errors.Is(err, io.EOF) {
				t.Fatalf("read = %d, %v; want EOF", n, err)
			}
			if d := time.Since(start); d < 50*time.Millisecond || d > time.Second {
				t.Errorf("closed after %v, want about 100ms", d)
			}
		})
	}
}

// TestIdleDeadlineEndsWithTheHead: a keep-alive request whose head arrived
// whole is parsed under the idle deadline (no deadline of its own is set);
// its handler then outlives that deadline with the body read, the context
// alive and the connection kept, and its body, sent later than the head,
// is still read under a deadline of its own.
func TestIdleDeadlineEndsWithTheHead(t *testing.T) {
	const idle = 100 * time.Millisecond
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		select {
		case <-r.Context().Done():
			http.Error(w, "context ended", http.StatusInternalServerError)
			return
		case <-time.After(3 * idle):
		}
		io.WriteString(w, "ok "+string(b))
	})
	_, addr := startH1(t, h, func(s *Server) { s.IdleTimeout = idle; s.ReadHeaderTimeout = time.Minute })
	c := dial(t, addr)
	br := bufio.NewReader(c)
	io.WriteString(c, post("/", "a"))
	if got := readResponse(t, br); got != "ok a" {
		t.Fatalf("first response %q", got)
	}
	io.WriteString(c, post("/", "b"))
	if got := readResponse(t, br); got != "ok b" {
		t.Fatalf("second response %q, want \"ok b\" (the idle deadline outlived the head)", got)
	}
	// The head first, the body after the idle timeout: read, not cut off.
	full := post("/", "late")
	io.WriteString(c, full[:len(full)-4])
	time.Sleep(2 * idle)
	io.WriteString(c, "late")
	if got := readResponse(t, br); got != "ok late" {
		t.Fatalf("third response %q", got)
	}
}

// TestBodyArrived: a body sent with its head is reported arrived (its read
// cannot wait on the client), one still on its way is not.
func TestBodyArrived(t *testing.T) {
	got := make(chan bool, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		a, ok := r.Body.(interface{ Arrived() bool })
		got <- ok && a.Arrived()
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	})
	_, addr := startH1(t, h, nil)
	c := dial(t, addr)
	br := bufio.NewReader(c)
	io.WriteString(c, post("/", "whole"))
	readResponse(t, br)
	if !<-got {
		t.Fatal("a body sent with its head: not arrived")
	}
	full := post("/", "later")
	io.WriteString(c, full[:len(full)-2])
	if <-got {
		t.Fatal("a body missing its last bytes: arrived")
	}
	io.WriteString(c, "er")
	readResponse(t, br)
}

func TestHijack(t *testing.T) {
	conns := make(chan net.Conn, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		nc, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			t.Errorf("Hijack: %v", err)
			return
		}
		brw.WriteString("HIJACKED\n")
		brw.Flush()
		if _, err := w.Write([]byte("x")); !errors.Is(err, http.ErrHijacked) {
			t.Errorf("Write after Hijack = %v, want ErrHijacked", err)
		}
		conns <- nc
	})
	s, addr := startH1(t, h, nil)
	c := dial(t, addr)
	io.WriteString(c, get("/", ""))
	nc := <-conns
	defer nc.Close()
	br := bufio.NewReader(c)
	if line, _ := br.ReadString('\n'); line != "HIJACKED\n" {
		t.Fatalf("got %q", line)
	}
	time.Sleep(50 * time.Millisecond) // the handler has returned
	s.Close()                         // must not close a hijacked conn
	io.WriteString(nc, "still mine\n")
	if line, err := br.ReadString('\n'); line != "still mine\n" {
		t.Fatalf("after the handler returned: got %q, %v", line, err)
	}
	io.WriteString(c, "from client\n")
	nc.SetReadDeadline(time.Now().Add(time.Second))
	if line, err := bufio.NewReader(nc).ReadString('\n'); line != "from client\n" {
		t.Fatalf("server side read %q, %v", line, err)
	}
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

func TestPanic(t *testing.T) {
	cases := []struct {
		name    string
		value   any
		wantLog string
	}{
		{"panic", "boom", "http: panic serving 127.0.0.1:"},
		{"abort handler", http.ErrAbortHandler, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var logBuf syncBuffer
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				io.WriteString(w, "partial")
				panic(tc.value)
			})
			_, addr := startH1(t, h, func(s *Server) { s.ErrorLog = log.New(&logBuf, "", 0) })
			c := dial(t, addr)
			io.WriteString(c, get("/", ""))
			expectEOF(t, c, time.Second)
			got := logBuf.String()
			switch {
			case tc.wantLog == "" && got != "":
				t.Errorf("logged %q, want nothing", got)
			case tc.wantLog != "" && (!strings.Contains(got, tc.wantLog) || !strings.Contains(got, "boom\ngoroutine")):
				t.Errorf("log = %q, want %q with the value and a stack", got, tc.wantLog)
			}
		})
	}
}

// TestNoGoroutineLeft: after Close, no goroutine of the package is left
// (connections served on the fast path, handed off, or hijacked).
func TestNoGoroutineLeft(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hijack" {
			nc, _, _ := http.NewResponseController(w).Hijack()
			nc.Close()
			return
		}
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	})
	s, addr := startH1(t, h, nil)
	for _, req := range []string{
		get("/", ""), post("/", "body"), get("/hijack", ""),
		"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
	} {
		c := dial(t, addr)
		io.WriteString(c, req)
		c.Read(make([]byte, 64))
	}
	s.Close()
	deadline := time.Now().Add(2 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		stacks := string(buf[:runtime.Stack(buf, true)])
		left := 0
		for g := range strings.SplitSeq(stacks, "\n\n") {
			if strings.Contains(g, "h1server.(*conn)") || strings.Contains(g, "h1server.(*Server).init") || strings.Contains(g, "h1server.(*watch)") {
				left++
			}
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines left:\n%s", left, stacks)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWaitingConnsHoldNoBuffers: idle keep-alive connections and a stream
// waiting between events hold neither read nor write buffers.
func TestWaitingConnsHoldNoBuffers(t *testing.T) {
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, "data: 1\n\n")
		if r.URL.Path == "/stream" {
			w.(http.Flusher).Flush()
			<-release
		}
	})
	_, addr := startH1(t, h, nil)
	defer close(release)
	for _, req := range []string{get("/", ""), post("/", strings.Repeat("x", 10000)), get("/", "")} {
		c := dial(t, addr)
		io.WriteString(c, req)
		readResponse(t, bufio.NewReader(c))
	}
	stream := dial(t, addr)
	io.WriteString(stream, post("/stream", "{}"))
	stream.Read(make([]byte, 100))
	deadline := time.Now().Add(time.Second)
	for readBufsHeld.Load() != 0 || writeBufsHeld.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("held: %d read buffers, %d write buffers; want 0", readBufsHeld.Load(), writeBufsHeld.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestLogs(t *testing.T) {
	cases := []struct {
		name    string
		handler http.HandlerFunc
		want    string
	}{
		{"superfluous WriteHeader", func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(200)
			w.WriteHeader(500)
		}, "http: superfluous response.WriteHeader call from "},
		{"invalid Content-Length", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", "-1")
			io.WriteString(w, "x")
		}, `http: invalid Content-Length of "-1"`},
		{"quiet", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "x") }, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var logBuf syncBuffer
			_, addr := startH1(t, tc.handler, func(s *Server) { s.ErrorLog = log.New(&logBuf, "", 0) })
			c := dial(t, addr)
			io.WriteString(c, get("/", ""))
			readResponse(t, bufio.NewReader(c))
			got := logBuf.String()
			if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
				t.Errorf("log = %q, want %q", got, tc.want)
			}
		})
	}
}

// flakyListener fails its first Accept with a temporary error.
type flakyListener struct {
	net.Listener
	failed bool
}

type tempErr struct{}

func (tempErr) Error() string   { return "temporary accept failure" }
func (tempErr) Timeout() bool   { return false }
func (tempErr) Temporary() bool { return true }

func (l *flakyListener) Accept() (net.Conn, error) {
	if !l.failed {
		l.failed = true
		return nil, tempErr{}
	}
	return l.Listener.Accept()
}

func TestTemporaryAcceptErrorRetried(t *testing.T) {
	var logBuf syncBuffer
	s := &Server{
		Handler:  http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }),
		ErrorLog: log.New(&logBuf, "", 0),
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(&flakyListener{Listener: l}) }()
	c := dial(t, l.Addr().String())
	io.WriteString(c, get("/", ""))
	if got := readResponse(t, bufio.NewReader(c)); got != "ok" {
		t.Errorf("got %q", got)
	}
	s.Close()
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		t.Errorf("Serve = %v", err)
	}
	if !strings.Contains(logBuf.String(), "http: Accept error: temporary accept failure; retrying in 5ms") {
		t.Errorf("log = %q", logBuf.String())
	}
}

// TestHandlerReadDeadlineDoesNotCancel: an expired read deadline set by the
// handler must not look like a disconnect to the watch.
func TestHandlerReadDeadlineDoesNotCancel(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).SetReadDeadline(time.Now().Add(-time.Second))
		select {
		case <-r.Context().Done():
			io.WriteString(w, "cancelled")
		case <-time.After(300 * time.Millisecond):
			io.WriteString(w, "ok")
		}
	})
	_, addr := startH1(t, h, nil)
	c := dial(t, addr)
	io.WriteString(c, get("/", ""))
	br := bufio.NewReader(c)
	if got := readResponse(t, br); got != "ok" {
		t.Errorf("got %q, want ok", got)
	}
	io.WriteString(c, get("/", "")) // the deadline is the server's again: the conn still serves
	if got := readResponse(t, br); got != "ok" {
		t.Errorf("second request: got %q, want ok", got)
	}
}

// TestBodyReadInOtherGoroutine: a body read by another goroutine while the
// handler writes (as a proxy's transport does) is race-free, and with
// EnableFullDuplex the reader gets the whole body.
func TestBodyReadInOtherGoroutine(t *testing.T) {
	for _, duplex := range []bool{false, true} {
		t.Run(boolStr(duplex), func(t *testing.T) {
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if duplex {
					http.NewResponseController(w).EnableFullDuplex()
				}
				n := make(chan int64, 1)
				go func() {
					c, _ := io.Copy(io.Discard, r.Body)
					n <- c
				}()
				io.WriteString(w, "first\n")
				w.(http.Flusher).Flush()
				got := <-n
				if duplex && got != 100000 {
					t.Errorf("full duplex: read %d body bytes, want 100000", got)
				}
				io.WriteString(w, "second\n")
			})
			_, addr := startH1(t, h, nil)
			c := dial(t, addr)
			br := bufio.NewReader(c)
			for range 3 {
				io.WriteString(c, post("/", strings.Repeat("d", 100000)))
				if got := readResponse(t, br); got != "first\nsecond\n" {
					t.Fatalf("got %q", got)
				}
			}
		})
	}
}
