package zmq

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

	"github.com/switchyard-llm/switchyard/internal/mpread"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// Registration formats (worker.Spec.Format and the "format" metric label).
const (
	FormatP2PNCCL   = "p2pnccl"    // {type, http_address, zmq_address}
	FormatMoRIIONew = "moriio-new" // P2P-NCCL keys + dp_size, tp_size, transfer_mode
	FormatMoRIIOOld = "moriio-old" // {type: register, role, request_address, ports, ...}
)

// MoRI-IO transfer modes.
const (
	ModeRead  = "READ"
	ModeWrite = "WRITE"
)

// Drop reasons: the "reason" label of vllm_router_discovery_dropped_total.
const (
	ReasonDecode              = "decode"                // payload is not one msgpack value
	ReasonNotMap              = "not_map"               // msgpack, but not a map
	ReasonMissingKey          = "missing_key"           // a required key is absent (or nil)
	ReasonBadType             = "bad_type"              // a value has the wrong msgpack type
	ReasonBadValue            = "bad_value"             // a number out of range (dp_size 0, ...)
	ReasonUnknownType         = "unknown_type"          // "type" (or old-format "role") not understood
	ReasonUnknownTransferMode = "unknown_transfer_mode" // transfer_mode not READ/WRITE
	ReasonBadAddress          = "bad_address"           // http_address/zmq_address/request_address invalid
	ReasonHello               = "hello"                 // {"type": "HELLO"}, ignored by design
	ReasonOversized           = "oversized"             // payload or ZMTP frame over MaxMessageBytes
	ReasonFrames              = "frames"                // not exactly [identity, payload]
	ReasonCommand             = "command"               // ZMTP command (heartbeat PING, ...)
	ReasonConnector           = "connector"             // valid, but not what the configured connector needs
	ReasonTooManyInstances    = "too_many_instances"    // MaxInstances reached
	ReasonConflict            = "conflict"              // a static/admin worker already has this URL
	ReasonHandshake           = "handshake"             // ZMTP handshake failed or timed out
	ReasonConnections         = "connections"           // connection refused: too many open
	ReasonInternal            = "internal"              // a bug: a handler panicked (recovered)
	ReasonModelPending        = "model_pending"         // --enable-igw: the instance's model is not known yet
)

// Bounds on numbers a registration may carry; ExpandDP allocates dp_size
// workers, so an unbounded dp_size would be a memory bomb.
const (
	maxDPSize = 1024
	maxTPSize = 1 << 16
)

// Registration is one parsed registration/heartbeat message.
type Registration struct {
	Role         worker.Role // RolePrefill or RoleDecode
	HTTPAddress  string      // host:port of the OpenAI server; the instance key
	ZMQAddress   string      // as registered, or synthesised for the old format
	ZMQ          worker.ZMQAddr
	DPSize       int    // >= 1
	TPSize       int    // >= 1
	TransferMode string // "READ", "WRITE", or "" when the message has none
	Format       string // FormatP2PNCCL, FormatMoRIIONew or FormatMoRIIOOld
	// ModelID is the model the instance serves (--enable-igw): not part of
	// the message, set by the Listener from Options.Model.
	ModelID string
}

// ParseError is why a message was dropped; Reason is a metric label.
type ParseError struct {
	Reason string
	Detail string
}

func (e *ParseError) Error() string {
	if e.Detail == "" {
		return "discovery message dropped: " + e.Reason
	}
	return "discovery message dropped: " + e.Reason + ": " + e.Detail
}

