#!/usr/bin/env bash
# The head-of-line benchmark on the lent H200 host (no network there; /tmp survives while the machine
# stays warm), in back-to-back calls:
#   bash scripts/gpu_hol.sh stage .bundle/N          # once per vLLM bundle part (the last one installs)
#   bash scripts/gpu_hol.sh build                    # nelssa._C once per machine (each command below builds it too)
#   bash scripts/gpu_hol.sh preset                   # the scenario preset for this GPU (h100 on 80 GB, else h200;
#                                                    # bench uses it unless its arguments name one)
#   bash scripts/gpu_hol.sh bench [hol args ...]     # build nelssa._C, run `nelssa bench hol` (both modes;
#                                                    # bench and handoff results come back as $OUT/<run>.tgz);
#                                                    # HOL_TAG=x: results in $OUT/hol_x (several runs per call);
#                                                    # HOL_NODE="nelssa-node args": the host tier as a node;
#                                                    # HOL_ENGINE_CORES=0-3: the bench's engines pinned there
#   bash scripts/gpu_hol.sh check [exact|throughput|units] # CUDA unit tests + benchmarks/gpu_validate.py (dummy 8B;
#                                                    # units: the tests only);
#                                                    # carry .wheels (grpcio: the node's CUDA test)
#   bash scripts/gpu_hol.sh select                   # benchmarks/bench_select_gpu.py (centroid search, torch vs kernel)
#   bash scripts/gpu_hol.sh handoff [args]           # benchmarks/bench_handoff.py (no vLLM needed: no staging) + its report
#   bash scripts/gpu_hol.sh kmeans [args]            # the k-means kernels' CUDA test, then benchmarks/bench_kmeans_kernel.py
#                                                    # (tilings vs torch; no vLLM: no staging, no build)
#   bash scripts/gpu_hol.sh hostcall [args]          # benchmarks/bench_host_call.py with the call's team sleeping and
#                                                    # spinning between calls (NELSSA_POOL_SPIN_US 0, 1000), torch's
#                                                    # team of 16 beside it as in an engine (no staging)
#   bash scripts/gpu_hol.sh hostmem [args]           # benchmarks/bench_host_memory.py (a move's copy into fresh vs
#                                                    # reserved, CUDA-registered host memory; no staging)
#   bash scripts/gpu_hol.sh node [bench_node args]   # benchmarks/bench_node.py (carry .wheels: grpcio); a node that
#                                                    # crashes leaves its native frames, resolved, in $OUT/node_crash.txt
#   PD_MODE=on|off bash scripts/gpu_hol.sh pd [hol-http --set args]
#                                                    # the P/D stack (run_pd_with_nelssa.sh: P and D on this host's
#                                                    # GPUs, one shared GPU split PD_SPLIT [0.5,0.27]) and the
#                                                    # head-of-line scenario through its proxy (`nelssa bench
#                                                    # hol-http`); carry .pdwheels (nixl==1.5.1, nixl-cu13==1.5.1
#                                                    # cp312 wheels) once; PD_ENGINE [local] D's host tier
#                                                    # (node: nelssa-node, and P hands long prompts over to D);
#                                                    # PD_VLLM_ARGS: more vLLM arguments for both instances;
#                                                    # PD_KV [40G,24.3g] P's,D's KV (both start at once; empty:
#                                                    # profiled, D after P); PD_START_S [360] bound on the start;
#                                                    # the launcher's knobs pass through (e.g. NIXL_PROGRESS_THREAD=0,
#                                                    # NELSSA_HANDOVER_WINDOW=0 on D via DECODE_ENV)
# Carried folders (`bash scripts/gpu_prepare.sh` makes them all, before the first call): .bundle/N (../shared/gpu/make-vllm-bundle.sh .bundle), .ninja (optional, with the last
# bundle part: the ninja wheel, for a parallel build of the extension), .gpubuild (optional: $OUT/gpubuild of
# the call that built the extension, used while csrc/, setup.py and the host CPU's flags are the same), .gpumodel/dummy-llama-3.1-8b
# (`nelssa make-dummy-model --out .gpumodel/dummy-llama-3.1-8b`: config + tokenizer). Results: $OUT.
set -euo pipefail
what=${1:?usage: gpu_hol.sh stage DIR... | bench [args]}
shift
# attention: vLLM's own choice on Hopper, FLASH_ATTN (NELSSA refuses any other at start: attention.wrap_impl);
# vLLM 0.26 ignores VLLM_ATTENTION_BACKEND (it logged it as unknown), --attention-backend selects one
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
export NELSSA_CACHE=/tmp/nelssa-cache PYTHONUNBUFFERED=1
# grpcio/protobuf newer than the host's (grpc_wheels), nelssa-node (start_node); the extension once
# shellcheck source=gpu_node.sh
source "$(dirname "$0")/gpu_node.sh"
# the extension once per machine; with .ninja carried (the ninja wheel: pip download ninja), torch builds
# its files in parallel (without ninja it compiles them one by one: 103 s on the H100 host)
# .gpubuild (optional): a build of an earlier session brought back ($OUT/gpubuild: the library and the hashes of
# the sources it was built from and of its CPU's flags), used when both match, so a fresh machine skips the build
# (setup.py builds with -march=native: another host's ISA could lack an instruction)
src_hash() { find csrc setup.py -type f | sort | xargs cat | sha256sum | cut -c1-16; }
cpu_hash() { grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sort | sha256sum | cut -c1-16; }
build_ext() {
  [ -f nelssa/_C*.so ] && return 0
  if ls .gpubuild/_C*.so >/dev/null 2>&1 && [ "$(cat .gpubuild/src.sha 2>/dev/null)" = "$(src_hash)" ] \
     && [ "$(cat .gpubuild/cpu.sha 2>/dev/null)" = "$(cpu_hash)" ]; then
    cp .gpubuild/_C*.so nelssa/ && echo "nelssa._C from .gpubuild (sources $(src_hash), CPU flags $(cpu_hash))" && return 0
  fi
  [ -d .gpubuild ] && echo "nelssa._C: .gpubuild is for other sources or another CPU: building"
  if ! command -v ninja >/dev/null && ls .ninja/ninja-*.whl >/dev/null 2>&1; then
    [ -x /tmp/ninja/bin/ninja ] || pip install -q --no-deps --target /tmp/ninja .ninja/ninja-*.whl >/dev/null
  fi
  [ -x /tmp/ninja/bin/ninja ] && export PATH=/tmp/ninja/bin:$PATH MAX_JOBS=${MAX_JOBS:-16}
  local t=$SECONDS
  python3 setup.py -q build_ext --inplace >/dev/null
  echo "nelssa._C built in $((SECONDS - t)) s ($(command -v ninja >/dev/null && echo ninja || echo 'no ninja'))"
  if [ -n "${OUT:-}" ]; then  # back with the results: carry it as .gpubuild next time; without its debug
    # information (~55 MB with it: over the 16 MiB a file may have to come back, so it never came, 2026-12-05)
    mkdir -p "$OUT/gpubuild"
    for so in nelssa/_C*.so; do
      strip --strip-debug -o "$OUT/gpubuild/$(basename "$so")" "$so" 2>/dev/null || cp "$so" "$OUT/gpubuild/"
    done
    src_hash > "$OUT/gpubuild/src.sha"
    cpu_hash > "$OUT/gpubuild/cpu.sha"
  fi
}
staged_vllm() {  # the staged vLLM bundle, and the plugin's entry point as an installed distribution declares it
  [ -d /tmp/site/vllm ] || { echo "vLLM is not installed: stage all bundle parts first" >&2; exit 2; }
  mkdir -p /tmp/site/nelssa-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: nelssa\nVersion: 0.1.0\n' > /tmp/site/nelssa-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\nnelssa = nelssa.vllm_plugin:register\n' > /tmp/site/nelssa-0.1.0.dist-info/entry_points.txt
}
# the scenario's preset by the GPU (gpu_bench.sh asks here too: `gpu_hol.sh preset`): an 80-GB card (the
# lent H100) gets h100, the H200 scenario's KV in tokens (its util 0.27 leaves ~3 GB of KV there and both
# engines fail at start: a lost call, 2026-12-05)
gpu_preset() {
  local mem; mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1) || true
  if [ "${mem:-0}" -gt 0 ] && [ "${mem:-0}" -lt 100000 ]; then echo h100; else echo h200; fi
}
# a call brings back at most 8 files from $OUT: a run's folder (and log) go back as one archive
pack() { local d=$1; shift; tar czf "$d.tgz" -C "$(dirname "$d")" "$(basename "$d")" "$@" && rm -rf "$d"; }
case "$what" in
  stage)
    for d in "$@"; do bash "$d/install-vllm-bundle.sh" "$d"; done ;;
  preset)
    gpu_preset ;;
  build)  # the extension alone (gpu_bench.sh's too)
    build_ext ;;
  handoff)
    build_ext
    hout="$OUT/handoff${HOL_TAG:+_$HOL_TAG}"  # HOL_TAG=x: several runs per call
    python3 benchmarks/bench_handoff.py --out "$hout" "$@" 2>&1 | grep -v -i warn | tail -n 20
    python3 -m nelssa.cli bench report "$hout" >/dev/null 2>&1 || true
    pack "$hout"
    exit 0 ;;
  kmeans)
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_split.py -k kmeans 2>&1 | tail -n 5
    python3 benchmarks/bench_kmeans_kernel.py --out "$OUT/kmeans${HOL_TAG:+_$HOL_TAG}" "$@" 2>&1 | grep -v -i warn | tail -n 20
    exit 0 ;;
  hostcall)
    build_ext
    for spin in ${HOSTCALL_SPINS:-0 1000}; do
      NELSSA_POOL_SPIN_US=$spin NELSSA_POOL_THREADS=${NELSSA_POOL_THREADS:-8} python3 benchmarks/bench_host_call.py \
        --out "$OUT/hostcall" --torch-threads 16 "$@" > "$OUT/hostcall_s$spin.log" 2>&1 || echo "spin $spin failed"
    done
    python3 - "$OUT/hostcall" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    d = json.load(open(f))
    print(f.rsplit("/", 1)[-1], "threads", d["pool_threads"], "spin_us", d.get("pool_spin_us"))
    for k, v in d["paced"].items():
        print(f"  paced {k}: {v['median_ms'] * 1e3:.1f} us", {a: round(b, 1) for a, b in v["split_us"].items()})
