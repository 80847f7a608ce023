"""``fastdl bench all``: every microbenchmark in one run, a summary of ratios vs PyTorch, one CSV, and a PNG plot of
speedup vs M for each op."""

from __future__ import annotations

import argparse
import importlib
import os
import time

from . import BENCHMARKS
from .common import print_table, write_csv

# The column holding each benchmark's ratio against its PyTorch baseline (> 1: fastdl is faster).
RATIO_KEYS = ("speedup_vs_eager", "x_vs_bf16", "speedup_vs_dense", "speedup_vs_dl0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default="bench-out", help="folder for all.csv, summary.csv and speedup.png")
    p.add_argument("--only", nargs="+", default=None, choices=sorted(BENCHMARKS), help="run only these")
    p.add_argument("--quick", action="store_true", help="fewer shapes and shorter timing (a smoke run)")


def _sub_args(module, device: str, quick: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    argv = []
    if any(a.dest == "device" for a in p._actions):
        argv += ["--device", device]
    if quick:
        dests = {a.dest for a in p._actions}
        if "m" in dests:
            argv += ["--m", "1", "16"]
        if "budget" in dests:
            argv += ["--budget", "0.2"]
    return p.parse_args(argv)


def _ratio(row: dict) -> tuple[str | None, float | None]:
    for k in RATIO_KEYS:
        if row.get(k) is not None:
            return k, row[k]
    return None, None


def summarize(rows_by_bench: dict[str, list[dict]]) -> list[dict]:
    """One line per fastdl measurement: bench, mode, shape, provider, ratio vs its PyTorch baseline."""
    out = []
    for bench, rows in rows_by_bench.items():
        for r in rows:
            prov = str(r.get("provider") or r.get("loader") or r.get("name") or "")
            if "fastdl" not in prov and bench != "loader":
                continue
            key, val = _ratio(r)
            if key is None:
                continue
            shape = "x".join(str(r[k]) for k in ("M", "K", "N") if r.get(k) is not None)
            out.append({"bench": bench, "mode": r.get("mode") or r.get("kind") or "", "shape": shape,
                        "M": r.get("M"), "provider": prov, "ratio": val, "baseline": key.split("_", 2)[-1]})
    return out


def plot(summary: list[dict], path: str) -> str | None:
    """Speedup vs M per op (log-2 x axis); returns the path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    benches = [b for b in dict.fromkeys(s["bench"] for s in summary) if any(s["M"] for s in summary if s["bench"] == b)]
    if not benches:
        return None
    fig, axes = plt.subplots(1, len(benches), figsize=(6 * len(benches), 4.5), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        series: dict[str, list[tuple[int, float]]] = {}
        for s in summary:
            if s["bench"] == bench and s["M"]:
                shape_kn = "x".join(s["shape"].split("x")[1:])
                label = f"{s['provider']} {s['mode']} K,N={shape_kn}".strip()
                series.setdefault(label, []).append((s["M"], s["ratio"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of x)")
        ax.set_ylabel("speedup vs PyTorch baseline")
        ax.set_title(bench)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args) -> list[dict]:
    os.makedirs(args.out, exist_ok=True)
    rows_by_bench: dict[str, list[dict]] = {}
    all_rows = []
    for name, module_name in BENCHMARKS.items():
        if args.only and name not in args.only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            print(f"== {name}: unavailable ({exc})")
            continue
        print(f"\n== {name}")
        t0 = time.perf_counter()
        sub = _sub_args(module, args.device, args.quick)
        sub.csv = os.path.join(args.out, f"{name}.csv") if hasattr(sub, "csv") else None
        rows = module.run(sub) or []
        print(f"({name}: {time.perf_counter() - t0:.0f} s)")
        rows_by_bench[name] = rows
        all_rows += [{"bench": name, **r} for r in rows]
    summary = summarize(rows_by_bench)
    print("\n== summary: fastdl vs its PyTorch baseline (ratio > 1: fastdl faster)")
    print_table(summary, [("bench", "bench"), ("mode", "mode"), ("shape", "MxKxN"), ("provider", "provider"),
                          ("baseline", "vs"), ("ratio", "ratio")])
    write_csv(all_rows, os.path.join(args.out, "all.csv"))
    write_csv(summary, os.path.join(args.out, "summary.csv"))
    png = plot(summary, os.path.join(args.out, "speedup.png"))
    if png:
        print(f"plot: {png}")
    return all_rows
