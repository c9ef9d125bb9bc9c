package proxy

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http"
	"net/http/httputil"
	"net/textproto"
	"strconv"
	"strings"
)

// readHeadFast parses the common response head a worker sends (HTTP/1.1, a
// final status, a Content-Length or "Transfer-Encoding: chunked" body, the
// whole head in the bytes one read brought) with three allocations: the
// head as one string that every header key and value is a slice of, the
// header map, and the values' backing array. It reports false, having
// consumed nothing, for anything else (another version, 1xx, 204 and 304,
// HEAD, a body read to the connection's end, folded or malformed lines,
// trailers, a head split across reads): http.ReadResponse then parses it,
// with its checks and its errors. http.ReadResponse allocates per header
// line (docs/BENCHMARKS.md, section 8: it was 13 % of the router's
// allocations under wrk).
func readHeadFast(br *bufio.Reader, req *http.Request) (*http.Response, bool) {
	if req.Method == http.MethodHead {
		return nil, false
	}
	if _, err := br.Peek(1); err != nil { // one read when nothing is buffered
		return nil, false
	}
	buf, _ := br.Peek(br.Buffered())
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 {
		return nil, false
	}
	head := string(buf[:end+2]) // every line with its CRLF
	resp, ok := parseHead(head, req)
	if !ok {
		return nil, false
	}
	_, _ = br.Discard(end + 4)
	return resp, true
}

// parseHead parses head (the status line and header lines, each ending in
// CRLF, without the blank line) into a response whose body readHeadFast's
// caller sets from its framing. It reports false for what readHeadFast
// leaves to http.ReadResponse.
func parseHead(head string, req *http.Request) (*http.Response, bool) {
	// At least one per line: a bare CR or LF inside a line is refused by
	// the checks of the status line, keys and values below.
	n := strings.Count(head, "\n")
	line, rest, _ := strings.Cut(head, "\r\n")
	status, ok := strings.CutPrefix(line, "HTTP/1.1 ")
	if !ok || len(status) < 3 || (len(status) > 3 && status[3] != ' ') || !validHeaderValue(status) {
		return nil, false
	}
	code, err := strconv.Atoi(status[:3])
	if err != nil || code < 200 || code == http.StatusNoContent || code == http.StatusNotModified {
		return nil, false
	}
	n--
	hdr := make(http.Header, n)
	// The response and its values in one allocation when they fit.
	rh := new(respHead)
	vals := rh.vals[:]
	if n > len(rh.vals) {
		vals = make([]string, n)
	}
	resp := &rh.resp
	*resp = http.Response{Status: status, StatusCode: code, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: hdr, Request: req, ContentLength: -1}
	for i := 0; rest != ""; i++ {
		line, rest, _ = strings.Cut(rest, "\r\n")
		k, v, ok := strings.Cut(line, ":")
		if !ok || !validHeaderKey(k) || !validHeaderValue(v) {
			return nil, false
		}
		k = canonicalKey(k)
		v = strings.Trim(v, " \t")
		if old := hdr[k]; old != nil {
			hdr[k] = append(old, v)
			continue
		}
		vals[i] = v
		hdr[k] = vals[i : i+1 : i+1]
	}
	return resp, frameBody(resp)
}

// respHead is a parsed response with room for the values of its first
// header lines (uvicorn's and Go's JSON and SSE heads have 3-5).
type respHead struct {
	resp http.Response
	vals [6]string
}

// validHeaderKey: a non-empty token (obs-fold lines start with a space and
// fail here).
func validHeaderKey(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// validHeaderValue: no control bytes but HTAB (what textproto accepts).
func validHeaderValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// commonKeys are the canonical forms of the header keys workers send, so
// that a lower-case key (uvicorn sends them so) costs no allocation.
var commonKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{"Content-Type", "Content-Length", "Transfer-Encoding", "Date", "Server",
		"Connection", "Keep-Alive", "Cache-Control", "Vary", "X-Request-Id", "Content-Encoding",
		"Access-Control-Allow-Origin", "X-Accel-Buffering", "Retry-After", "Www-Authenticate"} {
		m[k] = k
	}
	return m
}()

