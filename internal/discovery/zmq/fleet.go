package zmq

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/switchyard-llm/switchyard/internal/metrics"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// fleet is the discovery state machine: instances keyed by http_address,
// TTL expiry and the MoRI-IO transfer-mode gate. It owns no goroutine and no
// socket; every method takes the current time, so tests drive it directly.
// Methods are safe for concurrent use.
type fleet struct {
	reg          *worker.Registry
	m            *metrics.Metrics // may be nil
	log          *slog.Logger
	ttl          time.Duration
	gated        bool // connector is MoRI-IO: one transfer mode per routable fleet
	maxInstances int

	mu      sync.Mutex
	byKey   map[string]*instance
	mode    string           // transfer mode of the routable fleet; "" = unset
	counts  map[gaugeKey]int // instances by role and mode, mirrored to the gauge
	held    int
	nextSeq uint64

	status    atomic.Pointer[[]instanceView] // published on every change
	fleetMode atomic.Pointer[string]
}

type gaugeKey struct{ role, mode string }

type instance struct {
	reg       Registration
	workers   []*worker.Worker
	firstSeen time.Time
	lastSeen  time.Time
	held      bool
	seq       uint64 // arrival order, to pick the next mode deterministically
	identity  string // last ZMQ identity seen, for logs only
}

// instanceView is the immutable per-instance part of Status; LastSeen is
// read live from the worker.
type instanceView struct {
	reg       Registration
	held      bool
	note      string
	firstSeen time.Time
	w         *worker.Worker
}

// outcome is what observe did with a registration.
type outcome uint8

const (
	outRefreshed outcome = iota
	outAdded
	outReplaced
	outDropped
)

func newFleet(reg *worker.Registry, m *metrics.Metrics, log *slog.Logger, ttl time.Duration, gated bool, maxInstances int) *fleet {
	f := &fleet{
		reg: reg, m: m, log: log, ttl: ttl, gated: gated, maxInstances: maxInstances,
		byKey:  map[string]*instance{},
		counts: map[gaugeKey]int{},
	}
	f.setMode("")
	f.publishLocked()
	return f
}

// observe applies one accepted registration received at now. It returns the
// outcome and, for outDropped, the drop reason.
func (f *fleet) observe(r Registration, identity string, now time.Time) (outcome, string) {
	f.mu.Lock()
	defer f.mu.Unlock()

	e := f.byKey[r.HTTPAddress]
	if e != nil && e.reg == r && f.inRegistry(e) {
		f.heartbeat(e, identity, now)
		return outRefreshed, ""
	}
	if e == nil {
		if len(f.byKey) >= f.maxInstances {
			return outDropped, ReasonTooManyInstances
		}
		if w := f.conflict(r); w != nil {
			return outDropped, ReasonConflict
		}
	}
	held, note := f.gate(e, r)
	ws := f.upsertWorkers(r, held, note, now)
	out := f.retire(e, r, held, identity)
	f.install(e, r, ws, held, identity, now)
	return out, ""
}

// heartbeat is the steady state: the instance registers as before. Only
// its times refresh; the Workers (and their load, health and breaker
// state) stay.
func (f *fleet) heartbeat(e *instance, identity string, now time.Time) {
	e.lastSeen = now
	e.identity = identity
	for _, w := range e.workers {
		w.Touch(now)
	}
	f.countRegistration(e.reg)
	if f.log.Enabled(context.Background(), slog.LevelDebug) {
		f.log.Debug("zmq discovery: heartbeat", "http_address", e.reg.HTTPAddress, "role", e.reg.Role.String())
	}
}

// gate decides whether r is held aside (its transfer mode differs from a
// live fleet's; note says why) and, when r instead sets the fleet mode
// (the first registration, or the last instance of the old mode
// re-registering in the new one), switches the mode before r is
// published, so a routable worker never disagrees with FleetMode. e is the
// entry r replaces, if any.
func (f *fleet) gate(e *instance, r Registration) (held bool, note string) {
	if !f.gated {
		return false, ""
	}
	live := f.routableIn(f.mode)
	if e != nil && !e.held && e.reg.TransferMode == f.mode {
		live-- // the entry being replaced no longer counts
	}
	if f.mode != "" && live > 0 && r.TransferMode != f.mode {
		return true, heldNote(r.TransferMode, f.mode)
	}
	if f.mode != r.TransferMode {
		why := "first registration"
		if f.mode != "" {
			why = "the last " + f.mode + " instance re-registered as " + r.TransferMode
		}
		if e != nil { // the entry being replaced stops routing first
			for _, w := range e.workers {
				w.SetRoutable(false)
			}
		}
		f.switchMode(r.TransferMode, why)
	}
	return false, ""
}

