package proxy

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/freeport"
)

// h1Server is an upstream that counts the connections it accepted and
// reports the ones that closed.
type h1Server struct {
	*httptest.Server
	conns  atomic.Int32
	closed chan struct{} // one value per closed connection

	mu   sync.Mutex
	last net.Conn // the last accepted connection
}

func newH1Server(t *testing.T, h http.HandlerFunc) *h1Server {
	t.Helper()
	s := &h1Server{closed: make(chan struct{}, 1024)}
	s.Server = httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(c net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			s.conns.Add(1)
			s.mu.Lock()
			s.last = c
			s.mu.Unlock()
		case http.StateClosed, http.StateHijacked:
			s.closed <- struct{}{}
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s
}

// waitClosed waits (bounded) for n connections of s to close.
func (s *h1Server) waitClosed(t *testing.T, n int) {
	t.Helper()
	for range n {
		select {
		case <-s.closed:
		case <-time.After(10 * time.Second):
			t.Fatal("upstream connection not closed within 10 s")
		}
	}
}

// waitDone waits (bounded) for the request's context: the client went away.
func waitDone(r *http.Request) bool {
	select {
	case <-r.Context().Done():
		return true
	case <-time.After(20 * time.Second):
		return false
	}
}

func newH1(t *testing.T, o TransportOptions) *H1Transport {
	t.Helper()
	tr := NewH1Transport(o)
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

func TestH1RequestAndReuse(t *testing.T) {
	type seen struct {
		method, uri, host, ua, ct, xr string
		length                        int64
		body                          string
		te                            []string
	}
	got := make(chan seen, 16)
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- seen{r.Method, r.RequestURI, r.Host, r.UserAgent(), r.Header.Get("Content-Type"), r.Header.Get("X-Request-Id"),
			r.ContentLength, string(b), r.TransferEncoding}
		w.Header().Set("X-Up", "1")
		io.WriteString(w, "answer:"+string(b))
	})
	tr := newH1(t, TransportOptions{})
	big := strings.Repeat("x", h1InlineBody+100) // written after the head, not inline
	for i, tc := range []struct {
		name, method, path, body, ua string
		wantUA                       string
	}{
		{"post inline body", http.MethodPost, "/v1/completions?x=1", `{"prompt":"hi"}`, "switchyard", "switchyard"},
		{"post large body", http.MethodPost, "/v1/completions", big, "", "Go-http-client/1.1"},
		{"get no body", http.MethodGet, "/v1/models", "", "curl/8", "curl/8"},
		{"post empty body", http.MethodPost, "/x", "", "", "Go-http-client/1.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var body io.Reader
			if tc.body != "" {
				body = bytes.NewReader([]byte(tc.body))
			}
			req, _ := http.NewRequest(tc.method, s.URL+tc.path, body)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("X-Request-Id", "r1")
			if tc.ua != "" {
				req.Header.Set("User-Agent", tc.ua)
			}
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || string(b) != "answer:"+tc.body || resp.StatusCode != 200 || resp.Header.Get("X-Up") != "1" {
				t.Fatalf("response %d %q %v %v", resp.StatusCode, b, resp.Header, err)
			}
			sv := <-got
			if sv.method != tc.method || sv.uri != tc.path || sv.host != s.Listener.Addr().String() || sv.ua != tc.wantUA ||
				sv.ct != "application/json" || sv.xr != "r1" || sv.body != tc.body || sv.length != int64(len(tc.body)) || len(sv.te) != 0 {
				t.Fatalf("upstream saw %+v", sv)
			}
			if n := s.conns.Load(); n != 1 {
				t.Fatalf("request %d: %d upstream connections, want 1 (keep-alive)", i, n)
			}
			tr.mu.Lock()
			idle := tr.idle[s.Listener.Addr().String()]
			tr.mu.Unlock()
			if len(idle) != 1 || idle[0].attached {
				t.Fatalf("idle pool %d connection(s), want 1 holding no read buffer", len(idle))
			}
		})
	}
}