// canonicalKey is textproto.CanonicalMIMEHeaderKey for a valid token key,
// without allocating for a key that is canonical or common.
func canonicalKey(k string) string {
	if len(k) > 64 {
		return textproto.CanonicalMIMEHeaderKey(k)
	}
	var b [64]byte
	upper := true
	for i := 0; i < len(k); i++ {
		c := k[i]
		if upper && 'a' <= c && c <= 'z' {
			c -= 'a' - 'A'
		} else if !upper && 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		b[i] = c
		upper = c == '-'
	}
	ck := b[:len(k)]
	if string(ck) == k {
		return k
	}
	if s, ok := commonKeys[string(ck)]; ok {
		return s
	}
	return string(ck)
}

// frameBody sets resp's ContentLength, TransferEncoding and Close from its
// headers, as http.ReadResponse does, and reports false for framings
// readHeadFast leaves to it (no length, both, other codings, trailers,
// several lengths).
func frameBody(resp *http.Response) bool {
	h := resp.Header
	if _, ok := h["Trailer"]; ok {
		return false
	}
	te, cl := h["Transfer-Encoding"], h["Content-Length"]
	switch {
	case te != nil && cl != nil, len(te) > 1, len(cl) > 1:
		return false
	case te != nil:
		if !strings.EqualFold(te[0], "chunked") {
			return false
		}
		delete(h, "Transfer-Encoding")
		resp.TransferEncoding = []string{"chunked"}
	case cl != nil:
		n, err := strconv.ParseUint(cl[0], 10, 63)
		if err != nil {
			return false
		}
		resp.ContentLength = int64(n)
	default:
		return false
	}
	for _, v := range h["Connection"] {
		for tok := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(tok), "close") {
				resp.Close = true
			}
		}
	}
	if resp.Close {
		delete(h, "Connection") // as net/http does
	}
	return true
}

// setBodyIn gives resp, parsed by readHeadFast, the reader of its body on
// br; a Content-Length body is stored in lb (nil: allocated).
func setBodyIn(resp *http.Response, br *bufio.Reader, lb *lengthBody) {
	switch {
	case resp.TransferEncoding != nil:
		resp.Body = &chunkedBody{br: br, r: httputil.NewChunkedReader(br)}
	case resp.ContentLength == 0:
		resp.Body = http.NoBody
	default:
		if lb == nil {
			lb = new(lengthBody)
		}
		*lb = lengthBody{br: br, left: resp.ContentLength}
		resp.Body = lb
	}
}

// lengthBody reads a Content-Length body: io.ErrUnexpectedEOF when the
// connection ends early, io.EOF once every byte was read.
type lengthBody struct {
	br   *bufio.Reader
	left int64
}

func (b *lengthBody) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.br.Read(p)
	b.left -= int64(n)
	switch {
	case b.left == 0:
		return n, io.EOF
	case errors.Is(err, io.EOF):
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

func (b *lengthBody) Close() error { return nil }

// chunkedBody reads a chunked body and, after its last chunk, the trailer
// section as net/http's body reader does (its fields are dropped, as the
// relay would drop them), so that the connection is at the next response.
type chunkedBody struct {
	br   *bufio.Reader
	r    io.Reader
	done bool
}

var errTrailer = errors.New("http: suspiciously long trailer after chunked body")

func (b *chunkedBody) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.r.Read(p)
	if !errors.Is(err, io.EOF) {
		return n, err
	}
	if err := b.readTrailer(); err != nil {
		return n, err
	}
	b.done = true
	return n, io.EOF
}

// readTrailer reads the trailer section: an empty line, or header lines
// ending in an empty line that must already be in sight (no unbounded
// trailer), as net/http does.
func (b *chunkedBody) readTrailer() error {
	buf, err := b.br.Peek(2)
	switch {
	case string(buf) == "\r\n":
		_, _ = b.br.Discard(2)
		return nil
	case len(buf) < 2:
		return io.ErrUnexpectedEOF
	case err != nil:
		return err
	}
	for size := 4; ; size++ {
		buf, err := b.br.Peek(size)
		if bytes.HasSuffix(buf, []byte("\r\n\r\n")) {
			break
		}
		if err != nil {
			return errTrailer
		}
	}
	_, err = textproto.NewReader(b.br).ReadMIMEHeader()
	return err
}

func (b *chunkedBody) Close() error { return nil }
