package scenario

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/interopenv"
)

// SectionReal is the head to head over a real vLLM CPU prefill/decode pair
// moving KV through NIXL (kv_buffer_device cpu), the real-engine tier's
// setup (docs/INTEROP.md).
const SectionReal = "real-nixl"

// RealRow is one router's correctness check over the real pair.
type RealRow struct {
	Router string
	// Identical of Prompts greedy completions equal the reference (the
	// prefill engine answering alone, no KV transfer) token for token.
	Prompts, Identical int
	// Mismatch names the first prompt that differed, or the error.
	Mismatch string
	// The decode's vllm:prompt_tokens_by_source_total deltas over the
	// check: external_kv_transfer (KV that came over NIXL) and
	// local_compute (prompt tokens the decode recomputed).
	External, Local float64
}

// realPrompts are the greedy completions compared token for token.
var realPrompts = []string{
	"The router",
	"Prefill and decode run on different engines, and the KV cache of every prompt",
	"hello",
	strings.Repeat("Switchyard forwards the request bytes as they came. ", 12),
	"A request that fails must end with a clear error, never a hang.",
	strings.Repeat("one two three four five six seven eight nine ten ", 30),
}

// realEnv finds the real-engine tier's virtual environment and tiny model
// (INTEROP_VENV, INTEROP_MODEL as in test/interop), or says why not.
func realEnv() (venv, model, why string) {
	e, why := interopenv.Find(".")
	return e.Venv, e.Model, why
}

// realEngineArgs is one engine of the pair: docs/INTEROP.md's flags, the
// simulator's model name (so every router's readiness probe works), no
// prefix caching (every prompt token of every router's request crosses
// NIXL, so the decode's KV-source counters check each router alike).
func realEngineArgs(model string, port int, kvRole string) []string {
	return []string{"serve", model, "--served-model-name", simModel, "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--max-model-len", "1024", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
		"--max-num-seqs", "16", "--seed", "0", "--disable-uvicorn-access-log", "--no-enable-prefix-caching",
		"--distributed-executor-backend", "uni",
		"--kv-transfer-config", fmt.Sprintf(`{"kv_connector":"NixlConnector","kv_role":%q,"kv_buffer_device":"cpu"}`, kvRole)}
}

// realEngineEnv is the tier's engine environment: offline, one OpenMP
// thread, a 1 GiB KV cache, the NIXL side channel on sidePort.
func realEngineEnv(sidePort int) []string {
	return append(os.Environ(),
		"HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "VLLM_TARGET_DEVICE=cpu",
		"OMP_NUM_THREADS=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "VLLM_CPU_KVCACHE_SPACE=1",
		"VLLM_NO_USAGE_STATS=1", "DO_NOT_TRACK=1", "TOKENIZERS_PARALLELISM=false",
		"VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1", fmt.Sprintf("VLLM_NIXL_SIDE_CHANNEL_PORT=%d", sidePort))
}

// realReadyWithin bounds the pair's start-up (30-50 s on the idle 2-core
// machine, minutes when it is loaded).
const realReadyWithin = 4 * time.Minute

// compareReal starts the real pair once and runs the correctness check and
// the same small load through every router that speaks vLLM's NIXL PD.
func (e *env) compareReal(ctx context.Context, c CompareConfig, rep *CompareReport, all []peer) error {
	venv, model, why := realEnv()
	if why != "" {
		e.printf("%s: not run: %s\n", SectionReal, why)
		for _, p := range all {
			rep.Rows = append(rep.Rows, CompareRow{Section: SectionReal, Router: p.name, Concurrency: c.RealConcurrency[0], Skipped: "not run: " + why})
		}
		return nil
	}
	if _, err := e.budget(realReadyWithin+3*time.Minute, 3*time.Minute); err != nil {
		return err
	}
	ports, err := freePorts(4)
	if err != nil {
		return err
	}
	vllm := filepath.Join(venv, "bin", "vllm")
	var engines []*sim
	defer func() {
		for _, s := range engines {
			e.g.stop(s.proc)
		}
	}()
	t0 := time.Now()
	for i, role := range []string{"kv_producer", "kv_consumer"} {
		args := realEngineArgs(model, ports[i], role)
		p, err := e.g.startEnv("vllm-"+map[string]string{"kv_producer": "prefill", "kv_consumer": "decode"}[role], vllm, realEngineEnv(ports[2+i]), args...)
		if err != nil {
			return err
		}
		engines = append(engines, &sim{proc: p, ready: readyLine{HTTPAddress: fmt.Sprintf("127.0.0.1:%d", ports[i])}})
		rep.Commands = append(rep.Commands, fmt.Sprintf("VLLM_NIXL_SIDE_CHANNEL_PORT=%d %s %s", ports[2+i], vllm, strings.Join(args, " ")))
	}
	for _, s := range engines {
		if err := waitHTTP(ctx, s.proc, s.URL()+"/health", realReadyWithin); err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			why := "the real pair did not start: " + oneLine(err.Error(), 300)
			e.printf("%s: %s\n", SectionReal, why)
			for _, p := range all {
				rep.Rows = append(rep.Rows, CompareRow{Section: SectionReal, Router: p.name, Concurrency: c.RealConcurrency[0], Skipped: why})
			}
			return nil
		}
	}
	rep.Notes = append(rep.Notes, fmt.Sprintf("The real vLLM pair was ready %v after its start.", time.Since(t0).Round(time.Second)))
	e.printf("%s: real pair ready after %v\n", SectionReal, time.Since(t0).Round(time.Second))
	prefill, decode := engines[0], engines[1]

	ref, err := greedyAll(ctx, prefill.URL())
	if err != nil {
		return fmt.Errorf("%s: the reference completions from the prefill engine alone: %w", SectionReal, err)
	}
	f := fleetURLs{prefill: prefill.URL(), decode: decode.URL()}
	rs, err := e.startPeers(ctx, all, f, []string{SectionReal}, rep)
	defer e.stopPeers(rs)
	if err != nil {
		return err
	}
	for _, rr := range rs {
		if rr.r == nil {
			continue
		}
		row := e.realCheck(ctx, rr, decode, ref)
		e.printf("%s %-14s identical %d/%d, decode KV external %.0f local %.0f %s\n", SectionReal, rr.name, row.Identical, row.Prompts, row.External, row.Local, row.Mismatch)
		rep.Real = append(rep.Real, row)
	}
	rc := c
	rc.Input, rc.OutputLen, rc.MinPrompts, rc.PromptsPerC, rc.Repeats = c.RealInput, c.RealOutput, c.RealPrompts, 1, c.RealRepeats
	return e.streams(ctx, rc, rep, SectionReal, c.RealConcurrency, rs, prefill.proc, decode.proc)
}

