package h1server

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// startH1 serves h with an h1server.Server on 127.0.0.1; cleanup closes it.
func startH1(t testing.TB, h http.Handler, cfg func(*Server)) (*Server, string) {
	t.Helper()
	s := &Server{Handler: h, ErrorLog: log.New(io.Discard, "", 0)}
	if cfg != nil {
		cfg(s)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(l) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("Serve returned %v, want ErrServerClosed", err)
		}
	})
	return s, l.Addr().String()
}

// startStd serves h with net/http's Server configured like startH1's.
func startStd(t testing.TB, h http.Handler, cfg func(*http.Server)) string {
	t.Helper()
	s := &http.Server{Handler: h, ErrorLog: log.New(io.Discard, "", 0)}
	if cfg != nil {
		cfg(s)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- s.Serve(l) }()
	t.Cleanup(func() {
		s.Close()
		<-done
	})
	return l.Addr().String()
}

func dial(t testing.TB, addr string) *net.TCPConn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c.(*net.TCPConn)
}

// exchange sends steps on one connection: each but the last is followed by
// reading one response; after the last the client half-closes and reads
// until the server closes. It returns every byte received.
func exchange(t *testing.T, addr string, steps []string) string {
	t.Helper()
	c := dial(t, addr)
	var got bytes.Buffer
	br := bufio.NewReader(io.TeeReader(c, &got))
	for i, step := range steps {
		writeDone := make(chan error, 1)
		go func() { _, err := io.WriteString(c, step); writeDone <- err }()
		if i < len(steps)-1 {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("step %d: %v", i, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			<-writeDone
			continue
		}
		if err := <-writeDone; err != nil {
			t.Logf("write: %v", err)
		}
		c.CloseWrite()
		if _, err := io.Copy(io.Discard, br); err != nil {
			t.Logf("read: %v", err)
		}
	}
	return got.String()
}

// dropDate removes Date header lines.
func dropDate(s string) string {
	var b strings.Builder
	for line := range strings.SplitAfterSeq(s, "\r\n") {
		if !strings.HasPrefix(line, "Date: ") {
			b.WriteString(line)
		}
	}
	return b.String()
}
