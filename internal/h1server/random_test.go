package h1server

import (
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
)

// TestDifferentialRandom sends requests assembled at random (fixed seed) from
// pieces near the fast path's edges to both servers and compares the raw
// responses.
func TestDifferentialRandom(t *testing.T) {
	h := testHandler()
	_, h1 := startH1(t, h, nil)
	std := startStd(t, h, nil)
	rng := rand.New(rand.NewPCG(1, 2))
	pick := func(s ...string) string { return s[rng.IntN(len(s))] }
	for i := range 300 {
		method := pick("GET", "POST", "HEAD", "PUT", "get", "DELETE")
		path := pick("/info", "/hello", "/echo", "/mid", "/204", "/304", "/cl", "/close", "/stream", "/trailers", "/ignore", "/bodyeof",
			"/103", "/twice", "/cllong", "/clshort", "/flushempty", "/bodyclose", "/identity", "/nosniff", "/big", "/pieces", "/empty", "/writestring",
			"/echotyped", "/echohalf", "/fullduplex", "/echo", "/echo")
		proto := pick("HTTP/1.1", "HTTP/1.1", "HTTP/1.0")
		var b strings.Builder
		b.WriteString(method + " " + path + pick("", "?a=b", "?%zz", "#frag", "/x/../y") + " " + proto + "\r\n")
		if rng.IntN(8) != 0 {
			b.WriteString("Host: " + pick("a", "a.example:80", "", "[::1]", "a b", "a_b") + "\r\n")
		}
		body := ""
		if rng.IntN(2) == 0 {
			body = strings.Repeat("q", rng.IntN(3000))
			b.WriteString("Content-Length: " + pick(itoa(len(body)), itoa(len(body)), " "+itoa(len(body))+" ", "0"+itoa(len(body)), itoa(len(body)+7), "-1", "+5", "1e3") + "\r\n")
		}
		for range rng.IntN(4) {
			b.WriteString(pick(
				"Connection: close", "Connection: keep-alive", "Connection: Keep-Alive, x", "Connection: CLOSE",
				"Pragma: no-cache", "Cache-Control: x", "X-A: 1", "x-a:2", "X-Empty:", "Accept: */*",
				"X-Tab: \tv\t", "X-Obs: \x80\xff", "Expect: 100-continue", "Upgrade: h2c", "Transfer-Encoding: identity",
				"Connection: upgrade", "X-Long: "+strings.Repeat("l", rng.IntN(6000)), "Bad Name: 1", "Connection: x close",
			) + "\r\n")
		}
		b.WriteString("\r\n" + body)
		req := b.String()
		steps := []string{req + pick("", get("/hello", ""), req, "\r\n"+get("/info", ""), "GET / HTTP/1.0\r\n\r\n")}
		want := dropDate(exchange(t, std, steps))
		got := dropDate(exchange(t, h1, steps))
		if got != want {
			t.Errorf("case %d %q:\nh1server:\n%s\nnet/http:\n%s", i, steps[0], trunc(got), trunc(want))
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
