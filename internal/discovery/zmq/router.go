package zmq

// routerSocket is the bound, receive-only ROUTER socket the Listener reads.
// Two builds provide it through listenRouter:
//
//   - default (!czmq, router_zeromq.go): pure-Go go-zeromq behind the
//     guarded transport (guard.go);
//   - -tags czmq (router_czmq.go): libzmq through cgo (github.com/pebbe/zmq4).
//
// listenRouter(opts, hostPort, log, drop) binds hostPort (opts.Address
// without tcp://) and returns the socket and its bound host:port (the real
// port when the configured one is 0). A bind failure is an error containing
// "bind". drop counts transport-level drops (the go-zeromq guard's).
type routerSocket interface {
	// Recv blocks for the next message: the peer's identity frame, then its
	// payload frames. command marks a ZMTP command passed up by the
	// transport instead of a message. Recv is called from one goroutine; it
	// returns an error once Close has begun.
	Recv() (frames [][]byte, command bool, err error)
	// Close unblocks Recv and releases the socket and its port. It is
	// idempotent and returns once the socket is closed.
	Close() error
}
