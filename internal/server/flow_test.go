package server

import (
	"bytes"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/admission"
	"github.com/switchyard-llm/switchyard/internal/proxy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// flowEnv is a server with flow control, one slot, and a dispatcher that
// records the order of dispatch and holds each request until released.
type flowEnv struct {
	*env
	mu     sync.Mutex
	order  []string
	bodies map[string][]byte
	next   chan struct{}
}

func newFlowEnv(t *testing.T, queue int, mod func(*admission.FlowConfig)) *flowEnv {
	t.Helper()
	bands, err := admission.ParseBands([]string{"high=10", "default=0", "low=-10"}, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	fc := &admission.FlowConfig{Bands: bands}
	if mod != nil {
		mod(fc)
	}
	fe := &flowEnv{next: make(chan struct{}), bodies: map[string][]byte{}}
	fe.env = newEnv(t, func(o *Options) { o.MaxConcurrent, o.QueueSize, o.Flow = 1, queue, fc })
	fe.gen.fn = func(w http.ResponseWriter, r *http.Request, c *proxy.Call) {
		name := r.Header.Get("X-Test-Name")
		fe.mu.Lock()
		fe.order = append(fe.order, name)
		fe.bodies[name] = c.Body
		fe.mu.Unlock()
		select {
		case <-fe.next:
		case <-r.Context().Done():
		}
		writeJSON(w, 200, map[string]any{"name": name})
	}
	return fe
}

func (fe *flowEnv) dispatched() []string {
	fe.mu.Lock()
	defer fe.mu.Unlock()
	return slices.Clone(fe.order)
}

// send starts one request in the background; its response arrives on the
// returned channel.
func (fe *flowEnv) send(name, body string, hdr ...string) <-chan resp {
	ch := make(chan resp, 1)
	go func() {
		req, err := http.NewRequestWithContext(fe.t.Context(), http.MethodPost, fe.srv.URL+"/v1/completions", strings.NewReader(body))
		if err != nil {
			ch <- resp{status: -1}
			return
		}
		req.Header.Set("X-Test-Name", name)
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		res, err := fe.srv.Client().Do(req)
		if err != nil {
			ch <- resp{status: -1, body: []byte(err.Error())}
			return
		}
		defer res.Body.Close()
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(res.Body)
		ch <- resp{status: res.StatusCode, header: res.Header, body: buf.Bytes()}
	}()
	return ch
}

func recv(t *testing.T, ch <-chan resp) resp {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(20 * time.Second):
		t.Fatal("no response in 20 s")
	}
	return resp{}
}

func TestFlowControlHTTP(t *testing.T) {
	fe := newFlowEnv(t, 3, nil)
	l := fe.s.Limiter()
	hold := fe.send("hold", `{"model":"m","prompt":"x"}`)
	waitUntil(t, "hold dispatched", func() bool { return len(fe.dispatched()) == 1 })

	// a deadline shorter than the wait: 504 with a JSON body
	r := recv(t, fe.send("late", `{"model":"m","prompt":"x"}`, admission.DefaultDeadlineHeader, "50"))
	if r.status != http.StatusGatewayTimeout || !strings.Contains(r.errMsg(t), "deadline") {
		t.Fatalf("deadline: %d %s", r.status, r.body)
	}
	// an unknown objective: 400 naming it
	r = recv(t, fe.send("bad", `{"model":"m","prompt":"x"}`, admission.DefaultObjectiveHeader, "platinum"))
	if r.status != http.StatusBadRequest || !strings.Contains(r.errMsg(t), `"platinum"`) {
		t.Fatalf("bad objective: %d %s", r.status, r.body)
	}

	lowBody := `{"model":"m","prompt":"x", "priority": 10 }`
	low := fe.send("low", lowBody)
	waitUntil(t, "low queued", func() bool { return l.Queued() == 1 })
	def := fe.send("default", `{"model":"m","prompt":"x"}`)
	waitUntil(t, "default queued", func() bool { return l.Queued() == 2 })
	high := fe.send("high", `{"model":"m","prompt":"x"}`, admission.DefaultObjectiveHeader, "high")
	waitUntil(t, "high queued", func() bool { return l.Queued() == 3 })
	// queue full: a high newcomer (vLLM priority -10) sheds the low one
	high2 := fe.send("high2", `{"model":"m","prompt":"x","priority":-10}`)
	r = recv(t, low)
	if r.status != http.StatusTooManyRequests || r.header.Get("Retry-After") == "" || !strings.Contains(r.errMsg(t), "higher-priority") {
		t.Fatalf("shed: %d %v %s", r.status, r.header, r.body)
	}
	waitUntil(t, "high2 queued", func() bool { return l.Queued() == 3 })
	// a default newcomer finds the queue full of its own band and above
	r = recv(t, fe.send("refused", `{"model":"m","prompt":"x"}`))
	if r.status != http.StatusTooManyRequests || !strings.Contains(r.errMsg(t), "queue is full") {
		t.Fatalf("queue full: %d %s", r.status, r.body)
	}
	if got := l.FlowQueued(); got["high"] != 2 || got["default"] != 1 || got["low"] != 0 {
		t.Fatalf("band queues %v", got)
	}

	for range 4 {
		fe.next <- struct{}{}
	}
	for _, ch := range []<-chan resp{hold, def, high, high2} {
		if r := recv(t, ch); r.status != 200 {
			t.Fatalf("served: %d %s", r.status, r.body)
		}
	}
	if got, want := fe.dispatched(), []string{"hold", "high", "high2", "default"}; !slices.Equal(got, want) {
		t.Fatalf("dispatch order %v, want %v", got, want)
	}
	if v := value(fe.m.FlowShed.WithLabelValues("low", "shed")); v != 1 {
		t.Fatalf("shed counter %v", v)
	}
	if v := value(fe.m.FlowShed.WithLabelValues("default", "deadline")); v != 1 {
		t.Fatalf("deadline counter %v", v)
	}
	if v := histCount(fe.m.FlowQueueWait.WithLabelValues("high")); v != 2 {
		t.Fatalf("high wait samples %v", v)
	}
}

// TestFlowControlBodyForwarded: the priority field, and every other byte,
// reaches the dispatcher as the client sent it.
func TestFlowControlBodyForwarded(t *testing.T) {
	fe := newFlowEnv(t, 3, nil)
	body := `{"model":"m",  "priority":-10,"prompt":"x","user":"u1"}`
	ch := fe.send("one", body)
	waitUntil(t, "dispatched", func() bool { return len(fe.dispatched()) == 1 })
	fe.next <- struct{}{}
	if r := recv(t, ch); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	fe.mu.Lock()
	got := string(fe.bodies["one"])
	fe.mu.Unlock()
	if got != body {
		t.Fatalf("body forwarded as %q, want %q", got, body)
	}
}

// TestFlowControlSaturationHolds: with a per-worker in-flight limit the
// request waits in the router while the worker is at its limit, and
// /workers shows the saturation inputs.
func TestFlowControlSaturationHolds(t *testing.T) {
	fe := newFlowEnv(t, 3, func(fc *admission.FlowConfig) {
		fc.Saturation = &admission.SaturationConfig{MaxInFlight: 1, PollInterval: 20 * time.Millisecond}
	})
	w := fe.add("http://127.0.0.1:9", worker.RoleRegular, -1, 1)
	_, stop := serve(t, fe.s) // Serve runs the detector
	defer stop()
	busy := w.Acquire() // the worker is at its limit: hold, though a slot is free
	ch := fe.send("held", `{"model":"m","prompt":"x"}`)
	waitUntil(t, "held in the router queue", func() bool { return fe.s.Limiter().Queued() == 1 })
	r := fe.do(http.MethodGet, "/workers", "")
	if r.status != 200 || !strings.Contains(string(r.body), `"saturation":{"saturated":true,"in_flight":1,"max_in_flight":1}`) {
		t.Fatalf("/workers: %s", r.body)
	}
	if len(fe.dispatched()) != 0 {
		t.Fatal("dispatched while the only worker was saturated")
	}
	busy() // no release event reaches the scheduler: the detector's tick does
	waitUntil(t, "dispatched after the worker freed up", func() bool { return len(fe.dispatched()) == 1 })
	fe.next <- struct{}{}
	if r := recv(t, ch); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
}

// waitUntil polls cond for up to 15 s (the machine may be loaded).
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
