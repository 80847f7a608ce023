"""Run a benchmark as another CPU family would: ``--isa avx2|avx512|avx512_bf16|native``.

fastdl reads its cap from ``FASTDL_CPU_ISA``; PyTorch's CPU libraries each read their own, once per process, so a
capped run is a subprocess with all of them set before torch is imported (checked on an AMD EPYC Zen 4, torch
2.14.1):

- fastdl: ``FASTDL_CPU_ISA`` caps every fastdl CPU kernel family (csrc/cpu/cpu_isa.h).
- ATen: ``ATEN_CPU_CAPABILITY`` caps ATen's vectorised kernels (``torch.backends.cpu.get_cpu_capability()`` reads
  AVX2). A bf16 ``F.linear`` that oneDNN does not take runs ``at::native::AVX2::bf16_dot_with_fp32_arith`` (seen with
  perf): the same slow path as on an AVX2-only CPU.
- oneDNN: ``ONEDNN_MAX_CPU_ISA`` caps its JIT kernels; at ``AVX2`` oneDNN reports no bf16 support
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), so PyTorch stops sending bf16 matmuls to it, exactly
  as on an AVX2-only CPU (no oneDNN primitive runs: ``ONEDNN_VERBOSE=1`` prints nothing).
- MKL: ``MKL_ENABLE_INSTRUCTIONS`` caps MKL's code path on Intel CPUs only ("not available on non-Intel processors",
  oneMKL developer guide). On AMD, MKL always runs its generic branch with Zen (AVX2) kernels
  (``mkl_blas_def_sgemm_kernel_0_zen`` with and without the cap, seen with perf): fp32 ``F.linear`` is the same
  kernel natively and capped there.
- fbgemm: ``FBGEMM_ENABLE_INSTRUCTIONS`` caps the GEMM kernel family of ``fbgemmInstructionSet()``, i.e. PyTorch's
  dynamic-quantized int8 ``nn.Linear``.

A capped run on a bigger CPU is not a run on the smaller one: the caps remove instructions, not the bigger CPU's
caches, memory bandwidth or clock (a Zen 2 has about half the memory bandwidth per core of a Zen 4 and a smaller L3 per
CCX). Every benchmark says which CPU it ran on, at which level, and whether that level was capped.
"""

from __future__ import annotations

import os
import subprocess
import sys

LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")
CHOICES = ("avx2", "avx512", "avx512_bf16", "native")

# Per fastdl ISA level: the variable of each library and its value. avx512 is fastdl's level "AVX-512 F/BW/DQ/VL
# (+ VNNI, VBMI2), no AVX512-BF16" (Ice Lake / Cascade Lake class); avx512_bf16 adds AVX512-BF16 but no AMX.
CAPS: dict[str, dict[str, str]] = {
    "avx2": {
        "FASTDL_CPU_ISA": "avx2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {
        "FASTDL_CPU_ISA": "avx512",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1",
    },
    "avx512_bf16": {
        "FASTDL_CPU_ISA": "avx512_bf16",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512_E1",
    },
}
CAP_VARS = tuple(CAPS["avx2"])
# Set in the child process: the level it was started for (so it runs in place instead of starting another child).
CHILD_MARK = "FASTDL_BENCH_ISA"


def detected_level() -> str:
    from .._extension import cpu_info

    return cpu_info()["detected_level"]


def check_level(isa: str) -> None:
    """Raise ValueError when ``isa`` is not a level this CPU can run (a cap cannot add instructions)."""
    if isa not in CHOICES:
        raise ValueError(f"--isa must be one of {', '.join(CHOICES)}, got {isa!r}")
    if isa == "native":
        return
    have = detected_level()
    if LEVELS.index(isa) > LEVELS.index(have):
        raise ValueError(f"--isa {isa}: this CPU's level is {have}; a cap can only lower it")