func TestH1StreamsChunkByChunk(t *testing.T) {
	next := make(chan struct{})
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		for i := range 3 {
			io.WriteString(w, "data: "+string(rune('a'+i))+"\n\n")
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
	})
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodPost, s.URL+"/v1/completions", strings.NewReader(`{"stream":true}`))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	buf := make([]byte, 64)
	for i := range 3 {
		// each event arrives before the upstream is allowed to send the next
		n, err := resp.Body.Read(buf)
		if want := "data: " + string(rune('a'+i)) + "\n\n"; string(buf[:n]) != want || err != nil {
			t.Fatalf("read %d: %q %v, want %q", i, buf[:n], err, want)
		}
		next <- struct{}{}
	}
	if b, err := io.ReadAll(resp.Body); len(b) != 0 || err != nil {
		t.Fatalf("tail %q %v", b, err)
	}
	if n, err := resp.Body.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("read after EOF: %d %v", n, err)
	}
}

func TestH1CancelClosesUpstream(t *testing.T) {
	gone := make(chan struct{}, 1)
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		io.WriteString(w, "data: 1\n\n")
		w.(http.Flusher).Flush()
		if waitDone(r) { // the router's cancel must reach the worker
			gone <- struct{}{}
		}
	})
	for _, tc := range []struct {
		name   string
		cancel func(resp *http.Response, cancel context.CancelFunc)
	}{
		{"context cancelled while reading", func(_ *http.Response, c context.CancelFunc) { c() }},
		{"body closed while reading (idle timeout)", func(r *http.Response, _ context.CancelFunc) { r.Body.Close() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tr := newH1(t, TransportOptions{})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/", strings.NewReader("{}"))
			resp, err := tr.RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			if _, err := resp.Body.Read(buf); err != nil {
				t.Fatal(err)
			}
			readErr := make(chan error, 1)
			go func() { _, err := resp.Body.Read(buf); readErr <- err }() // blocked: nothing more comes
			tc.cancel(resp, cancel)
			select {
			case err := <-readErr:
				if err == nil {
					t.Fatal("blocked read returned no error")
				}
			case <-time.After(10 * time.Second):
				t.Fatal("blocked read not unblocked within 10 s")
			}
			select {
			case <-gone:
			case <-time.After(10 * time.Second):
				t.Fatal("upstream handler never saw the disconnect")
			}
			resp.Body.Close()
			tr.mu.Lock()
			idle := len(tr.idle)
			tr.mu.Unlock()
			if idle != 0 {
				t.Fatalf("a cancelled connection went back to the pool (%d hosts idle)", idle)
			}
		})
	}
}

func TestH1CancelBeforeAnswer(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body) // the server watches for a disconnect once the body is read
		waitDone(r)
	})
	tr := newH1(t, TransportOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	done := make(chan error, 1)
	go func() {
		_, err := tr.RoundTrip(req)
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err %v, want the context's deadline", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("RoundTrip not unblocked by its context within 10 s")
	}
	s.waitClosed(t, 1)
}

func TestH1EarlyCloseIsNotReused(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, strings.Repeat("y", 100<<10))
	})
	tr := newH1(t, TransportOptions{})
	for range 2 {
		req, _ := http.NewRequest(http.MethodGet, s.URL+"/", nil)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Read(make([]byte, 10))
		resp.Body.Close() // unread bytes: the connection cannot carry another response
	}
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (a half-read one is closed, not reused)", n)
	}
}

func TestH1StaleIdleConnection(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tr := newH1(t, TransportOptions{})
	get := func() {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, s.URL+"/", strings.NewReader("{}"))
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
			t.Fatalf("body %q", b)
		}
		resp.Body.Close()
	}
	get()
	s.mu.Lock()
	s.last.Close() // the worker closes the idle keep-alive connection
	s.mu.Unlock()
	s.waitClosed(t, 1)
	get() // must not be written onto the dead connection
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}
}

func TestH1IdleSweep(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tr := newH1(t, TransportOptions{IdleTimeout: 100 * time.Millisecond})
	req, _ := http.NewRequest(http.MethodGet, s.URL+"/", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	resp.Body.Close()
	s.waitClosed(t, 1) // closed by the sweep, not by the server
}

func TestH1Errors(t *testing.T) {
	port, err := freeport.Pick() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/", strings.NewReader("{}"))
	if _, err := tr.RoundTrip(req); !IsDialError(err) {
		t.Fatalf("refused connect: %v, want a DialError", err)
	}

	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		hj, _, _ := w.(http.Hijacker).Hijack()
		hj.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"))
		hj.Close()
	})
	req, _ = http.NewRequest(http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("truncated body: %v, want unexpected EOF", err)
	}

	req, _ = http.NewRequest(http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	req.Header.Set("X-Bad", "a\r\nInjected: 1")
	if _, err := tr.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "invalid header") {
		t.Fatalf("header with CRLF: %v", err)
	}
}

