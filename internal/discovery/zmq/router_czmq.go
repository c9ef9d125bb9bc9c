//go:build czmq

package zmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"

	czmq "github.com/pebbe/zmq4"
)

// routerBackend names the ROUTER implementation in the startup log line.
const routerBackend = "libzmq"

// czmqRouter is the -tags czmq ROUTER: libzmq through cgo. libzmq sockets
// are not goroutine-safe, so one goroutine (own) creates the context and
// every socket, binds, receives and closes them all; Recv reads what it
// forwards. It waits in zmq_poll on the ROUTER and on an inproc PAIR that
// Close writes one wake-up message to, so an idle listener makes no call
// at all and Close is immediate: no receive timeout, no polling loop.
type czmqRouter struct {
	log  *slog.Logger
	msgs chan czmqMsg // owner → Recv

	wake      *czmq.Socket  // Close's end of the wake-up pair: created by the owner, used once by Close
	stop      chan struct{} // closed by Close: Recv fails, the owner stops forwarding
	wakeSent  chan struct{} // closed by Close once its send on wake has returned
	exited    chan struct{} // closed by the owner after closing every socket and the context
	closeOnce sync.Once
}

type czmqMsg struct {
	frames [][]byte
	err    error
}

// czmqBacklog is how many received messages may wait for Recv (each at most
// MaxMessageBytes per frame, bounded by ZMQ_MAXMSGSIZE).
const czmqBacklog = 64

func listenRouter(opts Options, hostPort string, log *slog.Logger, _ func(reason, detail string)) (routerSocket, string, error) {
	endpoint, ipv6, err := czmqEndpoint(hostPort)
	if err != nil {
		return nil, "", fmt.Errorf("bind %s: %w", opts.Address, err)
	}
	r := &czmqRouter{
		log: log, msgs: make(chan czmqMsg, czmqBacklog),
		stop: make(chan struct{}), wakeSent: make(chan struct{}), exited: make(chan struct{}),
	}
	type bound struct {
		addr string
		err  error
	}
	ready := make(chan bound, 1)
	go r.own(func(addr string, err error) { ready <- bound{addr, err} }, endpoint, ipv6, opts)
	b := <-ready
	if b.err != nil {
		<-r.exited
		return nil, "", b.err
	}
	return r, b.addr, nil
}

// czmqEndpoint turns host:port (as validated by New) into a libzmq bind
// endpoint and whether it needs ZMQ_IPV6. An empty, "*", 0.0.0.0 or :: host
// binds every interface, IPv6 too, as net.Listen does (libzmq falls back to
// IPv4 where IPv6 is unavailable); an empty or "*" port, like 0, picks a
// free one. libzmq binds only IP literals, so a host name is resolved here
// and, as net.Listen does, its first IPv4 address (else its first) is bound.
func czmqEndpoint(hostPort string) (endpoint string, ipv6 bool, err error) {
	host, port, err := net.SplitHostPort(hostPort)
	if err != nil {
		return "", false, err
	}
	if port == "" || port == "*" {
		port = "0"
	}
	if host == "" || host == "*" {
		return "tcp://*:" + port, true, nil
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		ips, err := net.DefaultResolver.LookupNetIP(context.Background(), "ip", host)
		if err != nil {
			return "", false, err
		}
		if len(ips) == 0 {
			return "", false, fmt.Errorf("no address for %q", host)
		}
		ip = ips[0]
		for _, a := range ips {
			if a.Unmap().Is4() {
				ip = a
				break
			}
		}
	}
	ip = ip.Unmap()
	if ip.IsUnspecified() {
		return "tcp://*:" + port, true, nil
	}
	// An IPv4 address is bound without ZMQ_IPV6, so it is not reported as
	// [::ffff:a.b.c.d].
	return "tcp://" + net.JoinHostPort(ip.String(), port), ip.Is6(), nil
}

