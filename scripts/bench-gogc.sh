#!/usr/bin/env bash
# GOGC for a proxy, measured: one zero-latency vllm-sim, one switchyard
# (regular, round_robin) per GOGC value in front of it, and interleaved wrk
# runs (2 threads, 64 connections, 1-token /v1/completions) against each in
# turn. Prints req/s, latency P50, router CPU seconds per 1000 requests
# (utime+stime from /proc) and RSS per run. Needs bin/ (go build -o bin/
# ./cmd/...) and wrk (scripts/install-peers.sh).
# Usage: scripts/bench-gogc.sh [REPEATS] [SECONDS] [GOGC values...]
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${1:-3}; secs=${2:-5}; shift $(( $# > 2 ? 2 : $# )) || true
values=("$@"); [ ${#values[@]} -gt 0 ] || values=(100 200 off)
dir=$(mktemp -d); trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$dir"' EXIT
pids=()
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cat > "$dir/c.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"model":"sim-model","prompt":"hello","max_tokens":1}'
wrk.headers["Content-Type"] = "application/json"
LUA
sp=$(freeport)
bin/vllm-sim --role unified --profile-preset zero --port "$sp" > "$dir/sim.log" 2>&1 & pids+=($!)
declare -A port pid
for g in "${values[@]}"; do
  port[$g]=$(freeport)
  GOGC=$g bin/switchyard --host 127.0.0.1 --port "${port[$g]}" --prometheus-port "$(freeport)" \
    --worker-urls "http://127.0.0.1:$sp" --policy round_robin --log-level warn > "$dir/sy-$g.log" 2>&1 &
  pid[$g]=$!; pids+=($!)
done
for g in "${values[@]}"; do # ready: one completion through each router
  for _ in $(seq 100); do
    curl -sf -o /dev/null -XPOST "http://127.0.0.1:${port[$g]}/v1/completions" -H 'content-type: application/json' \
      -d '{"model":"sim-model","prompt":"hi","max_tokens":1}' && break
    sleep 0.1
  done
done
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
for rep in $(seq "$reps"); do
  for g in "${values[@]}"; do
    t0=$(ticks "${pid[$g]}")
    out=$(wrk -t2 -c64 -d"${secs}s" --latency -s "$dir/c.lua" "http://127.0.0.1:${port[$g]}/v1/completions")
    t1=$(ticks "${pid[$g]}")
    n=$(awk '/requests in/{print $1}' <<<"$out")
    awk -v rep="$rep" -v g="$g" -v t0="$t0" -v t1="$t1" -v n="$n" \
      -v rss="$(awk '/VmRSS/{print $2}' "/proc/${pid[$g]}/status")" \
      '/Requests\/sec/{rps=$2} $1=="50%"{p50=$2} END{printf "rep %s GOGC=%-4s req/s %8.0f  P50 %8s  CPU %.4f s/1k req  RSS %d MiB\n", rep, g, rps, p50, (t1-t0)/100*1000/n, rss/1024}' <<<"$out"
  done
done
