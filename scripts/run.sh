#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2 on this machine's CPU; CUDA vLLM where a GPU is):
#   1. the host-tier kernel benchmark (fused C++ sparse attention vs naive torch vs read bandwidth);
#   2. sparse-attention accuracy on real SmolLM2 KV;
#   3. NELSSA inside vLLM vs the NELSSA_OFF baseline on one mixed batch (3K/5K/7K-token prompts of
#      real text + short chats, 70 KV blocks): outputs, device blocks held, preemptions, host bytes.
# Results: results/*.json. Extra arguments go to the kernel benchmark (e.g. --quick).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup_env.sh | tail -n 1)
"$py" setup.py -q build_ext --inplace >/dev/null
"$py" -m nelssa.cli prepare-model
mkdir -p results
echo "[run] $("$py" -m nelssa.cpu)" >&2
"$py" -m nelssa.bench.sparse_attention --out results/bench_sparse_attention.json "$@"
"$py" -m nelssa.bench.real_kv --out results/real_kv.json
"$py" -m nelssa.bench.compare --out results/nelssa_vs_baseline.json
