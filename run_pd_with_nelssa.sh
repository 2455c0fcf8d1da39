#!/usr/bin/env bash
# NELSSA P/D stack on one machine: a prefill vLLM instance (P), a decode vLLM instance (D), the
# nelssa-node host tier (when D uses it) and the length-routing OpenAI proxy in front of them.
#
#   bash run_pd_with_nelssa.sh          start, wait until all are healthy, stay in the foreground (Ctrl-C stops)
#   bash run_pd_with_nelssa.sh stop     (another shell, same environment) stop exactly what start started
#   bash run_pd_with_nelssa.sh status   list the recorded processes and ports
#   NELSSA_OFF=1 bash run_pd_with_nelssa.sh    the same P/D topology with stock vLLM (the baseline)
#
# Knobs (environment; defaults in brackets):
#   MODEL [the prepared SmolLM2]   NELSSA_T_INPUT [2048]   NELSSA_BUDGET [0.04]   NELSSA_OFF [unset]
#   PREFILL_PORT [8100]  DECODE_PORT [8200]  PROXY_PORT [8300]  NODE_PORT [50151]
#   PREFILL_NIXL_PORT [5600]  DECODE_NIXL_PORT [5601]   (NIXL side channels)
#   NELSSA_ENGINE [auto]: D's host tier: node (nelssa-node, started here), local (in-process on D),
#       auto (node when this checkout has the node service, else local)
#   NODE_DEVICES [1]  NODE_ARGS [extra nelssa-node arguments]
#   NODE_THREADS [half the usable cores, at most 8]: the node's kernel threads, split over its devices
#       (--threads-per-device; unless NODE_ARGS names --device-cores, --cores-per-device or
#       --threads-per-device). The node's own default is one thread per unpinned device: D's layer calls
#       took 3-6 ms through it on the H200 host, against ~0.7 ms in process with 8 threads
#   NELSSA_HANDOVER [1 with the node]: P runs NELSSA too, clusters long prompts into nelssa-node as it
#       prefills them and hands them over to D, which adopts them instead of clustering them (0: P is
#       stock vLLM and D clusters); D then holds and reads over NIXL only their window's blocks
#       (NELSSA_HANDOVER_WINDOW=0 on D: the whole prompt's)
#   VLLM_EXTRA_ARGS [empty]: appended to both vLLM instances' arguments, e.g. "--dtype float32 --enforce-eager"
#   PREFILL_GPU [0]  DECODE_GPU [1 with two GPUs, else 0]  GPU_MEMORY_SPLIT [0.45: each instance's
#       --gpu-memory-utilization when P and D share a GPU; "P,D" for two values, e.g. 0.5,0.27]. On a
#       shared GPU D starts once P is healthy: vLLM sizes its KV cache from the device's free memory,
#       which the other instance's start would be changing
#   KV_CACHE_MEMORY [unset]: "P,D", each instance's KV cache in bytes (vLLM's --kv-cache-memory-bytes
#       syntax: 40G, 24.3g, 2000000000; the KV cache is that size, not what profiling leaves of the
#       memory share). On a shared GPU P and D then start at the same time; each one's share
#       (GPU_MEMORY_SPLIT) must still hold its weights, activations and that KV, and is still checked
#       against the free memory when it starts
#   PREFILL_ENV / DECODE_ENV [empty]: "NAME=value ..." added to that instance's environment only, e.g.
#       PREFILL_ENV=NELSSA_STEP_PRIORITY=0 (P's steps no longer ranked above its hand-over's k-means)
#   NELSSA_ENGINE_CORES: cores of both vLLM instances (taskset/numactl), or PREFILL_CORES / DECODE_CORES
#   NELSSA_AFFINITY_CORES: D's host-attention pool (NELSSA config)   NODE_CORES: the node's cores
#   LOG_DIR [${TMPDIR:-/tmp}/nelssa-pd-$PROXY_PORT]: logs and the PID record (stop reads it)
#   NIXL_KV_LEASE_S [120 on CPU, vLLM's 30 on GPUs]: how long P keeps a request's KV for D
#   NIXL_PROGRESS_THREAD [0 on CPU, 1 on GPUs]: NIXL's UCX progress thread in P and D (it polls without
#       sleeping, a core per instance; vLLM's steps drive the transfers without it: nelssa/vllm_plugin/
#       nixl_progress.py)
#   NIXL_CONNECTOR [NixlConnector (pull)]: vLLM's NIXL connector of both instances (NixlPushConnector:
#       see nelssa/proxy/pd.py)   UCX_CUDA_IPC_ENABLE_GET_ZCOPY [y on GPUs]: D reads P's GPU blocks over
#       cuda_ipc without NVLink too (UCX's default "auto" falls back to TCP there: 45 s per transfer
#       measured with P and D sharing an H200)
#   WARMUP_TRIES [5]: P->D warm-up requests (first NIXL handshake) before "ready"
#   HEALTH_TIMEOUT [900] s   PROXY_ARGS [extra nelssa-proxy arguments]   NELSSA_PYTHON [the project venv]
#
# Short requests (< T_input prompt tokens): standard vLLM P/D, prefill on P, KV to D through vLLM's
# NixlConnector (UCX; DRAM on the CPU platform, device memory on GPUs), decode on D.
# Long requests: the proxy decides once and tells P and D in kv_transfer_params["nelssa"]; their KV
# takes the same P/D path; with the node P clusters them into it and D adopts them there, else D moves
# their KV to its host tier (see docs/pd.md: the paths and the design of the rest).
set -euo pipefail
{  # the whole script is read before it runs: editing the file under a running stack cannot break it
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
action=${1:-start}

PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8300}
NODE_PORT=${NODE_PORT:-50151}
PREFILL_NIXL_PORT=${PREFILL_NIXL_PORT:-5600}
DECODE_NIXL_PORT=${DECODE_NIXL_PORT:-5601}
LOG_DIR=${LOG_DIR:-${TMPDIR:-/tmp}/nelssa-pd-$PROXY_PORT}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}
STATE="$LOG_DIR/pids"
log() { echo "[run_pd $(date +%H:%M:%S)] $*" >&2; }

