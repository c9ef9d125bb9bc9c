package kvevents

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/zmtp"
)

// A subscription reads its publisher's ZMTP stream itself, on its own
// goroutine. Through go-zeromq's SUB socket every message crossed from the
// connection's reader goroutine to the subscription's over a channel: a
// thread wake-up per event batch, which was most of an idle subscriber's
// CPU (docs/BENCHMARKS.md section 21). A subscription needs little of
// ZMTP 3.0: the greeting and READY handshake of the NULL mechanism, one
// subscription message, and then frames read in order. Frame sizes are
// checked before anything is allocated for them.

// zmtpSub is one ZMTP 3.0 SUB connection.
type zmtpSub struct {
	conn   net.Conn
	r      *bufio.Reader
	max    uint64   // bytes of one frame at most
	frames [][]byte // the message being read; its buffers are reused
}

// zmtpReadBuf is the read-ahead of a subscription's connection: the
// frames of a batch of a few hundred blocks' events come in one read.
const zmtpReadBuf = 32 << 10

// maxMessageFrames bounds the frames of one message (a batch has 3).
const maxMessageFrames = 16

var errZMTP = errors.New("kvevents: ZMTP")

// dialSub connects to a PUB endpoint (tcp:// or ipc://), makes the
// handshake and subscribes to topic. timeout bounds the connect and the
// handshake.
func dialSub(ctx context.Context, endpoint, topic string, maxFrame int, timeout time.Duration) (*zmtpSub, error) {
	network, addr := "tcp", ""
	if a, ok := strings.CutPrefix(endpoint, "tcp://"); ok {
		addr = a
	} else if a, ok := strings.CutPrefix(endpoint, "ipc://"); ok {
		network, addr = "unix", a
	} else {
		return nil, fmt.Errorf("%w: endpoint %q: only tcp:// and ipc:// are supported", errZMTP, endpoint)
	}
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	z := &zmtpSub{conn: conn, r: bufio.NewReaderSize(conn, zmtpReadBuf), max: uint64(maxFrame)}
	if err := z.handshake(ctx, topic, timeout); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return z, nil
}

// greeting is a ZMTP 3.0 greeting: signature, version 3.0, the NULL
// mechanism, as a client.
func greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:32], "NULL")
	return g
}

// command is a command frame of name and body.
func command(name string, body []byte) []byte {
	return zmtp.AppendFrame(nil, zmtp.FlagCommand, append(append([]byte{byte(len(name))}, name...), body...))
}

func (z *zmtpSub) handshake(ctx context.Context, topic string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = z.conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = z.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := z.conn.Write(greeting()); err != nil {
		return err
	}
	var peer [64]byte
	if _, err := io.ReadFull(z.r, peer[:]); err != nil {
		return fmt.Errorf("%w greeting: %w", errZMTP, err)
	}
	if peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 {
		return fmt.Errorf("%w greeting: not a ZMTP 3 peer (signature %#x…%#x, version %d)", errZMTP, peer[0], peer[9], peer[10])
	}
	if mech := strings.TrimRight(string(peer[12:32]), "\x00"); mech != "NULL" {
		return fmt.Errorf("%w greeting: security mechanism %q (only NULL is supported)", errZMTP, mech)
	}
	ready := command("READY", zmtp.AppendProperty(nil, "Socket-Type", "SUB"))
	if _, err := z.conn.Write(ready); err != nil {
		return err
	}
	flags, body, err := z.readFrame()
	if err != nil {
		return fmt.Errorf("%w handshake: %w", errZMTP, err)
	}
	if flags&zmtp.FlagCommand == 0 || len(body) < 6 || string(body[:6]) != "\x05READY" {
		if flags&zmtp.FlagCommand != 0 && len(body) >= 6 && string(body[:6]) == "\x05ERROR" {
			return fmt.Errorf("%w handshake: the publisher refused: %q", errZMTP, body[6:])
		}
		return fmt.Errorf("%w handshake: no READY from the publisher", errZMTP)
	}
	// ZMTP 3.0 subscribes with a message: 1, then the topic prefix.
	if _, err := z.conn.Write(zmtp.AppendFrame(nil, 0x00, append([]byte{1}, topic...))); err != nil {
		return err
	}
	return z.conn.SetDeadline(time.Time{})
}

