#!/usr/bin/env bash
# Cold-start burst with and without the router's pair warm-up (--pd-warmup):
# for each MoRI-IO mode, a fresh simulated DeepSeek-R1 1P1D fleet (first-
# contact handshake 1 s) registers over ZMQ; 2 s after the router is ready,
# sybench sends one burst of 16 requests (input 1000, output 32, no client
# warm-ups). Prints a Markdown table of TTFT P50/P99. Bounded: each run
# stops by itself (sybench --max-duration 60s).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bin
go build -o bin/ ./cmd/...
out=$(mktemp -d)
pids=()
stop_fleet() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap 'stop_fleet; rm -rf "$out"' EXIT INT TERM

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "| Mode | --pd-warmup | Requests | Failed | TTFT P50 ms | TTFT P99 ms |"
echo "|---|---|---|---|---|---|"
for mode in WRITE READ; do
  for warm in true false; do
    port=$(free_port); mport=$(free_port); zport=$(free_port)
    ./bin/switchyard --host 127.0.0.1 --port "$port" --prometheus-port "$mport" \
      --vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address "127.0.0.1:$zport" \
      --policy consistent_hash --log-level warn --pd-warmup="$warm" >"$out/router.log" 2>&1 &
    pids+=($!)
    for role in prefill decode; do
      ./bin/vllm-sim --role "$role" --kv-connector moriio --transfer-mode "$mode" --port 0 \
        --proxy-address "127.0.0.1:$zport" --profile-preset deepseek-r1-1p1d >/dev/null 2>"$out/sim-$role.log" &
      pids+=($!)
    done
    for _ in $(seq 1 100); do
      curl -fsS "http://127.0.0.1:$port/readiness" >/dev/null 2>&1 && break
      sleep 0.1
    done
    sleep 2
    ./bin/sybench --base-url "http://127.0.0.1:$port" --endpoint /v1/completions --model sim-model \
      --dataset-name random --random-input-len 1000 --random-output-len 32 --num-prompts 16 \
      --max-concurrency 16 --num-warmups 0 --ignore-eos --seed 1234 --disable-tqdm --max-duration 60s \
      --save-result --result-dir "$out" --result-filename r.json >"$out/bench.txt" 2>&1 || true
    /usr/bin/python3 - "$out/r.json" "$mode" "$warm" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {sys.argv[3]} | {r['completed'] + r.get('failed', 0)} | {r.get('failed', 0)} | "
      f"{r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} |")
PY
    stop_fleet
  done
done
