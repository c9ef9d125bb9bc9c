#!/usr/bin/env bash
# Per-request cost of router builds side by side under wrk: requests per
# second, router CPU (utime+stime from /proc) per request, and the Go
# runtime's exact allocation counts per request (go_memstats_mallocs_total
# and go_memstats_alloc_bytes_total from the router's /metrics, read around
# each run: counted, not sampled) and garbage collections per 1,000
# requests (go_gc_duration_seconds_count), and the router's RSS after each run. One zero-latency vllm-sim (regular) or a
# NIXL prefill and decode pair (pd), one router per build in front of it,
# interleaved wrk runs (2 threads, CONNS connections, 1-token
# /v1/completions). Needs wrk (scripts/install-peers.sh) and vllm-sim in
# the first BIN_DIR. Loopback only; every process started is stopped on exit.
#
#   scripts/bench-alloc-ab.sh regular|pd SECONDS REPEATS CONNS LABEL=BIN_DIR[:ENV=V...] ...
#   scripts/bench-alloc-ab.sh regular 5 5 64 old=/tmp/old new=bin
#   scripts/bench-alloc-ab.sh regular 5 5 64 gogc100=bin:GOGC=100 floor=bin
#   WRK_BODY='{"model":"sim-model","prompt":"hello","max_tokens":64,"stream":true}' scripts/bench-alloc-ab.sh pd 5 5 64 old=/tmp/old new=bin
set -euo pipefail
mode=$1; secs=$2; reps=$3; conns=$4; shift 4
[ $# -gt 0 ] || { echo "usage: $0 regular|pd SECONDS REPEATS CONNS LABEL=BIN_DIR[:ENV=V...] ..." >&2; exit 2; }
case $mode in regular | pd) ;; *) echo "mode must be regular or pd: the routers share one fleet" >&2; exit 2 ;; esac
dir=$(mktemp -d); pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
. "$(dirname "$0")/lib/bench.sh"
first=${1#*=}; start_fleet "$mode" "${first%%:*}"
labels=(); ports=(); mports=(); rpids=()
for spec in "$@"; do
  label=${spec%%=*}; rest=${spec#*=}; bin=${rest%%:*}; envs=(); p=$(freeport); mp=$(freeport)
  [[ $rest == *:* ]] && IFS=: read -r -a envs <<< "${rest#*:}"
  env "${envs[@]}" "$bin/switchyard" --host 127.0.0.1 --port "$p" --prometheus-host 127.0.0.1 --prometheus-port "$mp" \
    --log-level warn --policy round_robin "${fleet[@]}" > "$dir/sy-$label.log" 2>&1 & pids+=($!)
  labels+=("$label"); ports+=("$p"); mports+=("$mp"); rpids+=($!)
done
write_completion_lua "$dir/c.lua"
for p in "${ports[@]}"; do # ready: one completion through each router
  wait_completion "http://127.0.0.1:$p" || { echo "router on port $p never answered" >&2; exit 1; }
done
cpu() { awk '{print $14+$15}' "/proc/$1/stat"; }
metric() { curl -s "http://127.0.0.1:$1/metrics" | awk -v k="$2" '$1==k{printf "%.0f", $2}'; }
hz=$(getconf CLK_TCK)
echo "# $(date -u +%FT%TZ) $mode, load $(cut -d' ' -f1-3 /proc/loadavg); wrk -t2 -c$conns -d${secs}s, $reps interleaved repetitions"
for r in $(seq 1 "$reps"); do
  for i in "${!labels[@]}"; do
    pid=${rpids[$i]}; mp=${mports[$i]}
    c0=$(cpu "$pid"); m0=$(metric "$mp" go_memstats_mallocs_total); b0=$(metric "$mp" go_memstats_alloc_bytes_total)
    g0=$(metric "$mp" go_gc_duration_seconds_count)
    out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency --timeout 10s -s "$dir/c.lua" "http://127.0.0.1:${ports[$i]}/v1/completions" 2>&1)
    c1=$(cpu "$pid"); m1=$(metric "$mp" go_memstats_mallocs_total); b1=$(metric "$mp" go_memstats_alloc_bytes_total)
    g1=$(metric "$mp" go_gc_duration_seconds_count); rss=$(awk '/^VmRSS/{print $2}' "/proc/$pid/status")
    n=$(awk '/requests in/{print $1}' <<< "$out"); rps=$(awk '/Requests\/sec/{print $2}' <<< "$out")
    non2xx=$(awk '/Non-2xx/{print $4}' <<< "$out")
    awk -v r="$r" -v l="${labels[$i]}" -v rps="$rps" -v n="$n" -v c="$((c1 - c0))" -v hz="$hz" -v m="$((m1 - m0))" -v b="$((b1 - b0))" -v e="${non2xx:-0}" -v g="$((g1 - g0))" -v rss="$rss" \
      'BEGIN { printf "rep=%s %s req/s=%s cpu_us/req=%.1f mallocs/req=%.1f bytes/req=%.0f gc/1k=%.2f rss_mib=%.0f non2xx=%s\n", r, l, rps, c * 1e6 / hz / n, m / n, b / n, g * 1000 / n, rss / 1024, e }'
  done
done
