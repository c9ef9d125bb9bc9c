#!/usr/bin/env bash
# Regular mode side by side with wrk: one zero-latency vllm-sim, nginx (one
# worker process, keep-alive upstream: the config of `sybench scenario
# compare`) and one switchyard per LABEL=BIN_DIR[:ENV=VALUE...] (e.g. an old
# and a new build, or one build with GOGC=200) in front of it, then
# interleaved wrk runs (2 threads, CONNS connections, 1-token
# /v1/completions) against direct, nginx, the floor proxies (the least a
# Go proxy can do: `sybench floor-proxy`, a goroutine per connection and an
# epoll loop, when the first BIN_DIR's sybench has it) and each router in
# turn. Prints req/s, latency P50/P99, non-2xx and the proxy's CPU per
# request (utime+stime from /proc, nginx's worker included) per run. Needs
# wrk and nginx (scripts/install-peers.sh) and vllm-sim in the first
# BIN_DIR.
# Usage: scripts/bench-wrk-ab.sh SECONDS REPEATS CONNS LABEL=BIN_DIR[:ENV=V...] ...
set -euo pipefail
secs=$1; reps=$2; conns=$3; shift 3
[ $# -gt 0 ] || { echo "usage: $0 SECONDS REPEATS CONNS LABEL=BIN_DIR[:ENV=V...] ..." >&2; exit 2; }
dir=$(mktemp -d); pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
. "$(dirname "$0")/lib/bench.sh"
first=${1#*=}; first=${first%%:*}
sp=$(freeport); np=$(freeport)
"$first/vllm-sim" --role unified --profile-preset zero --port "$sp" > "$dir/sim.log" 2>&1 & pids+=($!)
mkdir -p "$dir/ngx/tmp"
cat > "$dir/ngx/nginx.conf" <<NGX
worker_processes 1; daemon off; master_process on; pid $dir/ngx/nginx.pid; error_log $dir/ngx/error.log warn;
events { worker_connections 16384; }
http { access_log off; client_body_temp_path $dir/ngx/tmp/b; proxy_temp_path $dir/ngx/tmp/p;
  fastcgi_temp_path $dir/ngx/tmp/f; uwsgi_temp_path $dir/ngx/tmp/u; scgi_temp_path $dir/ngx/tmp/s;
  upstream worker { server 127.0.0.1:$sp; keepalive 1024; }
  server { listen 127.0.0.1:$np backlog=4096; location / { proxy_pass http://worker; proxy_http_version 1.1;
    proxy_set_header Connection ""; proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 600s; } } }
NGX
nginx -p "$dir/ngx" -c "$dir/ngx/nginx.conf" -e "$dir/ngx/error.log" & pids+=($!)
targets=("direct=http://127.0.0.1:$sp" "nginx=http://127.0.0.1:$np")
declare -A tpid=([nginx]=$!)
if "$first/sybench" floor-proxy --help > /dev/null 2>&1; then
  for m in goroutine loop; do
    fp=$(freeport)
    "$first/sybench" floor-proxy --mode "$m" --listen "127.0.0.1:$fp" --upstream "127.0.0.1:$sp" > "$dir/floor-$m.log" 2>&1 & pids+=($!)
    targets+=("floor-$m=http://127.0.0.1:$fp"); tpid[floor-$m]=$!
  done
fi
for spec in "$@"; do
  label=${spec%%=*}; rest=${spec#*=}; bin=${rest%%:*}; envs=()
  [[ $rest == *:* ]] && IFS=: read -r -a envs <<< "${rest#*:}"
  p=$(freeport)
  env "${envs[@]}" "$bin/switchyard" --host 127.0.0.1 --port "$p" --prometheus-host 127.0.0.1 --prometheus-port "$(freeport)" \
    --log-level warn --worker-urls "http://127.0.0.1:$sp" --policy round_robin > "$dir/sy-$label.log" 2>&1 & pids+=($!)
  targets+=("$label=http://127.0.0.1:$p"); tpid[$label]=$!
done
# cpu PID: the process's and its children's CPU ticks (nginx's worker).
cpu() { local t=0 c; for c in "$1" $(pgrep -P "$1" || true); do t=$((t + $(awk '{print $14+$15}' "/proc/$c/stat"))); done; echo "$t"; }
hz=$(getconf CLK_TCK)
write_completion_lua "$dir/c.lua"
for t in "${targets[@]}"; do # ready: one completion through each target
  wait_completion "${t#*=}" || { echo "${t%%=*} never answered" >&2; exit 1; }
done
echo "# $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg); wrk -t2 -c$conns -d${secs}s, $reps interleaved repetitions"
for r in $(seq 1 "$reps"); do
  for t in "${targets[@]}"; do
    name=${t%%=*}; pid=${tpid[$name]:-}; c0=0
    [ -n "$pid" ] && c0=$(cpu "$pid")
    out=$(wrk -t2 -c"$conns" -d"${secs}s" --latency --timeout 10s -s "$dir/c.lua" "${t#*=}/v1/completions" 2>&1)
    rps=$(awk '/Requests\/sec/{print $2}' <<< "$out"); p50=$(awk '$1=="50%"{print $2}' <<< "$out")
    p99=$(awk '$1=="99%"{print $2}' <<< "$out"); non2xx=$(awk '/Non-2xx/{print $4}' <<< "$out")
    n=$(awk '/requests in/{print $1}' <<< "$out"); us=-
    [ -n "$pid" ] && us=$(awk -v c="$(( $(cpu "$pid") - c0 ))" -v hz="$hz" -v n="$n" 'BEGIN { printf "%.1f", c * 1e6 / hz / n }')
    echo "rep=$r $name req/s=$rps p50=$p50 p99=$p99 non2xx=${non2xx:-0} cpu_us/req=$us"
  done
done
