#!/usr/bin/env bash
# The test command (CI runs exactly this): environment, C++ extension, model, then pytest.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup_env.sh | tail -n 1)
echo "[test] building nelssa._C (incremental)" >&2
"$py" setup.py -q build_ext --inplace >/dev/null
echo "[test] preparing SmolLM2" >&2
"$py" -m nelssa.cli prepare-model
echo "[test] $("$py" -m nelssa.cpu)" >&2
echo "[test] pytest" >&2
exec "$py" -m pytest -q "$@"
