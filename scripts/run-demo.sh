#!/usr/bin/env bash
# Starts Switchyard in front of a simulated 1P1D MoRI-IO WRITE fleet that
# registers itself over ZMQ, waits until the router is ready, sends one
# streaming request, then keeps serving until Ctrl-C (or DEMO_SECONDS).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-30000}
METRICS_PORT=${METRICS_PORT:-29000}
ZMQ_PORT=${ZMQ_PORT:-36367}
MODE=${TRANSFER_MODE:-WRITE}
PRESET=${PRESET:-default}
mkdir -p bin logs
[ -x bin/switchyard ] && [ -x bin/vllm-sim ] || go build -o bin/ ./cmd/...

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

./bin/switchyard --host 127.0.0.1 --port "$PORT" --prometheus-port "$METRICS_PORT" \
  --vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address "127.0.0.1:$ZMQ_PORT" \
  --policy consistent_hash --route-receipt >logs/switchyard.log 2>&1 &
pids+=($!)
for role in prefill decode; do
  ./bin/vllm-sim --role "$role" --kv-connector moriio --transfer-mode "$MODE" --port 0 \
    --proxy-address "127.0.0.1:$ZMQ_PORT" --profile-preset "$PRESET" >"logs/sim-$role.out" 2>"logs/sim-$role.log" &
  pids+=($!)
done

echo "waiting for the fleet to register..."
for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$PORT/readiness" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$PORT/readiness"; echo
echo "--- one streaming request through the PD router:"
curl -sS -N "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model":"sim-model","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":8,"stream":true}'
echo
cat <<MSG
Switchyard is serving on http://127.0.0.1:$PORT (metrics on :$METRICS_PORT/metrics, workers on /workers).
Try: curl -sN http://127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model":"sim-model","messages":[{"role":"user","content":"hello"}],"max_tokens":16,"stream":true}'
Logs in ./logs. Ctrl-C stops the router and the fleet.
MSG
if [ -n "${DEMO_SECONDS:-}" ]; then sleep "$DEMO_SECONDS"; else wait "${pids[0]}"; fi
