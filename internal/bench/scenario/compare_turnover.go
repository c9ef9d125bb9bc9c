package scenario

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// TurnoverRow is one router through a MoRI-IO READ→WRITE fleet turnover
// without a restart (scenario 5): the router learns a READ pair over ZMQ
// discovery, a WRITE pair registers on the same address mid-load, and the
// READ pair goes away.
type TurnoverRow struct {
	Variant, Router string
	Sent, OK        int
	// FailedBefore are the failures that ended before the READ pair went
	// away (the WRITE pair's registrations must not disturb READ traffic);
	// requests in flight at the cut count as after it.
	FailedBefore int
	// FailedAfter are the failures from then to the end of the load.
	FailedAfter int
	// Outage is from the first failure after the READ pair went away to
	// the end of the last failed request (0 when none failed).
	Outage time.Duration
	// TailSent and TailOK are the requests of the load's last
	// turnoverTail: served there means the WRITE pair took over.
	TailSent, TailOK int
	// ByWrite is the requests the WRITE pair's decode served (its
	// decode_leg count at the end of the load).
	ByWrite int
	// Errors counts the failures by their first error.
	Errors string
	Note   string
}

// Recovered reports whether the WRITE pair took over: every request of
// the last turnoverTail succeeded and the WRITE decode served at least as
// many.
func (r TurnoverRow) Recovered() bool {
	return r.TailSent > 0 && r.TailOK == r.TailSent && r.ByWrite >= r.TailSent
}

// Turnover timing: the READ pair serves alone for turnoverLead, the WRITE
// pair registers and gets turnoverRegister to be heard, then the READ pair
// goes away and the load runs turnoverAfter more. turnoverAfter outlasts
// the longer discovery TTL (switchyard's 9 s; vllm-router's is 5 s) by
// more than turnoverTail.
const (
	turnoverLead     = 2 * time.Second
	turnoverRegister = 3 * time.Second
	turnoverAfter    = 18 * time.Second
	turnoverTail     = 4 * time.Second
	turnoverClients  = 8
	turnoverPeriod   = 100 * time.Millisecond
)

// Turnover variants.
const (
	// turnoverStop stops the READ pair (SIGTERM) once the WRITE pair is
	// registered: the procedure internal/discovery/zmq documents.
	turnoverStop = "READ pair stopped after the WRITE pair registered"
	// turnoverDrain turns the READ pair's heartbeats off (it keeps serving)
	// and stops it only after the load.
	turnoverDrain = "READ pair stops registering (still serving), stopped after the load"
)

// timedResult is one request of a paced load.
type timedResult struct {
	probeResult
	start time.Time
}

// pacedLoad runs clients loops, each sending one streaming 16-token
// completion at most every period, until stop is closed; it returns every
// request's result once the last in-flight one has ended.
func pacedLoad(ctx context.Context, base string, clients int, period time.Duration, stop <-chan struct{}) []timedResult {
	client := &http.Client{Timeout: faultClientTimeout}
	defer client.CloseIdleConnections()
	var (
		mu  sync.Mutex
		out []timedResult
		wg  sync.WaitGroup
	)
	for c := range clients {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				case <-ctx.Done():
					return
				default:
				}
				t0 := time.Now()
				r := probeOne(ctx, client, base, c*1_000_000+i)
				mu.Lock()
				out = append(out, timedResult{probeResult: r, start: t0})
				mu.Unlock()
				t := time.NewTimer(time.Until(t0.Add(period)))
				select {
				case <-t.C:
				case <-stop:
				case <-ctx.Done():
				}
				t.Stop()
			}
		})
	}
	wg.Wait()
	return out
}

// turnoverRow summarises a paced load around a turnover at cut; the tail
// is every request started at or after tail.
func turnoverRow(variant, router string, rs []timedResult, cut, tail time.Time) TurnoverRow {
	row := TurnoverRow{Variant: variant, Router: router, Sent: len(rs)}
	var firstFail, lastFailEnd time.Time
	errs := map[string]int{}
	for _, r := range rs {
		inTail := !r.start.Before(tail)
		if inTail {
			row.TailSent++
		}
		if r.ok {
			row.OK++
			if inTail {
				row.TailOK++
			}
			continue
		}
		errs[errClass(r.err)]++
		if r.start.Add(r.dur).Before(cut) { // in flight at the cut: after
			row.FailedBefore++
			continue
		}
		row.FailedAfter++
		if firstFail.IsZero() || r.start.Before(firstFail) {
			firstFail = r.start
		}
		if end := r.start.Add(r.dur); end.After(lastFailEnd) {
			lastFailEnd = end
		}
	}
	if !firstFail.IsZero() {
		row.Outage = lastFailEnd.Sub(firstFail)
	}
	row.Errors = countList(errs)
	return row
}

