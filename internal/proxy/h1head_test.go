package proxy

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// parsed is what the relay reads of a response, for comparing readHeadFast
// with http.ReadResponse.
type parsed struct {
	Status        string
	StatusCode    int
	Header        http.Header
	ContentLength int64
	TE            []string
	Close         bool
	Body          string
	BodyErr       string
	Next          string // what is left on the connection after the body
}

func parseWith(t testing.TB, raw string, method string, fast bool) (parsed, bool) {
	t.Helper()
	br := bufio.NewReaderSize(strings.NewReader(raw), 4096)
	req, _ := http.NewRequest(method, "http://w/v1/completions", nil)
	var resp *http.Response
	if fast {
		var ok bool
		if resp, ok = readHeadFast(br, req); !ok {
			if n := br.Buffered(); n > 0 {
				if b, _ := br.Peek(n); len(raw) < len(b) || string(b) != raw[:len(b)] {
					t.Fatalf("fallback consumed input: buffered %q", b)
				}
			}
			return parsed{}, false
		}
		setBodyIn(resp, br, nil)
	} else {
		var err error
		if resp, err = http.ReadResponse(br, req); err != nil {
			return parsed{}, false
		}
	}
	body, err := io.ReadAll(resp.Body)
	p := parsed{Status: resp.Status, StatusCode: resp.StatusCode, Header: resp.Header, ContentLength: resp.ContentLength,
		TE: resp.TransferEncoding, Close: resp.Close, Body: string(body)}
	if err != nil {
		p.BodyErr = err.Error()
	}
	rest, _ := io.ReadAll(br)
	p.Next = string(rest)
	return p, true
}

