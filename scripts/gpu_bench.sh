#!/usr/bin/env bash
# Issue 12 on the lent H200 host (no network there; /tmp survives while the machine stays warm), in
# back-to-back calls:
#   bash scripts/gpu_bench.sh stage .bundle/N ...      # once per vLLM bundle part (scripts/gpu_hol.sh stage)
#   bash scripts/gpu_bench.sh calibrate [args]         # nelssa calibrate (needs no vLLM)
#   bash scripts/gpu_bench.sh mixed|single-long|multi-long|growth|hol-http [args]   # NELSSA, then NELSSA_OFF
#                                                      # (BENCH_TIMEOUT=s: the bench stopped there, its files kept;
#                                                      # BENCH_PRESET=h100 on an 80-GB GPU: the same KV;
#                                                      # BENCH_NODE="nelssa-node args": the host tier as a node on
#                                                      # 127.0.0.1:50151 (the nelssa config names "engine": "node",
#                                                      # "node_address": "127.0.0.1:50151"; carry .wheels))
# Carried folders as for gpu_hol.sh: .bundle/N, .ninja, .gpumodel/dummy-llama-3.1-8b. Results come back as
# $OUT/<what>.tgz (the whole results folder) plus its summary/calibration JSON and report.md.
set -euo pipefail
what=${1:?usage: gpu_bench.sh stage DIR... | calibrate [args] | WORKLOAD [args]}
shift
# attention: vLLM's own choice on Hopper, FLASH_ATTN (NELSSA refuses any other at start: attention.wrap_impl);
# vLLM 0.26 ignores VLLM_ATTENTION_BACKEND (it logged it as unknown), --attention-backend selects one
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
export NELSSA_CACHE=/tmp/nelssa-cache PYTHONUNBUFFERED=1
[ "$what" = stage ] && exec bash scripts/gpu_hol.sh stage "$@"
bash scripts/gpu_hol.sh build  # once per machine (with .ninja carried: in parallel)
{ lscpu | grep -E "Model name|^CPU\(s\)"; nvidia-smi --query-gpu=name,memory.total --format=csv; } > "$OUT/machine.txt"
res=/tmp/nelssa-results/$what-$(date -u +%Y%m%d-%H%M%S)
rc=0
if [ "$what" = calibrate ]; then
  python3 -m nelssa.cli calibrate --out "$res" "$@" 2>&1 | tee "$OUT/$what.log" | grep -v "left$" || rc=$?
  cp "$res/calibration.json" "$res/calibration.png" "$OUT/" 2>/dev/null || true
else
  [ -d /tmp/site/vllm ] || { echo "vLLM is not installed: stage all bundle parts first" >&2; exit 2; }
  # the plugin's entry point, as an installed distribution would declare it (as gpu_hol.sh)
  mkdir -p /tmp/site/nelssa-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: nelssa\nVersion: 0.1.0\n' > /tmp/site/nelssa-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\nnelssa = nelssa.vllm_plugin:register\n' > /tmp/site/nelssa-0.1.0.dist-info/entry_points.txt
  if [ -n "${BENCH_NODE:-}" ]; then  # the host tier as nelssa-node on this host, stopped when the bench ends
    # shellcheck source=gpu_node.sh
    source "$(dirname "$0")/gpu_node.sh"
    # shellcheck disable=SC2086
    start_node "$OUT/node.log" $BENCH_NODE
  fi
  # BENCH_TIMEOUT (seconds): stop the bench there, so what it wrote still comes back (the device call's limit)
  ${BENCH_TIMEOUT:+timeout "$BENCH_TIMEOUT"} python3 -m nelssa.cli bench "$what" --preset "${BENCH_PRESET:-$(bash scripts/gpu_hol.sh preset)}" --model .gpumodel/dummy-llama-3.1-8b --out "$res" "$@" 2>&1 \
    | tee "$OUT/$what.log" | grep -v "left \[" || rc=$?
  python3 -m nelssa.cli bench report "$res" || true
  cp "$res/summary.json" "$res/report.md" "$OUT/" 2>/dev/null || true
fi
tar -C "$(dirname "$res")" -czf "$OUT/$what.tgz" "$(basename "$res")"
exit $rc
