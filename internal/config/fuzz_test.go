package config

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

// FuzzParse feeds newline-separated argv plus an in-memory --config file
// through the whole lifecycle; nothing may panic, and a parse either
// succeeds or returns an error (never both nil).
func FuzzParse(f *testing.F) {
	seeds := []struct{ args, file string }{
		{"--worker-urls\nhttp://a\nhttp://b\n--policy\nrandom", ""},
		{"--prefill\nhttp://p\n9000\n--prefill\nhttp://q\nnone\n--decode\nhttp://d\n--vllm-pd-disaggregation", ""},
		{"--prefill=http://p\n65536", ""},
		{"--prefill", ""},
		{"--config\nc.yaml", "port: 1\nprefill: [{url: http://p, bootstrap_port: 0}]\n"},
		{"--config\nc.json", `{"worker_urls": ["http://a"], "cache_threshold": 2}`},
		{"--config=c\n--port\n2", "- a"},
		{"--config\nc", "unknown: 1"},
		{"--help", ""},
		{"-V", ""},
		{"--\nx", ""},
		{"--port=\n--runtime\nopenai", ""},
		{"--selector\n=\n-\n--max-tree-size\n-1", ""},
		{"--otel-sampling-ratio\nNaN\n--discovery-ttl-secs\n-Inf", ""},
	}
	for _, s := range seeds {
		f.Add(s.args, s.file)
	}
	f.Fuzz(func(t *testing.T, args, file string) {
		var argv []string
		if args != "" {
			argv = strings.Split(args, "\n")
		}
		var out bytes.Buffer
		c, err := ParseWith(argv, Options{
			Stdout:    &out,
			Version:   "fuzz",
			LookupEnv: func(string) (string, bool) { return "", false },
			ReadFile:  func(string) ([]byte, error) { return []byte(file), nil },
		})
		if err != nil {
			if c != nil {
				t.Fatalf("config and error both returned: %v", err)
			}
			if !errors.Is(err, ErrHelp) && !errors.Is(err, ErrVersion) {
				var ce *Error
				if !errors.As(err, &ce) {
					t.Fatalf("error %T (%v) is not a *config.Error", err, err)
				}
			}
			return
		}
		if c == nil {
			t.Fatal("nil config without error")
		}
		_ = c.Validate()
		_ = c.Mode()
		_ = c.Warnings()
		_ = c.EffectiveRetry()
		_ = c.EffectiveCircuitBreaker()
		_ = c.Redacted()
		_ = c.Explicit()
		_, _, _ = c.SelectorMap(), c.PrefillSelectorMap(), c.DecodeSelectorMap()
		_ = c.StreamIdleTimeout() + c.DiscoveryTTL() + c.ShutdownTimeout()
	})
}

// FuzzParseDotEnv checks the .env parser never panics.
func FuzzParseDotEnv(f *testing.F) {
	for _, s := range []string{"A=1", "A='x", "A=\"${B}\\n\"", "export A=$", "#c\n\nB=x # y", "A=${", "A=\"\\"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = ParseDotEnv(strings.NewReader(s), func(string) (string, bool) { return "v", true })
	})
}