func TestReadHeadFastMatchesNetHTTP(t *testing.T) {
	const next = "HTTP/1.1 200 OK\r\n"
	for _, tc := range []struct {
		name string
		raw  string
		fast bool // the fast path takes it
	}{
		{"length", "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\nhello" + next, true},
		{"lower-case keys", "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nx-custom-thing: a\r\n\r\nok" + next, true},
		{"chunked", "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n3\r\n a\n\r\n0\r\n\r\n" + next, true},
		{"chunked trailer", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\nX-T: 1\r\n\r\n" + next, true},
		{"repeated key", "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 0\r\n\r\n" + next, true},
		{"connection close", "HTTP/1.1 503 Service Unavailable\r\nConnection: keep-alive, close\r\nContent-Length: 4\r\n\r\nbusy", true},
		{"no reason", "HTTP/1.1 404\r\nContent-Length: 0\r\n\r\n", true},
		{"odd reason", "HTTP/1.1 200 Fine By Me\r\nContent-Length: 1\r\n\r\nx", true},
		{"value spaces", "HTTP/1.1 200 OK\r\nX-A:   padded \t\r\nX-B:\r\nContent-Length: 1\r\n\r\nx", true},
		{"short body", "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", true},
		{"short chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", true},
		{"http/1.0", "HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", false},
		{"continue first", "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx", false},
		{"no content", "HTTP/1.1 204 No Content\r\n\r\n", false},
		{"until close", "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", false},
		{"both framings", "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false},
		{"gzip coding", "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", false},
		{"bad length", "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", false},
		{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", false},
		{"folded", "HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 1\r\n\r\nx", false},
		{"space in key", "HTTP/1.1 200 OK\r\nX A: a\r\nContent-Length: 1\r\n\r\nx", false},
		{"ctl in value", "HTTP/1.1 200 OK\r\nX-A: a\x01b\r\nContent-Length: 1\r\n\r\nx", false},
		{"bare LF", "HTTP/1.1 200 OK\nContent-Length: 1\n\nx", false},
		{"bare LF in a value", "HTTP/1.1 200 OK\r\nX-A: a\nb\r\nContent-Length: 1\r\n\r\nx", false},
		{"bare CR in a value", "HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 1\r\n\r\nx", false},
		{"bare CR ending a value", "HTTP/1.1 200 OK\r\nX-A: a\r\r\nContent-Length: 1\r\n\r\nx", false},
		{"bare LF in a key", "HTTP/1.1 200 OK\r\nX\nA: a\r\nContent-Length: 1\r\n\r\nx", false},
		{"bare CR in the status line", "HTTP/1.1 200 O\rK\r\nContent-Length: 1\r\n\r\nx", false},
		{"trailer header", "HTTP/1.1 200 OK\r\nTrailer: X-T\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: 1\r\n\r\n", false},
		{"garbage", "SSH-2.0-OpenSSH\r\n\r\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseWith(t, tc.raw, http.MethodPost, true)
			if ok != tc.fast {
				t.Fatalf("fast path took it: %v, want %v", ok, tc.fast)
			}
			if !ok {
				return
			}
			want, ok := parseWith(t, tc.raw, http.MethodPost, false)
			if !ok {
				t.Fatal("the fast path took a response net/http rejects")
			}
			if tc.name == "chunked trailer" {
				want.Header.Del("X-T") // net/http keeps trailers in Response.Trailer; the relay drops them
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("fast path differs from net/http (-net/http +fast):\n%s", diff)
			}
		})
	}
}

func TestReadHeadFastLeavesHEADAndSplitHeads(t *testing.T) {
	raw := "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
	if _, ok := parseWith(t, raw, http.MethodHead, true); ok {
		t.Fatal("a HEAD response went through the fast path (it has no body whatever its length says)")
	}
	// A head longer than the buffered bytes of one read.
	long := "HTTP/1.1 200 OK\r\nX-Big: " + strings.Repeat("a", 5000) + "\r\nContent-Length: 1\r\n\r\nx"
	if _, ok := parseWith(t, long, http.MethodPost, true); ok {
		t.Fatal("a head split across reads went through the fast path")
	}
	if got, ok := parseWith(t, long, http.MethodPost, false); !ok || got.Body != "x" {
		t.Fatalf("net/http fallback: %+v %v", got, ok)
	}
}

func TestCanonicalKey(t *testing.T) {
	for _, k := range []string{"content-type", "CONTENT-LENGTH", "x-request-id", "X-Request-Id", "a", "a-b-c",
		"x_under_score", "weird!key", strings.Repeat("k", 80), "Www-authenticate"} {
		if got, want := canonicalKey(k), http.CanonicalHeaderKey(k); got != want {
			t.Errorf("canonicalKey(%q) = %q, want %q", k, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { _ = canonicalKey("content-type") }); n != 0 {
		t.Fatalf("canonicalKey of a common key allocates %.0f times", n)
	}
}

// FuzzReadHeadFast: whatever the fast path accepts, net/http accepts and
// reads the same way.
func FuzzReadHeadFast(f *testing.F) {
	f.Add("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
	f.Add("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n")
	f.Add("HTTP/1.1 500 x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
	f.Fuzz(func(t *testing.T, raw string) {
		got, ok := parseWith(t, raw, http.MethodPost, true)
		if !ok {
			return
		}
		want, ok := parseWith(t, raw, http.MethodPost, false)
		if !ok {
			t.Fatalf("fast path took %q, net/http rejects it", raw)
		}
		if got.BodyErr != "" || want.BodyErr != "" {
			// Malformed chunk framing: both must fail (the messages differ).
			if (got.BodyErr == "") != (want.BodyErr == "") {
				t.Fatalf("%q: body error fast %q, net/http %q", raw, got.BodyErr, want.BodyErr)
			}
			return
		}
		if got.TE != nil && strings.Contains(strings.ToLower(raw), "\r\n0\r\n") {
			// Trailer fields: net/http keeps them aside, the fast path drops them.
			return
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("%q: (-net/http +fast):\n%s", raw, diff)
		}
	})
}

// BenchmarkReadHead compares the fast path with http.ReadResponse on the
// heads vLLM (uvicorn: lower-case keys) and vllm-sim (net/http) send.
//
//	go test -run '^$' -bench ReadHead -benchmem ./internal/proxy
func BenchmarkReadHead(b *testing.B) {
	heads := map[string]string{
		"uvicorn-json":  "HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 20:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\n{}",
		"uvicorn-sse":   "HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 20:00:00 GMT\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
		"net-http-json": "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nDate: Tue, 01 Dec 2026 20:00:00 GMT\r\nContent-Length: 2\r\n\r\n{}",
	}
	for name, raw := range heads {
		for _, fast := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/fast=%v", name, fast), func(b *testing.B) {
				sr := strings.NewReader(raw)
				br := bufio.NewReaderSize(sr, 4096)
				req, _ := http.NewRequest(http.MethodPost, "http://w/v1/completions", nil)
				b.ReportAllocs()
				for b.Loop() {
					sr.Reset(raw)
					br.Reset(sr)
					var resp *http.Response
					if fast {
						var ok bool
						if resp, ok = readHeadFast(br, req); !ok {
							b.Fatal("not taken")
						}
						setBodyIn(resp, br, nil)
					} else {
						var err error
						if resp, err = http.ReadResponse(br, req); err != nil {
							b.Fatal(err)
						}
					}
					io.Copy(io.Discard, resp.Body)
				}
			})
		}
	}
}
