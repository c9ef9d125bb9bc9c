package sim

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/switchyard-llm/switchyard/internal/sim/engine"
)

// Roles.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RoleUnified = "unified"
)

// KV connectors.
const (
	ConnMoRIIO   = "moriio"
	ConnNIXL     = "nixl"
	ConnMooncake = "mooncake"
	ConnP2PNCCL  = "p2pnccl"
)

// Presets.
const (
	PresetDefault  = "default"
	PresetDeepSeek = "deepseek-r1-1p1d"
	PresetZero     = "zero"
)

// Config is the whole configuration of one simulated vLLM instance.
type Config struct {
	Host  string
	Port  int
	Model string
	// EnableLoRA is vLLM's --enable-lora: requests may name a LoRA adapter
	// (LoRAModules, or one loaded at run time), whose blocks are keyed
	// with its name.
	EnableLoRA  bool
	LoRAModules []LoRAModule
	// RuntimeLoRA is vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the
	// environment variable, read by ParseArgs): /v1/load_lora_adapter and
	// /v1/unload_lora_adapter exist.
	RuntimeLoRA bool
	// Tokenizer is a HuggingFace tokenizer.json (or a model directory
	// holding one) for prompts; "" = the built-in word tokenizer.
	Tokenizer     string
	Role          string
	KVConnector   string
	TransferMode  string // "READ" or "WRITE" (MoRI-IO)
	ProxyAddress  string
	RegFormat     string // "new" or "old"
	HeartbeatIvl  time.Duration
	AdvertiseHost string
	HandshakePort int
	NotifyPort    int
	KVPort        int
	BootstrapPort int
	DPSize        int
	TPSize        int

	Preset      string
	Engine      engine.Params // before TimeScale
	MaxModelLen int
	TimeScale   float64

	Seed           int64
	EOSProbability float64
	Strict         bool
	NestedBlockIDs bool
	KVWaitTimeout  time.Duration
	DeferTimeout   time.Duration
	TransferTime   time.Duration

	ResponsesStore    bool   // VLLM_ENABLE_RESPONSES_API_STORE=1
	ResponsesStoreMax int    // stored responses kept; the oldest is evicted
	APIKey            string // vLLM's --api-key: /v1/* needs "Authorization: Bearer <key>"
	OpenAIStrict      bool   // answer like OpenAI's API: unknown request fields are a 400

	Cache CacheConfig // prefix cache usage reporting, KV events

	Faults FaultConfig

	LogLevel string
}

// FaultConfig is the start-up value of every injectable fault.
type FaultConfig struct {
	FailNext        int
	FailStatus      int
	CrashAfter      int
	StallFirstToken time.Duration
	DropWriteDone   bool
	NoHeartbeat     bool
	SlowFactor      float64
	MaxWaiting      int
	FailReads       int
	CutAfterTokens  int
	CrashAfterToks  int
}

