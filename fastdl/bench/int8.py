"""``fastdl bench int8``: fastdl's int8 linear layers against PyTorch, in one process on the same shapes.

Providers (inference forward, no grad; activations bf16 unless noted):
  bf16                 ``F.linear`` in bf16 (the baseline every ratio refers to)
  fp32                 ``F.linear`` in fp32
  int_mm+dequant       ``torch._int_mm`` on pre-quantized int8 activations, then the dequant (``acc * sx * sw``) and
                       the cast to bf16 as separate PyTorch ops (activation quantization not included)
  fbgemm_dynamic       ``torch.ao.quantization.quantize_dynamic`` ``nn.Linear`` (fbgemm, fp32 in/out, includes its
                       activation quantization; CPU only)
  fastdl_w8a8          ``fastdl.ops.int8_linear``: dynamic W8A8 including the per-token activation quantization
                       (on the CPU with the weight packed once, as ``Int8Linear`` does)
  fastdl_w8a8_u7       the same with ``act_bits=7``: 7-bit unsigned activations with a zero point per token, the
                       accuracy class of fbgemm's ``reduce_range`` (CPU only)
  fastdl_weight_only   ``fastdl.ops.int8_weight_only_linear`` with per-channel scales
  fastdl_weight_only_g16  the same with group scales (``quantize_per_group``: the default format of
                       ``Int8Linear(mode="weight_only")``, 8.5 bits per weight)
  fastdl_*[backend]    the same, forced to one backend (``--backends``)

``--cold`` flushes the caches before every timed call (weights from DRAM, as in a model larger than the cache);
by default the providers are timed in alternating blocks (one untimed call, then 3 timed ones), so every provider sees
the same machine load and weights that fit the last-level cache are read from it, as in a loop over one layer.

Columns: ms (median; ``*``: a slow call timed 1-2 times), GOP/s (2*M*N*K / t), x bf16 (bf16 time / time: > 1 is
faster than bf16), x repl (vs the PyTorch path the fastdl provider replaces: fbgemm dynamic quant for W8A8, the faster
of bf16 and fp32 ``F.linear`` for weight-only), x best (vs the fastest PyTorch option of the same class here: bf16,
fp32 and fbgemm for W8A8; bf16 and fp32 for weight-only, whose activations stay float), % int8 peak
(GOP/s over the measured int8 peak: ``torch._int_mm`` on a large square problem), W GB/s (weight bytes read per
second), rel err (``||out - ref|| / ||ref||`` against the float64 product of the same bf16 x, weight and bias: what
each provider's quantization costs). Every fastdl row slower than a PyTorch path is marked ``<<< SLOWER`` and listed
again at the end.

Like with like: W8A8 with 7-bit activations is judged against fbgemm (the path it replaces, the same activation
class) and the float paths; exact 8-bit W8A8 against the float paths, and against fbgemm only where fbgemm's error is
at most 1.1x its own (a less accurate result is not the same product); weight-only against the float paths.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch
import torch.nn.functional as F

from .. import backends
from ..ops import int8 as int8_ops
from .common import (
    LiveTable,
    activity,
    add_shape_arguments,
    env_columns,
    gemm_shapes,
    interleaved,
    mark_slower,
    module_main,
    over_time,
    print_header,
    say,
    sync,
    time_fn,
)

INT8_PROVIDERS = ("int_mm+dequant", "fbgemm_dynamic", "fastdl_w8a8", "fastdl_w8a8_u7", "fastdl_weight_only",
                  "fastdl_weight_only_g16")  # fmt: skip
QUICK_ARGS = ["--m", "1", "16", "128", "--llama-m", "--budget", "0.15"]
ALL_ARGS = ["--budget", "0.5"]
# The PyTorch providers a user could run instead (x best); int_mm+dequant leaves out the activation quantization.
TORCH_PROVIDERS = ("bf16", "fp32", "fbgemm_dynamic")

_INT8_PEAK: dict = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, llama_default="16 128 on CPU, 16 2048 4096 on CUDA")
    p.add_argument("--backends", nargs="+", default=None,
                   help="fastdl backends to time besides auto (default: every available one but torch and the one "
                        "auto picks)")  # fmt: skip
    p.add_argument("--no-baselines", action="store_true", help="time only bf16 and fastdl")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed runs per measurement (default 1.0 on CPU, 0.2 on CUDA)")
    p.add_argument("--cold", action="store_true",
                   help="flush the caches before every timed call: weights come from DRAM, as in a model whose "
                        "weights exceed the last-level cache (default: warm, each provider's weights stay cached "
                        "between its calls when they fit)")  # fmt: skip
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


def measured_int8_peak(device: str) -> float:
    """OP/s of ``torch._int_mm`` on a large square int8 problem here: what '% int8 peak' refers to. The best of
    several runs (a peak, not a typical time: on a shared or CPU-quota-throttled machine the median is far lower)."""
    if device not in _INT8_PEAK:
        n = 8192 if device.startswith("cuda") else 2048
        a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
        if not device.startswith("cuda"):
            t0 = time.perf_counter()
            torch._int_mm(a[:512, :512], b[:512, :512].t())
            if time.perf_counter() - t0 > 0.005:  # < 54 GOP/s at 512^3: a slow path (no VNNI); keep it short
                a, b, n = a[:512, :512].contiguous(), b[:512, :512].contiguous(), 512
        best = min(time_fn(lambda: torch._int_mm(a, b.t()), device, warmup=1, min_reps=1, max_reps=1)
                   for _ in range(10))  # fmt: skip
        _INT8_PEAK[device] = 2 * n**3 / best
    return _INT8_PEAK[device]


def _fbgemm_module(w: torch.Tensor, b: torch.Tensor):
    """PyTorch's dynamic-quantized nn.Linear (fbgemm), or (None, reason)."""
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as exc:  # removed in some future torch
        return None, f"torch.ao.quantization unavailable ({exc})"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None, f"fbgemm engine unavailable (engines: {torch.backends.quantized.supported_engines})"
    lin = torch.nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w.float())
        lin.bias.copy_(b.float())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.quantized.engine = "fbgemm"
            return quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8), None
    except Exception as exc:
        return None, f"quantize_dynamic failed: {type(exc).__name__}: {exc}"


