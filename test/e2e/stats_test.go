package e2e

import (
	"testing"
)

// assertClean fails the test if the simulator saw a failed or corrupted KV
// transfer or a PD protocol violation (the PD sims run with --strict, so a
// violation also turned into a 400 somewhere).
func (s *sim) assertClean(t *testing.T) {
	t.Helper()
	st := s.Stats(t)
	tr := st.Transfers
	if tr.Failed != 0 || tr.ReadsFailed != 0 || tr.ReadsUnmatched != 0 || tr.KVGarbage != 0 || tr.KVDigestMismatch != 0 || tr.ProtocolViolations != 0 {
		t.Fatalf("%s %s: transfers.failed %d, reads_failed %d, reads_unmatched %d, kv_garbage %d, kv_digest_mismatch %d, protocol_violations %d (last: %q)",
			s.Info.Role, s.URL(), tr.Failed, tr.ReadsFailed, tr.ReadsUnmatched, tr.KVGarbage, tr.KVDigestMismatch, tr.ProtocolViolations, tr.LastProtocolViolation)
	}
}
