package pd

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/rawjson"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Connector names accepted in Options.Connector.
const (
	ConnectorNIXL     = "nixl"
	ConnectorMooncake = "mooncake"
	ConnectorMoRIIO   = "moriio"
	ConnectorP2PNCCL  = "p2pnccl"
)

// Order is how the two legs of a PD request are dispatched.
type Order int

// Dispatch orders.
const (
	// Sequential: the prefill must complete (2xx, and kv_transfer_params
	// when the connector needs them) before the decode is sent.
	Sequential Order = iota
	// Concurrent: the decode is sent no later than the prefill, and the
	// prefill leg is watched while the decode waits for its KV.
	Concurrent
)

func (o Order) String() string {
	if o == Concurrent {
		return "concurrent"
	}
	return "sequential"
}

// Pair is one chosen (prefill, decode) pair with the identifiers shared by
// both legs of one attempt.
type Pair struct {
	P, D       *worker.Worker
	PRank      int    // P's data-parallel rank when P.DPSize > 1 (or chosen by a rankChooser), else -1
	DRank      int    // D's data-parallel rank when D.DPSize > 1, else -1
	RequestID  string // X-Request-Id on both legs
	TransferID string // "" when the connector has none
}

// Connector is the per-KV-transfer-protocol part of PD dispatch: which order
// the legs go in and what kv_transfer_params each leg carries.
type Connector interface {
	// Name is the --kv-connector value.
	Name() string
	// Order is the dispatch order for a pair whose prefill is p.
	Order(p *worker.Worker) Order
	// Eligible reports why w cannot take part in a PD request with this
	// connector right now (nil = it can).
	Eligible(w *worker.Worker) error
	// Compatible reports whether p and d may be paired.
	Compatible(p, d *worker.Worker) bool
	// TransferID returns the transfer id for one attempt ("" = none).
	TransferID(u [16]byte) string
	// PrefillParams is the raw kv_transfer_params object for the prefill
	// leg (nil = a client-supplied kv_transfer_params is removed).
	PrefillParams(pr *Pair) []byte
	// NeedsPrefillParams is true when a sequential decode cannot be sent
	// without the kv_transfer_params of P's response.
	NeedsPrefillParams(pr *Pair) bool
	// DecodeParams is the raw kv_transfer_params for the decode leg given
	// the raw kv_transfer_params of P's response (nil in concurrent mode).
	// A nil result with a nil error removes a client-supplied
	// kv_transfer_params (the client never controls the KV handoff).
	DecodeParams(pr *Pair, prefill []byte) ([]byte, error)
}

// rankChooser is implemented by connectors that learn a prefill's DP ranks
// from the prefill itself (Mooncake's bootstrap /query). prefillRank is the
// rank for one request to p when the registry does not pin one (-1 = none).
type rankChooser interface {
	prefillRank(p *worker.Worker) int
}

// NewConnector returns the connector for name. bootstrap is only used by
// Mooncake (it may be nil for the others).
func newConnector(name string, boot *bootstrapper) (Connector, error) {
	switch strings.ToLower(name) {
	case "", ConnectorNIXL:
		return nixl{}, nil
	case ConnectorMoRIIO:
		return moriio{}, nil
	case ConnectorP2PNCCL:
		return p2pnccl{}, nil
	case ConnectorMooncake:
		return &mooncake{boot: boot}, nil
	}
	return nil, fmt.Errorf("pd: unknown KV connector %q (want nixl, mooncake, moriio or p2pnccl)", name)
}

// errBadPrefillParams marks P responses that cannot feed a decode.
var errBadPrefillParams = errors.New("bad prefill kv_transfer_params")

// kvObj builds a JSON object with keys in insertion order (written as
// encoding/json writes them).
type kvObj struct{ b []byte }

func (o *kvObj) key(k string) {
	if len(o.b) == 0 {
		o.b = append(make([]byte, 0, 384), '{') // a MoRI-IO object: ~330 bytes
	} else {
		o.b = append(o.b, ',')
	}
	o.b = rawjson.AppendString(o.b, k)
	o.b = append(o.b, ':')
}

func (o *kvObj) raw(k string, v []byte) *kvObj {
	o.key(k)
	o.b = append(o.b, v...)
	return o
}

func (o *kvObj) flag(k string, v bool) *kvObj {
	o.key(k)
	o.b = strconv.AppendBool(o.b, v)
	return o
}

func (o *kvObj) num(k string, v int) *kvObj {
	o.key(k)
	o.b = strconv.AppendInt(o.b, int64(v), 10)
	return o
}

func (o *kvObj) str(k, v string) *kvObj {
	o.key(k)
	o.b = rawjson.AppendString(o.b, v)
	return o
}

func (o *kvObj) bytes() []byte {
	if len(o.b) == 0 {
		return []byte("{}")
	}
	return append(o.b, '}')
}

var jsonNull = []byte("null")