// Preset returns the engine parameters and max_model_len of a preset.
func Preset(name string) (engine.Params, int, error) {
	switch name {
	case PresetDefault:
		// Modest latencies for tests: a 8k-token prefill takes 165 ms and
		// its KV transfer 66 ms, so WRITE/READ differences are visible.
		return engine.Params{
			MaxNumSeqs:          256,
			NumBlocks:           16384,
			BlockSize:           16,
			MaxNumBatchedTokens: 8192,
			PrefillBase:         5 * time.Millisecond,
			PrefillPerToken:     20 * time.Microsecond,
			DecodeStepBase:      2 * time.Millisecond,
			DecodeStepPerSeq:    50 * time.Microsecond,
			NumLayers:           8,
			KVBytesPerToken:     16384,
			KVBandwidth:         2e9,
			TransferBase:        500 * time.Microsecond,
			HandshakeTime:       5 * time.Millisecond,
		}, 32768, nil
	case PresetZero:
		return engine.Params{
			MaxNumSeqs:          1024,
			NumBlocks:           1 << 20,
			BlockSize:           16,
			MaxNumBatchedTokens: 1 << 16,
			NumLayers:           1,
		}, 65536, nil
	case PresetDeepSeek:
		// DeepSeek-R1 on one TP8 node per role (MORIIO-RESULTS.md): MLA fp8
		// KV is 61 layers x 576 bytes per token, block size 1, 32k token
		// budget. Prefill F(L) = 150 ms + 10 µs·L + 9.4 ns·L²: ~170 ms at
		// 1k, ~830 ms at 8k, a batch of 16 x 1k ~460 ms, and a full step of
		// 4 x 8k ~2.9 s, so P saturates near 1.4 req/s at 8k as published.
		// A decode step is 15.4 ms at 16 sequences rising to 25 ms at 256.
		// An 8k KV transfer takes ~285 ms: WRITE hides all but one layer of
		// it, READ stalls D's decode step on it (READ's TPOT rises).
		return engine.Params{
			MaxNumSeqs:          512,
			NumBlocks:           2_000_000,
			BlockSize:           1,
			MaxNumBatchedTokens: 32768,
			PrefillBase:         150 * time.Millisecond,
			PrefillPerToken:     10 * time.Microsecond,
			PrefillQuadratic:    9.4,
			DecodeStepBase:      14800 * time.Microsecond,
			DecodeStepPerSeq:    40 * time.Microsecond,
			NumLayers:           61,
			KVBytesPerToken:     61 * 576,
			KVBandwidth:         1e9,
			TransferBase:        2 * time.Millisecond,
			HandshakeTime:       time.Second,
		}, 16384, nil
	}
	return engine.Params{}, 0, fmt.Errorf("unknown preset %q (want default, deepseek-r1-1p1d or zero)", name)
}

// UsageError is a command-line error; the binary exits with status 2.
type UsageError struct{ Err error }

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

// ErrHelp is returned when -h/--help was given (exit 0).
var ErrHelp = flag.ErrHelp

