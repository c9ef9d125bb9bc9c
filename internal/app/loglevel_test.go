package app

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
)

// Every --log-level value (the Rust binary's and the Python launcher's)
// maps to the slog level of the same meaning.
func TestNewLoggerLevels(t *testing.T) {
	tests := []struct {
		level string
		want  slog.Level
	}{
		{"debug", slog.LevelDebug},
		{"info", slog.LevelInfo},
		{"warn", slog.LevelWarn},
		{"warning", slog.LevelWarn},
		{"error", slog.LevelError},
		{"critical", slog.LevelError},
	}
	for _, tc := range tests {
		t.Run(tc.level, func(t *testing.T) {
			cfg := &config.Config{LogLevel: tc.level, LogFormat: config.LogFormatText}
			l, closeFn, err := newLogger(cfg, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			defer closeFn()
			ctx := context.Background()
			if !l.Enabled(ctx, tc.want) || (tc.want > slog.LevelDebug && l.Enabled(ctx, tc.want-1)) {
				t.Errorf("--log-level %s: enabled below %v or not at it", tc.level, tc.want)
			}
		})
	}
}
