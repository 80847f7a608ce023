"""Ahead-of-time compile of every Triton kernel in kernels/ for the GPUs fastdl targets, on a machine without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs Triton's whole pipeline (ttir, ttgir,
llir, ptx, then ptxas to a cubin) without a driver. For each target (sm_80: A100, sm_90a: H100/H200) this test

1. calls every public launcher of kernels/*.py under ``FakeTensorMode`` on "cuda" tensors (no memory, no GPU) over
   the inputs a user can pass (dtypes, activation, bias, residual, output masks, M bands, K sizes ...), with the
   launch itself replaced by a recorder: what is recorded is exactly what the launcher would hand to Triton
   (argument types and alignment, the constexprs it derives, num_warps/num_stages, compile options);
2. expands each autotuned launch into the configs its ``early_config_prune`` keeps for that target (shared memory
   limit, compute capability and SM count of the target patched in);
3. compiles the resulting (kernel, specialization, config) set in a process pool and reads ptxas' report: registers
   per thread, spill stores/loads, and the shared memory of the compiled kernel;
4. fails on a compile error, a register spill, shared memory above the target's per-block limit, or a
   ``@triton.jit`` function in kernels/ that is neither launched by a recorded launcher call nor called by one.

The full (variant x config) product is too large to compile in CI (5,567 compiles for both targets with triton 3.8,
~2.5 s of CPU each for a GEMM: over an hour on 2 cores), so it is reduced, per kernel and target, to a cover (see
``_plan``, 323 compiles, ~215-245 s of CPU, ~2-4.5 min on 2 cores; 120 of them the int4 kernels'): every tile the
launchers can pick is compiled with the heaviest variant that picks it, per dot class (most features on: activation,
bias, residual, pre-activation store, group scales; then the widest operands), and every value of every argument
type and constexpr is compiled at least once. A tile is every BLOCK_* constexpr: the int4 kernels whose tile shape
follows the group size name it BLOCK_G (GEMV) / BLOCK_K (W4A8 GEMM), so each group size is compiled with each
tile. ptxas is not monotonic (a relu variant can spill a few bytes where gelu does not), so the cover can miss a
spill that only the full product shows: ``python tests/test_triton_aot.py --full`` compiles it.

Run it by hand: ``python tests/test_triton_aot.py [--cc 80,90] [--jobs 2] [--full] [--json out.json]``.
The pytest test runs it in a subprocess without TRITON_INTERPRET (conftest sets that for the test session, and the
kernel modules pick their interpreter configs at import).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import io
import itertools
import json
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KERNEL_DIR = ROOT / "kernels"
KERNEL_MODULES = ("fused_linear", "int8", "sparse24", "int4")

# Shared memory a block may opt in to, and SM count (the launchers size split-K and grids with it).
# cudaDevAttrMaxSharedMemoryPerBlockOptin: A100 163 KB, H100/H200 227 KB (CUDA C programming guide, compute
# capabilities table).
TARGETS = {
    80: {"name": "sm_80 (A100)", "smem": 163 * 1024, "sms": 108},
    90: {"name": "sm_90a (H100/H200)", "smem": 227 * 1024, "sms": 132},
}

_TORCH_TO_TRITON = None  # filled lazily (torch dtype -> triton type string)


# ------------------------------------------------------------------------------------------------------------------
# recording launches
# ------------------------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for a module-level kernel object (JITFunction or Autotuner): ``kernel[grid](*args, **kwargs)``
    records the call instead of launching."""

    def __init__(self, module, name, kernel, sink):
        self.module, self.name, self.kernel, self.sink = module, name, kernel, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.module, self.name, self.kernel, args, kwargs))

        return launch


