//go:build linux

package floor

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"slices"
	"syscall"
)

// loopConn is a descriptor of ServeLoop's: a client connection or an
// upstream one. While a request is in flight its client and upstream
// connection are each other's peer.
type loopConn struct {
	fd       int
	upstream bool
	peer     *loopConn
	buf      []byte
}

// loop is ServeLoop's state; only its goroutine touches it.
type loop struct {
	ep    int
	lfd   int
	wake  [2]int
	up    syscall.SockaddrInet4
	conns map[int]*loopConn
	idle  []*loopConn // upstream connections with nothing in flight
	rbuf  []byte
}

// ServeLoop proxies every connection to addr (an IPv4 host:port it listens
// on) to upstream (an IPv4 host:port) from one goroutine locked to its
// thread: non-blocking sockets in an epoll set of its own, level-triggered,
// each readable descriptor read once per wake-up. It returns when ctx ends,
// with every descriptor closed. ready, when not nil, is called with the
// listening address once connections are accepted.
func ServeLoop(ctx context.Context, addr, upstream string, ready func(net.Addr)) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	la, err := inet4(addr)
	if err != nil {
		return err
	}
	ua, err := inet4(upstream)
	if err != nil {
		return err
	}
	l := &loop{ep: -1, lfd: -1, wake: [2]int{-1, -1}, up: ua, conns: map[int]*loopConn{}, rbuf: make([]byte, 64<<10)}
	defer l.close()
	if err := l.open(&la); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { syscall.Write(l.wake[1], []byte{0}) })
	defer stop()
	if ready != nil {
		sa, err := syscall.Getsockname(l.lfd)
		if err != nil {
			return fmt.Errorf("floor: getsockname: %w", err)
		}
		a := sa.(*syscall.SockaddrInet4)
		ready(&net.TCPAddr{IP: net.IP(a.Addr[:]), Port: a.Port})
	}
	return l.run()
}

// open creates the epoll set, the wake pipe and the listening socket.
func (l *loop) open(la *syscall.SockaddrInet4) error {
	var err error
	if l.ep, err = syscall.EpollCreate1(syscall.EPOLL_CLOEXEC); err != nil {
		return fmt.Errorf("floor: epoll_create1: %w", err)
	}
	if err = syscall.Pipe2(l.wake[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC); err != nil {
		return fmt.Errorf("floor: pipe2: %w", err)
	}
	if l.lfd, err = syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0); err != nil {
		return fmt.Errorf("floor: socket: %w", err)
	}
	if err = syscall.SetsockoptInt(l.lfd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		return fmt.Errorf("floor: SO_REUSEADDR: %w", err)
	}
	if err = syscall.Bind(l.lfd, la); err != nil {
		return fmt.Errorf("floor: bind: %w", err)
	}
	if err = syscall.Listen(l.lfd, 4096); err != nil {
		return fmt.Errorf("floor: listen: %w", err)
	}
	for _, fd := range []int{l.wake[0], l.lfd} {
		if err = l.watch(fd); err != nil {
			return err
		}
	}
	return nil
}

func (l *loop) watch(fd int) error {
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(fd)}
	if err := syscall.EpollCtl(l.ep, syscall.EPOLL_CTL_ADD, fd, &ev); err != nil {
		return fmt.Errorf("floor: epoll_ctl: %w", err)
	}
	return nil
}

// close closes every descriptor the loop opened.
func (l *loop) close() {
	for fd := range l.conns {
		syscall.Close(fd)
	}
	for _, fd := range []int{l.lfd, l.wake[0], l.wake[1], l.ep} {
		if fd >= 0 {
			syscall.Close(fd)
		}
	}
}

// run waits for events until the wake pipe is written.
func (l *loop) run() error {
	events := make([]syscall.EpollEvent, 256)
	for {
		n, err := syscall.EpollWait(l.ep, events, -1)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("floor: epoll_wait: %w", err)
		}
		for _, ev := range events[:n] {
			switch fd := int(ev.Fd); fd {
			case l.wake[0]:
				return nil
			case l.lfd:
				l.accept()
			default:
				if c := l.conns[fd]; c != nil {
					l.readable(c)
				}
			}
		}
	}
}