// zmqAddr is the address embedded in X-Request-Id: the registered
// zmq_address, or host:port of the HTTP URL for static workers (as the Rust
// router does).
func zmqAddr(w *worker.Worker) string {
	if w.ZMQAddress != "" {
		return w.ZMQAddress
	}
	return w.HostPort()
}

// zmqInfo returns the parsed MoRI-IO side-channel address of w.
func zmqInfo(w *worker.Worker) (worker.ZMQAddr, bool) {
	z := w.ZMQ
	if (z.Host == "" || z.Handshake == 0 || z.Notify == 0) && w.ZMQAddress != "" {
		if p, err := worker.ParseZMQAddress(w.ZMQAddress); err == nil {
			z = p
		}
	}
	return z, z.Host != "" && z.Handshake > 0 && z.Notify > 0
}

// httpPort is the port of w's base URL (80/443 when implicit).
func httpPort(w *worker.Worker) int {
	_, p, err := net.SplitHostPort(w.HostPort())
	if err != nil {
		if strings.HasPrefix(w.URL, "https://") {
			return 443
		}
		return 80
	}
	n, _ := strconv.Atoi(p)
	return n
}

// ---------------------------------------------------------------------------
// NIXL

type nixl struct{}

func (nixl) Name() string                        { return ConnectorNIXL }
func (nixl) Order(*worker.Worker) Order          { return Sequential }
func (nixl) Eligible(*worker.Worker) error       { return nil }
func (nixl) Compatible(_, _ *worker.Worker) bool { return true }
func (nixl) TransferID([16]byte) string          { return "" }
func (nixl) NeedsPrefillParams(*Pair) bool       { return true }
func (nixl) PrefillParams(*Pair) []byte {
	o := &kvObj{}
	o.flag("do_remote_decode", true).flag("do_remote_prefill", false)
	o.raw("remote_engine_id", jsonNull).raw("remote_block_ids", jsonNull)
	o.raw("remote_host", jsonNull).raw("remote_port", jsonNull)
	return o.bytes()
}

// DecodeParams: D gets P's returned kv_transfer_params verbatim.
func (nixl) DecodeParams(_ *Pair, prefill []byte) ([]byte, error) {
	if err := requireObject(prefill); err != nil {
		return nil, err
	}
	return prefill, nil
}

// ---------------------------------------------------------------------------
// P2P-NCCL

type p2pnccl struct{}

func (p2pnccl) Name() string                        { return ConnectorP2PNCCL }
func (p2pnccl) Order(*worker.Worker) Order          { return Sequential }
func (p2pnccl) Eligible(*worker.Worker) error       { return nil }
func (p2pnccl) Compatible(_, _ *worker.Worker) bool { return true }
func (p2pnccl) TransferID([16]byte) string          { return "" }
func (p2pnccl) NeedsPrefillParams(*Pair) bool       { return false }
func (p2pnccl) PrefillParams(*Pair) []byte          { return nil } // field removed

// DecodeParams: the decode gets the original body minus any client-supplied
// kv_transfer_params; peers find each other through the addresses embedded
// in X-Request-Id.
func (p2pnccl) DecodeParams(*Pair, []byte) ([]byte, error) { return nil, nil }

// ---------------------------------------------------------------------------
// MoRI-IO

type moriio struct{}

func (moriio) Name() string { return ConnectorMoRIIO }

func isWrite(w *worker.Worker) bool { return strings.EqualFold(w.TransferMode, "WRITE") }

func (moriio) Order(p *worker.Worker) Order {
	if isWrite(p) {
		return Concurrent
	}
	return Sequential
}

func (moriio) Eligible(w *worker.Worker) error {
	if _, ok := zmqInfo(w); !ok {
		return fmt.Errorf("MoRI-IO worker %s has no registered zmq_address with handshake and notify ports "+
			"(MoRI-IO workers must register over ZMQ discovery; static workers cannot be paired)", w.Key())
	}
	switch strings.ToUpper(w.TransferMode) {
	case "READ", "WRITE":
		return nil
	}
	return fmt.Errorf("MoRI-IO worker %s has unknown transfer mode %q (want READ or WRITE)", w.Key(), w.TransferMode)
}

func (moriio) Compatible(p, d *worker.Worker) bool {
	return strings.EqualFold(p.TransferMode, d.TransferMode)
}

func (moriio) TransferID(u [16]byte) string { return "tx-" + hyphenated(u) }

func (moriio) NeedsPrefillParams(pr *Pair) bool { return !isWrite(pr.P) }

func (moriio) PrefillParams(pr *Pair) []byte {
	dz, _ := zmqInfo(pr.D)
	o := &kvObj{}
	o.flag("do_remote_decode", true).flag("do_remote_prefill", false)
	o.raw("remote_engine_id", jsonNull).raw("remote_block_ids", jsonNull)
	o.str("transfer_id", pr.TransferID)
	// tp_size is what vLLM's WRITE-mode prefill reads (get("tp_size", 1))
	// to map its TP ranks onto D's; remote_tp_size is kept for older builds.
	o.num("remote_dp_size", pr.D.DPSize).num("remote_tp_size", pr.D.TPSize).num("tp_size", pr.D.TPSize)
	o.str("remote_host", dz.Host).num("remote_port", httpPort(pr.D))
	o.num("remote_handshake_port", dz.Handshake).num("remote_notify_port", dz.Notify)
	return o.bytes()
}

