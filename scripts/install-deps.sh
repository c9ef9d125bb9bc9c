#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine of this kind:
# libzmq peers for the discovery interop tests (Debian python3-zmq/msgpack,
# used through /usr/bin/python3), libzmq headers and pkg-config for the cgo
# discovery backend (go test -tags czmq), promtool for the metrics lint.
# Idempotent and quiet when everything is already present.
set -euo pipefail

need=()
/usr/bin/python3 -c 'import zmq, msgpack' >/dev/null 2>&1 || need+=(python3-zmq python3-msgpack)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
pkg-config --exists libzmq >/dev/null 2>&1 || need+=(libzmq3-dev)
command -v promtool >/dev/null 2>&1 || [ -x /usr/bin/promtool ] || need+=(prometheus)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-deps: need root to apt-get install ${need[*]}" >&2
    exit 1
  fi
  echo "install-deps: apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  dpkg --configure -a >/dev/null 2>&1 || true   # recover from an interrupted earlier install
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
/usr/bin/python3 -c 'import zmq, msgpack; print("install-deps: pyzmq", zmq.__version__, "libzmq", zmq.zmq_version())'
