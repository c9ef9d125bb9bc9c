package zmq

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"net/url"
	"strconv"
	"strings"

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
// never trusts a declared length: every str/bin/ext length and every
// array/map count is checked against the bytes actually remaining before
// anything is read or allocated (see mpReader). Allocation is bounded by
// the payload size (strings of the wanted keys and the small fields map).
func decodeMap(b []byte) (map[string]value, error) {
	if len(b) == 0 {
		return nil, dropf(ReasonDecode, "empty payload")
	}
	r := mpReader{b: b}
	t, err := r.next()
	if err != nil {
		return nil, dropf(ReasonDecode, "%v", err)
	}
	if t.kind != mpMap {
		if err := r.skipChildren(t); err != nil {
			return nil, dropf(ReasonDecode, "%v", err)
		}
		if r.remaining() != 0 {
			return nil, dropf(ReasonDecode, "not one msgpack value")
		}
		return nil, dropf(ReasonNotMap, "top-level code 0x%02x", b[0])
	}
	n := t.n // <= remaining/2, checked by next
	fields := make(map[string]value, min(n, len(wanted)))
	var typeErr error
	for range n {
		kc := r.peek()
		k, err := r.next()
		if err != nil {
			return nil, dropf(ReasonDecode, "map key: %v", err)
		}
		if k.kind != mpStr {
			// A non-string key: skip it and its value; remember the type
			// error, but only report it once the whole payload decoded.
			if err := r.skipChildren(k); err != nil {
				return nil, dropf(ReasonDecode, "map key: %v", err)
			}
			if err := r.skip(); err != nil {
				return nil, dropf(ReasonDecode, "map value: %v", err)
			}
			if typeErr == nil {
				typeErr = dropf(ReasonBadType, "map key of code 0x%02x is not a string", kc)
			}
			continue
		}
		if !wanted[string(k.data)] { // no allocation for the lookup
			if err := r.skip(); err != nil {
				return nil, dropf(ReasonDecode, "map value: %v", err)
			}
			continue
		}
		v, err := r.value()
		if err != nil {
			return nil, dropf(ReasonDecode, "map value: %v", err)
		}
		fields[string(k.data)] = v
	}
	if r.remaining() != 0 {
		return nil, dropf(ReasonDecode, "%d trailing bytes after the map", r.remaining())
	}
	if typeErr != nil {
		return nil, typeErr
	}
	return fields, nil
}

// mpReader is a minimal bounds-checked msgpack reader over one payload. It
// replaces msgpack.Decoder here because the latter reads a declared str,
// bin or ext length before it knows the payload holds it, growing its
// (pooled) buffer towards the declared size: a 5-byte "4 GiB string"
// (db ff ff ff ff) costs hundreds of MiB. mpReader never allocates: str,
// bin and ext data are sub-slices of the payload, and every declared
// length is checked against the remaining bytes first.
type mpReader struct {
	b   []byte
	off int
}

// mpKind is the kind of one msgpack token.
type mpKind uint8

const (
	mpNil mpKind = iota
	mpBool
	mpInt   // int family and positive/negative fixint; value in i
	mpUint  // uint family; value in u
	mpFloat // float32 and float64; value in f
	mpStr   // str and bin; bytes in data
	mpExt   // ext and fixext; bytes in data (type byte excluded)
	mpArray // n elements follow
	mpMap   // n key/value pairs follow
)

// mpToken is one msgpack header with its scalar payload.
type mpToken struct {
	kind mpKind
	n    int // array/map element count
	i    int64
	u    uint64
	f    float64
	data []byte // sub-slice of the payload: never copied
}

var (
	errTruncated = errors.New("truncated msgpack value")
	errBadLength = errors.New("declared length exceeds the payload")
	errBadCode   = errors.New("invalid msgpack code 0xc1")
)

func (r *mpReader) remaining() int { return len(r.b) - r.off }

// peek returns the next code byte (0xc1, never valid, at the end).
func (r *mpReader) peek() byte {
	if r.off < len(r.b) {
		return r.b[r.off]
	}
	return 0xc1
}

// take returns the next n bytes; n must be <= remaining (checked by the
// callers through uintN and length).
func (r *mpReader) take(n int) []byte {
	p := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return p
}

// uintN reads a big-endian unsigned integer of size bytes (1, 2, 4, 8).
func (r *mpReader) uintN(size int) (uint64, error) {
	if r.remaining() < size {
		return 0, errTruncated
	}
	p := r.take(size)
	switch size {
	case 1:
		return uint64(p[0]), nil
	case 2:
		return uint64(binary.BigEndian.Uint16(p)), nil
	case 4:
		return uint64(binary.BigEndian.Uint32(p)), nil
	}
	return binary.BigEndian.Uint64(p), nil
}

// length reads a size-byte length and checks that at least min(length) *
// per bytes remain (per = 1 for str/bin/array, 2 for maps: every element
// takes at least one byte), so no count or length can exceed the payload.
func (r *mpReader) length(size int, per uint64) (int, error) {
	l, err := r.uintN(size)
	if err != nil {
		return 0, err
	}
	if l > uint64(r.remaining())/per {
		return 0, errBadLength
	}
	return int(l), nil
}

// data reads a size-byte length and then that many bytes.
func (r *mpReader) data(size int) ([]byte, error) {
	l, err := r.length(size, 1)
	if err != nil {
		return nil, err
	}
	return r.take(l), nil
}

