package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseArgsRejectsBadValues(t *testing.T) {
	cases := [][]string{
		{"--role", "leader"},
		{"--kv-connector", "rdma"},
		{"--transfer-mode", "PUSH"},
		{"--registration-format", "v2"},
		{"--port", "-1"},
		{"--port", "x"},
		{"--handshake-port", "70000"},
		{"--proxy-address", "nohostport"},
		{"--heartbeat-interval", "0s"},
		{"--advertise-host", "a,b"},
		{"--data-parallel-size", "0"},
		{"--tensor-parallel-size", "0"},
		{"--profile-preset", "fast"},
		{"--max-num-seqs", "0"},
		{"--num-blocks", "0"},
		{"--block-size", "0"},
		{"--prefill-base", "-1ms"},
		{"--kv-bandwidth", "-5"},
		{"--time-scale", "0"},
		{"--eos-probability", "2"},
		{"--kv-wait-timeout", "-1s"},
		{"--defer-timeout", "0s"},
		{"--transfer-timeout", "0s"},
		{"--fail-status", "200"},
		{"--crash-after", "-1"},
		{"--slow-factor", "0"},
		{"--max-waiting", "-2"},
		{"--max-model-len", "999999999"},
		{"--responses-store-max", "0"},
		{"--responses-store-max", "-1"},
		{"--log-level", "loud"},
		{"--scheduling-policy", "lifo"},
	}
	for _, args := range cases {
		_, err := ParseArgs(args, io.Discard)
		var ue *UsageError
		if !errors.As(err, &ue) {
			t.Errorf("%v: err = %v, want a UsageError", args, err)
			continue
		}
		if name := strings.TrimPrefix(args[0], "--"); !strings.Contains(err.Error(), name) {
			t.Errorf("%v: error %q does not name the flag", args, err)
		}
	}
}

func TestParseArgsPresetsAndOverrides(t *testing.T) {
	c, err := ParseArgs([]string{"--profile-preset", "deepseek-r1-1p1d", "--decode-step-base", "10ms", "--transfer-mode", "read"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if c.Engine.DecodeStepBase != 10*time.Millisecond || c.Engine.NumLayers != 61 || c.Engine.BlockSize != 1 || c.TransferMode != "READ" {
		t.Errorf("preset+override: %+v mode %s", c.Engine, c.TransferMode)
	}
	// Deepseek preset shape: TPOT ~15 ms at 16 streams, ~25 ms at 256.
	if s := c.Engine.StepTime(16); s < 14*time.Millisecond && c.Engine.DecodeStepBase != 10*time.Millisecond {
		t.Errorf("S(16) = %v", s)
	}
	d, _, _ := Preset(PresetDeepSeek)
	if s16, s256 := d.StepTime(16), d.StepTime(256); s16 < 14*time.Millisecond || s16 > 17*time.Millisecond || s256 < 23*time.Millisecond || s256 > 27*time.Millisecond {
		t.Errorf("deepseek S(16)=%v S(256)=%v", s16, s256)
	}
	if f := d.PrefillTime(1000); f < 80*time.Millisecond || f > 250*time.Millisecond {
		t.Errorf("deepseek F(1000)=%v", f)
	}
	z, _, _ := Preset(PresetZero)
	if z.PrefillTime(8000) != 0 || z.StepTime(100) != 0 || z.TransferTime(8000) != 0 {
		t.Errorf("zero preset has latency: %+v", z)
	}
}

func TestParseArgsResponsesStore(t *testing.T) {
	for _, c := range []struct {
		args  []string
		store bool
		max   int
	}{
		{nil, false, 10000},
		{[]string{"--responses-store"}, true, 10000},
		{[]string{"--responses-store", "--responses-store-max", "1"}, true, 1},
	} {
		cfg, err := ParseArgs(c.args, io.Discard)
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if cfg.ResponsesStore != c.store || cfg.ResponsesStoreMax != c.max {
			t.Errorf("%v: store %v max %d, want %v %d", c.args, cfg.ResponsesStore, cfg.ResponsesStoreMax, c.store, c.max)
		}
	}
	var help strings.Builder
	_, _ = ParseArgs([]string{"--help"}, &help)
	if !strings.Contains(help.String(), "VLLM_ENABLE_RESPONSES_API_STORE=1") {
		t.Errorf("--help does not name VLLM_ENABLE_RESPONSES_API_STORE=1:\n%s", help.String())
	}
}

func TestMainPrintsReadyLine(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), testTimeout)
	defer cancel()
	pr, pw := io.Pipe()
	errc := make(chan error, 1)
	go func() {
		errc <- Main(ctx, []string{"--port", "0", "--role", "prefill", "--kv-connector", "mooncake", "--data-parallel-size", "2", "--log-level", "error"}, pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	if err != nil {
		t.Fatalf("read ready line: %v", err)
	}
	var r ReadyLine
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		t.Fatalf("ready line %q: %v", line, err)
	}
	if r.Event != "ready" || r.Role != "prefill" || r.KVConnector != "mooncake" || r.DPSize != 2 || r.TPSize != 1 || r.BootstrapPort == 0 ||
		!strings.HasPrefix(r.HTTPAddress, "127.0.0.1:") || r.ZMQAddress == "" {
		t.Errorf("ready line %+v", r)
	}
	// Exactly the documented keys.
	var keys map[string]any
	_ = json.Unmarshal([]byte(line), &keys)
	got := make([]string, 0, len(keys))
	for k := range keys {
		got = append(got, k)
	}
	want := []string{"bootstrap_port", "dp_size", "event", "http_address", "kv_connector", "role", "tp_size", "transfer_mode", "zmq_address"}
	if d := cmp.Diff(want, sortStrings(got)); d != "" {
		t.Errorf("ready keys (-want +got):\n%s", d)
	}
	resp, err := testClient.Get("http://" + r.HTTPAddress + "/health")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("health: %v", err)
	}
	resp.Body.Close()
	cancel()
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	if err := <-errc; err != nil {
		t.Errorf("Main returned %v", err)
	}
}

func TestMainUsageError(t *testing.T) {
	err := Main(t.Context(), []string{"--role", "x"}, io.Discard, io.Discard)
	var ue *UsageError
	if !errors.As(err, &ue) {
		t.Errorf("err = %v, want UsageError", err)
	}
	if err := Main(t.Context(), []string{"--help"}, io.Discard, io.Discard); err != nil {
		t.Errorf("--help: %v", err)
	}
}

func TestCrashAfter(t *testing.T) {
	ctx := testCtx(t)
	cfg, err := ParseArgs([]string{"--port", "0", "--crash-after", "2"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	exited := make(chan int, 1)
	in, err := Start(ctx, cfg, Options{Logger: testLogger(), Exit: func(c int) { exited <- c }})
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	postJSON(t, ctx, in.url("/v1/completions"), map[string]any{"prompt": "a", "max_tokens": 1}, nil)
	select {
	case <-exited:
		t.Fatal("exited after the first request")
	default:
	}
	resp, err := testClient.Do(newReq(t, ctx, "POST", in.url("/v1/completions"), map[string]any{"prompt": "a", "max_tokens": 1}, nil))
	if err == nil {
		resp.Body.Close()
	}
	select {
	case c := <-exited:
		if c != 1 {
			t.Errorf("exit code %d", c)
		}
	case <-time.After(5 * time.Second):
		t.Error("no exit after the second request")
	}
}

func sortStrings(s []string) []string {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s
}
