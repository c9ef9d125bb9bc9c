package zmq

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// logRec records log lines (level and message) for assertions.
type logRec struct {
	mu    sync.Mutex
	lines []string
}

func (r *logRec) Enabled(context.Context, slog.Level) bool { return true }
func (r *logRec) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.lines = append(r.lines, rec.Level.String()+" "+rec.Message)
	r.mu.Unlock()
	return nil
}
func (r *logRec) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRec) WithGroup(string) slog.Handler      { return r }

// count returns how many lines at level contain substr.
func (r *logRec) count(level, substr string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, l := range r.lines {
		if strings.HasPrefix(l, level+" ") && strings.Contains(l, substr) {
			n++
		}
	}
	return n
}

type fleetEnv struct {
	f   *fleet
	reg *worker.Registry
	m   *metrics.Metrics
	log *logRec
	t0  time.Time
}

func newFleetEnv(t *testing.T, gated bool) *fleetEnv {
	t.Helper()
	e := &fleetEnv{reg: worker.NewRegistry(worker.BreakerConfig{}), m: metrics.NewForTest(), log: &logRec{},
		t0: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	e.f = newFleet(e.reg, e.m, slog.New(e.log), DefaultTTL, gated, 100)
	if gated {
		// Every published snapshot: routable workers run FleetMode.
		e.reg.Subscribe(func(c worker.Change) {
			for _, w := range c.Snap.All {
				if w.Routable() && w.TransferMode != e.f.FleetMode() {
					t.Errorf("snapshot %d: routable %s runs %q, fleet mode %q", c.Snap.Gen, w, w.TransferMode, e.f.FleetMode())
				}
			}
		})
	}
	return e
}

func (e *fleetEnv) at(d time.Duration) time.Time { return e.t0.Add(d) }

func reg(role worker.Role, addr, mode string) Registration {
	return Registration{Role: role, HTTPAddress: addr, ZMQAddress: "host:10.0.0.1,handshake:6301,notify:61005",
		ZMQ: worker.ZMQAddr{Host: "10.0.0.1", Handshake: 6301, Notify: 61005}, DPSize: 1, TPSize: 1, TransferMode: mode, Format: FormatMoRIIONew}
}

func (e *fleetEnv) observe(t *testing.T, r Registration, at time.Duration) outcome {
	t.Helper()
	out, reason := e.f.observe(r, "id", e.at(at))
	if out == outDropped {
		t.Fatalf("dropped: %s", reason)
	}
	return out
}

func routable(reg *worker.Registry, role worker.Role) []string {
	var out []string
	for _, w := range reg.Snapshot().ByRole(role) {
		if w.Routable() {
			out = append(out, w.Key())
		}
	}
	return out
}

func TestFleetRegisterRefreshExpire(t *testing.T) {
	e := newFleetEnv(t, true)
	p := reg(worker.RolePrefill, "10.0.0.1:8000", ModeWrite)
	if out := e.observe(t, p, 0); out != outAdded {
		t.Fatalf("outcome %v", out)
	}
	ws := e.reg.Snapshot().Prefill
	if len(ws) != 1 || !ws[0].Routable() || ws[0].URL != "http://10.0.0.1:8000" || ws[0].Source != worker.SourceZMQ ||
		ws[0].TransferMode != ModeWrite || ws[0].Instance != "10.0.0.1:8000" || ws[0].Format != FormatMoRIIONew {
		t.Fatalf("worker %+v", ws)
	}
	if e.f.FleetMode() != ModeWrite {
		t.Fatalf("fleet mode %q", e.f.FleetMode())
	}
	gen := e.reg.Snapshot().Gen

	// Heartbeats refresh: same Worker pointer, no new snapshot.
	for i := 1; i <= 5; i++ {
		if out := e.observe(t, p, time.Duration(i)*3*time.Second); out != outRefreshed {
			t.Fatalf("heartbeat %d: outcome %v", i, out)
		}
	}
	if w := e.reg.Snapshot().Prefill[0]; w != ws[0] || e.reg.Snapshot().Gen != gen {
		t.Fatal("refresh replaced the worker or rebuilt the snapshot")
	}
	if got := ws[0].LastSeen(); !got.Equal(e.at(15 * time.Second)) {
		t.Fatalf("last seen %v", got)
	}

	// Silent from 15 s: still there 1 ns before the TTL, gone at the TTL.
	next, ok := e.f.nextExpiry()
	if !ok || !next.Equal(e.at(15*time.Second+DefaultTTL)) {
		t.Fatalf("next expiry %v %v", next, ok)
	}
	if n := e.f.expire(e.at(15*time.Second + DefaultTTL - time.Nanosecond)); n != 0 {
		t.Fatalf("expired early: %d", n)
	}
	if n := e.f.expire(e.at(15*time.Second + DefaultTTL)); n != 1 {
		t.Fatalf("expired %d", n)
	}
	if len(e.reg.Snapshot().All) != 0 || e.f.FleetMode() != "" {
		t.Fatalf("after expiry: %d workers, mode %q", len(e.reg.Snapshot().All), e.f.FleetMode())
	}
	if _, ok := e.f.nextExpiry(); ok {
		t.Fatal("next expiry with no instances")
	}

	// Logged once each; heartbeats not at info.
	if e.log.count("INFO", "instance registered") != 1 || e.log.count("INFO", "instance expired") != 1 ||
		e.log.count("INFO", "heartbeat") != 0 || e.log.count("DEBUG", "heartbeat") != 5 {
		t.Fatalf("log lines %q", e.log.lines)
	}
	if v := metricValue(t, e.m.DiscoveryRegistrations.WithLabelValues("prefill", FormatMoRIIONew)); v != 6 {
		t.Fatalf("registrations %v", v)
	}
	if v := metricValue(t, e.m.DiscoveryRemoved.WithLabelValues("expired")); v != 1 {
		t.Fatalf("removed %v", v)
	}
	if v := metricValue(t, e.m.DiscoveryInstances.WithLabelValues("prefill", ModeWrite)); v != 0 {
		t.Fatalf("instances gauge %v", v)
	}
}

func TestFleetReplaceOnNewZMQAddress(t *testing.T) {
	e := newFleetEnv(t, true)
	d := reg(worker.RoleDecode, "10.0.0.2:8000", ModeRead)
	e.observe(t, d, 0)
	old := e.reg.Snapshot().Decode[0]
	release := old.Acquire()
	defer release()

	d2 := d
	d2.ZMQAddress = "host:10.0.0.1,handshake:7301,notify:71005"
	d2.ZMQ.Handshake, d2.ZMQ.Notify = 7301, 71005
	if out := e.observe(t, d2, time.Second); out != outReplaced {
		t.Fatalf("outcome %v", out)
	}
	ws := e.reg.Snapshot().Decode
	if len(ws) != 1 || ws[0] == old || ws[0].ZMQAddress != d2.ZMQAddress || !ws[0].Routable() {
		t.Fatalf("not replaced: %+v", ws)
	}
	if e.log.count("INFO", "instance replaced") != 1 || e.log.count("INFO", "instance registered") != 1 {
		t.Fatalf("logs %q", e.log.lines)
	}
	if v := metricValue(t, e.m.DiscoveryRemoved.WithLabelValues("replaced")); v != 1 {
		t.Fatalf("removed{replaced} %v", v)
	}
	if v := metricValue(t, e.m.DiscoveryInstances.WithLabelValues("decode", ModeRead)); v != 1 {
		t.Fatalf("instances gauge %v", v)
	}
	// Replacing keeps the instance's first-seen time and resets its TTL.
	if n := e.f.expire(e.at(time.Second + DefaultTTL - time.Millisecond)); n != 0 {
		t.Fatal("replacement did not refresh the TTL")
	}
}

func TestFleetDPExpansion(t *testing.T) {
	e := newFleetEnv(t, true)
	p := reg(worker.RolePrefill, "10.0.0.1:8000", ModeWrite)
	p.DPSize = 4
	e.observe(t, p, 0)
	ws := e.reg.Snapshot().Prefill
	if len(ws) != 4 {
		t.Fatalf("%d workers", len(ws))
	}
	for i, w := range ws {
		if w.DPRank != i || w.DPSize != 4 || w.URL != "http://10.0.0.1:8000" || w.Instance != "10.0.0.1:8000" {
			t.Fatalf("rank %d: %+v", i, w.Spec)
		}
	}
	e.observe(t, p, time.Second)
	if e.reg.Snapshot().Prefill[3] != ws[3] {
		t.Fatal("refresh replaced a rank")
	}
	if st := e.f.Status(); len(st) != 1 || st[0].DPSize != 4 {
		t.Fatalf("status %+v", st)
	}
	e.f.expire(e.at(time.Second + DefaultTTL))
	if len(e.reg.Snapshot().All) != 0 {
		t.Fatal("ranks left after expiry")
	}
}

// checkNeverMixed asserts the mode invariant: every routable MoRI worker runs
// the fleet mode.
func checkNeverMixed(t *testing.T, e *fleetEnv) {
	t.Helper()
	modes := map[string]bool{}
	for _, w := range e.reg.Snapshot().All {
		if w.Routable() {
			modes[w.TransferMode] = true
		}
	}
	if len(modes) > 1 {
		t.Fatalf("mixed routable fleet: %v", modes)
	}
	for m := range modes {
		if m != e.f.FleetMode() {
			t.Fatalf("routable mode %q, fleet mode %q", m, e.f.FleetMode())
		}
	}
}

func TestFleetModeRolloutReadToWrite(t *testing.T) {
	e := newFleetEnv(t, true)
	pR := reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead)
	dR := reg(worker.RoleDecode, "10.0.0.2:8000", ModeRead)
	pW := reg(worker.RolePrefill, "10.0.0.3:8000", ModeWrite)
	dW := reg(worker.RoleDecode, "10.0.0.4:8000", ModeWrite)

	e.observe(t, pR, 0)
	e.observe(t, dR, 0)
	if e.f.FleetMode() != ModeRead {
		t.Fatalf("mode %q", e.f.FleetMode())
	}
	// WRITE instances arrive while READ is live: registered, held.
	e.observe(t, pW, time.Second)
	e.observe(t, dW, time.Second)
	checkNeverMixed(t, e)
	if got := routable(e.reg, worker.RolePrefill); len(got) != 1 || got[0] != "http://10.0.0.1:8000" {
		t.Fatalf("routable prefill %v", got)
	}
	held := e.reg.Get("http://10.0.0.3:8000")
	if held == nil || held.Routable() || held.Note() != "held: transfer_mode WRITE differs from fleet READ" {
		t.Fatalf("held worker %+v note %q", held, held.Note())
	}
	if v := metricValue(t, e.m.DiscoveryHeld); v != 2 {
		t.Fatalf("held gauge %v", v)
	}
	if e.log.count("WARN", "held aside") != 2 {
		t.Fatalf("logs %q", e.log.lines)
	}
	// Heartbeats from held instances do not warn again.
	e.observe(t, pW, 2*time.Second)
	if e.log.count("WARN", "held aside") != 2 {
		t.Fatal("held warning repeated on heartbeat")
	}

	for _, k := range []string{"http://10.0.0.3:8000", "http://10.0.0.4:8000"} {
		e.reg.Get(k).MarkProbed() // the health checker's first probe passed
	}
	// The READ instances stop; the WRITE ones keep pinging. While only the
	// READ decode has stopped, the READ fleet still serves: nothing switches.
	e.observe(t, pR, 3*time.Second)
	e.observe(t, pW, 6*time.Second)
	e.observe(t, dW, 6*time.Second)
	e.f.expire(e.at(DefaultTTL - time.Millisecond))
	checkNeverMixed(t, e)
	if e.f.FleetMode() != ModeRead || e.reg.Get("http://10.0.0.3:8000").Routable() {
		t.Fatal("switched while the READ fleet could serve")
	}
	// The READ decode expires first (heartbeats are not in step): the READ
	// prefill alone cannot serve, so the fleet switches to WRITE at once and
	// the READ prefill is held until it expires too.
	e.observe(t, pW, 9*time.Second)
	e.observe(t, dW, 9*time.Second)
	e.f.expire(e.at(DefaultTTL))
	checkNeverMixed(t, e)
	if e.f.FleetMode() != ModeWrite {
		t.Fatalf("mode %q", e.f.FleetMode())
	}
	if w := e.reg.Get("http://10.0.0.1:8000"); w == nil || w.Routable() {
		t.Fatalf("the READ prefill left alone is not held: %+v", w)
	}
	e.f.expire(e.at(3*time.Second + DefaultTTL))
	checkNeverMixed(t, e)
	if e.reg.Get("http://10.0.0.1:8000") != nil {
		t.Fatal("the READ prefill did not expire")
	}
	for _, k := range []string{"http://10.0.0.3:8000", "http://10.0.0.4:8000"} {
		w := e.reg.Get(k)
		if w == nil || !w.Routable() || w.Note() != "" {
			t.Fatalf("%s not released", k)
		}
	}
	if w := e.reg.Get("http://10.0.0.3:8000"); w != held {
		t.Fatal("release replaced the held worker instead of flipping it")
	}
	if v := metricValue(t, e.m.DiscoveryHeld); v != 0 {
		t.Fatalf("held gauge %v", v)
	}
	if e.log.count("INFO", "switched transfer mode") != 1 {
		t.Fatalf("logs %q", e.log.lines)
	}
	for _, st := range e.f.Status() {
		if st.Held || st.Note != "" {
			t.Fatalf("status %+v", st)
		}
	}
	if v := metricValue(t, e.m.DiscoveryInstances.WithLabelValues("prefill", ModeRead)); v != 0 {
		t.Fatalf("READ gauge %v", v)
	}
	if v := metricValue(t, e.m.DiscoveryInstances.WithLabelValues("decode", ModeWrite)); v != 1 {
		t.Fatalf("WRITE gauge %v", v)
	}
}