// ParseArgs parses and validates the command line.
func ParseArgs(args []string, stderr io.Writer) (Config, error) {
	var c Config
	fs := flag.NewFlagSet("vllm-sim", flag.ContinueOnError)
	fs.SetOutput(stderr)

	fs.StringVar(&c.Host, "host", "127.0.0.1", "HTTP (and ZMQ) bind address")
	fs.IntVar(&c.Port, "port", 8000, "HTTP port (0 = pick a free port)")
	fs.StringVar(&c.Model, "model", "sim-model", "served model name")
	fs.BoolVar(&c.EnableLoRA, "enable-lora", false, "serve LoRA adapters (vLLM's --enable-lora): --lora-modules, and with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the environment, adapters loaded at run time")
	fs.Var(loraModulesFlag{&c.LoRAModules}, "lora-modules", "LoRA adapters served from the start, as vLLM's: name=path entries (space-separated) or a JSON object {\"name\", \"path\"}; repeatable; needs --enable-lora")
	fs.StringVar(&c.Tokenizer, "tokenizer", "", "tokenize prompts with this HuggingFace tokenizer.json (or a model directory holding one; byte-level BPE, see internal/tokenizer) instead of the built-in word tokenizer: /tokenize, usage, the prefix cache and KV events then carry its ids (generated tokens stay the word model's)")
	fs.StringVar(&c.Role, "role", RoleUnified, "prefill, decode or unified")
	fs.StringVar(&c.KVConnector, "kv-connector", ConnMoRIIO, "moriio, nixl, mooncake or p2pnccl (ignored for unified)")
	fs.StringVar(&c.TransferMode, "transfer-mode", "WRITE", "MoRI-IO transfer mode: READ or WRITE")
	fs.StringVar(&c.ProxyAddress, "proxy-address", "", "host:port of the router's ZMQ discovery ROUTER (empty = do not register)")
	fs.StringVar(&c.RegFormat, "registration-format", "new", "MoRI-IO registration format: new or old")
	fs.DurationVar(&c.HeartbeatIvl, "heartbeat-interval", 3*time.Second, "registration heartbeat interval")
	fs.StringVar(&c.AdvertiseHost, "advertise-host", "127.0.0.1", "IP put in http_address and zmq_address")
	fs.IntVar(&c.HandshakePort, "handshake-port", 0, "handshake/side-channel base port (0 = free)")
	fs.IntVar(&c.NotifyPort, "notify-port", 0, "MoRI-IO notify base port (0 = free)")
	fs.IntVar(&c.KVPort, "kv-port", 0, "P2P-NCCL kv_port (0 = free)")
	fs.IntVar(&c.BootstrapPort, "bootstrap-port", 0, "Mooncake bootstrap HTTP port on the prefill (0 = free)")
	fs.IntVar(&c.DPSize, "data-parallel-size", 1, "number of DP engines (each its own scheduler)")
	fs.IntVar(&c.TPSize, "tensor-parallel-size", 1, "TP size (addressing only)")

	fs.StringVar(&c.Preset, "profile-preset", PresetDefault, "engine preset: default, deepseek-r1-1p1d or zero")
	var ov engineOverrides
	ov.register(fs)
	var cf cacheFlags
	cf.register(fs)
	fs.Float64Var(&c.TimeScale, "time-scale", 1.0, "multiplies every simulated duration")
	var policy string
	fs.StringVar(&policy, "scheduling-policy", engine.PolicyFCFS, "vLLM's --scheduling-policy: fcfs, or priority (the request field \"priority\", lower first; preempts the lowest priority when KV blocks run out)")

	fs.Int64Var(&c.Seed, "seed", 0, "sampling seed (a request's \"seed\" overrides it)")
	fs.Float64Var(&c.EOSProbability, "eos-probability", 0, "probability that the first token is EOS when ignore_eos is false")
	fs.BoolVar(&c.Strict, "strict", false, "return 400 for PD protocol violations instead of vLLM's hang/garbage")
	fs.BoolVar(&c.NestedBlockIDs, "nested-block-ids", false, "MoRI-IO prefill returns remote_block_ids as [[int]] (newest connector)")
	fs.DurationVar(&c.KVWaitTimeout, "kv-wait-timeout", 0, "decode: fail a request whose remote KV has not arrived after this long (0 = wait forever, like vLLM)")
	fs.DurationVar(&c.DeferTimeout, "defer-timeout", 60*time.Second, "prefill: free pinned blocks no consumer claimed after this long")
	fs.DurationVar(&c.TransferTime, "transfer-timeout", 30*time.Second, "handshake and KV read timeout")
	fs.BoolVar(&c.ResponsesStore, "responses-store", false, "keep /v1/responses results for GET /v1/responses/{id} (mirrors vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1)")
	fs.IntVar(&c.ResponsesStoreMax, "responses-store-max", 10000, "responses kept by --responses-store; the oldest is evicted when full")
	fs.StringVar(&c.APIKey, "api-key", "", "require \"Authorization: Bearer KEY\" on every /v1/* request, like vLLM's --api-key (401 otherwise)")
	fs.BoolVar(&c.OpenAIStrict, "openai-strict", false, "behave like OpenAI's API: chat/completion fields OpenAI does not know (vLLM's extensions) are a 400, a bad key is OpenAI's 401")

	fs.IntVar(&c.Faults.FailNext, "fail-next", 0, "fail the next N generation requests with --fail-status")
	fs.IntVar(&c.Faults.FailStatus, "fail-status", 500, "HTTP status used by --fail-next")
	fs.IntVar(&c.Faults.CrashAfter, "crash-after", 0, "exit(1) when the Nth generation request starts (0 = never)")
	fs.DurationVar(&c.Faults.StallFirstToken, "stall-first-token", 0, "delay the first token of every request by this long")
	fs.BoolVar(&c.Faults.DropWriteDone, "drop-write-done", false, "prefill: never send write_done (or the Mooncake/P2P completion)")
	fs.BoolVar(&c.Faults.NoHeartbeat, "no-heartbeat", false, "start with registration heartbeats off (SIGUSR1 toggles)")
	fs.Float64Var(&c.Faults.SlowFactor, "slow-factor", 1.0, "multiplies every step's compute time")
	fs.IntVar(&c.Faults.MaxWaiting, "max-waiting", 0, "reject with 503 when more than N requests are queued per engine (0 = unbounded)")
	fs.IntVar(&c.Faults.CutAfterTokens, "cut-after-tokens", 0, "close the connection of every generation (stream or not) once K tokens of it were generated, without [DONE] (0 = never)")
	fs.IntVar(&c.Faults.CrashAfterToks, "crash-after-tokens", 0, "exit(1) once K tokens of one generation were generated (and, streaming, sent) (0 = never)")
	fs.IntVar(&c.Faults.FailReads, "fail-reads", 0, "decode: the next N KV reads (MoRI-IO READ, NIXL) fail like an RDMA error: release, then local recompute")

	fs.StringVar(&c.LogLevel, "log-level", "info", "debug, info, warn or error")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return c, ErrHelp
		}
		return c, &UsageError{Err: err}
	}
	if fs.NArg() > 0 {
		return c, &UsageError{Err: fmt.Errorf("unexpected argument %q", fs.Arg(0))}
	}
	switch strings.ToLower(strings.TrimSpace(os.Getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING"))) {
	case "1", "true": // vLLM's envs.py reads it so
		c.RuntimeLoRA = true
	}
	p, mml, err := Preset(c.Preset)
	if err != nil {
		return c, &UsageError{Err: fmt.Errorf("invalid value for flag --profile-preset: %w", err)}
	}
	c.Engine = p
	c.Engine.SchedulingPolicy = policy
	c.MaxModelLen = mml
	ov.apply(fs, &c)
	if err := cf.apply(&c); err != nil {
		return c, &UsageError{Err: err}
	}
	if err := c.Validate(); err != nil {
		return c, &UsageError{Err: err}
	}
	return c, nil
}

