#!/usr/bin/env bash
# Router CPU per 1000 streamed requests, one router build (or vllm-router)
# at a time in front of zero-latency vllm-sim workers: regular mode (one
# unified worker), PD NIXL (static --prefill/--decode) or PD MoRI-IO WRITE
# (moriio: the pair registers over ZMQ). The load is sybench's random
# dataset (input 1000, output 100 tokens, --ignore-eos), an unmeasured
# warm-up of 200 requests, then N measured requests; CPU is utime+stime of
# the router's process from /proc around the measured run. The load is a
# closed loop of CONCURRENCY clients, or with RATE=R set an open loop:
# Poisson arrivals at R requests per second (--request-rate), at most
# CONCURRENCY in flight, so that routers of different speed see the same
# offered load (a closed loop gives the slower router a shallower queue).
# Prints router CPU, req/s, TTFT and E2E P50/P99 and failures.
# Run it for each build in turn, interleaved, and compare within one run.
#
#   scripts/bench-cpu-ab.sh regular|pd|moriio BIN_DIR ROUTER_EXE CONCURRENCY [N] [-- ROUTER_FLAGS...]
#   scripts/bench-cpu-ab.sh regular bin bin/switchyard 64
#   scripts/bench-cpu-ab.sh regular bin bin/switchyard 64 2000 -- --max-migrations 0
#   scripts/bench-cpu-ab.sh pd bin .venv-peers/bin/vllm-router 16
#   RATE=1500 scripts/bench-cpu-ab.sh moriio bin .venv-peers/bin/vllm-router 1024 8000
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
rate=()
[ -n "${RATE:-}" ] && rate=(--request-rate "$RATE")
load() { "$bin/sybench" --backend vllm --base-url "http://127.0.0.1:$rp" --model sim-model --dataset-name random --random-input-len 1000 \
  --random-output-len 100 --max-concurrency "$c" "${rate[@]}" --num-prompts "$1" --ignore-eos --disable-tqdm --seed 1 \
  --percentile-metrics ttft,e2el --metric-percentiles 50,99 > "$dir/bench.log" 2>&1; }
ticks() { awk '{print $14+$15}' "/proc/$rpid/stat"; }
failed() { echo "sybench failed; its output and the router's log:" >&2; for f in "$dir/bench.log" "$dir/router.log"; do tail -n 15 "$f" >&2; done; exit 1; }
load 200 || failed
t0=$(ticks); load "$n" || failed; t1=$(ticks)
python3 - "$t0" "$t1" "$(getconf CLK_TCK)" "$n" "$dir/bench.log" "$mode" "$c${RATE:+ rate=$RATE/s}" "$exe" <<'PY'
import re, sys
t0, t1, hz, n, log, mode, c, exe = sys.argv[1:]
text = open(log).read()
def grab(name):
    m = re.search(name + r"[^:]*:\s*([0-9.]+)", text)
    return m.group(1) if m else "?"
cpu = (int(t1) - int(t0)) / int(hz) / int(n) * 1000
print(f"{mode} C={c} {exe}: router CPU {cpu:.3f} s/1k req, {grab('Request throughput')} req/s, "
      f"TTFT P50/P99 {grab('Median TTFT')}/{grab('P99 TTFT')} ms, E2E P50/P99 {grab('Median E2EL')}/{grab('P99 E2EL')} ms, "
      f"failed {grab('Failed requests')}")
PY