// own is the goroutine that owns the libzmq context and sockets. It reports
// the bind result through bound, then receives until Close.
func (r *czmqRouter) own(bound func(addr string, err error), endpoint string, ipv6 bool, opts Options) {
	defer close(r.exited)
	zctx, err := czmq.NewContext()
	if err != nil {
		bound("", fmt.Errorf("libzmq: %w", err))
		return
	}
	// Deferred first, so it runs after the sockets are closed: zmq_ctx_term
	// waits for every socket of the context to be closed, and with
	// ZMQ_LINGER 0 that also releases the bound port before Close returns.
	defer func() { _ = zctx.Term() }()
	var socks []*czmq.Socket
	defer func() {
		for _, s := range socks {
			_ = s.Close()
		}
	}()
	newSocket := func(t czmq.Type) (*czmq.Socket, error) {
		s, err := zctx.NewSocket(t)
		if err != nil {
			return nil, err
		}
		socks = append(socks, s)
		return s, s.SetLinger(0)
	}

	// The wake-up pair: its own context makes the inproc name private.
	wakeR, err := newSocket(czmq.PAIR)
	if err == nil {
		err = wakeR.Bind("inproc://wake")
	}
	var wakeW *czmq.Socket
	if err == nil {
		wakeW, err = newSocket(czmq.PAIR)
	}
	if err == nil {
		err = wakeW.Connect("inproc://wake")
	}
	if err != nil {
		bound("", fmt.Errorf("libzmq wake-up socket: %w", err))
		return
	}

	router, err := newSocket(czmq.ROUTER)
	if err == nil {
		err = errors.Join(
			router.SetMaxmsgsize(int64(opts.MaxMessageBytes)),
			router.SetIpv6(ipv6),
			router.SetHandshakeIvl(opts.HandshakeTimeout),
			// A ROUTER accepts one connection per routing id (a P2P-NCCL
			// instance's is its zmq_address). Without handover an instance
			// that comes back with the same id while its old connection is
			// still open (half-open after a host reset) would be ignored
			// until that connection dies; with it, the newest one wins.
			router.SetRouterHandover(true),
			// TCP keep-alive as Go's net.Listen sets it (the default
			// backend): half-open connections are found and closed.
			router.SetTcpKeepalive(1),
			router.SetTcpKeepaliveIdle(15),
			router.SetTcpKeepaliveIntvl(15))
	}
	if err != nil {
		bound("", fmt.Errorf("libzmq ROUTER: %w", err))
		return
	}
	if err := router.Bind(endpoint); err != nil {
		bound("", fmt.Errorf("bind %s: %w", opts.Address, err))
		return
	}
	last, err := router.GetLastEndpoint()
	if err != nil {
		bound("", fmt.Errorf("libzmq ZMQ_LAST_ENDPOINT: %w", err))
		return
	}
	r.wake = wakeW
	bound(strings.TrimPrefix(last, "tcp://"), nil)

	r.receive(router, wakeR)
	// Close may still be inside its send on wakeW: close nothing before it
	// has returned.
	<-r.wakeSent
}

// receive forwards the ROUTER's messages to Recv until Close.
func (r *czmqRouter) receive(router, wake *czmq.Socket) {
	poller := czmq.NewPoller()
	poller.Add(router, czmq.POLLIN)
	poller.Add(wake, czmq.POLLIN)
	for {
		polled, err := poller.Poll(-1) // EINTR is retried by pebbe/zmq4
		if err != nil {
			// Not expected (the context is ours until we terminate it). The
			// error goes to Recv, whose caller pauses before receiving again,
			// so this cannot spin.
			if !r.forward(czmqMsg{err: fmt.Errorf("libzmq poll: %w", err)}) {
				return
			}
			continue
		}
		for _, p := range polled {
			if p.Socket == wake {
				return // Close
			}
		}
		// The ROUTER is readable: take everything queued, then poll again.
		for {
			frames, err := recvFrames(router)
			if czmq.AsErrno(err) == czmq.Errno(syscall.EAGAIN) {
				break
			}
			if err != nil {
				err = fmt.Errorf("libzmq recv: %w", err)
			}
			if !r.forward(czmqMsg{frames: frames, err: err}) {
				return
			}
			if err != nil {
				break
			}
		}
	}
}

// forward hands m to Recv; false once Close has begun.
func (r *czmqRouter) forward(m czmqMsg) bool {
	select {
	case <-r.stop:
		return false
	default:
	}
	select {
	case r.msgs <- m:
		return true
	case <-r.stop:
		return false
	}
}

// recvFrames reads one whole message without blocking (libzmq delivers a
// multipart message atomically, so once its first frame is there all are).
// Frames past the third are counted but not kept: a message of more than
// two frames is dropped anyway (ReasonFrames), with its real frame count.
func recvFrames(s *czmq.Socket) ([][]byte, error) {
	var frames [][]byte
	for {
		b, err := s.RecvBytes(czmq.DONTWAIT)
		if err != nil {
			return nil, err
		}
		if len(frames) >= 3 {
			b = nil
		}
		frames = append(frames, b)
		more, err := s.GetRcvmore()
		if err != nil {
			return nil, err
		}
		if !more {
			return frames, nil
		}
	}
}

func (r *czmqRouter) Recv() ([][]byte, bool, error) {
	// libzmq handles ZMTP commands (PING/PONG) itself: none reach Recv.
	select {
	case <-r.stop:
		return nil, false, net.ErrClosed
	default:
	}
	select {
	case m := <-r.msgs:
		return m.frames, false, m.err
	case <-r.stop:
		return nil, false, net.ErrClosed
	}
}

// Close wakes the owning goroutine out of zmq_poll and returns once it has
// closed every socket and terminated the context (the port is free again).
func (r *czmqRouter) Close() error {
	var err error
	r.closeOnce.Do(func() {
		close(r.stop)
		// One message on an inproc PAIR (far below its high-water mark):
		// the send does not block, and the owner closes wake only after
		// wakeSent.
		_, err = r.wake.Send("", 0)
		close(r.wakeSent)
		if err != nil {
			// Cannot happen with a live context; if it did, the owner would
			// stay in zmq_poll, so do not wait for it.
			err = fmt.Errorf("zmq discovery: waking the libzmq socket's goroutine: %w", err)
			r.log.Error(err.Error())
			return
		}
		<-r.exited
	})
	return err
}
