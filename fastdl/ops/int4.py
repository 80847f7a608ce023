"""int4 weight-only linear: the op, its reference, the packing helpers, the quantizer and the GPTQ / AWQ importers.

The format (the contract with the kernels; weight ``W [N, K]``, N = out_features, K = in_features, group size
``G`` in {32, 64, 128}, ``K % G == 0``): codes ``u[n, k]`` in 0..15, per group ``g = k // G`` a scale ``s[n, g]``
(float16) and a zero point ``z[n, g]``::

    W[n, k] = (u[n, k] - z[n, g]) * float32(s[n, g])      (exact in fp32: a 5-bit integer times an fp16 value)

Symmetric (the default quantizer): no ``zeros`` tensor, ``z = 8`` (codes 0..15 are the values -8..7). Asymmetric
(AWQ, GPTQ with ``sym=False``): ``zeros`` uint8 ``[N, K / G]``, values 0..15.

``qweight`` uint8 ``[N, K / 2]``: blocks of 32 input features; byte ``16 b + i`` (0 <= i < 16) of row n holds
``u[n, 32 b + i]`` in its LOW nibble and ``u[n, 32 b + 16 + i]`` in its HIGH nibble (llama.cpp's Q4_0 order: one
16-byte load gives 32 consecutive codes as ``(v & 15, v >> 4)``). ``scales`` float16 ``[N, K / G]``; ``zeros``
optional uint8 ``[N, K / G]``; ``bias`` optional ``[N]``, any float dtype (read as fp32; as fp64 for float64 x).

Op ``int4_weight_only_linear(x, qweight, scales, zeros, bias, group_size) -> out``:
``out[..., n] = sum_k x[..., k] * W[n, k] + bias[n]`` with fp32 accumulation and one rounding to x's dtype
(x: float32 / bfloat16 / float16, and float64 on the reference path, which accumulates in fp64). One exception, for
speed where the products bound the time: bfloat16 x from 16 rows on a CPU with AVX512_BF16 multiplies W rounded to
bfloat16 (as autocast rounds an fp32 weight; the products of bf16 pairs in hardware, fp32 accumulation, twice the
fp32 rate), dequantized in blocks of rows into a bounded workspace (8 MiB, freed with the call). (At 3 to 7 rows of
bfloat16 x the same CPUs multiply bf16 pairs too, but of x and the exact ``u - z``, the group's sum times its scale
in fp32: the formula above, except that bf16 subnormals of x count as 0.) Inference op:
differentiable in x and bias (``grad_x = g @ W``, ``grad_bias = sum g``, like ``int8_weight_only_linear``), no
gradient for the weight. Backends: the C++ CPU kernel (``fastdl_cpp::int4_weight_only_linear``, registered by the
extension) where the extension has it, else this module's PyTorch reference; on CUDA the Triton kernels of
kernels/int4.py (``fastdl.kernels.int4``: a split-K GEMV for M <= 16, a tiled GEMM above).

Plain PyTorch helpers (run once per model, not ops): ``pack_int4`` / ``unpack_int4`` (the nibble order above),
``dequantize_int4`` (the formula above, exact, fp32), ``quantize_int4`` (round-to-nearest or a per-group scale
search, see there), ``import_gptq`` / ``import_awq`` (Hugging Face GPTQ / AutoAWQ checkpoint tensors converted
exactly into this layout). All but ``quantize_int4`` are written in ``_int4_formats.py`` and re-exported here.
"""

from __future__ import annotations

import math

import torch

from . import _frozen_linear as _frozen
from ._checks import check_same_device, check_vector, check_x
from ._frozen_linear import rows as _rows
from ._int4_formats import BLOCK, dequantize_int4, import_awq, import_gptq, pack_int4, unpack_int4  # noqa: F401
from ._library import define, register_autocast_rule, register_autograd, require, require_device, require_dtype

__all__ = [
    "GROUP_SIZES",
    "dequantize_int4",
    "import_awq",
    "import_gptq",
    "int4_weight_only_linear",
    "pack_int4",
    "quantize_int4",
    "unpack_int4",
]

GROUP_SIZES = (32, 64, 128)
METHODS = ("search", "rtn")
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SCHEMA = "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size) -> Tensor"
_OP = "int4_weight_only_linear"
_A8_OP = "int4_a8_linear"


