package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// cliOptions are the command-line settings that are not part of Config.
type cliOptions struct {
	saveResult     bool
	saveDetailed   bool
	resultDir      string
	resultFilename string
	disableTqdm    bool
	selfTest       bool
	selfTestITL    time.Duration
	host           string
	port           int
}

// nargsFlags take one or more space-separated values, like argparse's
// nargs="+"/"*" (vllm bench serve's --goodput and --header).
var nargsFlags = map[string]bool{"goodput": true, "header": true}

// expandNargs rewrites "--goodput a b" into "--goodput a --goodput b" so the
// standard flag package can parse it.
func expandNargs(args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...)
		}
		name := strings.TrimLeft(a, "-")
		if !strings.HasPrefix(a, "-") || strings.Contains(name, "=") || !nargsFlags[name] {
			out = append(out, a)
			continue
		}
		j := i + 1
		for j < len(args) && !strings.HasPrefix(args[j], "-") {
			out = append(out, "--"+name, args[j])
			j++
		}
		if j == i+1 {
			out = append(out, a) // let flag report the missing value
		}
		i = j - 1
	}
	return out
}

// parseDuration accepts seconds ("30", "0.5") or a Go duration ("2m").
func parseDuration(s string) (time.Duration, error) {
	if f, err := strconv.ParseFloat(s, 64); err == nil {
		if f < 0 || math.IsNaN(f) || math.IsInf(f, 0) {
			return 0, fmt.Errorf("invalid duration %q", s)
		}
		return time.Duration(f * float64(time.Second)), nil
	}
	return time.ParseDuration(s)
}

func parseFloatList(s string) ([]float64, error) {
	var out []float64
	for _, p := range strings.Split(s, ",") {
		f, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil {
			return nil, fmt.Errorf("invalid number %q", p)
		}
		out = append(out, f)
	}
	return out, nil
}

// parseGoodput parses "ttft:1000" pairs (also comma-separated in one
// argument) into SLOs in ms.
func parseGoodput(into map[string]float64, s string) error {
	for _, pair := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		k, v, ok := strings.Cut(pair, ":")
		if !ok {
			return fmt.Errorf("invalid goodput %q: specify service level objectives as KEY:VALUE pairs (ms)", pair)
		}
		f, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return fmt.Errorf("invalid goodput %q: specify service level objectives as KEY:VALUE pairs (ms)", pair)
		}
		into[strings.TrimSpace(k)] = f
	}
	return nil
}

