//go:build unix

package h1server

import (
	"errors"
	"os"
	"syscall"
)

// readNow reads what the connection has into b without blocking: n > 0
// bytes, or again when nothing has arrived yet. EOF and errors (n 0, again
// false) are left to the next read of the connection, which reports them.
func readNow(fd uintptr, b []byte) (n int, again bool) {
	for {
		n, err := syscall.Read(int(fd), b)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK:
			return 0, true
		case err == nil && n > 0:
			return n, false
		}
		return 0, false
	}
}

// peekResult is what a non-blocking peek at a connection found.
type peekResult int

const (
	peekAlive peekResult = iota // nothing to read: the client is waiting
	peekData                    // the client sent more (a pipelined request)
	peekGone                    // EOF or a connection error
)

// peek looks at the connection without blocking and without consuming.
func peek(rc syscall.RawConn) peekResult {
	res := peekGone
	err := rc.Read(func(fd uintptr) bool {
		var one [1]byte
		n, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		switch {
		case n > 0:
			res = peekData
		case err == syscall.EAGAIN || err == syscall.EWOULDBLOCK:
			res = peekAlive
		default: // n == 0 with no error: EOF; or ECONNRESET and the like
			res = peekGone
		}
		return true // never wait for readiness
	})
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return peekAlive // a read deadline the handler set: says nothing of the peer
	case err != nil:
		return peekGone // closed
	}
	return res
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
