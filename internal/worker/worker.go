package worker

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Role is what a worker does in the fleet.
type Role uint8

// Roles.
const (
	RoleRegular Role = iota
	RolePrefill
	RoleDecode
)

func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	default:
		return "regular"
	}
}

// ParseRole accepts regular|prefill|decode (and P/D as vLLM registers them).
func ParseRole(s string) (Role, error) {
	switch strings.ToLower(s) {
	case "regular", "":
		return RoleRegular, nil
	case "prefill", "p":
		return RolePrefill, nil
	case "decode", "d":
		return RoleDecode, nil
	}
	return RoleRegular, fmt.Errorf("unknown worker role %q (want regular, prefill or decode)", s)
}

// Source says how a worker entered the registry.
type Source uint8

// Sources.
const (
	SourceStatic Source = iota
	SourceAdmin
	SourceZMQ
	SourceK8s
)

func (s Source) String() string {
	switch s {
	case SourceAdmin:
		return "admin"
	case SourceZMQ:
		return "zmq"
	case SourceK8s:
		return "kubernetes"
	default:
		return "static"
	}
}

// ZMQAddr is the parsed form of a registered zmq_address. MoRI-IO uses
// "host:IP,handshake:PORT,notify:PORT"; P2P-NCCL uses "IP:PORT".
type ZMQAddr struct {
	Host      string
	Handshake int
	Notify    int
	Port      int // P2P-NCCL kv port
}

