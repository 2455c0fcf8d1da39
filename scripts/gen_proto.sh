#!/usr/bin/env bash
# Regenerate nelssa-node's protobuf / gRPC Python code from nelssa/node/proto/nelssa_node.proto with
# the pinned grpcio-tools (nelssa/pins.env). The generated files are committed; tests check that this
# script reproduces them byte for byte.
#   PYTHON  interpreter with grpcio-tools (default: the NELSSA venv's)
#   OUT     output root (default: the checkout; the files land in OUT/nelssa/node/proto/)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-${NELSSA_VENV:-$HOME/.cache/nelssa/venv}/bin/python}
out=${OUT:-$repo}
# shellcheck source=../nelssa/pins.env
source "$repo/nelssa/pins.env"
have=$("$py" -c "import importlib.metadata as m; print(m.version('grpcio-tools'))")
if [ "$have" != "$GRPCIO_TOOLS_VERSION" ]; then
  echo "gen_proto: grpcio-tools $have installed, $GRPCIO_TOOLS_VERSION pinned (run scripts/setup_env.sh)" >&2
  exit 1
fi
mkdir -p "$out/nelssa/node/proto"
cd "$repo"
"$py" -m grpc_tools.protoc -I . --python_out="$out" --grpc_python_out="$out" nelssa/node/proto/nelssa_node.proto
echo "generated $out/nelssa/node/proto/nelssa_node_pb2{,_grpc}.py"