def _int_mm_ok(M, K, N, device) -> str | None:
    if device.startswith("cuda") and not (M > 16 and K % 8 == 0 and N % 8 == 0):
        return "torch._int_mm on CUDA needs M > 16 and K, N multiples of 8"
    if K < 2:
        return "torch._int_mm is wrong for K == 1 on CPU"
    return None


def _providers(args, M, K, N, x, w, b, w_q, w_scale, notes):
    """name -> (callable, backend or None)."""
    dev = args.device
    cuda = dev.startswith("cuda")
    xf, wf, bf = x.float(), w.float(), b.float()
    provs = {"bf16": (lambda: F.linear(x, w, b), None)}
    if not args.no_baselines:
        provs["fp32"] = (lambda: F.linear(xf, wf, bf), None)
        why = _int_mm_ok(M, K, N, dev)
        if why is None:
            xq, xs = int8_ops.quantize_rows_reference(x)
            wt = w_q.t()

            def int_mm_dequant():
                acc = torch._int_mm(xq, wt)
                return (acc.float() * xs[:, None] * w_scale[None, :] + bf).to(torch.bfloat16)

            provs["int_mm+dequant"] = (int_mm_dequant, None)
        else:
            notes.add(f"int_mm+dequant skipped where {why}")
        if cuda:
            notes.add("fbgemm_dynamic skipped on CUDA (fbgemm is a CPU library)")
        else:
            mod, why = _fbgemm_module(w, b)
            if mod is None:
                notes.add(f"fbgemm_dynamic skipped: {why}")
            else:
                provs["fbgemm_dynamic"] = (lambda: mod(xf), None)
    packed = comp = None
    if not cuda and backends.available("cpp", "int8_linear", "cpu")[0]:
        packed, comp = int8_ops.int8_pack_weight(w_q)  # once, like Int8Linear
    provs["fastdl_w8a8"] = (lambda: int8_ops.int8_linear(x, w_q, w_scale, b, packed, comp), "auto")
    if cuda:
        notes.add("fastdl_w8a8_u7 skipped on CUDA (the 7-bit mode is for CPUs without VNNI; GPUs run it in PyTorch)")
    else:
        provs["fastdl_w8a8_u7"] = (lambda: int8_ops.int8_linear(x, w_q, w_scale, b, packed, comp, 7), "auto")
    provs["fastdl_weight_only"] = (lambda: int8_ops.int8_weight_only_linear(x, w_q, w_scale, b), "auto")
    g_q, g_s, g_g = int8_ops.quantize_per_group(w.float())
    provs["fastdl_weight_only_g16"] = (lambda: int8_ops.int8_weight_only_linear(x, g_q, g_s, b, g_g), "auto")
    dtype = "cuda" if cuda else "cpu"
    wanted = args.backends or [be for be in backends.BACKENDS if be != "torch"]
    named = (
        ("int8_linear", "fastdl_w8a8"),
        ("int8_weight_only_linear", "fastdl_weight_only"),
        ("int8_weight_only_linear", "fastdl_weight_only_g16"),
    )
    for be in wanted:
        for op, name in named:
            if not args.backends and be == backends.select(op, dtype):
                continue  # auto's choice: already timed as the provider without a suffix
            if be in backends.preference(op, dtype) and backends.available(be, op, dtype)[0]:
                provs[f"{name}[{be}]"] = (provs[name][0], be)
    return provs