// upsertWorkers puts r's workers in the registry, routable unless held.
func (f *fleet) upsertWorkers(r Registration, held bool, note string, now time.Time) []*worker.Worker {
	ws, _ := f.reg.UpsertWith(r.HTTPAddress, specsFor(r), now, func(w *worker.Worker) {
		if held {
			w.SetRoutable(false)
			w.SetNote(note)
		}
	})
	for _, w := range ws {
		w.SetRoutable(!held)
		w.SetNote(note)
	}
	return ws
}

// retire uncounts the entry e that r replaces (if any), logs the change
// and returns its outcome.
func (f *fleet) retire(e *instance, r Registration, held bool, identity string) outcome {
	switch {
	case e != nil && e.reg == r:
		// Removed from the registry behind discovery's back (the admin API)
		// while it keeps registering: discovery is the source of truth.
		f.uncount(e)
		f.log.Info("zmq discovery: instance re-added: it was removed from the registry but keeps registering",
			"http_address", r.HTTPAddress, "role", r.Role.String(), "held", held)
		return outAdded
	case e != nil:
		f.uncount(e)
		f.log.Info("zmq discovery: instance replaced",
			"http_address", r.HTTPAddress, "role", r.Role.String(),
			"old_zmq_address", e.reg.ZMQAddress, "zmq_address", r.ZMQAddress,
			"old_transfer_mode", e.reg.TransferMode, "transfer_mode", r.TransferMode,
			"dp_size", r.DPSize, "tp_size", r.TPSize, "format", r.Format, "held", held)
		if f.m != nil {
			f.m.DiscoveryRemoved.WithLabelValues("replaced").Inc()
		}
		return outReplaced
	default:
		f.log.Info("zmq discovery: instance registered",
			"http_address", r.HTTPAddress, "role", r.Role.String(), "zmq_address", r.ZMQAddress,
			"dp_size", r.DPSize, "tp_size", r.TPSize, "transfer_mode", r.TransferMode,
			"format", r.Format, "held", held, "identity", identity)
		return outAdded
	}
}

// install records r as the instance at its address (keeping e's first
// sighting), counts it, and publishes the fleet.
func (f *fleet) install(e *instance, r Registration, ws []*worker.Worker, held bool, identity string, now time.Time) {
	f.nextSeq++
	first := now
	if e != nil {
		first = e.firstSeen
	}
	ne := &instance{reg: r, workers: ws, firstSeen: first, lastSeen: now, held: held, seq: f.nextSeq, identity: identity}
	f.byKey[r.HTTPAddress] = ne
	f.count(ne)
	if held {
		f.log.Warn("zmq discovery: instance held aside: its transfer_mode differs from the live fleet's; "+
			"it becomes routable once every "+f.mode+" instance has expired",
			"http_address", r.HTTPAddress, "role", r.Role.String(),
			"transfer_mode", r.TransferMode, "fleet_transfer_mode", f.mode)
	}
	if f.m != nil {
		f.m.DiscoveryAdded.Inc()
		f.m.DiscoveryUpdates.Inc()
	}
	f.countRegistration(r)
	f.reconcileLocked()
	f.publishLocked()
}

// expire removes every instance not seen for ttl and returns how many.
func (f *fleet) expire(now time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for key, e := range f.byKey {
		if now.Sub(e.lastSeen) < f.ttl {
			continue
		}
		delete(f.byKey, key)
		f.uncount(e)
		f.reg.RemoveInstance(key)
		n++
		f.log.Info("zmq discovery: instance expired",
			"http_address", key, "role", e.reg.Role.String(), "zmq_address", e.reg.ZMQAddress,
			"transfer_mode", e.reg.TransferMode, "held", e.held, "identity", e.identity,
			"silent_for", now.Sub(e.lastSeen).Round(time.Millisecond).String())
		if f.m != nil {
			f.m.DiscoveryRemoved.WithLabelValues("expired").Inc()
			f.m.DiscoveryUpdates.Inc()
		}
	}
	if n > 0 {
		f.reconcileLocked()
		// one role of the fleet expired before the other (their heartbeats
		// are not in step): the fleet cannot serve, a held one may
		f.failoverLocked()
		f.publishLocked()
	}
	return n
}

// nextExpiry is when the least recently seen instance expires.
func (f *fleet) nextExpiry() (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var next time.Time
	for _, e := range f.byKey {
		if t := e.lastSeen.Add(f.ttl); next.IsZero() || t.Before(next) {
			next = t
		}
	}
	return next, !next.IsZero()
}

