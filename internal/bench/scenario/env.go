package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/switchyard-llm/switchyard/internal/bench"
)

// Options are the settings every scenario shares.
type Options struct {
	// BinDir holds the switchyard and vllm-sim binaries (default "bin").
	BinDir string
	// OutDir receives the Markdown (and PNG) outputs; "" writes none.
	OutDir string
	// LogDir receives one log file per child process. When empty a
	// temporary directory is used and removed after a successful run (it is
	// kept, and its path printed, when the scenario fails).
	LogDir string
	// MaxDuration bounds the whole scenario, child start-up and shutdown
	// included (0: the scenario's default).
	MaxDuration time.Duration
	// Quick runs fewer, smaller points (smoke runs).
	Quick bool
	// Out receives progress lines and the final tables (nil: discarded).
	Out io.Writer
	// Command is the command line recorded in the outputs.
	Command string
}

// errBudget ends a scenario whose --max-duration is used up.
var errBudget = errors.New("scenario --max-duration reached")

// shutdownReserve is kept from the scenario budget for stopping children.
const shutdownReserve = 15 * time.Second

// env is a running scenario: its children, log directory and deadline.
type env struct {
	o        Options
	g        *group
	m        machine
	start    time.Time
	deadline time.Time
	tmpLogs  bool
}

// setup raises the fd limit, creates the log directory and the process
// group, and returns a context bounded by the scenario's budget.
func setup(ctx context.Context, o Options, defMax time.Duration) (*env, context.Context, context.CancelFunc, error) {
	if o.BinDir == "" {
		o.BinDir = "bin"
	}
	if o.Out == nil {
		o.Out = io.Discard
	}
	if o.MaxDuration <= 0 {
		o.MaxDuration = defMax
	}
	nofile, err := raiseNoFileLimit()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("raise RLIMIT_NOFILE: %w", err)
	}
	e := &env{o: o, start: time.Now()}
	e.deadline = e.start.Add(o.MaxDuration)
	if o.LogDir == "" {
		d, err := os.MkdirTemp("", "sybench-scenario-")
		if err != nil {
			return nil, nil, nil, err
		}
		e.o.LogDir, e.tmpLogs = d, true
	} else if err := os.MkdirAll(o.LogDir, 0o755); err != nil {
		return nil, nil, nil, err
	}
	e.g = newGroup(o.BinDir, e.o.LogDir)
	e.m = currentMachine(nofile)
	// The hard backstop: the budget plus time to stop the children.
	cctx, cancel := context.WithDeadline(ctx, e.deadline.Add(shutdownReserve))
	return e, cctx, cancel, nil
}

// finish stops every child and removes temporary logs when err is nil.
func (e *env) finish(err error) {
	e.g.stopAll()
	if err == nil && e.tmpLogs {
		os.RemoveAll(e.o.LogDir)
		return
	}
	if err != nil {
		fmt.Fprintf(e.o.Out, "child process logs kept in %s\n", e.o.LogDir)
	}
}

func (e *env) printf(format string, a ...any) { fmt.Fprintf(e.o.Out, format, a...) }

// budget returns how long the next point may run: at most cap, and never
// past the scenario deadline. It fails once less than floor remains.
func (e *env) budget(cap, floor time.Duration) (time.Duration, error) {
	left := time.Until(e.deadline)
	if left < floor {
		return 0, errBudget
	}
	return minDur(cap, left), nil
}

func minDur(a, b time.Duration) time.Duration {
	if a < b {
		return a
	}
	return b
}

// writeOut writes name under OutDir (no-op without OutDir).
func (e *env) writeOut(name string, write func(w io.Writer) error) (string, error) {
	if e.o.OutDir == "" {
		return "", nil
	}
	if err := os.MkdirAll(e.o.OutDir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(e.o.OutDir, name)
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	if err := write(f); err != nil {
		f.Close()
		return "", err
	}
	return path, f.Close()
}

// load is one benchmark point.
type load struct {
	base           string
	input, output  int
	concurrency    int
	prompts        int
	warmups        int
	seed           int64
	goodputTTFTms  float64
	maxDuration    time.Duration
	transport      *benchTransport
	requestTimeout time.Duration
}

// config turns a load into sybench's configuration (vllm bench serve
// --backend vllm --dataset-name random --ignore-eos ...).
func (l load) config() bench.Config {
	cfg := bench.DefaultConfig()
	cfg.BaseURL = l.base
	cfg.Backend = bench.BackendVLLM
	cfg.Model = simModel
	cfg.DatasetName = bench.DatasetRandom
	cfg.InputLen, cfg.OutputLen = l.input, l.output
	cfg.MaxConcurrency = l.concurrency
	cfg.NumPrompts = l.prompts
	cfg.NumWarmups = l.warmups
	cfg.IgnoreEOS = true
	cfg.Seed = l.seed
	if l.goodputTTFTms > 0 {
		cfg.Goodput = map[string]float64{"ttft": l.goodputTTFTms}
	}
	cfg.MaxDuration = l.maxDuration
	cfg.Timeout = l.requestTimeout
	cfg.DiscardText = true
	cfg.MetricPercentiles = []float64{50, 99}
	if l.transport != nil {
		cfg.Transport = l.transport.t
	}
	return cfg
}

// flags is the equivalent sybench command line of the load (for docs).
func (l load) flags() string {
	s := fmt.Sprintf("--backend vllm --dataset-name random --random-input-len %d --random-output-len %d --max-concurrency %d --num-prompts %d --num-warmups %d --ignore-eos --seed %d",
		l.input, l.output, l.concurrency, l.prompts, l.warmups, l.seed)
	if l.goodputTTFTms > 0 {
		s += fmt.Sprintf(" --goodput ttft:%g", l.goodputTTFTms)
	}
	return s
}

// run runs one point. A run cut short by its max duration is returned
// with Stopped set; a cancelled ctx returns ctx's error.
func (l load) run(ctx context.Context) (*bench.Result, error) {
	res, err := bench.Run(ctx, l.config())
	if err != nil && ctx.Err() != nil {
		return res, ctx.Err()
	}
	return res, err
}

// promptsFor is max(minN, ceil(f*C)).
func promptsFor(c int, f float64, minN int) int {
	return max(minN, int(math.Ceil(f*float64(c))))
}

// ms formats milliseconds for tables.
func ms(v float64) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "n/a"
	}
	return fmt.Sprintf("%.2f", v)
}

// sec formats a wall time.
func sec(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }
