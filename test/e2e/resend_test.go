package e2e

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// closingWorker answers each request on a connection and then closes the
// connection without saying so (no Connection: close), as a worker that
// closes idle keep-alive connections early does.
func closingWorker(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				body := `{"object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}]}`
				if req.URL.Path == "/v1/models" {
					body = `{"object":"list","data":[{"id":"m","object":"model"}]}`
				}
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
				time.Sleep(20 * time.Millisecond) // the router has pooled the connection
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// TestResendOnClosedPooledConnection: a worker that closes every
// connection after one answer costs no request: the router reuses a
// pooled connection without checking it and, finding it closed before
// any answer, writes the request again on a new one (counted in
// vllm_router_upstream_resends_total), never failing it or the worker.
func TestResendOnClosedPooledConnection(t *testing.T) {
	w := closingWorker(t)
	r := startRouter(t, "--worker-urls", w, "--policy", "round_robin", "--retry-max-retries", "1")
	r.WaitReady(t, 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 10 {
		if st, _, body := post(t, ctx, r.Base+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`); st != 200 || !strings.Contains(string(body), `"ok"`) {
			t.Fatalf("request %d: %d %s", i, st, body)
		}
		time.Sleep(40 * time.Millisecond) // the worker has closed it
	}
	if n := metricValue(t, r, "vllm_router_upstream_resends_total"); n < 5 {
		t.Fatalf("%v resends, want one for most of the 10 requests", n)
	}
}