func TestH1WroteRequestTrace(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tr := newH1(t, TransportOptions{})
	var wrote atomic.Int32
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) {
			if i.Err == nil {
				wrote.Add(1)
			}
		},
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if wrote.Load() != 1 {
		t.Fatalf("WroteRequest called %d times, want 1", wrote.Load())
	}
}

// wroteCtx is a request context that wants WroteRequest itself.
type wroteCtx struct {
	context.Context
	n atomic.Int32
}

func (w *wroteCtx) WroteRequest() { w.n.Add(1) }

// TestH1WroteRequestContext: H1Transport tells a WroteRequester context
// once its request is written, and not when the connection fails first.
func TestH1WroteRequestContext(t *testing.T) {
	if !TellsWroteRequest(NewH1Transport(TransportOptions{})) || TellsWroteRequest(http.DefaultTransport) {
		t.Fatalf("TellsWroteRequest: want true for H1Transport only")
	}
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	tr := newH1(t, TransportOptions{})
	ctx := &wroteCtx{Context: context.Background()}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if ctx.n.Load() != 1 {
		t.Fatalf("WroteRequest called %d times, want 1", ctx.n.Load())
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: the dial fails
	failed := &wroteCtx{Context: context.Background()}
	req, _ = http.NewRequestWithContext(failed, http.MethodPost, "http://"+addr+"/", strings.NewReader("{}"))
	if _, err := tr.RoundTrip(req); err == nil {
		t.Fatalf("a request to a closed port succeeded")
	}
	if failed.n.Load() != 0 {
		t.Errorf("WroteRequest called for a request never written")
	}
}

func TestH1FallsBackForUnknownLength(t *testing.T) {
	got := make(chan []string, 1)
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		got <- r.TransferEncoding
	})
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodPost, s.URL+"/", io.NopCloser(strings.NewReader("{}")))
	req.ContentLength = -1
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if te := <-got; len(te) != 1 || te[0] != "chunked" {
		t.Fatalf("transfer encoding %v, want chunked (net/http's transport)", te)
	}
}

func BenchmarkH1RoundTrip(b *testing.B) {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		io.WriteString(w, `{"choices":[{"text":"x"}]}`)
	}))
	defer s.Close()
	body := []byte(`{"model":"m","prompt":"hello","max_tokens":1}`)
	for _, tc := range []struct {
		name string
		rt   http.RoundTripper
	}{
		{"h1", NewH1Transport(TransportOptions{})},
		{"net-http", NewTransport(TransportOptions{})},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				req, _ := http.NewRequest(http.MethodPost, s.URL+"/v1/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := tc.rt.RoundTrip(req)
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			tc.rt.(interface{ CloseIdleConnections() }).CloseIdleConnections()
		})
	}
}

// An h1Conn holds its read buffer only while something is to be read:
// waitReadable waits for the worker's bytes (or its close, or a local
// close) without one and attaches it; detach gives it back only when
// nothing is buffered.
func TestH1ReadBufferOnlyWhileReading(t *testing.T) {
	nc, peer := tcpPair(t)
	c := newH1Conn(nc, nc.RemoteAddr().String())
	if c.attached || c.rc == nil {
		t.Fatalf("new connection: attached %v, raw conn %v; want no buffer yet", c.attached, c.rc != nil)
	}
	// wait runs waitReadable, bounded (a hang guard, not a timing claim).
	wait := func() {
		t.Helper()
		done := make(chan struct{})
		go func() { c.waitReadable(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("waitReadable did not return within 10 s")
		}
	}
	for _, tc := range []struct {
		name      string
		send      string
		read      int
		wantAfter bool // attached after detach
	}{
		{"all read: buffer given back", "hello", 5, false},
		{"bytes left: buffer kept", "ab", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := io.WriteString(peer, tc.send); err != nil {
				t.Fatal(err)
			}
			wait()
			if !c.attached {
				t.Fatal("no buffer attached after waitReadable")
			}
			got := make([]byte, tc.read)
			if _, err := io.ReadFull(c.br, got); err != nil || string(got) != tc.send[:tc.read] {
				t.Fatalf("read %q %v, want %q", got, err, tc.send[:tc.read])
			}
			c.detach()
			if c.attached != tc.wantAfter {
				t.Fatalf("attached %v after detach, want %v", c.attached, tc.wantAfter)
			}
		})
	}
	// what was left is still there; then the peer's close ends a wait
	wait()
	if b, err := c.br.ReadByte(); err != nil || b != 'b' {
		t.Fatalf("left byte %q %v, want 'b'", b, err)
	}
	peer.Close()
	wait()
	if _, err := c.br.ReadByte(); !errors.Is(err, io.EOF) {
		t.Fatalf("read after the peer closed: %v, want EOF", err)
	}
}

