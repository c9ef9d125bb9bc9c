package scenario

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// FaultRow is one injected fault through one router (scenario 5).
type FaultRow struct {
	Fault, Router string
	Sent, OK      int
	// ErrP50 and ErrMax are the times from sending a failed request to the
	// client seeing its error (an error status, an SSE error event, a
	// broken stream or the client's own timeout).
	ErrP50, ErrMax time.Duration
	TimedOut       int // failed requests that got no answer within the client timeout
	// DecodeLeft is the decode worker's waiting_for_remote_kv a few seconds
	// after the last answer: requests the router left waiting for KV.
	DecodeLeft int
	Note       string
}

// faultClientTimeout bounds one request of a fault probe.
const faultClientTimeout = 20 * time.Second

// probeResult is one request of a fault probe.
type probeResult struct {
	ok  bool
	dur time.Duration
	err string
}

// probe sends n streaming 16-token completions to base at once and reads
// each to its end. A request succeeds with a 200, a [DONE] event and no
// error event.
func probe(ctx context.Context, base string, n int) []probeResult {
	client := &http.Client{Timeout: faultClientTimeout}
	defer client.CloseIdleConnections()
	out := make([]probeResult, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { out[i] = probeOne(ctx, client, base, i) })
	}
	wg.Wait()
	return out
}

// probeOne sends the i-th probe request and reads it to its end.
func probeOne(ctx context.Context, client *http.Client, base string, i int) probeResult {
	body := fmt.Sprintf(`{"model":%q,"prompt":"fault probe %d","max_tokens":16,"ignore_eos":true,"stream":true}`, simModel, i)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return probeResult{dur: time.Since(t0), err: err.Error()}
	}
	b, rerr := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	r := probeResult{dur: time.Since(t0)}
	switch {
	case rerr != nil:
		r.err = "body: " + rerr.Error()
	case resp.StatusCode != http.StatusOK:
		r.err = fmt.Sprintf("HTTP %d", resp.StatusCode)
	case bytes.Contains(b, []byte(`"error"`)):
		r.err = "SSE error event"
	case !bytes.Contains(b, []byte("[DONE]")):
		r.err = "stream ended without [DONE]"
	default:
		r.ok = true
	}
	return r
}

// faultRow summarises a probe.
func faultRow(fault, router string, rs []probeResult) FaultRow {
	row := FaultRow{Fault: fault, Router: router, Sent: len(rs)}
	var errs []time.Duration
	for _, r := range rs {
		if r.ok {
			row.OK++
			continue
		}
		errs = append(errs, r.dur)
		if strings.Contains(r.err, "Client.Timeout") || strings.Contains(r.err, "deadline exceeded") {
			row.TimedOut++
		}
	}
	if len(errs) > 0 {
		slices.Sort(errs)
		row.ErrP50, row.ErrMax = errs[len(errs)/2], errs[len(errs)-1]
	}
	return row
}

// setFaults posts a /sim/faults body to a worker.
func setFaults(ctx context.Context, s *sim, body string) error {
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/sim/faults", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Timeout: httpGetTimeout}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("POST /sim/faults %s: HTTP %d %s", body, resp.StatusCode, b)
	}
	return nil
}

// waitingForKV reads a decode worker's waiting_for_remote_kv once it has
// stayed the same for a second (at most within).
func waitingForKV(ctx context.Context, s *sim, within time.Duration) int {
	client := &http.Client{Timeout: httpGetTimeout}
	read := func() int {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+"/sim/stats", nil)
		resp, err := client.Do(req)
		if err != nil {
			return -1
		}
		defer resp.Body.Close()
		var st struct {
			WaitingRemote int `json:"waiting_for_remote_kv"`
		}
		if json.NewDecoder(resp.Body).Decode(&st) != nil {
			return -1
		}
		return st.WaitingRemote
	}
	deadline := time.Now().Add(within)
	last, since := read(), time.Now()
	for time.Now().Before(deadline) && ctx.Err() == nil {
		t := time.NewTimer(200 * time.Millisecond)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
		v := read()
		if v != last {
			last, since = v, time.Now()
		} else if time.Since(since) >= time.Second && v == 0 {
			break
		}
	}
	return last
}

// faultPair is a router with the MoRI-IO WRITE pair registered to it.
type faultPair struct {
	rr              running
	prefill, decode *sim
}

// compareFaults injects the published PR's faults into each router's own
// MoRI-IO WRITE pair, after that section's measurements: a prefill that
// fails (HTTP 500) while its decode already waits for the KV, KV that never
// arrives (no write_done), and the decode killed mid-load (last: it ends
// the pair).
func (e *env) compareFaults(ctx context.Context, rep *CompareReport, pairs []faultPair) {
	type step struct {
		name     string
		inject   string
		clear    string
		n        int
		waitLeft bool
	}
	steps := []step{
		{"prefill fails (HTTP 500), WRITE", `{"fail_next":8}`, `{"fail_next":0}`, 8, true},
		{"KV never arrives (no write_done), WRITE", `{"drop_write_done":true}`, `{"drop_write_done":false}`, 4, true},
	}
	for _, st := range steps {
		for _, p := range pairs {
			if err := setFaults(ctx, p.prefill, st.inject); err != nil {
				rep.Faults = append(rep.Faults, FaultRow{Fault: st.name, Router: p.rr.name, Note: oneLine(err.Error(), 200)})
				continue
			}
			row := faultRow(st.name, p.rr.name, probe(ctx, p.rr.base, st.n))
			_ = setFaults(ctx, p.prefill, st.clear)
			if st.waitLeft {
				row.DecodeLeft = waitingForKV(ctx, p.decode, 5*time.Second)
			}
			e.printf("fault %-40s %-12s ok %d/%d, error after %v (max %v), %d client timeouts, decode left waiting %d\n",
				st.name, p.rr.name, row.OK, row.Sent, row.ErrP50.Round(time.Millisecond), row.ErrMax.Round(time.Millisecond), row.TimedOut, row.DecodeLeft)
			rep.Faults = append(rep.Faults, row)
		}
	}
	for _, p := range pairs {
		rep.Faults = append(rep.Faults, e.killDecode(ctx, killName, p))
	}
}

