package sidechan

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"strconv"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// quietLogger swallows go-zeromq's own log lines.
var quietLogger = log.New(io.Discard, "", 0)

// Endpoint returns "tcp://host:port", bracketing IPv6 hosts.
func Endpoint(host string, port int) string {
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(port))
}

// Handler handles one inbound message. reply sends [identity, "", payload]
// back to the sender and may be kept and called later from any goroutine.
// Handlers run on the server's receive goroutine and must not block.
type Handler func(identity []byte, payload []byte, reply func([]byte) error)

// Server is a bound ROUTER socket with one receive goroutine.
type Server struct {
	sock   zmq4.Socket
	port   int
	cancel context.CancelFunc
	done   chan struct{}
}

// Listen binds a ROUTER on host:port (0 = a free port) and serves h.
func Listen(ctx context.Context, host string, port int, h Handler) (*Server, error) {
	sctx, cancel := context.WithCancel(ctx)
	sock := zmq4.NewRouter(sctx, zmq4.WithLogger(quietLogger))
	if err := sock.Listen(Endpoint(host, port)); err != nil {
		cancel()
		_ = sock.Close()
		return nil, err
	}
	addr, ok := sock.Addr().(*net.TCPAddr)
	if !ok {
		cancel()
		_ = sock.Close()
		return nil, fmt.Errorf("zmq listener has no TCP address")
	}
	s := &Server{sock: sock, port: addr.Port, cancel: cancel, done: make(chan struct{})}
	go s.serve(sctx, h)
	return s, nil
}

// Port returns the bound port.
func (s *Server) Port() int { return s.port }

// Close stops the server and waits for its goroutine.
func (s *Server) Close() error {
	s.cancel()
	err := s.sock.Close()
	<-s.done
	return err
}

func (s *Server) serve(ctx context.Context, h Handler) {
	defer close(s.done)
	for {
		msg, err := s.sock.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		if msg.Type == zmq4.CmdMsg || len(msg.Frames) < 2 {
			continue // ZMTP commands (PING) and malformed messages
		}
		id := append([]byte(nil), msg.Frames[0]...)
		frames := msg.Frames[1:]
		for len(frames) > 1 && len(frames[0]) == 0 {
			frames = frames[1:] // REQ-style empty delimiter
		}
		payload := frames[0]
		reply := func(b []byte) error {
			return s.sock.Send(zmq4.NewMsgFrom(id, []byte{}, b))
		}
		h(id, payload, reply)
	}
}

// Pool sends one-way messages to peers through cached DEALER sockets, one
// goroutine and bounded queue per (endpoint, identity). A message that
// cannot be delivered (dial failure, send error after one redial, full
// queue) is dropped and reported to OnDrop.
type Pool struct {
	ctx         context.Context
	log         *slog.Logger
	dialTimeout time.Duration
	OnDrop      func(endpoint string, err error)

	mu     sync.Mutex
	peers  map[string]*peer
	closed bool
	wg     sync.WaitGroup
}

type peer struct {
	endpoint string
	identity string
	ch       chan []byte
}

// NewPool returns a sender pool whose goroutines stop when ctx is done or
// Close is called.
func NewPool(ctx context.Context, log *slog.Logger, dialTimeout time.Duration) *Pool {
	return &Pool{ctx: ctx, log: log, dialTimeout: dialTimeout, peers: make(map[string]*peer)}
}

// Send queues payload for endpoint ("tcp://host:port"). identity sets the
// DEALER's ZMQ identity ("" = random). It never blocks.
func (p *Pool) Send(endpoint, identity string, payload []byte) bool {
	key := endpoint + "\x00" + identity
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return false
	}
	pe, ok := p.peers[key]
	if !ok {
		pe = &peer{endpoint: endpoint, identity: identity, ch: make(chan []byte, 4096)}
		p.peers[key] = pe
		p.wg.Add(1)
		go p.run(pe)
	}
	p.mu.Unlock()
	select {
	case pe.ch <- payload:
		return true
	default:
		p.drop(endpoint, errors.New("send queue full"))
		return false
	}
}

