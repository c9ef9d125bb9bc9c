package h1server

import (
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// testHandler is the handler set both servers serve in the differential test.
func testHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/hello", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello world") })
	mux.HandleFunc("/info", func(w http.ResponseWriter, r *http.Request) {
		keys := make([]string, 0, len(r.Header))
		for k := range r.Header {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		fmt.Fprintf(w, "%s %s %s %q host=%q cl=%d close=%v\n", r.Method, r.RequestURI, r.Proto, r.URL.Path, r.Host, r.ContentLength, r.Close)
		for _, k := range keys {
			fmt.Fprintf(w, "%s=%q\n", k, r.Header[k])
		}
		b, err := io.ReadAll(r.Body)
		fmt.Fprintf(w, "body=%q err=%v\n", b, err)
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) { io.Copy(w, r.Body) })
	mux.HandleFunc("/mid", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(strings.Repeat("m", 3000))) })
	mux.HandleFunc("/big", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(strings.Repeat("b", 10000)))
		w.Write([]byte(strings.Repeat("c", 100)))
	})
	mux.HandleFunc("/pieces", func(w http.ResponseWriter, r *http.Request) {
		for i := range 40 {
			fmt.Fprintf(w, "piece %d %s\n", i, strings.Repeat("p", 100))
		}
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			time.Sleep(5 * time.Millisecond)
		}
	})
	mux.HandleFunc("/flushempty", func(w http.ResponseWriter, r *http.Request) { w.(http.Flusher).Flush() })
	mux.HandleFunc("/204", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		w.WriteHeader(204)
		_, err := w.Write([]byte("hello"))
		if err != http.ErrBodyNotAllowed {
			panic(err)
		}
	})
	mux.HandleFunc("/304", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Etag", `"x"`)
		w.WriteHeader(304)
		w.Write([]byte("hello"))
	})
	mux.HandleFunc("/cl", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		io.WriteString(w, "hello")
	})
	mux.HandleFunc("/clshort", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10")
		io.WriteString(w, "hello")
	})
	mux.HandleFunc("/cllong", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "3")
		_, err := io.WriteString(w, "hello")
		if err != http.ErrContentLength {
			panic(err)
		}
		io.WriteString(w, "abc")
	})
	mux.HandleFunc("/clbad", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "x")
		io.WriteString(w, "hello")
	})
	mux.HandleFunc("/close", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		io.WriteString(w, "bye")
	})
	mux.HandleFunc("/ignore", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ignored") })
	mux.HandleFunc("/103", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</a.css>; rel=preload")
		w.WriteHeader(103)
		w.Header().Del("Link")
		io.WriteString(w, "<html>after hints</html>")
	})
	mux.HandleFunc("/twice", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(201)
		w.WriteHeader(202)
		io.WriteString(w, "x")
	})
	mux.HandleFunc("/nosniff", func(w http.ResponseWriter, r *http.Request) {
		w.Header()["Content-Type"] = nil
		io.WriteString(w, "<html></html>")
	})
	mux.HandleFunc("/identity", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Transfer-Encoding", "identity")
		io.WriteString(w, strings.Repeat("i", 3000))
	})
	mux.HandleFunc("/empty", func(w http.ResponseWriter, r *http.Request) {})
	// Header fields the head writer must write as net/http's does: sorted,
	// invalid names dropped, CR and LF in values made spaces, values trimmed,
	// more fields than its stack array, a value longer than the output buffer.
	mux.HandleFunc("/oddheaders", func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h["Bad Name"] = []string{"dropped"}
		h["Bad:Name"] = []string{"dropped"}
		h[""] = []string{"dropped"}
		h["X-Split"] = []string{"a\r\nInjected: 1", " b\n", "\t c\r"}
		h["X-Trim"] = []string{"  spaced  ", "\t"}
		h["x-lower"] = []string{"kept as set"}
		for i := range 20 {
			h.Add(fmt.Sprintf("X-Many-%02d", 19-i), strconv.Itoa(i))
		}
		if r.URL.Query().Has("long") {
			h.Set("X-Long", strings.Repeat("v", 10<<10))
		}
		io.WriteString(w, "odd")
	})
	mux.HandleFunc("/json", jsonHandler)
	mux.HandleFunc("/hdr", hdrHandler)
	mux.HandleFunc("/echotyped", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		io.Copy(w, r.Body)
	})
	mux.HandleFunc("/echohalf", func(w http.ResponseWriter, r *http.Request) {
		io.CopyN(w, r.Body, r.ContentLength/2)
	})
	mux.HandleFunc("/fullduplex", func(w http.ResponseWriter, r *http.Request) {
		http.NewResponseController(w).EnableFullDuplex()
		io.WriteString(w, "early ")
		w.(http.Flusher).Flush()
		b, err := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%d %v", len(b), err)
	})
	mux.HandleFunc("/trailers", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum, Content-Length, x-late")
		w.Header().Set(http.TrailerPrefix+"X-Prefixed", "early")
		io.WriteString(w, "body")
		w.Header().Set("X-Sum", "42")
		w.Header().Add("X-Late", "a")
		w.Header().Add("X-Late", "b\r\nInjected: 1")
		w.Header().Set(http.TrailerPrefix+"X-Undeclared", "u")
	})
	mux.HandleFunc("/bodyclose", func(w http.ResponseWriter, r *http.Request) {
		p := make([]byte, 2)
		n, err := r.Body.Read(p)
		cerr := r.Body.Close()
		n2, err2 := r.Body.Read(p)
		fmt.Fprintf(w, "%d %v %v %d %v", n, err, cerr, n2, err2)
	})
	mux.HandleFunc("/bodyeof", func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		n, err2 := r.Body.Read(make([]byte, 1))
		fmt.Fprintf(w, "%q %v %d %v", b, err, n, err2)
	})
	mux.HandleFunc("/writestring", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, strings.Repeat("s", 1000))
		w.(http.Flusher).Flush()
		io.WriteString(w, strings.Repeat("t", 5000))
	})
	// The head decided at WriteHeader (Content-Type and Content-Length
	// set): later header changes, a panic, a flush, ReadFrom, an unread
	// body and trailers must come out as net/http's.
	decided := func(w http.ResponseWriter, n int) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(n))
	}
	mux.HandleFunc("/decided", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.WriteHeader(201)
		w.Header().Set("X-After", "1")
		w.Header().Del("Content-Type")
		io.WriteString(w, `{"a":1}`)
	})
	mux.HandleFunc("/decidedpanic", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.WriteHeader(200)
		panic(http.ErrAbortHandler)
	})
	mux.HandleFunc("/decidedpanicbody", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.WriteHeader(200)
		io.WriteString(w, `{"a"`)
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	})
	mux.HandleFunc("/decidedflush", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		io.WriteString(w, `{"a"`)
		w.(http.Flusher).Flush()
		io.WriteString(w, `:1}`)
	})
	mux.HandleFunc("/decidedreadfrom", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 3000)
		w.WriteHeader(200)
		w.(io.ReaderFrom).ReadFrom(strings.NewReader(strings.Repeat("r", 3000)))
	})
	mux.HandleFunc("/decidedtrailer", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.Header().Set(http.TrailerPrefix+"X-T", "t")
		w.WriteHeader(200)
		io.WriteString(w, `{"a":1}`)
	})
	mux.HandleFunc("/decidedunread", func(w http.ResponseWriter, r *http.Request) {
		decided(w, 7)
		w.WriteHeader(200)
		b, err := io.ReadAll(r.Body)
		fmt.Fprintf(w, "%3d%4v", len(b), err != nil)
	})
	mux.HandleFunc("/decidedread", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		decided(w, len(b))
		w.WriteHeader(200)
		w.Write(b)
	})
	return mux
}

