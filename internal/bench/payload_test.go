package bench

import (
	"encoding/json"
	"strings"
	"testing"
)

func sampleFor(t *testing.T, cfg *Config) Sample {
	t.Helper()
	if err := cfg.normalize(); err != nil {
		t.Fatal(err)
	}
	s, err := buildSamples(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s[0]
}

func TestCompletionsPayload(t *testing.T) {
	cfg := randomCfg(6, 3, 0, 1, 1)
	s := sampleFor(t, &cfg)
	pb, err := newPayloadBuilder(&cfg, "m/x")
	if err != nil {
		t.Fatal(err)
	}
	got := string(pb.build(s))
	want := `{"model":"m/x","prompt":"` + s.Prompt() + `","repetition_penalty":1.0,"max_tokens":3,"logprobs":null,"stream":true,"stream_options":{"include_usage":true},"ignore_eos":true}`
	if got != want {
		t.Errorf("payload\n got %s\nwant %s", got, want)
	}
}

func TestChatPayloadAndExtraBody(t *testing.T) {
	cfg := randomCfg(4, 9, 0, 1, 1)
	cfg.DatasetName = DatasetSharedPrefix
	cfg.SharedPrefixGroups, cfg.SharedPrefixLen, cfg.NumPrompts = 1, 2, 1
	cfg.Backend = BackendOpenAIChat
	cfg.Endpoint = ""
	n := 2
	cfg.Logprobs = &n
	cfg.ExtraBody = json.RawMessage(`{"temperature":0,"stream_options":{"include_usage":true,"continuous_usage_stats":false},"x\"y":[1]}`)
	s := sampleFor(t, &cfg)
	if cfg.Endpoint != "/v1/chat/completions" || cfg.IgnoreEOS {
		t.Fatalf("endpoint %q ignoreEOS %v", cfg.Endpoint, cfg.IgnoreEOS)
	}
	pb, err := newPayloadBuilder(&cfg, "m")
	if err != nil {
		t.Fatal(err)
	}
	got := string(pb.build(s))
	want := `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"` + s.Prompt() +
		`"}]}],"max_completion_tokens":9,"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false},"temperature":0,"x\"y":[1]}`
	if got != want {
		t.Errorf("payload\n got %s\nwant %s", got, want)
	}
	if !json.Valid([]byte(got)) {
		t.Error("payload is not valid JSON")
	}
	if len(strings.Fields(s.Prompt())) != 6 {
		t.Errorf("prompt %q: want 2 prefix + 4 words", s.Prompt())
	}
}

func TestParseArgsVLLMCommandLine(t *testing.T) {
	// The command line of MORIIO-RESULTS.md, plus the space-separated
	// goodput form and repeated headers.
	args := strings.Fields(`--backend vllm --dataset-name random --random-input-len 1000 --random-output-len 1000
		--max-concurrency 16 --num-warmups 32 --num-prompts 160 --goodput ttft:1000 tpot:50 --seed 1234
		--host 10.0.0.1 --port 30000 --header a=1 b=2 --header c=3 --metric-percentiles 50,99.9
		--percentile-metrics ttft,e2el --request-rate 2.5 --burstiness 0.5 --timeout 30 --max-duration 10m
		--temperature 0 --extra-body {"top_k":5,"temperature":1}`)
	cfg, o, err := parseArgs(args, new(strings.Builder))
	if err != nil {
		t.Fatal(err)
	}
	if cfg.BaseURL != "http://10.0.0.1:30000" || cfg.Backend != "vllm" || cfg.InputLen != 1000 || cfg.OutputLen != 1000 ||
		cfg.MaxConcurrency != 16 || cfg.NumWarmups != 32 || cfg.NumPrompts != 160 || cfg.Seed != 1234 ||
		cfg.RequestRate != 2.5 || cfg.Burstiness != 0.5 || cfg.Timeout.Seconds() != 30 || cfg.MaxDuration.Minutes() != 10 {
		t.Errorf("parsed config wrong: %+v", cfg)
	}
	if len(cfg.Goodput) != 2 || cfg.Goodput["ttft"] != 1000 || cfg.Goodput["tpot"] != 50 {
		t.Errorf("goodput = %v", cfg.Goodput)
	}
	if cfg.Header.Get("a") != "1" || cfg.Header.Get("b") != "2" || cfg.Header.Get("c") != "3" {
		t.Errorf("headers = %v", cfg.Header)
	}
	if len(cfg.MetricPercentiles) != 2 || cfg.MetricPercentiles[1] != 99.9 || strings.Join(cfg.PercentileMetrics, ",") != "ttft,e2el" {
		t.Errorf("percentiles %v metrics %v", cfg.MetricPercentiles, cfg.PercentileMetrics)
	}
	if string(cfg.ExtraBody) != `{"temperature":1,"top_k":5}` {
		t.Errorf("extra body = %s", cfg.ExtraBody)
	}
	if o.saveResult || !o.saveDetailed {
		t.Errorf("options = %+v", o)
	}
	if !strings.HasPrefix(cfg.RequestIDPrefix, "bench-") || len(cfg.RequestIDPrefix) != len("bench-12345678-") {
		t.Errorf("default request id prefix %q", cfg.RequestIDPrefix)
	}

	cfg, _, err = parseArgs([]string{"--input-len", "7", "--output-len", "3", "--base-url", "http://h:1/", "--request-rate", "inf"}, new(strings.Builder))
	if err != nil || cfg.InputLen != 7 || cfg.OutputLen != 3 || cfg.BaseURL != "http://h:1/" {
		t.Errorf("aliases: %+v %v", cfg, err)
	}
	for _, bad := range [][]string{
		{"--goodput", "ttft=5"},
		{"--header", "novalue"},
		{"--request-rate", "0"},
		{"stray"},
	} {
		if _, _, err := parseArgs(bad, new(strings.Builder)); err == nil {
			t.Errorf("%v: expected an error", bad)
		}
	}
}

func TestNormalizeRejects(t *testing.T) {
	for name, mut := range map[string]func(*Config){
		"range ratio 1":  func(c *Config) { c.RangeRatio = 1 },
		"negative ratio": func(c *Config) { c.RangeRatio = -0.1 },
		"bad goodput":    func(c *Config) { c.Goodput = map[string]float64{"itl": 5} },
		"neg goodput":    func(c *Config) { c.Goodput = map[string]float64{"ttft": -1} },
		"bad metric":     func(c *Config) { c.PercentileMetrics = []string{"foo"} },
		"bad endpoint":   func(c *Config) { c.Endpoint = "/v1/models" },
		"bad backend":    func(c *Config) { c.Backend = "tgi" },
		"zero prompts":   func(c *Config) { c.NumPrompts = 0 },
		"bad extra body": func(c *Config) { c.ExtraBody = json.RawMessage(`[1]`) },
		"no scheme":      func(c *Config) { c.BaseURL = "localhost:8000" },
	} {
		c := DefaultConfig()
		mut(&c)
		if err := c.normalize(); err == nil {
			t.Errorf("%s: normalize accepted it", name)
		}
	}
}