func (p *Pool) drop(endpoint string, err error) {
	p.log.Warn("side channel message dropped", "endpoint", endpoint, "err", err)
	if p.OnDrop != nil {
		p.OnDrop(endpoint, err)
	}
}

// Close stops every sender goroutine and closes the sockets.
func (p *Pool) Close() {
	p.mu.Lock()
	if !p.closed {
		p.closed = true
		for _, pe := range p.peers {
			close(pe.ch)
		}
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Pool) dial(pe *peer) (zmq4.Socket, error) {
	opts := []zmq4.Option{
		zmq4.WithLogger(quietLogger),
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(p.dialTimeout),
		zmq4.WithTimeout(p.dialTimeout),
	}
	if pe.identity != "" {
		opts = append(opts, zmq4.WithID(zmq4.SocketIdentity(pe.identity)))
	}
	s := zmq4.NewDealer(p.ctx, opts...)
	if err := s.Dial(pe.endpoint); err != nil {
		_ = s.Close()
		return nil, err
	}
	return s, nil
}

func (p *Pool) run(pe *peer) {
	defer p.wg.Done()
	var sock zmq4.Socket
	defer func() {
		if sock != nil {
			_ = sock.Close()
		}
	}()
	for payload := range pe.ch {
		if p.ctx.Err() != nil {
			continue // drain after shutdown
		}
		var err error
		for attempt := 0; attempt < 2; attempt++ {
			if sock == nil {
				sock, err = p.dial(pe)
				if err != nil {
					break
				}
			}
			if err = sock.Send(zmq4.NewMsg(payload)); err == nil {
				break
			}
			_ = sock.Close()
			sock = nil
		}
		if err != nil {
			p.drop(pe.endpoint, err)
		}
	}
}

// Client is a DEALER to one peer for request/reply with rpc_id
// correlation. A broken client fails its pending calls and reports Broken.
type Client struct {
	sock     zmq4.Socket
	cancel   context.CancelFunc
	done     chan struct{}
	sendMu   sync.Mutex
	mu       sync.Mutex
	pending  map[string]chan Any
	broken   error
	endpoint string
}

// DialClient connects a DEALER to endpoint.
func DialClient(ctx context.Context, endpoint string, dialTimeout time.Duration) (*Client, error) {
	cctx, cancel := context.WithCancel(ctx)
	sock := zmq4.NewDealer(cctx,
		zmq4.WithLogger(quietLogger),
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(dialTimeout),
		zmq4.WithTimeout(dialTimeout))
	if err := sock.Dial(endpoint); err != nil {
		cancel()
		_ = sock.Close()
		return nil, err
	}
	c := &Client{sock: sock, cancel: cancel, done: make(chan struct{}), pending: make(map[string]chan Any), endpoint: endpoint}
	go c.readLoop(cctx)
	return c, nil
}

func (c *Client) readLoop(ctx context.Context) {
	defer close(c.done)
	for {
		msg, err := c.sock.Recv()
		if err != nil {
			if ctx.Err() == nil {
				err = fmt.Errorf("connection to %s lost: %w", c.endpoint, err)
			} else {
				err = errors.New("client closed")
			}
			c.fail(err)
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		frames := msg.Frames
		for len(frames) > 1 && len(frames[0]) == 0 {
			frames = frames[1:]
		}
		if len(frames) == 0 {
			continue
		}
		m, err := Decode(frames[0])
		if err != nil || m.RPCID == "" {
			continue
		}
		c.mu.Lock()
		ch := c.pending[m.RPCID]
		delete(c.pending, m.RPCID)
		c.mu.Unlock()
		if ch != nil {
			ch <- m
		}
	}
}

func (c *Client) fail(err error) {
	c.mu.Lock()
	c.broken = err
	for id, ch := range c.pending {
		close(ch)
		delete(c.pending, id)
	}
	c.mu.Unlock()
}

// Broken reports the error that broke the client, if any.
func (c *Client) Broken() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.broken
}

// Send sends a one-way message.
func (c *Client) Send(payload []byte) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	return c.sock.Send(zmq4.NewMsg(payload))
}

