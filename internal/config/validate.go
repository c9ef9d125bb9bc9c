package config

import (
	"errors"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
)

// Validate checks the configuration with the Rust router's rules in its
// order (REFERENCE §1.3 mode derivation, then §1.4 rules 1-8), then the
// Switchyard rules. It reports every problem, as errors.Join of *Error.
func (c *Config) Validate() error {
	var errs []error
	add := func(e *Error) { errs = append(errs, e) }
	mode := c.Mode()

	if mode == ModeIGW {
		c.validateIGW(add)
	}
	c.validateModels(add)

	// §1.3: checks the Rust binary makes while building RouterConfig.
	pdSourceMissing := false
	switch mode {
	case ModeVLLMPD:
		static := len(c.Prefill) > 0 || len(c.Decode) > 0
		zmq := c.VLLMDiscoveryAddress != ""
		k8s := c.ServiceDiscovery && (len(c.PrefillSelector) > 0 || len(c.DecodeSelector) > 0)
		if !static && !zmq && !k8s {
			pdSourceMissing = true
			add(failed("vLLM PD disaggregation mode requires one of: --vllm-discovery-address, --prefill/--decode URLs, or --service-discovery with --prefill-selector/--decode-selector"))
		}
	case ModeRegular:
		if !c.ServiceDiscovery && len(c.WorkerURLs) == 0 {
			add(failed("Regular mode requires --worker-urls when not using service discovery"))
		}
	}

	// Rule 1: mode.
	switch mode {
	case ModeRegular:
		c.checkURLs(add, "--worker-urls", c.WorkerURLs)
	case ModeVLLMPD:
		// Deliberate difference: with --vllm-discovery-address, static
		// --prefill/--decode workers are kept and used alongside the
		// ZMQ-registered ones (Rust drops them, REFERENCE §4.1/§10.1.12), so
		// they are validated here like any other worker URL.
		if !c.HasServiceDiscovery() && !pdSourceMissing {
			if len(c.Prefill) == 0 {
				add(failed("vLLM PD mode requires at least one prefill worker URL"))
			}
			if len(c.Decode) == 0 {
				add(failed("vLLM PD mode requires at least one decode worker URL"))
			}
		}
		prefillURLs := make([]string, len(c.Prefill))
		for i, p := range c.Prefill {
			prefillURLs[i] = p.URL
		}
		c.checkURLs(add, "--prefill", prefillURLs)
		c.checkURLs(add, "--decode", c.Decode)
		for _, p := range c.Prefill {
			if p.BootstrapPort != nil && (*p.BootstrapPort < 1 || *p.BootstrapPort > 65535) {
				add(invalid("--prefill", p.URL+" "+strconv.Itoa(*p.BootstrapPort), "Port must be between 1 and 65535"))
			}
		}
	case ModeOpenAI:
		if len(c.WorkerURLs) != 1 {
			add(failed("OpenAI mode requires exactly one --worker-urls entry"))
		} else if reason := openAIURLError(c.WorkerURLs[0]); reason != "" {
			add(failed("Invalid OpenAI worker URL '" + c.WorkerURLs[0] + "': " + reason))
		}
	}

	// Rule 2: policies. Rust validates cache_aware parameters only when a
	// policy in use is cache_aware (the main one, or a P/D side's).
	checkEnum(add, "--policy", c.Policy, policyNames, false)
	checkEnum(add, "--prefill-policy", c.PrefillPolicy, policyNames, true)
	checkEnum(add, "--decode-policy", c.DecodePolicy, policyNames, true)
	cacheAware := c.Policy == PolicyCacheAware ||
		(mode == ModeVLLMPD && (c.PrefillPolicy == PolicyCacheAware || c.DecodePolicy == PolicyCacheAware))
	if cacheAware {
		if !(c.CacheThreshold >= 0 && c.CacheThreshold <= 1) {
			add(invalid("--cache-threshold", formatFloat(c.CacheThreshold), "Must be between 0.0 and 1.0"))
		}
		if !(c.BalanceRelThreshold >= 1) {
			add(invalid("--balance-rel-threshold", formatFloat(c.BalanceRelThreshold), "Must be >= 1.0"))
		}
		if c.EvictionIntervalSecs == 0 {
			add(invalid("--eviction-interval", "0", "Must be > 0"))
		}
		if c.MaxTreeSize <= 0 {
			add(invalid("--max-tree-size", strconv.Itoa(c.MaxTreeSize), "Must be > 0"))
		}
	}

	c.validateKV(add)

	// Rule 3: server.
	if c.Port == 0 {
		add(invalid("--port", "0", "Port must be > 0"))
	}
	if c.MaxPayloadSize <= 0 {
		add(invalid("--max-payload-size", strconv.Itoa(c.MaxPayloadSize), "Must be > 0"))
	}
	for _, f := range []struct {
		flag string
		v    uint64
	}{
		{"--request-timeout-secs", c.RequestTimeoutSecs},
		{"--worker-startup-timeout-secs", c.WorkerStartupTimeoutSecs},
		{"--worker-startup-check-interval", c.WorkerStartupCheckIntervalSecs},
	} {
		if f.v == 0 {
			add(invalid(f.flag, "0", "Must be > 0"))
		}
	}

	// Rule 4: Kubernetes discovery.
	if c.ServiceDiscovery && mode != ModeIGW {
		if c.ServiceDiscoveryPort == 0 {
			add(invalid("--service-discovery-port", "0", "Port must be > 0"))
		}
		switch mode {
		case ModeRegular:
			if len(c.SelectorMap()) == 0 {
				add(failed("Regular mode with service discovery requires a non-empty selector"))
			}
		case ModeVLLMPD:
			if len(c.PrefillSelectorMap()) == 0 && len(c.DecodeSelectorMap()) == 0 {
				add(failed("vLLM PD mode with service discovery requires at least one non-empty selector (prefill or decode)"))
			}
		case ModeOpenAI:
			add(failed("OpenAI mode does not support service discovery"))
		}
	}

	// Rule 5: metrics. Rust turns a non-IP host into 0.0.0.0; we refuse it.
	if c.PrometheusPort == 0 {
		add(invalid("--prometheus-port", "0", "Port must be > 0"))
	}
	if c.PrometheusHost == "" {
		add(invalid("--prometheus-host", `""`, "Host cannot be empty"))
	} else if net.ParseIP(c.PrometheusHost) == nil {
		add(invalid("--prometheus-host", c.PrometheusHost, "Must be an IP address"))
	}

	// Rule 6: compatibility (skipped under IGW, as in Rust).
	if mode != ModeIGW {
		if !c.HasServiceDiscovery() {
			if c.Policy == PolicyPowerOfTwo && c.workerCount() < 2 {
				add(incompatible("Power-of-two policy requires at least 2 workers"))
			}
			if mode == ModeVLLMPD {
				if c.PrefillPolicy == PolicyPowerOfTwo && len(c.Prefill) < 2 {
					add(incompatible("Power-of-two policy for prefill requires at least 2 prefill workers"))
				}
				if c.DecodePolicy == PolicyPowerOfTwo && len(c.Decode) < 2 {
					add(incompatible("Power-of-two policy for decode requires at least 2 decode workers"))
				}
			}
		}
		if c.KVConnector == KVConnectorMoRIIO && !c.hasVLLMDiscovery() {
			add(incompatible("MoRI-IO KV connector requires service discovery to be enabled (ZMQ addresses are obtained via instance registration). Please run with `--vllm-discovery-address ${address}`"))
		}
	}

	// Rule 7: effective retry.
	r := c.EffectiveRetry()
	if r.MaxAttempts < 1 {
		add(invalid("--retry-max-retries", strconv.Itoa(r.MaxAttempts), "Must be >= 1 (set to 1 to effectively disable retries)"))
	}
	if c.RetryInitialBackoffMS == 0 {
		add(invalid("--retry-initial-backoff-ms", "0", "Must be > 0"))
	}
	if c.RetryMaxBackoffMS < c.RetryInitialBackoffMS {
		add(invalid("--retry-max-backoff-ms", strconv.FormatUint(c.RetryMaxBackoffMS, 10), "Must be >= initial_backoff_ms"))
	}
	if !(c.RetryBackoffMultiplier >= 1) {
		add(invalid("--retry-backoff-multiplier", formatFloat(c.RetryBackoffMultiplier), "Must be >= 1.0"))
	}
	if !(c.RetryJitterFactor >= 0 && c.RetryJitterFactor <= 1) {
		add(invalid("--retry-jitter-factor", formatFloat(c.RetryJitterFactor), "Must be between 0.0 and 1.0"))
	}

	// Rule 8: effective circuit breaker.
	cb := c.EffectiveCircuitBreaker()
	if cb.FailureThreshold < 1 {
		add(invalid("--cb-failure-threshold", "0", "Must be >= 1 (set to u32::MAX to effectively disable CB)"))
	}
	if cb.SuccessThreshold < 1 {
		add(invalid("--cb-success-threshold", "0", "Must be >= 1"))
	}
	if c.CBTimeoutDurationSecs == 0 {
		add(invalid("--cb-timeout-duration-secs", "0", "Must be > 0"))
	}
	if c.CBWindowDurationSecs == 0 {
		add(invalid("--cb-window-duration-secs", "0", "Must be > 0"))
	}

	// Switchyard rules.
	c.validateExtras(add)
	return errors.Join(errs...)
}

