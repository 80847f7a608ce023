"""Triton kernels for int8 quantized linear layers (the op contract lives in fastdl/ops/int8.py).

Public launchers (same arguments as the ops):

    quantize_per_token(x) -> (q, scale)
    int8_mm(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp) -> out
    int8_linear(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8) -> out
    int8_weight_only_linear(x, w_q, w_scale, bias, w_group_scale=None) -> out

Kernels:

* ``_quant_kernel``: per-token quantization, BLOCK_M rows per program; the row is held in registers when it fits
  (one read of x), else two passes over it (the second from L2).
* ``_int8_mm_kernel``: int8 x int8 ``tl.dot`` with int32 accumulation (exact: integer adds are associative, so the
  result is bit-identical to any other exact order) and the dequant ``((float(acc) * a_scale) * b_scale) + bias`` and
  the cast fused in the epilogue; no int32 [M, N] tensor is written for float outputs. It is compiled with
  ``enable_fp_fusion=False`` so the epilogue is not contracted into an fma (the contract fixes the rounding order).
  With ``QUANT_A`` the per-token quantization is fused into its prologue: every program first reduces the row
  maxima of its BLOCK_M rows of x, then quantizes the x tiles in registers right before the dot. This re-reads the
  float rows once per column block, so it is used only for small M (``FUSE_MAX_M``; decode-like shapes, where x
  is tiny and L2-resident and the saved launch and q round trip matter); larger M runs ``_quant_kernel`` once and
  then the plain int8 GEMM (x read once, the GEMM reads 1-byte A tiles).
* ``_wo_kernel``: weight-only int8: the int8 weight tile is loaded and converted to x's dtype in registers (exact:
  |w| <= 127 is representable in bf16/fp16), ``tl.dot`` with fp32 accumulation, then ``* w_scale + bias``. With
  group scales (``HAS_GROUPS``) the uint8 code of each element's group (``k // WEIGHT_GROUP``) is loaded alongside
  and ``d = w * code`` is formed in fp32 (exact, |d| <= 127 * 255) before the cast to x's dtype (fp16 keeps 11
  significant bits of d, bf16 8: the precision of a 16-bit GEMM on the dequantized weight).
* ``_wo_gemv_kernel``: weight-only for M <= ``GEMV_MAX_M`` (decode): no tensor-core padding of M to 16, each
  program streams a [BLOCK_N, K] slab of the weight with coalesced 1-byte loads and keeps one accumulator row per
  token; purely bandwidth bound (the weight is read exactly once). Group scales as above (d exact in fp32).

Round half to even: ``libdevice.rint`` (cvt.rni) on the GPU; the interpreter has no libdevice, so there the
``(v + 1.5 * 2**23) - 1.5 * 2**23`` identity is used (exact for |v| <= 127 under round-to-nearest-even).
Divisions are ``tl.math.div_rn`` (IEEE), never the approximate ``/``.

Interpreter mode (``TRITON_INTERPRET=1``, CPU tensors): one small config per kernel instead of autotuning; 16-bit
dot operands are upcast to fp32 (bf16 ``tl.dot`` is broken in the interpreter; int8 dot works there).

This module imports triton, torch and its neighbours ``_tuning`` (launch configs) and ``constants`` (the weight
group); nothing of ``fastdl``. It imports without a GPU.
"""

import math
import os
import warnings

import torch
import triton
import triton.language as tl

from . import _tuning
from ._common import USE_RINT as _USE_RINT
from ._common import abs_nan_inf as _abs_nan_inf
from ._common import cast_out as _cast_out
from ._common import grouped_pid as _grouped_pid
from ._common import quant_params as _quant_params
from ._common import rint as _rint
from ._tuning import INTERPRET as _INTERPRET
from ._tuning import tile as _tile
from .constants import WEIGHT_GROUP as _WEIGHT_GROUP