PY
    exit 0 ;;
  hostmem)
    build_ext
    python3 benchmarks/bench_host_memory.py --out "$OUT/hostmem${HOL_TAG:+_$HOL_TAG}" "$@" 2>&1 | grep -v -i warn | tail -n 8
    exit 0 ;;
  node)
    grpc_wheels
    build_ext
    rc=0
    python3 benchmarks/bench_node.py --out "$OUT/node.json" "$@" \
      2> >(tee "$OUT/node_stderr.txt" >&2) || rc=$?
    if grep -q "nelssa: fatal signal" "$OUT/node_stderr.txt"; then
      # frames of our extension as object(+offset): file and line from its debug info
      sed -n '/nelssa: fatal signal/,/end of native frames/p' "$OUT/node_stderr.txt" | tee "$OUT/node_crash.txt"
      python3 - "$OUT/node_crash.txt" nelssa/_C*.so <<'PY' | tee -a "$OUT/node_crash.txt"
import re, subprocess, sys
crash, so = sys.argv[1], sys.argv[2]
syms = {}
for line in subprocess.run(["nm", "--defined-only", so], capture_output=True, text=True).stdout.splitlines():
    f = line.split()
    if len(f) == 3:
        syms[f[2]] = int(f[0], 16)
for m in re.finditer(r"_C[^ (]*\.so\(([^)+]*)\+(0x[0-9a-f]+)\)", open(crash).read()):
    addr = syms.get(m.group(1), 0) + int(m.group(2), 16) if m.group(1) else int(m.group(2), 16)
    r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", so, hex(addr)], capture_output=True, text=True)
    print(hex(addr), " | ".join(r.stdout.split("\n")))
