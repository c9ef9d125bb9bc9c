package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"
)

// hopHeaders are removed from relayed responses (RFC 9110 §7.6.1).
var hopHeaders = []string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// CopyResponseHeaders copies upstream response headers to dst, dropping
// hop-by-hop headers (and those named in Connection) and Content-Length
// (the relay decides framing). Multi-value headers are kept whole.
func CopyResponseHeaders(dst, src http.Header) {
	drop := map[string]bool{"Content-Length": true}
	for _, h := range hopHeaders {
		drop[h] = true
	}
	for _, v := range src.Values("Connection") {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" {
				drop[http.CanonicalHeaderKey(f)] = true
			}
		}
	}
	for k, vs := range src {
		if drop[k] {
			continue
		}
		dst[k] = append([]string(nil), vs...)
	}
}

// RelayOptions controls Relay.
type RelayOptions struct {
	// IdleTimeout aborts the relay when no upstream bytes arrive for this
	// long (0 = none).
	IdleTimeout time.Duration
	// OnFirstByte is called once, when the first body byte has been written
	// to the client.
	OnFirstByte func()
	// Observe, when set, sees every chunk written (e.g. a usage parser). It
	// must not retain the slice.
	Observe func([]byte)
}

// ErrIdleTimeout is returned when the upstream stays silent past IdleTimeout.
var ErrIdleTimeout = errors.New("upstream stream idle timeout")

// RelayResult says how a relay ended.
type RelayResult struct {
	Bytes        int64
	WroteAny     bool
	UpstreamErr  error // reading the upstream body failed (nil on clean EOF)
	DownstreamOK bool  // every write to the client succeeded
}

// Relay copies body to w chunk by chunk, flushing after every read so SSE
// events reach the client as soon as the worker produced them. It returns
// when the body ends, the upstream fails, the client goes away (ctx) or the
// idle timeout fires. The caller has already written the status line.
func Relay(ctx context.Context, w http.ResponseWriter, body io.Reader, o RelayOptions) RelayResult {
	rc := http.NewResponseController(w)
	buf := getBuf()
	defer putBuf(buf)
	var res RelayResult
	res.DownstreamOK = true

	type readResult struct {
		n   int
		err error
	}
	// Without an idle timeout, read inline: cancellation of ctx closes the
	// upstream body (the request shares ctx), which unblocks Read.
	var timer *time.Timer
	if o.IdleTimeout > 0 {
		timer = time.AfterFunc(o.IdleTimeout, func() {
			if c, ok := body.(io.Closer); ok {
				_ = c.Close()
			}
		})
		defer timer.Stop()
	}
	idleFired := func() bool {
		if timer == nil {
			return false
		}
		// Stop reports false when the timer already fired.
		if !timer.Stop() {
			return true
		}
		timer.Reset(o.IdleTimeout)
		return false
	}
	for {
		n, err := body.Read(buf)
		if n > 0 {
			if idleFired() {
				res.UpstreamErr = ErrIdleTimeout
				return res
			}
			if o.Observe != nil {
				o.Observe(buf[:n])
			}
			if _, werr := w.Write(buf[:n]); werr != nil {
				res.DownstreamOK = false
				return res
			}
			_ = rc.Flush()
			res.Bytes += int64(n)
			if !res.WroteAny {
				res.WroteAny = true
				if o.OnFirstByte != nil {
					o.OnFirstByte()
				}
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return res
			}
			if timer != nil && !timer.Stop() {
				res.UpstreamErr = ErrIdleTimeout
				return res
			}
			if ctx.Err() != nil {
				res.DownstreamOK = false
				res.UpstreamErr = ctx.Err()
				return res
			}
			res.UpstreamErr = err
			return res
		}
	}
}

const bufSize = 32 << 10

var bufPool = make(chan []byte, 1024)

func getBuf() []byte {
	select {
	case b := <-bufPool:
		return b
	default:
		return make([]byte, bufSize)
	}
}

func putBuf(b []byte) {
	select {
	case bufPool <- b:
	default:
	}
}
