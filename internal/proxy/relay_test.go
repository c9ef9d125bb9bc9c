package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// chunkReader returns one chunk per Read, then err (io.EOF if nil).
type chunkReader struct {
	chunks []string
	err    error
	// withErr returns the last chunk together with err
	withErr bool
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.chunks) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		return 0, io.EOF
	}
	n := copy(p, r.chunks[0])
	r.chunks = r.chunks[1:]
	if len(r.chunks) == 0 && r.withErr {
		return n, r.err
	}
	return n, nil
}

type failWriter struct{ http.ResponseWriter }

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("broken pipe") }

func TestRelayCopiesInOrderAndFlushes(t *testing.T) {
	rec := httptest.NewRecorder()
	var seen []string
	first := 0
	res := Relay(context.Background(), rec, &chunkReader{chunks: []string{"data: a\n\n", "data: b\n", "\n", "x"}}, RelayOptions{
		Observe:     func(b []byte) { seen = append(seen, string(b)) },
		OnFirstByte: func() { first++ },
	})
	if rec.Body.String() != "data: a\n\ndata: b\n\nx" || res.Bytes != 19 || !res.WroteAny || !res.DownstreamOK || res.UpstreamErr != nil {
		t.Fatalf("%q %+v", rec.Body.String(), res)
	}
	if len(seen) != 4 || first != 1 || !rec.Flushed {
		t.Fatalf("observe %v first %d flushed %v", seen, first, rec.Flushed)
	}
	if res.AtEventBoundary {
		t.Error("ends with x: not at an event boundary")
	}
}

// TestRelayBufferSizes: a stream is read in 4 KiB pieces until one fills
// its buffer, then in burst-sized ones (32 KiB) until one fits the small
// buffer again, unless more than burstStreams streams are open; any other
// body is read in 16 KiB pieces. A body larger than the buffer arrives
// whole either way.
func TestRelayBufferSizes(t *testing.T) {
	big := "data: " + strings.Repeat("x", 40<<10) + "\n\n"
	small := "data: y\n\n"
	for _, tc := range []struct {
		name   string
		stream bool
		open   int64 // streams counted open besides this one
		chunks []string
		reads  []int
	}{
		{"stream", true, 0, []string{big, small, big}, []int{4096, 32768, 4104, 9, 4096, 32768, 4104}},
		{"stream, too many open", true, burstStreams, []string{big}, []int{4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 8}},
		{"other body", false, 0, []string{big}, []int{16384, 16384, 8200}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			openStreams.Add(tc.open)
			defer openStreams.Add(-tc.open)
			rec := httptest.NewRecorder()
			var reads []int
			res := Relay(context.Background(), rec, &pieceReader{pieces: slices.Clone(tc.chunks)}, RelayOptions{
				Stream:  tc.stream,
				Observe: func(b []byte) { reads = append(reads, len(b)) },
			})
			if rec.Body.String() != strings.Join(tc.chunks, "") || res.UpstreamErr != nil || !res.AtEventBoundary {
				t.Fatalf("%d bytes relayed, %+v", rec.Body.Len(), res)
			}
			if !slices.Equal(reads, tc.reads) {
				t.Fatalf("reads %v, want %v", reads, tc.reads)
			}
		})
	}
}

// pieceReader returns each piece in as many reads as the caller's buffer
// needs, never two pieces in one read.
type pieceReader struct{ pieces []string }

func (r *pieceReader) Read(p []byte) (int, error) {
	if len(r.pieces) == 0 {
		return 0, io.EOF
	}
	n := copy(p, r.pieces[0])
	if r.pieces[0] = r.pieces[0][n:]; r.pieces[0] == "" {
		r.pieces = r.pieces[1:]
	}
	return n, nil
}

func TestRelayEventBoundary(t *testing.T) {
	for _, tc := range []struct {
		chunks []string
		want   bool
	}{
		{nil, true},
		{[]string{"data: a\n\n"}, true},
		{[]string{"data: a\n", "\n"}, true},
		{[]string{"data: a\r\n\r\n"}, true},
		{[]string{"data: a\r\n", "\r", "\n"}, true},
		{[]string{"data: a\n"}, false},
		{[]string{"data: a\r\n"}, false},
		{[]string{"\n\n", "d"}, false},
	} {
		res := Relay(context.Background(), httptest.NewRecorder(), &chunkReader{chunks: tc.chunks}, RelayOptions{})
		if res.AtEventBoundary != tc.want {
			t.Errorf("%q: boundary %v", tc.chunks, res.AtEventBoundary)
		}
	}
}

