package h1server

import (
	"bufio"
	"bytes"
	"math/rand/v2"
	"net/http"
	"net/url"
	"reflect"
	"strconv"
	"testing"
)

// FuzzParseHead checks the fast path's head parser against http.ReadRequest:
// whatever the fast path accepts, net/http must accept and read the same way.
func FuzzParseHead(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"POST /x?y=1 HTTP/1.1\r\nHost: a.example:8080\r\nContent-Length: 12\r\nConnection: close\r\n\r\n",
		"GET /a HTTP/1.0\r\nConnection: Keep-Alive\r\nx-b: 1\r\nX-B: 2\r\nPragma: no-cache\r\n\r\n",
		"PUT /%7e HTTP/1.1\r\nhost: [::1]:80\r\nContent-Length: 007\r\naccept-encoding:\tgzip \r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n",
		"GET // HTTP/1.1\r\nHost: \r\nCookie: a=b; c=d\r\n\r\n",
		"GET / HTTP/1.0\r\nConnection: clo\xc5\xbfe\r\nConnection: KEEP-ALIVE\r\n\r\n",
		"GET /a?? HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /v1/a:b@c;d=e?x#y HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /a!b?c\x7f HTTP/1.1\r\nHost: a\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		end, bad := scanHead(data, 0)
		if bad || end == 0 {
			return
		}
		h, ok := parseHead(data[:end])
		if !ok {
			return
		}
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(data[:end])))
		if err != nil {
			t.Fatalf("fast path accepted %q, http.ReadRequest: %v", data[:end], err)
		}
		checks := []struct {
			what      string
			got, want any
		}{
			{"Method", h.method, req.Method},
			{"RequestURI", h.target, req.RequestURI},
			{"URL", *h.url, *req.URL},
			{"Proto", h.proto, req.Proto},
			{"ProtoMinor", h.minor, req.ProtoMinor},
			{"Header", h.header, req.Header},
			{"Host", h.host, req.Host},
			{"ContentLength", h.contentLength, req.ContentLength},
			{"Close", h.close, req.Close},
		}
		for _, c := range checks {
			if !reflect.DeepEqual(c.got, c.want) {
				t.Errorf("%q: %s = %#v, net/http %#v", data[:end], c.what, c.got, c.want)
			}
		}
	})
}

// TestPlainTargetAgreesWithParseRequestURI: every target the shortcut
// reads, it reads as url.ParseRequestURI does; it leaves the rest to it.
func TestPlainTargetAgreesWithParseRequestURI(t *testing.T) {
	fixed := []string{
		"/", "/v1/completions", "/a?", "/a??", "/a?b?", "/?", "/a?x=1&y=%zz", "/a#b", "/a%2Fb",
		"/a!b", "/a b", "/a:b@c;d=e$f&g+h,i", "//x", "/a?\x7f", "/a?\t", "a", "", "?x", "/é",
	}
	rng := rand.New(rand.NewPCG(1, 2))
	const alphabet = "/?#%:;@=&+$,!*'()[] aZ09-_.~\x7f\x00\t\xc3\xa9"
	for range 20000 {
		b := make([]byte, rng.IntN(12))
		for i := range b {
			b[i] = alphabet[rng.IntN(len(alphabet))]
		}
		fixed = append(fixed, "/"+string(b))
	}
	plain := 0
	for _, target := range fixed {
		got := plainTarget(target)
		if got == nil {
			continue
		}
		plain++
		want, err := url.ParseRequestURI(target)
		if err != nil {
			t.Fatalf("plainTarget(%q) read a target url.ParseRequestURI rejects: %v", target, err)
		}
		if *got != *want {
			t.Fatalf("plainTarget(%q) = %#v, url.ParseRequestURI %#v", target, *got, *want)
		}
	}
	for _, target := range []string{"/v1/completions", "/a??", "/a?"} {
		if plainTarget(target) == nil {
			t.Errorf("plainTarget(%q) left a plain target to the parser", target)
		}
	}
	if plain < 1000 {
		t.Fatalf("only %d targets took the shortcut: the comparison checks little", plain)
	}
}

// FuzzOutFields checks the head's field writer against http.Header.Write:
// the same bytes for any header, including keys that are not tokens, values
// with CR, LF and surrounding space, and more keys than it sorts itself.
func FuzzOutFields(f *testing.F) {
	f.Add([]byte("Content-Type\x00application/json\x00X-Request-Id\x00a b\x00Date\x00x"), uint8(0))
	f.Add([]byte("a\x00 v \x00A\x00\r\nx\x00bad key\x00v\x00X\x00\tq\t\x00X\x00r"), uint8(1))
	f.Add([]byte("Zz\x00\x00aa\x00\n\x00\x00e"), uint8(40))
	f.Fuzz(func(t *testing.T, data []byte, extra uint8) {
		h := http.Header{}
		parts := bytes.Split(data, []byte{0})
		for i := 0; i+1 < len(parts); i += 2 {
			k := string(parts[i])
			h[k] = append(h[k], string(parts[i+1]))
		}
		for i := range int(extra) {
			h["K"+strconv.Itoa(i)] = []string{"v"}
		}
		var want bytes.Buffer
		_ = h.Write(&want)
		w := &response{wb: &wbuf{out: make([]byte, 0, 1<<20)}}
		w.outFields(h)
		if got := string(w.wb.out); got != want.String() {
			t.Fatalf("header %q:\noutFields %q\nWrite     %q", h, got, want.String())
		}
	})
}
