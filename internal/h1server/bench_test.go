package h1server

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// BenchmarkServe: a keep-alive loopback client posting a 200-byte JSON body
// to a handler answering 300 bytes of JSON, on h1server and on net/http.
func BenchmarkServe(b *testing.B) {
	h := http.HandlerFunc(jsonHandler)
	servers := []struct {
		name  string
		start func(testing.TB) string
	}{
		{"h1server", func(tb testing.TB) string { _, a := startH1(tb, h, nil); return a }},
		{"net-http", func(tb testing.TB) string { return startStd(tb, h, nil) }},
	}
	body := `{"model":"m","prompt":"` + strings.Repeat("p", 200-41) + `","max_tokens":16}`
	req := []byte(fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body))
	if len(body) != 200 {
		b.Fatalf("request body is %d bytes", len(body))
	}
	for _, srv := range servers {
		b.Run(srv.name, func(b *testing.B) {
			c := dial(b, srv.start(b))
			c.SetDeadline(timeZero)
			n := responseSize(b, c, req)
			buf := make([]byte, n)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(req); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(c, buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// responseSize does one exchange and returns the response's size in bytes
// (constant: the Date header has a fixed width).
func responseSize(b *testing.B, c net.Conn, req []byte) int {
	var got bytes.Buffer
	c.Write(req)
	resp, err := http.ReadResponse(bufio.NewReader(io.TeeReader(c, &got)), nil)
	if err != nil {
		b.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	if string(body) != string(jsonAnswer) || len(jsonAnswer) != 300 {
		b.Fatalf("answer %d bytes: %q", len(jsonAnswer), body)
	}
	return got.Len()
}

var timeZero time.Time

// BenchmarkParseHead parses the head of an OpenAI SDK generation request.
func BenchmarkParseHead(b *testing.B) {
	raw := []byte("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept-Encoding: gzip, deflate\r\n" +
		"Connection: keep-alive\r\nAccept: application/json\r\nContent-Type: application/json\r\nUser-Agent: OpenAI/Python 1.99.9\r\n" +
		"X-Stainless-Lang: python\r\nX-Stainless-Retry-Count: 0\r\nAuthorization: Bearer sk-test\r\nContent-Length: 112\r\n\r\n")
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := parseHead(raw); !ok {
			b.Fatal("not parsed")
		}
	}
}
