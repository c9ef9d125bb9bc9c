package h1server

import (
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestDifferentialRandom sends requests assembled at random (fixed seed) from
// pieces near the fast path's edges, alone or pipelined, to both servers and
// compares the raw responses.
func TestDifferentialRandom(t *testing.T) {
	configs := []struct {
		name      string
		maxHeader int
		timeouts  bool
	}{
		{"defaults", 0, false},
		{"small MaxHeaderBytes and timeouts", 1500, true},
	}
	for ci, cfg := range configs {
		t.Run(cfg.name, func(t *testing.T) {
			h := testHandler()
			_, h1 := startH1(t, h, func(s *Server) {
				s.MaxHeaderBytes = cfg.maxHeader
				if cfg.timeouts {
					s.ReadHeaderTimeout, s.IdleTimeout = 5*time.Second, 10*time.Second
				}
			})
			std := startStd(t, h, func(s *http.Server) {
				s.MaxHeaderBytes = cfg.maxHeader
				if cfg.timeouts {
					s.ReadHeaderTimeout, s.IdleTimeout = 5*time.Second, 10*time.Second
				}
			})
			g := reqGen{Rand: rand.New(rand.NewPCG(1, uint64(ci))), smallLimit: cfg.maxHeader > 0}
			for i := range 300 {
				var b strings.Builder
				for range 1 + g.IntN(3) {
					b.WriteString(g.request())
				}
				steps := []string{b.String() + g.pick("", "", get("/hello", ""), "\r\n"+get("/info", ""), "GET / HTTP/1.0\r\n\r\n")}
				want := dropDate(exchange(t, std, steps))
				got := dropDate(exchange(t, h1, steps))
				if got != want {
					t.Errorf("case %d %q:\nh1server:\n%s\nnet/http:\n%s", i, trunc(steps[0]), trunc(got), trunc(want))
				}
			}
		})
	}
}

// reqGen assembles requests from pieces near the fast path's edges.
// smallLimit keeps long headers clear of the zone just above MaxHeaderBytes
// where net/http's limit is fuzzy (it counts bytes read from the conn, so a
// pipelined head partly buffered during the previous request gets more
// room than the same head handed off with those bytes replayed).
type reqGen struct {
	*rand.Rand
	smallLimit bool
}

func (g reqGen) longLen() int {
	if g.smallLimit && g.IntN(2) == 0 {
		return 12000 + g.IntN(2000)
	}
	if g.smallLimit {
		return g.IntN(800)
	}
	return g.IntN(6000)
}

func (g reqGen) pick(s ...string) string { return s[g.IntN(len(s))] }

// hdrTarget is a request-target for hdrHandler.
func (g reqGen) hdrTarget() string {
	var q []string
	for range g.IntN(4) {
		q = append(q, g.pick("h=", "late=")+g.pick("Connection:close", "Connection:keep-alive", "Content-Length:5", "Content-Length:0",
			"Content-Length:3000", "Content-Length:x", "Transfer-Encoding:chunked", "Transfer-Encoding:identity", "Transfer-Encoding:gzip",
			"Content-Type:text/x", "Content-Encoding:gzip", "Date:yesterday", "Trailer:X-T", "X-Content-Type-Options:nosniff", "Upgrade:foo", "Connection:Upgrade"))
	}
	q = append(q, "code="+g.pick("", "", "200", "201", "204", "304", "404", "500", "101", "199", "999", "103"))
	q = append(q, "n="+g.pick("0", "5", "600", "2048", "2049", "5000"), "w="+g.pick("1", "2", "7"), "flush="+g.pick("0", "1"))
	return "/hdr?" + strings.Join(q, "&")
}

func (g reqGen) request() string {
	var b strings.Builder
	b.WriteString(g.pick("GET", "POST", "HEAD", "PUT", "get", "DELETE", "GET", "GET") + " ")
	b.WriteString(g.pick(g.hdrTarget(), g.hdrTarget(), g.hdrTarget(), "/info", "/hello", "/echo", "/mid", "/204", "/304", "/cl", "/close", "/stream", "/trailers", "/ignore", "/bodyeof",
		"/103", "/twice", "/cllong", "/clshort", "/flushempty", "/bodyclose", "/identity", "/nosniff", "/big", "/pieces", "/empty", "/writestring",
		"/echotyped", "/echohalf", "/fullduplex", "/echo", "/echo"))
	b.WriteString(g.pick("", "", "?a=b", "?%zz", "#frag", "/x/../y") + " " + g.pick("HTTP/1.1", "HTTP/1.1", "HTTP/1.0") + "\r\n")
	if g.IntN(8) != 0 {
		b.WriteString("Host: " + g.pick("a", "a", "a.example:80", "", "[::1]", "a b", "a_b") + "\r\n")
	}
	body := ""
	if g.IntN(2) == 0 {
		body = strings.Repeat("q", g.IntN(3000))
		n := strconv.Itoa(len(body))
		b.WriteString("Content-Length: " + g.pick(n, n, n, " "+n+" ", "0"+n, strconv.Itoa(len(body)+7), "-1", "+5", "1e3") + "\r\n")
	}
	for range g.IntN(4) {
		b.WriteString(g.pick(
			"Connection: close", "Connection: keep-alive", "Connection: Keep-Alive, x", "Connection: CLOSE",
			"Pragma: no-cache", "Cache-Control: x", "X-A: 1", "x-a:2", "X-Empty:", "Accept: */*",
			"X-Tab: \tv\t", "X-Obs: \x80\xff", "Expect: 100-continue", "Upgrade: h2c", "Transfer-Encoding: identity",
			"Connection: upgrade", "X-Long: "+strings.Repeat("l", g.longLen()), "Bad Name: 1", "Connection: x close",
		) + "\r\n")
	}
	return b.String() + "\r\n" + body
}