# ---------------------------------------------------------------- process records (name pid start-time)
start_time() { [ -r "/proc/$1/stat" ] && awk '{sub(/.*\) /, ""); print $20}' "/proc/$1/stat"; }
ours() {  # pid start-time: the recorded process is still the one we started (no PID reuse)
  local t; t=$(start_time "$1" 2>/dev/null || true)
  [ -n "$t" ] && [ "$t" = "$2" ]
}
group_alive() { kill -0 -- "-$1" 2>/dev/null; }
running() {  # pid start-time: ours and not a zombie
  ours "$1" "$2" && [ "$(awk '{sub(/.*\) /, ""); print $1}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

stop_all() {  # stop every recorded process group, newest first: TERM to its leader (vLLM's API server then
  # shuts its engine core down itself; a TERM to the whole group at once made the API server log an
  # EngineDeadError traceback at every stop), TERM to the group after half of STOP_TIMEOUT, KILL after it
  [ -f "$STATE" ] || { log "nothing recorded in $STATE"; return 0; }
  touch "$LOG_DIR/stopping"
  local lines name pid st i waited sent=()
  mapfile -t lines < "$STATE"
  for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
    read -r name pid st _ <<<"${lines[i]}"
    if ours "$pid" "$st"; then
      log "stopping $name (process group $pid)"
    elif [ ! -e "/proc/$pid" ] && group_alive "$pid"; then
      # the leader is gone, its children are not; Linux gives no new process a live group's id
      log "stopping what is left of $name (process group $pid)"
    else
      continue  # gone, or the id now belongs to another process: not ours
    fi
    if [ -e "/proc/$pid" ]; then kill -TERM "$pid" 2>/dev/null || true
    else kill -TERM -- "-$pid" 2>/dev/null || true; fi
    sent+=("$name $pid")
  done
  waited=0
  local limit=${STOP_TIMEOUT:-30}
  for i in "${sent[@]}"; do
    read -r name pid <<<"$i"
    while group_alive "$pid" && [ "$waited" -lt "$limit" ]; do
      sleep 1; waited=$((waited + 1))
      [ "$waited" -ne $((limit / 2)) ] || for j in "${sent[@]}"; do kill -TERM -- "-${j#* }" 2>/dev/null || true; done
    done
    if group_alive "$pid"; then
      log "$name (process group $pid) still running after $limit s: SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
  done
  local ports busy
  ports=$(awk '{for (i = 4; i <= NF; i++) print $i}' "$STATE" | tr '\n' ' ')
  for _ in $(seq 1 20); do
    busy=$("$PY" -m nelssa.proxy.pd listening $ports 2>/dev/null) && break
    sleep 0.5
  done
  rm -f "$STATE"
  if [ -n "${busy:-}" ]; then
    log "ports still listening after stop: $busy"
    return 1
  fi
  log "stopped; ports $ports free"
}

record() { echo "$1 $2 $(start_time "$2") $3" >> "$STATE"; }

launch() {  # name port log command...: own session (PID = process group id), recorded at once
  local name=$1 port=$2 logf=$3; shift 3
  setsid "$@" >"$logf" 2>&1 < /dev/null &
  local pid=$!
  record "$name" "$pid" "$port"
  log "$name: pid $pid, port $port, log $logf"
}

pin() {  # cores -> a command prefix that pins (numactl or taskset), empty when no cores or no tool
  [ -n "$1" ] || return 0
  if command -v numactl >/dev/null 2>&1; then echo "numactl --physcpubind=$1"
  elif command -v taskset >/dev/null 2>&1; then echo "taskset -c $1"
  else log "no numactl/taskset: cores $1 not pinned"; fi
}

resolve_python() {
  if [ -n "${NELSSA_PYTHON:-}" ]; then PY=$NELSSA_PYTHON
  else PY=$(bash "$repo/scripts/setup_env.sh" | tail -n 1); fi
}

# ---------------------------------------------------------------- stop / status
if [ "$action" = stop ] || [ "$action" = status ]; then
  PY=${NELSSA_PYTHON:-$HOME/.cache/nelssa/venv/bin/python}
  [ -x "$PY" ] || PY=python3
  cd "$repo"
  if [ "$action" = status ]; then
    [ -f "$STATE" ] || { echo "not running (no $STATE)"; exit 1; }
    while read -r name pid st port; do
      if running "$pid" "$st"; then echo "$name pid $pid port $port: running"; else echo "$name pid $pid port $port: gone"; fi
    done < "$STATE"
    exit 0
  fi
  stop_all
  exit $?
fi
[ "$action" = start ] || { echo "usage: $0 [start|stop|status]" >&2; exit 2; }

# ---------------------------------------------------------------- start
mkdir -p "$LOG_DIR"
if [ -f "$STATE" ]; then
  while read -r name pid st _; do
    if running "$pid" "$st"; then log "already running ($name pid $pid; $STATE): '$0 stop' first"; exit 1; fi
  done < "$STATE"
  rm -f "$STATE"
fi
rm -f "$LOG_DIR/stopping"
cd "$repo"
resolve_python
off=0
case "${NELSSA_OFF:-}" in 1|true|yes|on) off=1 ;; esac
if [ "$off" = 0 ] && ! err=$("$PY" -m nelssa.proxy.pd check-config '{}' 2>&1); then
  log "$err"; exit 2  # a bad NELSSA_* variable (the instances' own configs are checked below)
fi

ports="$PREFILL_PORT $DECODE_PORT $PROXY_PORT $PREFILL_NIXL_PORT $DECODE_NIXL_PORT"
if busy=$("$PY" -m nelssa.proxy.pd listening $ports); then :; else
  log "ports already in use: $busy (another stack? set PREFILL_PORT/DECODE_PORT/PROXY_PORT/*_NIXL_PORT)"; exit 1
fi
MODEL=${MODEL:-$("$PY" -m nelssa.cli prepare-model 2>/dev/null | tail -n 1)}
[ -e "$MODEL" ] || log "MODEL=$MODEL is not a local path (passed to vLLM as is)"
export NELSSA_T_INPUT=${NELSSA_T_INPUT:-2048}
export NELSSA_BUDGET=${NELSSA_BUDGET:-0.04}

# GPUs: P and D placement; one shared GPU gets a memory split
ngpu=0
if command -v nvidia-smi >/dev/null 2>&1; then ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); fi
dev_flag=--cpu
shared_gpu=0
p_env=() d_env=() p_extra=() d_extra=()
if [ "$ngpu" -gt 0 ]; then
  dev_flag=--cuda
  PREFILL_GPU=${PREFILL_GPU:-0}
  DECODE_GPU=${DECODE_GPU:-$([ "$ngpu" -ge 2 ] && echo 1 || echo 0)}
  p_env=(CUDA_VISIBLE_DEVICES="$PREFILL_GPU") d_env=(CUDA_VISIBLE_DEVICES="$DECODE_GPU")
  if [ "$PREFILL_GPU" = "$DECODE_GPU" ]; then
    shared_gpu=1
    split=${GPU_MEMORY_SPLIT:-0.45}
    p_util=${split%%,*} d_util=${split#*,}
    for u in "$p_util" "$d_util"; do
      "$PY" -c "import sys; v = float(sys.argv[1]); sys.exit(0 if 0 < v < 1 else 1)" "$u" 2>/dev/null \
        || { log "GPU_MEMORY_SPLIT=$split: each value must be a fraction in (0, 1)"; exit 2; }
    done
    "$PY" -c "import sys; sys.exit(0 if float(sys.argv[1]) + float(sys.argv[2]) < 1 else 1)" "$p_util" "$d_util" \
      || { log "GPU_MEMORY_SPLIT=$split: P's and D's shares of the one GPU must add up to less than 1"; exit 2; }
    p_extra=(--gpu-memory-utilization "$p_util") d_extra=(--gpu-memory-utilization "$d_util")
    log "P and D share GPU $PREFILL_GPU (--gpu-memory-utilization P $p_util, D $d_util)"
  fi
  if [ "$shared_gpu" = 1 ] && [ -z "${KV_CACHE_MEMORY:-}" ]; then
    log "D starts once P is healthy (one GPU, KV caches sized by profiling; KV_CACHE_MEMORY=P,D starts both at once)"
  fi
  export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-y}
  log "GPUs: P on $PREFILL_GPU, D on $DECODE_GPU (kv_buffer_device cuda; UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$UCX_CUDA_IPC_ENABLE_GET_ZCOPY)"
