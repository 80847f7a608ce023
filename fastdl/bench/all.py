"""``fastdl bench all``: every benchmark in one run, time-boxed, then a summary of fastdl vs PyTorch (every
measurement where fastdl is slower listed loudly), one CSV, a JSON summary and a PNG plot of speedup vs M per op.

The time box (``--time-box``, default 540 s; 210 s with ``--quick``) is shared among the benchmarks by weight; a
benchmark that finishes early leaves its time to the next ones, and one that runs out skips its remaining shapes
(and says so) after the shape it is measuring. Each benchmark runs with its ``ALL_ARGS`` (``QUICK_ARGS`` with
``--quick``): fused_linear without the torch.compile baseline (compiling every shape would take the whole box; run
``fastdl bench fused_linear`` for it)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

from . import BENCHMARKS
from .common import context, print_table, pyplot, say, set_deadline, stop_requested, write_csv

# Share of the time box per benchmark (the model benchmark converts and runs whole models; overhead is cheap).
WEIGHTS = {"fused_linear": 0.2, "int8": 0.16, "int4": 0.1, "sparse24": 0.09, "overhead": 0.05, "model": 0.42,
           "loader": 0.08}  # fmt: skip
# --quick: the microbenchmarks run 3 shapes each (int4: 6, weights cold); the whole models get the largest share.
# int4's weight and the 40 s added to the quick box give it ~40 s there and leave the others' seconds as before
# (the full box stays 540 s, under 10 minutes: int4 gets ~49 s of it, the others 9 % less than before).
QUICK_WEIGHTS = {"fused_linear": 0.19, "int8": 0.13, "int4": 0.235, "sparse24": 0.08, "overhead": 0.06, "model": 0.47,
                 "loader": 0.07}  # fmt: skip
# The box bounds when a benchmark starts its next shape; the shape it is measuring then finishes (the slowest: one
# model policy, ~30 s on a busy machine), so the whole run stays under 10 minutes (quick: about 4).
DEFAULT_TIME_BOX = {False: 540.0, True: 210.0}
# Per benchmark: the row key holding the ratio against the PyTorch path fastdl replaces (> 1: fastdl faster), and
# what that path is.
REPLACED = {
    "fused_linear": ("x_eager", "eager PyTorch, same dtype"),
    "int8": ("x_replaced", "fbgemm int8 (W8A8) / best float eager (weight-only)"),
    "int4": ("x_replaced", "eager fp32 F.linear (weights cold)"),
    "sparse24": ("x_dense", "dense bf16 F.linear"),
    "overhead": ("x_linear", "nn.Linear + activation"),
    "model": ("x_fp32", "fp32 original model"),
    "loader": ("x_baseline", "the DataLoader it wraps (row 'fastest': the fastest DataLoader)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--out", default="bench-out", help="folder for the CSVs, summary.json and speedup.png")
    p.add_argument("--only", nargs="+", default=None, choices=sorted(BENCHMARKS), help="run only these")
    p.add_argument("--skip", nargs="+", default=[], choices=sorted(BENCHMARKS), help="leave these out")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes, shorter timing, small models, no torch.compile (the main job's size)")
    p.add_argument("--time-box", type=float, default=None,
                   help="seconds for all benchmarks together (default 540; 210 with --quick)")


def _sub_args(module, name: str, device: str, quick: bool, out: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    dests = {a.dest for a in p._actions}
    argv = []
    if "device" in dests:
        argv += ["--device", device]
    argv += list(getattr(module, "QUICK_ARGS" if quick else "ALL_ARGS", []))
    if "csv" in dests:
        argv += ["--csv", os.path.join(out, f"{name}.csv")]
    return p.parse_args(argv)


def summarize(rows_by_bench: dict[str, list[dict]]) -> list[dict]:
    """One line per judged fastdl measurement: bench, what, ratio vs the PyTorch path it replaces, vs the best
    PyTorch path, and whether it is slower."""
    out = []
    for bench, rows in rows_by_bench.items():
        key, _ = REPLACED.get(bench, (None, None))
        for r in rows:
            if bench == "loader" and "slower" not in r:  # rows of a loader bench before x_baseline: vs dl0
                if not str(r.get("loader", "")).startswith("fastdl"):
                    continue
                ratio = r.get("speedup_vs_dl0")
                slower = f"{ratio:.2f}x DataLoader(num_workers=0)" if ratio is not None and ratio < 1 else ""
            elif "slower" in r:  # a judged fastdl row (x best when the replaced path was not timed: a slow path)
                ratio, slower = (r.get(key) if r.get(key) is not None else r.get("x_best")), r["slower"]
            else:
                continue
            shape = "x".join(str(r[k]) for k in ("M", "K", "N") if r.get(k) is not None)
            if r.get("batch") is not None:
                shape = f"b{r['batch']}" + (f" s{r['seq']}" if r.get("seq") else "")
            out.append({
                "bench": bench, "mode": r.get("mode") or r.get("kind") or r.get("model") or r.get("grad") or "",
                "what": r.get("policy") or r.get("module") or r.get("provider") or r.get("loader") or "",
                "shape": shape, "M": r.get("M"), "x_replaced": ratio, "x_best": r.get("x_best"),
                "best_pytorch": r.get("best_pytorch") or "", "slower": slower,
                "reduced": bool(r.get("reduced")),
            })  # fmt: skip
    return out


def plot(summary: list[dict], path: str) -> str | None:
    """Speedup vs M per op (log-2 x axis) against the path fastdl replaces; None when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    benches = [b for b in dict.fromkeys(s["bench"] for s in summary) if any(s["M"] for s in summary if s["bench"] == b)]
    if not benches:
        return None
    fig, axes = plt.subplots(1, len(benches), figsize=(6 * len(benches), 4.5), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        series: dict[str, list[tuple[int, float]]] = {}
        for s in summary:
            if s["bench"] == bench and s["M"] and s["x_replaced"] is not None:
                shape_kn = "x".join(s["shape"].split("x")[1:])
                label = f"{s['what']} {s['mode']} K,N={shape_kn}".strip()
                series.setdefault(label, []).append((s["M"], s["x_replaced"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (rows of x)")
        ax.set_ylabel("speedup vs the PyTorch path replaced")
        ax.set_title(bench)
        ax.legend(fontsize=6)
    ctx = context()
    fig.suptitle(f"{ctx['cpu_model']}, ISA {ctx['isa_level']}{' (capped)' if ctx['isa_capped'] else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(args) -> list[dict]:
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in BENCHMARKS if (not args.only or n in args.only) and n not in args.skip]
    box = args.time_box if args.time_box is not None else DEFAULT_TIME_BOX[bool(args.quick)]
    ctx = context()
    say(f"fastdl bench all{' --quick' if args.quick else ''}: {', '.join(names)}; time box {box:.0f} s; "
        f"CPU {ctx['cpu_model']}, ISA level {ctx['isa_level']}{' (capped)' if ctx['isa_capped'] else ''}")
    t_all = time.monotonic()
    rows_by_bench: dict[str, list[dict]] = {}
    all_rows: list[dict] = []
    timing = {}
    for i, name in enumerate(names):
        try:
            module = importlib.import_module(BENCHMARKS[name])
        except ImportError as exc:
            say(f"\n== {name}: unavailable ({exc})")
            continue
        weights = QUICK_WEIGHTS if args.quick else WEIGHTS
        left = box - (time.monotonic() - t_all)
        rest = sum(weights.get(n, 0.1) for n in names[i:])
        # its share of what is left, but never under 70% of its share of the whole box: a benchmark that ran over
        # (it stops after the shape it is measuring) does not starve the ones after it
        weight = weights.get(name, 0.1) / sum(weights.get(n, 0.1) for n in names)
        share = max(5.0, left * weights.get(name, 0.1) / rest, 0.7 * box * weight)
        set_deadline(share)
        say(f"\n== [{i + 1}/{len(names)}] {name} (time box {share:.0f} s; {time.monotonic() - t_all:.0f} s so far)")
        t0 = time.monotonic()
        sub = _sub_args(module, name, args.device, args.quick, args.out)
        try:
            rows = module.run(sub) or []
        except KeyboardInterrupt:
            say(f"   {name} interrupted")
            rows = []
            break
        except Exception as exc:  # one broken benchmark does not hide the others' results
            say(f"!! {name} FAILED: {type(exc).__name__}: {exc}")
            rows = []
        finally:
            set_deadline(None)
        timing[name] = time.monotonic() - t0
        say(f"({name}: {timing[name]:.0f} s)")
        rows_by_bench[name] = rows
        all_rows += [{"bench": name, **r} for r in rows]
        if stop_requested():
            say(f"   stopped: the benchmarks after {name} do not run")
            break
    summary = summarize(rows_by_bench)
    say(f"\n== summary: fastdl vs PyTorch on {ctx['cpu_model']}, ISA {ctx['isa_level']}"
        f"{' (capped; the CPU has ' + ctx['detected_level'] + ')' if ctx['isa_capped'] else ' (native)'}")
    say("   x repl: vs the PyTorch path fastdl replaces; x best: vs the fastest PyTorch option measured there")
    print_table(summary, [("bench", "bench"), ("mode", "mode"), ("what", "what"), ("shape", "shape"),
                          ("x_replaced", "x repl"), ("x_best", "x best"), ("best_pytorch", "best PyTorch"),
                          ("slower", "SLOWER than")])  # fmt: skip
    slower = [s for s in summary if s["slower"]]
    write_csv(all_rows, os.path.join(args.out, "all.csv"))
    write_csv(summary, os.path.join(args.out, "summary.csv"))
    total = time.monotonic() - t_all
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"context": ctx, "quick": bool(args.quick), "seconds": total, "seconds_per_bench": timing,
                   "summary": summary}, f, indent=1, default=str)  # fmt: skip
    png = plot(summary, os.path.join(args.out, "speedup.png"))
    if png:
        say(f"plot: {png}")
    say(f"bench all took {total:.0f} s")
    if slower:
        say(f"!! fastdl is SLOWER than PyTorch in {len(slower)} of {len(summary)} measurements:")
        for s in slower:
            say(f"!!   {s['bench']} {s['mode']} {s['what']} {s['shape']}: {s['slower']}")
    else:
        say(f"fastdl is at least as fast as PyTorch in all {len(summary)} measurements.")
    return all_rows