func dropf(reason, format string, args ...any) error {
	return &ParseError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// ReasonOf returns the drop reason of err (ReasonDecode if err carries none).
func ReasonOf(err error) string {
	if pe, ok := errors.AsType[*ParseError](err); ok {
		return pe.Reason
	}
	return ReasonDecode
}

// value is one decoded map value: a string (msgpack str or bin), an integer,
// nil, or something else (kind other).
type value struct {
	kind valueKind
	s    string
	n    int64
}

type valueKind uint8

const (
	kindNil valueKind = iota
	kindString
	kindInt
	kindFloat // integral floats are accepted as numbers
	kindOther
)

// ParseRegistration decodes one discovery payload. It accepts the P2P-NCCL
// format, both MoRI-IO formats, strings as msgpack str or bin and numbers as
// msgpack int or decimal strings; unknown keys are ignored. Every failure is
// a *ParseError whose Reason is a drop-reason label. It never panics.
func ParseRegistration(b []byte) (Registration, error) {
	fields, err := decodeMap(b)
	if err != nil {
		return Registration{}, err
	}
	typ, err := stringField(fields, "type")
	if err != nil {
		return Registration{}, err
	}
	switch strings.ToUpper(typ) {
	case "HELLO":
		return Registration{}, &ParseError{Reason: ReasonHello}
	case "REGISTER":
		return parseOld(fields)
	case "P", "D", "PREFILL", "DECODE":
		return parseNew(fields, typ)
	}
	return Registration{}, dropf(ReasonUnknownType, "type %q", clip(typ))
}

func parseNew(f map[string]value, typ string) (Registration, error) {
	r := Registration{Format: FormatP2PNCCL, DPSize: 1, TPSize: 1}
	var err error
	if r.Role, err = parseRole(typ); err != nil {
		return r, err
	}
	if r.HTTPAddress, err = stringField(f, "http_address"); err != nil {
		return r, err
	}
	if r.HTTPAddress, err = checkHTTPAddress(r.HTTPAddress); err != nil {
		return r, err
	}
	if r.ZMQAddress, err = stringField(f, "zmq_address"); err != nil {
		return r, err
	}
	if r.ZMQ, err = worker.ParseZMQAddress(r.ZMQAddress); err != nil {
		return r, dropf(ReasonBadAddress, "%v", err)
	}
	// The MoRI-IO additions come together; a message with some of them is a
	// broken new-format message, not a P2P-NCCL one.
	present := 0
	for _, k := range []string{"dp_size", "tp_size", "transfer_mode"} {
		if f[k].kind != kindNil {
			present++
		}
	}
	switch present {
	case 0:
		return r, nil
	case 3:
		r.Format = FormatMoRIIONew
	default:
		for _, k := range []string{"dp_size", "tp_size", "transfer_mode"} {
			if f[k].kind == kindNil {
				return r, dropf(ReasonMissingKey, "%s", k)
			}
		}
	}
	return r, parseMoRIFields(f, &r)
}

func parseOld(f map[string]value) (Registration, error) {
	r := Registration{Format: FormatMoRIIOOld, DPSize: 1, TPSize: 1}
	role, err := stringField(f, "role")
	if err != nil {
		return r, err
	}
	if r.Role, err = parseRole(role); err != nil {
		return r, err
	}
	ra, err := stringField(f, "request_address")
	if err != nil {
		return r, err
	}
	hp, err := intField(f, "handshake_port")
	if err != nil {
		return r, err
	}
	np, err := intField(f, "notify_port")
	if err != nil {
		return r, err
	}
	// "http://ip:port/v1/completions": keep host:port, drop the path.
	u, err := url.Parse(ra)
	if err != nil || u.Scheme != "http" || u.User != nil || u.Port() == "" || u.Hostname() == "" {
		return r, dropf(ReasonBadAddress, "request_address %q is not http://host:port/...", clip(ra))
	}
	if r.HTTPAddress, err = checkHTTPAddress(u.Host); err != nil {
		return r, err
	}
	if !validPort(hp) || !validPort(np) {
		return r, dropf(ReasonBadAddress, "handshake_port %d / notify_port %d", hp, np)
	}
	r.ZMQAddress = "host:" + u.Hostname() + ",handshake:" + strconv.FormatInt(hp, 10) + ",notify:" + strconv.FormatInt(np, 10)
	if r.ZMQ, err = worker.ParseZMQAddress(r.ZMQAddress); err != nil {
		return r, dropf(ReasonBadAddress, "%v", err)
	}
	// The old format always came from MoRI-IO, but dp_size/tp_size were
	// optional in early connectors: default 1. transfer_mode is checked
	// against the connector by the listener.
	return r, parseMoRIFields(f, &r)
}

// parseMoRIFields fills dp_size, tp_size (default 1 when absent) and
// transfer_mode (left "" when absent).
func parseMoRIFields(f map[string]value, r *Registration) error {
	for _, k := range []string{"dp_size", "tp_size"} {
		if f[k].kind == kindNil {
			continue
		}
		n, err := intField(f, k)
		if err != nil {
			return err
		}
		limit := int64(maxDPSize)
		if k == "tp_size" {
			limit = maxTPSize
		}
		if n < 1 || n > limit {
			return dropf(ReasonBadValue, "%s %d out of range [1, %d]", k, n, limit)
		}
		if k == "dp_size" {
			r.DPSize = int(n)
		} else {
			r.TPSize = int(n)
		}
	}
	if f["transfer_mode"].kind == kindNil {
		return nil
	}
	m, err := stringField(f, "transfer_mode")
	if err != nil {
		return err
	}
	switch up := strings.ToUpper(strings.TrimSpace(m)); up {
	case ModeRead, ModeWrite:
		r.TransferMode = up
	default:
		return dropf(ReasonUnknownTransferMode, "transfer_mode %q", clip(m))
	}
	return nil
}

func parseRole(s string) (worker.Role, error) {
	switch strings.ToUpper(s) {
	case "P", "PREFILL":
		return worker.RolePrefill, nil
	case "D", "DECODE":
		return worker.RoleDecode, nil
	}
	return worker.RoleRegular, dropf(ReasonUnknownType, "role %q", clip(s))
}

// checkHTTPAddress validates "host:port" (no scheme, no path; IPv6 in
// brackets) and rejects unspecified hosts, which a router cannot dial.
func checkHTTPAddress(s string) (string, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" {
		return "", dropf(ReasonBadAddress, "http_address %q is not host:port", clip(s))
	}
	p, err := strconv.Atoi(port)
	if err != nil || !validPort(int64(p)) {
		return "", dropf(ReasonBadAddress, "http_address %q: bad port", clip(s))
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.IsUnspecified() || ip.Zone() != "" {
			return "", dropf(ReasonBadAddress, "http_address %q: unspecified or zoned host", clip(s))
		}
	} else if !validHostname(host) {
		return "", dropf(ReasonBadAddress, "http_address %q: bad host", clip(s))
	}
	// Canonical form: JoinHostPort re-brackets IPv6 hosts.
	return net.JoinHostPort(host, strconv.Itoa(p)), nil
}

