package floor

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
)

// Main runs "sybench floor-proxy": the floor proxy in front of one
// upstream until ctx ends (the command's interrupt).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("floor-proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	listen := fs.String("listen", "127.0.0.1:0", "IPv4 host:port to listen on")
	upstream := fs.String("upstream", "", "the upstream's IPv4 host:port (required)")
	mode := fs.String("mode", "goroutine", "goroutine (a goroutine per connection over Go's poller), loop (one thread's epoll loop, Linux) or stdlib (net/http's server and httputil.ReverseProxy, flushing every read: also relays chunked event streams)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: sybench floor-proxy --upstream HOST:PORT [--listen HOST:PORT] [--mode goroutine|loop|stdlib]")
		fmt.Fprintln(stderr, "The least an HTTP/1.1 proxy can do (package internal/bench/floor): a yardstick for the router's overhead.")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("floor-proxy: unexpected argument %q", fs.Arg(0))
	}
	if *upstream == "" {
		return errors.New("floor-proxy: --upstream is required")
	}
	if _, err := inet4(*upstream); err != nil {
		return err
	}
	ready := func(a net.Addr) { fmt.Fprintf(stdout, "floor-proxy (%s) listening on %s\n", *mode, a) }
	switch *mode {
	case "goroutine", "stdlib":
		ln, err := net.Listen("tcp4", *listen)
		if err != nil {
			return fmt.Errorf("floor-proxy: %w", err)
		}
		ready(ln.Addr())
		if *mode == "stdlib" {
			return ServeStdlib(ctx, ln, *upstream)
		}
		return Serve(ctx, ln, *upstream)
	case "loop":
		return ServeLoop(ctx, *listen, *upstream, ready)
	default:
		return fmt.Errorf("floor-proxy: --mode must be goroutine, loop or stdlib, not %q", *mode)
	}
}