// reconcileLocked restores the mode invariant after a change: when no
// routable instance of the fleet mode is left, the held instances of the
// earliest-arrived other mode become the fleet (or the mode resets when no
// instance is left at all).
func (f *fleet) reconcileLocked() {
	if !f.gated || f.mode == "" || f.routableIn(f.mode) > 0 {
		return
	}
	var next *instance
	for _, e := range f.byKey {
		if e.held && (next == nil || e.seq < next.seq) {
			next = e
		}
	}
	if next == nil {
		f.log.Info("zmq discovery: no live MoRI-IO instance left; the next registration sets the transfer mode",
			"previous_transfer_mode", f.mode)
		f.setMode("")
		return
	}
	f.switchMode(next.reg.TransferMode, "every "+f.mode+" instance expired")
}

// FailoverCheckInterval is how often a MoRI-IO listener with held
// instances checks whether its fleet can still serve (failover).
const FailoverCheckInterval = 250 * time.Millisecond

// failover switches a MoRI-IO fleet whose mode can no longer serve to a
// held mode that can, without waiting for the dead instances' TTL: when
// the fleet mode has no healthy routable prefill or no healthy routable
// decode (kill -9 of a pair: its workers fail their probes within a
// second), and the held instances of another mode have both, that mode
// becomes the fleet and the old instances are held in its place (they are
// routable again if the new mode's instances expire, as in a rollout).
// It never switches away from a fleet that can serve, so a fleet does not
// flap on one failed probe. It reports whether it switched.
func (f *fleet) failover() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failoverLocked()
}

func (f *fleet) failoverLocked() bool {
	if !f.gated || f.mode == "" || f.held == 0 || f.serves(f.mode, false) {
		return false
	}
	var next *instance
	for _, e := range f.byKey {
		if e.held && e.reg.TransferMode != f.mode && (next == nil || e.seq < next.seq) && f.serves(e.reg.TransferMode, true) {
			next = e
		}
	}
	if next == nil {
		return false
	}
	old := f.mode
	for _, e := range f.byKey {
		if e.held || e.reg.TransferMode != old {
			continue
		}
		e.held = true
		f.held++
		for _, w := range e.workers {
			w.SetRoutable(false)
		}
	}
	f.log.Warn("zmq discovery: MoRI-IO fleet cannot serve (no healthy prefill or decode); failing over to the held instances",
		"from", old, "to", next.reg.TransferMode)
	f.switchMode(next.reg.TransferMode, "no healthy "+old+" prefill or decode")
	if f.m != nil {
		f.m.DiscoveryUpdates.Inc()
	}
	f.publishLocked()
	return true
}

// serves reports whether the instances of mode (held ones if held, else
// routable ones) have a healthy prefill worker and a healthy decode worker.
// A held worker must also have passed a probe: a fleet never fails over to
// instances no probe has vouched for (while a routable one just replaced
// in place, not probed yet, still counts as serving).
func (f *fleet) serves(mode string, held bool) bool {
	var p, d bool
	for _, e := range f.byKey {
		if e.held != held || e.reg.TransferMode != mode {
			continue
		}
		for _, w := range e.workers {
			if !w.Healthy() || (held && !w.Probed()) {
				continue
			}
			switch w.Role {
			case worker.RolePrefill:
				p = true
			case worker.RoleDecode:
				d = true
			}
		}
	}
	return p && d
}

// switchMode makes mode the fleet mode and releases the held instances that
// run it. Callers guarantee no routable instance runs another mode.
func (f *fleet) switchMode(mode, why string) {
	old := f.mode
	f.setMode(mode)
	released := 0
	for _, e := range f.byKey {
		if !e.held {
			continue
		}
		if e.reg.TransferMode != mode {
			note := heldNote(e.reg.TransferMode, mode)
			for _, w := range e.workers {
				w.SetNote(note)
			}
			continue
		}
		e.held = false
		f.held--
		released++
		for _, w := range e.workers {
			w.SetNote("")
			w.SetRoutable(true)
		}
	}
	if old == "" {
		f.log.Info("zmq discovery: MoRI-IO transfer mode set", "transfer_mode", mode, "reason", why, "released", released)
	} else {
		f.log.Info("zmq discovery: MoRI-IO fleet switched transfer mode",
			"from", old, "to", mode, "reason", why, "released", released)
	}
	if released > 0 && f.m != nil {
		f.m.DiscoveryUpdates.Inc()
	}
	f.setHeldGauge()
}

func (f *fleet) setMode(m string) {
	f.mode = m
	f.fleetMode.Store(&m)
}

