"""``fastdl bench fused_linear``: fastdl's fused linear vs eager PyTorch (``F.linear`` + activation), eager fp32 (what a
PyTorch user picks where bf16 is PyTorch's slow path, e.g. on AVX2-only CPUs) and ``torch.compile``, in one process on
the same inputs, calls interleaved.

Modes: ``fwd`` (inference forward in bf16), ``fwd_fp32`` (inference forward in fp32) and ``train`` (one training
step of the layer: forward + backward under ``torch.autocast`` bf16 with fp32 master weights, gradients for x, weight
and bias; its fp32 baseline is the same step in plain fp32).

Columns: ms (median; ``*``: a slow call timed 1-2 times), x eager (eager time / time in the same mode: > 1 is faster),
x fp32 (vs the eager fp32 step), x best (vs the fastest PyTorch provider measured at that shape), GFLOP/s, % peak (of
the faster of bf16 and fp32 ``torch.mm`` 2048^3 here), W GB/s. A fastdl row slower than any of them is marked
``<<< SLOWER`` and listed again at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F

from .. import backends
from ..ops import fused_linear
from ..ops.fused_linear import ACTIVATIONS, activation_fn
from . import common

MODES = ("fwd", "fwd_fp32", "train")
QUICK_ARGS = ["--m", "1", "16", "128", "--llama-m", "--no-compile", "--budget", "0.25", "--max-call", "2"]
ALL_ARGS = ["--no-compile", "--budget", "0.6"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_shape_arguments(p, llama_default="16 128 on CPU, 4096 on CUDA")
    p.add_argument("--activation", default="gelu", choices=ACTIVATIONS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--backends", nargs="+", default=None,
                   help="fastdl backends to time besides auto (default: every available one other than auto's choice)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per shape")
    p.add_argument("--max-call", type=float, default=10.0,
                   help="skip a PyTorch baseline predicted (from a smaller M) to take longer than this many seconds a "
                        "call (default 10)")  # fmt: skip
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


def _eager_fn(act):
    def eager(x, w, b):
        return activation_fn(F.linear(x, w, b), act)

    return eager


_COMPILED: dict = {}


def _providers(args, act: str, mode: str) -> dict:
    """name -> (function(x, w, b) -> y, backend or None, baseline dtype: 'same' | 'fp32' | None for fastdl)."""
    eager = _eager_fn(act)
    provs = {}
    if mode == "fwd_fp32":
        provs["eager_fp32"] = (eager, None, "same")
    else:
        provs["eager"] = (eager, None, "same")
        provs["eager_fp32"] = (eager, None, "fp32")
    if not args.no_compile:
        key = (act, args.device)
        if key not in _COMPILED:
            cmode = "max-autotune" if args.device.startswith("cuda") else None
            _COMPILED[key] = torch.compile(_eager_fn(act), mode=cmode, dynamic=False)
        provs["compile"] = (_COMPILED[key], None, "same")
    provs["fastdl"] = (lambda x, w, b: fused_linear(x, w, b, act), "auto", None)
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    auto = backends.select("fused_linear", dev)
    names = args.backends or [b for b in backends.BACKENDS if b not in ("torch", auto)]  # auto's already is "fastdl"
    for be in names:
        if be in backends.preference("fused_linear", dev) and backends.available(be, "fused_linear", dev)[0]:
            provs[f"fastdl[{be}]"] = (lambda x, w, b: fused_linear(x, w, b, act), be, None)
    return provs


def _tensors(mode, M, K, N, device, fp32: bool):
    """x, w, b, g for one provider of one mode (fp32: the fp32 baseline's own copies)."""
    gen = torch.Generator(device="cpu").manual_seed(M * 7 + K * 3 + N)
    dt = torch.float32 if (fp32 or mode == "fwd_fp32") else torch.bfloat16
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dt)
    if mode in ("fwd", "fwd_fp32"):
        w = (torch.randn(N, K, generator=gen) / K**0.5).to(device=device, dtype=dt)
        b = torch.randn(N, generator=gen).to(device=device, dtype=dt)
        return x, w, b, None
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device).requires_grad_()  # fp32 master weights
    b = torch.randn(N, generator=gen).to(device).requires_grad_()
    x.requires_grad_()
    g = torch.randn(M, N, generator=gen).to(device=device, dtype=dt)
    return x, w, b, g


def _step(mode, fn, x, w, b, g, device, autocast: bool, backend):
    """One timed call: the no-grad forward, or a training step (under autocast bf16 unless it is the fp32 step)."""
    ctx = (lambda: backends.use_backend(backend)) if backend else contextlib.nullcontext
    if mode != "train":

        def call():
            with ctx(), torch.no_grad():
                return fn(x, w, b)

        return call
    dev_type = "cuda" if device.startswith("cuda") else "cpu"

    def step():
        x.grad = w.grad = b.grad = None
        with ctx():
            if autocast:
                with torch.autocast(device_type=dev_type, dtype=torch.bfloat16):
                    y = fn(x, w, b)
            else:
                y = fn(x, w, b)
            y.backward(g)

    return step


COLUMNS = [("mode", "mode", 8), ("M", "M", 5), ("K", "K", 5), ("N", "N", 5), ("provider", "provider", 14),
           ("ms", "ms", 9), ("x_eager", "x eager", 7), *common.GEMM_RATE_COLUMNS]  # fmt: skip


