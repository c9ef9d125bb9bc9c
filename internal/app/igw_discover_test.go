package app

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
	"github.com/switchyard-llm/switchyard/internal/igw"
	"github.com/switchyard-llm/switchyard/internal/kvevents"
	"github.com/switchyard-llm/switchyard/internal/policy"
	"github.com/switchyard-llm/switchyard/internal/worker"
)

func TestDiscoverModel(t *testing.T) {
	for _, tc := range []struct {
		name   string
		models string // /v1/models answer ("" = 404)
		info   string // /get_server_info answer ("" = 404)
		want   string
		err    string
	}{
		{"v1 models", `{"data":[{"id":"Qwen/Qwen3-8B"},{"id":"lora-a"}]}`, `{"model_id":"other"}`, "Qwen/Qwen3-8B", ""},
		{"server info model_id", "", `{"model_id":"sgl-model"}`, "sgl-model", ""},
		{"server info model_path", `{"data":[]}`, `{"model_path":"/models/meta-llama/Llama-3.1-8B/"}`, "Llama-3.1-8B", ""},
		{"neither", "", "", "", "/v1/models: status 404"},
		{"empty list", `{"data":[]}`, `{"model_id":"  "}`, "", "no model listed"},
		{"garbage", `not json`, "", "", "/v1/models: invalid character"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if got := r.Header.Get("Authorization"); got != "Bearer k" {
					t.Errorf("%s without the upstream key: %q", r.URL.Path, got)
				}
				body := map[string]string{"/v1/models": tc.models, "/get_server_info": tc.info}[r.URL.Path]
				if body == "" {
					http.NotFound(w, r)
					return
				}
				_, _ = io.WriteString(w, body)
			}))
			defer srv.Close()
			a := &app{cfg: &config.Config{APIKey: "k"}, client: srv.Client()}
			got, err := a.discoverModel(context.Background(), srv.URL)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("%q %v, want %q", got, err, tc.want)
			}
		})
	}
}

// The LoRA adapters a worker lists with its model as parent (vLLM's
// /v1/models) are routed to that model's fleet; an entry with another
// parent, or none, is not taken for one.
func TestDiscoverModelRecordsAdapters(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"data":[{"id":"base","parent":null},{"id":"sql","parent":"base"},`+
			`{"id":"stray","parent":"other"},{"id":"plain"}]}`)
	}))
	defer srv.Close()
	rt, err := igw.New(igw.Options{Registry: worker.NewRegistry(worker.BreakerConfig{}), DefaultPolicy: "round_robin",
		NewPolicy: func(string) (policy.Policy, error) { return nil, errors.New("unused") }})
	if err != nil {
		t.Fatal(err)
	}
	defer rt.Close()
	a := &app{cfg: &config.Config{}, client: srv.Client(), igw: rt}
	if got, err := a.discoverModel(context.Background(), srv.URL); err != nil || got != "base" {
		t.Fatalf("%q %v, want base", got, err)
	}
	for name, want := range map[string]string{"sql": "base", "stray": "", "plain": ""} {
		if got, _ := rt.AdapterModel(name); got != want {
			t.Errorf("adapter %s → %q, want %q", name, got, want)
		}
	}
	// kv_aware's index, built after, keys the adapter's requests with its name
	a.noteLoRA("loaded") // a load through the router
	x := kvevents.NewIndex(kvevents.IndexOptions{BlockSize: 16})
	a.setLoRAIndex(x)
	a.noteLoRA("later")
	for name, want := range map[string]bool{"sql": true, "loaded": true, "later": true, "stray": false, "plain": false, "base": false} {
		if x.IsLoRA(name) != want {
			t.Errorf("index: IsLoRA(%s) = %v, want %v", name, !want, want)
		}
	}
}