# ----------------------------------------------------------------------------------------------- argument checks
def _check_group_size(fn: str, group_size) -> None:
    require_dtype(
        isinstance(group_size, int) and not isinstance(group_size, bool),
        lambda: f"{fn}: group_size must be an int (one of 32, 64, 128), got {type(group_size).__name__}",
    )
    require(group_size in GROUP_SIZES, lambda: f"{fn}: group_size must be one of 32, 64, 128, got {group_size}")


def _check_group_tensor(fn, name, t, dtype, N, groups, ref, what):
    require_dtype(t.dtype == dtype, lambda: f"{fn}: {name} must be {str(dtype)[6:]} ({what}), got dtype {t.dtype}")
    require(
        t.dim() == 2 and t.shape[0] == N and t.shape[1] == groups,
        lambda: f"{fn}: {name} must have shape [N, K / group_size] = [{N}, {groups}], got {tuple(t.shape)}",
    )
    require_device(
        t.device == ref.device,
        lambda: f"{fn}: {name} must be on the same device as x ({ref.device}), got {t.device}",
    )


def check_int4_linear(x, qweight, scales, zeros, bias, group_size):
    """The op's argument checks (every backend reports bad input with these types and words); returns (K, N)."""
    return _check_linear(_OP, x, qweight, scales, zeros, bias, group_size)


def check_int4_a8_linear(x, qweight, scales, zeros, bias, group_size):
    """``int4_a8_linear``'s argument checks: the same as ``int4_weight_only_linear``'s, in its own name."""
    return _check_linear(_A8_OP, x, qweight, scales, zeros, bias, group_size)


def _check_linear(fn, x, qweight, scales, zeros, bias, group_size):
    check_x(fn, x, _X_DTYPES, "float32, bfloat16, float16 or float64")
    _check_group_size(fn, group_size)
    K = x.shape[-1]
    require(
        K % group_size == 0,
        lambda: f"{fn}: K = x.shape[-1] = {K} must be a multiple of group_size = {group_size}",
    )
    require_dtype(
        qweight.dtype == torch.uint8,
        lambda: f"{fn}: qweight must be uint8 (two 4-bit codes per byte, from pack_int4), got dtype {qweight.dtype}",
    )
    require(
        qweight.dim() == 2 and qweight.shape[1] * 2 == K,
        lambda: f"{fn}: qweight must have shape [N, K / 2] with K = x.shape[-1] = {K}, got {tuple(qweight.shape)} "
        "(mismatched K)",
    )
    check_same_device(fn, "qweight", qweight, x)
    N, groups = qweight.shape[0], K // group_size
    _check_group_tensor(fn, "scales", scales, torch.float16, N, groups, x, "one scale per group")
    if zeros is not None:
        _check_group_tensor(fn, "zeros", zeros, torch.uint8, N, groups, x, "zero points 0..15, or None")
    if bias is not None:
        check_vector(fn, "bias", bias, N, x)
    return K, N


