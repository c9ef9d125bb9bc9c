package zmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/discovery"
	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Connectors (the values of config.KVConnector*).
const (
	ConnectorMoRIIO   = "moriio"
	ConnectorNIXL     = "nixl"
	ConnectorMooncake = "mooncake"
	ConnectorP2PNCCL  = "p2pnccl"
)

// Defaults.
const (
	DefaultTTL              = 9 * time.Second // three missed 3-second heartbeats
	DefaultMaxMessageBytes  = 64 << 10
	DefaultMaxInstances     = 4096
	DefaultMaxConnections   = 4096
	DefaultHandshakeTimeout = 5 * time.Second
)

// Options configure a Listener. Address, Registry and Connector are required.
type Options struct {
	// Address is host:port to bind (tcp://host:port is also accepted); an
	// empty host or "*" binds every interface, port 0 picks a free port.
	Address  string
	Registry *worker.Registry
	Metrics  *metrics.Metrics // nil: no metrics
	Logger   *slog.Logger     // nil: discard
	// TTL removes an instance this long after its last heartbeat.
	TTL time.Duration
	// Connector is the KV connector the fleet runs. moriio requires
	// transfer_mode and the host:..,handshake:..,notify:.. zmq_address and
	// gates routability on one transfer mode; p2pnccl requires an ip:port
	// zmq_address; nixl and mooncake accept any valid registration.
	Connector string
	// MaxMessageBytes bounds one ZMTP message (one frame with -tags czmq);
	// larger ones close the sender's connection.
	MaxMessageBytes int
	// MaxInstances bounds distinct registered instances; further new
	// instances are dropped (too_many_instances).
	MaxInstances int
	// MaxConnections bounds concurrent TCP connections to the socket (not
	// enforced with -tags czmq).
	MaxConnections int
	// HandshakeTimeout bounds a new connection's ZMTP handshake.
	HandshakeTimeout time.Duration
	// Now is the clock (tests); nil means time.Now.
	Now func() time.Time
	// Model, when set (--enable-igw), names the model the instance at an
	// http_address serves; its Workers carry it as ModelID. It must not
	// block: while it answers ok=false (the model is being asked for), the
	// registration is dropped (model_pending) and the instance's next
	// heartbeat tries again.
	Model func(httpAddress string) (model string, ok bool)

	// rawTCP bypasses the guarded transport (tests measure bare go-zeromq;
	// ignored with -tags czmq).
	rawTCP bool
}

// Listener is the ZMQ self-registration source: a receive-only ROUTER socket
// that turns vLLM heartbeats into registry entries.
type Listener struct {
	opts Options
	log  *slog.Logger
	now  func() time.Time
	sock routerSocket
	f    *fleet
	addr string

	kick     chan struct{}
	closed   chan struct{}
	stopOnce sync.Once
	startMu  sync.Mutex // orders starting the receive goroutine against closed
	running  atomic.Bool
	recvWG   sync.WaitGroup

	dropMu   sync.Mutex
	dropSeen map[string]bool
}

var _ discovery.Source = (*Listener)(nil)