else
  log "no GPU: vLLM's CPU platform, NIXL over DRAM (kv_buffer_device cpu)"
fi
if [ -n "${KV_CACHE_MEMORY:-}" ]; then
  case "$KV_CACHE_MEMORY" in
    *,*) p_kv=${KV_CACHE_MEMORY%%,*} d_kv=${KV_CACHE_MEMORY#*,} ;;
    *) log "KV_CACHE_MEMORY=$KV_CACHE_MEMORY: give P's and D's KV cache sizes as P,D"; exit 2 ;;
  esac
  # vLLM's own parser of --kv-cache-memory-bytes
  "$PY" -c "import sys; from vllm.utils.argparse_utils import human_readable_int as h
sys.exit(0 if all(h(v) > 0 for v in sys.argv[1:]) else 1)" "$p_kv" "$d_kv" 2>/dev/null \
    || { log "KV_CACHE_MEMORY=$KV_CACHE_MEMORY: P,D must be sizes vLLM's --kv-cache-memory-bytes takes (e.g. 40G,24.3g)"; exit 2; }
  p_extra+=(--kv-cache-memory-bytes "$p_kv") d_extra+=(--kv-cache-memory-bytes "$d_kv")
  log "KV caches of fixed size: P $p_kv, D $d_kv bytes (--kv-cache-memory-bytes)"
