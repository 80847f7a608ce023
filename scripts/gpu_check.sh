#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and its own torch (no install needed), JIT-build the extension, run the
# test suite (CUDA tests included) and the GPU benchmarks; logs and CSVs go to OUTDIR. Budget: < 8 min on an H200.
# Usage: bash scripts/gpu_check.sh OUTDIR [PYTHON]
set -uo pipefail
OUT="${1:?usage: gpu_check.sh OUTDIR [PYTHON]}"
PY="${2:-python}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" FASTDL_JIT=1 FASTDL_JIT_DIR="${FASTDL_JIT_DIR:-/tmp/fastdl-jit}"
export MAX_JOBS="${MAX_JOBS:-16}"
t0=$(date +%s)
step() { echo "== [$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/summary.txt"; }

step "environment"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee -a "$OUT/summary.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv >>"$OUT/summary.txt" 2>&1

step "JIT build (CUDA for the visible GPU)"
timeout 300 "$PY" -c "import fastdl; fastdl.load_extension(jit=True); fastdl.info()" >"$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/summary.txt"
tail -25 "$OUT/build.log" >>"$OUT/summary.txt"

step "tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests >"$OUT/tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/summary.txt"
tail -30 "$OUT/tests.log" >>"$OUT/summary.txt"

step "benchmarks"
timeout 180 "$PY" -m fastdl.bench fused_linear --device cuda --budget 0.5 --csv "$OUT/fused_linear.csv" \
    >"$OUT/bench.log" 2>&1
echo "fused_linear bench rc=$?" | tee -a "$OUT/summary.txt"
for extra in loader int8 sparse24; do
    if "$PY" -c "import importlib,sys; importlib.import_module('fastdl.bench.$extra')" 2>/dev/null; then
        timeout 120 "$PY" -m fastdl.cli bench "$extra" --device cuda --csv "$OUT/$extra.csv" >>"$OUT/bench.log" 2>&1
        echo "$extra bench rc=$?" | tee -a "$OUT/summary.txt"
    fi
done
step "done"
