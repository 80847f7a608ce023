#!/usr/bin/env bash
# The main job on a fresh machine: set up, build, and run fastdl's microbenchmarks against PyTorch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/setup_env.sh
fastdl info
fastdl bench fused_linear --csv bench-out/fused_linear.csv "$@"