fi
NIXL_PROGRESS_THREAD=${NIXL_PROGRESS_THREAD:-$([ "$ngpu" -gt 0 ] && echo 1 || echo 0)}
p_env+=(NELSSA_NIXL_PROGRESS_THREAD="$NIXL_PROGRESS_THREAD") d_env+=(NELSSA_NIXL_PROGRESS_THREAD="$NIXL_PROGRESS_THREAD")
[ "$NIXL_PROGRESS_THREAD" = 1 ] || log "NIXL without its progress thread (NIXL_PROGRESS_THREAD=$NIXL_PROGRESS_THREAD): vLLM's steps drive the transfers"
PREFILL_CORES=${PREFILL_CORES:-${NELSSA_ENGINE_CORES:-}}
DECODE_CORES=${DECODE_CORES:-${NELSSA_ENGINE_CORES:-}}
if [ "$ngpu" -eq 0 ]; then  # vLLM's CPU workers bind their OpenMP threads to exactly these cores
  [ -z "$PREFILL_CORES" ] || p_env+=(VLLM_CPU_OMP_THREADS_BIND="$PREFILL_CORES")
  [ -z "$DECODE_CORES" ] || d_env+=(VLLM_CPU_OMP_THREADS_BIND="$DECODE_CORES")
fi