// engineOverrides are the per-parameter flags applied over the preset, only
// when given on the command line.
type engineOverrides struct {
	maxNumSeqs, numBlocks, blockSize, maxBatched, numLayers, maxModelLen int
	prefillBase, prefillPerTok, stepBase, stepPerSeq, xferBase, hs       time.Duration
	kvBytes                                                              int64
	bandwidth, prefillQuad                                               float64
}

func (o *engineOverrides) register(fs *flag.FlagSet) {
	fs.IntVar(&o.maxNumSeqs, "max-num-seqs", 0, "running slots per engine (preset)")
	fs.IntVar(&o.numBlocks, "num-blocks", 0, "KV blocks per engine (preset)")
	fs.IntVar(&o.blockSize, "block-size", 0, "tokens per KV block (preset)")
	fs.IntVar(&o.maxBatched, "max-num-batched-tokens", 0, "token budget per step (preset)")
	fs.IntVar(&o.maxModelLen, "max-model-len", 0, "maximum prompt+output tokens (preset)")
	fs.DurationVar(&o.prefillBase, "prefill-base", 0, "prefill step base time a (preset)")
	fs.DurationVar(&o.prefillPerTok, "prefill-per-token", 0, "prefill time per token b (preset)")
	fs.Float64Var(&o.prefillQuad, "prefill-quadratic-ns", 0, "prefill attention cost c in ns per token², F = a + b·L + c·L² (preset)")
	fs.DurationVar(&o.stepBase, "decode-step-base", 0, "decode step base time s0 (preset)")
	fs.DurationVar(&o.stepPerSeq, "decode-step-per-seq", 0, "decode step time per sequence s1 (preset)")
	fs.IntVar(&o.numLayers, "num-layers", 0, "layers a KV transfer is split over (preset)")
	fs.Int64Var(&o.kvBytes, "kv-bytes-per-token", 0, "KV bytes per token (preset)")
	fs.Float64Var(&o.bandwidth, "kv-bandwidth", 0, "KV transfer bandwidth in bytes/s, 0 = infinite (preset)")
	fs.DurationVar(&o.xferBase, "transfer-base", 0, "fixed cost x0 of one KV transfer (preset)")
	fs.DurationVar(&o.hs, "handshake-time", 0, "first-contact handshake time Hs (preset)")
}