// ParseZMQAddress parses either zmq_address form. Keys split on the first
// colon, so an IPv6 host ("host:::1") survives.
func ParseZMQAddress(s string) (ZMQAddr, error) {
	var a ZMQAddr
	if s == "" {
		return a, errors.New("empty zmq_address")
	}
	if strings.Contains(s, "host:") && strings.Contains(s, ",") {
		for _, part := range strings.Split(s, ",") {
			k, v, ok := strings.Cut(strings.TrimSpace(part), ":")
			if !ok {
				return a, fmt.Errorf("zmq_address %q: element %q has no ':'", s, part)
			}
			switch k {
			case "host":
				a.Host = v
			case "handshake", "notify":
				n, err := strconv.Atoi(v)
				if err != nil || n <= 0 || n > 65535 {
					return a, fmt.Errorf("zmq_address %q: bad %s port %q", s, k, v)
				}
				if k == "handshake" {
					a.Handshake = n
				} else {
					a.Notify = n
				}
			}
		}
		if a.Host == "" {
			return a, fmt.Errorf("zmq_address %q: missing host", s)
		}
		if a.Handshake == 0 || a.Notify == 0 {
			return a, fmt.Errorf("zmq_address %q: missing handshake or notify port", s)
		}
		return a, nil
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return a, fmt.Errorf("zmq_address %q: %w", s, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n <= 0 || n > 65535 {
		return a, fmt.Errorf("zmq_address %q: bad port", s)
	}
	a.Host, a.Port = host, n
	return a, nil
}

// Spec is the immutable description of a worker.
type Spec struct {
	URL      string // base URL: scheme://host:port, no trailing slash, never "@rank"
	Role     Role
	DPRank   int // -1 when the worker is not pinned to a data-parallel rank
	DPSize   int // >= 1
	TPSize   int // >= 1
	ModelID  string
	Source   Source
	Instance string // groups the ranks of one instance; defaults to URL

	// PD fields (zero for regular workers).
	ZMQAddress    string // raw zmq_address as registered
	ZMQ           ZMQAddr
	TransferMode  string // "READ" or "WRITE" for MoRI-IO, "" otherwise
	BootstrapPort int    // Mooncake bootstrap port, 0 = connector default
	Format        string // registration format ("moriio-new", "moriio-old", "p2pnccl"), "" for static

	// KVEventsPort is the worker's KV event publisher port when its source
	// knows it (a pod annotation); 0 = the router's --kv-events-port.
	KVEventsPort int
}

// Key is the worker's identity: URL, or URL@rank for a DP-pinned worker.
func (s Spec) Key() string {
	if s.DPRank >= 0 {
		return s.URL + "@" + strconv.Itoa(s.DPRank)
	}
	return s.URL
}

// HostPort returns host:port of the base URL.
func (s Spec) HostPort() string {
	u, err := url.Parse(s.URL)
	if err != nil {
		return s.URL
	}
	return u.Host
}

// Hostname returns the host of the base URL without port or brackets.
func (s Spec) Hostname() string {
	u, err := url.Parse(s.URL)
	if err != nil {
		return ""
	}
	return u.Hostname()
}

// NormalizeURL validates a worker URL and returns its canonical base form
// (no trailing slash, no path). A trailing "@N" rank suffix is split off and
// returned separately (-1 when absent).
func NormalizeURL(raw string) (base string, rank int, err error) {
	rank = -1
	s := strings.TrimSpace(raw)
	if s == "" {
		return "", rank, errors.New("URL cannot be empty")
	}
	if i := strings.LastIndex(s, "@"); i > 0 {
		if n, err := strconv.Atoi(s[i+1:]); err == nil && n >= 0 && !strings.Contains(s[i+1:], "/") {
			rank = n
			s = s[:i]
		}
	}
	if !strings.HasPrefix(s, "http://") && !strings.HasPrefix(s, "https://") {
		return "", rank, errors.New("URL must start with http:// or https://")
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", rank, fmt.Errorf("Invalid URL format: %w", err) //nolint:staticcheck // Rust router's text
	}
	if u.Host == "" || u.Hostname() == "" {
		return "", rank, errors.New("URL must have a valid host")
	}
	return u.Scheme + "://" + u.Host + strings.TrimRight(u.Path, "/"), rank, nil
}

// ExpandDP turns one instance spec into one spec per data-parallel rank when
// dpSize > 1 (URL@0..URL@n-1); otherwise it returns the spec unchanged.
func ExpandDP(s Spec, dpSize int) []Spec {
	if s.Instance == "" {
		s.Instance = s.URL
	}
	if dpSize <= 1 {
		if s.DPSize < 1 {
			s.DPSize = 1
		}
		return []Spec{s}
	}
	out := make([]Spec, dpSize)
	for r := range dpSize {
		c := s
		c.DPRank = r
		c.DPSize = dpSize
		out[r] = c
	}
	return out
}

// Worker is one routable upstream (an instance, or one DP rank of it).
type Worker struct {
	Spec
	key     string
	base    *url.URL // URL parsed once (nil if it does not parse); never modified
	added   time.Time
	breaker *Breaker

	inflight   atomic.Int64
	prefilling atomic.Int64 // slots not yet past their first byte
	prefillTop atomic.Int64 // of which in the highest flow-control band
	topHook    atomic.Pointer[func()]
	total      atomic.Uint64
	healthy    atomic.Bool
	routable   atomic.Bool
	polledLoad atomic.Int64 // load reported by the worker itself; -1 = unknown
	lastSeen   atomic.Int64 // unix nanos of the last registration/heartbeat
	probed     atomic.Bool  // a health probe passed since registration
	hintAt     atomic.Int64 // unix nanos of an unconfirmed connect failure; 0 = none
	note       atomic.Pointer[string]
}

// New builds a worker from a spec. Workers start healthy and routable.
func New(s Spec, bc BreakerConfig) *Worker {
	if s.DPSize < 1 {
		s.DPSize = 1
	}
	if s.TPSize < 1 {
		s.TPSize = 1
	}
	if s.Instance == "" {
		s.Instance = s.URL
	}
	if bc.OnTransitionFor != nil {
		key, fn := s.Key(), bc.OnTransitionFor
		bc.OnTransition = func(from, to BreakerState) { fn(key, from, to) }
	}
	w := &Worker{Spec: s, key: s.Key(), added: time.Now(), breaker: NewBreaker(bc)}
	if u, err := url.Parse(s.URL); err == nil && u.Host != "" && u.Path == "" && u.RawQuery == "" && u.User == nil {
		w.base = u
	}
	w.healthy.Store(true)
	w.routable.Store(true)
	w.polledLoad.Store(-1)
	w.lastSeen.Store(time.Now().UnixNano())
	return w
}

// Key is the worker's identity (URL or URL@rank).
func (w *Worker) Key() string { return w.key }

// BaseURL is the worker's URL, parsed once: scheme and host, nothing else
// (nil if URL is not of that form). Callers must not modify it.
func (w *Worker) BaseURL() *url.URL { return w.base }

// HostPort returns host:port of the base URL, from the URL parsed once
// when it has that form (Spec.HostPort parses it each call).
func (w *Worker) HostPort() string {
	if w.base != nil {
		return w.base.Host
	}
	return w.Spec.HostPort()
}

// Endpoint returns the full URL for path on this worker (never with @rank).
func (w *Worker) Endpoint(path string) string { return w.URL + path }

// Acquire counts one in-flight request and returns its idempotent release.
// Call release when the response body has been fully relayed. The request
// counts as awaiting its first byte until then (see Slot).
func (w *Worker) Acquire() (release func()) {
	s := new(Slot)
	s.Start(w, false)
	return s.Release
}

// Slot is one request in flight on a worker, counted in Load from Start to
// Release. Until FirstByte (or Release) it also counts in Prefilling: the
// router has sent it and seen nothing of its answer yet, so it is waiting
// for or in the engine's prefill. A slot of the highest flow-control band
// (top) counts in PrefillingTop too. The zero value is ready for Start;
// embed it to save an allocation. FirstByte and Release are idempotent and
// safe for concurrent use.
type Slot struct {
	w     *Worker
	top   bool
	state atomic.Uint32 // slotPrefill, slotStreaming, slotReleased
}

const (
	slotPrefill uint32 = iota
	slotStreaming
	slotReleased
)

// Start counts the slot on w; call it once.
func (s *Slot) Start(w *Worker, top bool) {
	s.w, s.top = w, top
	w.inflight.Add(1)
	w.total.Add(1)
	w.prefilling.Add(1)
	if top {
		w.prefillTop.Add(1)
	}
}

// FirstByte marks the first byte of the answer relayed: the request is
// out of prefill.
func (s *Slot) FirstByte() {
	if s.state.CompareAndSwap(slotPrefill, slotStreaming) {
		s.w.leavePrefill(s.top)
	}
}

// Release ends the slot.
func (s *Slot) Release() {
	switch s.state.Swap(slotReleased) {
	case slotReleased:
		return
	case slotPrefill:
		s.w.leavePrefill(s.top)
	}
	s.w.inflight.Add(-1)
}

func (w *Worker) leavePrefill(top bool) {
	fire := w.prefilling.Add(-1) == 0
	if top && w.prefillTop.Add(-1) == 0 {
		fire = true
	}
	if fire {
		if f := w.topHook.Load(); f != nil {
			(*f)()
		}
	}
}

// Prefilling is the number of the router's in-flight requests on w that
// have not yet produced their first byte.
func (w *Worker) Prefilling() int64 { return w.prefilling.Load() }

// PrefillingTop is the part of Prefilling in the highest flow-control band.
func (w *Worker) PrefillingTop() int64 { return w.prefillTop.Load() }

// OnPrefillDone sets the function called (on the caller's goroutine, must
// not block) when Prefilling or PrefillingTop drops to 0; nil clears it.
func (w *Worker) OnPrefillDone(f *func()) { w.topHook.Store(f) }

// Load is the router's own in-flight count for this worker.
func (w *Worker) Load() int64 { return w.inflight.Load() }

// TotalRequests is the number of requests ever dispatched to this worker.
func (w *Worker) TotalRequests() uint64 { return w.total.Load() }

// PolledLoad is the last load the worker reported (-1 when unknown).
func (w *Worker) PolledLoad() int64 { return w.polledLoad.Load() }

// SetPolledLoad records a load reported by the worker.
func (w *Worker) SetPolledLoad(n int64) { w.polledLoad.Store(n) }

// Healthy reports the health-check view of the worker.
func (w *Worker) Healthy() bool { return w.healthy.Load() }

// SetHealthy sets the health flag and reports whether it changed.
func (w *Worker) SetHealthy(h bool) bool { return w.healthy.Swap(h) != h }

// Routable is false while the worker is held aside (e.g. a MoRI-IO instance
// whose transfer mode differs from the live fleet's).
func (w *Worker) Routable() bool { return w.routable.Load() }

// SetRoutable sets routability and reports whether it changed.
func (w *Worker) SetRoutable(r bool) bool { return w.routable.Swap(r) != r }

// Note is a short human-readable status (why a worker is held, etc.).
func (w *Worker) Note() string {
	if p := w.note.Load(); p != nil {
		return *p
	}
	return ""
}

// SetNote sets the status note ("" clears it).
func (w *Worker) SetNote(s string) { w.note.Store(&s) }

// Touch records a heartbeat/registration at t.
func (w *Worker) Touch(t time.Time) { w.lastSeen.Store(t.UnixNano()) }

// LastSeen is the time of the last Touch.
func (w *Worker) LastSeen() time.Time { return time.Unix(0, w.lastSeen.Load()) }

// Breaker returns the worker's circuit breaker.
func (w *Worker) Breaker() *Breaker { return w.breaker }

// Available reports whether a policy may pick the worker now.
func (w *Worker) Available() bool {
	return w.healthy.Load() && w.routable.Load() && w.breaker.Allow()
}

// String is for logs.
func (w *Worker) String() string { return w.Role.String() + ":" + w.key }

// sameSpec reports whether two specs describe the same upstream, so the
// existing Worker (and its runtime state) can be kept on re-registration.
func sameSpec(a, b Spec) bool { return a == b }

var errExists = errors.New("worker already exists")

// ErrExists is returned by Registry.Add for a duplicate key.
func ErrExists() error { return errExists }

// IsExists reports whether err is the duplicate-worker error.
func IsExists(err error) bool { return errors.Is(err, errExists) }
