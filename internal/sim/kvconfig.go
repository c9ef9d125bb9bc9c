package sim

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"strings"
)

// CacheConfig is the KV-event and usage part of Config; prefix caching
// itself is Config.Engine.PrefixCaching (vLLM's --enable-prefix-caching,
// default on).
type CacheConfig struct {
	// PromptTokensDetails is vLLM's --enable-prompt-tokens-details:
	// usage.prompt_tokens_details.cached_tokens.
	PromptTokensDetails bool
	// Events is --kv-events-config; nil = no events.
	Events *KVEventsConfig
	// Encoding of each event: "named" (current vLLM: maps with "type") or
	// "positional" (older vLLM: tagged arrays).
	Encoding string
	// IntBlockHashes mirrors VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (default
	// 1): block hashes as 64-bit ints rather than sha256 bytes.
	IntBlockHashes bool
}

// Event encodings.
const (
	EncodingNamed      = "named"
	EncodingPositional = "positional"
)

// KVEventsConfig is vLLM's KVEventsConfig (vllm/config/kv_events.py).
type KVEventsConfig struct {
	EnableKVCacheEvents bool    `json:"enable_kv_cache_events"`
	Publisher           string  `json:"publisher"`
	Endpoint            string  `json:"endpoint"`
	ReplayEndpoint      *string `json:"replay_endpoint"`
	BufferSteps         int     `json:"buffer_steps"`
	HWM                 int     `json:"hwm"`
	MaxQueueSize        int     `json:"max_queue_size"`
	Topic               string  `json:"topic"`
}

// ParseKVEventsConfig decodes a --kv-events-config JSON object with vLLM's
// defaults; unknown keys are an error. It returns nil when events are off
// (enable_kv_cache_events false or publisher "null").
func ParseKVEventsConfig(s string) (*KVEventsConfig, error) {
	c := KVEventsConfig{Endpoint: "tcp://*:5557", BufferSteps: 10_000, HWM: 100_000, MaxQueueSize: 100_000}
	dec := json.NewDecoder(bytes.NewReader([]byte(s)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("not a KVEventsConfig JSON object: %w", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("trailing data after the JSON object")
	}
	if c.Publisher == "" {
		c.Publisher = "null"
		if c.EnableKVCacheEvents {
			c.Publisher = "zmq"
		}
	}
	switch c.Publisher {
	case "null":
		return nil, nil
	case "zmq":
	default:
		return nil, fmt.Errorf("unknown event publisher %q (want zmq or null)", c.Publisher)
	}
	if !c.EnableKVCacheEvents {
		return nil, nil
	}
	if err := checkEndpoint("endpoint", c.Endpoint); err != nil {
		return nil, err
	}
	if c.ReplayEndpoint != nil {
		if err := checkEndpoint("replay_endpoint", *c.ReplayEndpoint); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"buffer_steps", c.BufferSteps}, {"hwm", c.HWM}, {"max_queue_size", c.MaxQueueSize}} {
		if f.v < 1 {
			return nil, fmt.Errorf("%s must be >= 1, got %d", f.name, f.v)
		}
	}
	return &c, nil
}

// checkEndpoint accepts tcp://host:port (host "*" = the --host address).
func checkEndpoint(name, ep string) error {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return fmt.Errorf("%s %q: only tcp:// endpoints are supported", name, ep)
	}
	i := strings.LastIndexByte(rest, ':')
	if i < 1 {
		return fmt.Errorf("%s %q is not tcp://host:port", name, ep)
	}
	if p, err := strconv.Atoi(rest[i+1:]); err != nil || p < 0 || p > 65535 {
		return fmt.Errorf("%s %q: bad port", name, ep)
	}
	return nil
}

// OffsetEndpointPort is vLLM's ZmqEventPublisher.offset_endpoint_port: the
// port of a tcp endpoint plus the DP rank (a port of 0 stays 0).
func OffsetEndpointPort(ep string, rank int) string {
	if ep == "" || rank == 0 {
		return ep
	}
	i := strings.LastIndexByte(ep, ':')
	port, err := strconv.Atoi(ep[i+1:])
	if i < 0 || err != nil || port == 0 {
		return ep
	}
	return ep[:i+1] + strconv.Itoa(port+rank)
}

// cacheFlags holds the raw flag values until they are checked.
type cacheFlags struct {
	enable, disable, details, intHashes bool
	events, encoding                    string
}

func (f *cacheFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.enable, "enable-prefix-caching", true, "keep full KV blocks of finished requests and reuse a cached prompt prefix (vLLM's default)")
	fs.BoolVar(&f.disable, "no-enable-prefix-caching", false, "turn prefix caching off")
	fs.BoolVar(&f.details, "enable-prompt-tokens-details", false, "report usage.prompt_tokens_details.cached_tokens (vLLM's flag)")
	fs.StringVar(&f.events, "kv-events-config", "", "vLLM's KVEventsConfig as JSON: publish KV cache events over ZMQ, e.g. '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":\"tcp://*:5558\"}'")
	fs.StringVar(&f.encoding, "kv-events-encoding", EncodingNamed, "KV event encoding: named (current vLLM, maps with \"type\") or positional (older vLLM, tagged arrays)")
	fs.BoolVar(&f.intHashes, "kv-events-int-block-hashes", true, "block hashes in events as 64-bit ints, like VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (vLLM's default); false sends sha256 bytes")
}

// apply fills c.Cache; a bad value is reported by Validate.
func (f *cacheFlags) apply(c *Config) error {
	c.Engine.PrefixCaching = f.enable && !f.disable
	c.Cache = CacheConfig{
		PromptTokensDetails: f.details,
		Encoding:            f.encoding,
		IntBlockHashes:      f.intHashes,
	}
	if f.events == "" {
		return nil
	}
	ev, err := ParseKVEventsConfig(f.events)
	if err != nil {
		return fmt.Errorf("invalid value for flag --kv-events-config: %w", err)
	}
	c.Cache.Events = ev
	return nil
}

// validateCache checks the cache settings of c.
func (c *Config) validateCache() []error {
	var errs []error
	switch c.Cache.Encoding {
	case EncodingNamed, EncodingPositional:
	default:
		errs = append(errs, fmt.Errorf("invalid value for flag --kv-events-encoding: %q (want named or positional)", c.Cache.Encoding))
	}
	return errs
}
