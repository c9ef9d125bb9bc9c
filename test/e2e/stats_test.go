package e2e

import (
	"bytes"
	"encoding/json"
	"net/http"
	"testing"
	"time"
)

// simStats is the subset of vllm-sim's GET /sim/stats the tests read.
type simStats struct {
	Requests struct {
		Completions     int64 `json:"completions"`
		ChatCompletions int64 `json:"chat_completions"`
		Responses       int64 `json:"responses"`
		PrefillLeg      int64 `json:"prefill_leg"`
		DecodeLeg       int64 `json:"decode_leg"`
		Plain           int64 `json:"plain"`
		Aborted         int64 `json:"aborted"`
		InFlight        int64 `json:"in_flight"`
	} `json:"requests"`
	Running       int `json:"running"`
	Waiting       int `json:"waiting"`
	WaitingRemote int `json:"waiting_for_remote_kv"`
	KVBlocksUsed  int `json:"kv_blocks_used"`
	Transfers     struct {
		Completed             int64  `json:"completed"`
		Failed                int64  `json:"failed"`
		Pending               int    `json:"pending"`
		ReadsFailed           int64  `json:"reads_failed"`
		ReadsUnmatched        int64  `json:"reads_unmatched"`
		DeferExpired          int64  `json:"defer_expired"`
		KVDigestMismatch      int64  `json:"kv_digest_mismatch"`
		KVGarbage             int64  `json:"kv_garbage"`
		ProtocolViolations    int64  `json:"protocol_violations"`
		LastProtocolViolation string `json:"last_protocol_violation"`
	} `json:"transfers"`
	Engines []struct {
		DPRank       int    `json:"dp_rank"`
		KVBlocksUsed int    `json:"kv_blocks_used"`
		Steps        uint64 `json:"steps"`
	} `json:"engines"`
}

// assertClean fails the test if the simulator saw a failed or corrupted KV
// transfer or a PD protocol violation (the PD sims run with --strict, so a
// violation also turned into a 400 somewhere).
func (s *sim) assertClean(t *testing.T) {
	t.Helper()
	st := s.stats(t)
	tr := st.Transfers
	if tr.Failed != 0 || tr.ReadsFailed != 0 || tr.ReadsUnmatched != 0 || tr.KVGarbage != 0 || tr.KVDigestMismatch != 0 || tr.ProtocolViolations != 0 {
		t.Fatalf("%s %s: transfers.failed %d, reads_failed %d, reads_unmatched %d, kv_garbage %d, kv_digest_mismatch %d, protocol_violations %d (last: %q)",
			s.info.Role, s.URL(), tr.Failed, tr.ReadsFailed, tr.ReadsUnmatched, tr.KVGarbage, tr.KVDigestMismatch, tr.ProtocolViolations, tr.LastProtocolViolation)
	}
}

func (s *sim) stats(t *testing.T) simStats {
	t.Helper()
	var st simStats
	if code := getJSON(t, s.URL()+"/sim/stats", &st); code != 200 {
		t.Fatalf("/sim/stats: %d", code)
	}
	return st
}

func (s *sim) setFaults(t *testing.T, faults map[string]any) {
	t.Helper()
	b, _ := json.Marshal(faults)
	resp, err := http.Post(s.URL()+"/sim/faults", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/sim/faults: %d", resp.StatusCode)
	}
}

// waitFor polls cond every 5 ms until it holds or d passes; it returns how
// long it took, or fails the test.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		if cond() {
			return time.Since(start)
		}
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
