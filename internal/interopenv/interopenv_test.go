package interopenv

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFind(t *testing.T) {
	dir := t.TempDir()
	venv, model := filepath.Join(dir, "venv"), filepath.Join(dir, "model")
	t.Setenv("INTEROP_VENV", venv)
	t.Setenv("INTEROP_MODEL", model)
	if _, why := Find(dir); !strings.Contains(why, "no vLLM environment at "+venv) {
		t.Fatalf("no venv: %q", why)
	}
	if err := os.MkdirAll(filepath.Join(venv, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(venv, "bin", "vllm"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, why := Find(dir); !strings.Contains(why, "no tiny model at "+model) {
		t.Fatalf("no model: %q", why)
	}
	if err := os.MkdirAll(model, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(model, "config.json"), []byte("{}"), 0o644); err != nil {
		t.Fatal(err)
	}
	e, why := Find(dir)
	if why != "" || e.Venv != venv || e.Model != model {
		t.Fatalf("Find = %+v, %q", e, why)
	}

	// The defaults: the cache folder's venv and the repository's model.
	t.Setenv("INTEROP_VENV", "")
	t.Setenv("INTEROP_MODEL", "")
	t.Setenv("XDG_CACHE_HOME", filepath.Join(dir, "cache"))
	e, _ = Find(dir)
	if e.Venv != filepath.Join(dir, "cache", "switchyard-interop", "venv") || e.Model != filepath.Join(dir, ".interop", "model", "tiny-llama") {
		t.Fatalf("defaults: %+v", e)
	}
}
