#!/usr/bin/env bash
# The main job on the embedded default: environment, extension, model, then the host-tier
# benchmarks (sparse-attention kernel vs naive torch vs read bandwidth; accuracy on real KV).
# Results: results/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup_env.sh | tail -n 1)
"$py" setup.py -q build_ext --inplace >/dev/null
"$py" -m nelssa.cli prepare-model
mkdir -p results
"$py" -m nelssa.bench.sparse_attention --out results/bench_sparse_attention.json "$@"
"$py" -m nelssa.bench.real_kv --out results/real_kv.json
