package fdpoll

import (
	"os"
	"sync"
	"syscall"
)

// Poller is an epoll set with the goroutine that delivers its events.
//
// The goroutine waits for the set in Go's runtime poller (the set's
// descriptor is itself pollable), not in a blocking epoll_wait: a
// goroutine blocked in a system call keeps its thread and, until the
// runtime's monitor takes it back (20 µs to 10 ms later), its processor
// too. With an event per request (RoundTripAsync's answers) the loop went
// back into the call hundreds of times a second, each time holding one
// of the router's processors away from the requests.
type Poller struct {
	epfd int
	set  *os.File        // epfd as a pollable file: closing it closes epfd
	rc   syscall.RawConn // set's, for the runtime poller's wait
	wake [2]int          // a pipe: a byte on wake[1] stops the loop

	events uint32 // what a registration asks for (Events), one-shot

	mu     sync.Mutex
	byFd   map[int32]Handler
	closed bool
	done   chan struct{}
}

// Readable and Hangup are what a poller's registrations ask to be told
// of. EPOLLHUP and EPOLLERR (a reset) are reported either way.
const (
	Readable Events = syscall.EPOLLIN | syscall.EPOLLRDHUP // data arrived or the peer closed
	Hangup   Events = syscall.EPOLLRDHUP                   // the peer closed (data does not count)
)

// New returns a running poller telling of Readable, or nil when the
// system refuses one.
func New() *Poller { return NewFor(Readable) }

// NewFor returns a running poller telling its handlers of ev, or nil when
// the system refuses one.
func NewFor(ev Events) *Poller {
	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil
	}
	if err := syscall.SetNonblock(epfd, true); err != nil { // NewFile makes a non-blocking descriptor pollable
		syscall.Close(epfd)
		return nil
	}
	p := &Poller{epfd: epfd, events: uint32(ev) | syscall.EPOLLONESHOT, byFd: make(map[int32]Handler), done: make(chan struct{})}
	p.set = os.NewFile(uintptr(epfd), "fdpoll")
	rc, err := p.set.SyscallConn()
	if err != nil {
		p.set.Close()
		return nil
	}
	p.rc = rc
	if err := syscall.Pipe2(p.wake[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC); err != nil {
		p.set.Close()
		return nil
	}
	wake := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(p.wake[0])}
	if err := syscall.EpollCtl(epfd, syscall.EPOLL_CTL_ADD, p.wake[0], &wake); err != nil {
		p.closeFds()
		return nil
	}
	go p.run()
	return p
}

func (p *Poller) closeFds() {
	syscall.Close(p.wake[0])
	syscall.Close(p.wake[1])
	p.set.Close()
}

// run delivers events to their handlers until Stop.
func (p *Poller) run() {
	defer close(p.done)
	evs := make([]syscall.EpollEvent, 64)
	for {
		n, err := p.wait(evs)
		if err != nil {
			return
		}
		for _, ev := range evs[:n] {
			if ev.Fd == int32(p.wake[0]) {
				return
			}
			p.mu.Lock()
			h := p.byFd[ev.Fd]
			p.mu.Unlock()
			if h != nil {
				h.PollEvent()
			}
		}
	}
}

// wait returns the set's next events, parked in the runtime poller while
// there are none: a set with events ready is readable, and each event that
// arrives after a look that found none makes it readable anew.
func (p *Poller) wait(evs []syscall.EpollEvent) (n int, err error) {
	rerr := p.rc.Read(func(fd uintptr) bool {
		for {
			n, err = syscall.EpollWait(int(fd), evs, 0)
			if err != syscall.EINTR {
				return n > 0 || err != nil
			}
		}
	})
	if err == nil {
		err = rerr
	}
	return n, err
}

// Stop ends the loop and closes the epoll set, then tells every handler
// still registered (once, on the caller's goroutine). Later calls of Add
// and Rearm register nothing.
func (p *Poller) Stop() {
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
	left := p.byFd
	p.byFd = nil
	p.mu.Unlock()
	for _, h := range left {
		h.PollEvent()
	}
}

// Add registers rc's descriptor for h and returns the number the poller
// knows it by (for Remove); ok false: not registered (stopped poller,
// closed connection, or the system refused).
func (p *Poller) Add(rc syscall.RawConn, h Handler) (fd int32, ok bool) {
	return p.ctl(rc, h, syscall.EPOLL_CTL_ADD)
}

// Rearm asks for the next event of a registered descriptor (the last one
// disarmed it).
func (p *Poller) Rearm(rc syscall.RawConn, h Handler) bool {
	_, ok := p.ctl(rc, h, syscall.EPOLL_CTL_MOD)
	return ok
}

// ctl adds or re-arms rc's descriptor. The map entry is in place before
// the descriptor is armed (under mu, which run takes to look it up), so an
// event right away finds it.
func (p *Poller) ctl(rc syscall.RawConn, h Handler, op int) (fd int32, ok bool) {
	if p == nil {
		return 0, false
	}
	err := rc.Control(func(u uintptr) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return
		}
		fd = int32(u)
		p.byFd[fd] = h
		ev := syscall.EpollEvent{Events: p.events, Fd: fd}
		if syscall.EpollCtl(p.epfd, op, int(u), &ev) == nil {
			ok = true
			return
		}
		delete(p.byFd, fd)
	})
	return fd, err == nil && ok
}

// Remove takes h's descriptor (fd, as Add returned it) out of the set. A
// connection already closed left it by itself (Control then fails and
// nothing is done to a descriptor number that may have been reused).
func (p *Poller) Remove(rc syscall.RawConn, fd int32, h Handler) {
	if p == nil {
		return
	}
	_ = rc.Control(func(u uintptr) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return
		}
		_ = syscall.EpollCtl(p.epfd, syscall.EPOLL_CTL_DEL, int(u), nil)
	})
	p.mu.Lock()
	if p.byFd[fd] == h {
		delete(p.byFd, fd)
	}
	p.mu.Unlock()
}
