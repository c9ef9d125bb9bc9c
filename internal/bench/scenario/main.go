package scenario

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

const usage = `Usage: sybench scenario pd|overhead|ceiling|kv|flow|relay|compare [flags]

Starts the router (switchyard) and simulated workers (vllm-sim) from --bin-dir
as child processes on free loopback ports, runs the benchmark in-process
against them, stops every child (also on failure and Ctrl-C) and prints the
tables; with --out-dir it also writes them (Markdown, and a PNG for pd).

  pd        MoRI-IO READ vs WRITE, 1P1D deepseek-r1-1p1d preset, ZMQ discovery
            (MORIIO-RESULTS.md's sweep, scaled down)      -> pd-readwrite.md/.png
  overhead  direct vs switchyard regular vs switchyard PD, zero-latency
            workers: added TTFT and router CPU per 1000 requests -> overhead.md
  ceiling   ramp concurrent streams through PD MoRI-IO WRITE until
            requests fail                                 -> ceiling.md
  kv        round_robin vs cache_aware vs kv_aware on a shared-prefix
            workload, 4 unified then 2P2D NIXL workers with small prefix
            caches and KV events: hit rate, TTFT          -> kv.md
  flow      2× capacity open loop with and without --flow-control: a high
            band, then two tenants at 10:1                -> flow.md
  relay     paced token streams whose events carry the worker's write
            time, direct and through switchyard regular mode: what the
            router adds per relayed event, its CPU per event -> relay.md
  compare   head to head: switchyard vs vllm-router, sglang-router, nginx
            and vLLM's NIXL toy proxy on the same fleets (wrk, sybench,
            faults, READ→WRITE turnover, ceiling, a real vLLM CPU
            pair; peers from scripts/install-peers.sh)
                                                          -> compare.md/.png

Run "sybench scenario NAME --help" for the flags of one scenario.
`