// New validates opts and binds the socket, so a bad or busy address fails
// the caller at startup. Run starts receiving; Close releases the socket.
func New(opts Options) (*Listener, error) {
	if opts.Registry == nil {
		return nil, errors.New("zmq discovery: a registry is required")
	}
	switch opts.Connector {
	case ConnectorMoRIIO, ConnectorNIXL, ConnectorMooncake, ConnectorP2PNCCL:
	default:
		return nil, fmt.Errorf("zmq discovery: unknown connector %q (want moriio, nixl, mooncake or p2pnccl)", opts.Connector)
	}
	if opts.TTL == 0 {
		opts.TTL = DefaultTTL
	}
	if opts.MaxMessageBytes == 0 {
		opts.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if opts.MaxInstances == 0 {
		opts.MaxInstances = DefaultMaxInstances
	}
	if opts.MaxConnections == 0 {
		opts.MaxConnections = DefaultMaxConnections
	}
	if opts.HandshakeTimeout == 0 {
		opts.HandshakeTimeout = DefaultHandshakeTimeout
	}
	var errs []error
	if opts.TTL < 0 {
		errs = append(errs, fmt.Errorf("TTL %v must be positive", opts.TTL))
	}
	if opts.MaxMessageBytes < 512 {
		errs = append(errs, fmt.Errorf("MaxMessageBytes %d is below 512", opts.MaxMessageBytes))
	}
	if opts.MaxInstances < 0 || opts.MaxConnections < 0 || opts.HandshakeTimeout < 0 {
		errs = append(errs, errors.New("MaxInstances, MaxConnections and HandshakeTimeout must not be negative"))
	}
	hostPort := strings.TrimPrefix(opts.Address, "tcp://")
	if _, _, err := net.SplitHostPort(hostPort); err != nil {
		errs = append(errs, fmt.Errorf("address %q: want host:port: %w", opts.Address, err))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("zmq discovery: %w", err)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}

	l := &Listener{
		opts: opts, log: log, now: opts.Now,
		kick: make(chan struct{}, 1), closed: make(chan struct{}),
		dropSeen: map[string]bool{},
	}
	l.f = newFleet(opts.Registry, opts.Metrics, log, opts.TTL, opts.Connector == ConnectorMoRIIO, opts.MaxInstances)

	sock, addr, err := listenRouter(opts, hostPort, log, l.drop)
	if err != nil {
		return nil, fmt.Errorf("zmq discovery: %w", err)
	}
	l.sock, l.addr = sock, addr
	log.Info("zmq discovery: listening", "address", l.addr, "connector", opts.Connector,
		"ttl", opts.TTL.String(), "max_message_bytes", opts.MaxMessageBytes, "backend", routerBackend)
	return l, nil
}

// Addr is the bound address (host:port), with the real port when the
// configured one was 0.
func (l *Listener) Addr() string { return l.addr }

// FleetMode is the MoRI-IO transfer mode of the routable fleet: "READ",
// "WRITE", or "" while no MoRI-IO instance is live (always "" for other
// connectors).
func (l *Listener) FleetMode() string { return l.f.FleetMode() }

// Run receives registrations and expires silent instances until ctx is
// cancelled or Close is called, then closes the socket and returns nil.
// Registry entries are left in place. Run may be called once.
func (l *Listener) Run(ctx context.Context) error {
	if !l.running.CompareAndSwap(false, true) {
		return errors.New("zmq discovery: Run called twice")
	}
	l.startMu.Lock()
	select {
	case <-l.closed:
		l.startMu.Unlock()
		return errors.New("zmq discovery: listener is closed")
	default:
	}
	l.recvWG.Go(l.recvLoop)
	l.startMu.Unlock()
	defer l.shutdown()

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var failover <-chan time.Time // MoRI-IO only: a fleet that cannot serve fails over
	if l.f.gated {
		t := time.NewTicker(FailoverCheckInterval)
		defer t.Stop()
		failover = t.C
	}
	for {
		if next, ok := l.f.nextExpiry(); ok {
			// A timer to the next expiry, not a poll; at least 1 ms so an odd
			// injected clock cannot spin the loop.
			timer.Reset(max(next.Sub(l.now()), time.Millisecond))
		} else {
			timer.Stop()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-l.closed:
			return nil
		case <-l.kick:
		case <-timer.C:
			l.f.expire(l.now())
		case <-failover:
			l.f.failover()
		}
	}
}

// Close stops Run (if running) and releases the socket. It is idempotent.
func (l *Listener) Close() error {
	l.shutdown()
	return nil
}

// shutdown closes the socket, which makes Recv fail (the receive goroutine
// then sees closed and returns), and waits for the receive goroutine. The
// socket's Close does what its backend needs first: go-zeromq's drains its
// internal queue (router_zeromq.go), libzmq's stops the goroutine that owns
// the socket (router_czmq.go).
func (l *Listener) shutdown() {
	l.stopOnce.Do(func() {
		l.startMu.Lock() // no receive goroutine starts after this
		close(l.closed)
		l.startMu.Unlock()
		_ = l.sock.Close()
		l.recvWG.Wait()
		l.log.Info("zmq discovery: stopped", "address", l.addr)
	})
}

// recvLoop is the one goroutine that calls Recv.
func (l *Listener) recvLoop() {
	for {
		frames, command, err := l.sock.Recv()
		if err != nil {
			select {
			case <-l.closed:
				return
			default:
			}
			// Recv only fails once the socket is closing; if it ever does
			// otherwise, do not spin.
			l.log.Debug("zmq discovery: receive error", "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		l.handle(frames, command)
	}
}

// handle processes one message (the identity frame, then the payload
// frames; command for a ZMTP command) and never panics.
func (l *Listener) handle(frames [][]byte, command bool) {
	defer func() {
		if p := recover(); p != nil {
			l.log.Error("zmq discovery: bug: message handler panicked; message dropped",
				"panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			l.count(ReasonInternal)
		}
	}()
	if command {
		l.drop(ReasonCommand, "ZMTP command frame (a peer with ZMQ heartbeats?)")
		return
	}
	if len(frames) != 2 {
		l.drop(ReasonFrames, fmt.Sprintf("%d frames, want [identity, payload]", len(frames)))
		return
	}
	identity, payload := clip(string(frames[0])), frames[1]
	if len(payload) > l.opts.MaxMessageBytes {
		l.drop(ReasonOversized, fmt.Sprintf("%d-byte payload from %q", len(payload), identity))
		return
	}
	r, err := ParseRegistration(payload)
	if err != nil {
		l.drop(ReasonOf(err), fmt.Sprintf("%v (identity %q)", err, identity))
		return
	}
	if reason, detail := l.checkConnector(r); reason != "" {
		l.drop(reason, fmt.Sprintf("%s (http_address %q)", detail, r.HTTPAddress))
		return
	}
	if l.opts.Model != nil {
		m, ok := l.opts.Model(r.HTTPAddress)
		if !ok {
			l.drop(ReasonModelPending, fmt.Sprintf("http_address %q: waiting for the instance to name its model", r.HTTPAddress))
			return
		}
		r.ModelID = m
	}
	switch out, reason := l.f.observe(r, identity, l.now()); out {
	case outAdded, outReplaced:
		select {
		case l.kick <- struct{}{}:
		default:
		}
	case outDropped:
		l.drop(reason, fmt.Sprintf("http_address %q", r.HTTPAddress))
	}
}

// checkConnector applies what the configured connector needs from a
// registration beyond ParseRegistration's checks.
func (l *Listener) checkConnector(r Registration) (reason, detail string) {
	switch l.opts.Connector {
	case ConnectorMoRIIO:
		if r.TransferMode == "" {
			return ReasonMissingKey, "transfer_mode is required by the moriio connector"
		}
		if r.ZMQ.Handshake == 0 {
			return ReasonConnector, fmt.Sprintf("zmq_address %q is not host:..,handshake:..,notify:.. as MoRI-IO needs", r.ZMQAddress)
		}
	case ConnectorP2PNCCL:
		if r.ZMQ.Port == 0 {
			return ReasonConnector, fmt.Sprintf("zmq_address %q is not ip:port as P2P-NCCL needs", r.ZMQAddress)
		}
	}
	return "", ""
}

// drop counts a dropped message; the first drop of each reason is logged at
// warn, later ones at debug (a misbehaving peer must not flood the log).
func (l *Listener) drop(reason, detail string) {
	l.count(reason)
	l.dropMu.Lock()
	first := !l.dropSeen[reason]
	l.dropSeen[reason] = true
	l.dropMu.Unlock()
	if first && reason != ReasonHello {
		l.log.Warn("zmq discovery: message dropped (further drops of this reason log at debug)", "reason", reason, "detail", detail)
	} else if l.log.Enabled(context.Background(), slog.LevelDebug) {
		l.log.Debug("zmq discovery: message dropped", "reason", reason, "detail", detail)
	}
}

func (l *Listener) count(reason string) {
	if l.opts.Metrics != nil {
		l.opts.Metrics.DiscoveryDropped.WithLabelValues(reason).Inc()
	}
}

// Status is a snapshot for /workers and /get_server_info.
type Status struct {
	Address    string           `json:"address"`
	Connector  string           `json:"connector"`
	FleetMode  string           `json:"fleet_transfer_mode"`
	TTLSeconds float64          `json:"ttl_secs"`
	Instances  []InstanceStatus `json:"instances"`
}

// InstanceStatus describes one registered instance (all its DP ranks).
type InstanceStatus struct {
	HTTPAddress  string    `json:"http_address"`
	URL          string    `json:"url"`
	Role         string    `json:"role"`
	ZMQAddress   string    `json:"zmq_address"`
	DPSize       int       `json:"dp_size"`
	TPSize       int       `json:"tp_size"`
	TransferMode string    `json:"transfer_mode,omitempty"`
	Format       string    `json:"format"`
	Held         bool      `json:"held"`
	Note         string    `json:"note,omitempty"`
	FirstSeen    time.Time `json:"first_seen"`
	LastSeen     time.Time `json:"last_seen"`
}

// Status returns the current instances (sorted by role, then address)
// without taking the discovery lock, so it is safe from registry callbacks.
func (l *Listener) Status() Status {
	return Status{
		Address:    l.addr,
		Connector:  l.opts.Connector,
		FleetMode:  l.FleetMode(),
		TTLSeconds: l.opts.TTL.Seconds(),
		Instances:  l.f.Status(),
	}
}
