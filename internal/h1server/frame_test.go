package h1server

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
)

// writeCalls is the process's count of write system calls so far
// (/proc/self/io syscw: one per write or writev); -1 when unknown.
func writeCalls() int {
	b, err := os.ReadFile("/proc/self/io")
	if err != nil {
		return -1
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "syscw: "); ok {
			if n, err := strconv.Atoi(v); err == nil {
				return n
			}
		}
	}
	return -1
}

// TestLargeWriteOneSystemCall: a body write larger than the server's
// output buffer goes out with what is queued before it (the head) and its
// chunk frame in one system call. It was three for a chunked body (the
// head and size line, the bytes, the closing CRLF at the flush) and two
// for a sized one. The client, in this process too, sits in a read while
// the handler writes, so the count is the handler's alone (no test in
// this package runs in parallel).
func TestLargeWriteOneSystemCall(t *testing.T) {
	if writeCalls() < 0 {
		t.Skip("no write count in /proc/self/io")
	}
	body := bytes.Repeat([]byte("0123456789abcdef"), 768) // 12 KiB: over the 8 KiB buffer, within loopback's send buffer
	for _, tc := range []struct {
		name  string
		sized bool
	}{
		{"chunked", false},
		{"content-length", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A write of another goroutine of the process (a server of an
			// earlier test closing) could land in the window: the best of 3.
			best := 0
			for attempt := 0; attempt < 3 && best != 1; attempt++ {
				best = largeWriteCalls(t, body, tc.sized)
			}
			if best != 1 {
				t.Errorf("the head and a 12 KiB body write took %d write system calls, want 1", best)
			}
		})
	}
}

// largeWriteCalls serves one response whose handler writes body in one
// Write and flushes, checks what the client receives, and returns the
// write system calls made between the handler's Write and its Flush's end.
func largeWriteCalls(t *testing.T, body []byte, sized bool) int {
	t.Helper()
	calls := make(chan int, 1)
	_, addr := startH1(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if sized {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		}
		before := writeCalls()
		_, _ = w.Write(body)
		w.(http.Flusher).Flush()
		calls <- writeCalls() - before
	}), nil)
	c := dial(t, addr)
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(resp.Body)
	if err != nil || !bytes.Equal(got, body) {
		t.Fatalf("body: %d bytes, %v; want the %d written", len(got), err, len(body))
	}
	if chunked := len(resp.TransferEncoding) > 0; chunked == sized {
		t.Errorf("transfer encoding %v, sized %v", resp.TransferEncoding, sized)
	}
	return <-calls
}
