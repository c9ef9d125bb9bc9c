// Package fdpoll tells a handler, without a goroutine of its own, that a
// connection became readable or its peer closed it: the connections'
// descriptors sit in an epoll set of the poller's own (EPOLLIN|EPOLLRDHUP,
// or EPOLLRDHUP alone for a poller made with NewFor(Hangup); one-shot),
// and one goroutine per poller waits on it, parked in Go's runtime poller
// (the set's own descriptor is pollable), not in a blocking epoll_wait. A connection also
// stays in Go's runtime poller: a handler reads it as usual, through its
// net.Conn, after the event.
//
// Events are hints: a handler is told at most once per Add or Rearm, may
// be told of a connection that has nothing to read after all (it looks for
// itself, e.g. with a MSG_PEEK), and is told nothing of a connection that
// was closed while registered (the kernel drops a closed descriptor from
// the set): whoever closes a connection must also end its wait. When the
// poller stops, every handler still registered is told once, so that no
// wait is left without an end.
//
// Off Linux New returns nil, and a nil *Poller registers nothing: callers
// fall back to a goroutine or a timer.
package fdpoll

// Events is what a poller's registrations ask to be told of (Readable,
// Hangup).
type Events uint32

// Handler receives a registered connection's event, on the poller's
// goroutine: it must not block (hand longer work to a goroutine).
type Handler interface {
	PollEvent()
}