// TestH1WaitReadableKeepsReadErrors: waitReadable reads what arrived in its
// own callback; an error met there (a reset, the worker's close) reaches
// the reader as net.Conn's Read reports it, once, and a wait with nothing
// to read holds no buffer.
func TestH1WaitReadableKeepsReadErrors(t *testing.T) {
	for _, tc := range []struct {
		name  string
		end   func(peer *net.TCPConn)
		check func(err error) bool
	}{
		{"reset", func(peer *net.TCPConn) { _ = peer.SetLinger(0); peer.Close() }, func(err error) bool {
			var op *net.OpError
			return errors.As(err, &op) && op.Op == "read" && errors.Is(err, syscall.ECONNRESET)
		}},
		{"close", func(peer *net.TCPConn) { peer.Close() }, func(err error) bool { return err == io.EOF }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nc, peer := tcpPair(t)
			// The peer reads the request before it ends the connection, so
			// that a close is a FIN and not a reset.
			if _, err := nc.Write([]byte("x")); err != nil {
				t.Fatal(err)
			}
			if _, err := io.ReadFull(peer, make([]byte, 1)); err != nil {
				t.Fatal(err)
			}
			c := newH1Conn(nc, nc.RemoteAddr().String())
			done := make(chan struct{})
			go func() { c.waitReadable(); close(done) }()
			time.Sleep(20 * time.Millisecond) // parked: nothing has arrived
			tc.end(peer)
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("waitReadable did not return within 10 s")
			}
			_, err := c.br.ReadByte()
			if !tc.check(err) {
				t.Fatalf("read after the %s: %#v (%v)", tc.name, err, err)
			}
			if c.rawErr != nil {
				t.Fatalf("the error is kept after it was read: %v", c.rawErr)
			}
		})
	}
}

// TestAwaitBodyReportsArrived: AwaitBody returns once the body's first
// bytes arrived, with how many are there (its framing included), and -1
// for a body that is not H1Transport's.
func TestAwaitBodyReportsArrived(t *testing.T) {
	release := make(chan struct{})
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "hello")
	})
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodPost, s.URL+"/", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := make(chan int, 1)
	go func() { got <- AwaitBody(resp.Body) }()
	select {
	case n := <-got:
		t.Fatalf("AwaitBody returned %d before the body was sent", n)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	select {
	case n := <-got:
		if n != 5 {
			t.Fatalf("AwaitBody = %d, want 5 (the body arrived)", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("AwaitBody did not return within 10 s of the body")
	}
	if b, err := io.ReadAll(resp.Body); err != nil || string(b) != "hello" {
		t.Fatalf("body %q %v", b, err)
	}
	if n := AwaitBody(strings.NewReader("x")); n != -1 {
		t.Fatalf("AwaitBody of another body = %d, want -1", n)
	}
}

// tcpPair returns both ends of a loopback TCP connection, closed when the
// test ends.
func tcpPair(t *testing.T) (client net.Conn, peer *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := ln.Accept() // nil on failure
		accepted <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	peer, _ = (<-accepted).(*net.TCPConn)
	if peer == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { peer.Close() })
	return client, peer
}

// rawWorker is an upstream that runs serve on each accepted connection
// (i counts them from 1) and reports each one it closed.
type rawWorker struct {
	addr   string
	conns  atomic.Int32
	reqs   atomic.Int32 // requests read by readReq
	closed chan int
}

func newRawWorker(t *testing.T, serve func(w *rawWorker, i int, c net.Conn, br *bufio.Reader)) *rawWorker {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	w := &rawWorker{addr: ln.Addr().String(), closed: make(chan int, 16)}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			i := int(w.conns.Add(1))
			wg.Add(1)
			go func() {
				defer wg.Done()
				serve(w, i, c, bufio.NewReader(c))
				c.Close()
				w.closed <- i
			}()
		}
	}()
	return w
}

