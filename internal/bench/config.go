package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"time"
)

// Dataset names.
const (
	DatasetRandom       = "random"
	DatasetSharedPrefix = "shared-prefix"
)

// Backend names (vllm bench serve --backend).
const (
	BackendOpenAI     = "openai"
	BackendVLLM       = "vllm"
	BackendOpenAIChat = "openai-chat"
)

// Metric names accepted by PercentileMetrics.
const (
	MetricTTFT           = "ttft"
	MetricTPOT           = "tpot"
	MetricITL            = "itl"
	MetricE2EL           = "e2el"
	MetricQueue          = "client_queue_time"
	MetricE2ELInclQueue  = "e2el_including_client_queue"
	defaultPercMetrics   = "ttft,tpot,itl"
	defaultMetricPercent = "99"
)

// Config describes one benchmark run. The zero value is not usable; start
// from DefaultConfig. Field names follow vllm bench serve's flags.
type Config struct {
	// BaseURL is the server root, e.g. "http://127.0.0.1:8000".
	BaseURL string
	// MoreBaseURLs are further roots of the same service (router
	// replicas): request i goes to the (i mod n)-th of BaseURL and these.
	MoreBaseURLs []string
	// Endpoint is appended to BaseURL ("/v1/completions" or
	// "/v1/chat/completions").
	Endpoint string
	// Backend is "openai" (default), "vllm" (same as openai) or
	// "openai-chat".
	Backend string
	// Model is sent as "model"; when empty it is discovered from
	// GET {BaseURL}/v1/models (data[0].id).
	Model string
	// ServedModelName, when set, is sent instead of Model.
	ServedModelName string

	// DatasetName is "random" or "shared-prefix".
	DatasetName string
	// InputLen and OutputLen are the random dataset's mean lengths (tokens).
	InputLen, OutputLen int
	// RangeRatio widens the length ranges; must be in [0, 1).
	RangeRatio float64
	// RandomPrefixLen tokens of one random prefix are prepended to every
	// random-dataset prompt.
	RandomPrefixLen int
	// Seed makes the dataset and the arrival times deterministic.
	Seed int64
	// SharedPrefixGroups groups of SharedPrefixPromptsPerGroup prompts each
	// share a SharedPrefixLen-token prefix (dataset "shared-prefix"). When
	// both counts are set NumPrompts becomes their product.
	SharedPrefixGroups          int
	SharedPrefixPromptsPerGroup int
	SharedPrefixLen             int
	// SharedPrefixTurns > 1 makes each group's prompts multi-turn
	// conversations of that many turns: turn t resends the group prefix and
	// the conversation's earlier questions and answers (dataset
	// "shared-prefix"; 0 or 1 = single questions).
	SharedPrefixTurns int

	// NumPrompts is the number of measured requests.
	NumPrompts int
	// MaxConcurrency caps in-flight requests (0: no cap).
	MaxConcurrency int
	// RequestRate in requests/s; +Inf (or 0) sends everything at t=0.
	RequestRate float64
	// Burstiness is the gamma shape of inter-arrival times (1: Poisson).
	Burstiness float64
	// NumWarmups copies of the first request are sent before the run.
	NumWarmups int
	// IgnoreEOS sends "ignore_eos": true. Forced on for the random dataset
	// (as current vllm bench serve does for OpenAI-compatible backends).
	IgnoreEOS bool
	// Logprobs is sent as "logprobs" (nil sends null).
	Logprobs *int
	// ExtraBody is a JSON object merged into every payload (keys override).
	ExtraBody json.RawMessage

	// Goodput SLOs in ms, keyed "ttft", "tpot", "e2el" (inclusive).
	Goodput map[string]float64
	// PercentileMetrics selects printed metrics (default ttft,tpot,itl).
	PercentileMetrics []string
	// MetricPercentiles selects printed percentiles (default 99).
	MetricPercentiles []float64

	// RequestIDPrefix prefixes the x-request-id header; the index follows.
	RequestIDPrefix string
	// Header is added to every request (after Authorization, before
	// x-request-id).
	Header http.Header
	// APIKey, when set, is sent as "Authorization: Bearer <key>". Main
	// fills it from $OPENAI_API_KEY.
	APIKey string

	// Timeout bounds each request (0: none).
	Timeout time.Duration
	// MaxDuration bounds the whole run including warm-ups (0: none). When it
	// expires in-flight requests are cancelled and unsent ones are marked
	// failed; Run still returns the result.
	MaxDuration time.Duration
	// MaxEventBytes bounds one SSE event (default 1 MiB).
	MaxEventBytes int

	// Label names the run in result files (default: Backend).
	Label string
	// Insecure skips TLS certificate verification.
	Insecure bool
	// DiscardText drops generated text (saves memory on long runs).
	DiscardText bool

	// Progress, when non-nil, receives a one-line progress bar.
	Progress io.Writer
	// Log, when non-nil, receives vllm-style informational lines.
	Log io.Writer
	// Transport overrides the HTTP transport (tests, in-process servers).
	// When nil Run builds one tuned for the run's concurrency.
	Transport http.RoundTripper
}

