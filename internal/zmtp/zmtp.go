// Package zmtp is the ZMTP 3.0 framing (rfc.zeromq.org/spec/23) that the
// router's ZeroMQ peers share: the KV-event subscription and replay
// (internal/kvevents), the registration listener's guard
// (internal/discovery/zmq) and vllm-sim's event publisher (internal/sim).
// It builds frames, commands and READY properties, and follows the frame
// boundaries of a byte stream fed in pieces of any size.
package zmtp

import "encoding/binary"

// Frame flags.
const (
	FlagMore    = 0x01 // more frames of this message follow
	FlagLong    = 0x02 // the size is 8 bytes, not 1
	FlagCommand = 0x04 // a command, not a message frame
)

// AppendFrameHeader appends the header of a frame of flags and a body of
// n bytes, with the size in the short or the long form.
func AppendFrameHeader(dst []byte, flags byte, n int) []byte {
	if n > 255 {
		dst = append(dst, flags|FlagLong)
		return binary.BigEndian.AppendUint64(dst, uint64(n))
	}
	return append(dst, flags, byte(n))
}

// AppendFrame appends a frame of flags and body.
func AppendFrame(dst []byte, flags byte, body []byte) []byte {
	return append(AppendFrameHeader(dst, flags, len(body)), body...)
}

// AppendProperty appends a READY metadata property.
func AppendProperty(dst []byte, name, value string) []byte {
	dst = append(dst, byte(len(name)))
	dst = append(dst, name...)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(value)))
	return append(dst, value...)
}

// IsCommand reports whether a command frame's body is the command name.
func IsCommand(body []byte, name string) bool {
	return len(body) >= 1+len(name) && int(body[0]) == len(name) && string(body[1:1+len(name)]) == name
}

// Scanner follows the frames of a ZMTP byte stream after its greeting, fed
// in pieces of any size. The zero value is at the start of a frame.
type Scanner struct {
	hdr  [9]byte
	hlen int
	skip uint64 // body bytes of the current frame still to come
	last byte   // flags of the last frame whose header was complete
}

// Skip passes the next n bytes over without reading them as frames (a
// 64-byte greeting).
func (s *Scanner) Skip(n uint64) { s.skip += n }

// Feed advances over b. Each frame's flags and body size are handed to
// header (when not nil) as soon as its header is complete; an error from
// header stops the scan and is returned.
func (s *Scanner) Feed(b []byte, header func(flags byte, size uint64) error) error {
	for len(b) > 0 {
		if s.skip > 0 {
			k := min(s.skip, uint64(len(b)))
			s.skip -= k
			b = b[k:]
			continue
		}
		s.hdr[s.hlen] = b[0]
		s.hlen++
		b = b[1:]
		need := 2
		if s.hdr[0]&FlagLong != 0 {
			need = 9
		}
		if s.hlen < need {
			continue
		}
		size := uint64(s.hdr[1])
		if need == 9 {
			size = binary.BigEndian.Uint64(s.hdr[1:9])
		}
		s.skip, s.hlen, s.last = size, 0, s.hdr[0]
		if header != nil {
			if err := header(s.last, size); err != nil {
				return err
			}
		}
	}
	return nil
}

// AtMessageEnd reports whether the bytes fed so far end where a message
// or a command does (a command has no MORE).
func (s *Scanner) AtMessageEnd() bool {
	return s.hlen == 0 && s.skip == 0 && (s.last&FlagMore == 0 || s.last&FlagCommand != 0)
}
