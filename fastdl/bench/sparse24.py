"""``fastdl bench sparse24``: 2:4 sparse linear vs dense bf16 ``F.linear`` on the same (masked) weight, in one process
on the same inputs; prune+compress time vs one dense GEMM; memory.

Providers per shape (K = 4096, N in 4096 / 11008, M in 1 16 128 512 by default):
  dense     ``F.linear(x, W)`` with W the decompressed 2:4 weight in bf16 (oneDNN on CPU, cuBLAS on CUDA)
  dense_fp32  the same in fp32 (what a PyTorch user runs where bf16 is PyTorch's slow path, e.g. AVX2-only CPUs)
  fastdl    ``fastdl.ops.sparse24_linear`` (the C++ kernel on CPU: reads only the kept half + metadata)
  module    ``fastdl.nn.Sparse24Linear`` in auto mode (its path: sparse / dense / semi, shown in the ``path`` column)
  semi      CUDA: ``F.linear`` with ``torch.sparse.to_sparse_semi_structured(W)`` (cuSPARSELt / CUTLASS)
Calls of the providers of one shape are interleaved (round robin) so that they see the same machine load; the
median per provider is reported (a call slower than 0.5 s is timed 1-2 times, marked ``*``). x dense: vs dense bf16
(the path it replaces), x fp32: vs dense fp32, x best: vs the fastest PyTorch provider; a fastdl row slower than
any of them is marked ``<<< SLOWER`` and listed again at the end. ``prune+compress`` rows time
``fastdl.ops.compress_2_4`` (mask + compress in one pass) of the dense weight against one dense GEMM (CPU: 4096 x
4096 weight, M = 512; CUDA: the ViT-L MLP shape, weight 4096 x 1024, M = 13008). ``memory`` rows compare the bytes
held by Sparse24Linear and the dense layer.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends, runtime_choice
from ..nn.sparse24 import Sparse24Linear
from ..ops import sparse24 as sp
from .common import (
    GEMM_RATE_COLUMNS,
    LiveTable,
    activity,
    env_columns,
    interleaved,
    mark_slower,
    measured_matmul_peak,
    module_main,
    over_time,
    print_header,
    say,
)

DEFAULT_M = (1, 16, 128, 512)
DEFAULT_N = (4096, 11008)
CUDA_EXTRA_M = (2048, 8192)
QUICK_ARGS = ["--m", "1", "16", "128", "--n", "4096", "--budget", "0.3"]
ALL_ARGS = ["--budget", "0.6"]
TORCH_PROVIDERS = ("dense", "dense_fp32", "semi")


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


def _interleaved(fns: dict, device: str, budget: float, wait_idle: bool = False) -> dict:
    """Median seconds per call of each function, calling them round robin (same load for all)."""
    before = (lambda r: _wait_idle() if r % 5 == 0 else None) if wait_idle else None
    return interleaved(fns, device, budget_s=budget, before_round=before)


def _semi(w: torch.Tensor):
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(w)


def _providers(x, wd, values, meta, bias, module, semi, x32=None, wd32=None) -> dict:
    fns = {"dense": lambda: F.linear(x, wd, bias)}
    if wd32 is not None:
        fns["dense_fp32"] = lambda: F.linear(x32, wd32)
    fns["fastdl"] = lambda: sp.sparse24_linear(x, values, meta, bias)
    if module is not None:
        fns["module"] = lambda: module(x)
    if semi is not None:
        fns["semi"] = lambda: F.linear(x, semi, bias)
    return fns


COLUMNS = [("M", "M", 5), ("K", "K", 5), ("N", "N", 5), ("provider", "provider", 10), ("path", "path", 8),
           ("ms", "ms", 9), ("x_dense", "x dense", 7), *GEMM_RATE_COLUMNS]  # fmt: skip


def run(args) -> list[dict]:
    device = args.device
    cuda = device.startswith("cuda")
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(0)
    print_header("sparse24", device)
    peak = measured_matmul_peak(device, dtype, torch.float32)  # the faster of the two
    env = env_columns(device)
    dev_type = "cuda" if cuda else "cpu"
    fastdl_backend = backends.select("sparse24_linear", dev_type)
    say(f"   {args.dtype}; peak = faster of {args.dtype}/fp32 torch.mm: {peak / 1e9:.0f} GFLOP/s; "
        f"fastdl sparse24_linear backend: {fastdl_backend}")
    ms = args.m or (list(DEFAULT_M) + (list(CUDA_EXTRA_M) if cuda else []))
    ns = args.n or list(DEFAULT_N)
    K = args.k
    base = {"op": "sparse24", "device": device, "dtype": args.dtype, "K": K, **env}
    table = LiveTable(COLUMNS)
    other_rows: list[dict] = []
    try:
        for N in ns:
            if over_time(f"N = {N} and later"):
                break
            activity(f"sparse24: compressing a {N} x {K} weight")
            w = torch.randn(N, K, device=device, dtype=dtype) / K**0.5
            values, meta = sp.compress_2_4(w)
            wd = sp.decompress_2_4(values, meta)  # the masked dense weight: the same function for every provider
            wd32 = wd.float() if dtype != torch.float32 else None
            bias = None
            module = None
            if not args.no_module:
                lin = nn.Linear(K, N, bias=False, device=device, dtype=dtype)
                with torch.no_grad():
                    lin.weight.copy_(wd)
                module = Sparse24Linear.from_linear(lin).requires_grad_(False)
            semi = None
            if cuda:
                try:
                    semi = _semi(wd)
                except Exception as exc:  # unsupported GPU / dtype / shape: reported, not fatal
                    say(f"  semi-structured unavailable for N={N} K={K}: {type(exc).__name__}: {exc}")
            for M in ms:
                if over_time(f"M = {M} and later at N = {N}"):
                    break
                activity(f"sparse24 M={M} K={K} N={N}")
                x = torch.randn(M, K, device=device, dtype=dtype)
                x32 = x.float() if wd32 is not None else None
                fns = _providers(x, wd, values, meta, bias, module, semi, x32, wd32)
                with torch.no_grad():
                    try:
                        if module is not None:  # its run-time choice settles first (the first calls at a new
                            for _ in range(runtime_choice.RETRIES + 2):  # bucket time the paths): steady state is timed
                                module(x)
                        t = _interleaved(fns, device, args.budget, wait_idle=args.wait_idle)
                    except Exception as exc:
                        say(f"  failed at M={M} N={N}: {type(exc).__name__}: {exc}")
                        continue
                _rows(table, t, base, M, N, K, x, module, fastdl_backend, values, meta, wd, peak)
            if module is not None:
                dense_bytes = N * K * torch.finfo(torch.bfloat16).bits // 8
                r = {**base, "kind": "memory", "N": N, "provider": "module", "bytes": module.weight_bytes(),
                     "dense_bf16_bytes": dense_bytes, "ratio_vs_dense_bf16": module.weight_bytes() / dense_bytes}
                other_rows.append(r)
                say(f"memory N={N} K={K}: Sparse24Linear {r['bytes'] / 2**20:.1f} MiB = "
                    f"{r['ratio_vs_dense_bf16']:.3f}x the dense bf16 layer")
            del w, wd, wd32, values, meta, module, semi

        # prune + compress (one pass over the dense weight) vs one dense GEMM
        if not over_time("the prune+compress measurement"):
            other_rows.append(_prune_compress(args, device, dtype, dev_type, base))
    except KeyboardInterrupt:
        say("  interrupted: the rows above are complete")
    return table.finish("fastdl sparse24", "PyTorch", args.csv, other_rows)


def _rows(table, t, base, M, N, K, x, module, fastdl_backend, values, meta, wd, peak) -> None:
    flops = 2 * M * N * K
    torch_t = {k: v for k, v in t.items() if k in TORCH_PROVIDERS}
    best = min(torch_t, key=torch_t.get)
    for name, sec in t.items():
        wbytes = (N * K * (4 if name == "dense_fp32" else wd.element_size())) if name.startswith("dense") else (
            values.numel() * values.element_size() + meta.numel() * meta.element_size())
        row = {
            **base, "kind": "linear", "M": M, "N": N, "provider": name, "ms": sec * 1e3, "reps": sec.reps,
            "reduced": sec.reduced, "x_dense": t["dense"] / sec,
            "x_fp32": t["dense_fp32"] / sec if "dense_fp32" in t else None, "x_best": torch_t[best] / sec,
            "best_pytorch": best, "gflops": flops / sec / 1e9, "pct_peak": 100 * flops / sec / peak,
            "weight_gbps": wbytes / sec / 1e9,
            "path": module.path_for(x) if name == "module" else (fastdl_backend if name == "fastdl" else ""),
        }  # fmt: skip
        if name in ("fastdl", "module"):
            checks = {"dense bf16": row["x_dense"], "dense fp32": row["x_fp32"]}
            if best not in ("dense", "dense_fp32"):
                checks[f"best PyTorch ({best})"] = row["x_best"]
            mark_slower(row, checks)
        table.add(row)


def _prune_compress(args, device, dtype, dev_type, base) -> dict:
    if device.startswith("cuda"):
        pN, pK, pM = 4096, 1024, 13008  # ViT-L MLP: 1024 -> 4096, 13008 tokens
    else:
        pN, pK, pM = 4096, 4096, 512
    activity("sparse24 prune+compress vs one dense GEMM")
    w = torch.randn(pN, pK, device=device, dtype=dtype)
    x = torch.randn(pM, pK, device=device, dtype=dtype)
    with torch.no_grad():
        t = _interleaved({"prune+compress": lambda: sp.compress_2_4(w), "dense_gemm": lambda: F.linear(x, w)},
                         device, args.budget, wait_idle=args.wait_idle)
    r = {**base, "K": pK, "kind": "prune+compress", "M": pM, "N": pN,
         "provider": backends.select("compress_2_4", dev_type, (w,)), "ms": t["prune+compress"] * 1e3,
         "dense_gemm_ms": t["dense_gemm"] * 1e3, "ratio_vs_dense_gemm": t["prune+compress"] / t["dense_gemm"],
         "weight_gbps": (w.numel() * w.element_size() * 1.5625) / t["prune+compress"] / 1e9}
    say(f"prune+compress {pN}x{pK} ({r['provider']}): {r['ms']:.2f} ms = {r['ratio_vs_dense_gemm']:.3f}x one dense "
        f"GEMM at M={pM} ({r['dense_gemm_ms']:.2f} ms{'*' if t['dense_gemm'].reduced else ''})")
    return r


def main(argv=None):
    return module_main("python -m fastdl.bench.sparse24", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
