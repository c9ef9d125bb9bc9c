package h1server

import (
	"context"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/fdpoll"
)

// Server serves HTTP/1.1 on a listener with an http.Handler: one goroutine
// per connection, no background reader, pooled buffers. Requests the fast
// path does not handle are served by net/http.
type Server struct {
	Handler           http.Handler
	ReadHeaderTimeout time.Duration // 0: none
	IdleTimeout       time.Duration // 0: ReadHeaderTimeout
	MaxHeaderBytes    int           // 0: http.DefaultMaxHeaderBytes (1 MiB)
	BaseContext       func(net.Listener) context.Context
	ErrorLog          *log.Logger

	initOnce   sync.Once
	fb         *http.Server // the fallback
	fbLn       *chanListener
	fbDone     chan struct{}  // closed when fb.Serve has returned
	poll       *fdpoll.Poller // the disconnect watches' epoll set (nil: timers)
	inShutdown atomic.Bool

	mu        sync.Mutex
	listeners map[net.Listener]struct{}
	conns     map[*conn]struct{}
}

// init creates the fallback server and starts its Serve goroutine, which
// Shutdown and Close end. replayConn carries BaseContext's result to the
// fallback's requests through ConnContext.
func (s *Server) init() {
	s.initOnce.Do(func() {
		s.listeners = make(map[net.Listener]struct{})
		s.conns = make(map[*conn]struct{})
		s.fbLn = newChanListener()
		s.poll = fdpoll.NewFor(fdpoll.Hangup)
		s.fbDone = make(chan struct{})
		s.fb = &http.Server{
			Handler:           http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { s.handler().ServeHTTP(w, r) }),
			ReadHeaderTimeout: s.ReadHeaderTimeout,
			IdleTimeout:       s.idleTimeout(), // the same effective timeout on both paths
			MaxHeaderBytes:    s.MaxHeaderBytes,
			ErrorLog:          s.ErrorLog,
			ConnContext: func(ctx context.Context, c net.Conn) context.Context {
				if rc, ok := c.(*replayConn); ok {
					return context.WithValue(rc.base, http.ServerContextKey, s.fb)
				}
				return ctx
			},
		}
		go func() {
			defer close(s.fbDone)
			_ = s.fb.Serve(s.fbLn) // ends when fb is shut down or closed
		}()
	})
}

func (s *Server) handler() http.Handler {
	if s.Handler == nil {
		return http.DefaultServeMux
	}
	return s.Handler
}

func (s *Server) maxHeaderBytes() int {
	if s.MaxHeaderBytes > 0 {
		return s.MaxHeaderBytes
	}
	return http.DefaultMaxHeaderBytes
}

// idleTimeout is IdleTimeout, or ReadHeaderTimeout when it is 0 (this
// package's documented rule; net/http falls back to ReadTimeout, which this
// Server does not have).
func (s *Server) idleTimeout() time.Duration {
	if s.IdleTimeout != 0 {
		return s.IdleTimeout
	}
	return s.ReadHeaderTimeout
}

func (s *Server) logf(format string, args ...any) {
	if s.ErrorLog != nil {
		s.ErrorLog.Printf(format, args...)
		return
	}
	log.Printf(format, args...)
}

// Serve accepts connections on l and serves each on its own goroutine. It
// blocks and returns http.ErrServerClosed after Shutdown or Close; any other
// error is the listener's (l is closed either way).
func (s *Server) Serve(l net.Listener) error {
	s.init()
	if !s.trackListener(l, true) {
		return http.ErrServerClosed
	}
	defer l.Close()
	defer s.trackListener(l, false) // first: Close then does not close l twice
	base := context.Background()
	if s.BaseContext != nil {
		if base = s.BaseContext(l); base == nil {
			panic("h1server: BaseContext returned a nil context")
		}
	}
	ctx := context.WithValue(base, http.ServerContextKey, s.fb)
	var delay time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if s.inShutdown.Load() {
				return http.ErrServerClosed
			}
			if ne, ok := err.(net.Error); ok && ne.Temporary() { //nolint:staticcheck // as net/http
				delay = nextAcceptDelay(delay)
				s.logf("http: Accept error: %v; retrying in %v", err, delay)
				time.Sleep(delay)
				continue
			}
			return err
		}
		delay = 0
		c := newConn(s, nc, ctx, base)
		if !s.trackConn(c, true) {
			nc.Close()
			continue
		}
		go c.serve()
	}
}

