"""``fastdl summary [DIR]``: the main job's closing summary, from ``DIR/demo.json`` (``fastdl demo --json``) and
``DIR/summary.json`` (``fastdl bench all``). It names the CPU (model, ISA level, capped or not, the kernel family of
each capability), gives per demo stage and per benchmark fastdl's speed against the fastest PyTorch option, and its
last line says whether fastdl was slower than PyTorch anywhere."""

from __future__ import annotations

import json
import os
import statistics


def _load(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summary_lines(demo: dict | None, bench: dict | None, elapsed: float | None = None) -> list[str]:
    lines = ["== main job summary"]
    ctx = (bench or {}).get("context") or {}
    cpu = (demo or {}).get("cpu") or {}
    model = ctx.get("cpu_model") or cpu.get("model") or "unknown CPU"
    level = ctx.get("isa_level") or cpu.get("level") or "?"
    detected = ctx.get("detected_level") or cpu.get("detected_level") or level
    capped = ctx.get("isa_capped", cpu.get("capped", False))
    kernels = ctx.get("kernels") or cpu.get("kernels") or {}
    lines.append(f"CPU: {model}")
    lines.append(f"ISA level: {level}" + (f" (CAPPED: the CPU has {detected}; PyTorch capped alike)" if capped
                                          else " (native)"))  # fmt: skip
    if kernels:
        lines.append("fastdl CPU kernels: " + ", ".join(f"{k}: {v}" for k, v in kernels.items()))
    pt = ctx.get("pytorch") or {}
    if pt:
        lines.append(f"PyTorch: ATen {pt.get('aten')}, oneDNN bf16 {'on' if pt.get('onednn_bf16') else 'off'}, "
                     f"fbgemm {pt.get('fbgemm_cap')}, MKL {pt.get('mkl_cap')}")  # fmt: skip
    if capped:
        lines.append("(a capped run removes instructions, not the bigger CPU's caches, memory bandwidth or clock)")
    slower_stages: list[str] = []
    if demo:
        lines.append("demo: fastdl vs the fastest PyTorch option per stage")
        for st in demo.get("stages", []):
            if st.get("ratio") is None:
                continue
            best = st["best"].replace("pytorch_", "PyTorch ")
            mark = "SLOWER" if st["slower"] else "faster"
            lines.append(f"  {st['stage']:<30} {st['ratio']:5.2f}x {best:<14} {mark}")
            if st["slower"]:
                slower_stages.append(f"{st['stage']} ({st['ratio']:.2f}x {best})")
            for row in st.get("slower_same_precision", []):  # a fastdl row slower than PyTorch at its own precision
                lines.append(f"  {'':<30} SLOWER at the same precision: {row}")
                slower_stages.append(f"{st['stage']}: {row}")
        missed = demo.get("missed") or []
        lines.append("  accuracy bars: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    else:
        lines.append("demo: no results (did it run?)")
    slower_bench = []
    if bench:
        summ = bench.get("summary", [])
        lines.append(f"benchmarks (bench all{' --quick' if bench.get('quick') else ''}, {bench.get('seconds', 0):.0f} "
                     f"s): {len(summ)} fastdl measurements")  # fmt: skip
        for name in dict.fromkeys(s["bench"] for s in summ):
            rs = [s for s in summ if s["bench"] == name and s.get("x_replaced") is not None]
            if not rs:
                continue
            xs = [s["x_replaced"] for s in rs]
            n_slow = sum(1 for s in summ if s["bench"] == name and s.get("slower"))
            lines.append(f"  {name:<13} vs the PyTorch path replaced: median {statistics.median(xs):.2f}x, "
                         f"min {min(xs):.2f}x; slower than PyTorch in {n_slow} of {len(rs)}")  # fmt: skip
        slower_bench = [s for s in summ if s.get("slower")]
        for s in slower_bench[:15]:
            lines.append(f"  SLOWER: {s['bench']} {s['mode']} {s['what']} {s['shape']}: {s['slower']}")
        if len(slower_bench) > 15:
            lines.append(f"  ... and {len(slower_bench) - 15} more (bench-out/summary.csv)")
    else:
        lines.append("benchmarks: no results (did bench all run?)")
    if elapsed is not None:
        lines.append(f"main job: {elapsed:.0f} s after setup")
    where = f"{level}{' capped' if capped else ''} on {model}"
    if slower_stages or slower_bench:
        parts = []
        if slower_stages:
            parts.append(f"{len(slower_stages)} demo stage(s): " + "; ".join(slower_stages))
        if slower_bench:
            parts.append(f"{len(slower_bench)} benchmark measurement(s) (listed above)")
        lines.append(f"RESULT ({where}): fastdl is SLOWER than PyTorch in " + " and ".join(parts))
    else:
        lines.append(f"RESULT ({where}): fastdl is at least as fast as PyTorch in every demo stage and benchmark "
                     "measurement")  # fmt: skip
    return lines


def main_job_summary(folder: str, elapsed: float | None = None) -> int:
    if elapsed is None and os.environ.get("FASTDL_MAIN_ELAPSED"):
        try:
            elapsed = float(os.environ["FASTDL_MAIN_ELAPSED"])
        except ValueError:
            elapsed = None
    demo = _load(os.path.join(folder, "demo.json"))
    bench = _load(os.path.join(folder, "summary.json"))
    print("\n".join(summary_lines(demo, bench, elapsed)), flush=True)
    return 0