// Names of the decode-kill faults.
const (
	killName     = "decode killed mid-load"
	killNameNIXL = "decode killed mid-load, NIXL static"
)

// killDecode holds every first token of p's decode 500 ms, sends 32
// streams through the router and SIGKILLs the decode 200 ms later, while
// they are in flight (it ends the pair).
func (e *env) killDecode(ctx context.Context, name string, p faultPair) FaultRow {
	if err := setFaults(ctx, p.decode, `{"stall_first_token_ms":500}`); err != nil {
		return FaultRow{Fault: name, Router: p.rr.name, Note: oneLine(err.Error(), 200)}
	}
	var rs []probeResult
	done := make(chan struct{})
	go func() {
		defer close(done)
		rs = probe(ctx, p.rr.base, 32)
	}()
	t := time.NewTimer(200 * time.Millisecond)
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	t.Stop()
	_ = syscall.Kill(p.decode.Pid(), syscall.SIGKILL)
	<-done
	row := faultRow(name, p.rr.name, rs)
	if p.rr.r.exited() {
		row.Note = "router exited"
	}
	e.printf("fault %-40s %-12s ok %d/%d, error after %v (max %v), %d client timeouts %s\n",
		name, p.rr.name, row.OK, row.Sent, row.ErrP50.Round(time.Millisecond), row.ErrMax.Round(time.Millisecond), row.TimedOut, row.Note)
	return row
}

// compareKillNIXL kills the decode mid-load under the static NIXL setup,
// each router on its own fresh pair (the kill ends it).
func (e *env) compareKillNIXL(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	for _, p := range all {
		if p.name == PeerDirect {
			continue
		}
		if _, err := p.args(fleetURLs{prefill: "http://127.0.0.1:1", decode: "http://127.0.0.1:2"}, 1, 2, ""); errors.Is(err, errUnsupported) {
			continue // its PD section row says why
		}
		if _, err := e.budget(faultClientTimeout+time.Minute, time.Minute); err != nil {
			return err
		}
		sims, err := e.startNIXLPair(ctx, "kill-"+p.name, c.Preset)
		if err != nil {
			e.stopSims(sims)
			return err
		}
		dir := filepath.Join(e.o.LogDir, p.name+"-kill-nixl")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			e.stopSims(sims)
			return err
		}
		r, _, err := e.g.startPeer(ctx, p, fleetURLs{prefill: sims[0].URL(), decode: sims[1].URL()}, dir, nil)
		if err != nil {
			e.stopSims(sims)
			if ctx.Err() != nil {
				return ctx.Err()
			}
			rep.Faults = append(rep.Faults, FaultRow{Fault: killNameNIXL, Router: p.name, Note: "did not run: " + oneLine(err.Error(), 240)})
			continue
		}
		rr := running{peer: p, r: r, base: r.base}
		rep.Faults = append(rep.Faults, e.killDecode(ctx, killNameNIXL, faultPair{rr: rr, prefill: sims[0], decode: sims[1]}))
		e.g.stop(r.proc)
		e.stopSims(sims)
	}
	return nil
}

// faultTable writes the fault rows.
func (r *CompareReport) faultTable(b *strings.Builder) {
	if len(r.Faults) == 0 {
		return
	}
	b.WriteString("## Faults (PD MoRI-IO WRITE, each router's own pair, after its measurements; the NIXL row on a fresh static pair per router)\n\n")
	fmt.Fprintf(b, "Injected with vllm-sim's `POST /sim/faults` on the prefill (or SIGKILL of the decode) while streaming 16-token completions are sent at once; the client gives each request %v. Error after = time from sending a failed request to the client seeing its error; decode left waiting = the decode's `waiting_for_remote_kv` a few seconds after the last answer (requests the router never cancelled; the simulated decode, like vLLM, waits for KV forever).\n\n", faultClientTimeout)
	b.WriteString("| Fault | Router | OK / sent | Error after P50 / max | No answer within the client timeout | Decode left waiting | Note |\n")
	b.WriteString("|---|---|---|---|---|---|---|\n")
	for _, f := range r.Faults {
		errs := "—"
		if f.Sent > f.OK && f.Sent > 0 {
			errs = fmt.Sprintf("%v / %v", f.ErrP50.Round(time.Millisecond), f.ErrMax.Round(time.Millisecond))
		}
		left := "—"
		if !strings.HasPrefix(f.Fault, "decode killed") && f.Sent > 0 {
			left = fmt.Sprint(f.DecodeLeft)
		}
		fmt.Fprintf(b, "| %s | %s | %d / %d | %s | %d | %s | %s |\n", f.Fault, f.Router, f.OK, f.Sent, errs, f.TimedOut, left, f.Note)
	}
	b.WriteString("\n")
}
