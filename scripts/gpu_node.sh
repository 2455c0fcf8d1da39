# Sourced by scripts/gpu_hol.sh and scripts/gpu_bench.sh on the lent GPU host (no network there):
#   grpc_wheels              grpcio/protobuf newer than the host's (the generated stubs need them), from the
#                            carried .wheels, once per machine (/tmp survives while the machine stays warm)
#   start_node LOG ARGS...   nelssa-node on 127.0.0.1:50151 with ARGS, its output in LOG, stopped when the
#                            calling script exits; returns once it listens (exits 2 with its log if it does not)
grpc_wheels() {
  [ -d /tmp/wheels/grpc ] || pip install -q --no-deps --target /tmp/wheels .wheels/*.whl
  export PYTHONPATH=/tmp/wheels:$PYTHONPATH
}

start_node() {
  local log=$1
  shift
  grpc_wheels
  python3 -m nelssa.node --port 50151 --log-level WARNING "$@" > "$log" 2>&1 &
  node_pid=$!
  trap 'kill $node_pid 2>/dev/null; wait $node_pid 2>/dev/null' EXIT
  for _ in $(seq 120); do grep -q "listening" "$log" && break; sleep 0.5; done
  grep "listening" "$log" || { cat "$log"; exit 2; }
}