// DefaultConfig returns vllm bench serve's defaults.
func DefaultConfig() Config {
	return Config{
		BaseURL:            "http://127.0.0.1:8000",
		Endpoint:           "/v1/completions",
		Backend:            BackendOpenAI,
		DatasetName:        DatasetRandom,
		InputLen:           1024,
		OutputLen:          128,
		NumPrompts:         1000,
		RequestRate:        math.Inf(1),
		Burstiness:         1,
		SharedPrefixGroups: 10,
		SharedPrefixLen:    256,
		PercentileMetrics:  strings.Split(defaultPercMetrics, ","),
		MetricPercentiles:  []float64{99},
		MaxEventBytes:      DefaultMaxEventBytes,
	}
}

// chat reports whether requests use the chat completions payload.
func (c *Config) chat() bool { return c.Backend == BackendOpenAIChat }

// APIURL is BaseURL + Endpoint.
func (c *Config) APIURL() string { return strings.TrimSuffix(c.BaseURL, "/") + c.Endpoint }

// apiURLs are the API URLs requests alternate over: BaseURL's, then
// MoreBaseURLs'.
func (c *Config) apiURLs() []string {
	out := []string{c.APIURL()}
	for _, u := range c.MoreBaseURLs {
		out = append(out, strings.TrimSuffix(u, "/")+c.Endpoint)
	}
	return out
}