// realCheck sends the reference prompts through one router.
func (e *env) realCheck(ctx context.Context, rr running, decode *sim, ref [][]int) RealRow {
	row := RealRow{Router: rr.name, Prompts: len(realPrompts)}
	ext0, loc0 := kvSources(ctx, decode.URL())
	got, err := greedyAll(ctx, rr.base)
	ext1, loc1 := kvSources(ctx, decode.URL())
	row.External, row.Local = ext1-ext0, loc1-loc0
	for i := range realPrompts {
		if i < len(got) && slices.Equal(got[i], ref[i]) {
			row.Identical++
		} else if row.Mismatch == "" && i < len(got) {
			row.Mismatch = fmt.Sprintf("prompt %d: %d tokens %v…, reference %d tokens %v…", i, len(got[i]), head(got[i], 4), len(ref[i]), head(ref[i], 4))
		}
	}
	if err != nil {
		row.Mismatch = oneLine(err.Error(), 200)
	}
	return row
}

func head(t []int, n int) []int { return t[:min(n, len(t))] }

// greedyAll sends every reference prompt to base, one at a time.
func greedyAll(ctx context.Context, base string) ([][]int, error) {
	client := &http.Client{Timeout: 60 * time.Second}
	defer client.CloseIdleConnections()
	var out [][]int
	for _, p := range realPrompts {
		ids, err := greedy(ctx, client, base, p)
		if err != nil {
			return out, err
		}
		out = append(out, ids)
	}
	return out, nil
}

// greedy asks for 24 greedy tokens of prompt with their ids
// (return_token_ids) and returns them.
func greedy(ctx context.Context, client *http.Client, base, prompt string) ([]int, error) {
	body, _ := json.Marshal(map[string]any{"model": simModel, "prompt": prompt, "max_tokens": 24, "temperature": 0,
		"ignore_eos": true, "return_token_ids": true})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: HTTP %d %s", base, resp.StatusCode, oneLine(string(b), 200))
	}
	var r struct {
		Choices []struct {
			TokenIDs []int `json:"token_ids"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%s: %w: %s", base, err, oneLine(string(b), 200))
	}
	if len(r.Choices) != 1 || len(r.Choices[0].TokenIDs) == 0 {
		return nil, fmt.Errorf("%s: no token_ids in %s", base, oneLine(string(b), 200))
	}
	return r.Choices[0].TokenIDs, nil
}

// kvSources reads the decode's vllm:prompt_tokens_by_source_total for
// external_kv_transfer and local_compute (NaN-free: 0 when absent).
func kvSources(ctx context.Context, base string) (external, local float64) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	resp, err := (&http.Client{Timeout: httpGetTimeout}).Do(req)
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	return parseKVSources(resp.Body)
}

// parseKVSources sums the two sources over every series of Prometheus
// text.
func parseKVSources(r io.Reader) (external, local float64) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if !strings.HasPrefix(l, "vllm:prompt_tokens_by_source_total{") {
			continue
		}
		f := strings.Fields(l)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			continue
		}
		switch {
		case strings.Contains(l, `source="external_kv_transfer"`):
			external += v
		case strings.Contains(l, `source="local_compute"`):
			local += v
		}
	}
	return external, local
}

// realTable writes the correctness check of the real pair.
func (r *CompareReport) realTable(b *strings.Builder) {
	if len(r.Real) == 0 {
		return
	}
	b.WriteString("### Token identity over the real pair\n\n")
	fmt.Fprintf(b, "%d greedy completions (24 tokens, `temperature 0`, `return_token_ids`, prompts of 1 to about 300 tokens) through each router, compared token id for token id with the prefill engine answering the same prompts alone (no KV transfer). The decode's `vllm:prompt_tokens_by_source_total` over the check: external = prompt tokens whose KV came over NIXL, local = prompt tokens the decode computed itself (0: the router's KV handoff worked; prefix caching is off, so every request transfers).\n\n", len(realPrompts))
	b.WriteString("| Router | Identical / prompts | Decode prompt tokens external / local | First difference |\n|---|---|---|---|\n")
	for _, x := range r.Real {
		fmt.Fprintf(b, "| %s | %d / %d | %.0f / %.0f | %s |\n", x.Router, x.Identical, x.Prompts, x.External, x.Local, orDefault(x.Mismatch, "none"))
	}
	b.WriteString("\n")
}
