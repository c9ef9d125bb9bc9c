package chaos

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// TestErrorBurstRegular: in regular mode one of two workers answers 500 to
// everything for a while. Retries move each failed attempt to the other
// worker before anything reached the client, the failing worker's breaker
// opens, and after the burst it half-opens, closes and serves again.
func TestErrorBurstRegular(t *testing.T) {
	s := scaleFor()
	f := startRegularFleet(t, 2, []string{"--cb-timeout-duration-secs", "2"})
	f.r.markBaseline(t)
	l := startLoad(loadConfig{base: f.r.Base, conc: s.conc, dur: s.dur, deadline: s.deadline})

	time.Sleep(s.at(0.2))
	failFor := 5 * time.Second
	if s.long {
		failFor = 20 * time.Second
	}
	f.w[0].SetFaults(t, map[string]any{"fail_next": 100000000, "fail_status": 500})
	time.Sleep(failFor)
	f.w[0].SetFaults(t, map[string]any{"fail_next": 0})
	served := f.w[0].Stats(t).Requests.Plain
	res := l.wait()
	f.r.alive(t)

	c := res.checkEnded(t)
	res.checkServedThroughout(t)
	res.checkSuccessRate(t, "whole run", time.Time{}, time.Time{}, 0.999)
	m := f.r.scrape(t)
	opens := metricSum(m, "vllm_router_cb_state_transitions_total", `to="open"`)
	closes := metricSum(m, "vllm_router_cb_state_transitions_total", `to="closed"`)
	// A half-open breaker closes after --cb-success-threshold consecutive
	// probe successes, one probe at a time; on a busy machine the load may
	// end first. Keep a trickle of requests going (bounded) until it closes.
	for deadline := time.Now().Add(20 * time.Second); opens >= 1 && closes < 1 && time.Now().Before(deadline); {
		resp, err := http.Post(f.r.Base+"/v1/completions", "application/json",
			strings.NewReader(`{"prompt":"probe","max_tokens":2}`))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		closes = metricSum(f.r.scrape(t), "vllm_router_cb_state_transitions_total", `to="closed"`)
	}
	retries := metricSum(m, "vllm_router_retries_total")
	t.Logf("breaker opens %v, closes %v, retries %v", opens, closes, retries)
	if opens < 1 || closes < 1 {
		t.Errorf("the failing worker's breaker did not open and close again (opens %v, closes %v)", opens, closes)
	}
	if retries < 1 {
		t.Errorf("no retry recorded")
	}
	if now := f.w[0].Stats(t).Requests.Plain; now == served {
		t.Errorf("the recovered worker got no traffic after the burst")
	}
	figures(t, "worker returns 500 for "+failFor.String(), c)
	f.r.checkNoLeak(t, 15*time.Second)
}

// TestAdmissionBurst: a router limited to 64 concurrent requests with a
// queue of 32 (1 s) under a closed loop of 256 clients plus a burst of 512
// more. The excess gets 429 (queue full) or 408 (queue timeout), never a
// reset; everything admitted completes, and the workers never see more than
// 64 requests at once.
func TestAdmissionBurst(t *testing.T) {
	s := scaleFor()
	const maxConc = 64
	f := startRegularFleet(t, 1, []string{"--max-concurrent-requests", fmt.Sprint(maxConc), "--queue-size", "32", "--queue-timeout-secs", "1"})
	f.r.markBaseline(t)
	l := startLoad(loadConfig{base: f.r.Base, conc: s.conc, dur: s.dur, deadline: s.deadline, maxTokens: 48})

	bursts := 1
	time.Sleep(s.at(0.4))
	l.burst(512)
	if s.long {
		for range 4 {
			time.Sleep(s.at(0.1))
			l.burst(512)
			bursts++
		}
	}
	res := l.wait()
	f.r.alive(t)

	c := res.checkEnded(t)
	// admitted requests start and end in waves of 64 (~2 s each)
	res.checkServedEvery(t, 3*time.Second)
	if c.ok < maxConc {
		t.Errorf("only %d requests were admitted and completed", c.ok)
	}
	for st, n := range c.status {
		if st != 200 && st != 429 && st != 408 {
			t.Errorf("%d requests got status %d; admission must answer 429 or 408", n, st)
		}
	}
	if c.status[429] == 0 {
		t.Errorf("no 429 under a load of %d over a limit of %d + queue 32", s.conc, maxConc)
	}
	if c.sseErr != 0 {
		t.Errorf("%d admitted streams ended with an error event", c.sseErr)
	}
	// The worker counts its own peak: one worker, so no sum of snapshots
	// taken at different moments. The worker's handler counts a request
	// out before the end of its response leaves (the chunked terminator,
	// or the buffered JSON body, is written after the handler returns), and
	// the router frees a slot only after it has read that end, so the
	// bound is exact.
	peak := f.w[0].Stats(t).Requests.PeakInFlight
	t.Logf("peak upstream in-flight %d (limit %d)", peak, maxConc)
	if peak > maxConc {
		t.Errorf("the worker saw %d requests at once, over --max-concurrent-requests %d", peak, maxConc)
	}
	figures(t, fmt.Sprintf("closed loop of %d + %d bursts of 512 over a limit of %d, queue 32", s.conc, bursts, maxConc), c)
	f.r.checkNoLeak(t, 15*time.Second)
}