// routableIn counts routable (not held) instances running mode.
func (f *fleet) routableIn(mode string) int {
	n := 0
	for _, e := range f.byKey {
		if !e.held && e.reg.TransferMode == mode {
			n++
		}
	}
	return n
}

// inRegistry reports whether the instance's Workers are still the
// registry's.
func (f *fleet) inRegistry(e *instance) bool {
	for _, w := range e.workers {
		if f.reg.Get(w.Key()) != w {
			return false
		}
	}
	return true
}

// conflict returns a non-ZMQ worker that already owns one of r's keys:
// static or admin configuration wins over self-registration.
func (f *fleet) conflict(r Registration) *worker.Worker {
	for _, s := range specsFor(r) {
		if w := f.reg.Get(s.Key()); w != nil && w.Source != worker.SourceZMQ {
			return w
		}
	}
	return nil
}

func (f *fleet) count(e *instance) {
	k := gaugeKey{e.reg.Role.String(), modeLabel(e.reg.TransferMode)}
	f.counts[k]++
	if e.held {
		f.held++
	}
	f.setGauges(k)
}

func (f *fleet) uncount(e *instance) {
	k := gaugeKey{e.reg.Role.String(), modeLabel(e.reg.TransferMode)}
	f.counts[k]--
	if e.held {
		f.held--
	}
	f.setGauges(k)
}

func (f *fleet) setGauges(k gaugeKey) {
	if f.m == nil {
		return
	}
	f.m.DiscoveryInstances.WithLabelValues(k.role, k.mode).Set(float64(f.counts[k]))
	f.setHeldGauge()
}

func (f *fleet) setHeldGauge() {
	if f.m != nil {
		f.m.DiscoveryHeld.Set(float64(f.held))
	}
}

func (f *fleet) countRegistration(r Registration) {
	if f.m != nil {
		f.m.DiscoveryRegistrations.WithLabelValues(r.Role.String(), r.Format).Inc()
	}
}

// publishLocked rebuilds the Status view.
func (f *fleet) publishLocked() {
	v := make([]instanceView, 0, len(f.byKey))
	for _, e := range f.byKey {
		iv := instanceView{reg: e.reg, held: e.held, firstSeen: e.firstSeen}
		if len(e.workers) > 0 {
			iv.w = e.workers[0]
			iv.note = iv.w.Note()
		}
		v = append(v, iv)
	}
	slices.SortFunc(v, func(a, b instanceView) int {
		if a.reg.Role != b.reg.Role {
			return int(a.reg.Role) - int(b.reg.Role)
		}
		return strings.Compare(a.reg.HTTPAddress, b.reg.HTTPAddress)
	})
	f.status.Store(&v)
}

// FleetMode is the transfer mode of the routable MoRI-IO fleet ("" while
// unset, and always "" for other connectors).
func (f *fleet) FleetMode() string { return *f.fleetMode.Load() }

// specsFor turns a registration into worker specs, one per DP rank.
func specsFor(r Registration) []worker.Spec {
	return worker.ExpandDP(worker.Spec{
		URL:          "http://" + r.HTTPAddress,
		Role:         r.Role,
		DPRank:       -1,
		DPSize:       r.DPSize,
		TPSize:       r.TPSize,
		Source:       worker.SourceZMQ,
		Instance:     r.HTTPAddress,
		ZMQAddress:   r.ZMQAddress,
		ZMQ:          r.ZMQ,
		TransferMode: r.TransferMode,
		Format:       r.Format,
		ModelID:      r.ModelID,
	}, r.DPSize)
}

func heldNote(mode, fleetMode string) string {
	return "held: transfer_mode " + mode + " differs from fleet " + fleetMode
}

func modeLabel(m string) string {
	if m == "" {
		return "none"
	}
	return m
}

// Status lists the instances from the last published view, lock-free.
func (f *fleet) Status() []InstanceStatus {
	v := *f.status.Load()
	out := make([]InstanceStatus, len(v))
	for i, iv := range v {
		out[i] = InstanceStatus{
			HTTPAddress:  iv.reg.HTTPAddress,
			URL:          "http://" + iv.reg.HTTPAddress,
			Role:         iv.reg.Role.String(),
			ZMQAddress:   iv.reg.ZMQAddress,
			DPSize:       iv.reg.DPSize,
			TPSize:       iv.reg.TPSize,
			TransferMode: iv.reg.TransferMode,
			Format:       iv.reg.Format,
			Held:         iv.held,
			Note:         iv.note,
			FirstSeen:    iv.firstSeen,
		}
		if iv.w != nil {
			out[i].LastSeen = iv.w.LastSeen()
		}
	}
	return out
}
