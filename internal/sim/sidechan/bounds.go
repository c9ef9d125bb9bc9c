package sidechan

import "github.com/switchyard-llm/switchyard/internal/mpread"

// maxDepth bounds the nesting of a side-channel message: the protocol's
// deepest is a map holding lists.
const maxDepth = 32

// checkBounds walks the first msgpack value of b and fails when a declared
// string, binary or extension length, or an array or map count, cannot fit
// in the bytes that follow it, or the nesting is deeper than maxDepth. The
// msgpack decoder allocates what a header declares (up to a megabyte per
// value) before it finds the payload short: a 16-byte message declaring a
// 3.6 GB string cost a megabyte, and a fuzzer's stream of them grew a
// process to gigabytes. Checked first, no value can declare more than the
// payload holds.
func checkBounds(b []byte) error {
	return mpread.NewReader(b).Skip(maxDepth)
}