// errClass shortens a probe error to its kind (connection errors carry
// ports that differ per request).
func errClass(e string) string {
	switch {
	case strings.Contains(e, "Client.Timeout"), strings.Contains(e, "deadline exceeded"):
		return "client timeout"
	case strings.Contains(e, "connection refused"):
		return "connection refused"
	case strings.Contains(e, "connection reset"), strings.Contains(e, "EOF"):
		return "connection closed"
	}
	return oneLine(e, 60)
}

// countList renders counts as "a ×3, b ×1", largest first.
func countList(m map[string]int) string {
	type kv struct {
		k string
		n int
	}
	var l []kv
	for k, n := range m {
		l = append(l, kv{k, n})
	}
	for i := range l { // a handful of entries
		for j := i + 1; j < len(l); j++ {
			if l[j].n > l[i].n || (l[j].n == l[i].n && l[j].k < l[i].k) {
				l[i], l[j] = l[j], l[i]
			}
		}
	}
	var parts []string
	for _, x := range l {
		parts = append(parts, fmt.Sprintf("%s ×%d", x.k, x.n))
	}
	return strings.Join(parts, ", ")
}

// compareTurnover runs both turnover variants through every router that
// speaks MoRI-IO ZMQ discovery, one router at a time, each on its own
// pairs (workers register with one router only).
func (e *env) compareTurnover(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	simArgs := func(role, mode, addr string) []string {
		return []string{"--role", role, "--kv-connector", "moriio", "--transfer-mode", mode, "--proxy-address", addr,
			"--profile-preset", c.Preset, "--heartbeat-interval", "1s"}
	}
	rep.Commands = append(rep.Commands,
		"vllm-sim "+strings.Join(simArgs("prefill|decode", "READ|WRITE", "ROUTER_ZMQ"), " ")+" (turnover: a READ pair, then a WRITE pair, per router)")
	for _, variant := range []string{turnoverStop, turnoverDrain} {
		for _, p := range all {
			if p.name == PeerDirect {
				continue
			}
			if _, err := p.args(fleetURLs{discovery: "127.0.0.1:1", policy: c.MoRIPolicy}, 1, 2, ""); errors.Is(err, errUnsupported) {
				rep.Turnover = append(rep.Turnover, TurnoverRow{Variant: variant, Router: p.name, Note: err.Error()})
				continue
			}
			if _, err := e.budget(turnoverLead+turnoverRegister+turnoverAfter+faultClientTimeout+time.Minute, time.Minute); err != nil {
				return err
			}
			row, err := e.turnoverOne(ctx, c, p, variant, simArgs)
			if err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				row = TurnoverRow{Variant: variant, Router: p.name, Note: "did not run: " + oneLine(err.Error(), 240)}
			}
			e.printf("turnover %-8s %-12s ok %d/%d, failed before %d after %d, outage %v, last %v %d/%d ok %s %s\n",
				map[string]string{turnoverStop: "stop", turnoverDrain: "drain"}[variant], p.name, row.OK, row.Sent,
				row.FailedBefore, row.FailedAfter, row.Outage.Round(time.Millisecond), turnoverTail, row.TailOK, row.TailSent, row.Errors, row.Note)
			rep.Turnover = append(rep.Turnover, row)
		}
	}
	return nil
}