__all__ = ["quantize_per_token", "int8_mm", "int8_linear", "int8_weight_only_linear"]

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# int8_linear fuses the quantization into the GEMM prologue for M <= FUSE_MAX_M (see the module docstring).
FUSE_MAX_M = _env_int("FASTDL_INT8_FUSE_MAX_M", 64)
# int8_weight_only_linear uses the GEMV kernel for M <= GEMV_MAX_M.
GEMV_MAX_M = _env_int("FASTDL_INT8_GEMV_MAX_M", 4)
_GROUP = 8
# k per group scale of int8_weight_only_linear: the op's (fastdl/ops/int8.py). The kernels below write it as the
# literal 16 (k // 16: a constant divisor the compiler turns into a shift).
WEIGHT_GROUP = _WEIGHT_GROUP
assert WEIGHT_GROUP == 16, "kernels/int8.py: the weight-only kernels take groups of 16 k"
# Set to the error text if the fused-quantization GEMM fails to compile here (e.g. a Triton version without
# register-operand int8 dots on this GPU): int8_linear then runs the two-kernel path, and says so once.
_FUSED_ERROR = None

# --------------------------------------------------------------------------------------------------------------
# autotuning configs: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
# --------------------------------------------------------------------------------------------------------------
# int8 operands: 128-byte K slices match the 128B swizzle of Hopper/Ampere shared memory; the BLOCK_M=16 tiles are
# for decode-like M (memory bound on the weight: narrow N tiles give enough programs to fill all SMs).
_MM_GPU = [
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 128, 128, 8, 4),
    (128, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (32, 128, 128, 4, 4),
    (16, 64, 256, 4, 4),
    (16, 128, 256, 4, 3),
    (16, 32, 256, 4, 4),
]
# 16-bit activations times an int8 weight converted in registers.
_WO_GPU = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (128, 128, 32, 4, 4),
    (32, 64, 128, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 32, 256, 4, 4),
]
# fp32 activations: the weight tile is converted to fp32 and the dot runs as tf32 or on the FMA units ('ieee'),
# which need 32-deep tiles (ptxas: every 64- to 256-deep tile above spills kilobytes with fp32 operands).
_WO_FP32 = [
    (128, 128, 32, 8, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 4),
    (32, 64, 32, 4, 4),
    (16, 64, 32, 4, 4),
]
# GEMV: (BLOCK_N, BLOCK_K, num_warps, num_stages)
_GEMV_GPU = [(16, 512, 4, 3), (32, 256, 4, 4), (64, 128, 4, 4), (32, 512, 8, 3), (64, 256, 8, 3)]
_MM_INTERP = [(32, 32, 32, 4, 1)]
_GEMV_INTERP = [(16, 32, 4, 1)]


def _configs(tiles, interp_tiles):
    return _tuning.configs(tiles, interp_tiles, ("BLOCK_M", "BLOCK_N", "BLOCK_K"), group=_GROUP)


def _gemv_configs():
    return _tuning.configs(_GEMV_GPU, _GEMV_INTERP, ("BLOCK_N", "BLOCK_K"))


def _m_band(c, M):
    """The tiles that suit M: small-M tiles for decode, big tiles for large M."""
    bm = c.kwargs["BLOCK_M"]
    if M <= 16:
        return bm == 16
    if M <= 64:
        return 16 < bm <= 64
    if M <= 256:
        return 32 <= bm <= 128
    return bm >= 64


def _prune(configs, a, M, smem_of, regs_of, reg_limit):
    """_tuning.prune preferring the tiles that suit M (fewer candidates also means less autotuning time)."""
    return _tuning.prune(configs, a, smem_of, regs_of, reg_limit, prefer=lambda c: _m_band(c, M))


def _smem_of(a, b, b_extra=0):
    """Pipelined operand buffers of a config; b_extra: bytes loaded per B element besides B (group-scale codes)."""
    a_bytes, b_bytes = a.element_size(), b.element_size() + b_extra

    def smem(c):
        kw = c.kwargs
        return c.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] * a_bytes + kw["BLOCK_N"] * b_bytes)

    return smem