def run(args) -> list[dict]:
    device = args.device
    torch.manual_seed(0)
    act = args.activation
    common.print_header("fused_linear", device)
    peak = common.measured_matmul_peak(device, torch.bfloat16, torch.float32)
    env = common.env_columns(device)
    common.say(f"   activation {act}; peak = faster of bf16/fp32 torch.mm: {peak / 1e9:.0f} GFLOP/s; "
        f"fastdl backend (auto): {backends.select('fused_linear', 'cuda' if device.startswith('cuda') else 'cpu')}")
    table = common.LiveTable(COLUMNS)
    predictor = common.CallPredictor(args.max_call)
    shapes = common.gemm_shapes(args, cpu_llama_m=[16, 128], cuda_llama_m=[4096])
    work = [(mode, shape) for mode in args.modes for shape in shapes]
    try:
        for i, (mode, (M, K, N)) in enumerate(work):
            if common.over_time(f"{len(work) - i} of {len(work)} shapes"):
                break
            common.activity(f"fused_linear {mode} M={M} K={K} N={N}")
            provs = _providers(args, act, mode)
            calls, meta = {}, {}
            shared = _tensors(mode, M, K, N, device, fp32=False)
            fp32_set = None
            flops = M * N * K
            skipped = []
            for name, (fn, be, base) in provs.items():
                ok, pred = predictor.allowed((mode, name, K, N), flops)
                # only an alternative in the slow dtype is skipped: eager fp32 is every row's fallback reference
                if base is not None and name != "eager_fp32" and not ok:
                    common.say(f"  {name} not timed at {mode} M={M} K={K} N={N}: predicted {pred:.0f} s a call from a "
                        f"smaller M (> --max-call {args.max_call:g} s; a slow path)")  # fmt: skip
                    skipped.append(name)
                    continue
                if base == "fp32":
                    fp32_set = fp32_set or _tensors(mode, M, K, N, device, fp32=True)
                    x, w, b, g = fp32_set
                    calls[name] = _step(mode, fn, x, w, b, g, device, autocast=False, backend=be)
                else:
                    x, w, b, g = shared
                    calls[name] = _step(mode, fn, x, w, b, g, device, autocast=True, backend=be)
                meta[name] = base
            try:
                try:
                    if "compile" in calls:
                        # compile time is not call time: the first call of a compiled function compiles it for this
                        # shape (seconds); timed as interleaved()'s probe it became the row (9-27 s at 1x512x512)
                        t0 = time.perf_counter()
                        calls["compile"]()
                        common.sync(device)
                        common.say(f"  compile: {time.perf_counter() - t0:.1f} s to compile {mode} M={M} K={K} N={N} "
                            "(a warm-up, not timed as a call)")  # fmt: skip
                    times = common.interleaved(calls, device, budget_s=args.budget)
                except Exception as exc:  # a provider that cannot run here is reported, then the shape without it
                    common.say(f"  a provider failed at {mode} M={M} K={K} N={N}: {type(exc).__name__}: {exc}; "
                               "retrying without compile")  # fmt: skip
                    calls.pop("compile", None)
                    times = common.interleaved(calls, device, budget_s=args.budget)
                for name, t in times.items():
                    predictor.record((mode, name, K, N), flops, t)
                _rows(table, times, meta, mode, M, K, N, act, device, peak, env, skipped)
            except Exception as exc:  # one shape that fails does not lose the others' rows
                common.say(f"!! {mode} M={M} K={K} N={N} FAILED: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        common.say("  interrupted: the rows above are complete")
    return table.finish("fastdl fused_linear", "PyTorch", args.csv)


def _rows(table, times, meta, mode, M, K, N, act, device, peak, env, skipped=()) -> None:
    flops = (2 if mode != "train" else 6) * M * N * K
    same = times.get("eager") if mode != "fwd_fp32" else times.get("eager_fp32")
    fp32 = times.get("eager_fp32") if mode != "fwd_fp32" else None
    torch_names = [n for n, base in meta.items() if base is not None and n in times]
    best_name = min(torch_names, key=lambda n: times[n]) if torch_names else None
    best = times[best_name] if best_name else None
    same_label = {"fwd": "eager bf16", "fwd_fp32": "eager fp32", "train": "eager autocast-bf16 step"}[mode]
    for name, t in times.items():
        wbytes = N * K * (2 if mode == "fwd" and meta[name] != "fp32" else 4)
        row = {
            "op": "fused_linear", "mode": mode, "device": device, "activation": act,
            "dtype": "fp32" if mode == "fwd_fp32" or meta[name] == "fp32" else "bf16",
            "M": M, "K": K, "N": N, "provider": name, "ms": t * 1e3, "reps": t.reps, "reduced": t.reduced,
            "x_eager": same / t if same else None, "x_fp32": fp32 / t if fp32 else None,
            "x_best": best / t if best else None,
            "best_pytorch": best_name, "gflops": flops / t / 1e9, "pct_peak": 100 * flops / t / peak,
            "weight_gbps": wbytes / t / 1e9, **env,
        }  # fmt: skip
        if meta[name] is None:  # a fastdl row: judged against every PyTorch path
            row["not_timed"] = ",".join(skipped)
            checks = {same_label: row["x_eager"]}
            if fp32 is not None:
                checks["eager fp32" + (" step" if mode == "train" else "")] = row["x_fp32"]
            if best_name not in (None, "eager", "eager_fp32"):
                checks[f"best PyTorch ({best_name})"] = row["x_best"]
            common.mark_slower(row, checks)
        table.add(row)


def main(argv=None):
    return common.module_main("python -m fastdl.bench.fused_linear", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
