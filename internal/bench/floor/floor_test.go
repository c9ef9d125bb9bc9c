package floor

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestMessageLen(t *testing.T) {
	for _, tc := range []struct {
		name       string
		in         string
		needLength bool
		want       int
		err        bool
	}{
		{"partial head", "POST / HTTP/1.1\r\nContent-Length: 2\r\n", false, 0, false},
		{"partial body", "POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nx", false, 0, false},
		{"whole", "POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nxy", false, 40, false},
		{"whole and the next", "POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\nxyGET", false, 40, false},
		{"no body", "GET / HTTP/1.1\r\nHost: a\r\n\r\n", false, 27, false},
		{"response needs a length", "HTTP/1.1 200 OK\r\nHost: a\r\n\r\n", true, 0, true},
		{"chunked", "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", false, 0, true},
		{"two lengths", "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", false, 0, true},
		{"bad length", "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", false, 0, true},
		{"too large", "POST / HTTP/1.1\r\nContent-Length: 2000000\r\n\r\n", false, 0, true},
		{"head never ends", "POST / HTTP/1.1\r\nX: " + strings.Repeat("a", maxMessage), false, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := messageLen([]byte(tc.in), tc.needLength)
			if (err != nil) != tc.err || got != tc.want {
				t.Fatalf("messageLen = %d, %v; want %d, error %v", got, err, tc.want, tc.err)
			}
		})
	}
}

// upstream is a net/http server that answers each POST with a body
// naming the request's body and a per-request count.
func upstream(t *testing.T) (addr string, seen func() int) {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	n := 0
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if string(b) == "slow" {
			time.Sleep(100 * time.Millisecond)
		}
		mu.Lock()
		n++
		mu.Unlock()
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprintf(w, "echo:%s", b)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().String(), func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// start runs the floor proxy of mode in front of up and returns its
// address; the test's cleanup stops it and checks that it returned.
func start(t *testing.T, mode, up string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	addrc := make(chan string, 1)
	switch mode {
	case "goroutine", "stdlib":
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrc <- ln.Addr().String()
		serve := Serve
		if mode == "stdlib" {
			serve = ServeStdlib
		}
		go func() { done <- serve(ctx, ln, up) }()
	case "loop":
		go func() { done <- ServeLoop(ctx, "127.0.0.1:0", up, func(a net.Addr) { addrc <- a.String() }) }()
	}
	var addr string
	select {
	case addr = <-addrc:
	case err := <-done:
		t.Fatalf("%s: returned before it listened: %v", mode, err)
	}
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: %v", mode, err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("%s: did not return after its context ended", mode)
		}
	})
	return addr
}