// readReq reads one request and its body: false when the connection ended.
func (w *rawWorker) readReq(br *bufio.Reader) (string, bool) {
	r, err := http.ReadRequest(br)
	if err != nil {
		return "", false
	}
	b, err := io.ReadAll(r.Body)
	if err != nil {
		return "", false
	}
	w.reqs.Add(1)
	return string(b), true
}

func answer(c net.Conn, body string) {
	fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// TestH1ResendsOnClosedPooledConnection: a request written on a pooled
// connection the worker had closed, and answered by nothing, is written
// again on a new connection when its body can be produced again (the
// pooled connection was then taken without a peek); a body that cannot be
// is never written on such a connection (the peek finds it closed). A
// fresh connection, or one that carried part of an answer, is never
// resent on.
func TestH1ResendsOnClosedPooledConnection(t *testing.T) {
	const body = `{"prompt":"hi"}`
	// Each worker answers its first connection's first request; what the
	// first connection does next is the case.
	answerThen := func(next func(w *rawWorker, c net.Conn, br *bufio.Reader)) func(*rawWorker, int, net.Conn, *bufio.Reader) {
		return func(w *rawWorker, i int, c net.Conn, br *bufio.Reader) {
			if i > 1 { // later connections answer every request
				for {
					b, ok := w.readReq(br)
					if !ok {
						return
					}
					answer(c, "again:"+b)
				}
			}
			if b, ok := w.readReq(br); ok {
				answer(c, "first:"+b)
				next(w, c, br)
			}
		}
	}
	closeIdle := func(*rawWorker, net.Conn, *bufio.Reader) {}                             // closes it idle
	closeUnanswered := func(w *rawWorker, c net.Conn, br *bufio.Reader) { w.readReq(br) } // takes the request, no answer
	partial := func(w *rawWorker, c net.Conn, br *bufio.Reader) {
		if _, ok := w.readReq(br); ok {
			io.WriteString(c, "HTTP/1.1 200 OK\r\n")
		}
	}
	newBody := map[string]func() (io.ReadCloser, func() (io.ReadCloser, error)){
		"bytes": func() (io.ReadCloser, func() (io.ReadCloser, error)) { return newBytesBody([]byte(body)), nil },
		"getbody": func() (io.ReadCloser, func() (io.ReadCloser, error)) {
			return io.NopCloser(strings.NewReader(body)), func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader(body)), nil }
		},
		"once": func() (io.ReadCloser, func() (io.ReadCloser, error)) {
			return io.NopCloser(strings.NewReader(body)), nil
		},
		"released": func() (io.ReadCloser, func() (io.ReadCloser, error)) {
			return &releasingBody{b: []byte(body), orig: []byte(body), keep: true}, nil
		},
		"unkept": func() (io.ReadCloser, func() (io.ReadCloser, error)) {
			return &releasingBody{b: []byte(body), orig: []byte(body)}, nil
		},
	}
	for _, tc := range []struct {
		name, body string
		next       func(*rawWorker, net.Conn, *bufio.Reader)
		idle       bool // the worker closes the connection idle, before the second request
		wantErr    bool
		resends    uint64
		reqs       int32 // requests the worker read
	}{
		{"closed idle, proxy's body", "bytes", closeIdle, true, false, 1, 2},
		{"closed idle, GetBody", "getbody", closeIdle, true, false, 1, 2},
		{"closed idle, body read once", "once", closeIdle, true, false, 0, 2}, // the peek
		{"taken and closed unanswered, proxy's body", "bytes", closeUnanswered, false, false, 1, 3},
		{"taken and closed unanswered, body read once", "once", closeUnanswered, false, true, 0, 2},
		{"part of an answer", "bytes", partial, false, true, 0, 2},
		// A body that cannot be read again once written (ResendableBody):
		// resent from Reopen, or not at all when it says it cannot be.
		{"closed idle, body let go once written", "released", closeIdle, true, false, 1, 2},
		{"taken and closed unanswered, body let go once written", "released", closeUnanswered, false, false, 1, 3},
		{"closed idle, body not to be kept", "unkept", closeIdle, true, false, 0, 2}, // the peek
		{"taken and closed unanswered, body not to be kept", "unkept", closeUnanswered, false, true, 0, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := newRawWorker(t, answerThen(tc.next))
			tr := newH1(t, TransportOptions{})
			send := func() (string, error) {
				rb, gb := newBody[tc.body]()
				req, _ := http.NewRequest(http.MethodPost, "http://"+w.addr+"/v1/completions", rb)
				req.ContentLength, req.GetBody = int64(len(body)), gb
				resp, err := tr.RoundTrip(req)
				if err != nil {
					return "", err
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				return string(b), err
			}
			if got, err := send(); err != nil || got != "first:"+body {
				t.Fatalf("first request: %q %v", got, err)
			}
			if tc.idle {
				select {
				case <-w.closed:
				case <-time.After(10 * time.Second):
					t.Fatal("the worker did not close its connection within 10 s")
				}
				time.Sleep(10 * time.Millisecond) // its FIN arrived
			}
			got, err := send()
			switch {
			case tc.wantErr && err == nil:
				t.Fatalf("second request answered %q, want an error", got)
			case !tc.wantErr && (err != nil || got != "again:"+body):
				t.Fatalf("second request: %q %v, want the answer on a new connection", got, err)
			}
			if n := tr.Resends(); n != tc.resends {
				t.Fatalf("%d resends, want %d", n, tc.resends)
			}
			if n := w.reqs.Load(); n != tc.reqs {
				t.Fatalf("the worker read %d requests, want %d", n, tc.reqs)
			}
		})
	}
}

