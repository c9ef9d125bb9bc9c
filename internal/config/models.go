package config

import (
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
	}
}
