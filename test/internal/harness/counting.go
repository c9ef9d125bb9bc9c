package harness

import (
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
)

// InFlight counts generation requests in flight across every
// CountingProxy that shares it, and the most seen at once. One counter
// in one process: no sum of snapshots taken from several workers at
// different moments.
type InFlight struct{ cur, peak atomic.Int64 }

// Peak is the most generation requests that were in flight at once.
func (c *InFlight) Peak() int64 { return c.peak.Load() }

// Now is the number in flight.
func (c *InFlight) Now() int64 { return c.cur.Load() }

func (c *InFlight) enter() {
	n := c.cur.Add(1)
	for p := c.peak.Load(); n > p && !c.peak.CompareAndSwap(p, n); p = c.peak.Load() {
	}
}

// CountingProxy starts a reverse proxy on 127.0.0.1 in front of target
// (a worker's base URL) and returns its base URL, to give the router in
// place of the worker's. POSTs to /v1/... count in c from their arrival
// until the worker's whole answer has been copied. Answers are sent
// chunked, so their end (the chunked terminator) leaves only after the
// request was counted out: a router that frees its slot when it reads
// that end can never make the count overshoot. The proxy stops when the
// test ends.
func CountingProxy(t testing.TB, target string, c *InFlight) string {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatalf("counting proxy target %q: %v", target, err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1 // relay each SSE chunk at once
	rp.ModifyResponse = func(r *http.Response) error {
		r.ContentLength = -1
		r.Header.Del("Content-Length")
		return nil
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("counting proxy listen: %v", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") {
			c.enter()
			defer c.cur.Add(-1)
		}
		rp.ServeHTTP(w, r)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}