# D's host tier
engine=${NELSSA_ENGINE:-auto}
node_ok=0
if "$PY" - <<'EOF' 2>/dev/null; then node_ok=1; fi
import importlib.util, sys
from nelssa.config import load_config
sys.exit(0 if importlib.util.find_spec("nelssa.node.__main__") and load_config({"nelssa": {"engine": "node"}}) else 1)
EOF
if [ "$off" = 1 ]; then
  engine=none
  log "NELSSA_OFF=1: stock vLLM P/D baseline (no node, no NELSSA)"
elif [ "$engine" = auto ]; then
  if [ "$node_ok" = 1 ]; then engine=node
  else engine=local; log "nelssa-node is not in this checkout yet: D keeps its host tier in process (engine local)"; fi
elif [ "$engine" = node ] && [ "$node_ok" = 0 ]; then
  log "NELSSA_ENGINE=node but this checkout has no nelssa-node service"; exit 1
fi
export NELSSA_ENGINE=$([ "$engine" = none ] && echo local || echo "$engine")
nelssa_json="{\"T_input\": $NELSSA_T_INPUT, \"budget\": $NELSSA_BUDGET, \"engine\": \"$NELSSA_ENGINE\""
if [ "$engine" = node ]; then
  export NELSSA_NODE_ADDRESS="127.0.0.1:$NODE_PORT"
  nelssa_json+=", \"node_address\": \"$NELSSA_NODE_ADDRESS\""
  if busy=$("$PY" -m nelssa.proxy.pd listening "$NODE_PORT"); then :; else
    log "NODE_PORT $NODE_PORT is already in use"; exit 1
  fi
fi
nelssa_json+="}"
p_nelssa=()  # P: stock vLLM, or with the node the plugin handing long prompts over to D (vllm_plugin/handover.py)
if [ "$engine" = node ] && [ "${NELSSA_HANDOVER:-1}" != 0 ]; then
  p_nelssa=(--nelssa "${nelssa_json%\}}, \"handover\": true}")
  p_env+=(NELSSA_HANDOVER=1 NELSSA_LANE=0)  # (the environment's NELSSA_* win over the JSON; P decodes nothing)
  log "P clusters long prompts into nelssa-node and hands them over to D (NELSSA_HANDOVER=0: D clusters them)"
