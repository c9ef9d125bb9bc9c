package chaos

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"
)

// TestAdmissionBurstPriorities is TestAdmissionBurst with flow control and
// two bands: a closed loop of 16 high-band clients and the rest of the
// load in the low band, plus bursts of 512 low requests, over 64 slots and
// a queue of 32. The high band is never refused: it holds at most 16 places
// of the queue, so whenever the queue is full a low request is queued to be
// shed for it, and its 20 s band timeout is far beyond its wait. The low
// band absorbs the excess (429 and 408, each with a JSON error body).
// Properties only, no timings.
func TestAdmissionBurstPriorities(t *testing.T) {
	s := scaleFor()
	const maxConc, queue, highClients = 64, 32, 16
	f := startRegularFleet(t, 1, []string{"--max-concurrent-requests", fmt.Sprint(maxConc), "--queue-size", fmt.Sprint(queue),
		"--flow-control", "--flow-bands", "high=10:20", "low=-10:1", "--flow-default-band", "low"})
	f.r.markBaseline(t)
	g := startBandLoad(f.r.Base, s.deadline, s.dur, map[string]int{"high": highClients, "low": s.conc - highClients})

	bursts := 1
	time.Sleep(s.at(0.4))
	g.burst("low", 512)
	if s.long {
		for range 4 {
			time.Sleep(s.at(0.1))
			g.burst("low", 512)
			bursts++
		}
	}
	res := g.wait()
	f.r.alive(t)

	hi, lo := res["high"].checkEnded(t), res["low"].checkEnded(t)
	t.Logf("high: %s", hi)
	t.Logf("low: %s", lo)
	if hi.sent == 0 || hi.ok != hi.sent {
		t.Errorf("high band: %d of %d requests completed, want all (%s; e.g. %v)", hi.ok, hi.sent, hi, res["high"].samples(kindHTTPErr, 3))
	}
	for st, n := range lo.status {
		if st != 200 && st != 429 && st != 408 {
			t.Errorf("%d low requests got status %d; admission must answer 429 or 408", n, st)
		}
	}
	if lo.status[429] == 0 {
		t.Errorf("no low request got 429 under a load of %d + %d bursts of 512 over %d slots + queue %d", s.conc, bursts, maxConc, queue)
	}
	if lo.ok == 0 {
		t.Error("no low request completed: the low band was starved, not just shed")
	}
	if hi.sseErr+lo.sseErr != 0 {
		t.Errorf("%d admitted streams ended with an error event", hi.sseErr+lo.sseErr)
	}
	peak := f.w[0].Stats(t).Requests.PeakInFlight
	t.Logf("peak upstream in-flight %d (limit %d)", peak, maxConc)
	if peak > maxConc {
		t.Errorf("the worker saw %d requests at once, over --max-concurrent-requests %d", peak, maxConc)
	}
	all := counts{sent: lo.sent + hi.sent, ok: lo.ok + hi.ok, httpErr: lo.httpErr + hi.httpErr, sseErr: lo.sseErr + hi.sseErr,
		hung: lo.hung + hi.hung, lost: lo.lost + hi.lost, status: map[int]int{}}
	for _, c := range []counts{hi, lo} {
		for st, n := range c.status {
			all.status[st] += n
		}
	}
	figures(t, fmt.Sprintf("flow control, %d high + %d low clients + %d bursts of 512 low over a limit of %d, queue %d", highClients, s.conc-highClients, bursts, maxConc, queue), all)
	f.r.checkNoLeak(t, 15*time.Second)
}

// bandLoad is a closed-loop load whose clients each belong to a band
// (x-gateway-inference-objective), with extra bursts; every request is a
// streaming completion.
type bandLoad struct {
	base     string
	deadline time.Duration
	client   *http.Client
	tr       *http.Transport
	start    time.Time
	end      time.Time
	wg       sync.WaitGroup

	mu  sync.Mutex
	seq int
	out map[string][]outcome
}

func startBandLoad(base string, deadline, dur time.Duration, clients map[string]int) *bandLoad {
	n := 0
	for _, c := range clients {
		n += c
	}
	tr := newClientTransport(n)
	g := &bandLoad{base: base, deadline: deadline, tr: tr, client: &http.Client{Transport: tr}, start: time.Now(), out: map[string][]outcome{}}
	g.end = g.start.Add(dur)
	for band, c := range clients {
		g.out[band] = nil
		for range c {
			g.wg.Go(func() {
				for time.Now().Before(g.end) {
					g.one(band)
				}
			})
		}
	}
	return g
}

func (g *bandLoad) burst(band string, n int) {
	for range n {
		g.wg.Go(func() { g.one(band) })
	}
}

func (g *bandLoad) one(band string) {
	g.mu.Lock()
	g.seq++
	i := g.seq
	g.mu.Unlock()
	body := fmt.Sprintf(`{"model":"sim-model","prompt":"chaos %d %s","max_tokens":48,"ignore_eos":true,"stream":true}`, i, promptWords)
	o := outcome{start: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), g.deadline)
	defer cancel()
	o.kind, o.status, o.detail = g.do(ctx, band, body)
	o.end = time.Now()
	g.mu.Lock()
	g.out[band] = append(g.out[band], o)
	g.mu.Unlock()
	if o.kind != kindOK {
		time.Sleep(errPause)
	}
}

func (g *bandLoad) do(ctx context.Context, band, body string) (kind, int, string) {
	b, k, st, detail, ok := post(ctx, g.client, g.base+"/v1/completions", body, "x-gateway-inference-objective", band)
	if !ok {
		return k, st, detail
	}
	return classifySSE(b)
}

// wait waits for every request and returns each band's outcomes.
func (g *bandLoad) wait() map[string]*loadResult {
	g.wg.Wait()
	g.tr.CloseIdleConnections()
	g.mu.Lock()
	defer g.mu.Unlock()
	res := map[string]*loadResult{}
	for band, out := range g.out {
		res[band] = &loadResult{start: g.start, end: g.end, out: out}
	}
	return res
}