// readFrame reads one frame: its flags and body. The body is fresh memory.
func (z *zmtpSub) readFrame() (byte, []byte, error) {
	flags, size, err := z.header()
	if err != nil {
		return 0, nil, err
	}
	body := make([]byte, size)
	_, err = io.ReadFull(z.r, body)
	return flags, body, err
}

// header reads a frame's flags and size, and checks the size.
func (z *zmtpSub) header() (byte, uint64, error) {
	flags, err := z.r.ReadByte()
	if err != nil {
		return 0, 0, err
	}
	if flags&^0x07 != 0 {
		return 0, 0, fmt.Errorf("%w: frame flags %#x", errZMTP, flags)
	}
	var size uint64
	if flags&zmtp.FlagLong != 0 {
		var b [8]byte
		if _, err := io.ReadFull(z.r, b[:]); err != nil {
			return 0, 0, err
		}
		size = binary.BigEndian.Uint64(b[:])
	} else {
		b, err := z.r.ReadByte()
		if err != nil {
			return 0, 0, err
		}
		size = uint64(b)
	}
	if size > z.max {
		return 0, 0, fmt.Errorf("%w: frame of %d bytes (limit %d)", errZMTP, size, z.max)
	}
	return flags, size, nil
}

// next reads the next message. Its frames are valid until the next call.
// Commands between messages are handled by command (a heartbeat PING is
// answered, the rest skipped).
func (z *zmtpSub) next() ([][]byte, error) {
	n := 0
	for {
		flags, size, err := z.header()
		if err != nil {
			return nil, err
		}
		if flags&zmtp.FlagCommand != 0 {
			if n > 0 {
				return nil, fmt.Errorf("%w: a command inside a message", errZMTP)
			}
			if err := z.command(size); err != nil {
				return nil, err
			}
			continue
		}
		if n == maxMessageFrames {
			return nil, fmt.Errorf("%w: a message of more than %d frames", errZMTP, maxMessageFrames)
		}
		if n == len(z.frames) {
			z.frames = append(z.frames, nil)
		}
		buf := z.frames[n]
		if uint64(cap(buf)) < size || cap(buf) > zmtpReadBuf && size <= zmtpReadBuf {
			buf = make([]byte, size) // fresh, or a large one not kept
		}
		buf = buf[:size]
		if _, err := io.ReadFull(z.r, buf); err != nil {
			return nil, err
		}
		z.frames[n] = buf
		n++
		if flags&zmtp.FlagMore == 0 {
			return z.frames[:n], nil
		}
	}
}

// command handles a command frame of size bytes between messages: a
// PING (ZMTP 3.1 heartbeat) is answered with a PONG carrying its context,
// as a libzmq publisher with ZMQ_HEARTBEAT_TIMEOUT expects (else it drops
// the connection); any other command is skipped.
func (z *zmtpSub) command(size uint64) error {
	if size < 5 || size > 255 {
		_, err := z.r.Discard(int(size))
		return err
	}
	var b [255]byte
	body := b[:size]
	if _, err := io.ReadFull(z.r, body); err != nil {
		return err
	}
	// name length, "PING", a 2-byte TTL, then up to 16 bytes of context
	if string(body[:5]) != "\x04PING" || len(body) < 7 {
		return nil
	}
	_ = z.conn.SetWriteDeadline(time.Now().Add(pongTimeout))
	_, err := z.conn.Write(command("PONG", body[7:]))
	_ = z.conn.SetWriteDeadline(time.Time{})
	return err
}

// pongTimeout bounds the write of a PONG.
const pongTimeout = time.Second

func (z *zmtpSub) Close() error { return z.conn.Close() }
