package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// NewUpstreamRequest must build what http.NewRequestWithContext builds of
// the joined URL, on the fast path and off it.
func TestNewUpstreamRequestMatchesNewRequest(t *testing.T) {
	type key struct{}
	ctx := context.WithValue(context.Background(), key{}, 1)
	cases := []struct {
		url, method, pathQuery string
		body                   []byte
		n                      int64
		fast                   bool
	}{
		{"http://127.0.0.1:8000", "POST", "/v1/completions", []byte(`{"a":1}`), 7, true},
		{"http://127.0.0.1:8000", "POST", "/v1/chat/completions", nil, 0, true},
		{"http://[::1]:8000", "GET", "/v1/models", nil, 0, true},
		{"http://worker.ns.svc:80", "POST", "/v1/completions", []byte(`{}`), -1, true},
		{"http://127.0.0.1:8000", "POST", "/v1/completions?x=1", []byte(`{}`), 2, false},
		{"http://127.0.0.1:8000", "GET", "/a%2Fb", nil, 0, false},
		{"http://127.0.0.1:8000", "GET", "/a b", nil, 0, false},
		{"http://127.0.0.1:8000", "PROPFIND", "/x", nil, 0, false},
		{"https://127.0.0.1:8443", "POST", "/v1/completions", []byte(`{}`), 2, true},
	}
	for _, tc := range cases {
		wk := worker.New(worker.Spec{URL: tc.url, DPRank: -1}, worker.BreakerConfig{})
		var body io.ReadCloser
		var want *http.Request
		var err error
		if tc.body != nil {
			body = io.NopCloser(bytes.NewReader(tc.body))
			want, err = http.NewRequestWithContext(ctx, tc.method, tc.url+tc.pathQuery, io.NopCloser(bytes.NewReader(tc.body)))
			want.ContentLength = tc.n
		} else {
			want, err = http.NewRequestWithContext(ctx, tc.method, tc.url+tc.pathQuery, nil)
		}
		if err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.pathQuery, err)
		}
		h := http.Header{"X-A": {"1"}}
		got, err := NewUpstreamRequest(ctx, tc.method, wk, tc.pathQuery, h, body, tc.n)
		if err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.pathQuery, err)
		}
		name := tc.method + " " + tc.url + tc.pathQuery
		if fast := plainPath(tc.pathQuery) && commonMethod(tc.method); fast != tc.fast {
			t.Errorf("%s: fast path %v, want %v", name, fast, tc.fast)
		}
		if got.Method != want.Method || got.URL.String() != want.URL.String() || got.URL.RequestURI() != want.URL.RequestURI() ||
			got.Host != want.Host || got.URL.Host != want.URL.Host || got.URL.Scheme != want.URL.Scheme ||
			got.Proto != want.Proto || got.ProtoMajor != want.ProtoMajor || got.ProtoMinor != want.ProtoMinor ||
			got.ContentLength != want.ContentLength || (got.Body == nil) != (want.Body == nil) ||
			(got.Body == http.NoBody) != (want.Body == http.NoBody) {
			t.Errorf("%s:\n got %s %s host=%q len=%d body=%T\nwant %s %s host=%q len=%d body=%T", name,
				got.Method, got.URL, got.Host, got.ContentLength, got.Body, want.Method, want.URL, want.Host, want.ContentLength, want.Body)
		}
		if got.Context().Value(key{}) != 1 {
			t.Errorf("%s: context not carried", name)
		}
		if got.Header.Get("X-A") != "1" {
			t.Errorf("%s: header not used", name)
		}
	}
}

func TestBytesBodyGetBody(t *testing.T) {
	bb := newBytesBody([]byte("hello"))
	if b, _ := io.ReadAll(bb); string(b) != "hello" {
		t.Fatalf("read %q", b)
	}
	again, _ := bb.again()
	if b, _ := io.ReadAll(again); string(b) != "hello" {
		t.Fatalf("GetBody read %q", b)
	}
}
