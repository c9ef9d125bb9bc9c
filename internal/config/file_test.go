package config

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func parseFile(t *testing.T, name, content string, args ...string) (*Config, error) {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return ParseWith(append([]string{"--config", path}, args...), Options{LookupEnv: noEnv, Stdout: &bytes.Buffer{}})
}

const yamlFile = `
# P/D with static workers
vllm_pd_disaggregation: true
policy: round_robin
prefill:
  - url: http://p1:8000
    bootstrap_port: 8998
  - url: http://p2:8000
    bootstrap_port: null
  - url: http://p3:8000
decode: [http://d1:8000, http://d2:8000]
cache_threshold: 0.5
port: 31000
prometheus_host: "::1"
forward_client_authorization: false
stream_idle_timeout_secs: 0.25
router_api_keys: ["k1"]
selector: ["app=vllm"]
`

const jsonFile = `{
	"vllm_pd_disaggregation": true,
	"policy": "round_robin",
	"prefill": [
		{"url": "http://p1:8000", "bootstrap_port": 8998},
		{"url": "http://p2:8000", "bootstrap_port": null},
		{"url": "http://p3:8000"}
	],
	"decode": ["http://d1:8000", "http://d2:8000"],
	"cache_threshold": 0.5,
	"port": 31000,
	"prometheus_host": "::1",
	"forward_client_authorization": false,
	"stream_idle_timeout_secs": 0.25,
	"router_api_keys": ["k1"],
	"selector": ["app=vllm"]
}`

func TestConfigFileYAMLAndJSON(t *testing.T) {
	want := Default()
	want.VLLMPDDisaggregation = true
	want.Policy = "round_robin"
	want.Prefill = []PrefillWorker{{URL: "http://p1:8000", BootstrapPort: ptr(8998)}, {URL: "http://p2:8000"}, {URL: "http://p3:8000"}}
	want.Decode = []string{"http://d1:8000", "http://d2:8000"}
	want.CacheThreshold = 0.5
	want.Port = 31000
	want.PrometheusHost = "::1"
	want.ForwardClientAuthorization = false
	want.StreamIdleTimeoutSecs = 0.25
	want.RouterAPIKeys = []string{"k1"}
	want.Selector = []string{"app=vllm"}
	wantExplicit := map[string]bool{
		"config": true, "vllm-pd-disaggregation": true, "policy": true, "prefill": true, "decode": true,
		"cache-threshold": true, "port": true, "prometheus-host": true, "forward-client-authorization": true,
		"stream-idle-timeout-secs": true, "router-api-keys": true, "selector": true,
	}
	for _, tc := range []struct{ name, content string }{{"c.yaml", yamlFile}, {"c.json", jsonFile}, {"c.conf", jsonFile}} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseFile(t, tc.name, tc.content)
			if err != nil {
				t.Fatal(err)
			}
			want.ConfigFile = c.ConfigFile
			if diff := cmp.Diff(want, c, ignoreExplicit); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(wantExplicit, c.Explicit()); diff != "" {
				t.Errorf("Explicit (-want +got):\n%s", diff)
			}
			if err := c.Validate(); err != nil {
				t.Errorf("Validate: %v", err)
			}
		})
	}
}

