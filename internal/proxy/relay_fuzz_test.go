package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http/httptest"
	"testing"
)

// fuzzChunkReader returns data in chunks whose sizes come from sizes (cycled).
type fuzzChunkReader struct {
	data  []byte
	sizes []byte
	i     int
}

func (c *fuzzChunkReader) Read(p []byte) (int, error) {
	if len(c.data) == 0 {
		return 0, io.EOF
	}
	n := 1
	if len(c.sizes) > 0 {
		n = int(c.sizes[c.i%len(c.sizes)]) + 1
		c.i++
	}
	n = min(n, len(p), len(c.data))
	copy(p, c.data[:n])
	c.data = c.data[n:]
	return n, nil
}

// FuzzRelay: whatever the upstream sends, in whatever chunking, the client
// receives exactly the same bytes in the same order.
func FuzzRelay(f *testing.F) {
	f.Add([]byte("data: {\"a\":1}\n\ndata: [DONE]\n\n"), []byte{0, 3, 200})
	f.Add(bytes.Repeat([]byte("x"), 70000), []byte{255})
	f.Fuzz(func(t *testing.T, data, sizes []byte) {
		rec := httptest.NewRecorder()
		var first int
		res := Relay(context.Background(), rec, &fuzzChunkReader{data: append([]byte(nil), data...), sizes: sizes},
			RelayOptions{OnFirstByte: func() { first++ }})
		if res.UpstreamErr != nil || !res.DownstreamOK {
			t.Fatalf("relay result %+v", res)
		}
		if !bytes.Equal(rec.Body.Bytes(), data) {
			t.Fatalf("relayed %d bytes, want %d (content differs)", rec.Body.Len(), len(data))
		}
		if res.Bytes != int64(len(data)) || (len(data) > 0) != (first == 1) {
			t.Fatalf("bytes %d first-byte calls %d for %d bytes", res.Bytes, first, len(data))
		}
	})
}