fi
# PREFILL_ENV / DECODE_ENV: more environment for one instance, after the launcher's own
for role in PREFILL DECODE; do
  var=${role}_ENV
  for kv in ${!var:-}; do
    [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { log "$var: '$kv' is not NAME=value"; exit 2; }
    if [ "$role" = PREFILL ]; then p_env+=("$kv"); else d_env+=("$kv"); fi
  done
done

if [ "$off" = 0 ]; then  # the config each instance will load (JSON and NELSSA_* variables), before anything starts
  for role in p d; do
    if [ "$role" = p ]; then envs=("${p_env[@]}"); else envs=("${d_env[@]}"); fi
    if ! err=$(env "${envs[@]}" "$PY" -m nelssa.proxy.pd check-config "$nelssa_json" 2>&1); then
      log "$([ "$role" = p ] && echo P || echo D): $err"; exit 2
    fi
  done
fi

on_exit() {  # whatever ends this script (error, Ctrl-C, a process dying) stops what it started
  if [ -f "$STATE" ] && [ ! -f "$LOG_DIR/stopping" ]; then stop_all || true; fi
}
trap on_exit EXIT
trap 'log "interrupted: stopping"; exit 130' INT TERM
: > "$STATE"
# shellcheck disable=SC2206
extra=(${VLLM_EXTRA_ARGS:-})
off_flag=()
[ "$off" = 0 ] || off_flag=(--off)
nixl_args=()  # both instances
[ -z "${NIXL_KV_LEASE_S:-}" ] || nixl_args=(--kv-lease "$NIXL_KV_LEASE_S")
[ -z "${NIXL_CONNECTOR:-}" ] || nixl_args+=(--nixl-connector "$NIXL_CONNECTOR")
if [ "$engine" = node ]; then
  node_threads=()  # NODE_THREADS, split over the devices, unless NODE_ARGS says how the devices compute
  case " ${NODE_ARGS:-} " in
    *" --device-cores"*|*" --cores-per-device"*|*" --threads-per-device"*) ;;
    *) nt=${NODE_THREADS:-$(( $(nproc 2>/dev/null || echo 2) / 2 ))}
       [ "$nt" -le 8 ] || nt=8
       per=$(( nt / ${NODE_DEVICES:-1} )); [ "$per" -ge 1 ] || per=1
       node_threads=(--threads-per-device "$per")
       log "node: ${NODE_DEVICES:-1} device(s), $per kernel thread(s) each (NODE_THREADS)" ;;
  esac
  # shellcheck disable=SC2046,SC2206
  launch node "$NODE_PORT" "$LOG_DIR/node.log" $(pin "${NODE_CORES:-}") env "$PY" -m nelssa.node \
    --host 127.0.0.1 --port "$NODE_PORT" --devices "${NODE_DEVICES:-1}" "${node_threads[@]}" ${NODE_ARGS:-}
fi
# shellcheck disable=SC2046
launch prefill "$PREFILL_PORT $PREFILL_NIXL_PORT" "$LOG_DIR/prefill.log" $(pin "$PREFILL_CORES") \
  env "${p_env[@]}" "$PY" -m nelssa.proxy.pd engine-cmd --exec --role prefill --port "$PREFILL_PORT" \
  --nixl-port "$PREFILL_NIXL_PORT" --model "$MODEL" "$dev_flag" "${off_flag[@]}" "${nixl_args[@]}" "${p_nelssa[@]}" \
  -- "${extra[@]}" "${p_extra[@]}"
if [ "$shared_gpu" = 1 ] && [ -z "${KV_CACHE_MEMORY:-}" ]; then
  read -r _ ppid _ < <(grep '^prefill ' "$STATE")
  log "waiting for P's health before D starts (one GPU)"
  "$PY" -m nelssa.proxy.pd wait --timeout "$HEALTH_TIMEOUT" --pid "$ppid=prefill" \
    "http://127.0.0.1:$PREFILL_PORT/health" >&2 \
    || { log "P did not become healthy; last lines of its log:"; tail -n 15 "$LOG_DIR/prefill.log" >&2; exit 1; }