func TestFlagsOverrideFile(t *testing.T) {
	c, err := parseFile(t, "c.yaml", yamlFile,
		"--policy", "random", "--decode", "http://d9:8000", "--prefill", "http://p9:8000", "7000", "--port=32000", "--forward-client-authorization")
	if err != nil {
		t.Fatal(err)
	}
	got := []any{c.Policy, c.Decode, c.Prefill, c.Port, c.ForwardClientAuthorization, c.CacheThreshold}
	want := []any{"random", []string{"http://d9:8000"}, []PrefillWorker{{URL: "http://p9:8000", BootstrapPort: ptr(7000)}}, uint16(32000), true, 0.5}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// A list flag given without values empties the file's list.
	c, err = parseFile(t, "c.yaml", yamlFile, "--router-api-keys")
	if err != nil {
		t.Fatal(err)
	}
	if len(c.RouterAPIKeys) != 0 {
		t.Errorf("RouterAPIKeys = %q, want empty", c.RouterAPIKeys)
	}
	// The --config flag may come after the flags it is overridden by.
	path := filepath.Join(t.TempDir(), "late.yaml")
	if err := os.WriteFile(path, []byte("port: 1\nhost: 0.0.0.0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err = ParseWith([]string{"--port", "2", "--config", path}, Options{LookupEnv: noEnv})
	if err != nil {
		t.Fatal(err)
	}
	if c.Port != 2 || c.Host != "0.0.0.0" {
		t.Errorf("Port=%d Host=%q, want 2 and 0.0.0.0", c.Port, c.Host)
	}
}

func TestConfigFileErrors(t *testing.T) {
	tests := []struct {
		name, file, content string
		want                []string // substrings
	}{
		{"unknown key", "c.yaml", "port: 1\nworker_url: [http://a]\n", []string{`unknown key "worker_url"`}},
		{"kebab key hint", "c.yaml", "worker-urls: [http://a]\n", []string{`unknown key "worker-urls" (did you mean "worker_urls"?)`}},
		{"wrong case", "c.json", `{"Port": 1}`, []string{`unknown key "Port" (did you mean "port"?)`}},
		{"several unknown keys", "c.yaml", "b: 1\na: 2\n", []string{`unknown key "a"`, `unknown key "b"`}},
		{"config key", "c.yaml", "config: other.yaml\n", []string{`unknown key "config"`}},
		{"runtime alias is not a key", "c.yaml", "runtime: openai\n", []string{`unknown key "runtime"`}},
		{"unknown nested key", "c.yaml", "prefill:\n  - url: http://p\n    port: 1\n", []string{`unknown field "port"`}},
		{"wrong type", "c.yaml", "port: abc\n", []string{"cannot unmarshal string", "port"}},
		{"out of range", "c.json", `{"port": 70000}`, []string{"cannot unmarshal number 70000"}},
		{"negative unsigned", "c.json", `{"retry_max_retries": -1}`, []string{"cannot unmarshal number -1"}},
		{"duplicate key", "c.yaml", "port: 1\nport: 2\n", []string{"already set"}},
		{"not a mapping", "c.yaml", "- a\n- b\n", []string{"must be a mapping"}},
		{"bad yaml", "c.yaml", "port: [1\n", []string{"yaml:"}},
		{"bad json", "c.json", `{"port": 1`, []string{"yaml:"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFile(t, tc.file, tc.content)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			var ce *Error
			if !errors.As(err, &ce) || ce.Kind != KindConfigFile || ce.Field != "--config" {
				t.Errorf("error is not a KindConfigFile *Error: %#v", ce)
			}
			if !strings.HasPrefix(err.Error(), "config file ") {
				t.Errorf("error %q does not start with the file", err)
			}
		})
	}

	_, err := ParseWith([]string{"--config", filepath.Join(t.TempDir(), "missing.yaml")}, Options{LookupEnv: noEnv})
	if err == nil || !strings.Contains(err.Error(), "no such file or directory") || strings.Count(err.Error(), "missing.yaml") != 1 {
		t.Errorf("missing file error = %v", err)
	}
}

func TestConfigFileEdgeCases(t *testing.T) {
	for _, content := range []string{"", "# only a comment\n", "{}", "null"} {
		c, err := parseFile(t, "c.yaml", content)
		if err != nil {
			t.Fatalf("%q: %v", content, err)
		}
		if diff := cmp.Diff(map[string]bool{"config": true}, c.Explicit()); diff != "" {
			t.Errorf("%q: Explicit (-want +got):\n%s", content, diff)
		}
	}
	// Last --config wins; flags still parse around it.
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
	if err := os.WriteFile(a, []byte("port: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(b, []byte("host: h\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := ParseWith([]string{"--config", a, "--config=" + b}, Options{LookupEnv: noEnv})
	if err != nil {
		t.Fatal(err)
	}
	if c.Port != 30000 || c.Host != "h" || c.ConfigFile != b {
		t.Errorf("Port=%d Host=%q ConfigFile=%q", c.Port, c.Host, c.ConfigFile)
	}
	// A usage error is reported before the file is read.
	_, err = ParseWith([]string{"--config", filepath.Join(dir, "missing"), "--nope"}, Options{LookupEnv: noEnv})
	if err == nil || err.Error() != "unknown flag: --nope" {
		t.Errorf("err = %v, want the unknown flag", err)
	}
	// The file reader is injectable.
	c, err = ParseWith([]string{"--config", "virtual.yaml"}, Options{LookupEnv: noEnv, ReadFile: func(p string) ([]byte, error) {
		return []byte("log_format: json\n"), nil
	}})
	if err != nil || c.LogFormat != "json" {
		t.Errorf("ReadFile stub: %v %+v", err, c)
	}
}
