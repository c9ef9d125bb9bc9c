package pd

import (
	"crypto/rand"
	"encoding/hex"
)

// randomUUID returns 16 random bytes from crypto/rand.
func randomUUID() [16]byte {
	var u [16]byte
	_, _ = rand.Read(u[:]) // crypto/rand.Read never fails on supported platforms
	return u
}

// asV4 sets the version (4) and variant (RFC 9562) bits, so every id the
// engine emits is a well-formed UUIDv4 whatever NewID returned.
func asV4(u [16]byte) [16]byte {
	u[6] = (u[6] & 0x0f) | 0x40
	u[8] = (u[8] & 0x3f) | 0x80
	return u
}

// hex32 is the UUID as 32 lowercase hex digits (Python's uuid4().hex).
func hex32(u [16]byte) string { return hex.EncodeToString(u[:]) }

// hyphenated is the canonical 8-4-4-4-12 form (Python's str(uuid4())).
func hyphenated(u [16]byte) string {
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:36], u[10:16])
	return string(b[:])
}

// requestID builds the X-Request-Id both legs carry (PROTOCOL §2.4):
// ___prefill_addr_{P}___decode_addr_{D}_{32 lowercase hex}.
func requestID(pAddr, dAddr string, u [16]byte) string {
	return "___prefill_addr_" + pAddr + "___decode_addr_" + dAddr + "_" + hex32(u)
}
