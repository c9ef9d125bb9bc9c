//go:build !czmq

package zmq

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// routerBackend names the ROUTER implementation in the startup log line.
const routerBackend = "go-zeromq"

// zeromqRouter is the default ROUTER: go-zeromq behind the guarded transport
// (without it when Options.rawTCP is set).
type zeromqRouter struct {
	sock zmq4.Socket
	g    *guard // nil with rawTCP
	stop context.CancelFunc
	log  *slog.Logger

	mu     sync.Mutex // held by Recv: Close takes it to wait out an in-flight Recv
	closed bool
}

func listenRouter(opts Options, hostPort string, log *slog.Logger, drop func(reason, detail string)) (routerSocket, string, error) {
	r := &zeromqRouter{log: log}
	scheme := "tcp"
	ctx := context.Background()
	if !opts.rawTCP {
		if err := registerTransport(); err != nil {
			return nil, "", err
		}
		scheme = transportName
		r.g = newGuard(opts.MaxMessageBytes, opts.MaxConnections, opts.HandshakeTimeout, drop)
		ctx = context.WithValue(ctx, guardKey{}, r.g)
	}
	ctx, r.stop = context.WithCancel(ctx)
	// No WithAutomaticReconnect: a bound ROUTER never dials, and the option
	// races with Close. go-zeromq's own log lines go to debug.
	r.sock = zmq4.NewRouter(ctx, zmq4.WithLogger(slog.NewLogLogger(log.Handler(), slog.LevelDebug)))
	if err := r.sock.Listen(scheme + "://" + hostPort); err != nil {
		_ = r.sock.Close()
		r.stop()
		return nil, "", fmt.Errorf("bind %s: %w", opts.Address, err)
	}
	return r, r.sock.Addr().String(), nil
}

func (r *zeromqRouter) Recv() ([][]byte, bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, false, net.ErrClosed
	}
	msg, err := r.sock.Recv()
	if err != nil {
		return nil, false, err
	}
	return msg.Frames, msg.Type == zmq4.CmdMsg, nil
}

// Close stops Recv (cancelling the socket's context), waits for an in-flight
// Recv to return, then drains go-zeromq's internal queue until none of its
// reader goroutines is left blocked on it, then closes the socket. The order
// matters: go-zeromq's Close also closes every connection, which would hide
// from the guard which reader goroutines are still holding a message (see
// guard.go).
func (r *zeromqRouter) Close() error {
	r.stop()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if r.g != nil {
		r.g.closeAll()
		deadline := time.Now().Add(2 * time.Second)
		for r.g.pending.Load() > 0 && time.Now().Before(deadline) {
			if _, err := r.sock.Recv(); err != nil {
				time.Sleep(100 * time.Microsecond)
			}
		}
		if n := r.g.pending.Load(); n > 0 {
			r.log.Warn("zmq discovery: socket reader goroutines still blocked after close", "count", n)
		}
	}
	return r.sock.Close()
}