// TestH1FreshConnectionIsNotResent: a worker that takes a request on a new
// connection and closes it unanswered fails the request: only a pooled
// connection's close says the worker never processed it.
func TestH1FreshConnectionIsNotResent(t *testing.T) {
	w := newRawWorker(t, func(w *rawWorker, _ int, _ net.Conn, br *bufio.Reader) { w.readReq(br) })
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodPost, "http://"+w.addr+"/v1/completions", newBytesBody([]byte("{}")))
	req.ContentLength = 2
	if resp, err := tr.RoundTrip(req); err == nil {
		resp.Body.Close()
		t.Fatalf("answered %d, want an error", resp.StatusCode)
	}
	if n, c := tr.Resends(), w.conns.Load(); n != 0 || c != 1 {
		t.Fatalf("%d resends over %d connections, want none over 1", n, c)
	}
}

// releasingBody is a ResendableBody that cannot be read once closed:
// a resend must come from Reopen, which gives it again when keep.
type releasingBody struct {
	b, orig []byte
	off     int
	keep    bool
}

func (rb *releasingBody) Read(p []byte) (int, error) {
	if rb.b == nil {
		return 0, errors.New("read after close")
	}
	if rb.off >= len(rb.b) {
		return 0, io.EOF
	}
	n := copy(p, rb.b[rb.off:])
	rb.off += n
	return n, nil
}

func (rb *releasingBody) Close() error { rb.b = nil; return nil }

func (rb *releasingBody) Resendable() bool { return rb.keep && rb.b != nil && rb.off == 0 }

func (rb *releasingBody) Reopen() io.ReadCloser {
	return &releasingBody{b: rb.orig, orig: rb.orig, keep: rb.keep}
}

// servedResponse is H1Transport's response to a request that serve
// answers on a raw connection; serve may wait for checked, which the
// caller closes once it has looked at the response.
func servedResponse(t *testing.T, serve func(c net.Conn, checked <-chan struct{}), checked <-chan struct{}) *http.Response {
	t.Helper()
	w := newRawWorker(t, func(w *rawWorker, _ int, c net.Conn, br *bufio.Reader) {
		if _, ok := w.readReq(br); ok {
			serve(c, checked)
		}
	})
	tr := newH1(t, TransportOptions{})
	req, _ := http.NewRequest(http.MethodGet, "http://"+w.addr+"/v1/completions", nil)
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// TestBodyBuffered: a short answer that came with its head is buffered in
// full (Relay arms no idle timeout for it); a body still on its way, a
// chunked one, one read to its end and other readers are not.
func TestBodyBuffered(t *testing.T) {
	const body = `{"id":"cmpl-1","choices":[{"text":" a"}]}`
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn, checked <-chan struct{})
		want  bool
	}{
		{"with its head", func(c net.Conn, _ <-chan struct{}) { answer(c, body) }, true},
		{"after its head", func(c net.Conn, checked <-chan struct{}) {
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n", len(body))
			<-checked
			io.WriteString(c, body)
		}, false},
		{"chunked", func(c net.Conn, _ <-chan struct{}) {
			fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n", len(body), body)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checked := make(chan struct{})
			resp := servedResponse(t, tc.serve, checked)
			got := BodyBuffered(resp.Body)
			close(checked)
			if got != tc.want {
				t.Fatalf("BodyBuffered = %v, want %v", got, tc.want)
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil || string(b) != body {
				t.Fatalf("body %q %v", b, err)
			}
			if BodyBuffered(resp.Body) {
				t.Fatal("a body read to its end reports itself buffered")
			}
		})
	}
	if BodyBuffered(strings.NewReader(body)) {
		t.Fatal("a reader that is not the transport's reports itself buffered")
	}
}