func TestFleetModeInPlaceRestart(t *testing.T) {
	e := newFleetEnv(t, true)
	a := reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead)
	b := reg(worker.RoleDecode, "10.0.0.2:8000", ModeRead)
	e.observe(t, a, 0)
	e.observe(t, b, 0)

	// a restarts as WRITE while b (READ) is live: a is held.
	aW := a
	aW.TransferMode = ModeWrite
	if out := e.observe(t, aW, time.Second); out != outReplaced {
		t.Fatalf("outcome %v", out)
	}
	checkNeverMixed(t, e)
	if e.reg.Get("http://10.0.0.1:8000").Routable() || e.f.FleetMode() != ModeRead {
		t.Fatal("restarted instance not held")
	}
	// b, the last READ instance, restarts as WRITE: the fleet switches and
	// both are routable.
	bW := b
	bW.TransferMode = ModeWrite
	e.observe(t, bW, 2*time.Second)
	checkNeverMixed(t, e)
	if e.f.FleetMode() != ModeWrite || !e.reg.Get("http://10.0.0.1:8000").Routable() || !e.reg.Get("http://10.0.0.2:8000").Routable() {
		t.Fatalf("mode %q", e.f.FleetMode())
	}
	if v := metricValue(t, e.m.DiscoveryHeld); v != 0 {
		t.Fatalf("held gauge %v", v)
	}
}

