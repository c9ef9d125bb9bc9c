package config

import (
	"net/url"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// ModelConfig is one model's section of the config file's "models"
// mapping (--enable-igw only; there is no flag for it):
//
//	models:
//	  Qwen/Qwen3-8B: {policy: cache_aware, max_concurrent_requests: 64}
//	  meta-llama/Llama-3.1-70B: {prefill_policy: random, decode_policy: power_of_two}
//	  gpt-4o-mini: {upstream: https://api.openai.com/v1, api_key_env: OPENAI_API_KEY}
//
// A model with an upstream is served by that OpenAI-compatible provider
// (as --backend openai serves its one upstream), beside the vLLM fleets of
// the other models; no worker can join it.
//
// Unknown keys are errors, as everywhere in the file.
type ModelConfig struct {
	// Policy is a regular model's policy, and a PD model's for both roles
	// unless PrefillPolicy/DecodePolicy name one. It wins over a worker's
	// labels.policy (a different one there is refused).
	Policy        string `json:"policy"`
	PrefillPolicy string `json:"prefill_policy"`
	DecodePolicy  string `json:"decode_policy"`
	// MaxConcurrentRequests bounds the model's requests in flight (0 = no
	// per-model bound; --max-concurrent-requests still bounds them all).
	MaxConcurrentRequests int `json:"max_concurrent_requests"`
	// Upstream is the base URL of the OpenAI-compatible provider serving
	// the model ("" = vLLM workers serve it).
	Upstream string `json:"upstream"`
	// APIKeyEnv names the environment variable holding the upstream's API
	// key, sent as "Authorization: Bearer <key>" (never logged). Empty:
	// the client's Authorization is forwarded with
	// --forward-client-authorization, else none is sent.
	APIKeyEnv string `json:"api_key_env"`
}

// validateModels checks the "models" section.
func (c *Config) validateModels(add func(*Error)) {
	if len(c.Models) == 0 {
		return
	}
	if c.Mode() != ModeIGW {
		add(&Error{Kind: KindNotSupported, Field: "models", Reason: "config-file model sections need --enable-igw"})
		return
	}
	names := make([]string, 0, len(c.Models))
	for m := range c.Models {
		names = append(names, m)
	}
	sort.Strings(names)
	for _, m := range names {
		mc := c.Models[m]
		field := "models." + m
		if strings.TrimSpace(m) == "" {
			add(invalid("models", `""`, "A model name cannot be empty"))
			continue
		}
		checkEnum(add, field+".policy", mc.Policy, policyNames, true)
		checkEnum(add, field+".prefill_policy", mc.PrefillPolicy, policyNames, true)
		checkEnum(add, field+".decode_policy", mc.DecodePolicy, policyNames, true)
		if mc.MaxConcurrentRequests < 0 {
			add(invalid(field+".max_concurrent_requests", strconv.Itoa(mc.MaxConcurrentRequests), "Must be >= 0"))
		}
		mc.validateUpstream(add, field)
	}
}

// validateUpstream checks an upstream model's fields.
func (mc ModelConfig) validateUpstream(add func(*Error), field string) {
	if mc.Upstream == "" {
		if mc.APIKeyEnv != "" {
			add(invalid(field+".api_key_env", mc.APIKeyEnv, "Needs "+field+".upstream (the key is the upstream's)"))
		}
		return
	}
	if u, err := url.Parse(mc.Upstream); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		add(invalid(field+".upstream", mc.Upstream, "Must be an http:// or https:// base URL"))
	}
	for _, p := range []struct{ name, v string }{{"policy", mc.Policy}, {"prefill_policy", mc.PrefillPolicy}, {"decode_policy", mc.DecodePolicy}} {
		if p.v != "" {
			add(invalid(field+"."+p.name, p.v, "A model served by an upstream has no policy (the provider balances its own fleet)"))
		}
	}
	if mc.APIKeyEnv != "" && !envName.MatchString(mc.APIKeyEnv) {
		add(invalid(field+".api_key_env", mc.APIKeyEnv, "Must be an environment variable name"))
	}
}

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// UpstreamModels returns the models served by an upstream, sorted.
func (c *Config) UpstreamModels() []string {
	var out []string
	for m, mc := range c.Models {
		if mc.Upstream != "" {
			out = append(out, m)
		}
	}
	sort.Strings(out)
	return out
}
