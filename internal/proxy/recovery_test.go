package proxy

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/internal/openai"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// A worker with one unconfirmed connect failure is avoided while another
// is available, and used again when it is the only one.
func TestSuspectAvoidedWhileOthersExist(t *testing.T) {
	a := newFakeWorker(t, nil)
	a.set(a.recordingOK("a"))
	b := newFakeWorker(t, nil)
	b.set(b.recordingOK("b"))
	f := newFixture(t, []string{a.srv.URL, b.srv.URL}, RegularOptions{Policy: orderPolicy{[]string{a.srv.URL}}})
	wa := f.reg.Get(a.srv.URL)
	f.reg.ConnectFailed(wa, time.Now())
	for range 3 {
		if code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`); code != 200 || body != `{"worker":"b"}` {
			t.Fatalf("got %d %s, want the non-suspect worker b", code, body)
		}
	}
	f.reg.Get(b.srv.URL).SetHealthy(false)
	if code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`); code != 200 || body != `{"worker":"a"}` {
		t.Fatalf("got %d %s, want the suspect when nothing else is available", code, body)
	}
	if !wa.Healthy() {
		t.Error("a suspect that answered must stay healthy")
	}
}

// Panic routing: every worker unhealthy or open-circuit, the registered
// ones are used anyway (with a metric); without it the answer is 503.
func TestPanicRouting(t *testing.T) {
	tests := []struct {
		name       string
		disabled   bool
		breakers   bool // open the breakers instead of marking unhealthy
		wantStatus int
	}{
		{name: "all unhealthy", wantStatus: 200},
		{name: "all open-circuit", breakers: true, wantStatus: 200},
		{name: "disabled", disabled: true, wantStatus: http.StatusServiceUnavailable},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := newFakeWorker(t, nil)
			a.set(a.recordingOK("a"))
			b := newFakeWorker(t, nil)
			b.set(b.recordingOK("b"))
			pn := &worker.Panic{Disabled: tt.disabled}
			bc := worker.BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, OpenDuration: time.Hour, HalfOpenMax: 1}
			f := newFixtureWith(t, []string{a.srv.URL, b.srv.URL}, RegularOptions{Panic: pn}, bc)
			pn.OnPick = func(r worker.Role) { f.m.PanicRouted.WithLabelValues(r.String()).Inc() }
			for _, w := range f.reg.Snapshot().All {
				if tt.breakers {
					w.Breaker().Record(false)
				} else {
					w.SetHealthy(false)
				}
				if w.Available() {
					t.Fatalf("%s still available", w.Key())
				}
			}
			code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
			if code != tt.wantStatus {
				t.Fatalf("got %d %s, want %d", code, body, tt.wantStatus)
			}
			want := 1.0
			if tt.disabled {
				want = 0
			}
			if v := counterValue(t, f.m.PanicRouted.WithLabelValues("regular")); v != want {
				t.Errorf("panic metric %v, want %v", v, want)
			}
		})
	}
}

// A truly dead fleet in panic mode: every registered worker is tried once
// (connection refused), then the client gets a clear 502 at once, not a
// hang; the second round confirms them down.
func TestPanicRoutingDeadFleetFailsFast(t *testing.T) {
	dead1, dead2 := deadURL(t), deadURL(t)
	f := newFixture(t, []string{dead1, dead2}, RegularOptions{Panic: &worker.Panic{},
		Retry: RetryConfig{MaxAttempts: 5, InitialBackoff: time.Millisecond}})
	for _, w := range f.reg.Snapshot().All {
		w.SetHealthy(false)
	}
	start := time.Now()
	code, _, body := f.post(testCtx(t), "/v1/completions", `{"prompt":"p"}`)
	if el := time.Since(start); el > 5*time.Second {
		t.Errorf("a dead fleet took %v to answer", el)
	}
	var e openai.ErrorBody
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("body %q: %v", body, err)
	}
	if code != http.StatusBadGateway || !strings.HasPrefix(e.Error.Message, "upstream connect failed: ") {
		t.Fatalf("got %d %q", code, e.Error.Message)
	}
	if rc := f.lastReceipt(); rc.Attempts != 2 {
		t.Errorf("attempts %d, want one per registered worker", rc.Attempts)
	}
}
