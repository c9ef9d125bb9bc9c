// Package floor is the least work an HTTP/1.1 reverse proxy can do for one
// upstream, as a yardstick for the router's own overhead: it forwards each
// request's bytes unchanged over a pooled keep-alive connection and the
// response's bytes back, with no header parsing beyond the framing, no
// routing, retries, metrics or deadlines.
//
// Two shapes of it run: Serve, a goroutine per client connection over Go's
// runtime poller (the router's shape), and ServeLoop (Linux), one goroutine
// locked to its thread running an epoll loop of its own (nginx's shape).
// Measured side by side with nginx and the router (scripts/bench-wrk-ab.sh,
// docs/BENCHMARKS.md section 20), they say how much of the router's cost
// per request the Go runtime's networking imposes and how much is the
// router's own work.
//
// It is a benchmark reference, not a proxy: it frames messages by
// Content-Length only (a request or response without one, or with chunked
// framing, ends the client's connection), and it never times out.
package floor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"syscall"
)

// maxMessage bounds a buffered message (head and body).
const maxMessage = 1 << 20

// errFraming is a message the floor proxy cannot frame.
var errFraming = errors.New("floor: message without a usable Content-Length")

// messageLen returns the length of the complete message at the start of b
// (its head and a Content-Length body), 0 while more bytes are needed, or
// errFraming. A request may have no Content-Length (no body); a response
// (needLength) must have one.
func messageLen(b []byte, needLength bool) (int, error) {
	end := bytes.Index(b, []byte("\r\n\r\n"))
	if end < 0 {
		if len(b) > maxMessage {
			return 0, errFraming
		}
		return 0, nil
	}
	head := b[:end]
	n := -1
	for len(head) > 0 {
		line := head
		if i := bytes.Index(head, []byte("\r\n")); i >= 0 {
			line, head = head[:i], head[i+2:]
		} else {
			head = nil
		}
		name, value, ok := bytes.Cut(line, []byte(":"))
		if !ok {
			continue
		}
		switch {
		case bytes.EqualFold(name, []byte("Content-Length")):
			v, err := strconv.Atoi(string(bytes.TrimSpace(value)))
			if err != nil || v < 0 || n >= 0 {
				return 0, errFraming
			}
			n = v
		case bytes.EqualFold(name, []byte("Transfer-Encoding")):
			return 0, errFraming
		}
	}
	if n < 0 {
		if needLength {
			return 0, errFraming
		}
		n = 0
	}
	total := end + 4 + n
	if total > maxMessage {
		return 0, errFraming
	}
	if len(b) < total {
		return 0, nil
	}
	return total, nil
}

// inet4 parses an IPv4 host:port.
func inet4(hostport string) (syscall.SockaddrInet4, error) {
	ap, err := netip.ParseAddrPort(hostport)
	if err != nil || !ap.Addr().Is4() {
		return syscall.SockaddrInet4{}, fmt.Errorf("floor: %q is not an IPv4 host:port", hostport)
	}
	return syscall.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}, nil
}

// pool holds the idle upstream connections of Serve.
type pool struct {
	addr string
	mu   sync.Mutex
	idle []net.Conn
}

func (p *pool) get(ctx context.Context) (net.Conn, error) {
	p.mu.Lock()
	if n := len(p.idle); n > 0 {
		c := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return c, nil
	}
	p.mu.Unlock()
	var d net.Dialer
	return d.DialContext(ctx, "tcp", p.addr)
}

func (p *pool) put(c net.Conn) {
	p.mu.Lock()
	p.idle = append(p.idle, c)
	p.mu.Unlock()
}

func (p *pool) close() {
	p.mu.Lock()
	for _, c := range p.idle {
		c.Close()
	}
	p.idle = nil
	p.mu.Unlock()
}

// readMessage reads one whole message from c into buf (grown as needed)
// and returns it; bytes after it stay in buf after the message (rest).
func readMessage(c net.Conn, buf []byte, needLength bool) (msg, rest []byte, err error) {
	for {
		n, err := messageLen(buf, needLength)
		if err != nil {
			return nil, nil, err
		}
		if n > 0 {
			return buf[:n], buf[n:], nil
		}
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		k, rerr := c.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+k]
		if rerr != nil && k == 0 {
			return nil, nil, rerr
		}
	}
}

// Serve proxies every connection ln accepts to upstream (host:port), a
// goroutine per connection, until ctx ends; it then closes ln and every
// connection and returns once their goroutines have.
func Serve(ctx context.Context, ln net.Listener, upstream string) error {
	p := &pool{addr: upstream}
	var wg sync.WaitGroup
	var mu sync.Mutex
	open := map[net.Conn]struct{}{}
	stop := context.AfterFunc(ctx, func() {
		ln.Close()
		mu.Lock()
		for c := range open {
			c.Close()
		}
		mu.Unlock()
	})
	defer stop()
	var err error
	for {
		c, aerr := ln.Accept()
		if aerr != nil {
			if ctx.Err() == nil {
				err = fmt.Errorf("floor: accept: %w", aerr)
			}
			break
		}
		mu.Lock()
		open[c] = struct{}{}
		mu.Unlock()
		wg.Go(func() {
			serveConn(ctx, c, p)
			mu.Lock()
			delete(open, c)
			mu.Unlock()
			c.Close()
		})
	}
	stop()
	mu.Lock()
	for c := range open {
		c.Close()
	}
	mu.Unlock()
	wg.Wait()
	p.close()
	return err
}

// serveConn relays c's requests one at a time until c or its upstream
// fails.
func serveConn(ctx context.Context, c net.Conn, p *pool) {
	in := make([]byte, 0, 4<<10)
	out := make([]byte, 0, 4<<10)
	for {
		req, rest, err := readMessage(c, in, false)
		if err != nil {
			return
		}
		u, err := p.get(ctx)
		if err != nil {
			return
		}
		if _, err := u.Write(req); err != nil {
			u.Close()
			return
		}
		resp, _, err := readMessage(u, out[:0], true)
		if err != nil {
			u.Close()
			return
		}
		p.put(u)
		if _, err := c.Write(resp); err != nil {
			return
		}
		in = append(req[:0], rest...) // keep a pipelined request's bytes
		out = resp[:0]
	}
}
