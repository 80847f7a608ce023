#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install fastdl into it with its compiled extension.
# Usage: source scripts/setup_env.sh      (env: VENV=path to use another location; PYTHON=python3.11 ...)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "== installing requirements (requirements/dev.txt)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/dev.txt"
echo "== building and installing fastdl (editable, compiled extension fastdl._C)"
t0=$(date +%s)
( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e . )
echo "== build took $(( $(date +%s) - t0 )) s"
export PATH="$VENV/bin:$PATH"
