#!/usr/bin/env bash
# Installs the routers that `sybench scenario compare` (make bench-compare)
# measures Switchyard against, pinned, into .venv-peers/ (git-ignored) and
# from Debian:
#   - vllm-router 0.1.17 and sglang-router 0.3.2 from PyPI (their Rust
#     binaries ship inside the wheels);
#   - nginx (plain reverse proxy) and wrk (HTTP load generator) from Debian;
#   - vLLM's source distribution (PyPI sdist, unpacked under .venv-peers/src)
#     for its disaggregated-serving toy proxies, run from where it unpacks
#     (never copied into this repository), plus the Python packages they
#     import (quart, aiohttp, msgpack, pyzmq).
# Idempotent: every step is skipped when its result is already there; a
# second run only checks and prints the versions (a few seconds).
# Override the Python with PYTHON=..., the folder with PEERS_DIR=....
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
dir=${PEERS_DIR:-$root/.venv-peers}
py=${PYTHON:-python3}
VLLM_ROUTER=0.1.17
SGLANG_ROUTER=0.3.2
VLLM_SDIST=0.33.0

log() { echo "install-peers: $*"; }

# Debian: nginx (light flavour when it exists) and wrk.
need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "need root to apt-get install ${need[*]}" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
    # Debian releases without nginx-light ship the same binary as "nginx".
    need=("${need[@]/nginx-light/nginx}")
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
  # The package's own service is not wanted: the benchmark starts nginx
  # with its own configuration on a free port.
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now nginx >/dev/null 2>&1 || true; fi
  if [ -f /run/nginx.pid ]; then kill "$(cat /run/nginx.pid)" 2>/dev/null || true; fi
fi

# PyPI: the two Rust routers, in their own virtual environment.
if [ ! -x "$dir/bin/python" ]; then
  log "creating $dir"
  "$py" -m venv "$dir"
fi
pip=("$dir/bin/python" -m pip -q --disable-pip-version-check)
have() { "$dir/bin/python" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
[ "$(have vllm-router)" = "$VLLM_ROUTER" ] || "${pip[@]}" install "vllm-router==$VLLM_ROUTER"
[ "$(have sglang-router)" = "$SGLANG_ROUTER" ] || "${pip[@]}" install "sglang-router==$SGLANG_ROUTER"
# The toy proxies' imports.
"$dir/bin/python" -c 'import quart, aiohttp, msgpack, zmq, httpx, fastapi, uvicorn' >/dev/null 2>&1 ||
  "${pip[@]}" install quart aiohttp msgpack pyzmq httpx fastapi uvicorn

# vLLM's sdist (examples/ and tests/ hold the toy proxies; the wheels ship
# neither). Building its metadata needs torch, so pip download stops after
# unpacking it; --no-clean keeps the unpacked tree, which is moved under
# $src. Nothing in it is built or installed.
src="$dir/src"
if [ ! -d "$src/vllm-$VLLM_SDIST/tests" ]; then
  mkdir -p "$src" "$dir/tmp"
  rm -rf "$dir/tmp"/pip-*
  TMPDIR="$dir/tmp" "${pip[@]}" download --no-clean --no-binary :all: --no-deps --no-build-isolation \
    -d "$src" "vllm==$VLLM_SDIST" >/dev/null 2>&1 || true
  tree=$(find "$dir/tmp" -maxdepth 3 -name setup.py -path '*vllm*' -printf '%h\n' 2>/dev/null | head -1)
  if [ -n "$tree" ] && [ -d "$tree/tests" ]; then
    rm -rf "$src/vllm-$VLLM_SDIST" && mv "$tree" "$src/vllm-$VLLM_SDIST"
  else
    log "vllm==$VLLM_SDIST sdist could not be unpacked: toy proxies unavailable"
  fi
  rm -rf "$dir/tmp"
fi

log "vllm-router $(have vllm-router) ($(command -v "$dir/bin/vllm-router" || echo "no binary"))"
log "sglang-router $(have sglang-router)"
log "nginx $(nginx -v 2>&1 | sed 's/.*\///'), $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2)"
find "$src" \( -name toy_proxy_server.py -o -name moriio_toy_proxy_server.py -o -name disagg_proxy_p2p_nccl_xpyd.py \) 2>/dev/null | sed "s|^$root/||; s|^|install-peers: toy proxy |" || true
