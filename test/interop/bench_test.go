package interop

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// benchLoad is the load both benchmark clients put on the PD fleet.
var benchLoad = []string{
	"--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
	"--num-prompts", "40", "--max-concurrency", "4", "--seed", "7",
	"--save-result", "--disable-tqdm",
}

type benchResult struct {
	Completed  int     `json:"completed"`
	Failed     int     `json:"failed"`
	MeanTTFTMs float64 `json:"mean_ttft_ms"`
	MeanTPOTMs float64 `json:"mean_tpot_ms"`
	MeanITLMs  float64 `json:"mean_itl_ms"`
}

func readBench(t *testing.T, path string) benchResult {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var r benchResult
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return r
}

// runTool runs a benchmark client with a bound and fails with its output.
func runTool(t *testing.T, d time.Duration, env []string, name string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", filepath.Base(name), args, err, tail(out))
	}
	t.Logf("%s:\n%s", filepath.Base(name), tail(out))
}

func tail(b []byte) string {
	if len(b) > 3000 {
		return "..." + string(b[len(b)-3000:])
	}
	return string(b)
}

// TestBenchServeAgainstPD: `vllm bench serve` from the installed vLLM (the
// random dataset, the tiny model's tokenizer by path) runs against
// Switchyard in front of the real NIXL pair with no failed request, and
// sybench on the same load reports latencies of the same order.
func TestBenchServeAgainstPD(t *testing.T) {
	needEnv(t)
	r := pdRouter(t)
	dir := t.TempDir()
	// A short warm-up first, so neither measured run pays the fleet's
	// first requests.
	runTool(t, 2*time.Minute, os.Environ(), filepath.Join(bins.Dir, "sybench"), "--backend", "vllm", "--base-url", r.Base,
		"--model", modelDir, "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "16",
		"--num-prompts", "8", "--max-concurrency", "4", "--disable-tqdm")
	args := append([]string{"bench", "serve", "--backend", "vllm", "--base-url", r.Base,
		"--model", modelDir, "--tokenizer", modelDir,
		"--result-dir", dir, "--result-filename", "vllm.json"}, benchLoad...)
	runTool(t, 5*time.Minute, engineEnv(), filepath.Join(venv, "bin", "vllm"), args...)
	v := readBench(t, filepath.Join(dir, "vllm.json"))

	sargs := append([]string{"--backend", "vllm", "--base-url", r.Base, "--model", modelDir,
		"--result-dir", dir, "--result-filename", "sybench.json"}, benchLoad...)
	runTool(t, 5*time.Minute, os.Environ(), filepath.Join(bins.Dir, "sybench"), sargs...)
	s := readBench(t, filepath.Join(dir, "sybench.json"))

	t.Logf("vllm bench serve: completed %d failed %d ttft %.1f ms tpot %.1f ms itl %.1f ms",
		v.Completed, v.Failed, v.MeanTTFTMs, v.MeanTPOTMs, v.MeanITLMs)
	t.Logf("sybench:          completed %d failed %d ttft %.1f ms tpot %.1f ms itl %.1f ms",
		s.Completed, s.Failed, s.MeanTTFTMs, s.MeanTPOTMs, s.MeanITLMs)
	for name, res := range map[string]benchResult{"vllm bench serve": v, "sybench": s} {
		if res.Completed != 40 || res.Failed != 0 {
			t.Errorf("%s: completed %d, failed %d, want 40 and 0", name, res.Completed, res.Failed)
		}
	}
	// The two clients measure the same fleet; on a shared 2-core machine
	// the means wander, so only a gross disagreement (a client measuring
	// something else) fails. docs/INTEROP.md has the measured ratios.
	for _, m := range []struct {
		name string
		a, b float64
	}{{"TPOT", v.MeanTPOTMs, s.MeanTPOTMs}, {"ITL", v.MeanITLMs, s.MeanITLMs}} {
		if m.a <= 0 || m.b <= 0 || m.a/m.b > 4 || m.b/m.a > 4 {
			t.Errorf("mean %s: vllm bench serve %.1f ms, sybench %.1f ms: more than 4x apart", m.name, m.a, m.b)
		}
	}
}