func (c *Config) validateExtras(add func(*Error)) {
	checkEnum(add, "--backend", c.Backend, backendNames, false)
	checkEnum(add, "--log-level", c.LogLevel, logLevelNames, false)
	checkEnum(add, "--history-backend", c.HistoryBackend, historyBackendNames, false)
	checkEnum(add, "--kv-connector", c.KVConnector, kvConnectorNames, false)
	checkEnum(add, "--log-format", c.LogFormat, logFormatNames, false)
	checkEnum(add, "--decode-output-length", c.DecodeOutputLength, decodeOutputNames, false)
	checkEnum(add, "--http-server", c.HTTPServer, httpServerNames, false)

	if !(c.OtelSamplingRatio >= 0 && c.OtelSamplingRatio <= 1) {
		add(invalid("--otel-sampling-ratio", formatFloat(c.OtelSamplingRatio), "Must be between 0.0 and 1.0"))
	}
	if c.VLLMDiscoveryAddress != "" && !isHostPort(c.VLLMDiscoveryAddress) {
		add(invalid("--vllm-discovery-address", c.VLLMDiscoveryAddress, "Must be host:port"))
	}
	c.checkURLs(add, "--api-key-validation-urls", c.APIKeyValidationURLs)
	for _, s := range []struct {
		flag  string
		items []string
	}{
		{"--selector", c.Selector},
		{"--prefill-selector", c.PrefillSelector},
		{"--decode-selector", c.DecodeSelector},
	} {
		// Rust drops items without '=' silently; we refuse them.
		for _, it := range s.items {
			if k, _, ok := strings.Cut(it, "="); !ok || k == "" {
				add(invalid(s.flag, quoteIfEmpty(it), "Must be key=value"))
			}
		}
	}

	// usize fields can only be negative when they come from a config file.
	for _, f := range []struct {
		flag string
		v    int
	}{
		{"--balance-abs-threshold", c.BalanceAbsThreshold},
		{"--intra-node-data-parallel-size", c.IntraNodeDataParallelSize},
		{"--prefill-data-parallel-size", c.PrefillDataParallelSize},
		{"--decode-data-parallel-size", c.DecodeDataParallelSize},
		{"--max-concurrent-requests", c.MaxConcurrentRequests},
		{"--queue-size", c.QueueSize},
		{"--pd-max-failovers", c.PDMaxFailovers},
		{"--max-migrations", c.MaxMigrations},
		{"--gc-heap-floor-mb", c.GCHeapFloorMB},
		{"--flow-worker-max-inflight", c.FlowWorkerMaxInFlight},
		{"--flow-headroom", c.FlowHeadroom},
		{"--flow-prefill-reserve", c.FlowPrefillReserve},
	} {
		if f.v < 0 {
			add(invalid(f.flag, strconv.Itoa(f.v), "Must be >= 0"))
		}
	}
	if c.MaxHeaderBytes <= 0 {
		add(invalid("--max-header-bytes", strconv.Itoa(c.MaxHeaderBytes), "Must be > 0"))
	}

	for _, f := range []struct {
		flag string
		v    float64
	}{
		{"--rate-limit-tokens-per-second", c.RateLimitTokensPerSecond},
		{"--shutdown-timeout-secs", c.ShutdownTimeoutSecs},
		{"--prefill-timeout-secs", c.PrefillTimeoutSecs},
		{"--kv-wait-timeout-secs", c.KVWaitTimeoutSecs},
		{"--stream-idle-timeout-secs", c.StreamIdleTimeoutSecs},
		{"--body-read-timeout-secs", c.BodyReadTimeoutSecs},
		{"--connect-timeout-secs", c.ConnectTimeoutSecs},
		{"--load-poll-interval-secs", c.LoadPollIntervalSecs},
		{"--flow-max-waiting", c.FlowMaxWaiting},
	} {
		if !(f.v >= 0) || math.IsInf(f.v, 1) {
			add(invalid(f.flag, formatFloat(f.v), "Must be a finite number >= 0"))
		}
	}
	for _, f := range []struct {
		flag string
		v    float64
	}{
		{"--health-unhealthy-interval-secs", c.HealthUnhealthyIntervalSecs},
		{"--health-unhealthy-max-interval-secs", c.HealthUnhealthyMaxIntervalSecs},
	} {
		if !(f.v > 0) || math.IsInf(f.v, 1) {
			add(invalid(f.flag, formatFloat(f.v), "Must be a finite number > 0"))
		}
	}
	if c.HistoryMaxEntries < 1 {
		add(invalid("--history-max-entries", strconv.Itoa(c.HistoryMaxEntries), "Must be >= 1"))
	}
	if !(c.HistoryTTLSecs > 0) || math.IsInf(c.HistoryTTLSecs, 1) {
		add(invalid("--history-ttl-secs", formatFloat(c.HistoryTTLSecs), "Must be a finite number > 0"))
	}
	if !(c.DiscoveryTTLSecs > 0) || math.IsInf(c.DiscoveryTTLSecs, 1) {
		add(invalid("--discovery-ttl-secs", formatFloat(c.DiscoveryTTLSecs), "Must be a finite number > 0"))
	}
	if !(c.RetryBudgetRatio >= 0 && c.RetryBudgetRatio <= 1) {
		add(invalid("--retry-budget-ratio", formatFloat(c.RetryBudgetRatio), "Must be between 0.0 and 1.0"))
	}
	if !(c.CBFailureRate >= 0 && c.CBFailureRate <= 1) {
		add(invalid("--cb-failure-rate", formatFloat(c.CBFailureRate), "Must be between 0.0 and 1.0"))
	}
	if !(c.FlowMaxKVUsage >= 0 && c.FlowMaxKVUsage <= 1) {
		add(invalid("--flow-max-kv-usage", formatFloat(c.FlowMaxKVUsage), "Must be between 0.0 and 1.0"))
	}
	if !(c.FlowPollIntervalSecs > 0) || math.IsInf(c.FlowPollIntervalSecs, 1) {
		add(invalid("--flow-poll-interval-secs", formatFloat(c.FlowPollIntervalSecs), "Must be a finite number > 0"))
	}
	if c.FlowControl {
		c.validateFlow(add)
	} else {
		if c.FlowEnginePriority {
			add(invalid("--flow-engine-priority", "true", "Needs --flow-control (the priority is the request's flow-control band)"))
		}
		if c.FlowAvoidPrefill {
			add(invalid("--flow-avoid-prefill", "true", "Needs --flow-control (the rule is about the flow-control bands)"))
		}
		if c.FlowIsolatePrefill {
			add(invalid("--flow-isolate-prefill", "true", "Needs --flow-control (the rule is about the flow-control bands)"))
		}
		if c.FlowPrefillReserve > 0 {
			add(invalid("--flow-prefill-reserve", strconv.Itoa(c.FlowPrefillReserve), "Needs --flow-control (the rule is about the flow-control bands)"))
		}
	}
	if c.CBMinRequests < 1 {
		add(invalid("--cb-min-requests", "0", "Must be >= 1"))
	}
	if c.CBHalfOpenMaxRequests < 1 {
		add(invalid("--cb-half-open-max-requests", "0", "Must be >= 1"))
	}
}