// turnoverOne is one router through one turnover variant.
func (e *env) turnoverOne(ctx context.Context, c CompareConfig, p peer, variant string, simArgs func(role, mode, addr string) []string) (TurnoverRow, error) {
	var workers []*proc
	defer func() { e.g.stop(workers...) }()
	startPair := func(mode, addr string) ([]*sim, error) {
		var pair []*sim
		for _, role := range []string{"prefill", "decode"} {
			s, err := e.g.startSim(ctx, fmt.Sprintf("sim-%s-%s-turnover-%s", role, strings.ToLower(mode), p.name), simArgs(role, mode, addr)...)
			if err != nil {
				return pair, err
			}
			workers = append(workers, s.proc)
			pair = append(pair, s)
		}
		return pair, nil
	}
	dir := filepath.Join(e.o.LogDir, p.name+"-turnover")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return TurnoverRow{}, err
	}
	var readPair []*sim
	r, _, err := e.g.startPeer(ctx, p, fleetURLs{discovery: "zmq", policy: c.MoRIPolicy}, dir, func(addr string) error {
		var err error
		readPair, err = startPair("READ", addr)
		return err
	})
	if err != nil {
		return TurnoverRow{}, err
	}
	defer e.g.stop(r.proc)

	stop := make(chan struct{})
	var rs []timedResult
	done := make(chan struct{})
	go func() {
		defer close(done)
		rs = pacedLoad(ctx, r.base, turnoverClients, turnoverPeriod, stop)
	}()
	finish := func() { close(stop); <-done }
	if !sleepCtx(ctx, turnoverLead) {
		finish()
		return TurnoverRow{}, ctx.Err()
	}
	writePair, err := startPair("WRITE", r.discovery)
	if err != nil {
		finish()
		return TurnoverRow{}, err
	}
	sleepCtx(ctx, turnoverRegister)
	cut := time.Now()
	var stopErr error
	switch variant {
	case turnoverStop:
		e.g.stop(readPair[0].proc, readPair[1].proc)
	case turnoverDrain:
		for _, s := range readPair {
			if err := setFaults(ctx, s, `{"heartbeat":false}`); err != nil && stopErr == nil {
				stopErr = err
			}
		}
	}
	end := cut.Add(turnoverAfter)
	sleepCtx(ctx, time.Until(end))
	finish()
	row := turnoverRow(variant, p.name, rs, cut, end.Add(-turnoverTail))
	row.ByWrite = decodeLegs(ctx, writePair[1])
	if stopErr != nil {
		row.Note = oneLine(stopErr.Error(), 200)
	}
	if r.exited() {
		row.Note = strings.TrimSpace(row.Note + " router exited")
	} else if n := logMentions(r.proc, "mismatch"); n > 0 {
		row.Note = strings.TrimSpace(fmt.Sprintf("%s router log: %d transfer-mode mismatch line(s)", row.Note, n))
	}
	return row, ctx.Err()
}

// decodeLegs is a decode worker's served decode legs (-1 when unknown).
func decodeLegs(ctx context.Context, s *sim) int {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL()+"/sim/stats", nil)
	resp, err := (&http.Client{Timeout: httpGetTimeout}).Do(req)
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	var st struct {
		Requests struct {
			DecodeLeg int `json:"decode_leg"`
		} `json:"requests"`
	}
	if json.NewDecoder(resp.Body).Decode(&st) != nil {
		return -1
	}
	return st.Requests.DecodeLeg
}

// logMentions counts the lines of p's log that contain s.
func logMentions(p *proc, s string) int {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return 0
	}
	n := 0
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, s) {
			n++
		}
	}
	return n
}

// sleepCtx waits d or until ctx ends; it reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// turnoverTable writes the turnover rows.
func (r *CompareReport) turnoverTable(b *strings.Builder) {
	if len(r.Turnover) == 0 {
		return
	}
	b.WriteString("## Fault: MoRI-IO READ→WRITE fleet turnover without a router restart\n\n")
	fmt.Fprintf(b, "Each router is started once (the same command line as in the MoRI-IO sections) and learns a READ prefill/decode pair over ZMQ discovery (heartbeat 1 s). %d clients each send a streaming 16-token completion at most every %v (client timeout %v). After %v a WRITE pair registers on the same address; %v later the READ pair goes away (the variant says how) and the load runs %v more, past both routers' discovery TTL (switchyard 9 s, vllm-router 5 s). Failed before = failed requests that ended while READ served and WRITE was registering (those in flight at the cut count as after); outage = first failure after the cut to the end of the last failed request; last %v = the requests started in the load's last %v; served by the WRITE pair = the WRITE decode's decode legs at the end (the WRITE pair took over when it served the whole tail; a router that keeps the READ pair serves the tail without it).\n\n",
		turnoverClients, turnoverPeriod, faultClientTimeout, turnoverLead, turnoverRegister, turnoverAfter, turnoverTail, turnoverTail)
	fmt.Fprintf(b, "| Variant | Router | OK / sent | Failed before | Failed after | Outage | Last %v OK / sent | Served by the WRITE pair | Errors | Note |\n", turnoverTail)
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, t := range r.Turnover {
		if t.Sent == 0 {
			fmt.Fprintf(b, "| %s | %s | — | — | — | — | — | — | — | %s |\n", t.Variant, t.Router, t.Note)
			continue
		}
		outage := "0"
		if t.FailedAfter > 0 {
			outage = t.Outage.Round(10 * time.Millisecond).String()
			if !t.Recovered() {
				outage = "not recovered"
			}
		}
		fmt.Fprintf(b, "| %s | %s | %d / %d | %d | %d | %s | %d / %d | %d | %s | %s |\n",
			t.Variant, t.Router, t.OK, t.Sent, t.FailedBefore, t.FailedAfter, outage, t.TailOK, t.TailSent, t.ByWrite, t.Errors, t.Note)
	}
	b.WriteString("\n")
}
