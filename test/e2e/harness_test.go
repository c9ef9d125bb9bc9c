// Package e2e starts the real binaries (switchyard, vllm-sim) as child
// processes and talks to them over real sockets.
package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/switchyard-llm/switchyard/test/internal/harness"
)

// bins starts the binaries TestMain built; failed tests print the last 4000
// bytes of each child's logs.
var bins = &harness.Bins{DumpTail: 4000}

func TestMain(m *testing.M) {
	dir, err := harness.Build("switchyard-e2e-", nil, "../../cmd/switchyard", "../../cmd/vllm-sim", "../../cmd/sybench")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.Dir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// sim is a started vllm-sim.
type sim struct{ *harness.Sim }

func startSim(t *testing.T, args ...string) *sim {
	t.Helper()
	return &sim{bins.StartSim(t, args...)}
}

type router = harness.Router

// startRouter starts switchyard with args and waits until /liveness answers.
func startRouter(t *testing.T, args ...string) *router {
	t.Helper()
	return bins.StartRouter(t, args...)
}

// post sends a JSON body and returns status, headers and the full body.
func post(t *testing.T, ctx context.Context, url, body string, hdr ...string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("read %s: %v", url, err)
	}
	return resp.StatusCode, resp.Header, b
}

func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	return harness.GetJSON(t, nil, url, v)
}

// waitFor polls cond every 5 ms until it holds or d passes; it returns how
// long it took, or fails the test.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	return harness.WaitFor(t, d, 5*time.Millisecond, what, cond)
}

// completionText extracts the text of a non-streaming response.
func completionText(t *testing.T, body []byte) string {
	t.Helper()
	var r struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(body, &r); err != nil || len(r.Choices) == 0 {
		t.Fatalf("bad completion %s: %v", body, err)
	}
	return r.Choices[0].Text + r.Choices[0].Message.Content
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}
