package config

import (
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

func TestValidateKVAware(t *testing.T) {
	w := []string{"--worker-urls", "http://w1:8000", "--policy", "kv_aware"}
	pd := []string{"--vllm-pd-disaggregation", "--prefill", "http://p1:8000", "--decode", "http://d1:8000"}
	with := func(base []string, more ...string) []string { return append(append([]string{}, base...), more...) }
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"regular kv_aware", w, nil},
		{"pd prefill kv_aware with bypass", with(pd, "--prefill-policy", "kv_aware", "--pd-uncached-token-threshold", "64"), nil},
		{"explicit endpoints", with(w, "--kv-events-endpoints", "http://w1:8000=tcp://w1:5557,tcp://w1:5558"), nil},
		{"kv flags ignored without kv_aware", []string{"--worker-urls", "http://w", "--kv-block-size", "0"}, nil},
		{"bypass without kv_aware", with(pd, "--pd-uncached-token-threshold", "64"),
			[]string{"invalid value for --pd-uncached-token-threshold: 64 - needs --policy (or --prefill-policy) kv_aware"}},
		{"bypass outside PD", with(w, "--pd-uncached-token-threshold", "64"),
			[]string{"invalid value for --pd-uncached-token-threshold: 64 - needs --vllm-pd-disaggregation (or --enable-igw with PD workers)"}},
		{"bypass off outside PD", with(w, "--pd-uncached-token-threshold", "0"), nil},
		{"tokenizer with kv_aware", with(w, "--tokenizer-path", "/m"), nil},
		{"tokenizer without kv_aware", []string{"--worker-urls", "http://w", "--tokenizer-path", "/m"},
			[]string{"invalid value for --tokenizer-path: /m - needs --policy (or --prefill-policy) kv_aware"}},
		{"chat template with a tokenizer", with(w, "--tokenizer-path", "/m", "--chat-template", "/m/t.jinja"), nil},
		{"chat template without a tokenizer", with(w, "--chat-template", "/m/t.jinja"),
			[]string{"invalid value for --chat-template: /m/t.jinja - needs --tokenizer-path"}},
		{"chat template without kv_aware", []string{"--worker-urls", "http://w", "--chat-template", "/t.jinja"},
			[]string{"invalid value for --chat-template: /t.jinja - needs --policy (or --prefill-policy) kv_aware"}},
		{"bad values", with(w, "--kv-block-size", "0", "--kv-index-max-entries", "0", "--kv-events-port", "0", "--kv-load-weight", "-1", "--kv-tie-band", "1.5"),
			[]string{
				"invalid value for --kv-block-size: 0 - Must be between 1 and 65536",
				"invalid value for --kv-index-max-entries: 0 - Must be > 0",
				"invalid value for --kv-events-port: 0 - Port must be > 0",
				"invalid value for --kv-load-weight: -1 - Must be >= 0",
				"invalid value for --kv-tie-band: 1.5 - Must be between 0.0 and 1.0",
			}},
		{"endpoint without =", with(w, "--kv-events-endpoints", "tcp://w1:5557"),
			[]string{`invalid value for --kv-events-endpoints: tcp://w1:5557 - "tcp://w1:5557": want URL=tcp://HOST:PORT[,tcp://HOST:PORT]`}},
		{"endpoint not tcp", with(w, "--kv-events-endpoints", "http://w1:8000=http://w1:5557"),
			[]string{`invalid value for --kv-events-endpoints: http://w1:8000=http://w1:5557 - "http://w1:8000=http://w1:5557": "http://w1:5557" is not tcp://HOST:PORT`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := messages(t, parse(t, tc.args...).Validate())
			if d := cmp.Diff(tc.want, got, cmpopts.EquateEmpty()); d != "" {
				t.Errorf("Validate() (-want +got):\n%s", d)
			}
		})
	}
	if got := parse(t, with(w, "--kv-events-endpoints", "http://w1:8000/=tcp://a:1")...); got.UsesKVAware() {
		eps, err := got.KVEndpointList()
		if err != nil || len(eps) != 1 || eps[0].URL != "http://w1:8000" || eps[0].Endpoint != "tcp://a:1" || eps[0].Replay != "" {
			t.Fatalf("endpoints %+v %v", eps, err)
		}
	}
}