// workerCount is Rust's RoutingMode::worker_count.
func (c *Config) workerCount() int {
	if c.Mode() == ModeVLLMPD {
		return len(c.Prefill) + len(c.Decode)
	}
	return len(c.WorkerURLs)
}

func checkEnum(add func(*Error), flagName, v string, allowed []string, optional bool) {
	if optional && v == "" {
		return
	}
	if !contains(allowed, v) {
		add(invalid(flagName, quoteIfEmpty(v), oneOf(allowed)))
	}
}

// checkURLs is the Rust validate_urls (REFERENCE §1.4), naming the flag the
// URL came from instead of "worker_url".
func (c *Config) checkURLs(add func(*Error), flagName string, urls []string) {
	for _, u := range urls {
		if reason := urlError(u); reason != "" {
			add(invalid(flagName, quoteIfEmpty(u), reason))
		}
	}
}

func urlError(u string) string {
	if u == "" {
		return "URL cannot be empty"
	}
	if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") {
		return "URL must start with http:// or https://"
	}
	p, err := url.Parse(u)
	if err != nil {
		return "Invalid URL format: " + urlErrText(err)
	}
	if p.Hostname() == "" {
		return "URL must have a valid host"
	}
	return ""
}

// openAIURLError approximates Rust url::Url::parse failures.
func openAIURLError(u string) string {
	p, err := url.Parse(u)
	switch {
	case err != nil:
		return urlErrText(err)
	case p.Scheme == "":
		return "relative URL without a base"
	case (p.Scheme == "http" || p.Scheme == "https") && p.Hostname() == "":
		return "empty host"
	}
	return ""
}