COLUMNS = [("M", "M", 5), ("K", "K", 5), ("N", "N", 5), ("provider", "provider", 22), ("ms", "ms", 9),
           ("gops", "GOP/s", 7), ("x_bf16", "x bf16", 6), ("x_replaced", "x repl", 6), ("x_best", "x best", 6),
           ("pct_int8_peak", "% int8 peak", 11), ("weight_gbps", "W GB/s", 6),
           ("rel_err", "rel err", 8)]  # fmt: skip

# An exact 8-bit W8A8 row is judged against fbgemm only where fbgemm's error is at most this factor times its own.
FBGEMM_PEER_ERR = 1.1


def _peers(name: str, errs: dict) -> tuple[str, ...]:
    """The PyTorch providers a fastdl row is judged against (the module docstring: like with like)."""
    if "w8a8_u7" in name:
        return TORCH_PROVIDERS
    if "w8a8" in name:
        fb, own = errs.get("fbgemm_dynamic"), errs.get(name)
        as_good = fb is not None and own is not None and fb <= FBGEMM_PEER_ERR * own
        return TORCH_PROVIDERS if as_good else ("bf16", "fp32")
    return ("bf16", "fp32")


def _judge(row: dict, times: dict, name: str, errs: dict) -> None:
    """Ratios of a fastdl row against the PyTorch path it replaces and the best PyTorch path, marked when < 1."""
    t = times[name]
    floats = {k: times[k] for k in ("bf16", "fp32") if k in times}
    if not floats:  # no float baseline ran here: nothing to judge against
        return
    best_float = min(floats, key=floats.get)
    peers = _peers(name, errs)
    torch_t = {k: times[k] for k in peers if k in times}
    best = min(torch_t, key=torch_t.get)
    if "fbgemm_dynamic" in torch_t and "w8a8" in name:
        replaced, label = "fbgemm_dynamic", "PyTorch int8 (fbgemm dynamic quant)"
    else:
        replaced, label = best_float, f"eager {best_float} F.linear"
    row["replaces"] = replaced
    row["x_replaced"] = times[replaced] / t
    row["best_pytorch"] = best
    row["x_best"] = torch_t[best] / t
    checks = {label: row["x_replaced"]}
    if best != replaced:
        checks[f"best PyTorch ({best})"] = row["x_best"]
    if replaced != "bf16" and best != "bf16":
        checks["eager bf16"] = row["x_bf16"]
    mark_slower(row, checks)


