package interop

import (
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestOpenAISDK runs testdata/sdk_check.py (the OpenAI Python SDK:
// completions, chat, streaming with usage, typed errors, models) through
// Switchyard in regular and in PD mode.
func TestOpenAISDK(t *testing.T) {
	needEnv(t)
	for _, mode := range []string{"regular", "pd"} {
		t.Run(mode, func(t *testing.T) {
			r := regularRouter
			if mode == "pd" {
				r = func(t *testing.T) *harnessRouter { return pdRouter(t) }
			}
			base := r(t).Base
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, filepath.Join(venv, "bin", "python"), "testdata/sdk_check.py", base, modelDir)
			cmd.Env = engineEnv()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("sdk_check.py: %v\n%s", err, tail(out))
			}
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			var res struct {
				Completion string         `json:"completion"`
				BadRequest map[string]any `json:"bad_request"`
			}
			if err := json.Unmarshal([]byte(lines[len(lines)-1]), &res); err != nil || res.Completion == "" || res.BadRequest == nil {
				t.Fatalf("sdk_check.py output %q: %v", out, err)
			}
			t.Logf("sdk: %s", lines[len(lines)-1])
		})
	}
}