// TestSlowClients: slowloris clients (headers sent a byte at a time, bodies
// never finished) and clients that never read their response hold
// connections while 256 normal clients are served. The router closes
// header-slowloris connections after its header timeout (10 s); once every
// slow client is gone its goroutines and fds come back down.
func TestSlowClients(t *testing.T) {
	s := scaleFor()
	if !s.long {
		s.dur = 14 * time.Second // past the router's 10 s header timeout
	} else {
		s.dur = 75 * time.Second // past its 60 s body timeout
	}
	const readHeaderTimeout, bodyReadTimeout = 10 * time.Second, 60 * time.Second
	f := startRegularFleet(t, 2, nil)
	f.r.markBaseline(t)
	host := strings.TrimPrefix(f.r.Base, "http://")
	nHdr, nBody, nStuck := 100, 100, 32
	if s.long {
		nHdr, nBody, nStuck = 300, 300, 64
	}

	l := startLoad(loadConfig{base: f.r.Base, conc: s.conc, dur: s.dur, deadline: s.deadline})
	var closedByRouter, hdrCount, bodyCount atomic.Int64
	var lateClose atomic.Int64 // header slowloris not closed within the timeout
	var bodyClosed atomic.Int64
	var clientClose atomic.Int64 // unix nanos when the test closes the slow clients
	var conns []net.Conn
	var mu sync.Mutex
	var wg sync.WaitGroup
	keep := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	done := make(chan struct{})

	// headers one byte every 100 ms, never finished
	for range nHdr {
		c, err := net.Dial("tcp", host)
		if err != nil {
			t.Fatalf("slowloris dial: %v", err)
		}
		keep(c)
		opened := time.Now()
		hdrCount.Add(1)
		wg.Go(func() {
			req := "POST /v1/completions HTTP/1.1\r\nHost: " + host + "\r\nContent-Type: application/json\r\nX-Slow: " + strings.Repeat("a", 4000)
			for i := 0; i < len(req); i++ {
				if _, err := c.Write([]byte{req[i]}); err != nil {
					break // the router closed it
				}
				select {
				case <-done:
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
			// the router must close (or answer) before the client gives up
			_ = c.SetReadDeadline(time.Now().Add(readHeaderTimeout + 5*time.Second - time.Since(opened)))
			_, err := c.Read(make([]byte, 512))
			if err == nil || !isTimeout(err) {
				closedByRouter.Add(1)
				if time.Since(opened) > readHeaderTimeout+3*time.Second {
					lateClose.Add(1)
				}
			}
		})
	}
	// complete headers, a body that never ends
	for range nBody {
		c, err := net.Dial("tcp", host)
		if err != nil {
			t.Fatalf("slow body dial: %v", err)
		}
		keep(c)
		bodyCount.Add(1)
		opened := time.Now()
		wg.Go(func() {
			hdr := "POST /v1/completions HTTP/1.1\r\nHost: " + host + "\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\":\""
			if _, err := io.WriteString(c, hdr); err != nil {
				return
			}
			go func() { // answered or closed by the router?
				_ = c.SetReadDeadline(time.Now().Add(s.dur + 10*time.Second))
				_, err := c.Read(make([]byte, 512))
				byUs := clientClose.Load() != 0 && time.Now().UnixNano() >= clientClose.Load()
				if !byUs && (err == nil || !isTimeout(err)) {
					if time.Since(opened) < bodyReadTimeout+5*time.Second {
						bodyClosed.Add(1)
					}
				}
			}()
			for {
				if _, err := c.Write([]byte("a")); err != nil {
					return
				}
				select {
				case <-done:
					return
				case <-time.After(500 * time.Millisecond):
				}
			}
		})
	}
	// streaming requests whose responses are never read
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	for range nStuck {
		c, err := d.Dial("tcp", host)
		if err != nil {
			t.Fatalf("stuck reader dial: %v", err)
		}
		keep(c)
		body := `{"model":"sim-model","prompt":"never read me","max_tokens":20000,"stream":true,"ignore_eos":true}`
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", host, len(body), body)
	}
	time.Sleep(time.Second)
	stuckUpstream := f.w[0].Stats(t).Requests.InFlight + f.w[1].Stats(t).Requests.InFlight
	peak := f.r.resources(t)
	t.Logf("with %d header slowloris, %d body slowloris, %d non-readers: router %d goroutines, %d fds; workers have %d in flight",
		nHdr, nBody, nStuck, peak.goroutines, peak.fds, stuckUpstream)

	res := l.wait()
	f.r.alive(t)
	// a fresh request still goes through
	warmUp(t, f.r.Base, 4)
	clientClose.Store(time.Now().UnixNano())
	close(done)
	mu.Lock()
	for _, c := range conns {
		_ = c.Close()
	}
	mu.Unlock()
	wg.Wait()

	c := res.checkEnded(t)
	res.checkServedThroughout(t)
	res.checkSuccessRate(t, "normal clients", time.Time{}, time.Time{}, 1)
	t.Logf("header slowloris closed by the router: %d/%d (%d late); body slowloris closed by the router: %d/%d",
		closedByRouter.Load(), hdrCount.Load(), lateClose.Load(), bodyClosed.Load(), bodyCount.Load())
	if closedByRouter.Load() != hdrCount.Load() || lateClose.Load() != 0 {
		t.Errorf("the router did not close every header slowloris within its %v header timeout", readHeaderTimeout)
	}
	// (TestSlowBodyTimeout checks the body timeout itself.)
	figures(t, fmt.Sprintf("%d header slowloris, %d unfinished bodies, %d non-reading streams", nHdr, nBody, nStuck), c)
	// the non-readers' upstream streams are cancelled once they are gone
	waitFor(t, 10*time.Second, "workers to drop the non-readers' streams", func() bool {
		return f.w[0].Stats(t).Requests.InFlight+f.w[1].Stats(t).Requests.InFlight == 0
	})
	f.r.checkNoLeak(t, 20*time.Second)
}

// TestSlowBodyTimeout: a client that sends its headers and then trickles a
// body that never ends (a byte every 500 ms) gets a 408 once the router's
// body-read timeout has passed (short form: --body-read-timeout-secs 3;
// long form: the 60 s default), and the router then closes the connection.
func TestSlowBodyTimeout(t *testing.T) {
	bodyReadTimeout := 3 * time.Second
	args := []string{"--body-read-timeout-secs", "3"}
	if longForm() {
		bodyReadTimeout, args = 60*time.Second, nil // the default
	}
	f := startRegularFleet(t, 1, args)
	host := strings.TrimPrefix(f.r.Base, "http://")
	c, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	opened := time.Now()
	fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"prompt\":\"", host)
	done := make(chan struct{})
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(done)
	wg.Go(func() {
		for {
			if _, err := c.Write([]byte("a")); err != nil {
				return
			}
			select {
			case <-done:
				return
			case <-time.After(500 * time.Millisecond):
			}
		}
	})
	_ = c.SetReadDeadline(opened.Add(bodyReadTimeout + 10*time.Second))
	br := bufio.NewReader(c)
	res, err := http.ReadResponse(br, nil)
	took := time.Since(opened)
	if err != nil {
		if isTimeout(err) {
			t.Fatalf("no response and connection still open %v after the headers (body timeout %v)", took.Round(time.Second), bodyReadTimeout)
		}
		t.Fatalf("no 408: the connection ended after %v without a response: %v", took.Round(time.Millisecond), err)
	}
	b, err := io.ReadAll(res.Body)
	res.Body.Close()
	t.Logf("after %v: %d %s (%v)", took.Round(time.Millisecond), res.StatusCode, b, err)
	if res.StatusCode != http.StatusRequestTimeout {
		t.Errorf("want a 408 for a body that timed out, got %d %s", res.StatusCode, b)
	}
	if took < bodyReadTimeout || took > bodyReadTimeout+5*time.Second {
		t.Errorf("408 after %v, want just after the %v body timeout", took.Round(time.Millisecond), bodyReadTimeout)
	}
	if !res.Close {
		t.Errorf("the 408 does not close the connection")
	}
	// the router closes the connection (EOF, or a reset if a trickled byte
	// was in flight) rather than waiting for the rest of the body
	if _, err := br.ReadByte(); err == nil || isTimeout(err) {
		t.Errorf("connection still open %v after the 408 (%v)", time.Since(opened).Round(time.Millisecond), err)
	}
	f.r.alive(t)
	warmUp(t, f.r.Base, 2)
}

func isTimeout(err error) bool {
	ne, ok := err.(net.Error)
	return ok && ne.Timeout()
}