func nextAcceptDelay(d time.Duration) time.Duration {
	if d == 0 {
		return 5 * time.Millisecond
	}
	return min(2*d, time.Second)
}

func (s *Server) trackListener(l net.Listener, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !add {
		delete(s.listeners, l)
		return true
	}
	if s.inShutdown.Load() {
		return false
	}
	s.listeners[l] = struct{}{}
	return true
}

func (s *Server) trackConn(c *conn, add bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !add {
		delete(s.conns, c)
		return true
	}
	if s.inShutdown.Load() {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

// closeListeners closes every listener Serve is accepting on.
func (s *Server) closeListeners() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var err error
	for l := range s.listeners {
		if cerr := l.Close(); cerr != nil && err == nil {
			err = cerr
		}
	}
	return err
}

// Shutdown stops accepting, closes idle connections and waits (polling) for
// the active ones to go idle and close, as net/http.Server.Shutdown does. It
// returns ctx's error if ctx ends first. The fallback server is shut down too.
func (s *Server) Shutdown(ctx context.Context) error {
	s.init()
	s.inShutdown.Store(true)
	lerr := s.closeListeners()
	fbErr := make(chan error, 1)
	go func() { fbErr <- s.fb.Shutdown(ctx) }() // returns when fb is idle or ctx ends
	err := s.waitIdle(ctx)
	if ferr := <-fbErr; err == nil {
		err = ferr
	}
	if err == nil {
		<-s.fbDone
		s.poll.Stop()
		err = lerr
	}
	return err
}

// waitIdle closes idle connections until none is left, or ctx ends.
func (s *Server) waitIdle(ctx context.Context) error {
	poll := time.Millisecond
	t := time.NewTimer(poll)
	defer t.Stop()
	for {
		if s.closeIdleConns() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			poll = min(2*poll, 500*time.Millisecond)
			t.Reset(poll)
		}
	}
}

// closeIdleConns closes the idle connections (and new ones that have sent
// nothing for 5 s) and reports whether no connection is left.
func (s *Server) closeIdleConns() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	quiet := true
	for c := range s.conns {
		if !c.closeIfIdle() {
			quiet = false
		}
	}
	return quiet
}

// Close closes the listeners, every connection and the fallback server now.
func (s *Server) Close() error {
	s.init()
	s.inShutdown.Store(true)
	err := s.closeListeners()
	s.mu.Lock()
	for c := range s.conns {
		c.nc.Close()
	}
	s.mu.Unlock()
	if ferr := s.fb.Close(); err == nil {
		err = ferr
	}
	<-s.fbDone
	s.poll.Stop()
	return err
}

// handOff gives c's connection, with the bytes already read, to the fallback
// server, which owns it from then on.
func (s *Server) handOff(rc *replayConn) {
	select {
	case s.fbLn.ch <- rc:
	case <-s.fbLn.done:
		rc.Close()
	}
}

// chanListener is the fallback's listener: Accept returns handed-off conns.
type chanListener struct {
	ch        chan net.Conn
	done      chan struct{}
	closeOnce sync.Once
}

func newChanListener() *chanListener {
	return &chanListener{ch: make(chan net.Conn), done: make(chan struct{})}
}

// Accept returns the next handed-off connection.
func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close makes Accept fail; it may be called more than once.
func (l *chanListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return nil
}

// Addr returns a placeholder address.
func (l *chanListener) Addr() net.Addr { return fallbackAddr{} }

type fallbackAddr struct{}

func (fallbackAddr) Network() string { return "h1server-fallback" }
func (fallbackAddr) String() string  { return "h1server-fallback" }

// replayConn is a connection whose Read first returns bytes already read.
type replayConn struct {
	net.Conn
	pending []byte
	base    context.Context
}

// Read drains the replayed bytes, then reads the connection.
func (c *replayConn) Read(p []byte) (int, error) {
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// ReadFrom lets net/http copy a body straight to the connection (sendfile,
// splice), as it does on a *net.TCPConn.
func (c *replayConn) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(struct{ io.Writer }{c.Conn}, r)
}

// CloseWrite half-closes the connection (net/http does before closing a
// connection whose request body it left unread).
func (c *replayConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}
