#!/usr/bin/env bash
# kv_aware in front of a fleet of fresh engines, router builds side by side.
# Every run starts 4 new unified vllm-sims (real prefix caches, KV events
# on, the tiny model's tokenizer.json: sybench scenario kv's workers) and a
# new kv_aware router from one build, and sends the scenario's shared-prefix
# workload (16 groups x 16 requests, conversations of 4 turns) at once, as
# traffic meets a router and engines that have just started: the engines
# have published nothing yet, so the first requests are routed by the
# fallback policy. Reports TTFT P50, req/s, and per worker the prompt
# tokens it computed (k) and its evictions: a group placed on a worker that
# already holds four evicts. Loopback only; 256 requests per run; every
# process started is stopped on exit.
#
#   scripts/bench-kv-fresh.sh RATE REPEATS LABEL=BIN_DIR ...
#   scripts/bench-kv-fresh.sh 200 6 old=/tmp/old new=bin
set -euo pipefail
rate=$1; reps=$2; shift 2
[ $# -gt 0 ] || { echo "usage: $0 RATE REPEATS LABEL=BIN_DIR ..." >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
tok=$root/internal/tokenizer/testdata/tiny-llama.json
dir=$(mktemp -d); pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT
. "$(dirname "$0")/lib/bench.sh"
first_bin=${1#*=}

# run LABEL BIN_DIR REP: one fresh fleet and router, one load.
run() {
  local label=$1 bin=$2 rep=$3 urls=() kv=() run_pids=() i sp ep rp
  for i in 1 2 3 4; do
    sp=$(freeport); ep=$(freeport); rp=$(freeport)
    "$first_bin/vllm-sim" --host 127.0.0.1 --port "$sp" --model m --log-level warn --role unified \
      --block-size 16 --num-blocks 1700 --max-model-len 27200 --enable-prompt-tokens-details --tokenizer "$tok" \
      --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$ep\",\"replay_endpoint\":\"tcp://*:$rp\"}" \
      > "$dir/sim$i.log" 2>&1 & pids+=($!); run_pids+=($!)
    urls+=("http://127.0.0.1:$sp"); kv+=("http://127.0.0.1:$sp=tcp://127.0.0.1:$ep,tcp://127.0.0.1:$rp")
  done
  local p; p=$(freeport)
  for u in "${urls[@]}"; do
    for _ in $(seq 1 100); do curl -sf -o /dev/null "$u/health" && break; sleep 0.1; done
  done
  "$bin/switchyard" --host 127.0.0.1 --port "$p" --log-level warn --policy kv_aware --tokenizer-path "$tok" \
    --kv-block-size 16 --worker-urls "${urls[@]}" --kv-events-endpoints "${kv[@]}" > "$dir/router.log" 2>&1 & pids+=($!); run_pids+=($!)
  for _ in $(seq 1 100); do curl -sf -o /dev/null "http://127.0.0.1:$p/health" && break; sleep 0.1; done
  local out
  out=$("$first_bin/sybench" --base-url "http://127.0.0.1:$p" --model m --backend vllm --dataset-name shared-prefix \
    --shared-prefix-groups 16 --shared-prefix-prompts-per-group 16 --shared-prefix-len 512 --random-input-len 64 \
    --random-range-ratio 0 --random-output-len 16 --shared-prefix-turns 4 --num-prompts 256 --num-warmups 0 \
    --request-rate "$rate" --max-concurrency 256 --max-duration 60s --ignore-eos --seed 2026 --disable-tqdm 2>&1)
  local per=""
  for u in "${urls[@]}"; do
    per+=$(curl -s "$u/sim/stats" | python3 -c 'import json,sys; e=json.load(sys.stdin)["engines"][0]; print("%d/%d" % (e["prefill_tokens"]//1000, e["prefix_cache"]["evictions"]), end=" ")')
  done
  awk -v r="$rep" -v l="$label" -v per="$per" '/Successful requests/{ok=$3} /Request throughput/{rps=$4} /Median TTFT/{t=$4}
    END { printf "rep=%s %s ok=%s req/s=%s ttft_p50_ms=%s k_tokens/evictions per worker: %s\n", r, l, ok, rps, t, per }' <<< "$out"
  kill "${run_pids[@]}" 2>/dev/null || true; wait "${run_pids[@]}" 2>/dev/null || true
}

echo "# $(date -u +%FT%TZ) load $(cut -d' ' -f1-3 /proc/loadavg); $rate req/s, $reps interleaved repetitions"
for r in $(seq 1 "$reps"); do
  for spec in "$@"; do run "${spec%%=*}" "${spec#*=}" "$r"; done
done