// ParseArgs parses vllm bench serve style flags into a Config.
func parseArgs(args []string, stderr io.Writer) (Config, cliOptions, error) {
	cfg := DefaultConfig()
	var o cliOptions
	fs := flag.NewFlagSet("sybench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "Usage: sybench [flags]   (a vllm bench serve compatible load generator)")
		for name := range subcommands {
			fmt.Fprintf(stderr, "       sybench %s ...   (sybench %s --help)\n", name, name)
		}
		fs.PrintDefaults()
	}

	fs.StringVar(&cfg.Backend, "backend", cfg.Backend, "backend: openai, vllm (completions) or openai-chat")
	fs.StringVar(&cfg.BaseURL, "base-url", "", "server base URL (default http://{host}:{port})")
	fs.StringVar(&o.host, "host", "127.0.0.1", "server host when --base-url is not set")
	fs.IntVar(&o.port, "port", 8000, "server port when --base-url is not set")
	fs.StringVar(&cfg.Endpoint, "endpoint", cfg.Endpoint, "API endpoint (/v1/completions or /v1/chat/completions)")
	fs.StringVar(&cfg.Model, "model", "", "model name (default: first model of GET /v1/models)")
	fs.StringVar(&cfg.ServedModelName, "served-model-name", "", "model name sent in requests (default --model)")
	fs.String("tokenizer", "", "accepted for compatibility and ignored (prompts are whitespace-tokenized)")
	fs.StringVar(&cfg.DatasetName, "dataset-name", cfg.DatasetName, "dataset: random or shared-prefix")
	fs.IntVar(&cfg.InputLen, "random-input-len", cfg.InputLen, "input length in tokens")
	inputLen := fs.Int("input-len", -1, "alias of --random-input-len")
	fs.IntVar(&cfg.OutputLen, "random-output-len", cfg.OutputLen, "output length in tokens")
	outputLen := fs.Int("output-len", -1, "alias of --random-output-len")
	fs.Float64Var(&cfg.RangeRatio, "random-range-ratio", 0, "length range ratio r in [0,1): lengths uniform in [L(1-r), L(1+r)]")
	fs.IntVar(&cfg.RandomPrefixLen, "random-prefix-len", 0, "tokens of a random prefix shared by every prompt")
	fs.Int64Var(&cfg.Seed, "seed", 0, "random seed (dataset and arrival times)")
	fs.IntVar(&cfg.SharedPrefixGroups, "shared-prefix-groups", cfg.SharedPrefixGroups, "shared-prefix: number of prefix groups")
	fs.IntVar(&cfg.SharedPrefixPromptsPerGroup, "shared-prefix-prompts-per-group", 0, "shared-prefix: prompts per group (sets --num-prompts to groups*this; default num-prompts/groups)")
	fs.IntVar(&cfg.SharedPrefixLen, "shared-prefix-len", cfg.SharedPrefixLen, "shared-prefix: prefix length in tokens")
	fs.IntVar(&cfg.SharedPrefixTurns, "shared-prefix-turns", 0, "shared-prefix: turns per conversation; > 1 makes every turn resend the conversation's history (earlier questions and answers)")
	fs.IntVar(&cfg.NumPrompts, "num-prompts", cfg.NumPrompts, "number of measured requests")
	fs.IntVar(&cfg.MaxConcurrency, "max-concurrency", 0, "maximum concurrent requests (default: no limit)")
	fs.Func("request-rate", "requests per second, or inf (default inf)", func(s string) error {
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || !(f > 0) {
			return fmt.Errorf("invalid request rate %q", s)
		}
		cfg.RequestRate = f
		return nil
	})
	fs.Func("burstiness", "gamma shape of request intervals (1 = Poisson; default 1)", func(s string) error {
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || !(f > 0) {
			return fmt.Errorf("invalid burstiness %q", s)
		}
		cfg.Burstiness = f
		return nil
	})
	fs.IntVar(&cfg.NumWarmups, "num-warmups", 0, "warm-up requests (copies of the first request) before the run")
	fs.BoolVar(&cfg.IgnoreEOS, "ignore-eos", false, "send ignore_eos (always on for the random dataset)")
	fs.Func("logprobs", "logprobs per token to request (default null)", func(s string) error {
		n, err := strconv.Atoi(s)
		if err != nil {
			return err
		}
		cfg.Logprobs = &n
		return nil
	})
	extra := map[string]any{}
	sampling := func(name string, integer bool) {
		fs.Func(name, "sampling parameter "+strings.ReplaceAll(name, "-", "_")+" (sent only when given)", func(s string) error {
			if integer {
				n, err := strconv.Atoi(s)
				if err != nil {
					return err
				}
				extra[strings.ReplaceAll(name, "-", "_")] = n
				return nil
			}
			f, err := strconv.ParseFloat(s, 64)
			if err != nil {
				return err
			}
			extra[strings.ReplaceAll(name, "-", "_")] = f
			return nil
		})
	}
	sampling("temperature", false)
	sampling("top-p", false)
	sampling("top-k", true)
	sampling("min-p", false)
	sampling("frequency-penalty", false)
	sampling("presence-penalty", false)
	sampling("repetition-penalty", false)
	extraBody := fs.String("extra-body", "", "JSON object merged into every request body")
	cfg.Goodput = map[string]float64{}
	fs.Func("goodput", "goodput SLOs as KEY:MS pairs (ttft, tpot, e2el), space or comma separated", func(s string) error {
		return parseGoodput(cfg.Goodput, s)
	})
	fs.Func("percentile-metrics", "comma-separated metrics to report: ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue (default ttft,tpot,itl)", func(s string) error {
		cfg.PercentileMetrics = strings.Split(s, ",")
		return nil
	})
	fs.Func("metric-percentiles", "comma-separated percentiles to report (default 99)", func(s string) error {
		p, err := parseFloatList(s)
		cfg.MetricPercentiles = p
		return err
	})
	fs.BoolVar(&o.saveResult, "save-result", false, "save the result JSON")
	fs.BoolVar(&o.saveDetailed, "save-detailed", true, "include per-request arrays in the saved JSON (default true; --save-detailed=false to omit)")
	fs.StringVar(&o.resultDir, "result-dir", "", "directory for the result JSON")
	fs.StringVar(&o.resultFilename, "result-filename", "", "file name for the result JSON (default vLLM's naming)")
	fs.StringVar(&cfg.RequestIDPrefix, "request-id-prefix", DefaultRequestIDPrefix(), "x-request-id prefix (the request index follows)")
	cfg.Header = http.Header{}
	fs.Func("header", "KEY=VALUE header for every request (repeatable, or several after one flag)", func(s string) error {
		k, v, ok := strings.Cut(s, "=")
		if !ok {
			return errors.New("invalid header format; use KEY=VALUE")
		}
		cfg.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
		return nil
	})
	fs.BoolVar(&o.disableTqdm, "disable-tqdm", false, "disable the progress bar")
	fs.Func("timeout", "per-request timeout (seconds or Go duration; default none)", func(s string) (err error) {
		cfg.Timeout, err = parseDuration(s)
		return err
	})
	fs.Func("max-duration", "hard limit on the whole run (seconds or Go duration; default none)", func(s string) (err error) {
		cfg.MaxDuration, err = parseDuration(s)
		return err
	})
	fs.StringVar(&cfg.Label, "label", "", "label of the result file (default: backend)")
	fs.BoolVar(&cfg.Insecure, "insecure", false, "skip TLS certificate verification")
	fs.IntVar(&cfg.MaxEventBytes, "max-event-bytes", DefaultMaxEventBytes, "largest accepted SSE event")
	fs.BoolVar(&o.selfTest, "self-test-overhead", false, "benchmark against an in-process zero-latency SSE server to measure sybench's own capacity")
	fs.Func("self-test-itl", "with --self-test-overhead: server pause between token events (e.g. 20ms; default 0)", func(s string) (err error) {
		o.selfTestITL, err = parseDuration(s)
		return err
	})

	if err := fs.Parse(expandNargs(args)); err != nil {
		return cfg, o, err
	}
	if fs.NArg() > 0 {
		return cfg, o, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if *inputLen >= 0 {
		cfg.InputLen = *inputLen
	}
	if *outputLen >= 0 {
		cfg.OutputLen = *outputLen
	}
	if cfg.BaseURL == "" {
		cfg.BaseURL = "http://" + net.JoinHostPort(o.host, strconv.Itoa(o.port))
	}
	if len(cfg.Goodput) == 0 {
		cfg.Goodput = nil
	}
	if len(extra) > 0 || *extraBody != "" {
		merged, err := mergeExtraBody(extra, *extraBody)
		if err != nil {
			return cfg, o, err
		}
		cfg.ExtraBody = merged
	}
	return cfg, o, nil
}

// Subcommand is a command Main runs instead of the benchmark when the first
// argument names it; args exclude the name.
type Subcommand func(ctx context.Context, args []string, stdout, stderr io.Writer) error

var subcommands = map[string]Subcommand{}

// RegisterSubcommand makes Main dispatch "sybench NAME args..." to fn
// (cmd/sybench registers "scenario"). Call it before Main, not concurrently.
// Without a registered first argument Main behaves as before: sybench
// takes no positional arguments, so a name cannot shadow a valid command
// line.
func RegisterSubcommand(name string, fn Subcommand) { subcommands[name] = fn }

// Main runs the sybench command line: it parses args, runs the benchmark,
// prints vLLM's report to stdout and optionally saves the JSON result.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		if fn := subcommands[args[0]]; fn != nil {
			return fn(ctx, args[1:], stdout, stderr)
		}
	}
	cfg, o, err := parseArgs(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	cfg.Log = stdout
	if key := os.Getenv("OPENAI_API_KEY"); key != "" {
		cfg.APIKey = key
	}
	if !o.disableTqdm && isTerminal(stdout) && isTerminal(stderr) {
		cfg.Progress = stderr
	}
	cfg.DiscardText = !(o.saveResult && o.saveDetailed)

	if o.selfTest {
		return selfTest(ctx, cfg, o.selfTestITL, stdout)
	}

	res, runErr := Run(ctx, cfg)
	if res == nil {
		return runErr
	}
	if err := res.WriteReport(stdout); err != nil {
		return err
	}
	if o.saveResult {
		path, err := res.SaveResult(o.resultDir, o.resultFilename, o.saveDetailed)
		if err != nil {
			return fmt.Errorf("save result: %w", err)
		}
		fmt.Fprintf(stdout, "Result saved to %s\n", path)
	}
	return runErr
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
