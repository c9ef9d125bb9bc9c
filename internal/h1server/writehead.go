package h1server

import (
	"net/http"
	"net/textproto"
	"strconv"
	"strings"
)

// writeHead puts the status line and header into out. p is the body's first
// bytes (nil if none yet): they decide Content-Type sniffing and, when the
// handler has returned, the Content-Length. The rules are net/http's.
func (w *response) writeHead(p []byte) {
	w.headSent = true
	h := w.snap // owned, or nil
	var ex extras
	hasTrailers := w.declareTrailers(h)
	te := h.Get("Transfer-Encoding")
	hasTE := te != ""
	ok := bodyAllowed(w.status)
	_, hasCLKey := h["Content-Length"]
	if w.handlerDone && !hasTrailers && !hasTE && ok && !hasCLKey && (!w.isHEAD || len(p) > 0) {
		w.contentLength = int64(len(p))
		ex.contentLength = true
	}
	w.decideClose(h, &ex, ok)
	if ok {
		_, haveType := h["Content-Type"]
		if h.Get("Content-Encoding") == "" && !haveType && !hasTE && len(p) > 0 {
			ex.contentType = http.DetectContentType(p)
		}
	} else {
		h.Del("Content-Length")
		h.Del("Transfer-Encoding")
		if w.status == http.StatusNotModified {
			h.Del("Content-Type")
		}
	}
	_, ex.date = h["Date"]
	ex.date = !ex.date
	w.decideFraming(h, &ex, te, ok)
	w.decideConnectionHeader(h, &ex)
	w.outStatusLine(w.status)
	w.outFields(h)
	w.outExtras(&ex)
	w.outString("\r\n")
}

// decideClose decides whether the connection closes after the response
// (and settles an unread request body).
func (w *response) decideClose(h http.Header, ex *extras, bodyOK bool) {
	keepAlives := !w.c.s.inShutdown.Load()
	if w.keepAlive10 && keepAlives && h.Get("Content-Length") != "" && h.Get("Connection") == "keep-alive" {
		w.closeAfter = false
	}
	hasCL := w.contentLength != -1
	if w.keepAlive10 && (w.isHEAD || hasCL || !bodyOK) {
		if _, set := h["Connection"]; !set {
			ex.connection = "keep-alive"
		}
	} else if w.minor == 0 || w.wantsClose {
		w.closeAfter = true
	}
	if h.Get("Connection") == "close" || !keepAlives {
		w.closeAfter = true
	}
	w.settleBody(h, ex)
}

// settleBody deals with a request body the handler has not read to its end
// when the head goes out: up to maxPostHandlerReadBytes are discarded to
// keep the connection; more closes it ("Connection: close").
func (w *response) settleBody(h http.Header, ex *extras) {
	if w.body == nil || w.closeAfter || w.fullDuplex {
		return
	}
	closed, sawEOF, remaining := w.body.state()
	switch {
	case closed:
		if !sawEOF {
			w.closeAfter = true
		}
	case remaining >= maxPostHandlerReadBytes:
		w.closeAfter, w.bodyLimitHit = true, true
		h.Del("Connection")
		ex.connection = "close"
	default:
		if err := w.body.discard(); err != nil {
			w.closeAfter = true
		}
	}
}

// decideFraming chooses between Content-Length, chunking and
// close-delimited bodies.
func (w *response) decideFraming(h http.Header, ex *extras, te string, bodyOK bool) {
	hasCL := w.contentLength != -1
	hasTE := te != ""
	if hasCL && hasTE && te != "identity" {
		w.c.s.logf("http: WriteHeader called with both Transfer-Encoding of %q and a Content-Length of %d", te, w.contentLength)
		h.Del("Content-Length")
		hasCL = false
	}
	switch {
	case w.isHEAD || !bodyOK || hasCL:
		h.Del("Transfer-Encoding")
	case w.minor == 1 && hasTE && te == "identity":
		w.closeAfter = true
		h.Del("Transfer-Encoding")
	case w.minor == 1:
		w.chunking = true
		ex.te = "chunked"
		if te == "chunked" {
			h.Del("Transfer-Encoding")
		}
	default:
		w.closeAfter = true
		h.Del("Transfer-Encoding")
	}
	if w.chunking {
		h.Del("Content-Length")
	}
}

// decideConnectionHeader replaces the handler's Connection header with
// "close" when the connection closes and the handler did not say so.
func (w *response) decideConnectionHeader(h http.Header, ex *extras) {
	if !w.closeAfter {
		return
	}
	keepAlives := !w.c.s.inShutdown.Load()
	if keepAlives && containsWord(h.Get("Connection"), "close") {
		return
	}
	if w.status == http.StatusSwitchingProtocols && h.Get("Upgrade") != "" && hasToken(h["Connection"], "upgrade") {
		return
	}
	h.Del("Connection")
	if w.minor == 1 {
		ex.connection = "close"
	}
}

// maxSortedFields is how many header keys outFields sorts on its stack;
// a larger header goes through http.Header.Write.
const maxSortedFields = 32

// outFields writes h as http.Header.Write does (keys in byte order, a key
// that is not a token dropped, CR and LF in a value written as spaces, each
// value trimmed of ASCII space) without its pooled sorter and a call through
// io.StringWriter for every string.
func (w *response) outFields(h http.Header) {
	if len(h) > maxSortedFields {
		_ = h.Write(outWriter{w})
		return
	}
	var arr [maxSortedFields]string
	keys := arr[:0]
	for k := range h {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ { // insertion sort: a head has a few keys
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	for _, k := range keys {
		if !isToken(k) {
			continue
		}
		for _, v := range h[k] {
			w.outString(k)
			w.outString(": ")
			w.outValue(v)
			w.outString("\r\n")
		}
	}
}

var newlineToSpace = strings.NewReplacer("\r", " ", "\n", " ")

// outValue writes a field value as http.Header.Write does.
func (w *response) outValue(v string) {
	if strings.ContainsAny(v, "\r\n") {
		v = newlineToSpace.Replace(v)
	}
	w.outString(textproto.TrimString(v))
}

func (w *response) outExtras(ex *extras) {
	if ex.date {
		w.outString("Date: ")
		w.outWrite(date())
		w.outString("\r\n")
	}
	if ex.contentLength {
		w.room(40)
		w.wb.out = append(w.wb.out, "Content-Length: "...)
		w.wb.out = strconv.AppendInt(w.wb.out, w.contentLength, 10)
		w.wb.out = append(w.wb.out, '\r', '\n')
	}
	for _, f := range [...]struct{ k, v string }{
		{"Content-Type", ex.contentType}, {"Connection", ex.connection}, {"Transfer-Encoding", ex.te},
	} {
		if f.v != "" {
			w.outString(f.k)
			w.outString(": ")
			w.outString(f.v)
			w.outString("\r\n")
		}
	}
}