// ext reads an ext body: the type byte then l data bytes.
func (r *mpReader) ext(l int) ([]byte, error) {
	if r.remaining() < 1 || l > r.remaining()-1 {
		return nil, errBadLength
	}
	r.off++ // ext type
	return r.take(l), nil
}

// next reads one token. For containers only the header is read; their
// elements are the following tokens.
func (r *mpReader) next() (mpToken, error) {
	if r.remaining() < 1 {
		return mpToken{}, errTruncated
	}
	c := r.b[r.off]
	r.off++
	var t mpToken
	var err error
	var u uint64
	switch {
	case c <= 0x7f: // positive fixint
		t.kind, t.i = mpInt, int64(c)
	case c >= 0xe0: // negative fixint
		t.kind, t.i = mpInt, int64(int8(c))
	case c <= 0x8f: // fixmap
		t.kind, t.n = mpMap, int(c&0x0f)
		if uint64(t.n)*2 > uint64(r.remaining()) {
			err = errBadLength
		}
	case c <= 0x9f: // fixarray
		t.kind, t.n = mpArray, int(c&0x0f)
		if t.n > r.remaining() {
			err = errBadLength
		}
	case c <= 0xbf: // fixstr
		t.kind = mpStr
		if n := int(c & 0x1f); n > r.remaining() {
			err = errBadLength
		} else {
			t.data = r.take(n)
		}
	default:
		switch c {
		case 0xc0:
			t.kind = mpNil
		case 0xc1:
			err = errBadCode
		case 0xc2, 0xc3:
			t.kind, t.i = mpBool, int64(c-0xc2)
		case 0xc4, 0xc5, 0xc6: // bin 8/16/32
			t.kind = mpStr
			t.data, err = r.data(1 << (c - 0xc4))
		case 0xc7, 0xc8, 0xc9: // ext 8/16/32
			t.kind = mpExt
			var l int
			if l, err = r.length(1<<(c-0xc7), 1); err == nil {
				t.data, err = r.ext(l)
			}
		case 0xca: // float32
			t.kind = mpFloat
			if u, err = r.uintN(4); err == nil {
				t.f = float64(math.Float32frombits(uint32(u)))
			}
		case 0xcb: // float64
			t.kind = mpFloat
			if u, err = r.uintN(8); err == nil {
				t.f = math.Float64frombits(u)
			}
		case 0xcc, 0xcd, 0xce, 0xcf: // uint 8/16/32/64
			t.kind = mpUint
			t.u, err = r.uintN(1 << (c - 0xcc))
		case 0xd0, 0xd1, 0xd2, 0xd3: // int 8/16/32/64
			t.kind = mpInt
			size := 1 << (c - 0xd0)
			if u, err = r.uintN(size); err == nil {
				shift := 64 - 8*size // sign-extend
				t.i = int64(u<<shift) >> shift
			}
		case 0xd4, 0xd5, 0xd6, 0xd7, 0xd8: // fixext 1/2/4/8/16
			t.kind = mpExt
			t.data, err = r.ext(1 << (c - 0xd4))
		case 0xd9, 0xda, 0xdb: // str 8/16/32
			t.kind = mpStr
			t.data, err = r.data(1 << (c - 0xd9))
		case 0xdc, 0xdd: // array 16/32
			t.kind = mpArray
			t.n, err = r.length(2<<(c-0xdc), 1)
		case 0xde, 0xdf: // map 16/32
			t.kind = mpMap
			t.n, err = r.length(2<<(c-0xde), 2)
		}
	}
	if err != nil {
		return mpToken{}, err
	}
	return t, nil
}

// skip skips one msgpack value.
func (r *mpReader) skip() error {
	t, err := r.next()
	if err != nil {
		return err
	}
	return r.skipChildren(t)
}

// skipChildren skips the elements of container t (nothing for a scalar),
// iteratively: nesting depth cannot exhaust the stack.
func (r *mpReader) skipChildren(t mpToken) error {
	pending := 0 // elements still to skip; never more than the bytes left
	for {
		switch t.kind {
		case mpArray:
			pending += t.n
		case mpMap:
			pending += 2 * t.n
		}
		// Every element takes at least one byte.
		if pending > r.remaining() {
			return errBadLength
		}
		if pending == 0 {
			return nil
		}
		pending--
		var err error
		if t, err = r.next(); err != nil {
			return err
		}
	}
}

// value decodes one wanted map value: str/bin as a string, int/uint as an
// integer (uint64 clamped to MaxInt64), an integral float (|f| < 2^53) as a
// number; anything else (bool, float with a fraction, containers, ext) is
// skipped and reported as kindOther.
func (r *mpReader) value() (value, error) {
	t, err := r.next()
	if err != nil {
		return value{}, err
	}
	var v value
	switch t.kind {
	case mpNil:
	case mpStr:
		v.kind, v.s = kindString, string(t.data)
	case mpInt:
		v.kind, v.n = kindInt, t.i
	case mpUint:
		v.kind, v.n = kindInt, int64(min(t.u, math.MaxInt64))
	case mpFloat:
		v.kind = kindOther
		if t.f == math.Trunc(t.f) && math.Abs(t.f) < 1<<53 {
			v.kind, v.n = kindFloat, int64(t.f)
		}
	default:
		v.kind = kindOther
		if err := r.skipChildren(t); err != nil {
			return value{}, err
		}
	}
	return v, nil
}