// normalize fills defaults and checks the configuration.
func (c *Config) normalize() error {
	if c.BaseURL == "" {
		return errors.New("base URL is required")
	}
	if !strings.HasPrefix(c.BaseURL, "http://") && !strings.HasPrefix(c.BaseURL, "https://") {
		return fmt.Errorf("base URL %q must start with http:// or https://", c.BaseURL)
	}
	c.BaseURL = strings.TrimSuffix(c.BaseURL, "/")
	for i, u := range c.MoreBaseURLs {
		if !strings.HasPrefix(u, "http://") && !strings.HasPrefix(u, "https://") {
			return fmt.Errorf("base URL %q must start with http:// or https://", u)
		}
		c.MoreBaseURLs[i] = strings.TrimSuffix(u, "/")
	}
	if c.Backend == "" {
		c.Backend = BackendOpenAI
	}
	switch c.Backend {
	case BackendOpenAI, BackendVLLM:
		if c.Endpoint == "" {
			c.Endpoint = "/v1/completions"
		}
		if strings.HasSuffix(c.Endpoint, "chat/completions") {
			// Only the chat payload makes sense on the chat endpoint.
			c.Backend = BackendOpenAIChat
		} else if !strings.HasSuffix(c.Endpoint, "completions") {
			return fmt.Errorf("endpoint %q: OpenAI Completions API URL must end with 'completions'", c.Endpoint)
		}
	case BackendOpenAIChat:
		if c.Endpoint == "" || c.Endpoint == "/v1/completions" {
			c.Endpoint = "/v1/chat/completions"
		}
		if !strings.HasSuffix(c.Endpoint, "chat/completions") {
			return fmt.Errorf("endpoint %q: OpenAI Chat Completions API URL must end with 'chat/completions'", c.Endpoint)
		}
	default:
		return fmt.Errorf("unknown backend %q (want openai, vllm or openai-chat)", c.Backend)
	}
	if !strings.HasPrefix(c.Endpoint, "/") {
		c.Endpoint = "/" + c.Endpoint
	}
	if c.DatasetName == "" {
		c.DatasetName = DatasetRandom
	}
	switch c.DatasetName {
	case DatasetRandom:
		c.IgnoreEOS = true
	case DatasetSharedPrefix:
		if c.SharedPrefixGroups <= 0 {
			return errors.New("shared-prefix groups must be > 0")
		}
		if c.SharedPrefixLen < 0 {
			return errors.New("shared-prefix length must be >= 0")
		}
		if c.SharedPrefixTurns < 0 {
			return errors.New("shared-prefix turns must be >= 0")
		}
		if c.SharedPrefixPromptsPerGroup > 0 {
			c.NumPrompts = c.SharedPrefixGroups * c.SharedPrefixPromptsPerGroup
		} else {
			if c.NumPrompts <= 0 {
				return errors.New("num prompts must be > 0")
			}
			c.SharedPrefixPromptsPerGroup = (c.NumPrompts + c.SharedPrefixGroups - 1) / c.SharedPrefixGroups
		}
	default:
		return fmt.Errorf("unknown dataset %q (want random or shared-prefix)", c.DatasetName)
	}
	if c.NumPrompts <= 0 {
		return errors.New("num prompts must be > 0")
	}
	if c.InputLen < 0 || c.OutputLen < 1 {
		return fmt.Errorf("input length must be >= 0 and output length >= 1 (got %d, %d)", c.InputLen, c.OutputLen)
	}
	if c.RandomPrefixLen < 0 {
		return errors.New("random prefix length must be >= 0")
	}
	if !(c.RangeRatio >= 0 && c.RangeRatio < 1) {
		return fmt.Errorf("random range ratio %v must be in [0, 1)", c.RangeRatio)
	}
	if c.MaxConcurrency < 0 {
		return errors.New("max concurrency must be greater than 0")
	}
	if c.RequestRate == 0 {
		c.RequestRate = math.Inf(1)
	}
	if !(c.RequestRate > 0) {
		return fmt.Errorf("request rate %v must be > 0", c.RequestRate)
	}
	if c.Burstiness == 0 {
		c.Burstiness = 1
	}
	if !(c.Burstiness > 0) {
		return fmt.Errorf("burstiness %v must be > 0", c.Burstiness)
	}
	if c.NumWarmups < 0 {
		return errors.New("num warmups must be >= 0")
	}
	for k, v := range c.Goodput {
		switch k {
		case MetricTTFT, MetricTPOT, MetricE2EL:
		default:
			return fmt.Errorf("invalid goodput metric %q: the service level objective name should be one of ttft, tpot, e2el", k)
		}
		if v < 0 || math.IsNaN(v) {
			return fmt.Errorf("invalid goodput value %s:%v: must be non-negative", k, v)
		}
	}
	if len(c.PercentileMetrics) == 0 {
		c.PercentileMetrics = strings.Split(defaultPercMetrics, ",")
	}
	for _, m := range c.PercentileMetrics {
		switch m {
		case MetricTTFT, MetricTPOT, MetricITL, MetricE2EL, MetricQueue, MetricE2ELInclQueue:
		default:
			return fmt.Errorf("unknown percentile metric %q", m)
		}
	}
	if len(c.MetricPercentiles) == 0 {
		c.MetricPercentiles = []float64{99}
	}
	for _, p := range c.MetricPercentiles {
		if !(p >= 0 && p <= 100) {
			return fmt.Errorf("metric percentile %v must be in [0, 100]", p)
		}
	}
	if len(c.ExtraBody) > 0 {
		if _, err := parseExtraBody(c.ExtraBody); err != nil {
			return err
		}
	}
	if c.MaxEventBytes <= 0 {
		c.MaxEventBytes = DefaultMaxEventBytes
	}
	if c.Timeout < 0 || c.MaxDuration < 0 {
		return errors.New("timeouts must be >= 0")
	}
	if c.Label == "" {
		c.Label = c.Backend
	}
	return nil
}
