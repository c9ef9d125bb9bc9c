package app

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/kvaware"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

// TestKVSource: each worker's event endpoint comes from an explicit
// --kv-events-endpoints entry, else its pod annotation's port, else
// --kv-events-port, each offset by the worker's DP rank as vLLM does.
func TestKVSource(t *testing.T) {
	cfg, err := config.Parse([]string{"--worker-urls", "http://10.0.0.1:8000", "--policy", "kv_aware",
		"--kv-events-replay-port", "5558", "--kv-events-topic", "kv@",
		"--kv-events-endpoints", "http://10.0.0.9:8000=tcp://10.0.0.99:7000,tcp://10.0.0.99:7001"})
	if err != nil {
		t.Fatal(err)
	}
	a := &app{cfg: cfg, reg: worker.NewRegistry(worker.BreakerConfig{})}
	eps, _ := cfg.KVEndpointList()
	a.kvs = &kvState{explicit: map[string]config.KVEndpoint{eps[0].URL: eps[0]}}
	for _, tc := range []struct {
		spec           worker.Spec
		endpoint, repl string
	}{
		{worker.Spec{URL: "http://10.0.0.1:8000", DPRank: -1}, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"},
		{worker.Spec{URL: "http://10.0.0.2:8000", DPRank: 3, DPSize: 4}, "tcp://10.0.0.2:5560", "tcp://10.0.0.2:5561"},
		{worker.Spec{URL: "http://[::1]:8000", DPRank: -1, KVEventsPort: 6000}, "tcp://[::1]:6000", "tcp://[::1]:5558"},
		{worker.Spec{URL: "http://10.0.0.9:8000", DPRank: -1}, "tcp://10.0.0.99:7000", "tcp://10.0.0.99:7001"},
	} {
		src, ok := a.kvSource(worker.New(tc.spec, worker.BreakerConfig{}))
		if !ok || src.Endpoint != tc.endpoint || src.ReplayEndpoint != tc.repl || src.Topic != "kv@" || src.Worker != tc.spec.Key() {
			t.Errorf("%s: source %+v ok %v, want %s %s", tc.spec.Key(), src, ok, tc.endpoint, tc.repl)
		}
	}
}

// TestKVTokenizerLoadError: a --tokenizer-path the router cannot use
// exactly is a startup error naming the file and the component.
func TestKVTokenizerLoadError(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tokenizer.json")
	if err := os.WriteFile(path, []byte(`{"model":{"type":"BPE","vocab":{},"merges":[]},"pre_tokenizer":{"type":"Metaspace"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse([]string{"--worker-urls", "http://10.0.0.1:8000", "--policy", "kv_aware", "--tokenizer-path", path})
	if err != nil {
		t.Fatal(err)
	}
	a := &app{cfg: cfg, reg: worker.NewRegistry(worker.BreakerConfig{}), client: http.DefaultClient}
	_, err = a.kv()
	if err == nil || !strings.Contains(err.Error(), "--tokenizer-path") || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "pre_tokenizer Metaspace") {
		t.Errorf("err %v, want the flag, %s and the component", err, path)
	}
}

// The flag's default is the policy's.
func TestKVTieBandDefault(t *testing.T) {
	if got := config.Default().KVTieBand; got != kvaware.DefaultTieBand {
		t.Fatalf("--kv-tie-band defaults to %v, kvaware.DefaultTieBand is %v", got, kvaware.DefaultTieBand)
	}
}