// Main runs "sybench scenario NAME [flags]" (args start after "scenario").
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, usage)
		if len(args) == 0 {
			return errors.New("scenario: missing scenario name")
		}
		return nil
	}
	name, rest := args[0], args[1:]
	o := Options{Out: stdout, Command: "sybench scenario " + strings.Join(args, " ")}
	switch name {
	case "pd":
		c, err := parsePD(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunPD(ctx, o, c)
		return err
	case "overhead":
		c, err := parseOverhead(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunOverhead(ctx, o, c)
		return err
	case "flow":
		c, err := parseFlow(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunFlow(ctx, o, c)
		return err
	case "ceiling":
		c, err := parseCeiling(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		rep, err := RunCeiling(ctx, o, c)
		if err == nil && rep.FirstFailing() > 0 {
			return fmt.Errorf("ceiling: requests failed from C=%d on", rep.FirstFailing())
		}
		return err
	case "kv":
		c, err := parseKV(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunKV(ctx, o, c)
		return err
	case "relay":
		c, err := parseRelay(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunRelay(ctx, o, c)
		return err
	case "compare":
		c, err := parseCompare(rest, &o, stderr)
		if err != nil {
			return helpOK(err)
		}
		_, err = RunCompare(ctx, o, c)
		return err
	}
	fmt.Fprint(stderr, usage)
	return fmt.Errorf("scenario: unknown scenario %q (want pd, overhead, ceiling, kv, flow, relay or compare)", name)
}

func helpOK(err error) error {
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	return err
}

// rateList is a comma-separated list of positive request rates.
type rateList []float64

func (l *rateList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	return strings.Join(s, ",")
}

func (l *rateList) Set(v string) error {
	var out []float64
	for _, p := range strings.Split(v, ",") {
		r, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || !(r > 0) || math.IsInf(r, 0) {
			return fmt.Errorf("invalid request rate %q (want a number > 0)", p)
		}
		out = append(out, r)
	}
	*l = out
	return nil
}

// intList is a comma-separated list of positive integers.
type intList []int

func (l *intList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, v := range *l {
		s[i] = strconv.Itoa(v)
	}
	return strings.Join(s, ",")
}

func (l *intList) Set(v string) error {
	var out []int
	for _, p := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n <= 0 {
			return fmt.Errorf("invalid positive integer %q", p)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// strList is a comma-separated list of words.
type strList []string

func (l *strList) String() string {
	if l == nil {
		return ""
	}
	return strings.Join(*l, ",")
}

func (l *strList) Set(v string) error {
	var out []string
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		return errors.New("empty list")
	}
	*l = out
	return nil
}

// quickRequested reports whether args ask for --quick (decides which
// defaults the real parse starts from).
func quickRequested(args []string) bool {
	q := false
	for _, a := range args {
		if a == "--" {
			break
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "quick" {
			q = !hasVal || val == "true" || val == "1"
		}
	}
	return q
}

// commonFlags registers the flags every scenario has.
func commonFlags(fs *flag.FlagSet, o *Options, defMax time.Duration) {
	o.BinDir = "bin"
	o.MaxDuration = defMax
	fs.StringVar(&o.BinDir, "bin-dir", o.BinDir, "directory holding the switchyard and vllm-sim binaries (go build -o bin/ ./cmd/...)")
	fs.StringVar(&o.OutDir, "out-dir", "", "write the Markdown (and PNG) outputs here (default: print only)")
	fs.StringVar(&o.LogDir, "log-dir", "", "keep the child processes' logs here (default: a temporary directory, removed after a successful run)")
	fs.DurationVar(&o.MaxDuration, "max-duration", o.MaxDuration, "bound on the whole scenario; points that do not fit are skipped")
	fs.BoolVar(&o.Quick, "quick", false, "fewer, smaller points (smoke run)")
}

func newFlagSet(name string, stderr io.Writer, help string) *flag.FlagSet {
	fs := flag.NewFlagSet("sybench scenario "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: sybench scenario %s [flags]\n\n%s\n\nFlags:\n", name, help)
		fs.PrintDefaults()
	}
	return fs
}

func finishParse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	return nil
}

// configFor is the quick config when args ask for --quick, else the
// default one: the values the real parse starts from.
func configFor[C any](args []string, def, quick func() C) C {
	if quickRequested(args) {
		return quick()
	}
	return def()
}

// loadFlags are the fleet and load flags every scenario has; the help
// texts carry what differs between scenarios.
type loadFlags struct {
	preset, policy *string
	seed           *int64
	outputLen      *int
	promptsPerC    *float64
	workers        string // whose preset: "both workers", "every worker"
	policyHelp     string
	outputHelp     string
	promptsHelp    string
}

// scenarioFlags is the flag set of one scenario with the common flags
// (commonFlags) and the load flags l registered.
func scenarioFlags(name string, stderr io.Writer, help string, o *Options, defMax time.Duration, l loadFlags) *flag.FlagSet {
	fs := newFlagSet(name, stderr, help)
	commonFlags(fs, o, defMax)
	fs.StringVar(l.preset, "preset", *l.preset, "vllm-sim --profile-preset of "+l.workers)
	fs.StringVar(l.policy, "policy", *l.policy, l.policyHelp)
	fs.Int64Var(l.seed, "seed", *l.seed, "dataset seed")
	fs.IntVar(l.outputLen, "output-len", *l.outputLen, l.outputHelp)
	fs.Float64Var(l.promptsPerC, "prompts-per-concurrency", *l.promptsPerC, l.promptsHelp)
	return fs
}

// transferMode upper-cases a MoRI-IO transfer mode and checks it; what
// names it in the error ("mode", "--mode", ...).
func transferMode(m, what string) (string, error) {
	m = strings.ToUpper(m)
	if m != "READ" && m != "WRITE" {
		return m, fmt.Errorf("invalid %s %q (want READ or WRITE)", what, m)
	}
	return m, nil
}

func parsePD(args []string, o *Options, stderr io.Writer) (PDConfig, error) {
	c := configFor(args, DefaultPDConfig, QuickPDConfig)
	fs := scenarioFlags("pd", stderr, "MoRI-IO READ vs WRITE through switchyard on a simulated DeepSeek-R1 1P1D fleet (one fresh fleet per mode).", o, 13*time.Minute, loadFlags{
		preset: &c.Preset, policy: &c.Policy, seed: &c.Seed, outputLen: &c.OutputLen, promptsPerC: &c.PromptsPerC,
		workers: "both workers", policyHelp: "switchyard --policy", outputHelp: "--random-output-len of every point",
		promptsHelp: "--num-prompts = ceil(this × C)",
	})
	modes := strList(c.Modes)
	fs.Var(&modes, "modes", "MoRI-IO transfer modes, one fleet each")
	var short, long PDInput
	ins := intList{}
	for _, in := range c.Inputs {
		ins = append(ins, in.Len)
		if in.Len < 4000 && short.Len == 0 {
			short = in
		} else if in.Len >= 4000 && long.Len == 0 {
			long = in
		}
	}
	if long.Len == 0 {
		long = PDInput{Concurrency: short.Concurrency, MaxWarmups: 4}
	}
	shortC, longC := intList(short.Concurrency), intList(long.Concurrency)
	fs.Var(&ins, "input-lens", "input lengths (tokens)")
	fs.Var(&shortC, "concurrency", "concurrency points for inputs < 4000 tokens")
	fs.Var(&longC, "long-concurrency", "concurrency points for inputs >= 4000 tokens")
	fs.IntVar(&short.MaxWarmups, "max-warmups", short.MaxWarmups, "warm-ups per point: min(C, this) for inputs < 4000")
	fs.IntVar(&long.MaxWarmups, "long-max-warmups", long.MaxWarmups, "warm-ups per point: min(C, this) for inputs >= 4000")
	fs.Float64Var(&c.GoodputTTFT, "goodput-ttft-ms", c.GoodputTTFT, "--goodput ttft:MS")
	fs.DurationVar(&c.PointTimeout, "point-max-duration", c.PointTimeout, "bound on one point (sybench --max-duration)")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.Modes = nil
	for _, m := range modes {
		m, err := transferMode(m, "mode")
		if err != nil {
			return c, err
		}
		c.Modes = append(c.Modes, m)
	}
	c.Inputs = nil
	for _, n := range ins {
		in := short
		in.Concurrency = shortC
		if n >= 4000 {
			in = long
			in.Concurrency = longC
		}
		in.Len = n
		c.Inputs = append(c.Inputs, in)
	}
	if c.OutputLen <= 0 || c.PromptsPerC <= 0 {
		return c, errors.New("--output-len and --prompts-per-concurrency must be positive")
	}
	return c, nil
}

func parseOverhead(args []string, o *Options, stderr io.Writer) (OverheadConfig, error) {
	c := configFor(args, DefaultOverheadConfig, QuickOverheadConfig)
	fs := scenarioFlags("overhead", stderr, "The same load sent directly to a worker, through switchyard regular mode and through switchyard PD mode (zero-latency workers): added TTFT and router CPU.", o, 12*time.Minute, loadFlags{
		preset: &c.Preset, policy: &c.Policy, seed: &c.Seed, outputLen: &c.OutputLen, promptsPerC: &c.PromptsPerC,
		workers: "every worker", policyHelp: "switchyard --policy (both routers)", outputHelp: "--random-output-len",
		promptsHelp: "--num-prompts = max(--min-prompts, ceil(this × C))",
	})
	cs := intList(c.Concurrency)
	fs.Var(&cs, "concurrency", "concurrency points")
	fs.IntVar(&c.Input, "input-len", c.Input, "--random-input-len")
	fs.IntVar(&c.MinPrompts, "min-prompts", c.MinPrompts, "lower bound of --num-prompts")
	fs.StringVar(&c.PDMode, "pd-mode", c.PDMode, "MoRI-IO transfer mode of the PD fleet")
	fs.IntVar(&c.Repeats, "repeats", c.Repeats, "interleaved repetitions of every (C, target) run; tables report medians")
	fs.DurationVar(&c.PointTimeout, "point-max-duration", c.PointTimeout, "bound on one measured run")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.Concurrency = cs
	var err error
	c.PDMode, err = transferMode(c.PDMode, "--pd-mode")
	return c, err
}

func parseRelay(args []string, o *Options, stderr io.Writer) (RelayConfig, error) {
	c := configFor(args, DefaultRelayConfig, QuickRelayConfig)
	fs := newFlagSet("relay", stderr, "Paced token streams, direct and through switchyard regular mode; every event carries the time the worker wrote it: per-event delivery latency and router CPU per event.")
	commonFlags(fs, o, 10*time.Minute)
	cs := intList(c.Concurrency)
	fs.Var(&cs, "concurrency", "concurrent streams per point")
	fs.IntVar(&c.Events, "events", c.Events, "token events per stream")
	fs.DurationVar(&c.Interval, "interval", c.Interval, "time between two events of a stream")
	fs.Float64Var(&c.Streams, "streams-per-concurrency", c.Streams, "streams per point = ceil(this × C)")
	fs.IntVar(&c.Repeats, "repeats", c.Repeats, "interleaved repetitions of every (C, target) run; tables report medians")
	fs.StringVar(&c.Policy, "policy", c.Policy, "switchyard --policy")
	fs.StringVar(&c.VLLMRouter, "vllm-router", c.VLLMRouter, "vllm-router executable to measure as a third target (e.g. .venv-peers/bin/vllm-router)")
	fs.BoolVar(&c.GoProxy, "go-proxy", c.GoProxy, "also measure Go's standard reverse proxy (sybench floor-proxy --mode stdlib, from --bin-dir): what Go's HTTP stack alone adds")
	fs.BoolVar(&c.Nginx, "nginx", c.Nginx, "also measure nginx (one worker process, the head-to-head table's configuration): what an event loop in C adds")
	ra := strList(c.RouterArgs)
	fs.Var(&ra, "router-arg", "more switchyard flags, comma-separated (e.g. --router-arg=--max-migrations=0)")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.Concurrency, c.RouterArgs = cs, ra
	if c.VLLMRouter != "" {
		abs, err := filepath.Abs(c.VLLMRouter) // not under --bin-dir
		if err != nil {
			return c, err
		}
		c.VLLMRouter = abs
	}
	if c.Events < 1 || c.Interval <= 0 || c.Streams <= 0 {
		return c, fmt.Errorf("relay: --events, --interval and --streams-per-concurrency must be positive")
	}
	return c, nil
}

func parseCeiling(args []string, o *Options, stderr io.Writer) (CeilingConfig, error) {
	c := configFor(args, DefaultCeilingConfig, QuickCeilingConfig)
	fs := scenarioFlags("ceiling", stderr, "Ramp concurrent streams through switchyard PD (MoRI-IO) and report the first concurrency with a failed request. Exits 1 if any request failed.", o, 10*time.Minute, loadFlags{
		preset: &c.Preset, policy: &c.Policy, seed: &c.Seed, outputLen: &c.OutputLen, promptsPerC: &c.PromptsPerC,
		workers: "both workers", policyHelp: "switchyard --policy", outputHelp: "--random-output-len",
		promptsHelp: "--num-prompts = ceil(this × C)",
	})
	fs.StringVar(&c.Mode, "mode", c.Mode, "MoRI-IO transfer mode")
	cs := intList(c.Concurrency)
	fs.Var(&cs, "concurrency", "concurrency ramp")
	fs.IntVar(&c.Input, "input-len", c.Input, "--random-input-len")
	fs.DurationVar(&c.StepTimeout, "step-max-duration", c.StepTimeout, "bound on one step")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.Concurrency = cs
	var err error
	c.Mode, err = transferMode(c.Mode, "--mode")
	return c, err
}

func parseKV(args []string, o *Options, stderr io.Writer) (KVConfig, error) {
	c := configFor(args, DefaultKVConfig, QuickKVConfig)
	fs := newFlagSet("kv", stderr, "round_robin vs cache_aware vs kv_aware on a shared-prefix workload over vllm-sims with small prefix caches and KV events (4 unified workers, then 2P2D NIXL): prefix-cache hit rate at the workers, TTFT, throughput.")
	commonFlags(fs, o, 10*time.Minute)
	pols := strList(c.Policies)
	fs.Var(&pols, "policies", "policies compared (interleaved in every repetition); NAME+FLAG+... adds router flags to one, e.g. kv_aware+--kv-load-weight=0.1")
	cs := intList(c.Concurrency)
	fs.Var(&cs, "concurrency", "load points (closed loops of this many streams)")
	rates := rateList(c.Rates)
	fs.Var(&rates, "request-rates", "open-loop load points instead of --concurrency: Poisson arrivals at these requests per second")
	fs.IntVar(&c.RateMaxConcurrency, "rate-max-concurrency", c.RateMaxConcurrency, "requests in flight at most at a --request-rates point")
	fs.IntVar(&c.Repeats, "repeats", c.Repeats, "repetitions; tables report medians")
	fs.IntVar(&c.Groups, "groups", c.Groups, "shared system prompts")
	fs.IntVar(&c.PerGroup, "per-group", c.PerGroup, "requests per group")
	fs.IntVar(&c.PrefixLen, "prefix-len", c.PrefixLen, "tokens of a system prompt")
	fs.IntVar(&c.QuestionLen, "question-len", c.QuestionLen, "tokens of a question")
	fs.IntVar(&c.OutputLen, "output-len", c.OutputLen, "output tokens")
	fs.IntVar(&c.Turns, "turns", c.Turns, "turns per conversation (each resends its history); 1 = single questions")
	fs.IntVar(&c.NumBlocks, "num-blocks", c.NumBlocks, "vllm-sim --num-blocks of every worker")
	fs.BoolVar(&c.PD, "pd", c.PD, "also run the 2P2D NIXL fleet")
	fs.IntVar(&c.Routers, "routers", max(c.Routers, 1), "router replicas with the same flags in front of each fleet; requests alternate over them")
	unified := fs.Bool("unified", !c.NoUnified, "run the unified fleet (--unified=false --pd: the PD fleet alone)")
	fs.BoolVar(&c.Chat, "chat", c.Chat, "send the workload as chat completions (one user message); give a kv_aware router +--chat-template=internal/sim/chat_template.jinja to render them in-process")
	fs.StringVar(&c.Tokenizer, "tokenizer", c.Tokenizer, "tokenizer.json every vllm-sim tokenizes prompts with (vllm-sim --tokenizer); add a policy NAME+--tokenizer-path=FILE to tokenize in the router ('' = the sims' word tokenizer)")
	fs.Int64Var(&c.Seed, "seed", c.Seed, "dataset seed (of the first repetition)")
	fs.Int64Var(&c.SeedStep, "seed-step", c.SeedStep, "repetition r sends the dataset of seed --seed + (r-1) × N (0: every repetition the same)")
	fs.DurationVar(&c.PointTimeout, "point-max-duration", c.PointTimeout, "bound on one measured run")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.Policies, c.Concurrency, c.Rates, c.NoUnified = pols, cs, rates, !*unified
	switch {
	case len(c.Rates) > 0 && c.RateMaxConcurrency < 1:
		return c, errors.New("kv: --rate-max-concurrency must be >= 1")
	case c.NoUnified && !c.PD:
		return c, errors.New("kv: --unified=false needs --pd")
	case c.Routers < 1 || c.Routers > 8:
		return c, errors.New("kv: --routers must be 1 to 8")
	case len(c.Policies) == 0 || len(c.Concurrency) == 0 || c.Repeats < 1:
		return c, errors.New("kv: --policies, --concurrency and --repeats must not be empty")
	case c.Groups < 1 || c.PerGroup < 2 || c.PrefixLen < c.BlockSize || c.QuestionLen < 1 || c.OutputLen < 1:
		return c, fmt.Errorf("kv: need --groups >= 1, --per-group >= 2, --prefix-len >= %d, --question-len and --output-len >= 1", c.BlockSize)
	case c.Turns < 1:
		return c, errors.New("kv: --turns must be >= 1")
	case c.NumBlocks*c.BlockSize < c.PrefixLen+c.Turns*(c.QuestionLen+c.OutputLen):
		return c, fmt.Errorf("kv: --num-blocks %d cannot hold one request of %d tokens", c.NumBlocks, c.PrefixLen+c.Turns*(c.QuestionLen+c.OutputLen))
	}
	return c, nil
}

func parseCompare(args []string, o *Options, stderr io.Writer) (CompareConfig, error) {
	c := configFor(args, DefaultCompareConfig, QuickCompareConfig)
	fs := scenarioFlags("compare", stderr, "The same fleet and load through switchyard, vllm-router, sglang-router, nginx and vLLM's NIXL toy proxy in turn (run scripts/install-peers.sh first): regular mode with wrk and sybench streams, PD NIXL with static workers, PD MoRI-IO WRITE/READ with ZMQ discovery, faults on the MoRI-IO WRITE pairs and a fresh NIXL pair, a MoRI-IO READ→WRITE fleet turnover without a restart, a PD NIXL concurrency ramp, and the same small load over a real vLLM CPU NIXL pair (scripts/install-interop.sh) with a token-identity check. Writes compare.md and compare.png.", o, 30*time.Minute, loadFlags{
		preset: &c.Preset, policy: &c.Policy, seed: &c.Seed, outputLen: &c.OutputLen, promptsPerC: &c.PromptsPerC,
		workers: "every worker", policyHelp: "--policy of every router", outputHelp: "--random-output-len of the sybench points",
		promptsHelp: "--num-prompts = max(--min-prompts, ceil(this × C))",
	})
	fs.StringVar(&c.PeersDir, "peers-dir", c.PeersDir, "scripts/install-peers.sh's folder (vllm-router, sglang-router, vLLM's sdist)")
	wrk, sc, pc := intList(c.WrkConns), intList(c.StreamConcurrency), intList(c.PDConcurrency)
	fs.Var(&wrk, "wrk-connections", "wrk connection counts (regular mode)")
	fs.DurationVar(&c.WrkDuration, "wrk-duration", c.WrkDuration, "length of one wrk run (whole seconds)")
	fs.Var(&sc, "concurrency", "sybench stream concurrencies (regular mode)")
	fs.Var(&pc, "pd-concurrency", "sybench concurrencies (PD NIXL)")
	cc := intList(c.CeilingConcurrency)
	fs.Var(&cc, "ceiling-concurrency", "PD NIXL concurrency ramp, per router until a request fails")
	noCeiling := fs.Bool("no-ceiling", false, "skip the concurrency ramp")
	mm, mc := strList(c.MoRIModes), intList(c.MoRIConcurrency)
	fs.Var(&mm, "moriio-modes", "MoRI-IO transfer modes of the ZMQ-discovery section")
	fs.Var(&mc, "moriio-concurrency", "sybench concurrencies of the MoRI-IO section")
	fs.StringVar(&c.MoRIPolicy, "moriio-policy", c.MoRIPolicy, "--policy of the MoRI-IO section (the published setup's)")
	noMoRI := fs.Bool("no-moriio", false, "skip the MoRI-IO section")
	fs.BoolVar(&c.Faults, "faults", c.Faults, "inject faults into the MoRI-IO WRITE pairs after their measurements (needs WRITE in --moriio-modes)")
	fs.BoolVar(&c.Turnover, "turnover", c.Turnover, "run the MoRI-IO READ→WRITE fleet turnover (fresh pairs per router, about 30 s each per variant)")
	fs.IntVar(&c.Input, "input-len", c.Input, "--random-input-len")
	fs.IntVar(&c.MinPrompts, "min-prompts", c.MinPrompts, "lower bound of --num-prompts")
	fs.IntVar(&c.Repeats, "repeats", c.Repeats, "interleaved repetitions of every point")
	fs.DurationVar(&c.PointTimeout, "point-max-duration", c.PointTimeout, "bound on one sybench run")
	only, secs := strList(c.Only), strList(c.Sections)
	fs.Var(&secs, "sections", "only these parts, in their fixed order: "+strings.Join(CompareSections, ","))
	fs.Var(&only, "routers", "only these routers (direct always runs): switchyard,vllm-router,sglang-router,nginx,nixl-toy-proxy,moriio-toy-proxy")
	if err := finishParse(fs, args); err != nil {
		return c, err
	}
	c.WrkConns, c.StreamConcurrency, c.PDConcurrency, c.Only, c.CeilingConcurrency = wrk, sc, pc, only, cc
	c.Sections = secs
	for _, s := range c.Sections {
		if !contains(CompareSections, s) {
			return c, fmt.Errorf("--sections: unknown part %q (want some of %s)", s, strings.Join(CompareSections, ","))
		}
	}
	if *noCeiling {
		c.CeilingConcurrency = nil
	}
	c.MoRIModes, c.MoRIConcurrency = nil, mc
	if !*noMoRI {
		for _, m := range mm {
			m, err := transferMode(m, "--moriio-modes value")
			if err != nil {
				return c, err
			}
			c.MoRIModes = append(c.MoRIModes, m)
		}
	}
	if c.WrkDuration < time.Second || c.Repeats < 1 || c.OutputLen <= 0 || c.PromptsPerC <= 0 {
		return c, errors.New("--wrk-duration must be at least 1s; --repeats, --output-len and --prompts-per-concurrency must be positive")
	}
	for _, r := range c.Only {
		if !contains([]string{PeerSwitchyard, PeerVLLMRouter, PeerSGLangRouter, PeerNginx, PeerNIXLToyProxy, PeerMoRIToyProxy}, r) {
			return c, fmt.Errorf("--routers: unknown router %q", r)
		}
	}
	return c, nil
}
