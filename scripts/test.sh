#!/usr/bin/env bash
# The whole test suite on a fresh machine: environment, build (C++ and CUDA sources), lint, tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
python - <<'PY'
import fastdl, sys
info = fastdl.info(print_result=True)
if info["extension"]["source"] == "missing":
    sys.exit("fastdl._C did not build: see the build log (.venv/.fastdl-build.log, or $VENV/.fastdl-build.log)")
PY
echo "== compiler warnings from csrc/ in the last build (-Wall -Wextra)"
python scripts/check_build_warnings.py "$VENV/.fastdl-build.log"
echo "== ruff"
ruff check fastdl kernels tests scripts setup.py
echo "== clang-format"
find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | xargs clang-format --dry-run --Werror
echo "== pytest"
python -m pytest -q "$@"
