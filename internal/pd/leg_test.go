package pd

import (
	"errors"
	"io"
	"testing"
)

// A leg's request body reads its bytes, replays them (GetBody) until the
// transport closes it, and holds no reference once closed.
func TestLegBody(t *testing.T) {
	const body = `{"prompt":"hi","max_tokens":1}`
	for _, tc := range []struct {
		name    string
		chunk   int  // read size
		close   bool // closed before GetBody
		wantErr error
	}{
		{"read whole, replay before close", 64, false, nil},
		{"small reads, replay before close", 3, false, nil},
		{"replay after close fails", 64, true, errLegBodyClosed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lb := &legBody{b: []byte(body)}
			var got []byte
			buf := make([]byte, tc.chunk)
			for {
				n, err := lb.Read(buf)
				got = append(got, buf[:n]...)
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if string(got) != body {
				t.Fatalf("read %q, want %q", got, body)
			}
			if tc.close {
				lb.Close()
				if lb.b != nil {
					t.Fatal("closed body still holds its bytes")
				}
			}
			rc, err := lb.again()
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("GetBody: %v, want %v", err, tc.wantErr)
			}
			if err != nil {
				return
			}
			again, _ := io.ReadAll(rc)
			if string(again) != body {
				t.Fatalf("replayed %q, want %q", again, body)
			}
			if n, err := lb.Read(buf); n != 0 || !errors.Is(err, io.EOF) {
				t.Fatalf("original after its end: %d %v, want 0 EOF", n, err)
			}
		})
	}
}
