package scenario

import (
	"bytes"
	"context"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

const wrkSample = `Running 3s test @ http://127.0.0.1:4000/v1/completions
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     4.62ms    2.10ms  41.07ms   85.50%
    Req/Sec     6.80k   512.33     7.90k    70.00%
  Latency Distribution
     50%    4.31ms
     75%    5.20ms
     90%    6.90ms
     99%   13.90ms
  40518 requests in 3.00s, 12.40MB read
  Non-2xx or 3xx responses: 7
  Socket errors: connect 1, read 2, write 0, timeout 3
Requests/sec:  13506.12
Transfer/sec:      4.13MB
`

func TestParseWrk(t *testing.T) {
	r, err := parseWrk([]byte(wrkSample))
	if err != nil {
		t.Fatal(err)
	}
	want := wrkResult{Requests: 40518, ReqPerS: 13506.12, P50: 4.31, P99: 13.90, Non2xx: 7, SocketErrors: 6}
	if r != want {
		t.Fatalf("parseWrk = %+v, want %+v", r, want)
	}
	if _, err := parseWrk([]byte("unable to connect to 127.0.0.1:1 Connection refused\n")); err == nil {
		t.Fatal("parseWrk accepted output without figures")
	}
}

func TestParseWrkDuration(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
		ok   bool
	}{
		{"850.00us", 0.85, true}, {"1.23ms", 1.23, true}, {"1.50s", 1500, true}, {"2.00m", 120000, true},
		{"ms", 0, false}, {"12", 0, false},
	} {
		got, err := parseWrkDuration(tc.in)
		if (err == nil) != tc.ok || (tc.ok && (got < tc.want*0.999 || got > tc.want*1.001)) {
			t.Errorf("parseWrkDuration(%q) = %v, %v; want %v ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

// The drop-in claim: switchyard and vllm-router get one command line.
func TestSameCommandLine(t *testing.T) {
	ps := peers("bin", "/peers", "round_robin")
	byName := map[string]peer{}
	for _, p := range ps {
		byName[p.name] = p
	}
	for _, f := range []fleetURLs{{worker: "http://127.0.0.1:1"}, {prefill: "http://127.0.0.1:2", decode: "http://127.0.0.1:3"}} {
		a, err1 := byName[PeerSwitchyard].args(f, 10, 11, "")
		b, err2 := byName[PeerVLLMRouter].args(f, 10, 11, "")
		if err1 != nil || err2 != nil || !slices.Equal(a, b) {
			t.Fatalf("fleet %+v: switchyard %v (%v) vs vllm-router %v (%v)", f, a, err1, b, err2)
		}
		if !slices.Contains(a, "warning") {
			t.Errorf("args %v: want the launcher's --log-level warning", a)
		}
	}
	// Routers that cannot run PD say so.
	pd := fleetURLs{prefill: "http://127.0.0.1:2", decode: "http://127.0.0.1:3"}
	for _, n := range []string{PeerSGLangRouter, PeerNginx} {
		if _, err := byName[n].args(pd, 10, 11, ""); err == nil || !strings.Contains(err.Error(), "unsupported") {
			t.Errorf("%s in PD mode: err = %v, want unsupported", n, err)
		}
	}
	a, err := byName[PeerNIXLToyProxy].args(pd, 10, 11, "")
	if err != nil || !slices.Contains(a, "--prefiller-port") || a[slices.Index(a, "--decoder-port")+1] != "3" {
		t.Errorf("toy proxy args %v, %v", a, err)
	}
}

func TestNginxConf(t *testing.T) {
	c := nginxConf("/d", "127.0.0.1:9", 8080)
	for _, want := range []string{"listen 127.0.0.1:8080", "server 127.0.0.1:9;", "worker_processes 1;", "proxy_buffering off;", "pid /d/nginx.pid;"} {
		if !strings.Contains(c, want) {
			t.Errorf("nginx.conf lacks %q:\n%s", want, c)
		}
	}
}

func TestStatPgrp(t *testing.T) {
	pg, ok := statPgrp([]byte("42 (a) b) S 1 77 77 0 -1"))
	if !ok || pg != 77 {
		t.Fatalf("statPgrp = %d, %v", pg, ok)
	}
	if pids := groupPids(syscall.Getpgrp()); !slices.Contains(pids, os.Getpid()) {
		t.Fatalf("groupPids(own group) = %v, want to contain %d", pids, os.Getpid())
	}
}

func TestCompareSummary(t *testing.T) {
	rep := &CompareReport{Config: QuickCompareConfig()}
	add := func(router string, rps, p50 float64, cpu time.Duration) {
		for k := range 3 {
			rep.Rows = append(rep.Rows, CompareRow{Section: SectionWrk, Router: router, Concurrency: 64, Rep: k,
				Wrk: wrkResult{ReqPerS: rps + float64(k), P50: p50}, Completed: 1000, RouterCPU: cpu})
		}
	}
	add(PeerDirect, 40000, 1, 0)
	add(PeerSwitchyard, 10000, 3, 100*time.Millisecond)
	add(PeerVLLMRouter, 20000, 2, 50*time.Millisecond)
	rep.Rows = append(rep.Rows, CompareRow{Section: SectionWrk, Router: PeerSGLangRouter, Skipped: "did not start: boom"})
	var b bytes.Buffer
	if err := rep.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	for _, want := range []string{
		"| vllm-router | 2.00x | 0.50x |",            // req/s and added P50 (1 vs 2 ms)
		"| switchyard | 1.00x (10001) | 1.00x (2) |", // own values
		"10001 (10000-10002)",                        // median and min-max
		"| 64 | sglang-router | — | — | — | — | — | — | — | did not start: boom |",
		"regular wrk 64 connections at req/s: vllm-router 20001 vs switchyard 10001 (2.00x)",
		"router CPU s/1k req: vllm-router 0.05 vs switchyard 0.1 (0.50x)",
	} {
		if !strings.Contains(md, want) {
			t.Errorf("markdown lacks %q:\n%s", want, md)
		}
	}
	b.Reset()
	if err := rep.WritePNG(&b); err != nil {
		t.Fatal(err)
	}
	if _, err := png.Decode(&b); err != nil {
		t.Fatal(err)
	}
}

// A real quick run with switchyard, nginx (when installed) and direct; the
// peers folder is empty, so the other routers get "not installed" rows.
func TestCompareQuick(t *testing.T) {
	if testing.Short() {
		t.Skip("starts routers and workers")
	}
	if _, err := exec.LookPath("wrk"); err != nil {
		t.Skip("wrk not installed (scripts/install-peers.sh)")
	}
	c := QuickCompareConfig()
	c.PeersDir = t.TempDir()
	c.WrkDuration = time.Second
	c.MinPrompts, c.OutputLen = 40, 4
	c.PDConcurrency = []int{8}
	c.StreamConcurrency = []int{8}
	c.WrkConns = []int{8}
	c.CeilingConcurrency = []int{8}
	c.MoRIConcurrency = []int{8}
	// The turnover has its own test; the real pair is test/interop's.
	c.Sections = []string{CompareRegular, ComparePD, CompareMoRI, CompareCeiling}
	out := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rep, err := RunCompare(ctx, Options{BinDir: binDir, OutDir: out, MaxDuration: 150 * time.Second}, c)
	if err != nil {
		t.Fatal(err)
	}
	sy, ok := rep.agg(SectionWrk, PeerSwitchyard, 8)
	if !ok || sy.runs != 1 || sy.reqPerS.med <= 0 || sy.failed != 0 {
		t.Fatalf("switchyard wrk = %+v", sy)
	}
	pd, ok := rep.agg(SectionPD, PeerSwitchyard, 8)
	if !ok || pd.runs != 1 || pd.completed != 40 || pd.failed != 0 {
		t.Fatalf("switchyard PD = %+v", pd)
	}
	ceil := 0
	for _, x := range rep.Rows {
		if x.Section == SectionCeiling && x.Router == PeerSwitchyard && x.Concurrency == 8 && x.Completed == 8 && x.RouterRSS > 0 {
			ceil++
		}
	}
	if ceil != 1 {
		t.Fatalf("switchyard ceiling step C=8 missing or incomplete: %+v", rep.Rows)
	}
	mo, ok := rep.agg(moriSection("WRITE"), PeerSwitchyard, 8)
	if !ok || mo.runs != 1 || mo.completed != 40 || mo.failed != 0 {
		t.Fatalf("switchyard MoRI-IO WRITE = %+v", mo)
	}
	faults := map[string]FaultRow{}
	for _, f := range rep.Faults {
		if f.Router == PeerSwitchyard {
			faults[f.Fault] = f
		}
	}
	kill, killNIXL := faults[killName], faults[killNameNIXL]
	if len(faults) != 4 || kill.Sent != 32 || kill.OK == kill.Sent || kill.Note != "" || killNIXL.Sent != 32 || killNIXL.OK == killNIXL.Sent || killNIXL.Note != "" {
		t.Fatalf("switchyard fault rows = %+v", faults)
	}
	vr, _ := rep.agg(SectionPD, PeerVLLMRouter, 8)
	if vr.runs != 0 || !strings.Contains(vr.skipped, "not installed") {
		t.Fatalf("vllm-router row = %+v, want not installed", vr)
	}
	for _, f := range []string{"compare.md", "compare.png"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
}

func TestTurnoverRow(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64, ok bool, dur float64, err string) timedResult {
		return timedResult{probeResult: probeResult{ok: ok, dur: time.Duration(dur * float64(time.Second)), err: err},
			start: t0.Add(time.Duration(s * float64(time.Second)))}
	}
	cut, tail := t0.Add(5*time.Second), t0.Add(19*time.Second)
	for _, tc := range []struct {
		name string
		rs   []timedResult
		want TurnoverRow
	}{
		{"clean", []timedResult{at(1, true, 0.1, ""), at(6, true, 0.1, ""), at(20, true, 0.1, "")},
			TurnoverRow{Sent: 3, OK: 3, TailSent: 1, TailOK: 1, ByWrite: 1}},
		{"outage then recovered", []timedResult{
			at(4, false, 0.1, "HTTP 503"), at(6, false, 0.5, "dial tcp 127.0.0.1:1: connect: connection refused"),
			at(9, false, 1, "HTTP 502"), at(12, true, 0.1, ""), at(20, true, 0.1, "")},
			TurnoverRow{Sent: 5, OK: 2, FailedBefore: 1, FailedAfter: 2, Outage: 4 * time.Second, TailSent: 1, TailOK: 1,
				ByWrite: 1, Errors: "HTTP 502 ×1, HTTP 503 ×1, connection refused ×1"}},
		{"in flight at the cut", []timedResult{at(4.9, false, 0.2, "stream ended without [DONE]"), at(20, true, 0.1, "")},
			TurnoverRow{Sent: 2, OK: 1, FailedAfter: 1, Outage: 200 * time.Millisecond, TailSent: 1, TailOK: 1, ByWrite: 1,
				Errors: "stream ended without [DONE] ×1"}},
		{"never recovered", []timedResult{at(6, false, 0.1, "HTTP 503"), at(19, false, 0.1, "HTTP 503"), at(21, false, 0.1, "HTTP 503")},
			TurnoverRow{Sent: 3, FailedAfter: 3, Outage: 15*time.Second + 100*time.Millisecond, TailSent: 2, Errors: "HTTP 503 ×3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := turnoverRow("v", "r", tc.rs, cut, tail)
			got.ByWrite = tc.want.ByWrite // set by the caller from the WRITE decode
			tc.want.Variant, tc.want.Router = "v", "r"
			if got != tc.want {
				t.Fatalf("turnoverRow = %+v\nwant %+v", got, tc.want)
			}
			if rec := got.Recovered(); rec != (tc.name != "never recovered") {
				t.Fatalf("Recovered = %v", rec)
			}
			if got.ByWrite = 0; got.TailSent > 0 && got.Recovered() {
				t.Fatal("Recovered with a tail the WRITE pair did not serve")
			}
		})
	}
}

// A real READ→WRITE turnover through switchyard (both variants): no request
// fails while the WRITE pair registers, and the WRITE pair serves every
// request of the load's tail (4 s after the 9 s TTL has passed). vllm-router is not installed in the empty
// peers folder and gets a row saying so.
func TestCompareTurnover(t *testing.T) {
	if testing.Short() {
		t.Skip("starts routers and workers, about a minute")
	}
	c := QuickCompareConfig()
	c.PeersDir = t.TempDir()
	c.Only = []string{PeerSwitchyard, PeerVLLMRouter, PeerNIXLToyProxy}
	var rep *CompareReport
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	_, err := runScenario(ctx, Options{BinDir: binDir, MaxDuration: 150 * time.Second, Out: &out, LogDir: t.TempDir()}, scenarioSpec[*CompareReport]{
		name: "turnover", defMax: time.Minute, skipped: "points",
		report: func(e *env) *CompareReport { rep = &CompareReport{Config: c, Machine: e.m.String()}; return rep },
		run: func(ctx context.Context, e *env, rep *CompareReport) error {
			return e.compareTurnover(ctx, c, rep, peers(e.o.BinDir, c.PeersDir, c.Policy))
		},
	})
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	seen := map[string]bool{}
	for _, r := range rep.Turnover {
		switch r.Router {
		case PeerSwitchyard:
			seen[r.Variant] = true
			if r.Sent == 0 || r.FailedBefore != 0 || !r.Recovered() || r.Note != "" {
				t.Errorf("switchyard %s: %+v\n%s", r.Variant, r, out.String())
			}
			// A drained turnover usually loses nothing, but the READ
			// prefill and decode expire up to one heartbeat apart, and in
			// between neither fleet has both roles: not asserted.
		case PeerVLLMRouter:
			if !strings.Contains(r.Note, "not installed") {
				t.Errorf("vllm-router row = %+v, want not installed", r)
			}
		case PeerNIXLToyProxy:
			if !strings.Contains(r.Note, "unsupported") {
				t.Errorf("toy proxy row = %+v, want unsupported", r)
			}
		}
	}
	if !seen[turnoverStop] || !seen[turnoverDrain] {
		t.Fatalf("switchyard variants = %v; rows %+v", seen, rep.Turnover)
	}
	var md strings.Builder
	rep.turnoverTable(&md)
	if !strings.Contains(md.String(), "| "+turnoverDrain+" | switchyard | ") {
		t.Fatalf("table:\n%s", md.String())
	}
}

func TestParseKVSources(t *testing.T) {
	for _, tc := range []struct {
		name       string
		in         string
		ext, local float64
	}{
		{"none", "# HELP x\nvllm:num_requests_running{engine=\"0\"} 3\n", 0, 0},
		{"both, two engines", `vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 927.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="external_kv_transfer"} 3.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 2.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 64.0
`, 930, 2},
		{"garbage value", `vllm:prompt_tokens_by_source_total{source="local_compute"} x` + "\n", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ext, local := parseKVSources(strings.NewReader(tc.in))
			if ext != tc.ext || local != tc.local {
				t.Fatalf("parseKVSources = %v, %v; want %v, %v", ext, local, tc.ext, tc.local)
			}
		})
	}
}
