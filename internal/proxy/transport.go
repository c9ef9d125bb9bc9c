package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"
)

// TransportOptions tunes the shared upstream transport.
type TransportOptions struct {
	ConnectTimeout time.Duration // dial timeout (0 → 3 s default, < 0 → none)
	IdleTimeout    time.Duration // idle keep-alive connection lifetime (4 s)
	MaxIdlePerHost int           // keep-alive pool per worker (4096)
}

// NewTransport returns the shared transport. There is no response-header
// timeout (a non-streaming generation sends headers only when done) and no
// global timeout: deadlines come from each request's context.
func NewTransport(o TransportOptions) *http.Transport {
	if o.ConnectTimeout == 0 {
		o.ConnectTimeout = 3 * time.Second
	} else if o.ConnectTimeout < 0 {
		o.ConnectTimeout = 0 // net.Dialer: no timeout
	}
	if o.IdleTimeout <= 0 {
		// Below uvicorn's 5 s keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE
		// default): the router closes an idle connection before the worker
		// does, so a POST is never written onto a connection the worker is
		// closing at that instant (net/http does not retry a POST then, and
		// the client would see a spurious 502).
		o.IdleTimeout = 4 * time.Second
	}
	if o.MaxIdlePerHost <= 0 {
		o.MaxIdlePerHost = 4096
	}
	d := &net.Dialer{Timeout: o.ConnectTimeout, KeepAlive: 30 * time.Second}
	return &http.Transport{
		Proxy: nil, // never route worker traffic through an environment proxy
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, &DialError{Addr: addr, Err: err}
			}
			return c, nil
		},
		MaxIdleConns:          0, // no global cap
		MaxIdleConnsPerHost:   o.MaxIdlePerHost,
		MaxConnsPerHost:       0,
		IdleConnTimeout:       o.IdleTimeout,
		DisableCompression:    true,
		ForceAttemptHTTP2:     false,
		ExpectContinueTimeout: 0,
		// 8 KiB each way per upstream connection: SSE events are a few
		// hundred bytes and bigger writes bypass the buffer anyway; at
		// thousands of mostly idle streams these buffers are the router's
		// memory (docs/BENCHMARKS.md, concurrency ceiling).
		WriteBufferSize: 8 << 10,
		ReadBufferSize:  8 << 10,
	}
}

// DialError marks a failure to connect: the request never reached the
// worker, so it is always safe to retry elsewhere.
type DialError struct {
	Addr string
	Err  error
}

func (e *DialError) Error() string { return fmt.Sprintf("connect to %s: %v", e.Addr, e.Err) }
func (e *DialError) Unwrap() error { return e.Err }

// IsDialError reports whether err is (or wraps) a DialError.
func IsDialError(err error) bool {
	var d *DialError
	return errors.As(err, &d)
}