func validHostname(h string) bool {
	if len(h) > 253 {
		return false
	}
	for i := 0; i < len(h); i++ {
		c := h[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_') {
			return false
		}
	}
	return true
}

func validPort(p int64) bool { return p > 0 && p <= 65535 }

func stringField(f map[string]value, k string) (string, error) {
	v := f[k]
	switch v.kind {
	case kindNil:
		return "", dropf(ReasonMissingKey, "%s", k)
	case kindString:
		return v.s, nil
	}
	return "", dropf(ReasonBadType, "%s is not a string", k)
}

func intField(f map[string]value, k string) (int64, error) {
	v := f[k]
	switch v.kind {
	case kindNil:
		return 0, dropf(ReasonMissingKey, "%s", k)
	case kindInt, kindFloat:
		return v.n, nil
	case kindString:
		n, err := strconv.ParseInt(strings.TrimSpace(v.s), 10, 64)
		if err != nil {
			return 0, dropf(ReasonBadType, "%s %q is not an integer", k, clip(v.s))
		}
		return n, nil
	}
	return 0, dropf(ReasonBadType, "%s is not a number", k)
}

// clip bounds attacker-controlled text that ends up in logs (always
// formatted with %q, which escapes it).
func clip(s string) string {
	const n = 64
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// wanted lists the keys whose values are decoded; other values are skipped
// without allocating.
var wanted = map[string]bool{
	"type": true, "http_address": true, "zmq_address": true, "dp_size": true, "tp_size": true,
	"transfer_mode": true, "role": true, "request_address": true, "handshake_port": true, "notify_port": true,
}

// decodeMap decodes a top-level msgpack map with string (str or bin) keys.
//
// Payloads come from anyone who can reach the discovery port, so decoding
// goes through mpread, which checks every declared length and count
// against the bytes remaining before anything is read or allocated (the
// msgpack.Decoder it replaces grew its pooled buffer towards a declared
// size: a 5-byte "4 GiB string" cost hundreds of MiB). Allocation is
// bounded by the payload size (strings of the wanted keys and the small
// fields map); skipped values may nest to any depth.
func decodeMap(b []byte) (map[string]value, error) {
	if len(b) == 0 {
		return nil, dropf(ReasonDecode, "empty payload")
	}
	r := mpread.NewReader(b)
	if mpread.FamilyOf(b[0]) != mpread.Map {
		if err := r.Skip(mpread.NoDepthLimit); err != nil {
			return nil, dropf(ReasonDecode, "%v", err)
		}
		if r.Remaining() != 0 {
			return nil, dropf(ReasonDecode, "not one msgpack value")
		}
		return nil, dropf(ReasonNotMap, "top-level code 0x%02x", b[0])
	}
	n, err := r.MapLen() // <= remaining/2
	if err != nil {
		return nil, dropf(ReasonDecode, "%v", err)
	}
	fields := make(map[string]value, min(n, len(wanted)))
	var typeErr error
	for range n {
		if err := readEntry(r, fields, &typeErr); err != nil {
			return nil, err
		}
	}
	if r.Remaining() != 0 {
		return nil, dropf(ReasonDecode, "%d trailing bytes after the map", r.Remaining())
	}
	if typeErr != nil {
		return nil, typeErr
	}
	return fields, nil
}

// readEntry reads one key/value pair into fields if the key is wanted. A
// non-string key is skipped with its value; the type error is kept in
// *typeErr (the first one only), reported once the whole payload decoded.
func readEntry(r *mpread.Reader, fields map[string]value, typeErr *error) error {
	kc, err := r.Peek()
	if err != nil {
		return dropf(ReasonDecode, "map key: %v", err)
	}
	if f := mpread.FamilyOf(kc); f != mpread.Str && f != mpread.Bin {
		if err := r.Skip(mpread.NoDepthLimit); err != nil {
			return dropf(ReasonDecode, "map key: %v", err)
		}
		if err := r.Skip(mpread.NoDepthLimit); err != nil {
			return dropf(ReasonDecode, "map value: %v", err)
		}
		if *typeErr == nil {
			*typeErr = dropf(ReasonBadType, "map key of code 0x%02x is not a string", kc)
		}
		return nil
	}
	k, _, err := r.StrOrBin()
	if err != nil {
		return dropf(ReasonDecode, "map key: %v", err)
	}
	if !wanted[string(k)] { // no allocation for the lookup
		if err := r.Skip(mpread.NoDepthLimit); err != nil {
			return dropf(ReasonDecode, "map value: %v", err)
		}
		return nil
	}
	v, err := readValue(r)
	if err != nil {
		return dropf(ReasonDecode, "map value: %v", err)
	}
	fields[string(k)] = v
	return nil
}

// readValue decodes one wanted map value: str/bin as a string, int/uint as
// an integer (uint64 clamped to MaxInt64), an integral float (|f| < 2^53)
// as a number; anything else (bool, float with a fraction, containers,
// ext) is skipped and reported as kindOther.
func readValue(r *mpread.Reader) (value, error) {
	c, err := r.Peek()
	if err != nil {
		return value{}, err
	}
	var v value
	switch mpread.FamilyOf(c) {
	case mpread.Nil:
		r.Nil()
	case mpread.Str, mpread.Bin:
		s, _, err := r.StrOrBin()
		v.kind, v.s = kindString, string(s)
		return v, err
	case mpread.Int, mpread.Uint:
		u, neg, err := r.Integer()
		v.kind, v.n = kindInt, int64(min(u, math.MaxInt64))
		if neg {
			v.n = int64(u)
		}
		return v, err
	case mpread.Float:
		f, err := r.Float()
		v.kind = kindOther
		if f == math.Trunc(f) && math.Abs(f) < 1<<53 {
			v.kind, v.n = kindFloat, int64(f)
		}
		return v, err
	default:
		v.kind = kindOther
		return v, r.Skip(mpread.NoDepthLimit)
	}
	return v, nil
}
