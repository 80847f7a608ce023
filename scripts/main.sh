#!/usr/bin/env bash
# The main job on a fresh machine: set up and build, then `fastdl info`, `fastdl demo` (DDP training with FusedLinear
# and the PrefetchLoader, 2:4 pruning + fine-tuning, int8 and 2:4 inference, each beside every PyTorch option a user
# could pick here), `fastdl bench all --quick` (every benchmark, time-boxed), and a closing summary that names the CPU
# and says on its last line whether fastdl was slower than PyTorch anywhere.
#
# Usage: bash scripts/main.sh [--isa avx2|avx512|avx512_bf16|native] [--out DIR] [--no-setup]
#   --isa (or FASTDL_CPU_ISA=...): run everything as on a CPU of that level, fastdl AND PyTorch capped together
#   (see fastdl/bench/isa.py). Results go to DIR (default bench-out/). --no-setup: skip step 1 and use the python
#   and fastdl already on PATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ISA="${FASTDL_CPU_ISA:-}"
OUT=bench-out
SETUP=1
while [ $# -gt 0 ]; do
    case "$1" in
        --isa) ISA="$2"; shift 2 ;;
        --isa=*) ISA="${1#--isa=}"; shift ;;
        --out) OUT="$2"; shift 2 ;;
        --no-setup) SETUP=0; shift ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "scripts/main.sh: unknown argument $1 (expected --isa LEVEL, --out DIR or --no-setup)" >&2; exit 2 ;;
    esac
done

cat <<EOF
== fastdl main job: what runs, and about how long (measured on 2 cores; a busy machine takes longer)
  1. setup: .venv, requirements, build of fastdl (seconds when already built; a fresh build takes 4-5 minutes)
  2. fastdl info: versions, the CPU, its ISA level and the kernel family of each capability
  3. fastdl demo (~1 min): train an MLP with DDP (fastdl FusedLinear vs PyTorch fp32 and bf16), prune to 2:4 and
     fine-tune, int8 and 2:4 inference vs PyTorch fp32 / bf16 / int8 (fbgemm); a verdict per stage
  4. fastdl bench all --quick (~3.5 min, time-boxed at 210 s): fused_linear, int8, int4, sparse24, call overhead, whole
     models (BERT-style encoder, LLaMA-style decoder), loader; every row printed as it is measured
  5. summary: the CPU and, per stage, fastdl vs the fastest PyTorch option; the last line says if fastdl was slower
  After setup: about 4-5 minutes (at most 6). Results: $OUT/
EOF

if [ "$SETUP" = 1 ]; then
    source scripts/setup_env.sh
fi
if [ -n "$ISA" ]; then
    caps="$(python -m fastdl.bench.isa --env "$ISA")"
    eval "$caps"
    echo "== ISA cap $ISA for fastdl and PyTorch: $(echo "$caps" | tr '\n' ' ')"
fi
mkdir -p "$OUT"
t0=$(date +%s)
echo "== fastdl info"
fastdl info
echo "== fastdl demo  ($(( $(date +%s) - t0 )) s)"
fastdl demo --json "$OUT/demo.json" || echo "!! fastdl demo missed a bar (see above); continuing"
echo "== fastdl bench all --quick  ($(( $(date +%s) - t0 )) s)"
fastdl bench all --quick --out "$OUT"
FASTDL_MAIN_ELAPSED=$(( $(date +%s) - t0 )) fastdl summary "$OUT"
