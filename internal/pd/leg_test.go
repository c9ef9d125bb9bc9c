package pd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/cookiejar"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// A leg's request body reads its pieces in order at any read size,
// replays them (GetBody, Reopen) before and after it is closed, and reads
// nothing more once closed.
func TestLegBody(t *testing.T) {
	const body = `{"prompt":"hi","max_tokens":1}`
	prompt := strings.Repeat("w", 2<<10) // long enough to be spliced as pieces
	o, err := rawjson.Parse([]byte(`{"prompt":"` + prompt + `", "max_tokens":9,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	spliced := o.Splice(rawjson.Set("max_tokens", []byte("1")), rawjson.Delete("stream"), rawjson.Set("kv_transfer_params", []byte("{}")))
	if got := string(spliced.Bytes()); got != `{"prompt":"`+prompt+`", "max_tokens":1,"kv_transfer_params":{}}` || spliced.NumParts() < 4 {
		t.Fatalf("spliced %q in %d pieces", got, spliced.NumParts())
	}
	for _, tc := range []struct {
		name  string
		s     rawjson.Spliced
		chunk int  // read size
		close bool // closed before GetBody
	}{
		{"whole, read at once", rawjson.Whole([]byte(body)), 64, false},
		{"whole, small reads", rawjson.Whole([]byte(body)), 3, false},
		{"pieces, read at once", spliced, 64, false},
		{"pieces, a byte a read", spliced, 1, false},
		{"pieces, reads across pieces", spliced, 5, false},
		{"pieces, reads longer than a piece", spliced, 3000, false},
		{"replay after close", spliced, 64, true},
		{"empty", rawjson.Whole(nil), 8, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want := string(tc.s.Bytes())
			lb := &legBody{s: tc.s}
			if got := readChunks(t, lb, tc.chunk); got != want {
				t.Fatalf("read %q, want %q", got, want)
			}
			if tc.close {
				lb.Close()
			}
			rc, err := lb.again()
			if err != nil {
				t.Fatalf("GetBody: %v", err)
			}
			if again := readChunks(t, rc, tc.chunk); again != want {
				t.Fatalf("replayed %q, want %q", again, want)
			}
			if again := readChunks(t, lb.Reopen(), tc.chunk); again != want {
				t.Fatalf("reopened %q, want %q", again, want)
			}
			if n, err := lb.Read(make([]byte, 8)); n != 0 || !errors.Is(err, io.EOF) {
				t.Fatalf("original after its end: %d %v, want 0 EOF", n, err)
			}
		})
	}
	lb := &legBody{s: spliced}
	lb.Close()
	if n, err := lb.Read(make([]byte, 8)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("read after close: %d %v, want 0 EOF", n, err)
	}
}

// readChunks reads r to its end, chunk bytes at a time.
func readChunks(t *testing.T, r io.Reader, chunk int) string {
	t.Helper()
	var got []byte
	buf := make([]byte, chunk)
	for i := 0; ; i++ {
		n, err := r.Read(buf)
		got = append(got, buf[:n]...)
		if errors.Is(err, io.EOF) {
			return string(got)
		}
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 && i > 1000 {
			t.Fatal("no progress")
		}
	}
}

// A leg's body can be resent (proxy.ResendableBody) while unread and
// open, whatever its length: its pieces hold no copy of the prompt.
func TestLegBodyResendable(t *testing.T) {
	short := []byte(`{"prompt":"hi","max_tokens":1}`)
	long := append(append([]byte(`{"prompt":"`), bytes.Repeat([]byte("w"), 1<<20)...), `"}`...)
	for _, tc := range []struct {
		name string
		b    []byte
		prep func(*legBody)
		want bool
	}{
		{"short, unread", short, func(*legBody) {}, true},
		{"a MiB, unread", long, func(*legBody) {}, true},
		{"partly read", short, func(lb *legBody) { lb.Read(make([]byte, 3)) }, false},
		{"closed", short, func(lb *legBody) { lb.Close() }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lb := &legBody{s: rawjson.Whole(tc.b)}
			tc.prep(lb)
			var rb proxy.ResendableBody = lb
			if got := rb.Resendable(); got != tc.want {
				t.Fatalf("Resendable() = %v, want %v", got, tc.want)
			}
		})
	}
}

// A leg's GetBody is set exactly where something may rewind its body:
// net/http's Transport (a resend on a new connection) or http.Client.Do (a
// 307/308 redirect). H1Transport, called directly, never rewinds.
func TestLegRequestGetBody(t *testing.T) {
	h1 := proxy.NewH1Transport(proxy.TransportOptions{})
	defer h1.CloseIdleConnections()
	for _, tc := range []struct {
		name   string
		client *http.Client
		body   string
		want   bool
	}{
		{"H1Transport direct", &http.Client{Transport: h1}, `{"a":1}`, false},
		{"H1Transport through Do (timeout)", &http.Client{Transport: h1, Timeout: time.Minute}, `{"a":1}`, true},
		{"net/http Transport", &http.Client{Transport: &http.Transport{}}, `{"a":1}`, true},
		{"default transport", &http.Client{}, `{"a":1}`, true},
		{"empty body", &http.Client{Transport: &http.Transport{}}, ``, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &Engine{o: Options{Client: tc.client}}
			w := worker.New(worker.Spec{URL: "http://127.0.0.1:1", DPRank: -1}, worker.BreakerConfig{})
			st := &reqState{path: "/v1/completions", hdr: http.Header{}}
			req, err := e.newLegRequest(context.Background(), st, &Pair{RequestID: "r"}, &leg{name: "prefill", w: w}, -1, rawjson.Whole([]byte(tc.body)), nil)
			if err != nil {
				t.Fatal(err)
			}
			if got := req.GetBody != nil; got != tc.want {
				t.Fatalf("GetBody set = %v, want %v", got, tc.want)
			}
			if tc.want {
				rc, err := req.GetBody()
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(rc)
				if string(b) != tc.body {
					t.Fatalf("GetBody read %q, want %q", b, tc.body)
				}
			}
		})
	}
}

// An attempt's two legs share one header map when they would build the
// same one (no span of their own, one rank), and each leg's headers are
// its own otherwise.
func TestLegHeadersShared(t *testing.T) {
	w := worker.New(worker.Spec{URL: "http://127.0.0.1:1", DPRank: -1}, worker.BreakerConfig{})
	span := trace.SpanFromContext(context.Background()) // a span: the leg carries its own context
	for _, tc := range []struct {
		name         string
		pRank, dRank int
		dSpan        bool
		shared       bool
	}{
		{"same rank", -1, -1, false, true},
		{"same DP rank", 2, 2, false, true},
		{"different ranks", 0, 1, false, false},
		{"decode span", -1, -1, true, false},
		{"through http.Client.Do", -1, -1, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &Engine{o: Options{Client: &http.Client{}}}
			if tc.name == "through http.Client.Do" {
				e.o.Client.Timeout = time.Minute // Do may write to the header (a jar's cookies)
			}
			st := &reqState{path: "/v1/completions", hdr: http.Header{"Traceparent": {"00-a-b-01"}}, auth: "Bearer k"}
			pr := &Pair{RequestID: "r-1"}
			var hs legHeaders
			preq, err := e.newLegRequest(context.Background(), st, pr, &leg{name: "prefill", w: w}, tc.pRank, rawjson.Whole([]byte(`{}`)), &hs)
			if err != nil {
				t.Fatal(err)
			}
			dl := &leg{name: "decode", w: w}
			if tc.dSpan {
				dl.span = span
			}
			dreq, err := e.newLegRequest(context.Background(), st, pr, dl, tc.dRank, rawjson.Whole([]byte(`{}`)), &hs)
			if err != nil {
				t.Fatal(err)
			}
			if got := reflect.ValueOf(preq.Header).UnsafePointer() == reflect.ValueOf(dreq.Header).UnsafePointer(); got != tc.shared {
				t.Fatalf("shared header map = %v, want %v", got, tc.shared)
			}
			for _, c := range []struct {
				h    http.Header
				rank int
			}{{preq.Header, tc.pRank}, {dreq.Header, tc.dRank}} {
				want := http.Header{"Content-Type": {"application/json"}, "X-Request-Id": {"r-1"}, "Authorization": {"Bearer k"},
					"Traceparent": {"00-a-b-01"}, "User-Agent": {"switchyard"}}
				if c.rank >= 0 {
					want["X-Data-Parallel-Rank"] = []string{strconv.Itoa(c.rank)}
				}
				got := http.Header{}
				for k, v := range c.h {
					got[http.CanonicalHeaderKey(k)] = v
				}
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("leg header %v, want %v", got, want)
				}
			}
		})
	}
}

// A concurrent prefill is handed to an async transport only where a leg
// would go to the transport directly: a client with a timeout, a cookie
// jar or a redirect policy sends it through http.Client.Do.
func TestAsyncTransportOnlyDirect(t *testing.T) {
	h1 := proxy.NewH1Transport(proxy.TransportOptions{})
	defer h1.CloseIdleConnections()
	jar, _ := cookiejar.New(nil)
	for _, tc := range []struct {
		name   string
		client *http.Client
		async  bool
	}{
		{"H1Transport", &http.Client{Transport: h1}, true},
		{"timeout", &http.Client{Transport: h1, Timeout: time.Minute}, false},
		{"cookie jar", &http.Client{Transport: h1, Jar: jar}, false},
		{"redirect policy", &http.Client{Transport: h1, CheckRedirect: func(*http.Request, []*http.Request) error { return nil }}, false},
		{"net/http Transport", &http.Client{Transport: &http.Transport{}}, false},
		{"default transport", &http.Client{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := &Engine{o: Options{Client: tc.client}}
			if got := e.asyncTransport() != nil; got != tc.async {
				t.Fatalf("async transport = %v, want %v", got, tc.async)
			}
		})
	}
}

// bufferedFake is a proxy.BufferedBody that reports what it is told.
type bufferedFake struct {
	io.Reader
	all bool
}

func (b bufferedFake) Buffered() bool { return b.all }

// D's body as Relay reads it is buffered in full when what follows the
// first chunk is (proxy.BodyBuffered): Relay then arms no idle timeout.
func TestFirstThenBodyBuffered(t *testing.T) {
	for _, tc := range []struct {
		name string
		rest io.Reader
		want bool
	}{
		{"the first read was all", http.NoBody, true},
		{"the rest arrived", bufferedFake{all: true}, true},
		{"the rest on its way", bufferedFake{all: false}, false},
		{"a body that cannot tell", strings.NewReader("data: x\n\n"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &firstThenBody{first: []byte("data: a\n\n"), rest: tc.rest}
			if got := proxy.BodyBuffered(b); got != tc.want {
				t.Fatalf("BodyBuffered = %v, want %v", got, tc.want)
			}
		})
	}
}