func TestFleetModeResetWhenEmpty(t *testing.T) {
	e := newFleetEnv(t, true)
	e.observe(t, reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead), 0)
	e.f.expire(e.at(DefaultTTL))
	if e.f.FleetMode() != "" {
		t.Fatal("mode not reset")
	}
	// The next registration sets the mode, unlike the Rust router's OnceLock.
	e.observe(t, reg(worker.RoleDecode, "10.0.0.2:8000", ModeWrite), DefaultTTL+time.Second)
	if e.f.FleetMode() != ModeWrite || !e.reg.Get("http://10.0.0.2:8000").Routable() {
		t.Fatal("WRITE not accepted after the READ fleet left")
	}
}

func TestFleetUngatedConnector(t *testing.T) {
	e := newFleetEnv(t, false)
	e.observe(t, reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead), 0)
	e.observe(t, reg(worker.RoleDecode, "10.0.0.2:8000", ModeWrite), 0)
	if e.f.FleetMode() != "" || len(routable(e.reg, worker.RolePrefill)) != 1 || len(routable(e.reg, worker.RoleDecode)) != 1 {
		t.Fatal("non-MoRI connector gated on transfer mode")
	}
}

func TestFleetLimitsAndConflicts(t *testing.T) {
	e := newFleetEnv(t, true)
	e.f.maxInstances = 2
	e.observe(t, reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead), 0)
	e.observe(t, reg(worker.RolePrefill, "10.0.0.2:8000", ModeRead), 0)
	if out, reason := e.f.observe(reg(worker.RolePrefill, "10.0.0.3:8000", ModeRead), "", e.at(0)); out != outDropped || reason != ReasonTooManyInstances {
		t.Fatalf("%v %q", out, reason)
	}
	// Known instances still refresh at the limit.
	e.observe(t, reg(worker.RolePrefill, "10.0.0.2:8000", ModeRead), time.Second)

	// A statically configured worker wins over a self-registration.
	e2 := newFleetEnv(t, false)
	if _, err := e2.reg.Add(worker.Spec{URL: "http://10.0.0.9:8000", Role: worker.RoleDecode, DPRank: -1}); err != nil {
		t.Fatal(err)
	}
	if out, reason := e2.f.observe(reg(worker.RoleDecode, "10.0.0.9:8000", ModeRead), "", e2.at(0)); out != outDropped || reason != ReasonConflict {
		t.Fatalf("%v %q", out, reason)
	}
	if w := e2.reg.Get("http://10.0.0.9:8000"); w.Source != worker.SourceStatic {
		t.Fatal("static worker taken over")
	}
}