func (o *engineOverrides) apply(fs *flag.FlagSet, c *Config) {
	fs.Visit(func(f *flag.Flag) {
		p := &c.Engine
		switch f.Name {
		case "max-num-seqs":
			p.MaxNumSeqs = o.maxNumSeqs
		case "num-blocks":
			p.NumBlocks = o.numBlocks
		case "block-size":
			p.BlockSize = o.blockSize
		case "max-num-batched-tokens":
			p.MaxNumBatchedTokens = o.maxBatched
		case "max-model-len":
			c.MaxModelLen = o.maxModelLen
		case "prefill-base":
			p.PrefillBase = o.prefillBase
		case "prefill-per-token":
			p.PrefillPerToken = o.prefillPerTok
		case "prefill-quadratic-ns":
			p.PrefillQuadratic = o.prefillQuad
		case "decode-step-base":
			p.DecodeStepBase = o.stepBase
		case "decode-step-per-seq":
			p.DecodeStepPerSeq = o.stepPerSeq
		case "num-layers":
			p.NumLayers = o.numLayers
		case "kv-bytes-per-token":
			p.KVBytesPerToken = o.kvBytes
		case "kv-bandwidth":
			p.KVBandwidth = o.bandwidth
		case "transfer-base":
			p.TransferBase = o.xferBase
		case "handshake-time":
			p.HandshakeTime = o.hs
		}
	})
}

