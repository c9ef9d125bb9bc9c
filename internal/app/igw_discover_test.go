package app

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/switchyard-llm/switchyard/internal/config"
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