// TestFleetHeldNeverPublishedRoutable checks that a held worker is never
// visible as routable, even for an instant: a registry subscriber sees every
// snapshot as it is published.
func TestFleetHeldNeverPublishedRoutable(t *testing.T) {
	e := newFleetEnv(t, true)
	var bad []string
	e.reg.Subscribe(func(c worker.Change) {
		for _, w := range c.Added {
			if w.TransferMode == ModeWrite && w.Routable() {
				bad = append(bad, w.Key())
			}
		}
	})
	e.observe(t, reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead), 0)
	e.observe(t, reg(worker.RoleDecode, "10.0.0.2:8000", ModeWrite), 0)
	if len(bad) != 0 {
		t.Fatalf("held workers published routable: %v", bad)
	}
}

// metricValue reads a counter or gauge (prometheus/testutil needs a module
// this repository does not carry).
func metricValue(t *testing.T, m prometheus.Metric) float64 {
	t.Helper()
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		t.Fatal(err)
	}
	if d.Counter != nil {
		return d.Counter.GetValue()
	}
	return d.Gauge.GetValue()
}

func TestFleetReaddsAfterExternalRemoval(t *testing.T) {
	e := newFleetEnv(t, true)
	p := reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead)
	e.observe(t, p, 0)
	e.reg.RemoveInstance("10.0.0.1:8000") // e.g. the admin API
	if out := e.observe(t, p, time.Second); out != outAdded {
		t.Fatalf("outcome %v", out)
	}
	if w := e.reg.Get("http://10.0.0.1:8000"); w == nil || !w.Routable() {
		t.Fatal("not re-added")
	}
	if v := metricValue(t, e.m.DiscoveryInstances.WithLabelValues("prefill", ModeRead)); v != 1 {
		t.Fatalf("instances gauge %v", v)
	}
	if e.log.count("INFO", "re-added") != 1 {
		t.Fatalf("logs %q", e.log.lines)
	}
}

