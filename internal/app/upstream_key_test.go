package app

import (
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
)

func TestResolveUpstreamKey(t *testing.T) {
	base := []string{"--backend", "openai", "--worker-urls", "https://api.example.com/v1"}
	cases := []struct {
		name    string
		args    []string
		env     map[string]string
		want    string // resulting APIKey
		wantErr string
	}{
		{"flag", []string{"--api-key", "sk-flag"}, map[string]string{"OPENAI_API_KEY": "sk-env"}, "sk-flag", ""},
		{"env", nil, map[string]string{"OPENAI_API_KEY": " sk-env\n"}, "sk-env", ""},
		{"none", nil, nil, "", "no upstream API key"},
		{"blank env", nil, map[string]string{"OPENAI_API_KEY": "  "}, "", "no upstream API key"},
		{"client auth forwarded on request", []string{"--forward-client-authorization"}, nil, "", ""},
		{"default forwarding is not enough", []string{"--forward-client-authorization=false"}, nil, "", "no upstream API key"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse(append(append([]string{}, base...), tc.args...))
			if err != nil {
				t.Fatal(err)
			}
			err = resolveUpstreamKey(cfg, func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || cfg.APIKey != tc.want {
				t.Fatalf("err %v, key %q, want %q", err, cfg.APIKey, tc.want)
			}
		})
	}
}
