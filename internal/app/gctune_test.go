package app

import (
	"io"
	"log/slog"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
)

func TestStartGCTuning(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		started bool
	}{
		{"default floor", nil, nil, true},
		{"floor off", []string{"--gc-heap-floor-mb", "0"}, nil, false},
		{"GOGC set by the operator", nil, map[string]string{"GOGC": "200"}, false},
		{"GOGC set, floor given", []string{"--gc-heap-floor-mb", "64"}, map[string]string{"GOGC": "off"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse(append([]string{"--worker-urls", "http://127.0.0.1:1"}, tc.args...))
			if err != nil {
				t.Fatal(err)
			}
			lookup := func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok }
			tu := startGCTuning(cfg, log, lookup)
			defer tu.Stop()
			if (tu != nil) != tc.started {
				t.Fatalf("tuner started %v, want %v", tu != nil, tc.started)
			}
		})
	}
}