# --------------------------------------------------------------------------------------------------------- op
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _reference(x, qweight, scales, zeros, bias, group_size):
    """``x @ W.T + bias`` with W dequantized exactly (fp32), fp32 accumulation (fp64 for float64 x), one rounding."""
    N = qweight.shape[0]
    ct = _compute_dtype(x)
    w = dequantize_int4(qweight, scales.detach(), zeros, group_size).to(ct)
    out = torch.matmul(_rows(x).to(ct), w.t())
    if bias is not None:
        out = out + bias.to(ct)[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


def _supports(backend, args):
    if backend in ("cpp", "triton") and args[0].dtype == torch.float64:
        return "float64 x runs on the PyTorch reference"
    return None


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, bias, group_size = inputs
    _frozen.save_context(ctx, x, bias, (qweight, scales, zeros), group_size=group_size)


def _frozen_backward(ctx, grad_out):
    """``grad_x = g @ W`` (fp32, fp64 for float64 x; rounded to x's dtype), ``grad_bias = sum g``; no weight grad."""
    qweight, scales, zeros = ctx.saved_tensors

    def times_weight(g, ct):
        return torch.matmul(g.to(ct), dequantize_int4(qweight, scales.detach(), zeros, ctx.group_size).to(ct))

    return _frozen.grads(ctx, grad_out, 4, times_weight)


def _define_linear(name: str, reference, check, triton: str):
    """One of the two int4 linear ops: the same schema, argument checks (``check``, in the op's name), backends (the
    extension on the CPU, Triton on CUDA, the reference elsewhere and for float64 x), backward and autocast rule.
    The backward is made of differentiable torch ops, linear in grad_out and independent of x: its own double
    backward. Each ``reference`` is the differentiable form (x and bias enter through differentiable casts and a
    matmul)."""

    def fake(x, qweight, scales, zeros, bias, group_size):
        _, N = check(x, qweight, scales, zeros, bias, group_size)
        return x.new_empty((*x.shape[:-1], N))

    op = define(name, SCHEMA, reference=reference, fake=fake, check=check, supports=_supports, cuda=("triton", "torch"),
                triton=triton)  # fmt: skip
    register_autograd(op, _frozen_backward, _setup_context, double_backward=_frozen_backward)
    register_autocast_rule(name)
    return op


# cpp: the extension's CPU kernel once it registers one (until then backends.available() reports "fastdl._C has
# no CPU kernel" and auto takes torch). triton: kernels/int4.py (split-K GEMV for M <= 16, tiled GEMM above).
int4_weight_only_linear_op = _define_linear(_OP, _reference, check_int4_linear, "int4:int4_weight_only_linear")


def int4_weight_only_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    group_size: int = 128,
) -> torch.Tensor:
    """``x @ W.T + bias`` for the int4 weight ``W = (u - z) * scales`` (see the module docstring): ``x [..., K]``,
    ``qweight`` uint8 ``[N, K / 2]`` (``pack_int4``), ``scales`` float16 ``[N, K / group_size]``, ``zeros`` uint8
    ``[N, K / group_size]`` or None (symmetric, z = 8). Returns ``[..., N]`` in x's dtype (fp32 accumulation)."""
    return int4_weight_only_linear_op(x, qweight, scales, zeros, bias, group_size)