// sseHead is a stream's head, as uvicorn frames it (chunked).
const sseHead = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

// sseChunk is one event as a chunk.
func sseChunk(ev string) string { return fmt.Sprintf("%x\r\n%s\r\n", len(ev), ev) }

// TestBodyArrived: a body whose first bytes came with the head has
// arrived (length-framed or chunked); one still on its way, one read to
// its end and other readers have not. A stream's head is flushed alone
// only when its first token is not there yet (respondHead): one write
// less when it is.
func TestBodyArrived(t *testing.T) {
	const ev = "data: {\"choices\":[{\"text\":\" a\"}]}\n\n"
	for _, tc := range []struct {
		name    string
		serve   func(c net.Conn, checked <-chan struct{})
		want    bool
		flushes int // respondHead's flushes of the head alone
	}{
		{"stream, first event with its head", func(c net.Conn, _ <-chan struct{}) {
			io.WriteString(c, sseHead+sseChunk(ev)+"0\r\n\r\n")
		}, true, 0},
		{"stream, first event after its head", func(c net.Conn, checked <-chan struct{}) {
			io.WriteString(c, sseHead)
			<-checked
			io.WriteString(c, sseChunk(ev)+"0\r\n\r\n")
		}, false, 1},
		{"length-framed, with its head", func(c net.Conn, _ <-chan struct{}) { answer(c, ev) }, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checked := make(chan struct{})
			resp := servedResponse(t, tc.serve, checked)
			got := BodyArrived(resp.Body)
			fw := &flushCounter{ResponseWriter: httptest.NewRecorder()}
			(&Regular{}).respondHead(fw, &reqSpec{sse: true}, resp)
			close(checked)
			if got != tc.want || fw.flushes != tc.flushes {
				t.Fatalf("BodyArrived = %v, want %v; respondHead flushed the head alone %d times, want %d", got, tc.want, fw.flushes, tc.flushes)
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil || string(b) != ev {
				t.Fatalf("body %q %v", b, err)
			}
			if BodyArrived(resp.Body) {
				t.Fatal("a body read to its end reports itself arrived")
			}
		})
	}
	if BodyArrived(strings.NewReader(ev)) {
		t.Fatal("a reader that is not the transport's reports itself arrived")
	}
}

// flushCounter counts the flushes http.ResponseController makes.
type flushCounter struct {
	http.ResponseWriter
	flushes int
}

func (f *flushCounter) FlushError() error { f.flushes++; return nil }