def _load_module(name):
    path = KERNEL_DIR / f"{name}.py"
    # a fresh copy of the module (compiled for the GPU, not the interpreter), inside fastdl.kernels so that its
    # relative imports (kernels/constants.py) resolve
    spec = importlib.util.spec_from_file_location(f"fastdl.kernels._aot_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _jit_objects(mod):
    """name -> JITFunction of every @triton.jit function defined in the module (autotuned ones unwrapped)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    found = {}
    for name, obj in vars(mod).items():
        fn = obj
        while isinstance(fn, Autotuner):
            fn = fn.fn
        if isinstance(fn, JITFunction) and getattr(fn.fn, "__module__", None) == mod.__name__:
            found[name] = fn
    return found


def _scenarios(mods):
    """Launcher calls covering what a user can pass. Yields (label, thunk); the thunks run under FakeTensorMode."""
    import torch

    fl, i8, sp = mods["fused_linear"], mods["int8"], mods["sparse24"]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    dev = "cuda"

    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=dev)

    # representative aligned LLM-like sizes: K = 4096, N = 4096; M per band
    K, N = 4096, 4096
    out = []

    # ---- fused_linear forward
    for c in floats:
        for wdt in {c, torch.float32}:
            for tf32 in (False, True) if c == torch.float32 else (False,):
                for act in fl.ACTIVATIONS:
                    for has_b, has_r in itertools.product((False, True), repeat=2):
                        for save in (False, True) if act != "none" else (False,):

                            def f(c=c, wdt=wdt, act=act, has_b=has_b, has_r=has_r, save=save):
                                x = t(512, K, dtype=c)
                                b = t(N, dtype=wdt) if has_b else None
                                r = t(512, N, dtype=c) if has_r else None
                                fl.fused_linear_fwd(x, t(N, K, dtype=wdt), b, act, r, save)

                            out.append((("fused_linear_fwd", c, wdt, tf32, act, has_b, has_r, save), f, tf32))
    # ---- fused_linear backward (every output mask; M large enough to split the weight-gradient reduction for
    # small layers, and a large layer that does not split)
    masks = [m for m in itertools.product((False, True), repeat=3) if any(m)]
    for c in floats:
        for wdt in {c, torch.float32}:
            for tf32 in (False, True) if c == torch.float32 else (False,):
                for act in fl.ACTIVATIONS:
                    for mask in masks:
                        for m, n, k in ((4096, 4096, 4096), (16384, 256, 256)):

                            def f(c=c, wdt=wdt, act=act, mask=mask, m=m, n=n, k=k):
                                x = t(m, k, dtype=c)
                                g = t(m, n, dtype=c)
                                p = t(m, n, dtype=c) if act != "none" else None
                                fl.fused_linear_bwd(g, x, t(n, k, dtype=wdt), p, act, list(mask))

                            out.append((("fused_linear_bwd", c, wdt, tf32, act, mask, m, n, k), f, tf32))
    # ---- int8: per-token quantization (its block shape follows K: every power of two the launcher can pick)
    for c in floats:
        for k in sorted({1 << e for e in range(0, 14)} | {12288}):

            def f(c=c, k=k):
                i8.quantize_per_token(t(64, k, dtype=c))

            out.append((("quantize_per_token", c, k), f, False))
    # ---- int8_mm: out dtype (int32: no epilogue), bias, M bands of the config pruning
    for od in (torch.int32, *floats):
        for has_b in (False, True):
            for m in (16, 64, 256, 4096):

                def f(od=od, has_b=has_b, m=m):
                    a, b = t(m, K, dtype=torch.int8), t(N, K, dtype=torch.int8)
                    i8.int8_mm(a, b, t(m), t(N), t(N) if has_b else None, od, None, None)

                out.append((("int8_mm", od, has_b, m), f, False))
    # ---- int8_linear: fused quantization prologue (M <= FUSE_MAX_M) or quantize + GEMM
    for c in floats:
        for has_b in (False, True):
            for m in (1, 16, 64, 256, 4096):

                def f(c=c, has_b=has_b, m=m):
                    i8.int8_linear(t(m, K, dtype=c), t(N, K, dtype=torch.int8), t(N), t(N, dtype=c) if has_b else None,
                                   None, None)  # fmt: skip

                out.append((("int8_linear", c, has_b, m), f, False))
    # ---- weight-only int8: GEMV for M <= GEMV_MAX_M (BLOCK_M = next power of two of M), GEMM bands above
    for c in floats:
        for tf32 in (False, True) if c == torch.float32 else (False,):
            for has_b, groups in itertools.product((False, True), repeat=2):
                for m in (1, 2, 3, 4, 16, 64, 256, 4096):

                    def f(c=c, has_b=has_b, groups=groups, m=m):
                        gs = t(N, K // i8.WEIGHT_GROUP, dtype=torch.uint8) if groups else None
                        i8.int8_weight_only_linear(t(m, K, dtype=c), t(N, K, dtype=torch.int8), t(N),
                                                   t(N, dtype=c) if has_b else None, gs)  # fmt: skip

                    out.append((("int8_weight_only_linear", c, tf32, has_b, groups, m), f, tf32))
    # ---- 2:4 prune + compress
    for c in floats:

        def f(c=c):
            sp.compress_2_4(t(N, K, dtype=c))

        out.append((("compress_2_4", c), f, False))
    if "int4" in mods:
        out += _int4_scenarios(mods["int4"], t, floats)
    return out


def _int4_scenarios(i4, t, floats):
    """int4 weight-only and W4A8: activation dtype (tf32 for fp32 weight-only), bias, zero points, every group size,
    M over the GEMV's accumulator rows (1, 4, 8, 16; K slices and the summing kernel at 4096x4096, one slice at
    K = 512) and the GEMM bands (64, 256, 4096)."""
    import torch

    out = []
    for op in ("int4_weight_only_linear", "int4_a8_linear"):
        fn = getattr(i4, op)
        for c in floats:
            for tf32 in (False, True) if c == torch.float32 and op == "int4_weight_only_linear" else (False,):
                for has_b, zeros in itertools.product((False, True), repeat=2):
                    for G in i4.GROUP_SIZES:
                        for m, n, k in [(1, 4096, 4096), (3, 4096, 4096), (8, 4096, 4096),
                                        (16, 4096, 4096), (1, 4096, 512), (64, 4096, 4096), (256, 4096, 4096),
                                        (4096, 4096, 4096)]:  # fmt: skip

                            def f(fn=fn, c=c, has_b=has_b, zeros=zeros, G=G, m=m, n=n, k=k):
                                z = t(n, k // G, dtype=torch.uint8) if zeros else None
                                fn(t(m, k, dtype=c), t(n, k // 2, dtype=torch.uint8), t(n, k // G, dtype=torch.float16),
                                   z, t(n, dtype=c) if has_b else None, G)  # fmt: skip

                            out.append(((op, c, tf32, has_b, zeros, G, m, n, k), f, tf32))
    return out


def _record(mods, target):
    """Compile jobs of all launches of all scenarios for one target, and the (module, kernel) pairs launched. The
    autotuners' pruning runs here too, with the target's shared memory, capability and SM count patched in."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    info = TARGETS[target]
    sink = []
    saved = []
    for mname, mod in mods.items():
        for name in _jit_objects(mod):
            obj = getattr(mod, name)
            if name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(mname, name, obj, sink))
    # the device limits every kernel module reads through kernels/_tuning.py (one module, shared by all)
    tuning = {id(m._tuning): m._tuning for m in mods.values() if hasattr(m, "_tuning")}
    assert tuning, "no kernel module imports kernels/_tuning.py: the device limits below would not be patched"
    for mod in tuning.values():
        for helper, value in (
            ("max_smem", lambda idx: info["smem"]),
            ("capability_major", lambda idx: target // 10),
            ("num_sms", lambda idx: info["sms"]),
        ):
            saved.append((mod, helper, getattr(mod, helper)))
            setattr(mod, helper, value)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    jobs, launched, seen = [], set(), set()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            for label, thunk, tf32 in _scenarios(mods):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                start = len(sink)
                thunk()
                for rec in sink[start:]:
                    launched.add((rec[0], rec[1]))
                    for job in _jobs_of_call(label, rec, target):
                        key = _job_key(job)
                        if key not in seen:
                            seen.add(key)
                            jobs.append(job)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
        for mod, name, obj in reversed(saved):
            setattr(mod, name, obj)
    return jobs, launched


# ------------------------------------------------------------------------------------------------------------------
# specialization (what triton.runtime.jit does at launch: pointer/int types, 16-byte divisibility, ints equal to 1
# become constexprs)
# ------------------------------------------------------------------------------------------------------------------
def _type_of(value):
    import torch

    global _TORCH_TO_TRITON
    if _TORCH_TO_TRITON is None:
        _TORCH_TO_TRITON = {
            torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
            torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
            torch.bool: "i1",
        }  # fmt: skip
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[value.dtype], True  # the caching allocator aligns to >= 16 bytes
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        kind = "i32" if -(2**31) <= value < 2**31 else "i64"
        return kind, value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    if value is None:
        return "constexpr", False
    raise TypeError(f"unexpected kernel argument {value!r}")


_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def _jobs_of_call(label, rec, target):
    """Expand one recorded launch into compile jobs (one per config the autotuner's pruning keeps)."""
    from triton.runtime.autotuner import Autotuner

    mname, kname, kernel, args, kwargs = rec
    fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
    names = fn.arg_names
    const_params = {p.name for p in fn.params if p.is_constexpr}
    bound = dict(zip(names, args))
    launch_kwargs = {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k in _OPTION_NAMES}
    configs = [None]
    if isinstance(kernel, Autotuner):
        configs = kernel.configs
        if kernel.early_config_prune:
            configs = kernel.early_config_prune(configs, bound, **kwargs)
    jobs = []
    for cfg in configs:
        values = dict(bound)
        values.update(launch_kwargs)
        opts = dict(options)
        if cfg is not None:
            values.update(cfg.kwargs)
            opts.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            if getattr(cfg, "maxnreg", None) is not None:
                opts["maxnreg"] = cfg.maxnreg
        sig, constexprs, aligned = {}, {}, []
        for i, name in enumerate(names):
            if name not in values:
                raise TypeError(f"{kname}: the launcher passed no value for argument {name}")
            v = values[name]
            if name in const_params:
                sig[name] = "constexpr"
                constexprs[name] = v
                continue
            kind, div16 = _type_of(v)
            sig[name] = kind
            if kind == "constexpr":
                constexprs[name] = v
            elif div16:
                aligned.append(i)
        jobs.append(
            {
                "module": mname,
                "kernel": kname,
                "target": target,
                "signature": sig,
                "constexprs": constexprs,
                "aligned": aligned,
                "options": opts,
                "config": _config_str(constexprs, opts),
                "label": repr(label),
            }
        )
    return jobs


def _config_str(constexprs, opts):
    """The tile: BLOCK_* constexprs (from the autotune config or chosen by the launcher), warps and stages."""
    blocks = "x".join(str(v) for k, v in constexprs.items() if k.startswith("BLOCK"))
    return f"{blocks} w{opts.get('num_warps', 4)}s{opts.get('num_stages', 3)}"


def _job_key(job):
    return json.dumps(
        [job["module"], job["kernel"], job["target"], job["signature"], job["constexprs"], job["aligned"],
         job["options"]], sort_keys=True, default=str,
    )  # fmt: skip


def _variant_key(job):
    """The job without its tile: what the launcher chose (argument types and constexprs other than BLOCK_*)."""
    return json.dumps(sorted(_features(job)), default=str)


def _features(job):
    """(name, value) pairs of a job other than its tile: each argument's type (pointer dtypes, ints specialized to
    1 or not) and each constexpr that is not a BLOCK_* size, plus the compile options other than warps/stages."""
    out = set()
    for name, kind in job["signature"].items():
        if kind == "constexpr":
            value = job["constexprs"][name]
            if name.startswith("BLOCK") or name == "GROUP":
                continue
            out.add((name, repr(value)))
        else:
            out.add((name, kind))
    for k, v in job["options"].items():
        if k not in ("num_warps", "num_stages"):
            out.add((k, repr(v)))
    return out


_BYTES = {"fp64": 8, "fp32": 4, "i32": 4, "i64": 8, "fp16": 2, "bf16": 2, "i8": 1, "u8": 1, "i1": 1}


_ACT_COST = {0: 0, 1: 1, 4: 2, 3: 3, 2: 3}  # none < relu < silu < gelu_tanh, gelu (erf): epilogue temporaries


def _weight(job):
    """Heaviness of a variant (registers, shared memory) within its dot class: the features switched on (True
    flags, the activation's cost), then the bytes of its operands."""
    operand_bytes = sum(_BYTES.get(t[1:], 0) for t in job["signature"].values() if t.startswith("*"))
    flags = 0
    for k, v in job["constexprs"].items():
        if k.startswith("BLOCK") or k == "GROUP":
            continue
        if k == "ACT":
            flags += _ACT_COST.get(v, 1)
        elif v is True:
            flags += 1
    return (flags, operand_bytes)


def _dot_class(job):
    """Variants whose main loop differs are planned separately: for a kernel with a float dot (an IN_PREC
    constexpr), fp32 'ieee' (FMA units), fp32 'tf32' and 16-bit operands (fp16 and bf16: same tile bytes and MMA
    shapes). Other kernels (int8 dot, elementwise and reductions) have one class: their heaviest variant is the one
    with the widest operands and the most features."""
    cx = job["constexprs"]
    if "IN_PREC" not in cx:
        return "one"
    if "CDT" in cx:
        fp32 = cx["CDT"] == 0
    else:
        fp32 = next(t for t in job["signature"].values() if t.startswith("*")) == "*fp32"
    return f"{cx['IN_PREC']}-{'fp32' if fp32 else '16bit'}"


def _tile_size(job):
    tile = 1
    for k, v in job["constexprs"].items():
        if k.startswith("BLOCK") and isinstance(v, int):
            tile *= v
    return (tile * job["options"].get("num_stages", 1), job["options"].get("num_warps", 4))


def _plan(jobs, full=False):
    """The jobs to compile: the whole product with full=True, else a cover, per kernel and target:

    * every tile (autotune config, or BLOCK sizes the launcher picks) with the heaviest variant that picks it, per
      dot class: the worst case for registers and shared memory;
    * every value of every argument type and constexpr (1-wise) at least once, greedily, heaviest variants first,
      each with its largest tile: every branch of the kernel source is compiled."""
    unique = {}
    for j in jobs:
        unique.setdefault(_job_key(j), j)
    jobs = list(unique.values())
    if full:
        return jobs, len(jobs)
    chosen = {}
    by_kernel = {}
    for j in jobs:
        by_kernel.setdefault((j["module"], j["kernel"], j["target"]), []).append(j)
    for group in by_kernel.values():
        by_config = {}
        for j in group:
            by_config.setdefault((j["config"], _dot_class(j)), []).append(j)
        for cands in by_config.values():
            top = max(cands, key=_weight)
            chosen.setdefault(_job_key(top), top)
        covered = set()
        for j in group:
            if _job_key(j) in chosen:
                covered |= _features(j)
        by_variant = {}
        for j in group:
            by_variant.setdefault(_variant_key(j), []).append(j)
        variants = sorted(by_variant.values(), key=lambda c: _weight(c[0]), reverse=True)
        while True:
            best = max(variants, key=lambda c: (len(_features(c[0]) - covered), _weight(c[0])), default=None)
            if best is None or not (_features(best[0]) - covered):
                break
            top = max(best, key=_tile_size)
            chosen.setdefault(_job_key(top), top)
            covered |= _features(top)
    return list(chosen.values()), len(jobs)


# ------------------------------------------------------------------------------------------------------------------
# compiling
# ------------------------------------------------------------------------------------------------------------------
_MODS = {}


def _compile(job):
    """Compile one job (in a pool worker); returns the job with registers, spills, shared bytes or an error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        from triton import knobs

        knobs.nvidia.dump_ptxas_log = True  # ptxas runs with -v; this prints its report (triton >= 3.4)
    except (ImportError, AttributeError):
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    fn = _jit_objects(_MODS[job["module"]])[job["kernel"]]
    attrs = {(i,): [["tt.divisibility", 16]] for i in job["aligned"]}
    src = ASTSource(fn, job["signature"], job["constexprs"], attrs)
    res = dict(job)
    log = io.StringIO()
    t0 = time.perf_counter()
    cpu0 = _cpu_seconds()
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(src, target=GPUTarget("cuda", job["target"], 32), options=dict(job["options"]))
    except Exception as exc:  # noqa: BLE001 - reported per job
        res["error"] = f"{type(exc).__name__}: {str(exc).strip()[-1500:]}"
        res["seconds"] = time.perf_counter() - t0
        res["cpu_seconds"] = _cpu_seconds() - cpu0
        return res
    res["seconds"] = time.perf_counter() - t0
    res["cpu_seconds"] = _cpu_seconds() - cpu0
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    res["registers"] = int(regs.group(1)) if regs else None
    res["spill_stores"] = int(spill.group(1)) if spill else None
    res["spill_loads"] = int(spill.group(2)) if spill else None
    res["stack"] = int(stack.group(1)) if stack else None
    res["shared"] = int(k.metadata.shared)
    res["num_warps"] = int(k.metadata.num_warps)
    if regs is None:
        res["error"] = "no ptxas report (registers unknown): " + text[-500:]
    return res


def _cpu_seconds():
    """CPU time of this process and its finished children (ptxas): the cost of a compile on a loaded machine."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _init_worker(cache_dir):
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    for name in KERNEL_MODULES:
        if name not in _MODS:
            _MODS[name] = _load_module(name)


def _problems(r):
    """What is wrong with one compiled job (empty when it is fine)."""
    if "error" in r:
        return [r["error"]]
    out = []
    if r["spill_stores"] or r["spill_loads"]:
        out.append(f"register spills: {r['spill_stores']} B stores, {r['spill_loads']} B loads ({r['registers']} regs)")
    elif r["stack"]:
        out.append(f"{r['stack']} B stack frame (local memory) with {r['registers']} registers")
    limit = TARGETS[r["target"]]["smem"]
    if r["shared"] > limit:
        out.append(f"shared memory {r['shared']} B > {limit} B per block on {TARGETS[r['target']]['name']}")
    return out


def _describe(r):
    """Pointer types and the constexprs other than the tile (integer arguments equal to 1 show as NAME=1)."""
    cx = {k: v for k, v in r["constexprs"].items() if not k.startswith("BLOCK") and k != "GROUP"}
    ptrs = ",".join(t[1:] for t in r["signature"].values() if t.startswith("*"))
    flags = " ".join(f"{k}={v}" for k, v in cx.items() if not k.startswith("stride"))
    return f"[{ptrs}] {flags}"


def run(targets=(80, 90), jobs=None, full=False, json_path=None, verbose=True, plan_only=False):
    """Record, plan, compile; print the table. Returns (results, coverage problems, summary)."""
    import triton

    t_start = time.perf_counter()
    for name in KERNEL_MODULES:
        _MODS[name] = _load_module(name)
    all_jobs, launched = [], set()
    for cc in targets:
        jobs_cc, launched_cc = _record(_MODS, cc)
        all_jobs.extend(jobs_cc)
        launched |= launched_cc
    # coverage: every @triton.jit function in kernels/ is launched or called (as a helper) by a launched kernel
    coverage = []
    listing = []
    for mname, mod in _MODS.items():
        jits = _jit_objects(mod)
        sources = {n: f.src for n, f in jits.items()}
        reached = {n for n in jits if (mname, n) in launched}
        frontier = list(reached)
        while frontier:
            src = sources[frontier.pop()]
            for n in jits:
                if n not in reached and re.search(rf"\b{re.escape(n)}\s*\(", src):
                    reached.add(n)
                    frontier.append(n)
        for n in sorted(jits):
            kind = "kernel" if (mname, n) in launched else ("helper" if n in reached else "NOT COVERED")
            listing.append((mname, n, kind))
            if n not in reached:
                coverage.append(
                    f"kernels/{mname}.py: @triton.jit {n} is not launched by any launcher call of this test and not "
                    "called by a launched kernel: add a call of its launcher to _scenarios"
                )
    plan, total = _plan(all_jobs, full=full)
    if plan_only:
        counts = {}
        for j in plan:
            key = (j["target"], j["kernel"])
            counts[key] = counts.get(key, 0) + 1
        for key, n in sorted(counts.items()):
            print(key, n)
        print(f"plan: {len(plan)} of {total} combinations, {len(all_jobs)} jobs recorded, "
              f"{time.perf_counter() - t_start:.1f} s")
        return [], coverage, {}
    plan.sort(key=lambda j: -_tile_size(j)[0])  # big compiles first: better packing in the pool
    n_workers = jobs or min(len(plan), os.cpu_count() or 1) or 1
    t_rec = time.perf_counter() - t_start
    with tempfile.TemporaryDirectory(prefix="fastdl-aot-") as cache_dir:
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=n_workers, mp_context=ctx, initializer=_init_worker, initargs=(cache_dir,)
        ) as pool:
            results = list(pool.map(_compile, plan, chunksize=1))
    wall = time.perf_counter() - t_start
    results.sort(key=lambda r: (r["target"], r["module"], r["kernel"], r["config"], _describe(r)))
    bad = [(r, p) for r in results for p in _problems(r)]
    ok = [r for r in results if "error" not in r]
    summary = {
        "triton": triton.__version__,
        "targets": list(targets),
        "kernels": sorted({f"{r['module']}.{r['kernel']}" for r in results}),
        "compiled": len(results),
        "product": total,
        "failures": sum(1 for r in results if "error" in r),
        "spills": sum(1 for r in ok if r["spill_stores"] or r["spill_loads"] or r["stack"]),
        "over_smem": sum(1 for r in ok if r["shared"] > TARGETS[r["target"]]["smem"]),
        "max_registers": max((r["registers"] for r in ok), default=0),
        "max_shared": max((r["shared"] for r in ok), default=0),
        "compile_seconds": round(sum(r["seconds"] for r in results), 1),
        "compile_cpu_seconds": round(sum(r["cpu_seconds"] for r in results), 1),
        "record_seconds": round(t_rec, 1),
        "wall_seconds": round(wall, 1),
        "workers": n_workers,
    }
    if verbose:
        print(f"triton {triton.__version__}: Triton kernels in kernels/ ({len(listing)} @triton.jit functions)")
        for mname, n, kind in listing:
            print(f"  kernels/{mname}.py  {n:24s} {kind}")
        head = f"{'target':7s} {'kernel':22s} {'config':22s} {'regs':>4s} {'spill':>9s} {'shared':>7s}  variant"
        print(head)
        print("-" * len(head))
        for r in results:
            tgt = f"sm_{r['target']}{'a' if r['target'] == 90 else ''}"
            if "error" in r:
                print(f"{tgt:7s} {r['kernel']:22s} {r['config']:22s} {'ERROR':>4s}  {_describe(r)}")
                continue
            spill = f"{r['spill_stores']}/{r['spill_loads']}"
            print(f"{tgt:7s} {r['kernel']:22s} {r['config']:22s} {r['registers']:4d} {spill:>9s} {r['shared']:7d}  "
                  f"{_describe(r)}")  # fmt: skip
        print(
            f"compiled {summary['compiled']} of {summary['product']} (kernel, specialization, config) combinations "
            f"for {', '.join(TARGETS[c]['name'] for c in targets)} in {summary['wall_seconds']} s wall "
            f"({summary['compile_cpu_seconds']} s CPU in compiles on {n_workers} workers); max registers "
            f"{summary['max_registers']}, max shared {summary['max_shared']} B; failures {summary['failures']}, "
            f"spills {summary['spills']}, over the shared-memory limit {summary['over_smem']}"
        )
        for r, p in bad:
            print(f"PROBLEM sm_{r['target']} {r['kernel']} {r['config']} {_describe(r)}: {p}")
        for c in coverage:
            print(f"PROBLEM {c}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"summary": summary, "results": results, "coverage": coverage,
                       "problems": [[_job_key(r), p] for r, p in bad]}, f, default=str)  # fmt: skip
    return results, coverage, summary


