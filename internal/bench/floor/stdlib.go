package floor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"
)

// ServeStdlib serves ln until ctx ends with the Go standard library's own
// reverse proxy (net/http's server and Transport, httputil.ReverseProxy
// flushing every read of a response): the yardstick for what Go's HTTP
// stack costs a relayed event stream, which the other shapes cannot frame.
func ServeStdlib(ctx context.Context, ln net.Listener, upstream string) error {
	u := &url.URL{Scheme: "http", Host: upstream}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1 // every read of the answer goes out at once
	rp.Transport = &http.Transport{MaxIdleConnsPerHost: 1 << 16, IdleConnTimeout: 90 * time.Second}
	rp.ErrorLog = quietLog
	srv := &http.Server{Handler: rp, ReadHeaderTimeout: 10 * time.Second, ErrorLog: quietLog}
	stop := context.AfterFunc(ctx, func() { _ = srv.Close() })
	defer stop()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("floor: %w", err)
	}
	return nil
}

// quietLog drops the standard library's own log lines (a client that went
// away mid-stream).
var quietLog = log.New(io.Discard, "", 0)