PY
    fi
    exit $rc ;;
  pd)
    staged_vllm
    if [ ! -d /tmp/nixl/nixl ]; then
      ls .pdwheels/nixl*.whl >/dev/null 2>&1 || { echo "NIXL is not installed: carry .pdwheels once" >&2; exit 2; }
      pip install -q --no-deps --target /tmp/nixl .pdwheels/*.whl
    fi
    export PYTHONPATH=/tmp/nixl:$PYTHONPATH
    grpc_wheels
    build_ext
    { lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,memory.total --format=csv; } | tee "$OUT/machine.txt"
    python3 -c "import vllm, nixl, nelssa._C; from nixl._api import nixl_agent; print('vllm', vllm.__version__, 'nixl ok')"
    mode=${PD_MODE:-on}
    out="$OUT/pd_$mode${HOL_TAG:+_$HOL_TAG}"
    mkdir -p "$out"
    model=$PWD/.gpumodel/dummy-llama-3.1-8b
    # both modes: the V1 model runner (NELSSA's D needs it; stock P/D the same, so only NELSSA differs)
    export VLLM_USE_V2_MODEL_RUNNER=0 NELSSA_PYTHON=python3 MODEL=$model LOG_DIR=/tmp/pd_$mode
    export NELSSA_T_INPUT=8192 NELSSA_BUDGET=0.04 NELSSA_ENGINE=${PD_ENGINE:-local} NELSSA_LANE=1
    export NELSSA_HOST_CAPACITY=64GiB GPU_MEMORY_SPLIT=${PD_SPLIT:-0.5,0.27} HEALTH_TIMEOUT=400
    # KV caches of fixed size, so P and D start at once (profiling would make D wait for P): D's 24.3e9 B
    # are the single-GPU scenario's ~185K tokens of the 8B shape (128 KiB per token); PD_KV= (empty):
    # sized by profiling from the split, D after P
    export KV_CACHE_MEMORY=${PD_KV-40G,24.3g}
    # P keeps a prompt's KV for D this long (vLLM's 30 s): D admits a 100K prompt only when its KV fits
    # (stock: after the other long request; NELSSA: after its hand-off), both modes alike
    export NIXL_KV_LEASE_S=${PD_LEASE_S:-120} UCX_PROTO_INFO=y  # UCX prints the protocols (transports) it selects
    # the h200 preset's server arguments (nelssa bench hol-http --preset h200), less the memory share
    # (PD_VLLM_ARGS: more for both instances, e.g. "--block-size 64": a NIXL descriptor is one block of one
    # layer, 32 KiB at vLLM's 16 tokens, and costs ~8.5 us over cuda_ipc: bench_nixl_local.py)
    export VLLM_EXTRA_ARGS="--load-format dummy --max-model-len 131072 --max-num-seqs 128 --max-num-batched-tokens 8192 --long-prefill-token-threshold 2048 --no-enable-prefix-caching --seed 0 ${PD_VLLM_ARGS:-}"
    if [ "$mode" = off ]; then export NELSSA_OFF=1; else unset NELSSA_OFF; fi
    rm -rf "$LOG_DIR"
    bash run_pd_with_nelssa.sh > "$out/launcher.log" 2>&1 &
    stack=$!
    t=$SECONDS up=0
    while [ $((SECONDS - t)) -lt "${PD_START_S:-360}" ]; do  # bounded: the logs still come back
      if grep -q "ready:" "$out/launcher.log"; then up=1; break; fi
      kill -0 $stack 2>/dev/null || break
      sleep 2
    done
    if [ "$up" = 1 ]; then echo "stack up after $((SECONDS - t)) s"
    else echo "the stack did not start within ${PD_START_S:-360} s:"; tail -n 60 "$out/launcher.log"; fi
    rc=0
    if [ "$up" = 1 ] && kill -0 $stack 2>/dev/null; then
      python3 -m nelssa.cli bench hol-http --preset h200 --model "$model" --out "$out" \
        --endpoints "$mode=http://127.0.0.1:8300" \
        --metrics "$mode=http://127.0.0.1:8200/metrics+http://127.0.0.1:8100/metrics" "$@" 2>&1 \
        | tee "$out/bench.log" | grep -vE "^\[hol-http" | tail -n 40 || rc=$?
      # KV moved P -> D over NIXL: the connectors' transfer stats in D's metrics
      for side in d:8200 p:8100; do
        python3 -c "import sys; from nelssa.bench.serving import http_get; print(http_get(sys.argv[1]))" \
          "http://127.0.0.1:${side#*:}/metrics" | grep -E "^(vllm:nixl|vllm:num_preemptions|nelssa:)" \
          > "$out/${side%%:*}_metrics_end.txt" || true
      done
      bash run_pd_with_nelssa.sh stop >> "$out/launcher.log" 2>&1 || rc=$?
    else
      rc=1
      bash run_pd_with_nelssa.sh stop >> "$out/launcher.log" 2>&1 || true
    fi
    wait $stack 2>/dev/null || true
    for lg in "$LOG_DIR"/*.log; do
      [ -f "$lg" ] || continue
      grep -E "NELSSA|nixl|NIXL|UCX|ucp_context|Traceback|Error" "$lg" | tail -n 300 > "$out/$(basename "${lg%.log}")_diag.txt" || true
      gzip -c "$lg" > "$out/$(basename "$lg").gz"
    done
    pack "$out"
    exit $rc ;;
  bench|check|select)
    staged_vllm
    build_ext
    { lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,memory.total --format=csv; } | tee "$OUT/machine.txt"
    python3 -c "import vllm, nelssa._C; print('vllm', vllm.__version__)"
    if [ "$what" = select ]; then
      python3 benchmarks/bench_select_gpu.py --out "$OUT/select" "$@" 2>&1 | tail -n 40
      exit 0
    fi
    if [ "$what" = check ]; then
      grpc_wheels  # the node's tests (the store slot registered with CUDA, the DMA read-back) first: a call
                   # cut short after test_cuda_split (~65 s on an H100) lost them once
      python3 -m pytest -q -p no:cacheprovider tests/test_node.py -k cuda 2>&1 | tee "$OUT/cuda_tests.log" | tail -n 5
      python3 -m pytest -q -p no:cacheprovider tests/test_cuda_split.py 2>&1 | tee -a "$OUT/cuda_tests.log" | tail -n 15
      # the hand-off's moves and a recall's load on the side stream (CUDA variants), and write_kv's flash layout
      python3 -m pytest -q -p no:cacheprovider tests/test_plugin_units.py -k "handoff or write_kv" 2>&1 \
        | tee -a "$OUT/cuda_tests.log" | tail -n 5
      if python3 -c "import hypothesis" 2>/dev/null; then  # tests/test_sparse.py needs it
        python3 -m pytest -q -p no:cacheprovider tests/test_sparse.py -k "cuda or pinned" 2>&1 | tee -a "$OUT/cuda_tests.log" | tail -n 5
      else
        echo "tests/test_sparse.py not run: no hypothesis on this host" | tee -a "$OUT/cuda_tests.log"
      fi
      [ "${1:-}" = units ] && exit 0  # the unit tests only
      python3 benchmarks/gpu_validate.py --out "$OUT/validate" --model .gpumodel/dummy-llama-3.1-8b \
        ${1:+--only "$1"} 2>&1 | tee "$OUT/validate.log" | grep -vE "^(INFO|WARNING|DEBUG)" | tail -n 60
      exit 0
    fi
    out="$OUT/hol${HOL_TAG:+_$HOL_TAG}"
    mkdir -p "$out"
    if [ -n "${HOL_NODE:-}" ]; then
      # the host tier as nelssa-node on this host (HOL_NODE: its arguments; the run's nelssa config names
      # "engine": "node", "node_address": "127.0.0.1:50151"); stopped when the bench ends
      # shellcheck disable=SC2086
      start_node "$out/node.log" $HOL_NODE
    fi
    set -o pipefail
    rc=0
    # HOL_ENGINE_CORES (e.g. 0-3 beside HOL_NODE's device cores): the bench and its engines on those cores
    # only, so the engine's threads do not preempt the node's device workers (unpinned, the H200 run
    # through the node spent ~0.3 ms per layer call outside the node's kernels, against ~0.04 ms in
    # bench_node with the client on cores of its own)
    pin=()
    [ -n "${HOL_ENGINE_CORES:-}" ] && pin=(taskset -c "$HOL_ENGINE_CORES")
    # the GPU's preset first: a --preset among the arguments comes later and wins
    ${pin[@]+"${pin[@]}"} python3 -m nelssa.cli bench hol --preset "$(gpu_preset)" --model .gpumodel/dummy-llama-3.1-8b \
      --out "$out" "$@" 2>&1 \
      | tee "$out.log" | grep -E "^\[hol|^(on|off)(:[^ ]+)? |^target|Traceback|Error|error" || rc=$?
    # engine logs: the diagnostic lines (watchdog, slow device steps, lane batches, migrations) apart,
    # the whole log compressed (fewer and smaller files to bring back)
    for lg in "$out"/hol_*.log; do
      [ -f "$lg" ] || continue
      grep -E "NELSSA (watchdog|step:|lane: batch|reserve:)|migrating|recalling|Traceback|Error" "$lg" > "${lg%.log}_diag.txt" || true
      # the lane's start and its first transitions (warm-up, enqueued batches of new sets, captures) in the
      # call's output, where the next decision is made
      grep -hE "NELSSA lane: (dense graphs|batch of [0-9]+ rows (\(new_key\)|\(captured\)|captured as))" "$lg" \
        | head -n 8 | sed "s/^.*\] NELSSA lane: /$(basename "${lg%.log}") lane: /" || true
      gzip -f "$lg"
    done
    # profiles (--set profile_at=...): a summary next to the results; the trace itself when small enough
    for d in "$out"/profile_*; do
      [ -d "$d" ] || continue
      m=$(basename "$d")
      for t in "$d"/*.pt.trace.json*; do
        python3 -m nelssa.bench.trace_summary "$t" --out "$out/${m}_summary.json" > /dev/null || true
        [ "$(stat -c %s "$t")" -lt 15000000 ] && cp "$t" "$out/${m}.trace.json.gz"
      done
      [ -f "$d/profiler_out_0.txt" ] && cp "$d/profiler_out_0.txt" "$out/${m}_table.txt"
      rm -rf "$d"
    done
    [ -f "$out.log" ] && mv "$out.log" "$out/run.log"
    pack "$out"
    exit $rc ;;
  *) echo "unknown step $what" >&2; exit 2 ;;
esac
