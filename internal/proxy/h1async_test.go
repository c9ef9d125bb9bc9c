package proxy

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"
)

// heldUpstream accepts connections on one goroutine and answers none until
// the test does: requests wait in the kernel's buffers, so nothing on the
// upstream side parks a goroutine per request.
type heldUpstream struct {
	ln    net.Listener
	conns chan net.Conn
}

func newHeldUpstream(t *testing.T) *heldUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &heldUpstream{ln: ln, conns: make(chan net.Conn, 1024)}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(u.conns)
				return
			}
			u.conns <- c
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for c := range u.conns {
			c.Close()
		}
	})
	return u
}

// next returns the next accepted connection with the request it carries
// read (bounded).
func (u *heldUpstream) next(t *testing.T) (net.Conn, *http.Request) {
	t.Helper()
	select {
	case c := <-u.conns:
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, req.Body)
		return c, req
	case <-time.After(10 * time.Second):
		t.Fatal("no connection within 10 s")
		return nil, nil
	}
}

type asyncResult struct {
	resp *http.Response
	err  error
	body string
}

// asyncCall sends req through RoundTripAsync; the response (body read) or
// the error arrives on the channel. It fails the test when RoundTripAsync
// does not return within 5 s (it waited for the answer).
func asyncCall(t *testing.T, tr *H1Transport, req *http.Request) <-chan asyncResult {
	t.Helper()
	ch := make(chan asyncResult, 1)
	returned := make(chan struct{})
	go func() {
		tr.RoundTripAsync(req, func(resp *http.Response, err error) {
			r := asyncResult{resp: resp, err: err}
			if err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				r.body = string(b)
			}
			ch <- r
		})
		close(returned)
	}()
	select {
	case <-returned:
	case <-time.After(5 * time.Second):
		t.Fatal("RoundTripAsync did not return within 5 s: it waited for the response")
	}
	return ch
}

func waitResult(t *testing.T, ch <-chan asyncResult) asyncResult {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("done not called within 10 s")
		return asyncResult{}
	}
}

func postReq(t *testing.T, ctx context.Context, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"prompt":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

const okAnswer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"

// While responses are awaited, RoundTripAsync holds no goroutine per
// request; each answer then reaches its own done.
func TestRoundTripAsyncHoldsNoGoroutineWhileWaiting(t *testing.T) {
	u := newHeldUpstream(t)
	tr := NewH1Transport(TransportOptions{})
	defer tr.Close()
	if tr.poller() == nil {
		t.Skip("no epoll set on this system")
	}
	url := "http://" + u.ln.Addr().String() + "/v1/completions"
	const n = 64
	runtime.GC()
	before := runtime.NumGoroutine()
	chans := make([]<-chan asyncResult, n)
	for i := range n {
		chans[i] = asyncCall(t, tr, postReq(t, context.Background(), url))
	}
	conns := make([]net.Conn, n)
	for i := range n {
		conns[i], _ = u.next(t)
	}
	time.Sleep(50 * time.Millisecond) // let the senders' goroutines end
	if extra := runtime.NumGoroutine() - before; extra > 8 {
		t.Fatalf("%d goroutines more than before with %d responses awaited (want none per request)", extra, n)
	}
	for _, c := range conns {
		if _, err := io.WriteString(c, okAnswer); err != nil {
			t.Fatal(err)
		}
	}
	for i, ch := range chans {
		r := waitResult(t, ch)
		if r.err != nil || r.resp.StatusCode != 200 || r.body != `{"ok":true}` {
			t.Fatalf("request %d: %v, %+v, body %q", i, r.err, r.resp, r.body)
		}
	}
}

// One connection serves async requests one after another (it leaves the
// epoll set after each), and an answer already there when the request is
// registered is not missed.
func TestRoundTripAsyncReusesConnection(t *testing.T) {
	s := newH1Server(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte("answer " + r.URL.Query().Get("i")))
	})
	tr := NewH1Transport(TransportOptions{})
	defer tr.Close()
	for i := range 20 {
		is := string(rune('a' + i))
		r := waitResult(t, asyncCall(t, tr, postReq(t, context.Background(), s.URL+"/x?i="+is)))
		if r.err != nil || r.body != "answer "+is {
			t.Fatalf("request %d: %v, body %q", i, r.err, r.body)
		}
	}
	if c := s.conns.Load(); c != 1 {
		t.Fatalf("%d connections for 20 sequential requests, want 1", c)
	}
}

// A wait ends with the request's context, with a worker that closes the
// connection without answering, and goes on when the transport is closed.
func TestRoundTripAsyncEnds(t *testing.T) {
	u := newHeldUpstream(t)
	url := "http://" + u.ln.Addr().String() + "/"
	t.Run("context cancelled", func(t *testing.T) {
		tr := NewH1Transport(TransportOptions{})
		defer tr.Close()
		ctx, cancel := context.WithCancel(context.Background())
		ch := asyncCall(t, tr, postReq(t, ctx, url))
		c, _ := u.next(t)
		defer c.Close()
		cancel()
		if r := waitResult(t, ch); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", r.err)
		}
	})
	t.Run("context deadline", func(t *testing.T) {
		tr := NewH1Transport(TransportOptions{})
		defer tr.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		ch := asyncCall(t, tr, postReq(t, ctx, url))
		c, _ := u.next(t)
		defer c.Close()
		if r := waitResult(t, ch); !errors.Is(r.err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want context.DeadlineExceeded", r.err)
		}
	})
	t.Run("worker closes", func(t *testing.T) {
		tr := NewH1Transport(TransportOptions{})
		defer tr.Close()
		ch := asyncCall(t, tr, postReq(t, context.Background(), url))
		c, _ := u.next(t)
		c.Close()
		if r := waitResult(t, ch); r.err == nil {
			t.Fatalf("no error for a worker that closed without answering: %+v", r.resp)
		}
	})
	t.Run("transport closed while waiting", func(t *testing.T) {
		tr := NewH1Transport(TransportOptions{})
		ch := asyncCall(t, tr, postReq(t, context.Background(), url))
		c, _ := u.next(t)
		defer c.Close()
		tr.Close()
		if _, err := io.WriteString(c, okAnswer); err != nil {
			t.Fatal(err)
		}
		if r := waitResult(t, ch); r.err != nil || r.body != `{"ok":true}` {
			t.Fatalf("after Close: %v, body %q", r.err, r.body)
		}
		// later calls wait on the caller's goroutine, on a new connection
		// (a closed transport pools none)
		done := make(chan asyncResult, 1)
		go tr.RoundTripAsync(postReq(t, context.Background(), url), func(resp *http.Response, err error) {
			done <- asyncResult{resp: resp, err: err}
		})
		c2, _ := u.next(t)
		defer c2.Close()
		io.WriteString(c2, okAnswer)
		if r := waitResult(t, done); r.err != nil || r.resp.StatusCode != 200 {
			t.Fatalf("after Close, a new request: %v", r.err)
		}
	})
	t.Run("dial error", func(t *testing.T) {
		tr := NewH1Transport(TransportOptions{})
		defer tr.Close()
		r := waitResult(t, asyncCall(t, tr, postReq(t, context.Background(), deadURL(t))))
		if !IsDialError(r.err) {
			t.Fatalf("err = %v, want a dial error", r.err)
		}
	})
}
