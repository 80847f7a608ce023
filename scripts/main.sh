#!/usr/bin/env bash
# The main job on a fresh machine: set up and build, then `fastdl demo` (DDP training with FusedLinear and the
# PrefetchLoader, 2:4 pruning + fine-tuning, int8 and 2:4 inference, side by side with plain PyTorch), then the
# fused-linear microbenchmark against PyTorch. Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
fastdl info
fastdl demo
fastdl bench fused_linear --csv bench-out/fused_linear.csv "$@"