func urlErrText(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err.Error()
	}
	return err.Error()
}

// isHostPort accepts host:port with a non-empty host (a name, an IP, "*"
// for ZMQ's all-interfaces, or a bracketed IPv6) and a numeric port; port 0
// is allowed for tests that bind an ephemeral port.
func isHostPort(s string) bool {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" || strings.ContainsAny(host, " /") {
		return false
	}
	_, err = strconv.ParseUint(port, 10, 16)
	return err == nil
}

// validateFlow checks the flow-control lists: bands NAME=PRIORITY[:SECS[:ORDER]]
// with unique names, the default band among them, weights FLOW=WEIGHT > 0.
func (c *Config) validateFlow(add func(*Error)) {
	if m := c.Mode(); m != ModeRegular {
		for _, f := range []struct {
			flag, v string
			on      bool
		}{
			{"--flow-avoid-prefill", "true", c.FlowAvoidPrefill},
			{"--flow-isolate-prefill", "true", c.FlowIsolatePrefill},
			{"--flow-prefill-reserve", strconv.Itoa(c.FlowPrefillReserve), c.FlowPrefillReserve > 0},
		} {
			if f.on {
				add(invalid(f.flag, f.v, "Regular mode only (the router picks a worker per request there), not "+string(m)+" mode"))
			}
		}
	}
	names := map[string]bool{}
	for _, it := range c.FlowBands {
		name, spec, ok := strings.Cut(it, "=")
		prio, secs, hasSecs := strings.Cut(spec, ":")
		_, perr := strconv.Atoi(prio)
		switch {
		case !ok || name == "" || perr != nil:
			add(invalid("--flow-bands", it, "Must be NAME=PRIORITY[:QUEUE_TIMEOUT_SECS[:ORDER]] with an integer priority"))
			continue
		case names[name]:
			add(invalid("--flow-bands", it, "Band names must be unique"))
		}
		secs, order, _ := strings.Cut(secs, ":")
		if hasSecs && secs != "" {
			if v, err := strconv.ParseFloat(secs, 64); err != nil || !(v >= 0) || math.IsInf(v, 1) {
				add(invalid("--flow-bands", it, "The queue timeout must be a finite number of seconds >= 0"))
			}
		}
		if order != "" && order != FlowOrderArrival && order != FlowOrderDeadline {
			add(invalid("--flow-bands", it, "The order must be arrival or deadline"))
		}
		names[name] = true
	}
	if len(c.FlowBands) == 0 {
		add(invalid("--flow-bands", "", "At least one band is needed"))
	}
	if !names[c.FlowDefaultBand] {
		add(invalid("--flow-default-band", quoteIfEmpty(c.FlowDefaultBand), "Must be one of the --flow-bands names"))
	}
	for _, it := range c.FlowWeights {
		k, v, ok := strings.Cut(it, "=")
		w, err := strconv.ParseFloat(v, 64)
		if !ok || k == "" || err != nil || !(w > 0) || math.IsInf(w, 1) {
			add(invalid("--flow-weights", it, "Must be FLOW=WEIGHT with a finite weight > 0"))
		}
	}
	for _, h := range []struct{ flag, v string }{
		{"--flow-objective-header", c.FlowObjectiveHeader},
		{"--flow-fairness-header", c.FlowFairnessHeader},
		{"--flow-deadline-header", c.FlowDeadlineHeader},
	} {
		if strings.TrimSpace(h.v) == "" {
			add(invalid(h.flag, `""`, "Must be a header name"))
		}
	}
}

