package h1server

import (
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
)

// head is a parsed request head the fast path can serve.
type head struct {
	method, target, proto string
	url                   *url.URL
	minor                 int // 0 or 1 (HTTP/1.0, HTTP/1.1)
	header                http.Header
	host                  string
	contentLength         int64
	close                 bool // http.Request.Close
	wantsClose            bool // close, or a "close" word in the first Connection value
	keepAlive10           bool // HTTP/1.0 with a "keep-alive" token in Connection
}

// scanHead looks in b, from index from on, for the end of a head (the first
// empty line). It returns the head's length (end > 0), or bad when a line
// ends in a bare LF (net/http accepts those; the fallback serves them).
func scanHead(b []byte, from int) (end int, bad bool) {
	for i := from; i < len(b); i++ {
		if b[i] != '\n' {
			continue
		}
		if i == 0 || b[i-1] != '\r' {
			return 0, true
		}
		if i >= 3 && b[i-2] == '\n' && b[i-3] == '\r' {
			return i + 1, false
		}
	}
	return 0, false
}

// parseHead parses a complete head (request line, header lines, empty line;
// every line ending in CRLF). ok is false when the head is not one the fast
// path serves: malformed, or needing a feature only net/http implements.
func parseHead(b []byte) (h head, ok bool) {
	s := string(b) // one allocation backs every string of the request
	line, rest, _ := strings.Cut(s, "\r\n")
	if !h.parseRequestLine(line) {
		return h, false
	}
	if !h.parseFields(rest) {
		return h, false
	}
	return h, h.interpret()
}

// parseRequestLine parses "METHOD SP origin-form SP HTTP/1.x".
func (h *head) parseRequestLine(line string) bool {
	method, rest, ok1 := strings.Cut(line, " ")
	target, proto, ok2 := strings.Cut(rest, " ")
	if !ok1 || !ok2 || !isToken(method) || method == "CONNECT" || method == "PRI" {
		return false
	}
	if len(target) == 0 || target[0] != '/' {
		return false
	}
	switch proto {
	case "HTTP/1.1":
		h.minor = 1
	case "HTTP/1.0":
		h.minor = 0
	default:
		return false
	}
	u := plainTarget(target)
	if u == nil {
		var err error
		if u, err = url.ParseRequestURI(target); err != nil {
			return false
		}
	}
	h.method, h.target, h.proto, h.url = method, target, proto, u
	return true
}

// plainTarget returns what url.ParseRequestURI returns for an origin-form
// target whose path needs no escaping and whose query has no control bytes
// (a generation request's "/v1/completions"), without the parser's pass;
// nil for any other target, which the parser reads.
func plainTarget(target string) *url.URL {
	path, query, hasQuery := strings.Cut(target, "?")
	if path == "" || path[0] != '/' {
		return nil
	}
	for i := 0; i < len(path); i++ {
		if !pathByte[path[i]] {
			return nil
		}
	}
	for i := 0; i < len(query); i++ {
		if c := query[i]; c < ' ' || c == 0x7f {
			return nil
		}
	}
	// "/a?" forces an empty query; "/a??" has the query "?".
	return &url.URL{Path: path, RawQuery: query, ForceQuery: hasQuery && query == ""}
}

// pathByte marks the bytes url's path encoding leaves as they are.
var pathByte = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c], t[c-'a'+'A'] = true, true
	}
	for _, c := range "-_.~$&+,/:;=@" {
		t[c] = true
	}
	return t
}()

