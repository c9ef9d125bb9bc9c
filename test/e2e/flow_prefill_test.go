package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The prefill rules end to end (--flow-avoid-prefill --flow-isolate-prefill):
// two vllm-sim workers whose prefill takes 10 ms per prompt token, so a
// 400-token prompt stays in prefill for 4 s and the router's view of it
// (sent, no first byte yet) lasts that long. round_robin picks, so every
// pick the rules change is one the policy alone would have made otherwise.

var prefillSimArgs = []string{"--role", "unified", "--max-num-seqs", "4", "--decode-step-base", "20ms", "--decode-step-per-seq", "0",
	"--prefill-base", "0", "--prefill-per-token", "10ms"}

// prefillStream is one streamed completion: its route receipt once the
// headers arrived, the time of its first body byte, its end.
type prefillStream struct {
	name    string
	receipt chan string    // the X-Switchyard-Route header (or "error: ...")
	headers time.Time      // when the headers arrived (read after receipt)
	first   chan time.Time // closed after the first body byte
	firstAt time.Time
	done    chan error
}

func openPrefillStream(ctx context.Context, t *testing.T, base, name, band string, words int) *prefillStream {
	t.Helper()
	s := &prefillStream{name: name, receipt: make(chan string, 1), first: make(chan time.Time), done: make(chan error, 1)}
	body := fmt.Sprintf(`{"model":"sim-model","prompt":%q,"max_tokens":4,"ignore_eos":true,"stream":true}`, strings.TrimSpace(strings.Repeat("tok ", words)))
	go func() {
		err := func() error {
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
			if err != nil {
				return err
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("x-gateway-inference-objective", band)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				s.receipt <- "error: " + err.Error()
				return err
			}
			defer resp.Body.Close()
			s.headers = time.Now()
			s.receipt <- resp.Header.Get("X-Switchyard-Route")
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(resp.Body)
				return fmt.Errorf("status %d: %s", resp.StatusCode, b)
			}
			br := bufio.NewReader(resp.Body)
			if _, err := br.ReadByte(); err != nil {
				return fmt.Errorf("first byte: %w", err)
			}
			s.firstAt = time.Now()
			close(s.first)
			b, err := io.ReadAll(br)
			if err == nil && !strings.Contains(string(b), "data: [DONE]") {
				err = fmt.Errorf("stream without [DONE]: %q", b)
			}
			return err
		}()
		s.done <- err
	}()
	return s
}

// worker waits (≤ 20 s) for the receipt and returns the worker it names.
func (s *prefillStream) worker(t *testing.T) string {
	t.Helper()
	select {
	case rc := <-s.receipt:
		for _, kv := range strings.Split(rc, ";") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(kv), "worker="); ok {
				return v
			}
		}
		t.Fatalf("%s: no worker in receipt %q", s.name, rc)
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: no response headers within 20 s", s.name)
	}
	return ""
}

func (s *prefillStream) streamed() bool {
	select {
	case <-s.first:
		return true
	default:
		return false
	}
}

func (s *prefillStream) waitFirst(t *testing.T) {
	t.Helper()
	select {
	case <-s.first:
	case err := <-s.done:
		t.Fatalf("%s ended before its first byte: %v", s.name, err)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: no first byte within 30 s", s.name)
	}
}

func (s *prefillStream) wait(t *testing.T) {
	t.Helper()
	select {
	case err := <-s.done:
		if err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("%s did not end within 60 s", s.name)
	}
}

// startPrefillFleet starts two slow-prefill sims and a round_robin router
// with flow control and flags in front of them.
func startPrefillFleet(t *testing.T, flags ...string) (*router, context.Context) {
	t.Helper()
	a, b := startSim(t, prefillSimArgs...), startSim(t, prefillSimArgs...)
	args := append([]string{"--worker-urls", a.URL(), b.URL(), "--policy", "round_robin", "--route-receipt", "--flow-control",
		"--flow-worker-max-inflight", "4", "--queue-size", "16"}, flags...)
	r := startRouter(t, args...)
	r.WaitReady(t, 10*time.Second)
	return r, ctxT(t, 120*time.Second)
}

func TestFlowPrefillRules(t *testing.T) {
	r, ctx := startPrefillFleet(t, "--flow-avoid-prefill", "--flow-isolate-prefill")
	const long, short = 400, 1

	// A long low prompt on one worker (X), a short one on the other (Y)
	// that streams at once. round_robin's next turn is X's.
	l1 := openPrefillStream(ctx, t, r.Base, "l1", "low", long)
	x := l1.worker(t)
	l2 := openPrefillStream(ctx, t, r.Base, "l2", "low", short)
	y := l2.worker(t)
	if x == y {
		t.Fatalf("round_robin sent l1 and l2 both to %s", x)
	}
	l2.waitFirst(t)
	// --flow-avoid-prefill: the high request goes to Y, where nothing is in
	// prefill, though it is X's turn.
	h1 := openPrefillStream(ctx, t, r.Base, "h1", "high", long)
	if w := h1.worker(t); w != y || l1.streamed() {
		t.Fatalf("h1 went to %s (want %s, the worker without a prompt in prefill; l1 streamed already: %v)", w, y, l1.streamed())
	}
	// --flow-isolate-prefill: a low request stays off Y while h1 awaits
	// its first byte there.
	l3 := openPrefillStream(ctx, t, r.Base, "l3", "low", short)
	if w := l3.worker(t); w != x || h1.streamed() {
		t.Fatalf("l3 went to %s (want %s: %s prefills a high request; h1 streamed already: %v)", w, x, y, h1.streamed())
	}
	for _, s := range []*prefillStream{l1, l2, h1, l3} {
		s.wait(t)
	}

	// Two high prompts: one per worker (the second avoids the first's
	// prefill); a low request then waits in the router until one of them
	// streams, as both workers prefill a high request.
	ha := openPrefillStream(ctx, t, r.Base, "ha", "high", long)
	wa := ha.worker(t)
	hb := openPrefillStream(ctx, t, r.Base, "hb", "high", long)
	if wb := hb.worker(t); wb == wa {
		t.Fatalf("ha and hb both went to %s", wa)
	}
	l4 := openPrefillStream(ctx, t, r.Base, "l4", "low", short)
	waitQueued(t, r, 1) // without the rule it would go at once (a slot is free on both)
	l4.worker(t)        // and it goes once one of them streams
	for _, s := range []*prefillStream{ha, hb, l4} {
		s.wait(t)
	}
	if v := routerGauge(t, r, "vllm_router_queue_depth "); v != 0 {
		t.Fatalf("queue depth %v at the end", v)
	}
}

// TestFlowPrefillReserve: with --flow-prefill-reserve 1 and two workers, a
// low request joins the worker already prefilling another rather than
// start a prefill on the last free one (round_robin alone would take the
// free one).
func TestFlowPrefillReserve(t *testing.T) {
	r, ctx := startPrefillFleet(t, "--flow-prefill-reserve", "1")

	l1 := openPrefillStream(ctx, t, r.Base, "l1", "low", 400)
	x := l1.worker(t)
	l2 := openPrefillStream(ctx, t, r.Base, "l2", "low", 1)
	if w := l2.worker(t); w != x || l1.streamed() {
		t.Fatalf("l2 went to %s (want %s, which is prefilling l1; l1 streamed already: %v)", w, x, l1.streamed())
	}
	for _, s := range []*prefillStream{l1, l2} {
		s.wait(t)
	}
}
