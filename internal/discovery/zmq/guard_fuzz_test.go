//go:build !czmq

package zmq

import (
	"bytes"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

// memConn is a peer whose bytes are fixed; writes are discarded.
type memConn struct {
	r *bytes.Reader
}

func (c *memConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *memConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *memConn) Close() error                     { return nil }
func (c *memConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *memConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *memConn) SetDeadline(time.Time) error      { return nil }
func (c *memConn) SetReadDeadline(time.Time) error  { return nil }
func (c *memConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzGuardedZMTP feeds arbitrary peer bytes through the guard into
// go-zeromq's own handshake and frame reader: nothing may panic or allocate
// past the limit (bare go-zeromq fails this within seconds).
func FuzzGuardedZMTP(f *testing.F) {
	reg := zmtp.AppendFrame(nil, 0, must(f, newFormat("P", "READ")))
	ping := zmtp.AppendFrame(nil, zmtp.FlagCommand, append(append([]byte{4}, "PING"...), 0, 1, 'c'))
	f.Add(append(append(append(zmtpGreeting(), dealerReady...), reg...), ping...))
	f.Add(append(append(zmtpGreeting(), zmtpReady(zmtp.AppendProperty(nil, "Socket-Type", "FOO"))...), reg...))
	f.Add(append(zmtpGreeting(), zmtp.AppendFrame(nil, zmtp.FlagCommand, append(append([]byte{5}, "READY"...), 1))...))
	f.Add(append(append(zmtpGreeting(), dealerReady...), zmtp.FlagLong, 0, 0, 0x01, 0, 0, 0, 0, 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		g := newGuard(4096, 16, time.Second, func(string, string) {})
		gc := g.track(&memConn{r: bytes.NewReader(b)})
		zc, err := zmq4.Open(gc, null.Security(), zmq4.Router, zmq4.SocketIdentity("router"), true, nil)
		if err != nil {
			return
		}
		for range 64 {
			msg, err := zc.RecvMsg()
			if err != nil {
				return
			}
			n := 0
			for _, fr := range msg.Frames {
				n += len(fr)
			}
			if n > 4096 || len(msg.Frames) > maxFramesPerMsg {
				t.Fatalf("message of %d bytes in %d frames passed the guard", n, len(msg.Frames))
			}
		}
	})
}