// Validate checks every field and names the offending flag.
func (c *Config) Validate() error {
	var errs []error
	bad := func(flagName string, format string, args ...any) {
		errs = append(errs, fmt.Errorf("invalid value for flag --%s: %s", flagName, fmt.Sprintf(format, args...)))
	}
	if net.ParseIP(c.Host) == nil && !validHostname(c.Host) {
		bad("host", "%q is not an IP address or host name", c.Host)
	}
	checkPort := func(name string, v int) {
		if v < 0 || v > 65535 {
			bad(name, "port %d out of range [0, 65535]", v)
		}
	}
	checkPort("port", c.Port)
	checkPort("handshake-port", c.HandshakePort)
	checkPort("notify-port", c.NotifyPort)
	checkPort("kv-port", c.KVPort)
	checkPort("bootstrap-port", c.BootstrapPort)
	if strings.TrimSpace(c.Model) == "" {
		bad("model", "must not be empty")
	}
	if len(c.LoRAModules) > 0 && !c.EnableLoRA {
		bad("lora-modules", "needs --enable-lora")
	}
	seen := map[string]bool{c.Model: true}
	for _, m := range c.LoRAModules {
		if seen[m.Name] {
			bad("lora-modules", "%q is named twice (or is the model's name)", m.Name)
		}
		seen[m.Name] = true
	}
	switch c.Role {
	case RolePrefill, RoleDecode, RoleUnified:
	default:
		bad("role", "%q (want prefill, decode or unified)", c.Role)
	}
	switch c.KVConnector {
	case ConnMoRIIO, ConnNIXL, ConnMooncake, ConnP2PNCCL:
	default:
		bad("kv-connector", "%q (want moriio, nixl, mooncake or p2pnccl)", c.KVConnector)
	}
	switch strings.ToUpper(c.TransferMode) {
	case "READ", "WRITE":
		c.TransferMode = strings.ToUpper(c.TransferMode)
	default:
		bad("transfer-mode", "%q (want READ or WRITE)", c.TransferMode)
	}
	if c.ProxyAddress != "" {
		host, port, err := net.SplitHostPort(c.ProxyAddress)
		if err != nil || host == "" {
			bad("proxy-address", "%q is not host:port", c.ProxyAddress)
		} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			bad("proxy-address", "bad port in %q", c.ProxyAddress)
		}
	}
	switch c.RegFormat {
	case "new", "old":
	default:
		bad("registration-format", "%q (want new or old)", c.RegFormat)
	}
	if c.HeartbeatIvl <= 0 {
		bad("heartbeat-interval", "must be > 0, got %v", c.HeartbeatIvl)
	}
	if !validAdvertiseHost(c.AdvertiseHost) {
		bad("advertise-host", "%q must be an IP address or host name without ',' or '___'", c.AdvertiseHost)
	}
	if c.DPSize < 1 || c.DPSize > 256 {
		bad("data-parallel-size", "%d not in [1, 256]", c.DPSize)
	}
	if c.TPSize < 1 || c.TPSize > 64 {
		bad("tensor-parallel-size", "%d not in [1, 64]", c.TPSize)
	}
	if err := c.Engine.Validate(); err != nil {
		// engine.Params.Validate names fields by their flag names.
		for _, e := range splitJoined(err) {
			errs = append(errs, fmt.Errorf("invalid value for flag --%s", e.Error()))
		}
	}
	if c.MaxModelLen < 1 {
		bad("max-model-len", "must be >= 1, got %d", c.MaxModelLen)
	} else if c.Engine.NumBlocks > 0 && c.Engine.BlockSize > 0 && c.MaxModelLen > c.Engine.NumBlocks*c.Engine.BlockSize {
		bad("max-model-len", "%d exceeds the KV capacity num-blocks*block-size = %d", c.MaxModelLen, c.Engine.NumBlocks*c.Engine.BlockSize)
	}
	if c.TimeScale <= 0 || math.IsNaN(c.TimeScale) || math.IsInf(c.TimeScale, 0) {
		bad("time-scale", "must be a positive number, got %g", c.TimeScale)
	}
	if c.EOSProbability < 0 || c.EOSProbability > 1 || math.IsNaN(c.EOSProbability) {
		bad("eos-probability", "must be in [0, 1], got %g", c.EOSProbability)
	}
	if c.KVWaitTimeout < 0 {
		bad("kv-wait-timeout", "must be >= 0, got %v", c.KVWaitTimeout)
	}
	if c.DeferTimeout <= 0 {
		bad("defer-timeout", "must be > 0, got %v", c.DeferTimeout)
	}
	if c.TransferTime <= 0 {
		bad("transfer-timeout", "must be > 0, got %v", c.TransferTime)
	}
	if c.ResponsesStoreMax < 1 {
		bad("responses-store-max", "must be >= 1, got %d", c.ResponsesStoreMax)
	}
	f := c.Faults
	if f.FailNext < 0 {
		bad("fail-next", "must be >= 0, got %d", f.FailNext)
	}
	if f.FailStatus < 400 || f.FailStatus > 599 {
		bad("fail-status", "must be an HTTP error status in [400, 599], got %d", f.FailStatus)
	}
	if f.CrashAfter < 0 {
		bad("crash-after", "must be >= 0, got %d", f.CrashAfter)
	}
	if f.StallFirstToken < 0 {
		bad("stall-first-token", "must be >= 0, got %v", f.StallFirstToken)
	}
	if f.SlowFactor <= 0 || math.IsNaN(f.SlowFactor) || math.IsInf(f.SlowFactor, 0) {
		bad("slow-factor", "must be a positive number, got %g", f.SlowFactor)
	}
	if f.MaxWaiting < 0 {
		bad("max-waiting", "must be >= 0, got %d", f.MaxWaiting)
	}
	if f.CutAfterTokens < 0 {
		bad("cut-after-tokens", "must be >= 0, got %d", f.CutAfterTokens)
	}
	if f.CrashAfterToks < 0 {
		bad("crash-after-tokens", "must be >= 0, got %d", f.CrashAfterToks)
	}
	if f.FailReads < 0 {
		bad("fail-reads", "must be >= 0, got %d", f.FailReads)
	}
	errs = append(errs, c.validateCache()...)
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("log-level", "%q (want debug, info, warn or error)", c.LogLevel)
	}
	return errors.Join(errs...)
}

func splitJoined(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func validHostname(h string) bool {
	if h == "" || len(h) > 253 {
		return false
	}
	for _, r := range h {
		if !(r == '.' || r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			return false
		}
	}
	return true
}

func validAdvertiseHost(h string) bool {
	if strings.Contains(h, ",") || strings.Contains(h, "___") {
		return false
	}
	return net.ParseIP(h) != nil || validHostname(h)
}

// pd reports whether the instance takes part in PD disaggregation.
func (c *Config) pd() bool { return c.Role != RoleUnified }

// readMode reports MoRI-IO READ mode.
func (c *Config) readMode() bool { return c.KVConnector == ConnMoRIIO && c.TransferMode == "READ" }

// portSpan is how many consecutive side-channel ports one instance binds
// per base: offsets dp_rank + tp_rank, i.e. 0..dp+tp-2 (PROTOCOL §2.2).
func (c *Config) portSpan() int { return c.DPSize + c.TPSize - 1 }

// rankForOffset maps a side-channel port offset to the DP engine that
// listens there. With TP > 1 offsets collide as in vLLM; the sim gives
// offset o to DP rank min(o, dp-1).
func (c *Config) rankForOffset(o int) int { return min(o, c.DPSize-1) }
