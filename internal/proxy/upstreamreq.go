package proxy

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/url"

	"github.com/switchyard-llm/switchyard/internal/worker"
)

// NewUpstreamRequest returns the request for method on wk's URL plus
// pathQuery, with header h (used as it is, not copied) and body (nil: none)
// of n bytes: what http.NewRequestWithContext builds, without joining and
// parsing the URL for every request when pathQuery is a plain path (the
// worker's URL was parsed once, worker.BaseURL). Anything else goes through
// http.NewRequestWithContext.
func NewUpstreamRequest(ctx context.Context, method string, wk *worker.Worker, pathQuery string, h http.Header, body io.ReadCloser, n int64) (*http.Request, error) {
	if n == 0 {
		body = nil // as http.NewRequest of an empty reader: no body
	}
	base := wk.BaseURL()
	if base == nil || !plainPath(pathQuery) || !commonMethod(method) {
		var rd io.Reader
		if body != nil {
			rd = body
		}
		req, err := http.NewRequestWithContext(ctx, method, wk.URL+pathQuery, rd)
		if err != nil {
			return nil, err
		}
		if h != nil {
			req.Header = h
		}
		req.ContentLength = n
		return req, nil
	}
	if h == nil {
		h = make(http.Header)
	}
	r := http.Request{
		Method:     method,
		URL:        &url.URL{Scheme: base.Scheme, Host: base.Host, Path: pathQuery},
		Proto:      "HTTP/1.1",
		ProtoMajor: 1,
		ProtoMinor: 1,
		Header:     h,
		Host:       base.Host,
	}
	if body != nil {
		r.Body, r.ContentLength = body, n
	}
	return r.WithContext(ctx), nil
}

// plainPath reports whether p is an absolute path that url.Parse reads
// back unchanged: no query, fragment, escapes or characters a request
// target would have to escape.
func plainPath(p string) bool {
	if p == "" || p[0] != '/' {
		return false
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '/', c == '-', c == '_', c == '.', c == '~':
		default:
			return false
		}
	}
	return true
}

func commonMethod(m string) bool {
	switch m {
	case http.MethodGet, http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch, http.MethodHead, http.MethodOptions:
		return true
	}
	return false
}

// bytesBody is a request body read from a byte slice, with the GetBody
// http.NewRequest gives a bytes.Reader, in one allocation.
type bytesBody struct {
	bytes.Reader
	b []byte
}

func newBytesBody(b []byte) *bytesBody {
	bb := &bytesBody{b: b}
	bb.Reset(b)
	return bb
}

func (*bytesBody) Close() error { return nil }

// Resendable makes bytesBody a ResendableBody: its bytes stay.
func (*bytesBody) Resendable() bool { return true }

// Reopen is a fresh reader of the same bytes.
func (bb *bytesBody) Reopen() io.ReadCloser { return newBytesBody(bb.b) }

// again is the request's GetBody: a fresh reader of the same bytes.
func (bb *bytesBody) again() (io.ReadCloser, error) { return bb.Reopen(), nil }
