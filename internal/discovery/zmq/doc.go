// Package zmq is the ZMQ self-registration source for prefill/decode
// disaggregated vLLM: vLLM instances started with a kv_connector that has
// proxy_ip/proxy_port (P2P-NCCL) or proxy_ping_port (MoRI-IO) connect a
// DEALER socket to the router and send a msgpack registration every 3 s,
// forever, with no unregister message. The Listener binds a receive-only
// ROUTER socket (pure-Go go-zeromq; libzmq with -tags czmq, see below),
// keeps one registry entry per instance, and expires instances that stop
// sending.
//
// # Wiring
//
//	l, err := zmq.New(zmq.Options{Address: cfg.VLLMDiscoveryAddress, Registry: reg,
//		Metrics: m, Logger: log, TTL: cfg.DiscoveryTTL(), Connector: cfg.KVConnector})
//	if err != nil { return err }      // bad options or bind failure: fail at startup
//	go l.Run(ctx)                     // returns nil once ctx is cancelled
//	defer l.Close()                   // idempotent; also fine if Run never ran
//	l.FleetMode(); l.Status()         // for PD dispatch, /workers, /get_server_info
//
// # Formats
//
// Payloads are msgpack maps with string keys; strings may be msgpack str or
// bin, numbers int or decimal str; unknown keys are ignored.
//
//   - P2P-NCCL: {"type": "P"|"D", "http_address": "ip:port", "zmq_address": "ip:port"}.
//   - MoRI-IO (current): the same plus "dp_size", "tp_size" and
//     "transfer_mode" ("READ"|"WRITE", any case; upper-cased), all three or
//     none; zmq_address is "host:IP,handshake:PORT,notify:PORT".
//   - MoRI-IO (old): {"type": "register", "role": "P"|"D", "request_address":
//     "http://ip:port/v1/completions", "handshake_port", "notify_port",
//     "dp_size", "tp_size", "transfer_mode", "index"}. http_address is the
//     host:port of request_address (IPv6 and host names work) and zmq_address
//     is synthesised as host:IP,handshake:HP,notify:NP. "index" changes on
//     every heartbeat and is ignored.
//   - {"type": "HELLO"} is ignored (counted as dropped, reason hello).
//
// The connector adds requirements: moriio needs transfer_mode and the MoRI-IO
// zmq_address; p2pnccl needs an ip:port zmq_address; nixl and mooncake take
// any valid registration and never gate on the transfer mode.
//
// # Invariants
//
//   - One instance per http_address (the registry Instance key). Its Workers
//     have URL http://<http_address>, Source zmq, Role prefill|decode, the
//     registered DP/TP sizes, zmq_address, transfer mode and format; dp_size
//     > 1 expands into one Worker per rank (X-data-parallel-rank pins ranks).
//   - A heartbeat identical to the registration (ignoring "index") only
//     refreshes LastSeen: the Workers and their load, health and breaker
//     state are kept, and no snapshot is rebuilt. Any change (a restart with
//     a new zmq_address, another mode or size) replaces the instance's
//     Workers. Queued heartbeats arriving in a burst after a reconnect are
//     therefore harmless.
//   - An instance removed from the registry by someone else (the admin API)
//     while it keeps registering is re-added by its next heartbeat:
//     discovery is the source of truth for the instances it found.
//   - An instance is removed TTL after its last message (default 9 s: three
//     missed 3-second heartbeats), with sub-second precision: a timer aims at
//     the next expiry; nothing polls.
//   - Arrival, replacement, expiry and mode changes are logged once at info;
//     heartbeats only at debug. The first drop of each reason is a warning,
//     later ones debug.
//   - MoRI-IO transfer mode is per instance and the routable fleet never
//     mixes modes. FleetMode is the mode of the routable MoRI-IO instances;
//     with none live, the next registration sets it. An instance whose mode
//     differs from a live fleet is registered but held aside: its Workers are
//     created not routable (never published routable, even briefly) with the
//     note "held: transfer_mode X differs from fleet Y", and it is listed in
//     Status. When the last instance of the fleet mode expires (or re-
//     registers in the other mode), the fleet switches: the held instances
//     become routable.
//   - No input stops the listener, and none costs more memory than its own
//     size: the payload is read by a bounds-checked msgpack reader that
//     checks every declared str/bin/ext length and array/map count against
//     the bytes left before using it (a 5-byte "4 GiB string" is a decode
//     drop). Every dropped message is counted in
//     vllm_router_discovery_dropped_total{reason}: decode, not_map,
//     missing_key, bad_type, bad_value, unknown_type, unknown_transfer_mode,
//     bad_address, hello, oversized, frames, command, connector,
//     too_many_instances, conflict (a static or admin worker owns the URL),
//     handshake, connections, internal, model_pending (--enable-igw: the
//     instance's model is still being asked for, Options.Model).
//   - Registry changes are made under the discovery lock, so registry
//     subscribers run under it too; FleetMode and Status are lock-free and
//     safe to call from them.
//   - One goroutine owns Recv; the expiry timer runs in Run's goroutine.
//     Cancelling ctx (or Close) stops both, drains the socket and closes it;
//     no goroutine outlives Run. Registry entries are left in place.
//
// # The guarded transport
//
// go-zeromq v0.17.0 can be crashed by one TCP client (a huge frame header, a
// READY with an unknown or missing Socket-Type or a truncated property), is
// stalled by one silent client (its accept loop runs each handshake inline),
// leaks sockets of failed handshakes and reader goroutines at Close, and
// never answers ZMTP heartbeat PINGs, so libzmq peers with
// ZMQ_HEARTBEAT_IVL/TIMEOUT reconnect every timeout. The Listener therefore
// binds through a guarded TCP transport (guard.go) that validates the
// handshake, bounds frames and messages (MaxMessageBytes), applies a
// handshake deadline, answers PINGs with PONGs, caps connections and lets
// shutdown drain exactly the reader goroutines that hold a message. vLLM sets
// no heartbeat options, but with the guard heartbeating peers keep one
// stable connection too.
//
// # The cgo backend (-tags czmq)
//
// Built with -tags czmq (CGO_ENABLED=1 and libzmq's headers: Debian
// libzmq3-dev, found through pkg-config; scripts/install-deps.sh installs
// it), the Listener binds its ROUTER with libzmq through
// github.com/pebbe/zmq4 instead, and go-zeromq and the guard are not built
// in. Everything above the socket (formats, invariants, metrics, the
// address forms, Addr with the real port, a bind failure at startup, Run
// and Close) is the same. libzmq itself answers ZMTP heartbeats, survives
// malformed peers and handshakes each connection without holding up the
// others, so what differs is at the transport:
//
//   - MaxMessageBytes is ZMQ_MAXMSGSIZE: libzmq closes the connection of a
//     peer that sends a larger frame. HandshakeTimeout is ZMQ_HANDSHAKE_IVL.
//     MaxConnections is not enforced, and a multipart message is bounded
//     per frame only (libzmq holds it whole until its last frame).
//   - Transport-level drops are not counted (libzmq does not report them):
//     no handshake, oversized, connections or command; frames and the
//     payload drops are counted as in the default build.
//   - A ROUTER takes one connection per peer identity. With
//     ZMQ_ROUTER_HANDOVER the newest connection of an identity wins (an
//     instance back after a host reset is heard at once); two live peers
//     with one identity (P2P-NCCL's is its zmq_address, so two instances
//     would have to share one) are not both heard. TCP keep-alive is on
//     (15 s), as with net.Listen.
//   - One goroutine owns the libzmq context and sockets (created, bound,
//     received from and closed there; libzmq sockets are not
//     goroutine-safe) and forwards messages to the receive goroutine. It
//     waits in zmq_poll on the ROUTER and on an inproc PAIR to which Close
//     writes one wake-up message, so an idle listener makes no calls and
//     Close is immediate; Close returns once that goroutine has closed the
//     sockets and terminated the context (the port is free again).
//
// The package's tests run under both builds:
//
//	CGO_ENABLED=1 go test -race -tags czmq ./internal/discovery/zmq/
//
// # Rolling a MoRI-IO fleet from READ to WRITE
//
//  1. Start the WRITE prefill and decode instances with the same
//     proxy_ping_port. They register and are held: /workers lists them with
//     "held": true, vllm_router_discovery_held_instances counts them, and a
//     warning is logged once per instance. READ traffic is unaffected.
//  2. Stop every READ instance, all at once. Each expires TTL after its
//     last heartbeat; until then it stays routable, so requests may hit a
//     dead instance (connect errors, handled as any worker loss).
//  3. When the last READ instance expires, the fleet switches to WRITE (one
//     info log line, FleetMode "WRITE"); the held instances become routable
//     at once.
//
// The cut-over window is at most one TTL after the last READ instance stops.
// Stopping the READ instances in stages only lengthens it: while any READ
// instance lives, no WRITE instance is routable, so a role whose READ
// instances are all gone has nothing to route to. A whole-fleet restart in
// the other mode needs no procedure: with no live instance the first
// registration sets the mode. Rolling back (WRITE to READ) is the same.
package zmq
