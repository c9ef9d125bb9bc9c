// Package config is Switchyard's single configuration struct and its
// lifecycle. The command line is the Rust vllm-router's (REFERENCE §1), so
// an existing vllm-router command line starts Switchyard unchanged.
//
// Lifecycle (STYLE §3.2 item 11, with the file before the flags):
//
//  1. main calls LoadDotEnv(".env") (dotenvy semantics: existing variables
//     win, a missing file is fine).
//  2. Parse / ParseWith: Default(), then the --config FILE (YAML or JSON,
//     strict: an unknown key is an error naming it), then the flags (so
//     flags override the file), then the API_KEY_VALIDATION_URLS fallback
//     when no validation URL was given. --help / --version print and return
//     ErrHelp / ErrVersion (exit 0). Syntax problems are one *Error of
//     KindUsage, KindInvalidValue or KindConfigFile.
//  3. Validate: every rule of REFERENCE §1.3/§1.4 in the Rust order with the
//     Rust reason texts, then the Switchyard rules; all problems at once as
//     errors.Join of *Error, each naming the flag
//     ("invalid value for --cache-threshold: 1.5 - Must be between 0.0 and 1.0").
//  4. The app uses IsSet/Explicit to refuse flags whose feature is not built
//     yet, Warnings for non-fatal notes, and the Effective* helpers; the
//     Config is read-only from then on.
//
// Command-line syntax: `--x v` and `--x=v`; booleans take no separate value
// (`--forward-client-authorization=false` to turn a true default off);
// multi-value flags (--worker-urls, --decode, --api-key-validation-urls,
// --otel-excluded-paths, --selector, --prefill-selector, --decode-selector,
// --request-id-headers, --cors-allowed-origins, --router-api-keys) consume
// tokens until the next token that looks like a flag ("-" followed by
// anything, as clap does), and repeated occurrences append. `--prefill URL
// [PORT|none]` is hand-parsed before everything else exactly as the Rust
// split_prefill_args_from_others.
//
// Data-parallel sizes of static workers: each --prefill URL becomes
// PrefillDPSize() workers (one per DP rank) and each --decode URL
// DecodeDPSize(): --prefill-data-parallel-size / --decode-data-parallel-size
// when set (> 0), else --intra-node-data-parallel-size (default 1). So a
// prefill with dp=2 and a decode with dp=1 are
// `--prefill-data-parallel-size 2` (or `--intra-node-data-parallel-size 2
// --decode-data-parallel-size 1`); with --intra-node-data-parallel-size 2
// alone the decode would get X-data-parallel-rank: 1, which a dp=1 vLLM
// rejects (400). A URL@rank pins one rank whatever the sizes.
//
// PD deadlines are bounded by default: --kv-wait-timeout-secs 300 (a
// streaming decode's first byte, i.e. its KV) and --stream-idle-timeout-secs
// 300 (silence between two stream chunks, also on the regular proxy); 0
// turns either off. Non-streaming PD decodes are bounded only by
// --request-timeout-secs (docs/CONNECTORS.md explains why).
// --pd-warmup (default true; =false turns it off) sends one 1-token PD
// request through every new prefill/decode instance pair so that the
// engines' first-contact KV handshake is not paid by real traffic.
// --health-unhealthy-interval-secs (0.5) and
// --health-unhealthy-max-interval-secs (1) are the re-probe schedule of
// workers that are unhealthy, never probed, or whose last probe failed
// (healthy ones keep --health-check-interval-secs); --panic-routing
// (default true) routes to the registered workers of a role when none is
// available (docs/RELIABILITY.md, "Fast recovery").
// --pd-split-responses PD-splits /v1/responses; by default it is served
// unsplit by one prefill worker, because most vLLM versions drop
// kv_transfer_params on that route.
//
// Deliberate differences from the Rust router:
//   - Static --prefill/--decode together with --vllm-discovery-address are
//     allowed and both are used (Rust silently drops the static ones).
//   - --prefill=URL is accepted (Rust: "unexpected argument").
//   - --decode takes several values like the other list flags (Rust: one
//     per occurrence); a repeated scalar flag keeps the last value (clap
//     errors).
//   - --enable-igw runs the multi-model router with regular and PD fleets
//     (--worker-urls, --prefill/--decode, --vllm-discovery-address, POST
//     /workers); with --service-discovery, --backend openai, or an explicit
//     --panic-routing/--pd-warmup it is refused by Validate ("not supported:
//     --service-discovery (with --enable-igw: ...)").
//   - --prometheus-host must be an IP address (Rust binds 0.0.0.0 for any
//     other string); selector items without '=' are errors (Rust drops them).
//   - --otel-sampling-ratio outside [0,1] is a validation error (Rust only
//     fails OTel init and continues without tracing).
//   - --kv-connector also accepts p2pnccl; the Switchyard flags are extras
//     (--intra-node-data-parallel-size keeps its Rust meaning, both roles,
//     unless a role-specific size overrides it).
//   - Validate reports every problem, not only the first, and names flags
//     rather than Rust struct fields.
//   - A config file exists at all (Rust has none, REFERENCE §1.7). Its
//     "models" mapping (ModelConfig: per-model policies and
//     max_concurrent_requests, --enable-igw only) has no flag.
package config