// TestH1BurstBuffer: an event stream that arrives faster than it is read
// moves its connection to the burst buffer (one read takes what four
// small ones did), carrying what the small buffer held across the move;
// a read that fits the small buffer moves it back; while more than
// burstStreams streams are open it stays small. The bytes are the
// worker's either way.
func TestH1BurstBuffer(t *testing.T) {
	var burst, want strings.Builder
	for i := range 150 { // about 40 KiB of events: no boundary falls on 4 KiB
		ev := fmt.Sprintf("data: {\"choices\":[{\"text\":\" token %d %s\"}]}\n\n", i, strings.Repeat("y", 200+i%37))
		burst.WriteString(sseChunk(ev))
		want.WriteString(ev)
	}
	const tail = "data: [DONE]\n\n"
	for _, tc := range []struct {
		name  string
		open  int64 // streams counted open besides this one
		grows bool
		size  int // the largest read buffer the connection had
	}{
		{"grows", 0, true, h1BurstBuffer},
		{"too many open streams", burstStreams, false, h1ReadBuffer},
	} {
		t.Run(tc.name, func(t *testing.T) {
			openStreams.Add(tc.open + 1) // as Relay counts this stream
			defer openStreams.Add(-tc.open - 1)
			checked, end := make(chan struct{}), make(chan struct{})
			resp := servedResponse(t, func(c net.Conn, checked <-chan struct{}) {
				io.WriteString(c, sseHead+burst.String())
				<-checked
				io.WriteString(c, sseChunk(tail))
				<-end
				io.WriteString(c, "0\r\n\r\n")
			}, checked)
			closeChecked, closeEnd := sync.OnceFunc(func() { close(checked) }), sync.OnceFunc(func() { close(end) })
			t.Cleanup(func() { closeChecked(); closeEnd() }) // before the worker's: a failure ends it too
			b := resp.Body.(*h1Body)
			got := make([]byte, 0, want.Len()+len(tail))
			p := make([]byte, burstBufSize)
			size, grew := 0, false
			for len(got) < want.Len() {
				n, err := b.Read(p)
				if err != nil {
					t.Fatalf("after %d bytes: %v", len(got), err)
				}
				got, size, grew = append(got, p[:n]...), max(size, b.c.br.Size()), grew || b.c.burst
			}
			if string(got) != want.String() {
				t.Fatalf("the burst arrived altered (%d bytes, want %d)", len(got), want.Len())
			}
			if grew != tc.grows || size != tc.size {
				t.Fatalf("burst buffer taken %v (want %v), read buffer up to %d bytes (want %d)", grew, tc.grows, size, tc.size)
			}
			closeChecked()
			if n, err := io.ReadFull(b, p[:len(tail)]); err != nil || string(p[:n]) != tail {
				t.Fatalf("after the burst: %q %v", p[:n], err)
			}
			b.c.resize() // as the next Read does
			if b.c.burst || !b.c.attached {
				t.Fatalf("after a small read: burst buffer %v, attached %v", b.c.burst, b.c.attached)
			}
			closeEnd()
			if rest, err := io.ReadAll(b); err != nil || len(rest) != 0 {
				t.Fatalf("the end: %q %v", rest, err)
			}
		})
	}
}

// TestH1BurstBufferRandom: events of random sizes, written in random
// groups with pauses, read with random buffer sizes, arrive byte for byte
// while the connection's buffer moves between sizes (and carries what it
// holds across each move).
func TestH1BurstBufferRandom(t *testing.T) {
	openStreams.Add(1)
	defer openStreams.Add(-1)
	for seed := range int64(12) {
		rng, wrng := rand.New(rand.NewPCG(uint64(seed), 16)), rand.New(rand.NewPCG(uint64(seed), 17)) // the reader's, the worker's
		var writes []string
		var want strings.Builder
		for range 40 {
			var w strings.Builder
			for range 1 + rng.IntN(30) {
				ev := "data: " + strings.Repeat(string(rune('a'+rng.IntN(26))), 1+rng.IntN(3000)) + "\n\n"
				w.WriteString(sseChunk(ev))
				want.WriteString(ev)
			}
			writes = append(writes, w.String())
		}
		resp := servedResponse(t, func(c net.Conn, _ <-chan struct{}) {
			io.WriteString(c, sseHead)
			for _, w := range writes {
				io.WriteString(c, w)
				if wrng.IntN(3) == 0 {
					time.Sleep(time.Duration(wrng.IntN(300)) * time.Microsecond)
				}
			}
			io.WriteString(c, "0\r\n\r\n")
		}, nil)
		var got []byte
		sizes := map[int]bool{}
		for {
			p := make([]byte, 1+rng.IntN(40<<10))
			n, err := resp.Body.Read(p)
			got = append(got, p[:n]...)
			if err == nil {
				sizes[resp.Body.(*h1Body).c.br.Size()] = true
			}
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatalf("seed %d: after %d bytes: %v", seed, len(got), err)
			}
		}
		if string(got) != want.String() {
			t.Fatalf("seed %d: %d bytes arrived, want %d, first difference at %d", seed, len(got), want.Len(), firstDiff(got, want.String()))
		}
		if !sizes[h1BurstBuffer] {
			t.Fatalf("seed %d: the burst buffer was never taken (%v)", seed, sizes)
		}
	}
}

func firstDiff(a []byte, b string) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