func TestRelaysRequestsAndResponses(t *testing.T) {
	for _, mode := range []string{"goroutine", "loop", "stdlib"} {
		t.Run(mode, func(t *testing.T) {
			up, seen := upstream(t)
			addr := start(t, mode, up)
			tr := &http.Transport{MaxIdleConnsPerHost: 8}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			var wg sync.WaitGroup
			errs := make(chan error, 64)
			for g := range 8 {
				wg.Go(func() {
					for i := range 8 {
						body := fmt.Sprintf("g%d-r%d", g, i)
						resp, err := c.Post("http://"+addr+"/v1/completions", "application/json", strings.NewReader(body))
						if err != nil {
							errs <- err
							return
						}
						b, err := io.ReadAll(resp.Body)
						resp.Body.Close()
						if err != nil || string(b) != "echo:"+body || resp.StatusCode != 200 {
							errs <- fmt.Errorf("%s: status %d body %q (%v)", body, resp.StatusCode, b, err)
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			if n := seen(); n != 64 {
				t.Errorf("upstream served %d requests, want 64", n)
			}
		})
	}
}

// TestPipelinedRequests: two requests in one write are answered in order.
func TestPipelinedRequests(t *testing.T) {
	for _, mode := range []string{"goroutine", "loop", "stdlib"} {
		t.Run(mode, func(t *testing.T) {
			up, _ := upstream(t)
			c, err := net.Dial("tcp4", start(t, mode, up))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			req := "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n"
			if _, err := io.WriteString(c, req+"a"+req+"b"); err != nil {
				t.Fatal(err)
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			br := bufio.NewReader(c)
			for _, want := range []string{"echo:a", "echo:b"} {
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				if string(b) != want {
					t.Errorf("body %q, want %q", b, want)
				}
			}
		})
	}
}

// TestUnframedRequestEndsTheConnection: a chunked request is not relayed.
func TestUnframedRequestEndsTheConnection(t *testing.T) {
	for _, mode := range []string{"goroutine", "loop"} {
		t.Run(mode, func(t *testing.T) {
			up, seen := upstream(t)
			c, err := net.Dial("tcp4", start(t, mode, up))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n")
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			b, err := io.ReadAll(c)
			if err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
				t.Fatalf("read: %v", err)
			}
			if len(b) != 0 || seen() != 0 {
				t.Errorf("got %q, upstream served %d; want the connection closed unanswered", b, seen())
			}
		})
	}
}

// TestClientGoneMidRequest: a client that leaves before its answer costs
// only its own connection; the next client is served.
func TestClientGoneMidRequest(t *testing.T) {
	for _, mode := range []string{"goroutine", "loop", "stdlib"} {
		t.Run(mode, func(t *testing.T) {
			up, seen := upstream(t)
			addr := start(t, mode, up)
			c, err := net.Dial("tcp4", addr)
			if err != nil {
				t.Fatal(err)
			}
			io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nslow")
			c.Close()
			time.Sleep(300 * time.Millisecond) // the answer found its client gone
			cl := &http.Client{Timeout: 10 * time.Second}
			for i := range 3 {
				resp, err := cl.Post("http://"+addr+"/", "text/plain", strings.NewReader("next"))
				if err != nil {
					t.Fatalf("request %d after the gone client: %v", i, err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if string(b) != "echo:next" {
					t.Fatalf("request %d: body %q", i, b)
				}
			}
			if n := seen(); n != 4 {
				t.Errorf("upstream served %d requests, want 4", n)
			}
		})
	}
}

func isReset(err error) bool {
	return err != nil && bytes.Contains([]byte(err.Error()), []byte("reset"))
}

func TestMainFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{}, "--upstream is required"},
		{[]string{"--upstream", "localhost:1"}, "not an IPv4 host:port"},
		{[]string{"--upstream", "127.0.0.1:1", "--mode", "threads"}, "--mode must be goroutine, loop or stdlib"},
		{[]string{"--upstream", "127.0.0.1:1", "extra"}, "unexpected argument"},
	} {
		err := Main(context.Background(), tc.args, io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Main(%q) = %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

// TestStdlibRelaysEachEvent: the stdlib shape passes a chunked event
// stream through event by event. The worker sends its second event only
// once the client has read the first, so a proxy that held the first
// back (until more arrived or the stream ended) stalls the test.
func TestStdlibRelaysEachEvent(t *testing.T) {
	next := make(chan struct{})
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-next:
			case <-r.Context().Done():
				return
			}
		}
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	addr := start(t, "stdlib", ln.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/completions", strings.NewReader("{}"))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if te := resp.TransferEncoding; len(te) != 1 || te[0] != "chunked" {
		t.Errorf("transfer encoding %q, want chunked", te)
	}
	br := bufio.NewReader(resp.Body)
	for i := range 3 {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if want := fmt.Sprintf("data: %d\n", i); line != want {
			t.Fatalf("event %d: %q, want %q", i, line, want)
		}
		if _, err := br.ReadString('\n'); err != nil { // the blank line
			t.Fatal(err)
		}
		if i < 2 {
			next <- struct{}{}
		}
	}
	next <- struct{}{}
	if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
		t.Errorf("after the events: %q, %v", rest, err)
	}
}