# ------------------------------------------------------------------------------------------------------------------
# the pytest test
# ------------------------------------------------------------------------------------------------------------------
def test_aot_compile_every_kernel_for_sm80_and_sm90(tmp_path):
    import pytest

    pytest.importorskip("triton", reason="triton is not installed: no Triton kernel to compile")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the kernel modules must pick their GPU configs
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).resolve()), "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(proc.stdout[-20000:])  # the table (shown with -s or -rA)
    assert proc.returncode == 0 and out.exists(), f"the AOT compile run failed:\n{proc.stdout[-5000:]}\n{proc.stderr}"
    data = json.loads(out.read_text())
    assert not data["coverage"], "\n".join(data["coverage"])
    assert data["summary"]["compiled"] > 0
    assert not data["problems"], "\n".join(f"{k}: {p}" for k, p in data["problems"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="80,90", help="compute capabilities, comma separated (80, 90)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    ap.add_argument("--full", action="store_true", help="compile the whole (variant x config) product")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--plan", action="store_true", help="only count what would be compiled")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernel modules pick interpreter configs when it is set")
    targets = tuple(int(c) for c in a.cc.split(","))
    for c in targets:
        if c not in TARGETS:
            sys.exit(f"--cc: unknown target {c}; known: {sorted(TARGETS)}")
    results, coverage, summary = run(targets, jobs=a.jobs, full=a.full, json_path=a.json, plan_only=a.plan)
    bad = sum(1 for r in results if _problems(r))
    return 1 if (bad or coverage) else 0


if __name__ == "__main__":
    sys.exit(main())