def child_env(isa: str, base: dict | None = None) -> dict:
    """The environment of a run at ``isa``: every cap variable removed, then the level's set (none for native)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in CAP_VARS}
    env.update(CAPS.get(isa, {}))
    env[CHILD_MARK] = isa
    return env


def in_child(isa: str) -> bool:
    return os.environ.get(CHILD_MARK) == isa


def rerun(argv: list[str], isa: str) -> int:
    """Run ``fastdl <argv>`` in a subprocess at ``isa``; returns its exit status. Output streams through."""
    check_level(isa)
    env = child_env(isa)
    caps = " ".join(f"{k}={v}" for k, v in CAPS.get(isa, {}).items()) or "no caps (native)"
    print(f"[fastdl --isa {isa}] running in a subprocess with {caps}", flush=True)
    cmd = [sys.executable, "-m", "fastdl.cli", *argv]
    return subprocess.call(cmd, env=env)


def env_lines(isa: str) -> str:
    """Shell ``export`` lines for ``isa`` (scripts/main.sh evaluates them)."""
    if isa == "native":
        return "\n".join(f"unset {k}" for k in CAP_VARS)
    return "\n".join(f"export {k}={v}" for k, v in CAPS[isa].items())


def pytorch_levels() -> dict:
    """What PyTorch's libraries run at in this process, as far as each can be asked."""
    import torch

    out = {"aten": torch.backends.cpu.get_cpu_capability()}
    try:
        out["onednn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        out["onednn_bf16"] = None
    out["onednn_max_isa"] = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "native"
    out["mkl_cap"] = os.environ.get("MKL_ENABLE_INSTRUCTIONS") or "native"
    out["fbgemm_cap"] = os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS") or "native"
    return out


def run_context() -> dict:
    """CPU model, fastdl's ISA level and cap, PyTorch's levels, and whether the caps of fastdl and PyTorch agree."""
    from .._extension import cpu_info

    cpu = cpu_info()
    pt = pytorch_levels()
    level = cpu["level"]
    warnings = []
    # ATen has no avx512_bf16 capability: its AVX512 is the top for both fastdl avx512 levels.
    want_aten = {"scalar": "DEFAULT", "avx2": "AVX2"}.get(level, "AVX512")
    if cpu["capped"] and pt["aten"] != want_aten:
        warnings.append(f"fastdl is capped to {level} but PyTorch's ATen runs at {pt['aten']}: ratios are not those "
                        f"of a {level} CPU (run with --isa {level} to cap PyTorch too)")  # fmt: skip
    if cpu["capped"] and level in ("scalar", "avx2") and pt["onednn_bf16"]:
        warnings.append(f"fastdl is capped to {level} but oneDNN still runs bf16 with AVX-512 (set "
                        "ONEDNN_MAX_CPU_ISA=AVX2 or use --isa)")  # fmt: skip
    # PyTorch capped below fastdl's level (the caps of a CPU's own level, e.g. --isa avx2 on an AVX2-only CPU, change
    # nothing for either: no warning then)
    if not cpu["capped"] and any(os.environ.get(k) for k in CAP_VARS[1:]) and pt["aten"] != want_aten:
        warnings.append("PyTorch is capped (" + ", ".join(f"{k}={os.environ[k]}" for k in CAP_VARS[1:]
                                                         if os.environ.get(k)) + ") but fastdl is not")  # fmt: skip
    return {
        "cpu_model": cpu["model"],
        "isa_level": level,
        "detected_level": cpu["detected_level"],
        "isa_capped": bool(cpu["capped"]),
        "kernels": dict(cpu.get("kernels", {})),
        "pytorch": pt,
        "warnings": warnings,
    }


def describe(ctx: dict) -> str:
    """One header line: the CPU, the level and whether it is capped, and PyTorch's levels."""
    lvl = ctx["isa_level"] + (f" (CAPPED; the CPU has {ctx['detected_level']})" if ctx["isa_capped"] else " (native)")
    pt = ctx["pytorch"]
    onednn = {True: "bf16 on", False: "bf16 off", None: "?"}[pt["onednn_bf16"]]
    return (f"CPU {ctx['cpu_model']} | ISA level {lvl} | PyTorch: ATen {pt['aten']}, oneDNN {onednn} "
            f"(max ISA {pt['onednn_max_isa']}), fbgemm {pt['fbgemm_cap']}, MKL {pt['mkl_cap']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``python -m fastdl.bench.isa --env LEVEL``: print the shell lines that cap fastdl and PyTorch to LEVEL (for
    ``eval``); ``--check``: print what this process runs at."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fastdl.bench.isa", description=main.__doc__)
    p.add_argument("--env", choices=CHOICES, default=None, help="print export lines for this level")
    p.add_argument("--check", action="store_true", help="print this process's CPU, levels and caps")
    args = p.parse_args(argv)
    if args.env:
        try:
            check_level(args.env)
        except ValueError as exc:
            print(f"fastdl: {exc}", file=sys.stderr)
            return 2
        print(env_lines(args.env))
    if args.check or not args.env:
        ctx = run_context()
        print(describe(ctx))
        for w in ctx["warnings"]:
            print(f"WARNING: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
