//go:build !linux

package fdpoll

import "syscall"

// Poller is Linux's epoll set; elsewhere there is none.
type Poller struct{}

// Readable and Hangup are Linux's event masks; elsewhere they select nothing.
const (
	Readable Events = 1
	Hangup   Events = 2
)

// New returns nil off Linux.
func New() *Poller { return nil }

// NewFor returns nil off Linux.
func NewFor(Events) *Poller { return nil }

// Stop does nothing.
func (*Poller) Stop() {}

// Add registers nothing.
func (*Poller) Add(syscall.RawConn, Handler) (int32, bool) { return 0, false }

// Rearm registers nothing.
func (*Poller) Rearm(syscall.RawConn, Handler) bool { return false }

// Remove does nothing.
func (*Poller) Remove(syscall.RawConn, int32, Handler) {}
