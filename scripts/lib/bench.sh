# Shared by the scripts/bench-*-ab.sh benchmarks (source it; bash only).
# They run loopback fleets of zero-latency vllm-sims and routers, and stop
# every process they started on exit: the caller sets dir (a temporary
# directory) and pids (an array) and traps EXIT to kill "${pids[@]}".

# freeport prints a free loopback TCP port.
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_fleet MODE SIM_BIN_DIR starts the workers of MODE (regular: one
# unified vllm-sim; pd: a NIXL prefill and decode; moriio: a MoRI-IO WRITE
# prefill and decode that register with the router over ZMQ, so one router
# per fleet) and sets fleet to the router flags that name them.
start_fleet() {
  local mode=$1 bin=$2
  case $mode in
  regular)
    local sp; sp=$(freeport)
    "$bin/vllm-sim" --role unified --profile-preset zero --port "$sp" > "$dir/sim.log" 2>&1 & pids+=($!)
    fleet=(--worker-urls "http://127.0.0.1:$sp") ;;
  pd)
    local pp dp; pp=$(freeport); dp=$(freeport)
    "$bin/vllm-sim" --role prefill --kv-connector nixl --profile-preset zero --port "$pp" > "$dir/p.log" 2>&1 & pids+=($!)
    "$bin/vllm-sim" --role decode --kv-connector nixl --profile-preset zero --port "$dp" > "$dir/d.log" 2>&1 & pids+=($!)
    fleet=(--vllm-pd-disaggregation --kv-connector nixl --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp") ;;
  moriio)
    local zp role; zp=$(freeport)
    for role in prefill decode; do
      "$bin/vllm-sim" --role "$role" --kv-connector moriio --transfer-mode WRITE --proxy-address "127.0.0.1:$zp" \
        --heartbeat-interval 1s --profile-preset zero --port 0 > "$dir/$role.log" 2>&1 & pids+=($!)
    done
    fleet=(--vllm-pd-disaggregation --kv-connector moriio --vllm-discovery-address "127.0.0.1:$zp") ;;
  *) echo "mode must be regular, pd or moriio" >&2; return 2 ;;
  esac
}

# wait_completion URL [TRIES]: until one 1-token completion through URL
# succeeds (TRIES × 0.2 s, default 100); fails when it never does.
wait_completion() {
  local u=$1 tries=${2:-100}
  for _ in $(seq 1 "$tries"); do
    if curl -sf -o /dev/null -H 'Content-Type: application/json' -d '{"model":"sim-model","prompt":"hi","max_tokens":1}' "$u/v1/completions"; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}

# write_completion_lua FILE writes wrk's script: POST a 1-token completion,
# or the request body in $WRK_BODY (e.g. a stream:
# WRK_BODY='{"model":"sim-model","prompt":"hello","max_tokens":64,"stream":true}').
write_completion_lua() {
  local body=${WRK_BODY:-'{"model":"sim-model","prompt":"hello","max_tokens":1}'}
  printf 'wrk.method = "POST"\nwrk.body = [[%s]]\nwrk.headers["Content-Type"] = "application/json"\n' "$body" > "$1"
}
