// Package interopenv finds the real-engine tier's environment: the virtual
// environment scripts/install-interop.sh builds (vLLM on CPU, NIXL, the
// peers' Python packages) and the tiny local model it makes. The test tier
// (test/interop) and the benchmark scenarios share it.
package interopenv

import (
	"fmt"
	"os"
	"path/filepath"
)

// Env is where the tier's pieces are.
type Env struct {
	Venv  string // INTEROP_VENV, else $XDG_CACHE_HOME (or ~/.cache)/switchyard-interop/venv
	Model string // INTEROP_MODEL, else <repo>/.interop/model/tiny-llama; absolute
}

// Find locates the environment; repoRoot is the repository's root (the
// default model lives under it). Missing says why it cannot be used ("" =
// both pieces are present).
func Find(repoRoot string) (e Env, missing string) {
	e.Venv = os.Getenv("INTEROP_VENV")
	if e.Venv == "" {
		cache := os.Getenv("XDG_CACHE_HOME")
		if cache == "" {
			home, _ := os.UserHomeDir()
			cache = filepath.Join(home, ".cache")
		}
		e.Venv = filepath.Join(cache, "switchyard-interop", "venv")
	}
	e.Model = os.Getenv("INTEROP_MODEL")
	if e.Model == "" {
		e.Model = filepath.Join(repoRoot, ".interop", "model", "tiny-llama")
	}
	if a, err := filepath.Abs(e.Model); err == nil {
		e.Model = a
	}
	if _, err := os.Stat(filepath.Join(e.Venv, "bin", "vllm")); err != nil {
		return e, fmt.Sprintf("no vLLM environment at %s (run scripts/install-interop.sh)", e.Venv)
	}
	if _, err := os.Stat(filepath.Join(e.Model, "config.json")); err != nil {
		return e, fmt.Sprintf("no tiny model at %s (run scripts/install-interop.sh)", e.Model)
	}
	return e, ""
}