// TestFleetModeFailover: a READ fleet whose decode dies (its worker fails
// its probes) fails over to the held WRITE instances at the next check,
// without waiting for the READ instances' TTL; a fleet that can still
// serve never switches, and neither does one whose held mode cannot serve.
func TestFleetModeFailover(t *testing.T) {
	e := newFleetEnv(t, true)
	pR := reg(worker.RolePrefill, "10.0.0.1:8000", ModeRead)
	dR := reg(worker.RoleDecode, "10.0.0.2:8000", ModeRead)
	pW := reg(worker.RolePrefill, "10.0.0.3:8000", ModeWrite)
	dW := reg(worker.RoleDecode, "10.0.0.4:8000", ModeWrite)
	for _, r := range []Registration{pR, dR, pW, dW} {
		e.observe(t, r, 0)
	}
	setHealthy := func(addr string, h bool) { e.reg.Get("http://" + addr).SetHealthy(h) }
	setHealthy("10.0.0.2:8000", false) // the READ fleet cannot serve
	if e.f.failover() {
		t.Fatal("failed over to instances no probe has passed")
	}
	setHealthy("10.0.0.2:8000", true)
	for _, a := range []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"} {
		e.reg.Get("http://" + a).MarkProbed()
	}
	steps := []struct {
		name    string
		healthy map[string]bool
		switch_ bool
		mode    string
	}{
		{"every worker healthy", nil, false, ModeRead},
		{"the READ prefill alone down: the held WRITE decode is down too", map[string]bool{"10.0.0.1:8000": false, "10.0.0.4:8000": false}, false, ModeRead},
		{"the READ fleet serves again", map[string]bool{"10.0.0.1:8000": true}, false, ModeRead},
		{"the READ decode dies, WRITE healthy again", map[string]bool{"10.0.0.2:8000": false, "10.0.0.4:8000": true}, true, ModeWrite},
		{"the READ decode comes back: no switch back", map[string]bool{"10.0.0.2:8000": true}, false, ModeWrite},
	}
	for _, st := range steps {
		for a, h := range st.healthy {
			setHealthy(a, h)
		}
		if got := e.f.failover(); got != st.switch_ || e.f.FleetMode() != st.mode {
			t.Fatalf("%s: switched %v (want %v), mode %q (want %q)", st.name, got, st.switch_, e.f.FleetMode(), st.mode)
		}
		checkNeverMixed(t, e)
	}
	if got := routable(e.reg, worker.RoleDecode); len(got) != 1 || got[0] != "http://10.0.0.4:8000" {
		t.Fatalf("routable decodes %v after the failover", got)
	}
	if w := e.reg.Get("http://10.0.0.2:8000"); w == nil || w.Routable() || w.Note() != "held: transfer_mode READ differs from fleet WRITE" {
		t.Fatalf("the old READ decode is not held: %+v", w)
	}
	if v := metricValue(t, e.m.DiscoveryHeld); v != 2 {
		t.Fatalf("held gauge %v, want the 2 READ instances", v)
	}
	if e.log.count("WARN", "failing over") != 1 {
		t.Fatalf("logs %q", e.log.lines)
	}
	// The WRITE instances expire while the READ ones keep registering: the
	// held READ instances are the fleet again, as in a rollout.
	e.observe(t, pR, 8*time.Second)
	e.observe(t, dR, 8*time.Second)
	e.f.expire(e.at(DefaultTTL + time.Second))
	if e.f.FleetMode() != ModeRead {
		t.Fatalf("mode %q after the WRITE instances expired", e.f.FleetMode())
	}
	checkNeverMixed(t, e)
	// An ungated (non-MoRI-IO) fleet never fails over.
	u := newFleetEnv(t, false)
	if u.f.failover() {
		t.Fatal("an ungated fleet failed over")
	}
}
