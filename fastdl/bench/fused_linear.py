"""``fastdl bench fused_linear``: fastdl's fused linear vs eager PyTorch (``F.linear`` + activation) and
``torch.compile`` of the same function, in one process on the same inputs.

Modes: ``fwd`` (inference forward in bf16) and ``train`` (one training step of the layer: forward + backward under
``torch.autocast`` bf16 with fp32 master weights, gradients for x, weight and bias).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F

from .. import backends
from ..ops import fused_linear
from ..ops.fused_linear import activation_fn
from .common import env_columns, measured_matmul_peak, print_table, progress, time_fn, write_csv

DEFAULT_M = (1, 16, 128, 512)
# LLaMA-7B MLP: gate/up projections 4096 -> 11008, down projection 11008 -> 4096
LLAMA_SHAPES = ((4096, 11008), (11008, 4096))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--m", type=int, nargs="+", default=None, help="batch sizes (rows of x); default 1 16 128 512")
    p.add_argument("--kn", type=int, nargs=2, action="append", default=None, metavar=("K", "N"),
                   help="in/out features; repeatable; default 4096 4096 plus the LLaMA-7B MLP shapes")
    p.add_argument("--llama-m", type=int, nargs="+", default=None,
                   help="M for the LLaMA shapes (default: 16 128 on CPU, 4096 on CUDA)")
    p.add_argument("--activation", default="gelu", help="none|relu|gelu|gelu_tanh|silu")
    p.add_argument("--modes", nargs="+", default=["fwd", "train"], choices=["fwd", "train"])
    p.add_argument("--backends", nargs="+", default=None,
                   help="fastdl backends to time besides auto (default: every available one)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per measurement")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


def _shapes(args) -> list[tuple[int, int, int]]:
    cuda = args.device.startswith("cuda")
    ms = args.m or list(DEFAULT_M)
    out = []
    if args.kn:
        return [(m, k, n) for k, n in args.kn for m in ms]
    out += [(m, 4096, 4096) for m in ms]
    llama_m = args.llama_m or ([4096] if cuda else [16, 128])
    out += [(m, k, n) for k, n in LLAMA_SHAPES for m in llama_m]
    return out


def _providers(args, act: str):
    """name -> (function(x, w, b) -> y, backend or None)."""

    def eager(x, w, b):
        return activation_fn(F.linear(x, w, b), act)

    provs = {"eager": (eager, None)}
    if not args.no_compile:
        mode = "max-autotune" if args.device.startswith("cuda") else None
        provs["compile"] = (torch.compile(eager, mode=mode, dynamic=False), None)
    provs["fastdl"] = (lambda x, w, b: fused_linear(x, w, b, act), "auto")
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    names = args.backends or [b for b in backends.BACKENDS if b != "torch"]
    for be in names:
        if be in backends.preference("fused_linear", dev) and backends.available(be, "fused_linear", dev)[0]:
            provs[f"fastdl[{be}]"] = (lambda x, w, b: fused_linear(x, w, b, act), be)
    return provs


def _step(mode, fn, x, w, b, g, device):
    """One timed call: the no-grad forward, or a training step under autocast bf16 (fp32 master weights)."""
    if mode == "fwd":

        def call():
            with torch.no_grad():
                return fn(x, w, b)

        return call
    autocast_device = "cuda" if device.startswith("cuda") else "cpu"

    def step():
        x.grad = w.grad = b.grad = None
        with torch.autocast(device_type=autocast_device, dtype=torch.bfloat16):
            y = fn(x, w, b)
        y.backward(g)

    return step


def run(args) -> list[dict]:
    device = args.device
    torch.manual_seed(0)
    act = args.activation
    peak = measured_matmul_peak(device)
    env = env_columns(device)
    print(f"fused_linear on {env['device_name']}; measured bf16 matmul peak {peak / 1e9:.0f} GFLOP/s")
    rows = []
    work = [(mode, shape) for mode in args.modes for shape in _shapes(args)]
    for mode, (M, K, N) in progress(work, desc="fused_linear"):
        provs = _providers(args, act)
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        if mode == "fwd":
            w = torch.randn(N, K, device=device, dtype=torch.bfloat16) / K**0.5
            b = torch.randn(N, device=device, dtype=torch.bfloat16)
            flops = 2 * M * N * K
        else:
            w = (torch.randn(N, K, device=device) / K**0.5).requires_grad_()
            b = torch.randn(N, device=device).requires_grad_()
            x.requires_grad_()
            g = torch.randn(M, N, device=device, dtype=torch.bfloat16)
            flops = 6 * M * N * K
        base = None
        for name, (fn, be) in provs.items():
            call = _step(mode, fn, x, w, b, g if mode == "train" else None, device)
            ctx = backends.use_backend(be) if be else contextlib.nullcontext()
            with ctx:
                try:
                    t = time_fn(call, device, budget_s=args.budget)
                except Exception as exc:  # a baseline that cannot run here is reported, not fatal
                    print(f"  {name} failed at M={M} K={K} N={N} ({mode}): {type(exc).__name__}: {exc}")
                    continue
            if name == "eager":
                base = t
            rows.append({
                "op": "fused_linear", "mode": mode, "device": device, "dtype": "bf16", "activation": act,
                "M": M, "K": K, "N": N, "provider": name, "ms": t * 1e3,
                "speedup_vs_eager": (base / t) if base else None,
                "gflops": flops / t / 1e9, "pct_peak": 100 * flops / t / peak,
                "weight_gbps": (N * K * (2 if mode == "fwd" else 4)) / t / 1e9,
                **env,
            })
    print_table(rows, [("mode", "mode"), ("M", "M"), ("K", "K"), ("N", "N"), ("provider", "provider"),
                       ("ms", "ms"), ("speedup_vs_eager", "x eager"), ("gflops", "GFLOP/s"),
                       ("pct_peak", "% peak"), ("weight_gbps", "W GB/s")])
    if args.csv:
        write_csv(rows, args.csv)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastdl.bench.fused_linear", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