// Call sends payload (which must carry rpcID) and waits for the reply with
// the same rpc_id, or ctx.
func (c *Client) Call(ctx context.Context, rpcID string, payload []byte) (Any, error) {
	ch := make(chan Any, 1)
	c.mu.Lock()
	if c.broken != nil {
		err := c.broken
		c.mu.Unlock()
		return Any{}, err
	}
	c.pending[rpcID] = ch
	c.mu.Unlock()
	if err := c.Send(payload); err != nil {
		c.mu.Lock()
		delete(c.pending, rpcID)
		c.mu.Unlock()
		return Any{}, err
	}
	select {
	case m, ok := <-ch:
		if !ok {
			return Any{}, c.Broken()
		}
		return m, nil
	case <-ctx.Done():
		c.mu.Lock()
		delete(c.pending, rpcID)
		c.mu.Unlock()
		return Any{}, ctx.Err()
	}
}

// Close closes the socket and waits for the reader.
func (c *Client) Close() {
	c.cancel()
	_ = c.sock.Close()
	<-c.done
}

// Clients caches one Client per endpoint and redials broken ones.
type Clients struct {
	ctx         context.Context
	dialTimeout time.Duration
	mu          sync.Mutex
	m           map[string]*Client
	closed      bool
}

// NewClients returns an empty cache.
func NewClients(ctx context.Context, dialTimeout time.Duration) *Clients {
	return &Clients{ctx: ctx, dialTimeout: dialTimeout, m: make(map[string]*Client)}
}

// Get returns a live client for endpoint, dialling if needed.
func (cs *Clients) Get(endpoint string) (*Client, error) {
	cs.mu.Lock()
	defer cs.mu.Unlock()
	if cs.closed {
		return nil, errors.New("clients closed")
	}
	if c, ok := cs.m[endpoint]; ok {
		if c.Broken() == nil {
			return c, nil
		}
		c.Close()
		delete(cs.m, endpoint)
	}
	c, err := DialClient(cs.ctx, endpoint, cs.dialTimeout)
	if err != nil {
		return nil, err
	}
	cs.m[endpoint] = c
	return c, nil
}

// Close closes every client.
func (cs *Clients) Close() {
	cs.mu.Lock()
	cs.closed = true
	m := cs.m
	cs.m = map[string]*Client{}
	cs.mu.Unlock()
	for _, c := range m {
		c.Close()
	}
}

// Handshake performs vLLM's MoRI-IO engine-metadata handshake against a
// peer's handshake ROUTER: a fresh DEALER sends "get_meta_msg" and receives
// two messages, each [b"", payload]. It returns the decoded metadata.
func Handshake(ctx context.Context, endpoint string, timeout time.Duration) (AgentMetadata, error) {
	var meta AgentMetadata
	hctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	sock := zmq4.NewDealer(hctx,
		zmq4.WithLogger(quietLogger),
		zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(timeout),
		zmq4.WithTimeout(timeout))
	defer func() { _ = sock.Close() }()
	if err := sock.Dial(endpoint); err != nil {
		return meta, err
	}
	if err := sock.Send(zmq4.NewMsgString(GetMetaMsg)); err != nil {
		return meta, err
	}
	for i := 0; i < 2; i++ {
		msg, err := sock.Recv()
		if err != nil {
			return meta, fmt.Errorf("handshake with %s: reply %d: %w", endpoint, i+1, err)
		}
		frames := msg.Frames
		if len(frames) != 2 || len(frames[0]) != 0 {
			return meta, fmt.Errorf("handshake with %s: reply %d has %d frames, want [\"\", payload]", endpoint, i+1, len(frames))
		}
		if i == 0 {
			if err := decodeMeta(frames[1], &meta); err != nil {
				return meta, err
			}
		}
	}
	return meta, nil
}

// ServeHandshake answers a get_meta_msg request with the two messages.
func ServeHandshake(meta AgentMetadata, layers map[string][][]byte, reply func([]byte) error) error {
	if err := reply(Encode(meta)); err != nil {
		return err
	}
	return reply(Encode(layers))
}