func TestRelayWritesBytesReadWithError(t *testing.T) {
	boom := errors.New("connection reset")
	rec := httptest.NewRecorder()
	res := Relay(context.Background(), rec, &chunkReader{chunks: []string{"ab", "cd"}, err: boom, withErr: true}, RelayOptions{})
	if rec.Body.String() != "abcd" || !errors.Is(res.UpstreamErr, boom) || !res.DownstreamOK {
		t.Fatalf("%q %+v", rec.Body.String(), res)
	}
}

func TestRelayDownstreamFailure(t *testing.T) {
	res := Relay(context.Background(), failWriter{httptest.NewRecorder()}, &chunkReader{chunks: []string{"a", "b"}}, RelayOptions{})
	if res.DownstreamOK || res.WroteAny || res.UpstreamErr != nil {
		t.Fatalf("%+v", res)
	}
}

func TestRelayContextEnd(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	res := Relay(ctx, httptest.NewRecorder(), &chunkReader{chunks: []string{"a"}, err: errors.New("read: canceled")}, RelayOptions{})
	if res.DownstreamOK || !errors.Is(res.UpstreamErr, context.Canceled) {
		t.Fatalf("client gone: %+v", res)
	}
	dctx, dcancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer dcancel()
	res = Relay(dctx, httptest.NewRecorder(), &chunkReader{chunks: []string{"a"}, err: errors.New("read: deadline")}, RelayOptions{})
	if !res.DownstreamOK || !errors.Is(res.UpstreamErr, context.DeadlineExceeded) {
		t.Fatalf("deadline: the client is still there: %+v", res)
	}
}

// pipeBody is an io.ReadCloser whose writer the test drives.
func pipeBody() (*io.PipeReader, *io.PipeWriter) { return io.Pipe() }

func TestRelayIdleTimeout(t *testing.T) {
	// The gaps are 50× shorter than the timeout, so a loaded machine's
	// scheduling stalls cannot make them trip it.
	const gap, idle = 20 * time.Millisecond, time.Second
	pr, pw := pipeBody()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() {
		// chunks a gap apart never trip the idle timeout…
		for range 10 {
			if _, err := pw.Write([]byte("data: x\n\n")); err != nil {
				return
			}
			time.Sleep(gap)
		}
		// …then silence does
	})
	rec := httptest.NewRecorder()
	start := time.Now()
	res := Relay(context.Background(), rec, pr, RelayOptions{IdleTimeout: idle})
	el := time.Since(start)
	pw.Close()
	if !errors.Is(res.UpstreamErr, ErrIdleTimeout) || !res.DownstreamOK {
		t.Fatalf("%+v", res)
	}
	if got := strings.Count(rec.Body.String(), "data: x\n\n"); got != 10 {
		t.Fatalf("%d chunks relayed, want all 10", got)
	}
	// at least 9 gaps and then the timeout; the upper bound is a hang guard
	if el < 9*gap+idle || el > idle+10*time.Second {
		t.Fatalf("relay ended after %v", el)
	}
}

func TestRelayIdleTimeoutNotAfterEOF(t *testing.T) {
	rec := httptest.NewRecorder()
	res := Relay(context.Background(), rec, io.NopCloser(strings.NewReader("all")), RelayOptions{IdleTimeout: time.Millisecond})
	if res.UpstreamErr != nil || rec.Body.String() != "all" {
		t.Fatalf("%+v", res)
	}
}

func TestWriteSSEError(t *testing.T) {
	rec := httptest.NewRecorder()
	if err := WriteSSEError(rec, RelayResult{AtEventBoundary: false}, 502, "x"); err != nil {
		t.Fatal(err)
	}
	want := "\n\ndata: {\"error\":{\"message\":\"x\",\"type\":\"BadGatewayError\",\"param\":null,\"code\":502}}\n\ndata: [DONE]\n\n"
	if rec.Body.String() != want || !rec.Flushed {
		t.Fatalf("%q", rec.Body.String())
	}
}
