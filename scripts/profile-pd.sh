#!/usr/bin/env bash
# Profiles switchyard and vllm-router side by side in PD NIXL mode (static
# --prefill/--decode, vllm-sim --profile-preset zero, the compare
# scenario's setup) at high concurrency: the same load through each router
# in turn, interleaved, and around every measured run
#   - perf stat on the router's process group: task-clock, context
#     switches, CPU migrations, every syscall and the common ones by name;
#   - the router's user and system CPU (/proc), its threads and (switchyard,
#     through --enable-pprof) goroutines sampled mid-run, its TCP
#     connections to the workers at the end;
#   - the two workers' CPU, and sybench's req/s, TTFT and TPOT.
# Then one perf record per router at the largest C (where the CPU goes, by
# shared object and by symbol).
# Writes a summary table (one line per router and C, medians and min-max
# of the repetitions) to stdout and raw files to $OUT_DIR.
#
#   scripts/profile-pd.sh                     # C=256 and 1024, 3 repetitions
#   C_LIST="256" REPS=1 scripts/profile-pd.sh
#
# Needs: bin/ (go build -o bin/ ./cmd/...), .venv-peers (scripts/install-peers.sh),
# perf (linux-perf) with access to tracepoints (root or perf_event_paranoid <= 1), python3.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${BIN_DIR:-$root/bin}
peers=${PEERS_DIR:-$root/.venv-peers}
C_LIST=${C_LIST:-"256 1024"}
REPS=${REPS:-3}
INPUT=${INPUT:-1000}
OUTPUT=${OUTPUT:-100}
PROMPTS_PER_C=${PROMPTS_PER_C:-8}
out=${OUT_DIR:-$(mktemp -d /tmp/profile-pd.XXXXXX)}
mkdir -p "$out"
log() { echo "profile-pd: $*" >&2; }

for need in perf python3 curl; do
  command -v "$need" >/dev/null || { log "missing $need"; exit 1; }
done
[ -x "$bin/switchyard" ] && [ -x "$bin/vllm-sim" ] && [ -x "$bin/sybench" ] || { log "build first: go build -o bin/ ./cmd/..."; exit 1; }
[ -x "$peers/bin/vllm-router" ] || { log "no $peers/bin/vllm-router (run scripts/install-peers.sh)"; exit 1; }

