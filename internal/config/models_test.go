package config

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestModelSections(t *testing.T) {
	const good = `
enable_igw: true
models:
  Qwen/Qwen3-8B: {policy: cache_aware, max_concurrent_requests: 64}
  big:
    prefill_policy: random
    decode_policy: power_of_two
  gpt-4o-mini: {upstream: "https://api.openai.com/v1", api_key_env: OPENAI_API_KEY, max_concurrent_requests: 8}
`
	c, err := parseFile(t, "c.yaml", good)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	want := map[string]ModelConfig{
		"Qwen/Qwen3-8B": {Policy: PolicyCacheAware, MaxConcurrentRequests: 64},
		"big":           {PrefillPolicy: PolicyRandom, DecodePolicy: PolicyPowerOfTwo},
		"gpt-4o-mini":   {Upstream: "https://api.openai.com/v1", APIKeyEnv: "OPENAI_API_KEY", MaxConcurrentRequests: 8},
	}
	if d := cmp.Diff(want, c.Models); d != "" {
		t.Fatalf("models (-want +got):\n%s", d)
	}
	if got := c.UpstreamModels(); len(got) != 1 || got[0] != "gpt-4o-mini" {
		t.Fatalf("UpstreamModels = %v", got)
	}

	for _, tc := range []struct {
		name, file string
		args       []string
		want       []string // parse or validation errors, each a substring
	}{
		{"unknown key", "enable_igw: true\nmodels:\n  m: {polcy: random}\n", nil, []string{`unknown field "polcy"`}},
		{"not a mapping", "enable_igw: true\nmodels: [m]\n", nil, []string{"config file"}},
		{"bad values", "enable_igw: true\nmodels:\n  m: {policy: fastest, decode_policy: nope, max_concurrent_requests: -1}\n", nil, []string{
			"invalid value for models.m.policy: fastest - Must be one of",
			"invalid value for models.m.decode_policy: nope",
			"invalid value for models.m.max_concurrent_requests: -1 - Must be >= 0",
		}},
		{"bad upstream", "enable_igw: true\nmodels:\n  m: {upstream: \"ftp://x\", policy: random, api_key_env: \"A-B\"}\n  q: {api_key_env: K}\n", nil, []string{
			"invalid value for models.m.upstream: ftp://x - Must be an http:// or https:// base URL",
			"invalid value for models.m.policy: random - A model served by an upstream has no policy",
			"invalid value for models.m.api_key_env: A-B - Must be an environment variable name",
			"invalid value for models.q.api_key_env: K - Needs models.q.upstream",
		}},
		{"empty name", "enable_igw: true\nmodels:\n  \"\": {policy: random}\n", nil, []string{"A model name cannot be empty"}},
		{"without igw", "worker_urls: [http://w:1]\nmodels:\n  m: {policy: random}\n", nil, []string{"not supported: models (config-file model sections need --enable-igw)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseFile(t, "c.yaml", tc.file, tc.args...)
			if err == nil {
				err = c.Validate()
			}
			if err == nil {
				t.Fatal("accepted")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
}
