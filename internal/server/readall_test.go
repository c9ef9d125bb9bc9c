package server

import (
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

// zeroThenData returns (0, nil) once before each read of r.
type zeroThenData struct {
	r    io.Reader
	zero bool
}

func (z *zeroThenData) Read(p []byte) (int, error) {
	if z.zero = !z.zero; z.zero {
		return 0, nil
	}
	return z.r.Read(p)
}

func TestReadAll(t *testing.T) {
	const body = `{"model":"m","prompt":"hello"}`
	n := int64(len(body))
	tests := []struct {
		name    string
		r       io.Reader
		length  int64
		want    string
		wantErr string
	}{
		{"exact length", strings.NewReader(body), n, body, ""},
		{"one byte per read", iotest.OneByteReader(strings.NewReader(body)), n, body, ""},
		{"data with EOF", iotest.DataErrReader(strings.NewReader(body)), n, body, ""},
		{"zero-byte reads", &zeroThenData{r: strings.NewReader(body)}, n, body, ""},
		{"unknown length", strings.NewReader(body), -1, body, ""},
		{"over the limit: read as unknown", strings.NewReader(body), 1 << 40, body, ""},
		{"shorter than declared", strings.NewReader(body), n + 5, "", "unexpected EOF"},
		{"longer than declared", strings.NewReader(body + "x"), n, "", "longer than its Content-Length"},
		{"read error", iotest.TimeoutReader(iotest.OneByteReader(strings.NewReader(body))), n, "", "timeout"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := readAll(tc.r, tc.length, 1<<20)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || string(got) != tc.want {
				t.Fatalf("readAll = %q, %v; want %q", got, err, tc.want)
			}
			if tc.length == n && cap(got) != len(got) {
				t.Errorf("cap %d for a %d-byte body: want one exactly-sized buffer", cap(got), len(got))
			}
		})
	}
	if _, err := readAll(strings.NewReader(""), 3, 10); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("empty body with Content-Length 3: %v", err)
	}
}