pids=()
cleanup() {
  [ ${#pids[@]} -gt 0 ] || return 0
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 1
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT

freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# start NAME CMD...: runs CMD in its own session (its pid, in $started, is
# its process group) and remembers it for cleanup (not in a subshell).
start() {
  local name=$1; shift
  setsid "$@" >"$out/$name.log" 2>&1 &
  started=$!
  pids+=("$started")
}
wait_ok() { # URL [BODY]: until it answers 200, at most 60 s
  local i
  for i in $(seq 1 240); do
    if [ -n "${2:-}" ]; then
      curl -fsS -m 5 -o /dev/null -H 'Content-Type: application/json' -d "$2" "$1" 2>/dev/null && return 0
    else
      curl -fsS -m 2 -o /dev/null "$1" 2>/dev/null && return 0
    fi
    sleep 0.25
  done
  log "$1 not ready within 60 s"; return 1
}
group_pids() { ps -o pid= -g "$1" | tr -s ' \n' ',' | sed 's/^,//; s/,$//'; }
# cpu PID...: utime and stime of the processes (all threads), in clock ticks.
cpu() { for p in "$@"; do awk '{print $14, $15}' "/proc/$p/stat" 2>/dev/null || true; done | awk '{u+=$1; s+=$2} END {print u+0, s+0}'; }

pp=$(freeport); dp=$(freeport)
start prefill "$bin/vllm-sim" --host 127.0.0.1 --port "$pp" --model sim-model --log-level warn --role prefill --kv-connector nixl --profile-preset zero
prefill=$started
start decode "$bin/vllm-sim" --host 127.0.0.1 --port "$dp" --model sim-model --log-level warn --role decode --kv-connector nixl --profile-preset zero
decode=$started
wait_ok "http://127.0.0.1:$pp/health"; wait_ok "http://127.0.0.1:$dp/health"

declare -A rpid rport rmport
body='{"model":"sim-model","prompt":"hello","max_tokens":1}'
for r in switchyard vllm-router; do
  port=$(freeport); mport=$(freeport)
  exe=$bin/switchyard; extra=(--enable-pprof)
  if [ "$r" = vllm-router ]; then exe=$peers/bin/vllm-router; extra=(); fi
  # The compare scenario's command line (the same for both), switchyard
  # with --enable-pprof for its goroutine count.
  args=(--host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$mport" --log-level warning
    --policy round_robin --vllm-pd-disaggregation --kv-connector nixl
    --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" "${extra[@]}")
  echo "$exe ${args[*]}" >>"$out/commands.txt"
  start "$r" "$exe" "${args[@]}"
  rpid[$r]=$started
  rport[$r]=$port; rmport[$r]=$mport
  wait_ok "http://127.0.0.1:$port/v1/completions" "$body"
done

hz=$(getconf CLK_TCK)
events=task-clock,context-switches,cpu-migrations,raw_syscalls:sys_enter
for s in read write readv writev recvfrom sendto recvmsg sendmsg epoll_wait epoll_pwait epoll_ctl futex connect accept4 close sched_yield nanosleep clock_nanosleep madvise mmap munmap; do
  events+=,syscalls:sys_enter_$s
done

# sample PID OUTFILE: max threads (and switchyard goroutines) every 0.5 s until killed.
sample() {
  local pid=$1 f=$2 mport=$3 maxt=0 maxg=0 t g
  set +e
  while kill -0 "$pid" 2>/dev/null; do
    t=$(ps -o nlwp= -g "$pid" | awk '{s+=$1} END {print s+0}')
    [ "$t" -gt "$maxt" ] && maxt=$t
    if [ "$mport" != 0 ]; then
      g=$(curl -fsS -m 2 "http://127.0.0.1:$mport/debug/pprof/goroutine?debug=1" 2>/dev/null | head -1 | awk '{print $NF}')
      [ -n "$g" ] && [ "$g" -gt "$maxg" ] && maxg=$g
    fi
    echo "$maxt $maxg" >"$f"
    sleep 0.5
  done
}

run_load() { # ROUTER C N RESULTFILE [TIMEFILE: sybench's user and system CPU]
  local timer=()
  [ -n "${5:-}" ] && timer=(/usr/bin/time -f '%U %S' -o "$5")
  "${timer[@]}" "$bin/sybench" --backend vllm --base-url "http://127.0.0.1:${rport[$1]}" --model sim-model --dataset-name random \
    --random-input-len "$INPUT" --random-output-len "$OUTPUT" --ignore-eos --max-concurrency "$2" --num-prompts "$3" \
    --num-warmups 0 --seed 1234 --metric-percentiles 50,99 --percentile-metrics ttft,tpot,itl,e2el --save-result --result-dir "$out" --result-filename "$4" \
    >"$out/$4.txt" 2>&1
}

echo "router c rep completed reqps ttft_p50 ttft_p99 tpot_p50 e2el_p50 e2el_p99 router_user_s_1k router_sys_s_1k workers_cpu_s_1k sybench_cpu_s_1k ctxsw_per_req syscalls_per_req reads_per_req eagain_reads_per_req writes_per_req epoll_per_req futex_per_req connects threads goroutines upstream_conns" >"$out/rows.txt"
for c in $C_LIST; do
  n=$((c * PROMPTS_PER_C))
  for rep in $(seq 1 "$REPS"); do
    for r in switchyard vllm-router; do
      pg=${rpid[$r]}
      run_load "$r" "$c" "$c" "warm-$r-$c-$rep.json" # warm-up, unmeasured
      gp=$(group_pids "$pg")
      read -r u0 s0 < <(cpu ${gp//,/ })
      read -r wu0 ws0 < <(cpu "$prefill" "$decode")
      mp=0; [ "$r" = switchyard ] && mp=${rmport[$r]}
      sample "$pg" "$out/sample-$r-$c-$rep" "$mp" &
      spid=$!
      perf stat -x, -o "$out/perf-$r-$c-$rep.csv" -e "$events" \
        -e syscalls:sys_exit_read --filter 'ret == -11' -e syscalls:sys_exit_recvfrom --filter 'ret == -11' -p "$gp" &
      ppid=$!
      sleep 0.2
      run_load "$r" "$c" "$n" "res-$r-$c-$rep.json" "$out/time-$r-$c-$rep"
      conns=$(ss -Htnp state established "( dport = :$pp or dport = :$dp )" 2>/dev/null | grep -cE "pid=(${gp//,/|})," || true)
      kill -INT "$ppid"; wait "$ppid" || true
      kill "$spid" 2>/dev/null || true
      wait "$spid" 2>/dev/null || true
      read -r u1 s1 < <(cpu ${gp//,/ })
      read -r wu1 ws1 < <(cpu "$prefill" "$decode")
      python3 - "$out" "$r" "$c" "$rep" "$hz" "$u0" "$s0" "$u1" "$s1" "$wu0" "$ws0" "$wu1" "$ws1" "$conns" >>"$out/rows.txt" <<'EOF'
import json, sys
out, r, c, rep, hz = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])
u0, s0, u1, s1, wu0, ws0, wu1, ws1 = map(float, sys.argv[6:14])
conns = sys.argv[14]
res = json.load(open(f"{out}/res-{r}-{c}-{rep}.json"))
n = res["completed"]
ev = {}
for line in open(f"{out}/perf-{r}-{c}-{rep}.csv"):
    f = line.strip().split(",")
    if len(f) > 3 and f[0] and not line.startswith("#"):
        try:
            ev[f[2]] = float(f[0])
        except ValueError:
            pass
def per(k): return ev.get(k, 0) / n if n else 0
sc = lambda *names: sum(per("syscalls:sys_enter_" + x) for x in names)
tu, ts = map(float, open(f"{out}/time-{r}-{c}-{rep}").read().split())
thr, gor = open(f"{out}/sample-{r}-{c}-{rep}").read().split() if n else ("0", "0")
k = 1000.0 / n if n else 0
print(r, c, rep, n, f'{res["request_throughput"]:.1f}', f'{res["median_ttft_ms"]:.2f}', f'{res["p99_ttft_ms"]:.2f}',
      f'{res["median_tpot_ms"]:.2f}', f'{res["median_e2el_ms"]:.1f}', f'{res["p99_e2el_ms"]:.1f}', f"{(u1-u0)/hz*k:.3f}", f"{(s1-s0)/hz*k:.3f}", f"{(wu1-wu0+ws1-ws0)/hz*k:.3f}",
      f"{(tu+ts)*k:.3f}", f'{per("context-switches"):.1f}', f'{per("raw_syscalls:sys_enter"):.1f}',
      f'{sc("read","readv","recvfrom","recvmsg"):.1f}', f'{per("syscalls:sys_exit_read") + per("syscalls:sys_exit_recvfrom"):.1f}', f'{sc("write","writev","sendto","sendmsg"):.1f}',
      f'{sc("epoll_wait","epoll_pwait","epoll_ctl"):.1f}', f'{sc("futex"):.1f}', int(ev.get("syscalls:sys_enter_connect", 0)),
      thr, gor, conns)
EOF
      tail -1 "$out/rows.txt" >&2
    done
  done
done

# Where the CPU goes: one perf record per router at the largest C.
cmax=${C_LIST##* }
for r in switchyard vllm-router; do
  gp=$(group_pids "${rpid[$r]}")
  perf record -q -F 999 -g -o "$out/perf-$r.data" -p "$gp" >/dev/null 2>&1 &
  ppid=$!
  sleep 0.2
  run_load "$r" "$cmax" "$((cmax * PROMPTS_PER_C))" "rec-$r.json"
  kill -INT "$ppid"; wait "$ppid" || true
  perf report -i "$out/perf-$r.data" --no-children --sort dso --stdio -g none 2>/dev/null | grep '%' | head -6 >"$out/report-dso-$r.txt" || true
  perf report -i "$out/perf-$r.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null | grep '%' >"$out/report-sym-$r.txt" || true
done

python3 - "$out/rows.txt" <<'EOF'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
head, rows = rows[0], rows[1:]
groups = {}
for r in rows:
    groups.setdefault((int(r[1]), r[0]), []).append(r)
print("| C | router | " + " | ".join(head[3:]) + " |")
print("|---|---|" + "---|" * len(head[3:]))
for (c, r), rs in sorted(groups.items()):
    cells = []
    for i in range(3, len(head)):
        v = sorted(float(x[i]) for x in rs)
        med = statistics.median(v)
        cells.append(f"{med:g} ({v[0]:g}-{v[-1]:g})" if len(v) > 1 and v[0] != v[-1] else f"{med:g}")
    print(f"| {c} | {r} | " + " | ".join(cells) + " |")
EOF
for r in switchyard vllm-router; do
  echo; echo "## $r: perf record at C=$cmax, by shared object"; cat "$out/report-dso-$r.txt"
  echo; echo "## $r: by category (symbols grouped by name)"
  python3 - "$out/report-sym-$r.txt" <<'EOF'
import re, sys
rules = [  # first match wins; applied to "dso sym"
    ("kernel", r"\[k\]"),
    ("libc malloc/free", r"libc.*(malloc|free|_int_|unlink_chunk|realloc|consolidate|tcache)"),
    ("libc other (memmove, ...)", r"libc"),
    ("Go GC", r"runtime\.(gc|mark|scan|sweep|tryDefer|findObject|greyobject|heapBits|wbBuf|bulkBarrier|spanOf|\(\*mspan\)|\(\*spanSet\)|\(\*sweepLocked\)|\(\*unwinder\)|step|pcvalue|funcInfo|scanobject|scanstack)|gc/scan|gcDrain"),
    ("Go allocation", r"runtime\.(malloc|memclr|nextFree|newobject|makeslice|growslice|\(\*mcache\)|\(\*mcentral\)|\(\*mheap\))"),
    ("Go scheduler, channels, locks", r"runtime\.(select|chan|gopark|goready|schedule|findRunnable|park|ready|lock|unlock|sellock|selunlock|futex|notesleep|notewakeup|netpoll|stealWork|runq|execute|mcall|casgstatus|semacquire|semrelease|wakep|startm|stopm|procyield|gfget|gfput|newproc|goexit|systemstack|mPark|resetspinning|injectglist|checkTimers|runOneTimer|\(\*timer)|sync\.|procyieldAsm"),
    ("memmove", r"memmove"),
    ("encoding/json", r"encoding/json"),
    ("net/http, textproto, bufio", r"net/http|net/textproto|bufio|net/url|mime"),
    ("Go net, poll, syscall", r"internal/poll|syscall\.|net\.|runtime\.entersyscall|runtime\.exitsyscall"),
    ("switchyard packages", r"github\.com/switchyard-llm"),
    ("Go runtime other", r"runtime\.|internal/runtime|internal/abi"),
    ("Go maps, context, strings", r"internal/runtime/maps|context\.|strings\.|aeshash|strconv"),
    ("hyper, axum, reqwest, h2", r"hyper|axum|reqwest|http_body|h2::|tower"),
    ("tokio", r"tokio"),
    ("vllm_router_rs other", r"vllm_router_rs"),
]
agg = {}
for l in open(sys.argv[1]):
    m = re.match(r"\s*([\d.]+)%\s+(.*)", l)
    if not m:
        continue
    name = next((k for k, rx in rules if re.search(rx, m.group(2))), "other")
    agg[name] = agg.get(name, 0) + float(m.group(1))
print(", ".join(f"{k} {v:.1f} %" for k, v in sorted(agg.items(), key=lambda x: -x[1])))
EOF
  echo; echo "## $r: top symbols"; head -15 "$out/report-sym-$r.txt" | cut -c1-160
done
log "raw files in $out"