// parseFields parses the header lines in rest (which ends with the empty line).
func (h *head) parseFields(rest string) bool {
	n := strings.Count(rest, "\n") - 1 // every line ends in CRLF (scanHead)
	if n < 0 {
		return false
	}
	h.header = make(http.Header, n)
	vals := make([]string, n)
	for {
		line, more, _ := strings.Cut(rest, "\r\n")
		rest = more
		if line == "" {
			return true
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok || !isToken(k) { // also rejects obs-fold and space before ':'
			return false
		}
		v = strings.Trim(v, " \t")
		if !validValue(v) {
			return false
		}
		k = textproto.CanonicalMIMEHeaderKey(k)
		if vv, ok := h.header[k]; ok {
			h.header[k] = append(vv, v)
			continue
		}
		vals[0] = v
		h.header[k] = vals[:1:1]
		vals = vals[1:]
	}
}

// interpret applies the header fields' meaning (Host, Content-Length,
// Connection) and rejects what the fast path leaves to net/http.
func (h *head) interpret() bool {
	hd := h.header
	for _, k := range [...]string{"Transfer-Encoding", "Expect", "Upgrade"} {
		if _, ok := hd[k]; ok {
			return false
		}
	}
	hosts := hd["Host"]
	if len(hosts) > 1 || (h.minor == 1 && len(hosts) == 0) {
		return false
	}
	if len(hosts) == 1 {
		if !validHost(hosts[0]) {
			return false
		}
		h.host = hosts[0]
		delete(hd, "Host")
	}
	if !h.parseContentLength() {
		return false
	}
	conn := hd["Connection"]
	if hasToken(conn, "upgrade") {
		return false
	}
	// As net/http: Request.Close weighs every Connection value, comma-
	// separated; the response's keep-alive rules look at the first value
	// only, where tokens may also be separated by spaces or tabs.
	first := hd.Get("Connection")
	h.close = hasToken(conn, "close") || (h.minor == 0 && !hasToken(conn, "keep-alive"))
	h.wantsClose = h.close || containsWord(first, "close")
	h.keepAlive10 = h.minor == 0 && containsWord(first, "keep-alive")
	if p := hd["Pragma"]; len(p) > 0 && p[0] == "no-cache" {
		if _, ok := hd["Cache-Control"]; !ok {
			hd["Cache-Control"] = []string{"no-cache"}
		}
	}
	return true
}

// parseContentLength accepts no Content-Length or exactly one made of digits.
func (h *head) parseContentLength() bool {
	cl := h.header["Content-Length"]
	switch {
	case len(cl) == 0:
		return true
	case len(cl) > 1 || cl[0] == "" || len(cl[0]) > 18:
		return false
	}
	for i := 0; i < len(cl[0]); i++ {
		if c := cl[0][i]; c < '0' || c > '9' {
			return false
		}
	}
	n, err := strconv.ParseInt(cl[0], 10, 64)
	h.contentLength = n
	return err == nil
}

// hasToken reports whether a comma-separated list in vals holds tok (ASCII
// case-insensitively).
func hasToken(vals []string, tok string) bool {
	for _, v := range vals {
		for f := range strings.SplitSeq(v, ",") {
			if asciiEqualFold(strings.Trim(f, " \t"), tok) {
				return true
			}
		}
	}
	return false
}

// containsWord reports whether v holds tok (ASCII case-insensitively) between
// boundaries: the ends of v, spaces, commas or tabs.
func containsWord(v, tok string) bool {
	for i := 0; i+len(tok) <= len(v); i++ {
		if !asciiEqualFold(v[i:i+len(tok)], tok) {
			continue
		}
		if (i == 0 || isWordBoundary(v[i-1])) && (i+len(tok) == len(v) || isWordBoundary(v[i+len(tok)])) {
			return true
		}
	}
	return false
}

// asciiEqualFold is strings.EqualFold for ASCII only (no Unicode folding,
// as net/http compares tokens).
func asciiEqualFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		if lower(a[i]) != lower(b[i]) {
			return false
		}
	}
	return true
}

func lower(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

func isWordBoundary(b byte) bool { return b == ' ' || b == ',' || b == '\t' }

// isToken reports whether s is a non-empty RFC 9110 token.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isTokenByte(s[i]) {
			return false
		}
	}
	return true
}

func isTokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// validValue rejects control bytes other than HTAB (as net/http's server does).
func validValue(v string) bool {
	for i := 0; i < len(v); i++ {
		if c := v[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

// validHost is deliberately narrower than net/http's check: a host with any
// other byte is served (and judged) by the fallback.
func validHost(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case c == '-' || c == '.' || c == ':' || c == '[' || c == ']' || c == '_':
		default:
			return false
		}
	}
	return true
}
