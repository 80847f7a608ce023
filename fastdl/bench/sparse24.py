"""``fastdl bench sparse24``: 2:4 sparse linear vs dense bf16 ``F.linear`` on the same (masked) weight, in one process
on the same inputs; prune+compress time vs one dense GEMM; memory.

Providers per shape (K = 4096, N in 4096 / 11008, M in 1 16 128 512 by default):
  dense     ``F.linear(x, W)`` with W the decompressed 2:4 weight in bf16 (oneDNN on CPU, cuBLAS on CUDA)
  fastdl    ``fastdl.ops.sparse24_linear`` (the C++ kernel on CPU: reads only the kept half + metadata)
  module    ``fastdl.nn.Sparse24Linear`` in auto mode (its path: sparse / dense / semi, shown in the ``path`` column)
  semi      CUDA: ``F.linear`` with ``torch.sparse.to_sparse_semi_structured(W)`` (cuSPARSELt / CUTLASS)
Calls of the providers of one shape are interleaved (round robin) so that they see the same machine load; the
median per provider is reported. ``prune+compress`` rows time ``fastdl.ops.compress_2_4`` (mask + compress in one
pass) of the dense weight against one dense GEMM (CPU: 4096 x 4096 weight, M = 512; CUDA: the ViT-L MLP shape,
weight 4096 x 1024, M = 13008). ``memory`` rows compare the bytes held by Sparse24Linear and the dense layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends
from ..nn.sparse24 import Sparse24Linear
from ..ops import sparse24 as sp
from .common import env_columns, measured_matmul_peak, print_table, progress, sync, write_csv

DEFAULT_M = (1, 16, 128, 512)
DEFAULT_N = (4096, 11008)
CUDA_EXTRA_M = (2048, 8192)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--m", type=int, nargs="+", default=None,
                   help="batch sizes (rows of x); default 1 16 128 512 (+ 2048 8192 on CUDA)")
    p.add_argument("--n", type=int, nargs="+", default=None, help="out features; default 4096 11008")
    p.add_argument("--k", type=int, default=4096, help="in features (default 4096)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="compute dtype (default bf16)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed runs per shape")
    p.add_argument("--no-module", action="store_true", help="skip the Sparse24Linear provider")
    p.add_argument("--wait-idle", action="store_true",
                   help="shared machine (Linux): before each round of calls wait (up to 20 s) until the CPUs are idle")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _cpu_busy(interval: float = 0.2) -> float:
    """Fraction of the machine's CPU time that was busy over ``interval`` seconds (/proc/stat; 0 elsewhere)."""

    def read():
        with open("/proc/stat") as f:
            v = [int(a) for a in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    try:
        t0, i0 = read()
        time.sleep(interval)
        t1, i1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _wait_idle(timeout: float = 20.0, limit: float = 0.08) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout and _cpu_busy() > limit:
        pass


def _interleaved(fns: dict, device: str, budget: float, min_reps: int = 5, max_reps: int = 200,
                 wait_idle: bool = False) -> dict:
    """Median seconds per call of each function, calling them round robin (same load for all)."""
    for fn in fns.values():  # warm-up (and caches)
        fn()
        fn()
    sync(device)
    times = {k: [] for k in fns}
    start = time.perf_counter()
    reps = 0
    while reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget):
        if wait_idle and reps % 5 == 0:
            _wait_idle()
        for name, fn in fns.items():
            if device.startswith("cuda"):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                times[name].append(e0.elapsed_time(e1) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        reps += 1
    return {k: statistics.median(v) for k, v in times.items()}


def _semi(w: torch.Tensor):
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(w)


def _providers(x, wd, values, meta, bias, module, semi) -> dict:
    fns = {
        "dense": lambda: F.linear(x, wd, bias),
        "fastdl": lambda: sp.sparse24_linear(x, values, meta, bias),
    }
    if module is not None:
        fns["module"] = lambda: module(x)
    if semi is not None:
        fns["semi"] = lambda: F.linear(x, semi, bias)
    return fns


def run(args) -> list[dict]:
    device = args.device
    cuda = device.startswith("cuda")
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)
    peak = measured_matmul_peak(device, dtype)
    env = env_columns(device)
    dev_type = "cuda" if cuda else "cpu"
    fastdl_backend = backends.select("sparse24_linear", dev_type)
    print(f"sparse24 on {env['device_name']}; measured {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s; "
          f"fastdl sparse24_linear backend: {fastdl_backend}")
    ms = args.m or (list(DEFAULT_M) + (list(CUDA_EXTRA_M) if cuda else []))
    ns = args.n or list(DEFAULT_N)
    K = args.k
    rows = []
    base = {"op": "sparse24", "device": device, "dtype": args.dtype, "K": K, **env}

    for N in progress(ns, desc="sparse24"):
        w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
        values, meta = sp.compress_2_4(w)
        wd = sp.decompress_2_4(values, meta)  # the masked dense weight: the same function for every provider
        bias = None
        module = None
        if not args.no_module:
            lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(wd)
            module = Sparse24Linear.from_linear(lin).requires_grad_(False)
        semi = None
        semi_why = None
        if cuda:
            try:
                semi = _semi(wd)
            except Exception as exc:  # unsupported GPU / dtype / shape: reported, not fatal
                semi_why = f"{type(exc).__name__}: {exc}"
                print(f"  semi-structured unavailable for N={N} K={K}: {semi_why}")
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype)
            fns = _providers(x, wd, values, meta, bias, module, semi)
            with torch.no_grad():
                try:
                    t = _interleaved(fns, device, args.budget, wait_idle=args.wait_idle)
                except Exception as exc:
                    print(f"  failed at M={M} N={N}: {type(exc).__name__}: {exc}")
                    continue
            flops = 2 * M * N * K
            for name, sec in t.items():
                wbytes = N * K * wd.element_size() if name == "dense" else (
                    values.numel() * values.element_size() + meta.numel())
                rows.append({
                    **base, "kind": "linear", "M": M, "N": N, "provider": name, "ms": sec * 1e3,
                    "speedup_vs_dense": t["dense"] / sec, "gflops": flops / sec / 1e9,
                    "pct_peak": 100 * flops / sec / peak, "weight_gbps": wbytes / sec / 1e9,
                    "path": module.path_for(x) if name == "module" else (
                        fastdl_backend if name == "fastdl" else ""),
                })
        if module is not None:
            dense_bytes = N * K * torch.finfo(torch.bfloat16).bits // 8
            rows.append({**base, "kind": "memory", "N": N, "provider": "module",
                         "bytes": module.weight_bytes(), "dense_bf16_bytes": dense_bytes,
                         "ratio_vs_dense_bf16": module.weight_bytes() / dense_bytes})
        del w, wd, values, meta, module, semi

    # prune + compress (one pass over the dense weight) vs one dense GEMM
    if cuda:
        pN, pK, pM = 4096, 1024, 13008  # ViT-L MLP: 1024 -> 4096, 13008 tokens
    else:
        pN, pK, pM = 4096, 4096, 512
    w = torch.randn(pN, pK, device=device, dtype=dtype)
    x = torch.randn(pM, pK, device=device, dtype=dtype)
    with torch.no_grad():
        t = _interleaved({"prune+compress": lambda: sp.compress_2_4(w), "dense_gemm": lambda: F.linear(x, w)},
                         device, args.budget, wait_idle=args.wait_idle)
    rows.append({**base, "K": pK, "kind": "prune+compress", "M": pM, "N": pN,
                 "provider": backends.select("compress_2_4", dev_type, (w,)), "ms": t["prune+compress"] * 1e3,
                 "dense_gemm_ms": t["dense_gemm"] * 1e3,
                 "ratio_vs_dense_gemm": t["prune+compress"] / t["dense_gemm"],
                 "weight_gbps": (w.numel() * w.element_size() * 1.5625) / t["prune+compress"] / 1e9})

    lin_rows = [r for r in rows if r["kind"] == "linear"]
    print_table(lin_rows, [("M", "M"), ("K", "K"), ("N", "N"), ("provider", "provider"), ("path", "path"),
                           ("ms", "ms"), ("speedup_vs_dense", "x dense"), ("gflops", "GFLOP/s"),
                           ("pct_peak", "% peak"), ("weight_gbps", "W GB/s")])
    for r in rows:
        if r["kind"] == "memory":
            print(f"memory N={r['N']} K={r['K']}: Sparse24Linear {r['bytes'] / 2**20:.1f} MiB = "
                  f"{r['ratio_vs_dense_bf16']:.3f}x the dense bf16 layer")
        elif r["kind"] == "prune+compress":
            print(f"prune+compress {r['N']}x{r['K']} ({r['provider']}): {r['ms']:.2f} ms = "
                  f"{r['ratio_vs_dense_gemm']:.3f}x one dense GEMM at M={r['M']} ({r['dense_gemm_ms']:.2f} ms)")
    if args.csv:
        write_csv(rows, args.csv)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fastdl.bench.sparse24", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