# ------------------------------------------------------------------------------------ W4A8: int4_a8_linear
# The int4 weight times int8 activations: x is quantized per row and per group of the weight's group_size input
# features (its own scale per group, symmetric, s_x = amax / 127, q = round_half_even(x * (127 / amax)), one IEEE
# division per group: bit for bit the C++ kernel's rounding), then every group's product sum_k q_x (u - z) is an
# exact integer (vpdpbusd / vpmaddubsw in the kernels), scaled by s_x * s_w. A group of x with a NaN or infinity
# gets a NaN scale (its row's outputs are NaN); an all-zero group gets 0. The activations' rounding adds an error of
# ~0.2 % of the output (measured in tests/test_int4.py: about 1/50 of int4's own weight error), for integer products
# that run at the memory's speed (fastdl bench int4).
def quantize_groups(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` quantized per row and group: ``(q int8 [M, K], s float32 [M, K / group_size])`` (the contract
    above, written plainly in PyTorch)."""
    M, K = x2.shape
    G = K // group_size
    xg = x2.float().reshape(M, G, group_size)
    a = xg.abs()
    amax = torch.where(torch.isnan(a), math.inf, a).amax(dim=-1)
    finite = torch.isfinite(amax)
    ok = finite & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    c127 = torch.full_like(safe, 127.0)
    inv = torch.div(c127, safe)  # tensor / tensor: an IEEE division, as the kernel's
    v = xg * inv[..., None]
    v = torch.where(torch.isnan(v), 0.0, v).clamp_(-127.0, 127.0).round_()  # round half to even
    q = torch.where(ok[..., None], v, 0.0).to(torch.int8).reshape(M, K)
    scale = torch.where(ok, torch.div(safe, c127), torch.where(finite, 0.0, math.nan))
    return q, scale


def _a8_reference(x, qweight, scales, zeros, bias, group_size):
    """``x_q @ W.T + bias`` with x_q = q_x * s_x (per row and group) and W dequantized exactly, fp32 accumulation
    (fp64 for float64 x), one rounding to x's dtype."""
    N, K = qweight.shape[0], x.shape[-1]
    ct = _compute_dtype(x)
    q, sx = quantize_groups(_rows(x).detach(), group_size)
    xq = (q.to(ct).reshape(-1, K // group_size, group_size) * sx.to(ct)[..., None]).reshape(-1, K)
    w = dequantize_int4(qweight, scales.detach(), zeros, group_size).to(ct)
    out = torch.matmul(xq, w.t())
    if bias is not None:
        out = out + bias.to(ct)[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


# triton: kernels/int4.py (the quantization in the split-K GEMV's registers for M <= 16; else a quantization
# kernel and an int8 tl.dot GEMM). The derivative is straight through the activations' rounding (as int8_linear's):
# grad_x = g @ W, grad_bias = sum g.
int4_a8_linear_op = _define_linear(_A8_OP, _a8_reference, check_int4_a8_linear, "int4:int4_a8_linear")


def int4_a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    group_size: int = 128,
) -> torch.Tensor:
    """W4A8: ``int4_weight_only_linear`` with x quantized to int8 per row and group first (see above): the same
    arguments, integer products. Returns ``[..., N]`` in x's dtype."""
    return int4_a8_linear_op(x, qweight, scales, zeros, bias, group_size)


# --------------------------------------------------------------------------------------------------- quantizer
# Symmetric codes are the values q = u - 8 in -8..7: 8 steps on one side of zero, 7 on the other. Round-to-nearest
# ("rtn") is the plain rule: s = absmax / 7, so every weight is in range and code 0 (-8) is never used. The search
# (after llama.cpp's make_qx_quants and HQQ's scale search) tries per group the scales s = m / -c for the grid of c
# below (m: the group's weight of largest magnitude, signed, so that it lands on the 8-step side: llama.cpp's Q4_0
# uses c = 8; a scale may therefore be negative), rounds the group for each, refits the scale to those codes by least
# squares (s = sum w q / sum q^2), rounds it to fp16, re-rounds the codes to that fp16 scale and keeps the candidate
# with the least squared error (computed with the fp16 scale the kernels use). RTN is the first candidate, so the
# search is never worse than it per group. Asymmetric: the range [min(w, 0), max(w, 0)] / 15 shrunk by the same
# grid, the zero point round(-min / s), the scale refitted with the zero point fixed.
# Measured on Gaussian [512, 4096] weights (and with 1 % of them x10): c in 7 .. 10 by 0.25 (13 candidates) gives the
# MSE of steps of 0.125 or 0.1 (within 0.3 %) and of 6 .. 12; search / RTN MSE = 0.70 (G = 32) and 0.68 (G = 128),
# with outliers 0.75 and 0.70. (llama.cpp's Q4_0 rule alone, c = 8 without the refit: 0.78 / 0.77 / 0.79 / 0.80.)
_SEARCH_C = tuple(7.0 + 0.25 * i for i in range(13))
_CHUNK = 1 << 19  # weights searched at a time (2 MB temporaries): 2048 x 5632 on Zen 4 in 1.1 s (1 << 21: 3.6 s)


def _fp16_scale(s: torch.Tensor) -> torch.Tensor:
    return s.to(torch.float16).float()


def _codes(wg, s, z):
    """RTN codes of ``wg [R, G]`` for scales ``s [R, 1]`` (0 allowed: all codes z) and zero points ``z [R, 1]``."""
    inv = torch.where(s != 0, 1.0 / torch.where(s != 0, s, 1.0), 0.0)
    return (wg * inv).round_().add_(z).clamp_(0, 15)


def _error(wg, u, s, z):
    return ((u - z) * s - wg).square_().sum(dim=1, keepdim=True)


def _search_chunk(wg: torch.Tensor, search: bool, symmetric: bool):
    """(codes float [R, G], fp16-rounded scales [R, 1], zero points [R, 1]) of the groups ``wg [R, G]`` (fp32)."""
    if symmetric:
        idx = wg.abs().argmax(dim=1, keepdim=True)
        m = wg.gather(1, idx)  # signed weight of largest magnitude
        z = torch.full_like(m, 8.0)
        s = _fp16_scale(m.abs() / 7.0)  # plain RTN
        lo = hi = None
    else:
        lo = wg.amin(dim=1, keepdim=True).clamp_(max=0.0)
        hi = wg.amax(dim=1, keepdim=True).clamp_(min=0.0)
        s = _fp16_scale((hi - lo) / 15.0)
        z = torch.where(s != 0, (-lo / torch.where(s != 0, s, 1.0)).round_(), 0.0).clamp_(0, 15)
    best_u = _codes(wg, s, z)
    if not search:
        return best_u, s, z
    best_s, best_z = s, z
    best_err = _error(wg, best_u, s, z)
    del best_u  # the codes of the best scale are made once at the end
    for c in _SEARCH_C:
        if symmetric:
            s0 = m / -c
            zc = z
        else:
            s0 = (hi - lo) / (15.0 * c / 7.0)  # the same grid, as a shrink of the range: 1 .. 0.7
            zc = torch.where(s0 != 0, (-lo / torch.where(s0 != 0, s0, 1.0)).round_(), 0.0).clamp_(0, 15)
        q = _codes(wg, s0, zc).sub_(zc)
        den = q.square().sum(dim=1, keepdim=True)
        s1 = torch.where(den > 0, (wg * q).sum(dim=1, keepdim=True) / den.clamp_min(1.0), s0)  # least squares
        s1 = _fp16_scale(s1)
        u = _codes(wg, s1, zc)
        err = _error(wg, u, s1, zc)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s1, best_s)
        best_z = torch.where(better, zc, best_z)
    return _codes(wg, best_s, best_z), best_s, best_z


@torch.no_grad()
def quantize_int4(
    w: torch.Tensor, group_size: int = 128, method: str = "search", symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize a float weight ``w [N, K]`` to the int4 format: ``(qweight uint8 [N, K / 2], scales float16
    [N, K / group_size], zeros uint8 [N, K / group_size] or None)`` with ``w ~= dequantize_int4(...)``.

    ``method="rtn"``: round to nearest with the group's absmax scale (symmetric: ``s = absmax / 7``, codes
    ``clamp(round(w / s) + 8, 0, 15)``; asymmetric: ``s = (max - min) / 15`` over ``[min(w, 0), max(w, 0)]``, ``z =
    round(-min / s)``). ``method="search"`` (default): per group the scale with the least squared weight error among
    RTN's and 13 refitted candidates (see the comment above ``_SEARCH_C``); scales are float16 and the error is that
    of the fp16 scale. Symmetric (default): no zero points (z = 8). A zero group gets scale 0. NaN/Inf weights, or a
    group whose scale exceeds float16's range, raise ValueError."""
    fn = "quantize_int4"
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{fn}: w must be a torch.Tensor, got {type(w).__name__}")
    require_dtype(w.is_floating_point(), lambda: f"{fn}: w must be a floating tensor, got dtype {w.dtype}")
    require(w.dim() == 2, lambda: f"{fn}: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    _check_group_size(fn, group_size)
    require(method in METHODS, lambda: f"{fn}: method must be 'search' or 'rtn', got {method!r}")
    N, K = w.shape
    require(K % group_size == 0, lambda: f"{fn}: K = w.shape[1] = {K} must be a multiple of group_size = {group_size}")
    groups = K // group_size
    dev = w.device
    if w.is_meta:  # shapes only (models built on the meta device)
        zeros = None if symmetric else torch.empty((N, groups), dtype=torch.uint8, device=dev)
        return (torch.empty((N, K // 2), dtype=torch.uint8, device=dev),
                torch.empty((N, groups), dtype=torch.float16, device=dev), zeros)  # fmt: skip
    w = w.detach()
    if w.numel() and not bool(torch.isfinite(w).all()):
        bad = (~torch.isfinite(w)).nonzero()[0].tolist()
        raise ValueError(f"{fn}: w must be finite; it holds NaN or Inf (first at {tuple(bad)}: {float(w[tuple(bad)])})")
    wg = w.float().reshape(N * groups, group_size)
    rows = max(1, _CHUNK // group_size)
    parts = [_search_chunk(wg[i : i + rows], method == "search", symmetric) for i in range(0, N * groups, rows)]
    if parts:
        u, s, z = (torch.cat(t) for t in zip(*parts))
    else:
        u, s, z = wg.new_zeros((0, group_size)), wg.new_zeros((0, 1)), wg.new_zeros((0, 1))
    scales = s.reshape(N, groups).to(torch.float16)
    if not bool(torch.isfinite(scales).all()):
        amax = float(w.abs().max())
        raise ValueError(f"{fn}: w has weights too large for float16 group scales (max |w| = {amax:.4g}; a scale "
                         f"must stay below 65504)")  # fmt: skip
    qweight = pack_int4(u.reshape(N, K).to(torch.uint8))
    zeros = None if symmetric else z.reshape(N, groups).to(torch.uint8)
    return qweight, scales, zeros