fi
# shellcheck disable=SC2046
launch decode "$DECODE_PORT $DECODE_NIXL_PORT" "$LOG_DIR/decode.log" $(pin "$DECODE_CORES") \
  env "${d_env[@]}" "$PY" -m nelssa.proxy.pd engine-cmd --exec --role decode --port "$DECODE_PORT" \
  --nixl-port "$DECODE_NIXL_PORT" --model "$MODEL" "$dev_flag" "${off_flag[@]}" "${nixl_args[@]}" --nelssa "$nelssa_json" \
  -- "${extra[@]}" "${d_extra[@]}"
# shellcheck disable=SC2206
launch proxy "$PROXY_PORT" "$LOG_DIR/proxy.log" "$PY" -m nelssa.proxy.server --host 127.0.0.1 \
  --port "$PROXY_PORT" --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --model "$MODEL" --t-input "$NELSSA_T_INPUT" "${off_flag[@]}" ${PROXY_ARGS:-}

pidargs=()
while read -r name pid _; do pidargs+=(--pid "$pid=$name"); done < "$STATE"
urls=("http://127.0.0.1:$PREFILL_PORT/health" "http://127.0.0.1:$DECODE_PORT/health" "http://127.0.0.1:$PROXY_PORT/health")
log "waiting for health (up to $HEALTH_TIMEOUT s): ${urls[*]}"
if [ "$engine" = node ]; then
  for _ in $(seq 1 120); do
    "$PY" -m nelssa.proxy.pd listening "$NODE_PORT" >/dev/null || break
    sleep 0.5
  done
fi
if ! "$PY" -m nelssa.proxy.pd wait --timeout "$HEALTH_TIMEOUT" "${pidargs[@]}" "${urls[@]}" >&2; then
  log "start failed; last lines of the logs:"
  for f in "$LOG_DIR"/*.log; do echo "== $f" >&2; tail -n 15 "$f" >&2; done
  exit 1
fi
if ! "$PY" -m nelssa.proxy.pd warmup --prefill "http://127.0.0.1:$PREFILL_PORT" \
     --decode "http://127.0.0.1:$DECODE_PORT" --tries "${WARMUP_TRIES:-5}" >&2; then
  log "start failed: no KV reached D from P"; exit 1
fi
mode=$([ "$off" = 1 ] && echo "stock P/D (NELSSA_OFF)" || echo "NELSSA (T_input $NELSSA_T_INPUT, budget $NELSSA_BUDGET, host tier $engine)")
log "ready: $mode"
echo "Send OpenAI requests to http://127.0.0.1:$PROXY_PORT/v1 (completions, chat/completions, models; /metrics, /health)"
echo "  e.g. curl http://127.0.0.1:$PROXY_PORT/v1/chat/completions -H 'Content-Type: application/json' \\"
echo "         -d '{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'"
echo "Logs: $LOG_DIR   Stop: Ctrl-C, or 'bash $0 stop' from another shell (same LOG_DIR/PROXY_PORT)"

check_once() {  # 0: all running; 3: stopped from another shell; 4: a process exited (said here)
  [ ! -f "$LOG_DIR/stopping" ] || return 3
  while read -r name pid st _; do
    if ! running "$pid" "$st"; then
      [ ! -f "$LOG_DIR/stopping" ] || return 3
      log "$name (pid $pid) exited; see $LOG_DIR/$name.log; stopping the rest"
      return 4
    fi
  done < "$STATE"
}
# foreground: until Ctrl-C, a stop from another shell, or a process exiting on its own. Each round runs
# in the background and is waited for: a SIGINT/SIGTERM ends the wait and runs the trap at once, not
# after the round's commands. (Started in the background of a non-interactive shell, `... &`, the
# script gets SIGINT ignored and cannot trap it: stop it with `bash run_pd_with_nelssa.sh stop` or TERM.)
while true; do
  rc=0
  { sleep 1; check_once; } & wait $! || rc=$?
  case $rc in
    0) ;;
    3) log "stopped from another shell"; exit 0 ;;
    4) exit 1 ;;
    *) log "monitor round failed ($rc)"; exit 1 ;;
  esac
done
exit 0
}
