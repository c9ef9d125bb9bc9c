package app

import (
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// R6: --prefill-data-parallel-size / --decode-data-parallel-size expand the
// static --prefill / --decode lists separately, so P dp=2 / D dp=1 never
// sends X-data-parallel-rank 1 to a dp=1 decode.
func TestStaticWorkersRoleDPSizes(t *testing.T) {
	for _, tc := range []struct {
		name         string
		args         []string
		wantP, wantD int // workers (one per DP rank)
		pDP, dDP     int
	}{
		{"intra-node both roles", []string{"--intra-node-data-parallel-size", "2"}, 2, 2, 2, 2},
		{"prefill only", []string{"--prefill-data-parallel-size", "2"}, 2, 1, 2, 1},
		{"decode override", []string{"--intra-node-data-parallel-size", "2", "--decode-data-parallel-size", "1"}, 2, 1, 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--vllm-pd-disaggregation", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"}, tc.args...)
			cfg, err := config.Parse(args)
			if err != nil {
				t.Fatal(err)
			}
			a := &app{cfg: cfg, reg: worker.NewRegistry(worker.BreakerConfig{})}
			if err := a.addStaticWorkers(); err != nil {
				t.Fatal(err)
			}
			snap := a.reg.Snapshot()
			if len(snap.Prefill) != tc.wantP || len(snap.Decode) != tc.wantD {
				t.Fatalf("prefill %d decode %d workers, want %d %d", len(snap.Prefill), len(snap.Decode), tc.wantP, tc.wantD)
			}
			if snap.Prefill[0].DPSize != tc.pDP || snap.Decode[0].DPSize != tc.dDP {
				t.Fatalf("dp sizes P %d D %d, want %d %d", snap.Prefill[0].DPSize, snap.Decode[0].DPSize, tc.pDP, tc.dDP)
			}
			if tc.dDP == 1 && snap.Decode[0].DPRank >= 0 {
				t.Fatalf("dp=1 decode pinned to rank %d", snap.Decode[0].DPRank)
			}
		})
	}
}
