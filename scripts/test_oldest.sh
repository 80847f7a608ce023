#!/usr/bin/env bash
# CI's second job: the whole test suite on the oldest supported pair, torch 2.11.0 + triton 3.6.0
# (requirements/oldest.txt), with the extension built against it (C++ and CUDA sources).
#
# It works on a fresh copy of the checkout in .venv-oldest/src (the files git tracks plus untracked ones that are not
# ignored), so its build never touches the main checkout's fastdl/_C*.so, which belongs to .venv's torch.
# Env: VENV_OLDEST (default .venv-oldest), PYTHON (default python3), MAX_JOBS; extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV_OLDEST:-$ROOT/.venv-oldest}"
PYTHON="${PYTHON:-python3}"
SRC="$VENV/src"
cd "$ROOT"
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo "== installing requirements/oldest.txt (torch 2.11.0 + triton 3.6.0)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements/oldest.txt
t1=$(date +%s)
echo "== copying the checkout to $SRC"
rm -rf "$SRC"
mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"  # skip files deleted but not yet committed
done | tar --null -T - -cf - | tar -xf - -C "$SRC"
echo "== building and installing fastdl into $VENV (editable in the copy, compiled extension fastdl._C)"
( cd "$SRC" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    --no-build-isolation --no-deps -e . )
t2=$(date +%s)
cd "$SRC"
export PATH="$VENV/bin:$PATH"
python - <<'PY'
import sys

import torch
import triton

import fastdl

info = fastdl.info(print_result=True)
if info["extension"]["source"] == "missing":
    sys.exit("fastdl._C did not build: see the pip output above")
want = {"torch": "2.11.0", "triton": "3.6.0"}
have = {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}
if have != want:
    sys.exit(f"the oldest job must run {want}, got {have}")
PY
echo "== pytest (torch 2.11.0 + triton 3.6.0)"
python -m pytest -q "$@"
t3=$(date +%s)
echo "== oldest job: install $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s"
