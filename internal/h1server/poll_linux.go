package h1server

import (
	"sync"
	"syscall"
)

// poller watches the connections whose requests are being handled for a
// client that leaves, without polling: their descriptors sit in an epoll
// set of the server's own (EPOLLRDHUP|EPOLLIN, one-shot) and one goroutine
// waits on it. An event makes the watch peek at the connection (peek), so
// a pipelined request ends the watch and a closed or reset one cancels the
// request, as the timer's peeks do elsewhere. While nothing happens on the
// connections it costs nothing.
type poller struct {
	epfd int
	wake [2]int // a pipe: a byte on wake[1] stops the loop

	mu     sync.Mutex
	byFd   map[int32]*watch
	closed bool
	done   chan struct{}
}

const pollEvents = syscall.EPOLLIN | syscall.EPOLLRDHUP | syscall.EPOLLONESHOT

// newPoller returns a running poller, or nil when the system refuses one
// (the watches then use their timers).
func newPoller() *poller {
	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil
	}
	p := &poller{epfd: epfd, byFd: make(map[int32]*watch), done: make(chan struct{})}
	if err := syscall.Pipe2(p.wake[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC); err != nil {
		syscall.Close(epfd)
		return nil
	}
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(p.wake[0])}
	if err := syscall.EpollCtl(epfd, syscall.EPOLL_CTL_ADD, p.wake[0], &ev); err != nil {
		p.closeFds()
		return nil
	}
	go p.run()
	return p
}

func (p *poller) closeFds() {
	syscall.Close(p.wake[0])
	syscall.Close(p.wake[1])
	syscall.Close(p.epfd)
}

// run delivers events to their watches until stop.
func (p *poller) run() {
	defer close(p.done)
	evs := make([]syscall.EpollEvent, 64)
	for {
		n, err := syscall.EpollWait(p.epfd, evs, -1)
		if err == syscall.EINTR {
			continue
		}
		if err != nil {
			return
		}
		for _, ev := range evs[:n] {
			if ev.Fd == int32(p.wake[0]) {
				return
			}
			p.mu.Lock()
			w := p.byFd[ev.Fd]
			p.mu.Unlock()
			if w != nil {
				w.event()
			}
		}
	}
}

// stop ends the loop and closes the epoll set; watches still registered
// are forgotten (their requests then go unwatched).
func (p *poller) stop() {
	if p == nil {
		return
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	p.mu.Unlock()
	syscall.Write(p.wake[1], []byte{1})
	<-p.done
	p.mu.Lock()
	p.closeFds()
	p.byFd = nil
	p.mu.Unlock()
}

// add registers w's connection; false: not registered (use the timer).
func (p *poller) add(w *watch) bool {
	return p.ctl(w, syscall.EPOLL_CTL_ADD)
}

// rearm asks for the connection's next event (the last one disarmed it).
func (p *poller) rearm(w *watch) bool {
	return p.ctl(w, syscall.EPOLL_CTL_MOD)
}

// ctl adds or re-arms w's descriptor. The map entry is in place before the
// descriptor is armed (under mu, which run takes to look it up), so an
// event right away finds it.
func (p *poller) ctl(w *watch, op int) bool {
	ok := false
	err := w.rc.Control(func(fd uintptr) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return
		}
		w.fd = int32(fd)
		p.byFd[w.fd] = w
		ev := syscall.EpollEvent{Events: pollEvents, Fd: int32(fd)}
		if syscall.EpollCtl(p.epfd, op, int(fd), &ev) == nil {
			ok = true
			return
		}
		delete(p.byFd, w.fd)
	})
	return err == nil && ok
}

// remove takes w's descriptor out of the set. A connection already closed
// left it by itself (Control then fails and nothing is done to a
// descriptor number that may have been reused).
func (p *poller) remove(w *watch) {
	_ = w.rc.Control(func(fd uintptr) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return
		}
		_ = syscall.EpollCtl(p.epfd, syscall.EPOLL_CTL_DEL, int(fd), nil)
	})
	p.mu.Lock()
	if p.byFd[w.fd] == w {
		delete(p.byFd, w.fd)
	}
	p.mu.Unlock()
}

// peekNow looks at the connection without blocking, consuming or minding
// a read deadline the handler set (Control, not Read: an event is news of
// the socket itself).
func peekNow(rc syscall.RawConn) peekResult {
	res := peekGone
	err := rc.Control(func(fd uintptr) {
		var one [1]byte
		n, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case n > 0:
			res = peekData
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK || err == syscall.EINTR:
			res = peekAlive
		}
	})
	if err != nil {
		return peekGone // closed
	}
	return res
}
