package proxy

import (
	"net/http"
	"strings"
)

// isHopHeader reports whether a canonical header name is hop-by-hop
// (RFC 9110 §7.6.1) and so never crosses the proxy in either direction.
func isHopHeader(k string) bool {
	switch k {
	case "Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// connectionListed reports whether the Connection header values name k
// (a header the sender marked hop-by-hop).
func connectionListed(conn []string, k string) bool {
	for _, v := range conn {
		for f := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), k) {
				return true
			}
		}
	}
	return false
}

// CopyResponseHeaders copies upstream response headers to dst, dropping
// hop-by-hop headers (and those named in Connection) and Content-Length
// (the caller decides framing). Multi-value headers are kept whole and
// Content-Encoding is kept (the body is relayed as is). Headers already set
// in dst (the router's own x-request-id, route receipt, ...) win over the
// upstream's.
func CopyResponseHeaders(dst, src http.Header) {
	conn := src["Connection"]
	copied := func(k string) bool {
		if k == "Content-Length" || isHopHeader(k) {
			return false
		}
		if _, set := dst[k]; set {
			return false
		}
		return len(conn) == 0 || !connectionListed(conn, k)
	}
	n := 0
	for k, vs := range src {
		if copied(k) {
			n += len(vs)
		}
	}
	// Every value in one allocation; each key's slice is capped at its
	// length, so an append to one never writes into the next.
	slab := make([]string, n)
	for k, vs := range src {
		if !copied(k) {
			continue
		}
		m := copy(slab, vs)
		dst[k] = slab[:m:m]
		slab = slab[m:]
	}
}

// forwardRequestHeaders copies client headers for an upstream request,
// minus hop-by-hop headers, Host, Content-Length, Expect and Authorization
// (the caller decides the upstream credentials). Trace headers
// (traceparent, tracestate, b3...) and x-request-id pass through.
func forwardRequestHeaders(src http.Header) http.Header {
	dst := make(http.Header, len(src)+2)
	conn := src["Connection"]
	for k, vs := range src {
		switch k {
		case "Host", "Content-Length", "Expect", "Authorization":
			continue
		}
		if isHopHeader(k) || (len(conn) > 0 && connectionListed(conn, k)) {
			continue
		}
		dst[k] = vs // read-only share: the upstream request never mutates them
	}
	return dst
}

// dpRankHeader carries a data-parallel rank to vLLM.
const dpRankHeader = "X-Data-Parallel-Rank"