def run(args) -> list[dict]:
    device = args.device
    cuda = device.startswith("cuda")
    budget = args.budget if args.budget is not None else (0.2 if cuda else 1.0)
    torch.manual_seed(0)
    print_header("int8", device)
    env = env_columns(device)
    activity("measuring the int8 peak")
    peak = measured_int8_peak(device)
    say(f"   measured int8 peak (torch._int_mm, large square) {peak / 1e9:.0f} GOP/s; caches "
        f"{'flushed before every call (--cold)' if args.cold else 'warm'}; int8 CPU kernels: "
        f"{env.get('int8_kernels') or _int8_kernels()}")  # fmt: skip
    for op in ("int8_linear", "int8_weight_only_linear"):
        be = backends.select(op, "cuda" if cuda else "cpu")
        say(f"   fastdl {op}: backend {be!r} in auto mode")
    table = LiveTable(COLUMNS)
    notes: set[str] = set()
    shapes = gemm_shapes(args, cpu_llama_m=[16, 128], cuda_llama_m=[16, 2048, 4096])
    try:
        for i, (M, K, N) in enumerate(shapes):
            if over_time(f"{len(shapes) - i} of {len(shapes)} shapes"):
                break
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w = (torch.randn(N, K, device=device) / K**0.5).to(torch.bfloat16)
            b = torch.randn(N, device=device, dtype=torch.bfloat16) * 0.1
            w_q, w_scale = int8_ops.quantize_per_channel(w.float())
            ops = 2 * M * N * K
            activity(f"int8 M={M} K={K} N={N}")
            calls, errs = {}, {}
            ref = torch.addmm(b.double(), x.double(), w.double().t())
            for name, (fn, be) in _providers(args, M, K, N, x, w, b, w_q, w_scale, notes).items():

                def call(fn=fn, be=be):
                    with backends.use_backend(be) if be else contextlib.nullcontext(), torch.no_grad():
                        return fn()

                try:
                    out = call()  # a provider that cannot run here is reported, not fatal
                except Exception as exc:
                    say(f"  {name} failed at M={M} K={K} N={N}: {type(exc).__name__}: {exc}")
                    continue
                calls[name] = call
                errs[name] = _rel_err(out, ref)
            del ref
            # alternating blocks of 3 calls per provider (one untimed call first: its weights back in the cache)
            try:
                times = interleaved(calls, device, budget_s=budget * len(calls), min_reps=4, block=3, cold=args.cold)
            except Exception as exc:  # one shape that fails does not lose the others' rows
                say(f"!! M={M} K={K} N={N} FAILED: {type(exc).__name__}: {exc}")
                continue
            rows = []
            for name, t in times.items():
                int8_weights = name.startswith(("fastdl", "int_mm", "fbgemm"))
                rows.append({
                    "op": "int8", "device": device, "cold": args.cold, "M": M, "K": K, "N": N, "provider": name,
                    "ms": t * 1e3, "reps": t.reps, "reduced": t.reduced,
                    "gops": ops / t / 1e9, "x_bf16": times["bf16"] / t if "bf16" in times else None,
                    "pct_int8_peak": 100 * ops / t / peak,
                    "weight_gbps": N * K * (1 if int8_weights else 2 if name != "fp32" else 4)
                    * (17 / 16 if "_g16" in name else 1) / t / 1e9,
                    "rel_err": errs.get(name),
                    **env,
                })  # fmt: skip
            for row in rows:
                if row["provider"].startswith("fastdl"):
                    _judge(row, times, row["provider"], errs)
                table.add(row)
            sync(device)
    except KeyboardInterrupt:
        say("  interrupted: the rows above are complete")
    for note in sorted(notes):
        say(f"note: {note}")
    return table.finish("fastdl int8", "PyTorch", args.csv)


def _rel_err(out, ref: torch.Tensor) -> float | None:
    """||out - ref|| / ||ref|| in float64 (None for an output that is not a tensor of ref's shape)."""
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return None
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _int8_kernels() -> str:
    from .._extension import int8_cpu_kernels

    return int8_cpu_kernels() or "none (no extension)"


def main(argv=None):
    return module_main("python -m fastdl.bench.int8", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
