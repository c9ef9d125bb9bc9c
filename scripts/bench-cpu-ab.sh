#!/usr/bin/env bash
# Router CPU per 1000 streamed requests, one router build (or vllm-router)
# at a time in front of zero-latency vllm-sim workers: regular mode (one
# unified worker) or PD NIXL (static --prefill/--decode). The load is
# sybench's random dataset (input 1000, output 100 tokens, --ignore-eos),
# an unmeasured warm-up of 200 requests, then N measured requests; CPU is
# utime+stime of the router's process from /proc around the measured run.
# Run it for each build in turn, interleaved, and compare within one run.
#
#   scripts/bench-cpu-ab.sh regular|pd BIN_DIR ROUTER_EXE CONCURRENCY [N] [-- ROUTER_FLAGS...]
#   scripts/bench-cpu-ab.sh regular bin bin/switchyard 64
#   scripts/bench-cpu-ab.sh regular bin bin/switchyard 64 2000 -- --max-migrations 0
#   scripts/bench-cpu-ab.sh pd bin .venv-peers/bin/vllm-router 16
#
# BIN_DIR holds vllm-sim and sybench. Ports are loopback; every process
# started is stopped on exit.
set -euo pipefail
mode=$1; bin=$2; exe=$3; c=$4; n=${5:-2000}
shift $(( $# >= 5 ? 5 : 4 ))
[ "${1:-}" = "--" ] && shift
. "$(dirname "$0")/lib/bench.sh"
dir=$(mktemp -d); pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
rp=$(freeport); mp=$(freeport)
start_fleet "$mode" "$bin" || exit 2
"$exe" --host 127.0.0.1 --port "$rp" --prometheus-host 127.0.0.1 --prometheus-port "$mp" --log-level warning \
  --policy round_robin "${fleet[@]}" "$@" > "$dir/router.log" 2>&1 & rpid=$!; pids+=($rpid)
wait_completion "http://127.0.0.1:$rp" 150 || { echo "router never answered; log:" >&2; tail -20 "$dir/router.log" >&2; exit 1; }
load() { "$bin/sybench" --backend vllm --base-url "http://127.0.0.1:$rp" --dataset-name random --random-input-len 1000 \
  --random-output-len 100 --max-concurrency "$c" --num-prompts "$1" --ignore-eos --disable-tqdm --seed 1 > "$dir/bench.log" 2>&1; }
ticks() { awk '{print $14+$15}' "/proc/$rpid/stat"; }
load 200
t0=$(ticks); load "$n"; t1=$(ticks)
python3 - "$t0" "$t1" "$(getconf CLK_TCK)" "$n" "$dir/bench.log" "$mode" "$c" "$exe" <<'PY'
import re, sys
t0, t1, hz, n, log, mode, c, exe = sys.argv[1:]
text = open(log).read()
def grab(name):
    m = re.search(name + r"[^:]*:\s*([0-9.]+)", text)
    return m.group(1) if m else "?"
cpu = (int(t1) - int(t0)) / int(hz) / int(n) * 1000
print(f"{mode} C={c} {exe}: router CPU {cpu:.3f} s/1k req, {grab('Request throughput')} req/s, "
      f"TTFT P50 {grab('Median TTFT')} ms, failed {grab('Failed requests')}")
PY