# int8 GEMM: int32 accumulators per thread. Hopper's wgmma takes 128 (128x256 with 8 warps: 172 registers); on
# Ampere mma.sync also keeps the int8 fragments of the 128-deep tiles in registers and 128 accumulators spill
# 720-860 bytes (ptxas, sm_80), so 64 there (128x128x128 with 8 warps: 242 registers). With the quantization fused
# (QUANT_A) the float x tile is in registers too: at most 96 (64x128x128 with 4 warps, 128, spills 4 bytes on
# sm_90a with triton 3.6).
_MM_LIMIT_SM90, _MM_LIMIT_SM80, _MM_LIMIT_QUANT_A = 128, 64, 96


def _prune_mm(configs, named_args, **kwargs):
    a, b = named_args["a_ptr"], named_args["b_ptr"]
    quant_a = bool(kwargs.get("QUANT_A", False))

    def regs(c):
        kw = c.kwargs
        x_tile = kw["BLOCK_M"] * kw["BLOCK_K"] if quant_a else 0
        return (kw["BLOCK_M"] * kw["BLOCK_N"] + x_tile) / (32 * c.num_warps)

    limit = _MM_LIMIT_SM90 if a.device.type == "cuda" and _tuning.device_major(a) >= 9 else _MM_LIMIT_SM80
    if quant_a:
        limit = max(min(limit, _MM_LIMIT_QUANT_A), _MM_LIMIT_SM80)
    return _prune(configs, a, named_args["M"], _smem_of(a, b), regs, limit)


# Weight-only, per thread: the fp32 accumulator plus the converted weight tile in fp32 (twice with group scales:
# the codes too). ptxas on sm_80 and sm_90a: 16-bit activations are clean up to 192 (16x128x128, 272, spills on
# sm_90a), and on Ampere only with at most 64 accumulators (128x256x64 and 128x128x64 with 4 warps, 128, spill
# 24-350 bytes on sm_80); fp32 activations up to 128 with tf32 (32x64x128, 144, spills) and, on the FMA units
# ('ieee'), at most 16 accumulators (32x64x32 with group scales: 203 registers; 64x64x32 spills 430-700 bytes).
_WO_LIMIT_16BIT, _WO_ACC_SM80, _WO_LIMIT_TF32, _WO_ACC_FMA = 192, 64, 128, 16
_WO_FP32_SET = set(_WO_FP32)


def _prune_wo(configs, named_args, **kwargs):
    groups = bool(kwargs.get("HAS_GROUPS", named_args.get("HAS_GROUPS", False)))
    x, w = named_args["x_ptr"], named_args["w_ptr"]
    fp32 = x.dtype == torch.float32
    if not _INTERPRET:  # each activation dtype has its own tile list
        configs = [c for c in configs if (_tile(c) in _WO_FP32_SET) == fp32] or configs

    fma = fp32 and kwargs.get("IN_PREC") == "ieee"
    ampere = x.device.type == "cuda" and _tuning.device_major(x) < 9
    acc_limit = _WO_ACC_FMA if fma else (_WO_ACC_SM80 if ampere else None)

    def regs(c):  # a config over the accumulator limit counts as over the register limit
        kw = c.kwargs
        threads = 32 * c.num_warps
        acc = kw["BLOCK_M"] * kw["BLOCK_N"] / threads
        b_tile = kw["BLOCK_K"] * kw["BLOCK_N"] * (2 if groups else 1) / threads
        return acc + b_tile + (1 << 20 if acc_limit is not None and acc > acc_limit else 0)

    limit = _WO_LIMIT_TF32 if fp32 else _WO_LIMIT_16BIT
    return _prune(configs, x, named_args["M"], _smem_of(x, w, 1 if groups else 0), regs, limit)


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _row_amax(x):
    """max |x| per row of an fp32 tile, NaN counted as +inf (so the row is 'not finite'); masked lanes hold 0."""
    return tl.max(_abs_nan_inf(x), axis=1)


@triton.jit
def _quantize(x, inv, ok, USE_RINT: tl.constexpr):
    """q = clamp(rint(x * inv), -127, 127) per row (one fp32 multiply), 0 in rows that are not ok."""
    v = x * inv[:, None]
    v = tl.where(v != v, 0.0, v)  # 0 * inf when 127 / amax overflowed
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    v = _rint(v, USE_RINT)
    return tl.where(ok[:, None], v, 0.0).to(tl.int8)