// validateIGW checks the flags of --enable-igw: model fleets come from
// --worker-urls (regular), --prefill/--decode and --vllm-discovery-address
// (PD, the connector is --kv-connector), --service-discovery (every
// selector) and POST /workers. Panic routing and the PD warm-up would
// cross models, so asking for them explicitly is refused.
func (c *Config) validateIGW(add func(*Error)) {
	if c.Backend == BackendOpenAI {
		add(&Error{Kind: KindNotSupported, Field: "--backend openai", Reason: "with --enable-igw: an OpenAI-compatible upstream serves one model there; " +
			"name it in the config file (models: {MODEL: {upstream: URL, api_key_env: VAR}}) beside the vLLM models"})
	}
	if c.ServiceDiscovery {
		if c.ServiceDiscoveryPort == 0 {
			add(invalid("--service-discovery-port", "0", "Port must be > 0"))
		}
		if len(c.SelectorMap()) == 0 && len(c.PrefillSelectorMap()) == 0 && len(c.DecodeSelectorMap()) == 0 {
			add(failed("--enable-igw with service discovery requires a non-empty --selector, --prefill-selector or --decode-selector"))
		}
	}
	for _, u := range []struct{ flag, why string }{
		{"panic-routing", "panic routing picks among every registered worker, whatever its model"},
		{"pd-warmup", "the warm-up pairs prefill and decode workers across models"},
	} {
		if c.IsSet(u.flag) && ((u.flag == "panic-routing" && c.PanicRouting) || (u.flag == "pd-warmup" && c.PDWarmup)) {
			add(&Error{Kind: KindNotSupported, Field: "--" + u.flag, Reason: "with --enable-igw: " + u.why + " (it is off there; drop the flag)"})
		}
	}
	if c.KVConnector == KVConnectorMoRIIO && c.VLLMDiscoveryAddress == "" {
		add(incompatible("with --enable-igw, --kv-connector moriio needs --vllm-discovery-address: MoRI-IO workers register over ZMQ discovery"))
	}
	c.checkURLs(add, "--worker-urls", c.WorkerURLs)
	prefillURLs := make([]string, len(c.Prefill))
	for i, p := range c.Prefill {
		prefillURLs[i] = p.URL
		if p.BootstrapPort != nil && (*p.BootstrapPort < 1 || *p.BootstrapPort > 65535) {
			add(invalid("--prefill", p.URL+" "+strconv.Itoa(*p.BootstrapPort), "Port must be between 1 and 65535"))
		}
	}
	c.checkURLs(add, "--prefill", prefillURLs)
	c.checkURLs(add, "--decode", c.Decode)
}