func get(path, extra string) string {
	return "GET " + path + " HTTP/1.1\r\nHost: example.com\r\n" + extra + "\r\n"
}

func post(path, body string) string {
	return fmt.Sprintf("POST %s HTTP/1.1\r\nHost: example.com\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
}

func TestDifferential(t *testing.T) {
	h := testHandler()
	const maxHeader = 8 << 10
	_, h1 := startH1(t, h, func(s *Server) { s.MaxHeaderBytes = maxHeader })
	std := startStd(t, h, func(s *http.Server) { s.MaxHeaderBytes = maxHeader })
	cases := []struct {
		name  string
		steps []string
	}{
		{"get", []string{get("/hello", "")}},
		{"info", []string{get("/info?q=1&r=%20", "X-B: 1\r\nx-a: 2\r\nX-B:  3 \r\nPragma: no-cache\r\nConnection: keep-alive, foo\r\n")}},
		{"post echo", []string{post("/echo", `{"a":1}`)}},
		{"post info", []string{post("/info", "0123456789")}},
		{"post CL 0", []string{post("/info", "")}},
		{"mid chunked", []string{get("/mid", "")}},
		{"big chunked", []string{get("/big", "")}},
		{"small writes", []string{get("/pieces", "")}},
		{"stream", []string{get("/stream", "")}},
		{"flush empty", []string{get("/flushempty", "")}},
		{"empty", []string{get("/empty", "")}},
		{"odd headers", []string{get("/oddheaders", ""), get("/hello", "")}},
		{"odd headers, a value over the buffer", []string{get("/oddheaders?long=1", ""), get("/hello", "")}},
		{"odd headers, 103", []string{get("/103", ""), get("/oddheaders", "")}},
		{"head", []string{"HEAD /hello HTTP/1.1\r\nHost: a\r\n\r\n"}},
		{"head big", []string{"HEAD /big HTTP/1.1\r\nHost: a\r\n\r\n"}},
		{"204", []string{get("/204", "")}},
		{"304", []string{get("/304", "")}},
		{"handler CL", []string{get("/cl", "")}},
		{"handler CL short", []string{get("/clshort", ""), get("/hello", "")}},
		{"handler CL long", []string{get("/cllong", "")}},
		{"handler CL bad", []string{get("/clbad", "")}},
		{"handler close", []string{get("/close", ""), get("/hello", "")}},
		{"103", []string{get("/103", "")}},
		{"superfluous", []string{get("/twice", "")}},
		{"nosniff", []string{get("/nosniff", "")}},
		{"identity", []string{get("/identity", "")}},
		{"404", []string{get("/nope", "")}},
		{"http10", []string{"GET /hello HTTP/1.0\r\n\r\n"}},
		{"http10 big", []string{"GET /big HTTP/1.0\r\n\r\n"}},
		{"http10 keepalive", []string{"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "GET /info HTTP/1.0\r\nConnection: keep-alive\r\nHost: h\r\n\r\n"}},
		{"http10 keepalive chunkless", []string{"GET /big HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"}},
		{"connection close", []string{get("/hello", "Connection: close\r\n"), get("/hello", "")}},
		{"pipelined", []string{get("/hello", "") + post("/echo", "abc") + get("/info", "")}},
		{"keep-alive 3", []string{get("/hello", ""), post("/echo", "xyz"), get("/big", "")}},
		{"fallback TE chunked", []string{"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"}},
		{"fallback expect", []string{"POST /echo HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc"}},
		{"fallback obs-fold", []string{get("/info", "X-A: a\r\n b\r\n")}},
		{"fallback no host", []string{"GET /hello HTTP/1.1\r\n\r\n"}},
		{"fallback two hosts", []string{get("/hello", "Host: b\r\n")}},
		{"fallback bad line", []string{"GARBAGE\r\n\r\n"}},
		{"fallback bad version", []string{"GET /hello HTTP/1.2\r\nHost: a\r\n\r\n"}},
		{"fallback http2 preface", []string{"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"}},
		{"fallback over max header", []string{get("/hello", "X-Big: "+strings.Repeat("z", 14<<10)+"\r\n")}},
		{"fallback 6KiB header", []string{get("/info", "X-Big: "+strings.Repeat("z", 6<<10)+"\r\n")}},
		{"fallback bare LF", []string{"GET /info HTTP/1.1\nHost: a\n\n"}},
		{"fallback absolute form", []string{"GET http://a.example/info HTTP/1.1\r\nHost: b\r\n\r\n"}},
		{"fallback bad CL", []string{"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc"}},
		{"fallback third request", []string{get("/hello", ""), get("/hello", ""), "POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nq\r\n0\r\n\r\n", get("/hello", "")}},
		{"fallback truncated head", []string{"GET /hello HTTP/1.1\r\nHost: a\r\n"}},
		{"post CRLF tolerance", []string{post("/echo", "abc") + "\r\n" + get("/hello", "")}},
		{"options star", []string{"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n"}},
		{"odd method", []string{"get /info HTTP/1.1\r\nHost: a\r\n\r\n"}},
		{"get with body", []string{"GET /info HTTP/1.1\r\nHost: a\r\nContent-Length: 03\r\n\r\nabc"}},
		{"short body", []string{"POST /info HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc"}},
		{"header space before colon", []string{get("/info", "X-A : 1\r\n")}},
		{"header control byte", []string{get("/info", "X-A: a\x01b\r\n")}},
		{"upgrade", []string{get("/info", "Connection: Upgrade\r\nUpgrade: websocket\r\n")}},
		{"head http10", []string{"HEAD /hello HTTP/1.0\r\n\r\n"}},
		{"http10 keepalive head", []string{"HEAD /big HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /hello HTTP/1.0\r\n\r\n"}},
		{"http10 handler CL", []string{"GET /cl HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "GET /cl HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"}},
		{"body close", []string{post("/bodyclose", "0123456789"), get("/hello", "")}},
		{"body close large", []string{post("/bodyclose", strings.Repeat("L", 300<<10))}},
		{"body eof", []string{post("/bodyeof", "0123456789"), get("/hello", "")}},
		{"flush then big", []string{get("/writestring", "")}},
		{"trailers", []string{get("/trailers", "")}},
		{"trailers http10", []string{"GET /trailers HTTP/1.0\r\n\r\n"}},
		{"trailers head", []string{"HEAD /trailers HTTP/1.1\r\nHost: a\r\n\r\n"}},
		{"unread body small", []string{post("/ignore", strings.Repeat("u", 100<<10)), get("/hello", "")}},
		{"unread body large", []string{post("/ignore", strings.Repeat("u", 300<<10))}},
		{"decided head", []string{get("/decided", ""), get("/hello", "")}},
		{"decided head, panic", []string{get("/decidedpanic", "")}},
		{"decided head, panic after a flush", []string{get("/decidedpanicbody", "")}},
		{"decided head, flushes", []string{get("/decidedflush", ""), get("/decided", "")}},
		{"decided head, ReadFrom", []string{get("/decidedreadfrom", "")}},
		{"decided head, trailer", []string{get("/decidedtrailer", "")}},
		{"decided head, body read after", []string{post("/decidedunread", "0123456789"), get("/hello", "")}},
		{"decided head, body read before", []string{post("/decidedread", "0123456789"), post("/decidedread", "ab")}},
		{"decided head, client closes", []string{get("/decided", "Connection: close\r\n"), get("/hello", "")}},
		{"decided head, http10", []string{"GET /decided HTTP/1.0\r\n\r\n"}},
		{"decided head, http10 keepalive", []string{"GET /decided HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", "GET /decidedflush HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"}},
		{"decided head, HEAD", []string{"HEAD /decided HTTP/1.1\r\nHost: a\r\n\r\n"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			want := dropDate(exchange(t, std, tc.steps))
			got := dropDate(exchange(t, h1, tc.steps))
			if got != want {
				t.Errorf("h1server and net/http differ\nh1server:\n%s\nnet/http:\n%s", trunc(got), trunc(want))
			}
			if want == "" && !strings.Contains(tc.name, "panic") { // a panic before a write sends nothing
				t.Errorf("net/http sent nothing")
			}
		})
	}
}

func trunc(s string) string {
	if len(s) > 3000 {
		return s[:3000] + "...(truncated)"
	}
	return s
}

// hdrHandler answers as its query says: h=Key:Value header fields (set
// before WriteHeader; late=Key:Value after it), code=status, n=body bytes
// written in w=pieces, flush=1 to flush after the first piece.
func hdrHandler(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	for _, kv := range q["h"] {
		k, v, _ := strings.Cut(kv, ":")
		w.Header().Add(k, v)
	}
	code, _ := strconv.Atoi(q.Get("code"))
	if code != 0 {
		w.WriteHeader(code)
	}
	for _, kv := range q["late"] {
		k, v, _ := strings.Cut(kv, ":")
		w.Header().Add(k, v)
	}
	n, _ := strconv.Atoi(q.Get("n"))
	pieces, _ := strconv.Atoi(q.Get("w"))
	pieces = max(pieces, 1)
	for i := range pieces {
		w.Write([]byte(strings.Repeat("h", n/pieces)))
		if i == 0 && q.Get("flush") == "1" {
			w.(http.Flusher).Flush()
		}
	}
}

func jsonHandler(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	w.Write(jsonAnswer)
}

var jsonAnswer = []byte(`{"id":"cmpl-1","object":"text_completion","model":"m","choices":[{"index":0,"text":"` + strings.Repeat("a", 300-156) + `","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"total_tokens":2}}`)

// A head that nothing to come can change is framed at WriteHeader, from
// the handler's header itself (no snapshot: net/http clones the header
// there); any other waits for the body, on a snapshot.
func TestHeadDecidedAtWriteHeader(t *testing.T) {
	type seen struct {
		framed, aliased bool
	}
	got := make(chan seen, 1)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		io.Copy(io.Discard, r.Body)
		if q.Has("ct") {
			w.Header().Set("Content-Type", "application/json")
		}
		if q.Has("cl") {
			w.Header().Set("Content-Length", "2")
		}
		if q.Has("conn") {
			w.Header().Set("Connection", "keep-alive")
		}
		w.WriteHeader(200)
		rw := w.(*response)
		got <- seen{framed: rw.headSent, aliased: sameMap(rw.snap, rw.handlerHeader)}
		io.WriteString(w, "{}")
	})
	_, addr := startH1(t, h, nil)
	for _, tc := range []struct {
		query  string
		framed bool
	}{
		{"ct&cl", true},
		{"cl", false},         // Content-Type to sniff from the body
		{"ct", false},         // chunked, or a Content-Length if the handler ends first
		{"ct&cl&conn", false}, // a Connection field the head's rules may edit
	} {
		exchange(t, addr, []string{get("/?"+tc.query, "")})
		s := <-got
		if s.framed != tc.framed || s.aliased != tc.framed {
			t.Errorf("%s: head framed at WriteHeader %v, header not snapshotted %v; want %v", tc.query, s.framed, s.aliased, tc.framed)
		}
	}
}

// sameMap reports whether a and b are one map.
func sameMap(a, b http.Header) bool {
	if a == nil || b == nil {
		return false
	}
	const probe = "X-H1server-Probe"
	a[probe] = nil
	_, ok := b[probe]
	delete(a, probe)
	return ok
}