# --------------------------------------------------------------------------------------------------------------
# per-token quantization
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk,
    USE_RINT: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # int64
    mask_m = offs_m < M
    arange_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    q_rows = q_ptr + offs_m[:, None] * K
    if ONE_PASS:  # the whole row block in registers: x is read once
        offs_k = arange_k.to(tl.int64)
        mask = mask_m[:, None] & (arange_k < K)[None, :]
        x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        ok, inv, scale = _quant_params(_row_amax(x))
        tl.store(q_rows + offs_k[None, :], _quantize(x, inv, ok, USE_RINT), mask=mask)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + arange_k.to(tl.int64)
            mask = mask_m[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, _row_amax(x))
        ok, inv, scale = _quant_params(amax)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + arange_k.to(tl.int64)
            mask = mask_m[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_rows + offs_k[None, :], _quantize(x, inv, ok, USE_RINT), mask=mask)
    tl.store(s_ptr + offs_m, scale, mask=mask_m)


# --------------------------------------------------------------------------------------------------------------
# int8 GEMM, dequant epilogue, optional fused quantization of A
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_configs(_MM_GPU, _MM_INTERP), key=["M", "N", "K"], prune_configs_by={"early_config_prune": _prune_mm}
)
@triton.jit
def _int8_mm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_om, stride_on,
    QUANT_A: tl.constexpr, OUT_INT32: tl.constexpr, HAS_BIAS: tl.constexpr, USE_RINT: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _grouped_pid(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # int64
    arange_k = tl.arange(0, BLOCK_K)
    offs_k = arange_k.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # [BK, BN] = B^T tile
    a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk
    num_k = tl.cdiv(K, BLOCK_K)

    if QUANT_A:  # prologue: the row maxima of this program's BLOCK_M rows of x
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        p = a_ptrs
        for kb in range(0, num_k):
            mask_k = arange_k < K - kb * BLOCK_K
            x = tl.load(p, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, _row_amax(x))
            p += a_step
        ok, inv, a_scale = _quant_params(amax)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for kb in range(0, num_k):
        mask_k = arange_k < K - kb * BLOCK_K
        if QUANT_A:
            x = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            a = _quantize(x, inv, ok, USE_RINT)
        else:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        # int8 x int8 -> int32, exact. out_dtype must be given: it defaults to fp32, and triton <= 3.6 then rejects
        # the int32 accumulator (semantic.dot asserts acc.type.element_ty == out_dtype, on the GPU too).
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += a_step
        b_ptrs += b_step

    mask_mn = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if OUT_INT32:
        tl.store(out_ptrs, acc, mask=mask_mn)
    else:
        if not QUANT_A:
            a_scale = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
        b_scale = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
        y = acc.to(tl.float32) * a_scale[:, None]
        y = y * b_scale[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, _cast_out(y, out_ptr, RNE_BF16), mask=mask_mn)


# --------------------------------------------------------------------------------------------------------------
# weight-only int8: float activations, int8 weight converted in registers, fp32 accumulation
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_configs(_WO_GPU + _WO_FP32, _MM_INTERP),
    key=["M", "N", "K", "HAS_GROUPS"],
    prune_configs_by={"early_config_prune": _prune_wo},
)
@triton.jit
def _wo_kernel(
    x_ptr, w_ptr, ws_ptr, gs_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_gn, stride_gk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_GROUPS: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _grouped_pid(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    arange_k = tl.arange(0, BLOCK_K)
    offs_k = arange_k.to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    g_cols = gs_ptr + offs_n[None, :] * stride_gn  # [1, BN]; row (k // 16) added per tile (any BLOCK_K)
    x_step = tl.full((), BLOCK_K, tl.int64) * stride_xk
    w_step = tl.full((), BLOCK_K, tl.int64) * stride_wk
    k_abs = offs_k  # int64 k of each row of the weight tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = arange_k < K - kb * BLOCK_K
        mask_b = mask_k[:, None] & mask_n[None, :]
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_b, other=0).to(tl.float32)
        if HAS_GROUPS:  # d = w * code[n, k // 16]: an integer, |d| <= 127 * 255, exact in fp32
            code = tl.load(g_cols + (k_abs // 16)[:, None] * stride_gk, mask=mask_b, other=0)
            b = b * code.to(tl.float32)
        if UPCAST:  # interpreter (no bf16 dot, no int8 -> bf16 cast there): exact products in fp32
            a = a.to(tl.float32)
        else:
            b = b.to(x_ptr.dtype.element_ty)  # exact for |w| <= 127; a grouped d is rounded to a 16-bit x's dtype
        acc = tl.dot(a, b, acc, input_precision=IN_PREC)
        x_ptrs += x_step
        w_ptrs += w_step
        k_abs += BLOCK_K
    y = acc * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        _cast_out(y, out_ptr, RNE_BF16),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.autotune(configs=_gemv_configs(), key=["M", "N", "K", "HAS_GROUPS"])
@triton.jit
def _wo_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, gs_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_gn, stride_gk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, HAS_GROUPS: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    arange_m = tl.arange(0, BLOCK_M)
    arange_k = tl.arange(0, BLOCK_K)
    offs_k = arange_k.to(tl.int64)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK], K contiguous
    g_rows = gs_ptr + offs_n[:, None] * stride_gn  # [BN, 1]; column (k // 16) added per tile (any BLOCK_K)
    w_step = tl.full((), BLOCK_K, tl.int64) * stride_wk
    x_step = tl.full((), BLOCK_K, tl.int64) * stride_xk
    x_ptrs = x_ptr + offs_k * stride_xk
    k_abs = offs_k  # int64 k of each column of the weight tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = arange_k < K - kb * BLOCK_K
        mask_w = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptrs, mask=mask_w, other=0).to(tl.float32)
        if HAS_GROUPS:  # d = w * code[n, k // 16], exact in fp32
            code = tl.load(g_rows + (k_abs // 16)[None, :] * stride_gk, mask=mask_w, other=0)
            w = w * code.to(tl.float32)
        for m in tl.static_range(BLOCK_M):  # each weight tile is used by every token
            # tl.where, not mask_k & (m < M): triton 3.9's interpreter gives a block & scalar of bools an int32
            # handle and then rejects it as a load mask ("mask has unsupported dtype"); the GPU code is the same.
            xm = tl.load(x_ptrs + m * stride_xm, mask=tl.where(m < M, mask_k, False), other=0.0).to(tl.float32)
            part = tl.sum(w * xm[None, :], axis=1)  # [BN]
            acc = tl.where(arange_m[:, None] == m, acc + part[None, :], acc)
        w_ptrs += w_step
        x_ptrs += x_step
        k_abs += BLOCK_K
    y = acc * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    offs_m = arange_m.to(tl.int64)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        _cast_out(y, out_ptr, RNE_BF16),
        mask=(offs_m < M)[:, None] & mask_n[None, :],
    )


# --------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------
def _fail(exc, msg):
    raise exc(msg)


def _check_device(t, name, fn, ref=None):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ref is not None and t.device != ref.device:
        _fail(RuntimeError, f"{fn}: {name} must be on the same device as the other inputs ({ref.device}), "
                            f"got {t.device}")  # fmt: skip
    if ref is None and t.device.type != "cuda" and not _INTERPRET:
        _fail(RuntimeError, f"{fn}: {name} must be a CUDA tensor for the Triton backend "
                            f"(or run with TRITON_INTERPRET=1), got {t.device}")  # fmt: skip


def _check_x(x, fn):
    _check_device(x, "x", fn)
    if x.dtype not in _X_DTYPES:
        _fail(TypeError, f"{fn}: x must be float32, bfloat16 or float16, got dtype {x.dtype}")
    if x.dim() < 1:
        _fail(ValueError, f"{fn}: x must have shape [..., K] (at least 1 dim), got a 0-dim tensor")


def _check_int8(t, name, fn, ref, shape_doc):
    _check_device(t, name, fn, ref)
    if t.dtype != torch.int8:
        _fail(TypeError, f"{fn}: {name} must be int8, got dtype {t.dtype}")
    if t.dim() != 2:
        _fail(ValueError, f"{fn}: {name} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")


def _check_vec(t, name, fn, ref, n, what, fp32=True):
    _check_device(t, name, fn, ref)
    if fp32 and t.dtype != torch.float32:
        _fail(TypeError, f"{fn}: {name} must be float32, got dtype {t.dtype}")
    if not fp32 and t.dtype not in _FLOAT:
        _fail(TypeError, f"{fn}: {name} must be a floating tensor, got dtype {t.dtype}")
    if tuple(t.shape) != (n,):
        _fail(ValueError, f"{fn}: {name} must have shape [{what}] = [{n}], got {tuple(t.shape)}")


def _unit_stride(*vecs):
    """The kernels load 1-D scales and bias at ``ptr + offs`` (unit stride): a sliced or expanded one is copied
    (N values; a no-op for the contiguous tensors the modules pass)."""
    return tuple(v if v is None else v.contiguous() for v in vecs)


def _check_group_scale(t, fn, ref, n, k):
    _check_device(t, "w_group_scale", fn, ref)
    if t.dtype != torch.uint8:
        _fail(TypeError, f"{fn}: w_group_scale must be uint8 (from quantize_per_group), got dtype {t.dtype}")
    g = -(-k // WEIGHT_GROUP)
    if tuple(t.shape) != (n, g):
        _fail(ValueError, f"{fn}: w_group_scale must have shape [N, ceil(K / {WEIGHT_GROUP})] = [{n}, {g}], "
                          f"got {tuple(t.shape)}")  # fmt: skip


def _check_packed(packed, comp, n, k, fn, ref, names):
    if (packed is None) != (comp is None):
        _fail(ValueError, f"{fn}: {names[0]} and {names[1]} must be given together or both be None")
    if packed is None:
        return
    np_, kp = -(-n // 16) * 16, -(-k // 4) * 4
    _check_device(packed, names[0], fn, ref)
    _check_device(comp, names[1], fn, ref)
    if packed.dtype != torch.int8:
        _fail(TypeError, f"{fn}: {names[0]} must be int8, got dtype {packed.dtype}")
    if tuple(packed.shape) != (np_, kp):
        _fail(ValueError, f"{fn}: {names[0]} must have shape [roundup(N, 16), roundup(K, 4)] = [{np_}, {kp}], "
                          f"got {tuple(packed.shape)}")  # fmt: skip
    if comp.dtype != torch.int32:
        _fail(TypeError, f"{fn}: {names[1]} must be int32, got dtype {comp.dtype}")
    if tuple(comp.shape) != (np_,):
        _fail(ValueError, f"{fn}: {names[1]} must have shape [roundup(N, 16)] = [{np_}], got {tuple(comp.shape)}")


def _plain_weight(w_q, w_packed):
    """The [N, K] weight; a stride-0 placeholder w_q (weight held only in the VNNI-packed form) is unpacked."""
    if w_packed is None or w_q.numel() <= 1 or any(s != 0 for s in w_q.stride()):
        return w_q
    n, k = w_q.shape
    np_, kp = w_packed.shape
    return w_packed.reshape(np_ // 16, kp // 4, 16, 4).permute(0, 2, 1, 3).reshape(np_, kp)[:n, :k]


def _fp_options():
    # The dequant epilogue must not be contracted into an fma (the contract fixes its rounding order).
    return {} if _INTERPRET else {"enable_fp_fusion": False}


def _rne_bf16(out):
    return _INTERPRET and out.dtype == torch.bfloat16


def _in_prec(dtype):
    if dtype == torch.float32 and (_INTERPRET or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _quant_blocks(K):
    """(BLOCK_M, BLOCK_K, one_pass, num_warps): ~4K elements per program (registers), whole rows when they fit."""
    max_k = 256 if _INTERPRET else 8192
    block_k = min(triton.next_power_of_2(max(K, 1)), max_k)
    one_pass = K <= block_k
    block_m = max(1, min(64, 4096 // block_k)) if one_pass else 1
    warps = 8 if block_m * block_k >= 4096 else 4
    return block_m, block_k, one_pass, warps


def _launch_quant(x2, q2, s1):
    M, K = x2.shape
    block_m, block_k, one_pass, warps = _quant_blocks(K)
    _quant_kernel[(triton.cdiv(M, block_m),)](
        x2, q2, s1, M, K, x2.stride(0), x2.stride(1),
        USE_RINT=_USE_RINT, ONE_PASS=one_pass, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip


def quantize_per_token(x):
    """(q int8 [..., K], scale fp32 [...]) per the contract (see fastdl/ops/int8.py)."""
    fn = "quantize_per_token"
    _check_x(x, fn)
    K = x.shape[-1]
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(lead, dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    if K == 0:
        return q, s.zero_()
    _launch_quant(x.reshape(M, K), q.view(M, K), s.view(M))
    return q, s


def _launch_mm(a, b, a_scale, b_scale, bias, out, quant_a):
    M, K = a.shape
    N = b.shape[0]
    dummy = out
    out_int32 = out.dtype == torch.int32

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _int8_mm_kernel[grid](
        a, b, a_scale if a_scale is not None else dummy, b_scale if b_scale is not None else dummy,
        bias if bias is not None else dummy, out,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        QUANT_A=quant_a, OUT_INT32=out_int32, HAS_BIAS=bias is not None and not out_int32, USE_RINT=_USE_RINT,
        RNE_BF16=_rne_bf16(out),
        **_fp_options(),
    )  # fmt: skip


def _dequant_zero_k(M, a_scale, b_scale, bias, out_dtype, device):
    """K == 0: acc = 0 and the epilogue is evaluated on it (0 * NaN scale stays NaN)."""
    acc = torch.zeros((M, b_scale.shape[0]), dtype=torch.float32, device=device)
    y = acc * a_scale[:, None] * b_scale[None, :]
    if bias is not None:
        y = y + bias.float()[None, :]
    return y.to(out_dtype)


def int8_mm(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp):
    """acc = a_q @ b_q.T (int32, exact); out = cast(((float(acc) * a_scale[m]) * b_scale[n]) + bias[n]) or acc."""
    fn = "int8_mm"
    _check_device(a_q, "a_q", fn)
    _check_int8(a_q, "a_q", fn, a_q, "[M, K]")
    _check_int8(b_q, "b_q", fn, a_q, "[N, K]")
    M, K = a_q.shape
    N = b_q.shape[0]
    if b_q.shape[1] != K:
        _fail(ValueError, f"{fn}: b_q must have shape [N, K] with K = a_q.shape[1] = {K}, got {tuple(b_q.shape)} "
                          "(mismatched K)")  # fmt: skip
    if out_dtype not in _OUT_DTYPES:
        _fail(TypeError, f"{fn}: out_dtype must be one of float32, bfloat16, float16, int32, got {out_dtype}")
    _check_vec(a_scale, "a_scale", fn, a_q, M, "M")
    _check_vec(b_scale, "b_scale", fn, a_q, N, "N")
    if bias is not None:
        _check_vec(bias, "bias", fn, a_q, N, "N", fp32=False)
    _check_packed(b_packed, b_comp, N, K, fn, a_q, ("b_packed", "b_comp"))
    a_scale, b_scale, bias = _unit_stride(a_scale, b_scale, bias)
    b = _plain_weight(b_q, b_packed)
    out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        if out_dtype == torch.int32:
            return out.zero_()
        return _dequant_zero_k(M, a_scale, b_scale, bias, out_dtype, a_q.device)
    _launch_mm(a_q, b, a_scale, b_scale, bias, out, quant_a=False)
    return out


def _check_linear(x, w_q, w_scale, bias, fn):
    _check_x(x, fn)
    _check_int8(w_q, "w_q", fn, x, "[N, K]")
    K = x.shape[-1]
    N = w_q.shape[0]
    if w_q.shape[1] != K:
        _fail(ValueError, f"{fn}: w_q must have shape [N, K] with K = x.shape[-1] = {K}, got {tuple(w_q.shape)} "
                          "(mismatched K)")  # fmt: skip
    _check_vec(w_scale, "w_scale", fn, x, N, "N")
    if bias is not None:
        _check_vec(bias, "bias", fn, x, N, "N", fp32=False)
    return K, N


def int8_linear(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8):
    """Dynamic W8A8: quantize x per token (fused into the GEMM prologue for small M), int8 GEMM, dequant + bias.
    8-bit activations only (the router sends ``act_bits=7`` elsewhere: fastdl.ops.int8)."""
    fn = "int8_linear"
    if act_bits != 8:
        _fail(ValueError, f"{fn} (Triton): act_bits={act_bits!r} has no Triton kernel; only 8 is served here")
    K, N = _check_linear(x, w_q, w_scale, bias, fn)
    _check_packed(w_packed, w_comp, N, K, fn, x, ("w_packed", "w_comp"))
    w_scale, bias = _unit_stride(w_scale, bias)
    w = _plain_weight(w_q, w_packed)
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    out = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        zeros = torch.zeros(M, dtype=torch.float32, device=x.device)
        return _dequant_zero_k(M, zeros, w_scale, bias, x.dtype, x.device).reshape(*lead, N)
    global _FUSED_ERROR
    x2 = x.reshape(M, K)
    out2 = out.view(M, N)
    if M <= FUSE_MAX_M and _FUSED_ERROR is None:
        try:
            _launch_mm(x2, w, None, w_scale, bias, out2, quant_a=True)
            return out
        except Exception as exc:  # a compile error of the fused variant: fall back to two kernels from now on
            if _INTERPRET:
                raise
            _FUSED_ERROR = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"fastdl int8_linear (Triton): the GEMM with fused activation quantization failed to compile "
                f"({_FUSED_ERROR[:300]}); using the quantize kernel + int8 GEMM instead",
                RuntimeWarning,
                stacklevel=2,
            )
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    _launch_quant(x2, q, s)
    _launch_mm(q, w, s, w_scale, bias, out2, quant_a=False)
    return out


def int8_weight_only_linear(x, w_q, w_scale, bias, w_group_scale=None):
    """out = (x @ d.T) * w_scale + bias with the int8 weight converted in registers, fp32 accumulation; d = w_q, or
    d[n, k] = w_q[n, k] * w_group_scale[n, k // 16] with the uint8 group scales (formed exactly in fp32)."""
    fn = "int8_weight_only_linear"
    K, N = _check_linear(x, w_q, w_scale, bias, fn)
    has_groups = w_group_scale is not None
    if has_groups:
        _check_group_scale(w_group_scale, fn, x, N, K)
    w_scale, bias = _unit_stride(w_scale, bias)
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    out = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        y = torch.zeros((M, N), dtype=torch.float32, device=x.device)
        if bias is not None:
            y = y + bias.float()[None, :]
        return y.to(x.dtype).reshape(*lead, N)
    x2 = x.reshape(M, K)
    out2 = out.view(M, N)
    dummy = out2
    b = bias if bias is not None else dummy
    # never read without HAS_GROUPS
    gs, stride_gn, stride_gk = (w_group_scale, *w_group_scale.stride()) if has_groups else (w_q, 0, 0)
    if M <= GEMV_MAX_M:
        _wo_gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
            x2, w_q, w_scale, gs, b, out2, M, N, K,
            x2.stride(0), x2.stride(1), w_q.stride(0), w_q.stride(1), stride_gn, stride_gk,
            out2.stride(0), out2.stride(1),
            HAS_BIAS=bias is not None, HAS_GROUPS=has_groups, RNE_BF16=_rne_bf16(out2),
            BLOCK_M=triton.next_power_of_2(M),
        )  # fmt: skip
        return out

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _wo_kernel[grid](
        x2, w_q, w_scale, gs, b, out2, M, N, K,
        x2.stride(0), x2.stride(1), w_q.stride(0), w_q.stride(1), stride_gn, stride_gk,
        out2.stride(0), out2.stride(1),
        HAS_BIAS=bias is not None, HAS_GROUPS=has_groups, UPCAST=_INTERPRET or x.device.type != "cuda",
        IN_PREC=_in_prec(x.dtype), RNE_BF16=_rne_bf16(out2),
    )  # fmt: skip
    return out