// DecodeParams builds D's params from P's registration; in READ mode
// everything P returned is overlaid on top (opaque JSON: remote_block_ids
// may be [int] or [[int]], newer keys pass through).
func (moriio) DecodeParams(pr *Pair, prefill []byte) ([]byte, error) {
	pz, _ := zmqInfo(pr.P)
	o := &kvObj{}
	o.flag("do_remote_decode", false).flag("do_remote_prefill", true)
	o.str("transfer_id", pr.TransferID)
	o.raw("remote_engine_id", jsonNull).raw("remote_block_ids", jsonNull)
	o.num("remote_dp_size", pr.P.DPSize).num("remote_tp_size", pr.P.TPSize).num("tp_size", pr.P.TPSize)
	o.str("remote_host", pz.Host).num("remote_port", httpPort(pr.P))
	o.num("remote_handshake_port", pz.Handshake).num("remote_notify_port", pz.Notify)
	if pr.PRank >= 0 {
		o.num("remote_dp_rank", pr.PRank)
	}
	base := o.bytes()
	if isWrite(pr.P) {
		return base, nil
	}
	// READ: P's response must carry the block ids and engine id.
	if err := requireObject(prefill); err != nil {
		return nil, err
	}
	po, _ := rawjson.Parse(prefill)
	for _, k := range []string{"remote_engine_id", "remote_block_ids"} {
		if v := po.Get(k); v == nil || string(v) == "null" {
			return nil, fmt.Errorf("%w: READ mode needs %s in the prefill response's kv_transfer_params", errBadPrefillParams, k)
		}
	}
	return overlay(base, po), nil
}

// overlay sets every member of src onto the object base (last occurrence of
// a repeated key wins, key order of base kept, new keys appended in src
// order).
func overlay(base []byte, src *rawjson.Object) []byte {
	bo, err := rawjson.Parse(base)
	if err != nil {
		return base
	}
	ms := src.Members()
	last := make(map[string]int, len(ms))
	for i, m := range ms {
		last[m.Key] = i
	}
	edits := make([]rawjson.Edit, 0, len(ms))
	for i, m := range ms {
		if last[m.Key] == i {
			edits = append(edits, rawjson.Set(m.Key, m.Value))
		}
	}
	return bo.Apply(edits...)
}

// requireObject checks that P returned a non-null kv_transfer_params object.
func requireObject(v []byte) error {
	if v == nil {
		return fmt.Errorf("%w: the prefill response has no kv_transfer_params", errBadPrefillParams)
	}
	if string(v) == "null" {
		return fmt.Errorf("%w: the prefill response's kv_transfer_params is null (the first token was probably EOS or a stop string: finish_reason \"stop\"; send ignore_eos or min_tokens to avoid it)", errBadPrefillParams)
	}
	if !rawjson.IsObject(v) {
		return fmt.Errorf("%w: the prefill response's kv_transfer_params is not a JSON object", errBadPrefillParams)
	}
	return nil
}

// ---------------------------------------------------------------------------
// Mooncake

type mooncake struct{ boot *bootstrapper }

func (*mooncake) Name() string                        { return ConnectorMooncake }
func (*mooncake) Order(*worker.Worker) Order          { return Concurrent }
func (*mooncake) Compatible(_, _ *worker.Worker) bool { return true }
func (*mooncake) TransferID(u [16]byte) string        { return "xfer-" + hyphenated(u) }
func (*mooncake) NeedsPrefillParams(*Pair) bool       { return false }

func (m *mooncake) Eligible(w *worker.Worker) error {
	if w.Role != worker.RolePrefill {
		return nil
	}
	_, _, err := m.boot.lookup(w, w.DPRank)
	return err
}

// prefillRank implements rankChooser: a prefill the router believes is
// dp=1 but whose bootstrap server lists several ranks gets one per request
// (X-data-parallel-rank on P, that rank's engine_id for D).
func (m *mooncake) prefillRank(p *worker.Worker) int { return m.boot.pickRank(p) }

func (*mooncake) PrefillParams(pr *Pair) []byte {
	o := &kvObj{}
	o.flag("do_remote_decode", true).flag("do_remote_prefill", false).str("transfer_id", pr.TransferID)
	return o.bytes()
}

func (m *mooncake) DecodeParams(pr *Pair, _ []byte) ([]byte, error) {
	addr, engine, err := m.boot.lookup(pr.P, pr.PRank)
	if err != nil {
		return nil, err
	}
	o := &kvObj{}
	o.flag("do_remote_decode", false).flag("do_remote_prefill", true)
	o.str("remote_bootstrap_addr", addr).str("remote_engine_id", engine)
	o.str("transfer_id", pr.TransferID)
	return o.bytes(), nil
}