func (l *loop) accept() {
	for {
		fd, _, err := syscall.Accept4(l.lfd, syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC)
		if err != nil {
			return // EAGAIN, or an error the next wake-up retries
		}
		syscall.SetsockoptInt(fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1)
		if l.watch(fd) != nil {
			syscall.Close(fd)
			continue
		}
		l.conns[fd] = &loopConn{fd: fd, buf: make([]byte, 0, 4<<10)}
	}
}

// drop closes c and, when it had a request in flight, its peer.
func (l *loop) drop(c *loopConn) {
	for _, x := range []*loopConn{c, c.peer} {
		if x == nil {
			continue
		}
		delete(l.conns, x.fd)
		syscall.Close(x.fd)
		if x.upstream {
			l.idle = slices.DeleteFunc(l.idle, func(u *loopConn) bool { return u == x })
		}
	}
}

// readable reads what c has and moves a whole message on.
func (l *loop) readable(c *loopConn) {
	k, err := syscall.Read(c.fd, l.rbuf)
	if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINTR) {
		return
	}
	if k <= 0 {
		l.drop(c)
		return
	}
	c.buf = append(c.buf, l.rbuf[:k]...)
	if !c.upstream {
		l.dispatch(c)
		return
	}
	n, ferr := messageLen(c.buf, true)
	if ferr != nil || c.peer == nil {
		l.drop(c)
		return
	}
	if n == 0 {
		return
	}
	client := c.peer
	c.peer, client.peer = nil, nil
	werr := writeAll(client.fd, c.buf[:n])
	l.idle = append(l.idle, l.reset(c)) // done with this response either way
	if werr != nil {
		l.drop(client)
		return
	}
	l.dispatch(client)
}

// reset empties an upstream connection's buffer for its next response
// (anything past a response is a framing error the next read reports).
func (l *loop) reset(c *loopConn) *loopConn {
	c.buf = c.buf[:0]
	return c
}

// dispatch sends client's next whole request upstream when none is in
// flight.
func (l *loop) dispatch(client *loopConn) {
	if client.peer != nil {
		return
	}
	n, err := messageLen(client.buf, false)
	if err != nil {
		l.drop(client)
		return
	}
	if n == 0 {
		return
	}
	u, err := l.upstream()
	if err != nil {
		l.drop(client)
		return
	}
	if writeAll(u.fd, client.buf[:n]) != nil {
		l.drop(u)
		l.drop(client)
		return
	}
	client.buf = append(client.buf[:0], client.buf[n:]...)
	u.peer, client.peer = client, u
}

// upstream returns an idle upstream connection or connects a new one
// (blocking: a loopback connect returns at once).
func (l *loop) upstream() (*loopConn, error) {
	if n := len(l.idle); n > 0 {
		u := l.idle[n-1]
		l.idle = l.idle[:n-1]
		return u, nil
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Connect(fd, &l.up); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	syscall.SetsockoptInt(fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1)
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	if err := l.watch(fd); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	u := &loopConn{fd: fd, upstream: true, buf: make([]byte, 0, 4<<10)}
	l.conns[fd] = u
	return u, nil
}

// errFull is a write that found the socket's buffer full: the loop never
// waits to write (a loopback socket's buffer holds a whole message of the
// sizes this is for), so the connection is dropped.
var errFull = errors.New("floor: socket buffer full")

// writeAll writes b to a non-blocking socket.
func writeAll(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := syscall.Write(fd, b)
		switch {
		case errors.Is(err, syscall.EINTR):
			continue
		case errors.Is(err, syscall.EAGAIN):
			return errFull
		case err != nil:
			return err
		}
		b = b[n:]
	}
	return nil
}
