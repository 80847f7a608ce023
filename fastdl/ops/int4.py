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
(x: float32 / bfloat16 / float16, and float64 on the reference path, which accumulates in fp64). Inference op:
differentiable in x and bias (``grad_x = g @ W``, ``grad_bias = sum g``, like ``int8_weight_only_linear``), no
gradient for the weight. Backends: the C++ CPU kernel (``fastdl_cpp::int4_weight_only_linear``, registered by the
extension) where the extension has it, else this module's PyTorch reference; on CUDA the Triton kernels of
kernels/int4.py (``fastdl.kernels.int4``: a split-K GEMV for M <= 16, a tiled GEMM above).

Plain PyTorch helpers (run once per model, not ops): ``pack_int4`` / ``unpack_int4`` (the nibble order above),
``dequantize_int4`` (the formula above, exact, fp32), ``quantize_int4`` (round-to-nearest or a per-group scale
search, see there), ``import_gptq`` / ``import_awq`` (Hugging Face GPTQ / AutoAWQ checkpoint tensors converted
exactly into this layout).
"""

from __future__ import annotations

import math

import torch

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
BLOCK = 32  # input features per 16-byte block of qweight
METHODS = ("search", "rtn")
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SCHEMA = "(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, int group_size) -> Tensor"
_OP = "int4_weight_only_linear"
_A8_OP = "int4_a8_linear"


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` as ``[M, K]`` (``reshape(-1, K)`` is ambiguous when K == 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


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
    require_dtype(
        x.dtype in _X_DTYPES,
        lambda: f"{fn}: x must be float32, bfloat16, float16 or float64, got dtype {x.dtype}",
    )
    require(x.dim() >= 1, lambda: f"{fn}: x must have at least 1 dimension [..., K], got a 0-dim tensor")
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
    require_device(
        qweight.device == x.device,
        lambda: f"{fn}: qweight must be on the same device as x ({x.device}), got {qweight.device}",
    )
    N, groups = qweight.shape[0], K // group_size
    _check_group_tensor(fn, "scales", scales, torch.float16, N, groups, x, "one scale per group")
    if zeros is not None:
        _check_group_tensor(fn, "zeros", zeros, torch.uint8, N, groups, x, "zero points 0..15, or None")
    if bias is not None:
        require_dtype(bias.dtype in _FLOAT, lambda: f"{fn}: bias must be a floating tensor, got dtype {bias.dtype}")
        require(
            bias.dim() == 1 and bias.shape[0] == N,
            lambda: f"{fn}: bias must have shape [N] = [{N}], got {tuple(bias.shape)}",
        )
        require_device(
            bias.device == x.device,
            lambda: f"{fn}: bias must be on the same device as x ({x.device}), got {bias.device}",
        )
    return K, N


# ---------------------------------------------------------------------------------------------- layout helpers
def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Codes ``u [N, K]`` (uint8, 0..15; K a multiple of 32) as ``qweight [N, K / 2]`` in the contract's nibble order:
    byte ``16 b + i`` = ``u[32 b + i] | u[32 b + 16 + i] << 4``. Values above 15 raise ValueError."""
    fn = "pack_int4"
    require_dtype(u.dtype == torch.uint8, lambda: f"{fn}: u must be uint8 (codes 0..15), got dtype {u.dtype}")
    require(u.dim() == 2, lambda: f"{fn}: u must be 2-D [N, K], got shape {tuple(u.shape)}")
    N, K = u.shape
    require(K % BLOCK == 0, lambda: f"{fn}: K = u.shape[1] = {K} must be a multiple of {BLOCK}")
    if not u.is_meta and u.numel():
        require(bool((u <= 15).all()), lambda: f"{fn}: u must hold codes 0..15, got a maximum of {int(u.max())}")
    blocks = u.reshape(N, K // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(qweight: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """The codes ``u [N, K]`` (uint8, 0..15) of ``qweight [N, K / 2]`` (inverse of ``pack_int4``)."""
    fn = "unpack_int4"
    require_dtype(qweight.dtype == torch.uint8, lambda: f"{fn}: qweight must be uint8, got dtype {qweight.dtype}")
    require(qweight.dim() == 2, lambda: f"{fn}: qweight must be 2-D [N, K / 2], got shape {tuple(qweight.shape)}")
    N, half = qweight.shape
    if K is None:
        K = 2 * half
    require(
        K == 2 * half and K % BLOCK == 0,
        lambda: f"{fn}: qweight of shape {tuple(qweight.shape)} holds K = {2 * half} codes per row; K must be that "
        f"and a multiple of {BLOCK}, got K = {K}",
    )
    blocks = qweight.reshape(N, K // BLOCK, 1, BLOCK // 2)
    return torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(N, K)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:  # fmt: skip
    """``W [N, K]`` in fp32: ``(u - z) * float32(s)`` per group (exact), z = 8 when ``zeros`` is None."""
    u = unpack_int4(qweight)
    N, K = u.shape
    if K == 0:
        return torch.zeros((N, 0), dtype=torch.float32, device=qweight.device)
    groups = K // group_size
    z = 8.0 if zeros is None else zeros.float().reshape(N, groups, 1)
    w = (u.float().reshape(N, groups, group_size) - z) * scales.float().reshape(N, groups, 1)
    return w.reshape(N, K)


# --------------------------------------------------------------------------------------------------------- op
def _fake(x, qweight, scales, zeros, bias, group_size):
    _, N = check_int4_linear(x, qweight, scales, zeros, bias, group_size)
    return x.new_empty((*x.shape[:-1], N))


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


int4_weight_only_linear_op = define(
    _OP,
    SCHEMA,
    reference=_reference,
    fake=_fake,
    # cpp: the extension's CPU kernel once it registers one (until then backends.available() reports "fastdl._C has
    # no CPU kernel" and auto takes torch). triton: kernels/int4.py (split-K GEMV for M <= 16, tiled GEMM above).
    prefer={"cpu": ("cpp", "torch"), "cuda": ("triton", "torch")},
    triton="int4:int4_weight_only_linear",
    supports=_supports,
    check=check_int4_linear,
)


def _setup_context(ctx, inputs, output):
    x, qweight, scales, zeros, bias, group_size = inputs
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.group_size = group_size
    ctx.save_for_backward(qweight, scales, zeros)


def _frozen_backward(ctx, grad_out):
    """``grad_x = g @ W`` (fp32, fp64 for float64 x; rounded to x's dtype), ``grad_bias = sum g``; no weight grad."""
    qweight, scales, zeros = ctx.saved_tensors
    g = _rows(grad_out)
    gx = gb = None
    ct = torch.float64 if ctx.x_dtype == torch.float64 else torch.float32
    if ctx.needs_input_grad[0]:
        w = dequantize_int4(qweight, scales.detach(), zeros, ctx.group_size).to(ct)
        gx = torch.matmul(g.to(ct), w).to(ctx.x_dtype).reshape(ctx.x_shape)
    if ctx.needs_input_grad[4]:
        gb = g.to(ct).sum(0).to(ctx.bias_dtype)
    return gx, None, None, None, gb, None


# The backward is made of differentiable torch ops, linear in grad_out and independent of x: its own double backward.
# The reference is the differentiable form (x and bias enter through differentiable casts and a matmul).
register_autograd(int4_weight_only_linear_op, _frozen_backward, _setup_context, double_backward=_frozen_backward)
register_autocast_rule(_OP)


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


def _a8_fake(x, qweight, scales, zeros, bias, group_size):
    _, N = check_int4_a8_linear(x, qweight, scales, zeros, bias, group_size)
    return x.new_empty((*x.shape[:-1], N))


int4_a8_linear_op = define(
    _A8_OP,
    SCHEMA,
    reference=_a8_reference,
    fake=_a8_fake,
    prefer={"cpu": ("cpp", "torch"), "cuda": ("triton", "torch")},
    # triton: kernels/int4.py (the quantization in the split-K GEMV's registers for M <= 16; else a quantization
    # kernel and an int8 tl.dot GEMM)
    triton="int4:int4_a8_linear",
    supports=_supports,
    check=check_int4_a8_linear,
)
# The derivative is straight through the activations' rounding (as int8_linear's): grad_x = g @ W, grad_bias = sum g.
register_autograd(int4_a8_linear_op, _frozen_backward, _setup_context, double_backward=_frozen_backward)
register_autocast_rule(_A8_OP)


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


# --------------------------------------------------------------------------------------------------- importers
def _check_int32_2d(fn, name, t, shape_doc):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    require_dtype(t.dtype == torch.int32, lambda: f"{fn}: {name} must be int32 (packed codes), got dtype {t.dtype}")
    require(t.dim() == 2, lambda: f"{fn}: {name} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """The 8 4-bit fields of each int32 of ``t [A, B]`` as ``[A, B, 8]`` (field j = bits 4j..4j+3), int64."""
    shifts = torch.arange(0, 32, 4, device=t.device, dtype=torch.int64)
    return (t.to(torch.int64)[..., None] >> shifts) & 15


def _check_scales(fn, scales, groups, N):
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{fn}: scales must be a torch.Tensor, got {type(scales).__name__}")
    require_dtype(scales.is_floating_point(), lambda: f"{fn}: scales must be float16, got dtype {scales.dtype}")
    require(
        scales.dim() == 2 and scales.shape[1] == N,
        lambda: f"{fn}: scales must have shape [K / group_size, N] with N = {N}, got {tuple(scales.shape)}",
    )
    s16 = scales.to(torch.float16)
    require(
        bool(torch.equal(s16.to(scales.dtype), scales)) if scales.dtype != torch.float16 else True,
        lambda: f"{fn}: scales must be float16 (or hold float16 values exactly), got {scales.dtype} values that "
        "float16 cannot hold",
    )
    require(bool(torch.isfinite(s16).all()), lambda: f"{fn}: scales must be finite")
    return s16


def _regroup(fn, src_group: int, K: int):
    """The fastdl group size for a checkpoint's group size: the largest of 128, 64, 32 that divides it (the source
    group's scale and zero repeat over its sub-groups: exact)."""
    for g in (128, 64, 32):
        if src_group % g == 0 and K % g == 0:
            return g
    raise ValueError(f"{fn}: the checkpoint's group size {src_group} (K = {K}) is not a multiple of 32; fastdl's int4 "
                     "groups are 32, 64 or 128 input features")  # fmt: skip


def _finish_import(fn, u_nk, scales_gn, zeros_gn, src_group, K, N):
    """Codes ``[N, K]``, scales / zeros ``[K / src_group, N]`` (zeros: ints, None = 8) into the contract's tensors."""
    G = _regroup(fn, src_group, K)
    rep = src_group // G
    scales = scales_gn.t().repeat_interleave(rep, dim=1).contiguous()
    zeros = None
    if zeros_gn is not None:
        z = zeros_gn.t().repeat_interleave(rep, dim=1)
        bad = (z < 0) | (z > 15)
        if bool(bad.any()):
            n, g = bad.nonzero()[0].tolist()
            raise ValueError(f"{fn}: qzeros decodes to a zero point of {int(z[n, g])} at output {n}, group {g}; fastdl "
                             "zero points are 0..15 (a GPTQ 'v1' checkpoint stores z - 1: a stored 15 means z = 16, "
                             "which the packing of z = 0 produces by overflow; such a checkpoint is damaged)")
        zeros = None if bool((z == 8).all()) else z.to(torch.uint8).contiguous()
    return pack_int4(u_nk.to(torch.uint8).contiguous()), scales, zeros, G


_GPTQ_FORMATS = {"v1": "v1", "gptq": "v1", "v2": "v2", "gptq_v2": "v2"}


def import_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
                *, format: str = "v1"):  # fmt: skip
    """Convert a 4-bit GPTQ layer as Hugging Face checkpoints store it (AutoGPTQ / optimum / transformers' GPTQ
    integration) into fastdl's int4 format, exactly. Returns ``(qweight, scales, zeros, group_size, perm)``:
    ``zeros`` None when every zero point is 8 (``sym=True``), ``perm`` None or an int64 ``[K]`` input permutation.

    The checkpoint's tensors (K = in_features, N = out_features, G its group size):
      ``qweight`` int32 ``[K / 8, N]``: code of input ``k`` in row ``k // 8``, bits ``4 (k % 8)`` .. ``+3``;
      ``qzeros``  int32 ``[K / G, N / 8]``: zero point of output ``n`` in column ``n // 8``, bits ``4 (n % 8)``;
      ``scales``  float16 ``[K / G, N]``;
      ``g_idx``   int32 ``[K]`` (optional): the group of each input feature; with act-order (``desc_act``) it is
                  not ``k // G``: the inputs are then sorted by group (``perm``) so that groups are contiguous, and the
                  layer computes ``x[..., perm] @ W.T`` (exact).
    ``W[:, k] = (code - zero) * scale`` of group ``g_idx[k]``. ``format="v1"`` (default; ``checkpoint_format:
    "gptq"`` in quantize_config.json, what AutoGPTQ, optimum, transformers and GPTQModel write by default: ``qzeros``
    holds ``zero - 1``, added back when unpacking) or ``"v2"`` (``checkpoint_format: "gptq_v2"``: ``qzeros`` holds the
    zero point); the quantize_config names ``"gptq"`` / ``"gptq_v2"`` are accepted too. (Packing facts from
    AutoGPTQ's ``qlinear_cuda_old.QuantLinear.pack`` and its torch fallback: ``zeros -= 1`` before packing, ``zeros +
    1`` after unpacking.) A checkpoint group size that is a multiple of 32 is supported (256, or ``-1``: one group of
    K, become groups of 128 with repeated scales)."""
    fn = "import_gptq"
    require(format in _GPTQ_FORMATS, lambda: f"{fn}: format must be 'v1' ('gptq') or 'v2' ('gptq_v2'), got {format!r}")
    format = _GPTQ_FORMATS[format]
    _check_int32_2d(fn, "qweight", qweight, "[K / 8, N]")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    require(K % BLOCK == 0, lambda: f"{fn}: in_features K = 8 * qweight.shape[0] = {K} must be a multiple of 32")
    _check_int32_2d(fn, "qzeros", qzeros, "[K / group_size, N / 8]")
    groups = qzeros.shape[0]
    require(
        qzeros.shape[1] * 8 == N and groups >= 1,
        lambda: f"{fn}: qzeros must have shape [K / group_size, N / 8] with N = {N}, got {tuple(qzeros.shape)}",
    )
    s16 = _check_scales(fn, scales, groups, N)
    require(
        s16.shape[0] == groups,
        lambda: f"{fn}: scales must have shape [K / group_size, N] = [{groups}, {N}] (as qzeros), got "
        f"{tuple(s16.shape)}",
    )
    require(K % groups == 0, lambda: f"{fn}: K = {K} is not a whole number of the checkpoint's {groups} groups")
    src_group = K // groups
    u_kn = _nibbles(qweight).permute(0, 2, 1).reshape(K, N)  # row r, field j -> input 8 r + j
    z_gn = _nibbles(qzeros).reshape(groups, N)  # column c, field j -> output 8 c + j
    if format == "v1":
        z_gn = z_gn + 1
    perm = None
    if g_idx is not None:
        if not isinstance(g_idx, torch.Tensor):
            raise TypeError(f"{fn}: g_idx must be a torch.Tensor or None, got {type(g_idx).__name__}")
        require_dtype(not g_idx.is_floating_point() and g_idx.dtype != torch.bool,
                      lambda: f"{fn}: g_idx must be an integer tensor (int32), got dtype {g_idx.dtype}")
        require(g_idx.shape == (K,), lambda: f"{fn}: g_idx must have shape [K] = [{K}], got {tuple(g_idx.shape)}")
        gi = g_idx.to(torch.int64)
        require(bool(((gi >= 0) & (gi < groups)).all()),
                lambda: f"{fn}: g_idx values must be group indices 0..{groups - 1}")
        counts = torch.bincount(gi, minlength=groups)
        require(bool((counts == src_group).all()),
                lambda: f"{fn}: g_idx must give each of the {groups} groups {src_group} input features, got counts "
                f"{counts.tolist()[:8]}...")
        if not torch.equal(gi, torch.arange(K, device=gi.device) // src_group):
            perm = torch.sort(gi, stable=True).indices
            u_kn = u_kn[perm]
    return (*_finish_import(fn, u_kn.t(), s16, z_gn, src_group, K, N), perm)


# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py WQLinear_GEMM.from_linear, awq/utils/packing_utils.py): int32
# column c of qweight [K, N / 8] holds in bits 4 i .. 4 i + 3 the code of output 8 c + AWQ_ORDER[i]; qzeros likewise;
# zero points are stored as they are (no - 1).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def import_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """Convert a 4-bit AutoAWQ layer (the GEMM version, as Hugging Face checkpoints of AWQ models store it) into
    fastdl's int4 format, exactly. Returns ``(qweight, scales, zeros, group_size)`` (``zeros`` None when every zero
    point is 8).

    The checkpoint's tensors: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[K / G, N / 8]``, packed along N
    in AWQ's interleaved order (field ``i`` of column ``c``, bits ``4 i`` .. ``4 i + 3``, holds output
    ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``scales`` float16 ``[K / G, N]``; ``W[n, k] = (code - zero) * scale``."""
    fn = "import_awq"
    _check_int32_2d(fn, "qweight", qweight, "[K, N / 8]")
    K, N = qweight.shape[0], qweight.shape[1] * 8
    require(K % BLOCK == 0, lambda: f"{fn}: in_features K = qweight.shape[0] = {K} must be a multiple of 32")
    _check_int32_2d(fn, "qzeros", qzeros, "[K / group_size, N / 8]")
    groups = qzeros.shape[0]
    require(
        qzeros.shape[1] * 8 == N and groups >= 1,
        lambda: f"{fn}: qzeros must have shape [K / group_size, N / 8] with N = {N}, got {tuple(qzeros.shape)}",
    )
    s16 = _check_scales(fn, scales, groups, N)
    require(
        s16.shape[0] == groups,
        lambda: f"{fn}: scales must have shape [K / group_size, N] = [{groups}, {N}] (as qzeros), got "
        f"{tuple(s16.shape)}",
    )
    require(K % groups == 0, lambda: f"{fn}: K = {K} is not a whole number of the checkpoint's {groups} groups")
    order = torch.tensor(AWQ_ORDER, device=qweight.device)
    undo = torch.argsort(order)  # field holding output j of each 8: undo[j]

    def unpack(t):
        f = _nibbles(t)  # [A, N / 8, 8]: field i = output 8 c + AWQ_ORDER[i]
        return f[:, :, undo].reshape(t.shape[0], N)

    u_kn, z_gn = unpack(qweight), unpack(qzeros)
    return _finish_import(fn, u_kn.t(), s16, z_gn, K // groups, K, N)
