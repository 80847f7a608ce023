"""Triton kernels for the int4 linear ops (the op contract lives in fastdl/ops/int4.py).

Public launchers (same arguments as the ops):

    int4_weight_only_linear(x, qweight, scales, zeros, bias, group_size) -> out
    int4_a8_linear(x, qweight, scales, zeros, bias, group_size) -> out

The weight format: ``qweight`` uint8 ``[N, K / 2]`` in llama.cpp's Q4_0 nibble order (byte ``16 b + i`` of a row holds
the code of ``k = 32 b + i`` in its low nibble and of ``k = 32 b + 16 + i`` in its high nibble), ``scales`` float16
``[N, K / G]``, optional ``zeros`` uint8 ``[N, K / G]`` (else z = 8); ``W[n, k] = (u - z) * s``.

The float-activation kernels never reorder the nibbles: a tile of packed bytes (whole 32-blocks) is split into its
low and high nibbles, and the activations are read at the matching k instead: the low nibble of byte ``p`` pairs
with ``k = 32 (p // 16) + p % 16``, the high one with that ``k + 16`` (runs of 16 contiguous activations). The
W4A8 GEMM interleaves the two nibbles in registers and reads the activations quantized in that order.

Kernels:

* ``_gemv_kernel`` (M <= ``GEMV_MAX_M`` = 16, decode): split-K GEMV on the FMA units. Program ``(j, s)`` takes a
  block of BLOCK_N output columns and the s-th slice of K (``KS`` input features, a multiple of the largest
  BLOCK_K), and streams its ``[BLOCK_N, KS / 2]`` packed bytes once with coalesced loads, as 3-D tiles ``[BLOCK_N,
  BLOCK_K / G, G / 2]`` (one scale and zero point per (n, group), loaded once per tile; ``BLOCK_G`` = G). The codes
  are dequantized in registers (``u - z`` in fp32), meet each token's x in a static loop over the accumulator rows
  (BLOCK_M = 1, 4, 8 or 16; padded rows are masked) and the group's fp32 sum is scaled by ``s`` per (n, group):
  the weight is exact (no rounding of the dequantized value), fp32 accumulation. With ``A8`` (``int4_a8_linear``)
  each program first quantizes the x groups of its slice per the contract (absmax per row and group, IEEE
  ``127 / amax``, one multiply, round half to even) in registers: the group sums ``sum_k q_x (u - z)`` are then
  integers, exact in fp32 (|sum| <= 127 * 15 * 128 < 2**24), scaled by ``s_x * s_w``. Reduction over the slices:
  deterministic, no atomics. With one slice the program writes the output itself (bias, one rounding); with several
  it writes its fp32 partial into a ``[slices, M, N]`` buffer and ``_splitk_sum_kernel`` adds the slices in a fixed
  order, adds the bias and rounds once. The launcher picks the slices: about 2 programs per SM from a nominal
  64-column block (``_split``). Rows 5..16 take tiles with fewer weight bytes per thread (ptxas: the wider tiles
  spill there with some group sizes).
* ``_wo_mm_kernel`` (weight-only, M > 16): tiled GEMM, BLOCK_M x BLOCK_N x BLOCK_K, BLOCK_K in {32, 64, 128} and at
  most the group size (``early_config_prune``: one scale / zero vector per K tile). The packed ``[BLOCK_K / 2,
  BLOCK_N]`` byte tile is split into its two nibble tiles, ``W = (u - z) * s`` is formed in fp32 (exact) and
  rounded once to x's dtype (fp32 x: unchanged; fp16 keeps 11 significant bits, bf16 8: the precision of a 16-bit
  GEMM on the dequantized weight), and each nibble tile is a ``tl.dot`` with the x tile of the matching k (two
  dots of depth BLOCK_K / 2 per step, fp32 accumulation). Bias and the cast in the epilogue.
* ``_a8_quant_kernel`` + ``_a8_mm_kernel`` (``int4_a8_linear``, M > 16): x is quantized once per row and group into
  int8 (the contract, bit for bit) and written in the packed weight's pairing order: within each group,
  ``q'[2 p + h]`` = q of the k that nibble ``h`` of byte ``p`` holds. The GEMM steps one group per iteration
  (``BLOCK_K`` = G); per 32-block of the group the two nibble tiles (``u - z`` as int8) are interleaved in
  registers (``tl.join`` + reshape) into one ``[32, BLOCK_N]`` int8 operand and ``tl.dot`` of int8 operands
  accumulates the group's exact int32 sums; then ``acc += float(sums) * (s_x[m] * s_w[n])`` in fp32.
* ``_splitk_sum_kernel``: the split-K reduction above.

Round half to even: ``libdevice.rint`` on the GPU; the interpreter has no libdevice, so there the
``(v + 1.5 * 2**23) - 1.5 * 2**23`` identity is used (exact for |v| <= 127). Divisions are ``tl.math.div_rn``.

Interpreter mode (``TRITON_INTERPRET=1``, CPU tensors): one small config per kernel instead of autotuning; 16-bit
dot operands are upcast to fp32 (bf16 ``tl.dot`` is broken in the interpreter; int8 dot works there) and the
fp32 -> bf16 output cast is rounded to nearest even by hand (the interpreter truncates).

This module imports triton and torch, nothing of ``fastdl``; it imports without a GPU.
"""

import math
import os

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

__all__ = ["int4_weight_only_linear", "int4_a8_linear"]

# Before triton 3.8, ptxas spills 8-12 bytes in three W4A8 GEMV variants on sm_90a (tests/test_triton_aot.py, triton
# 3.6: 16 rows x 16 x 256 with groups of 128, 4 x 16 x 512 with groups of 32, 4 x 64 x 256 (8 warps) with groups of
# 64); triton 3.8 compiles them without spills. There the W4A8 GEMV keeps its 32 x 256 tile only and serves up to 4
# rows (more rows take the W4A8 GEMM).
_OLD_TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2] if p.isdigit()) < (3, 8)

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
GROUP_SIZES = (32, 64, 128)


def _env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# M <= GEMV_MAX_M runs the split-K GEMV (at most 16: the kernel keeps one accumulator row per token).
GEMV_MAX_M = max(0, min(16, _env_int("FASTDL_INT4_GEMV_MAX_M", 16)))
# Slices of K in the GEMV: 0 = the launcher's choice (from the SM count); n > 0 forces n (tests).
SPLIT_K = _env_int("FASTDL_INT4_SPLIT_K", 0)
_GROUP = 8

# --------------------------------------------------------------------------------------------------------------
# autotuning configs
# --------------------------------------------------------------------------------------------------------------
# GEMV: (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_K >= 128 (a whole number of groups of every size).
_GEMV_GPU = [(32, 256, 4, 3), (16, 512, 4, 3), (64, 256, 8, 3)]
# M > 4 (BLOCK_M 8, 16: the weight tile meets every row): fewer weight bytes per thread
_GEMV_WIDE = [(16, 256, 4, 3)]
_GEMV_WIDE_SET = set(_GEMV_WIDE)
_GEMV_INTERP = [(32, 128, 4, 1)]
# Slices of K are multiples of the largest BLOCK_K (every config steps through a slice in whole tiles).
_CHUNK = max(k for _, k, _, _ in (_GEMV_INTERP if _INTERPRET else _GEMV_GPU + _GEMV_WIDE))
# Weight-only GEMM: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), BLOCK_K in {32, 64, 128} <= group size.
# Left out after ptxas (every variant, sm_80 and sm_90a): 128x128x64 with 8 warps (spills 50-90 bytes), and
# 32x64x128 (bf16) and 32x64x32 (fp32, tf32), which spill 16-24 bytes on sm_80 without zero points only.
_WO_GPU = [
    (128, 64, 64, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 64, 64, 4, 4),
    (128, 128, 32, 8, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 32, 4, 4),
    (32, 64, 32, 4, 4),
]
# fp32 activations (tf32 or FMA dots: short K tiles, few accumulators per thread)
_WO_FP32 = [(64, 128, 32, 8, 3), (64, 64, 32, 8, 3), (32, 64, 64, 4, 3)]
_WO_INTERP = [(32, 32, 32, 4, 1)]
# W4A8 GEMM: (BLOCK_M, BLOCK_N, num_warps, num_stages); the K tile is one group.
_A8_GPU = [(128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (32, 64, 4, 4), (32, 128, 4, 3)]
_A8_INTERP = [(32, 32, 4, 1)]
# The activations' quantization for the W4A8 GEMM: rows x input features per program.
_QUANT_BLOCK_M, _QUANT_K = (16, 128) if _INTERPRET else (8, 512)
_SUM_BLOCK = 1024


def _gemv_configs():
    return _tuning.configs(_GEMV_GPU + _GEMV_WIDE, _GEMV_INTERP, ("BLOCK_N", "BLOCK_K"))


def _gemv_tile(c):
    return (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)


def _wo_configs():
    return _tuning.configs(_WO_GPU + _WO_FP32, _WO_INTERP, ("BLOCK_M", "BLOCK_N", "BLOCK_K"), group=_GROUP)


def _a8_configs():
    return _tuning.configs(_A8_GPU, _A8_INTERP, ("BLOCK_M", "BLOCK_N"), group=_GROUP)


def _m_band(bm, M):
    """The GEMM tiles that suit M (> 16 here): narrow row tiles for small M, big tiles for large M."""
    if M <= 64:
        return bm <= 64
    if M <= 256:
        return 32 <= bm <= 128
    return bm >= 64


def _prune(configs, t, M, smem_of, regs_of, reg_limit):
    """_tuning.prune preferring the tiles that suit M."""
    def prefer(c):
        return _m_band(c.kwargs.get("BLOCK_M", 0), M)

    return _tuning.prune(configs, t, smem_of, regs_of, reg_limit, prefer=prefer)


_WO_FP32_SET = set(_WO_FP32)
# Per-thread register budgets (fp32 values of the accumulators and the dequantized tile), from ptxas on sm_80 and
# sm_90a (tests/test_triton_aot.py): above them the tiles spill. fp32 x on the FMA units ('ieee'): at most 16
# accumulators and 32-deep tiles (32x64x64 and 64x128x32 with 8 warps spill 300-700 bytes).
_WO_LIMIT_16BIT, _WO_LIMIT_FP32, _WO_ACC_FMA = 192, 96, 16
# W4A8 GEMM: fp32 + int32 accumulators per thread (sm_80: 128 reach 253-255 registers with 128-deep groups).
_A8_ACC, _A8_ACC_SM80 = 128, 64


def _prune_wo(configs, named_args, **kwargs):
    x = named_args["x_ptr"]
    G = kwargs.get("GROUP_SIZE", named_args.get("GROUP_SIZE", 128))
    fp32 = x.dtype == torch.float32
    fma = fp32 and kwargs.get("IN_PREC") == "ieee"
    if not _INTERPRET:  # each activation dtype has its own tile list
        configs = [c for c in configs if (_tile(c) in _WO_FP32_SET) == fp32] or configs
    configs = [c for c in configs if c.kwargs["BLOCK_K"] <= G] or [min(configs, key=lambda c: c.kwargs["BLOCK_K"])]
    xb = x.element_size()

    def smem(c):
        kw = c.kwargs
        return c.num_stages * kw["BLOCK_K"] * (kw["BLOCK_M"] * xb + kw["BLOCK_N"] // 2)

    def regs(c):  # the accumulators + the dequantized tile in fp32; over the FMA limits counts as over the budget
        kw = c.kwargs
        threads = 32 * c.num_warps
        acc = kw["BLOCK_M"] * kw["BLOCK_N"] / threads
        over = fma and (acc > _WO_ACC_FMA or kw["BLOCK_K"] > 32)
        return acc + kw["BLOCK_K"] * kw["BLOCK_N"] / threads + (1 << 20 if over else 0)

    return _prune(configs, x, named_args["M"], smem, regs, _WO_LIMIT_FP32 if fp32 else _WO_LIMIT_16BIT)


def _prune_a8(configs, named_args, **kwargs):
    q = named_args["q_ptr"]
    G = kwargs.get("BLOCK_K", named_args.get("BLOCK_K", 128))
    sm80 = q.device.type == "cuda" and _tuning.device_major(q) < 9

    def smem(c):
        kw = c.kwargs
        return c.num_stages * G * (kw["BLOCK_M"] + kw["BLOCK_N"] // 2)

    def regs(c):  # the fp32 and the int32 accumulators
        return 2 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] / (32 * c.num_warps)

    return _prune(configs, q, named_args["M"], smem, regs, _A8_ACC_SM80 if sm80 else _A8_ACC)


def _prune_gemv(configs, named_args, **kwargs):
    """The tiles of M's band (one to four rows, or more: fewer weight bytes per thread), within shared memory."""
    x = named_args["x_ptr"]
    if len(configs) <= 1:
        return configs
    wide = named_args["M"] > 4
    configs = [c for c in configs if (_gemv_tile(c) in _GEMV_WIDE_SET) == wide] or configs
    if _OLD_TRITON and kwargs.get("A8", named_args.get("A8")):  # see _OLD_TRITON
        configs = [c for c in configs if _gemv_tile(c) == _GEMV_GPU[0]] or configs
    if x.device.type != "cuda":
        return configs
    try:
        limit = _tuning.max_smem(_tuning.device_index(x))

        def smem(c):
            return c.num_stages * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] // 2

        return [c for c in configs if smem(c) <= limit] or [min(configs, key=smem)]
    except Exception:
        return configs


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _lo_k(p):
    """The k (relative to the tile's first 32-block) whose code is the low nibble of packed byte p."""
    return (p // 16) * 32 + (p % 16)


@triton.jit
def _quantize(x, inv, ok, USE_RINT: tl.constexpr):
    """clamp(rint(x * inv), -127, 127) (one fp32 multiply; inv and ok broadcast by the caller), 0 where not ok;
    returned as fp32 integers."""
    v = x * inv
    v = tl.where(v != v, 0.0, v)  # 0 * inf when 127 / amax overflowed
    v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    v = _rint(v, USE_RINT)
    return tl.where(ok, v, 0.0)


# --------------------------------------------------------------------------------------------------------------
# split-K GEMV (M <= 16): float activations, or int8-quantized ones (A8)
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_gemv_configs(),
    key=["M", "N", "K", "KS", "BLOCK_G", "HAS_ZEROS", "A8"],
    prune_configs_by={"early_config_prune": _prune_gemv},
)
@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, KS,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sk, stride_zn, stride_zk, stride_om, stride_on,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, A8: tl.constexpr, SPLIT: tl.constexpr,
    USE_RINT: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    arange_m = tl.arange(0, BLOCK_M)
    ag = tl.arange(0, BLOCK_K // BLOCK_G)  # groups of a tile
    ah = tl.arange(0, BLOCK_G // 2)  # bytes of a group
    p = ag[:, None] * (BLOCK_G // 2) + ah[None, :]  # [NG, H] byte of the tile
    kl = _lo_k(p)  # [NG, H] k of its low nibble (high nibble: kl + 16)
    full = ah[None, :] >= 0  # [1, H] all True (broadcasts group masks to [NG, H])
    k_begin = pid_s * KS
    k_end = tl.minimum(k_begin + KS, K)
    g_end = k_end // BLOCK_G
    qw_rows = qw_ptr + offs_n[:, None, None] * stride_qn  # [BN, 1, 1]
    s_rows = s_ptr + offs_n[:, None] * stride_sn  # [BN, 1]
    z_rows = z_ptr + offs_n[:, None] * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        g0 = k0 // BLOCK_G
        gmask = (g0 + ag) < g_end  # [NG]
        smask = mask_n[:, None] & gmask[None, :]  # [BN, NG]
        b = tl.load(qw_rows + ((k0 // 2) + p)[None, :, :] * stride_qk, mask=smask[:, :, None], other=0)
        s = tl.load(s_rows + (g0 + ag)[None, :] * stride_sk, mask=smask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_rows + (g0 + ag)[None, :] * stride_zk, mask=smask, other=0).to(tl.float32)
            lo = (b & 15).to(tl.float32) - z[:, :, None]
            hi = (b >> 4).to(tl.float32) - z[:, :, None]
        else:
            lo = (b & 15).to(tl.float32) - 8.0
            hi = (b >> 4).to(tl.float32) - 8.0
        x_lo = x_ptr + (k0 + kl) * stride_xk  # [NG, H]
        xmask = gmask[:, None] & full
        for m in tl.static_range(BLOCK_M):  # each weight tile is used by every token
            # tl.where, not xmask & (m < M): the interpreter rejects a block & scalar of bools as a load mask
            mk = tl.where(m < M, xmask, False)
            xl = tl.load(x_lo + m * stride_xm, mask=mk, other=0.0).to(tl.float32)
            xh = tl.load(x_lo + m * stride_xm + 16 * stride_xk, mask=mk, other=0.0).to(tl.float32)
            if A8:  # the contract's per-(row, group) quantization of x, in registers
                amax = tl.maximum(tl.max(_abs_nan_inf(xl), axis=1), tl.max(_abs_nan_inf(xh), axis=1))  # [NG]
                ok, inv, sx = _quant_params(amax)
                xl = _quantize(xl, inv[:, None], ok[:, None], USE_RINT)
                xh = _quantize(xh, inv[:, None], ok[:, None], USE_RINT)
                sc = s * sx[None, :]
            else:
                sc = s
            # per (n, group): sum_k (u - z) x (an exact integer with A8), then the scale(s)
            t = tl.sum(lo * xl[None, :, :] + hi * xh[None, :, :], axis=2)  # [BN, NG]
            part = tl.sum(t * sc, axis=1)  # [BN]
            acc = tl.where(arange_m[:, None] == m, acc + part[None, :], acc)
    offs_m = arange_m.to(tl.int64)
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    if SPLIT:  # this slice's partial sums; _splitk_sum_kernel adds the slices
        tl.store(ws_ptr + (pid_s * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
            _cast_out(acc, out_ptr, RNE_BF16),
            mask=mask,
        )


@triton.jit
def _splitk_sum_kernel(
    ws_ptr, bias_ptr, out_ptr, M, N, S, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """out[m, n] = cast(sum_s ws[s, m, n] + bias[n]): the slices added in order (deterministic), one rounding."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    MN = M * N
    mask = offs < MN
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in range(1, S):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n * stride_on, _cast_out(acc, out_ptr, RNE_BF16), mask=mask)


@triton.jit
def _tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """The GEMMs' output tile of this program: row and column offsets and their bounds masks."""
    pid = tl.program_id(0).to(tl.int64)
    pid_m, pid_n = _grouped_pid(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < M, offs_n < N


@triton.jit
def _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on,
                HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr):  # fmt: skip
    """The GEMMs' epilogue: + bias, one rounding to the output dtype, a masked store of the tile."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        _cast_out(acc, out_ptr, RNE_BF16),
        mask=mask_m[:, None] & mask_n[None, :],
    )


# --------------------------------------------------------------------------------------------------------------
# weight-only GEMM (M > 16)
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_wo_configs(),
    key=["M", "N", "K", "GROUP_SIZE", "HAS_ZEROS"],
    prune_configs_by={"early_config_prune": _prune_wo},
)
@triton.jit
def _wo_mm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sk, stride_zn, stride_zk, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    IN_PREC: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, mask_m, mask_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP)
    j = tl.arange(0, BLOCK_K // 2)  # packed bytes of a K tile
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + _lo_k(j)[None, :] * stride_xk  # [BM, BK/2]: low-nibble k
    w_ptrs = qw_ptr + j[:, None] * stride_qk + offs_n[None, :] * stride_qn  # [BK/2, BN]
    x_hi = 16 * stride_xk
    x_step = tl.full((), BLOCK_K, tl.int64) * stride_xk
    w_step = tl.full((), BLOCK_K // 2, tl.int64) * stride_qk
    s_cols = s_ptr + offs_n * stride_sn
    z_cols = z_ptr + offs_n * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // BLOCK_K):  # BLOCK_K divides the group size, which divides K: no K mask
        g = (kb * BLOCK_K) // GROUP_SIZE
        a_lo = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
        a_hi = tl.load(x_ptrs + x_hi, mask=mask_m[:, None], other=0.0)
        b = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
        s = tl.load(s_cols + g * stride_sk, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_cols + g * stride_zk, mask=mask_n, other=0).to(tl.float32)
            lo = ((b & 15).to(tl.float32) - z[None, :]) * s[None, :]  # [BK/2, BN]: W, exact in fp32
            hi = ((b >> 4).to(tl.float32) - z[None, :]) * s[None, :]
        else:
            lo = ((b & 15).to(tl.float32) - 8.0) * s[None, :]
            hi = ((b >> 4).to(tl.float32) - 8.0) * s[None, :]
        if UPCAST:  # interpreter (no bf16 dot): exact products in fp32
            a_lo = a_lo.to(tl.float32)
            a_hi = a_hi.to(tl.float32)
        else:  # W rounded once to x's dtype (fp32 x: unchanged)
            lo = lo.to(x_ptr.dtype.element_ty)
            hi = hi.to(x_ptr.dtype.element_ty)
        acc = tl.dot(a_lo, lo, acc, input_precision=IN_PREC)
        acc = tl.dot(a_hi, hi, acc, input_precision=IN_PREC)
        x_ptrs += x_step
        w_ptrs += w_step
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, HAS_BIAS, RNE_BF16)


# --------------------------------------------------------------------------------------------------------------
# W4A8 GEMM (M > 16): quantize x per row and group, then int8 x int4 dots per group
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _a8_quant_kernel(
    x_ptr, q_ptr, sx_ptr, M, K, stride_xm, stride_xk,
    GROUP_SIZE: tl.constexpr, USE_RINT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NG: tl.constexpr,
):  # fmt: skip
    """q [M, K] int8 in the weight's pairing order (q[m, G g + 2 p + h] = q_x of the k that nibble h of byte p of
    group g holds) and s_x [M, K / G] fp32 (the contract of quantize_groups)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = pid_g * BLOCK_NG + tl.arange(0, BLOCK_NG)
    ah = tl.arange(0, GROUP_SIZE // 2)
    n_groups = K // GROUP_SIZE
    mask_mg = (offs_m < M)[:, None] & (offs_g < n_groups)[None, :]  # [BM, BG]
    mask = mask_mg[:, :, None] & (ah >= 0)[None, None, :]  # [BM, BG, H]
    k_lo = offs_g[None, :, None] * GROUP_SIZE + _lo_k(ah)[None, None, :]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm
    xl = tl.load(x_rows + k_lo * stride_xk, mask=mask, other=0.0).to(tl.float32)
    xh = tl.load(x_rows + (k_lo + 16) * stride_xk, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(_abs_nan_inf(xl), axis=2), tl.max(_abs_nan_inf(xh), axis=2))  # [BM, BG]
    ok, inv, sx = _quant_params(amax)
    ql = _quantize(xl, inv[:, :, None], ok[:, :, None], USE_RINT).to(tl.int8)
    qh = _quantize(xh, inv[:, :, None], ok[:, :, None], USE_RINT).to(tl.int8)
    q_rows = q_ptr + offs_m[:, None, None] * K + offs_g[None, :, None] * GROUP_SIZE + 2 * ah[None, None, :]
    tl.store(q_rows, ql, mask=mask)
    tl.store(q_rows + 1, qh, mask=mask)
    tl.store(sx_ptr + offs_m[:, None] * n_groups + offs_g[None, :], sx, mask=mask_mg)


@triton.autotune(
    configs=_a8_configs(),
    key=["M", "N", "K", "BLOCK_K", "HAS_ZEROS"],
    prune_configs_by={"early_config_prune": _prune_a8},
)
@triton.jit
def _a8_mm_kernel(
    q_ptr, sx_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_qn, stride_qk, stride_sn, stride_sk, stride_zn, stride_zk, stride_om, stride_on,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    offs_m, offs_n, mask_m, mask_n = _tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP)
    n_groups = K // BLOCK_K
    a_ptrs = q_ptr + offs_m[:, None] * K + tl.arange(0, 32)[None, :]  # [BM, 32] (pairing order)
    w_ptrs = qw_ptr + offs_n[:, None] * stride_qn + tl.arange(0, 16)[None, :] * stride_qk  # [BN, 16] packed bytes
    w_step = tl.full((), 16, tl.int64) * stride_qk
    sx_rows = sx_ptr + offs_m * n_groups
    s_cols = s_ptr + offs_n * stride_sn
    z_cols = z_ptr + offs_n * stride_zn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, n_groups):
        if HAS_ZEROS:
            z = tl.load(z_cols + g * stride_zk, mask=mask_n, other=0).to(tl.int8)[:, None]
        else:
            z = tl.full((), 8, tl.int8)
        isum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for sb in tl.static_range(BLOCK_K // 32):  # the group's 32-blocks: 32-deep int8 dots
            a = tl.load(a_ptrs + sb * 32, mask=mask_m[:, None], other=0)
            b = tl.load(w_ptrs + sb * w_step, mask=mask_n[:, None], other=0)
            lo = (b & 15).to(tl.int8) - z  # u - z in -15..15
            hi = (b >> 4).to(tl.int8) - z
            # column 2 p + h: nibble h of byte p, the order the quantization kernel wrote q in
            w = tl.trans(tl.join(lo, hi).reshape(BLOCK_N, 32))
            isum = tl.dot(a, w, isum, out_dtype=tl.int32)  # exact
        sx = tl.load(sx_rows + g, mask=mask_m, other=0.0)
        sw = tl.load(s_cols + g * stride_sk, mask=mask_n, other=0.0).to(tl.float32)
        acc += isum.to(tl.float32) * (sx[:, None] * sw[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += (BLOCK_K // 32) * w_step
    _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, stride_on, HAS_BIAS, RNE_BF16)


# --------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------
def _fail(exc, msg):
    raise exc(msg)


def _check(x, qweight, scales, zeros, bias, group_size, fn):
    """The launchers' own checks (the op checks everything first; these keep a direct call safe)."""
    if not isinstance(x, torch.Tensor):
        _fail(TypeError, f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda" and not _INTERPRET:
        _fail(RuntimeError, f"{fn}: x must be a CUDA tensor for the Triton backend (or run with TRITON_INTERPRET=1), "
                            f"got {x.device}")  # fmt: skip
    if x.dtype not in _X_DTYPES:
        _fail(TypeError, f"{fn}: x must be float32, bfloat16 or float16 (Triton backend), got dtype {x.dtype}")
    if x.dim() < 1:
        _fail(ValueError, f"{fn}: x must have at least 1 dimension [..., K], got a 0-dim tensor")
    if group_size not in GROUP_SIZES:
        _fail(ValueError, f"{fn}: group_size must be one of 32, 64, 128, got {group_size}")
    K = x.shape[-1]
    if K % group_size:
        _fail(ValueError, f"{fn}: K = x.shape[-1] = {K} must be a multiple of group_size = {group_size}")
    if qweight.dtype != torch.uint8:
        _fail(TypeError, f"{fn}: qweight must be uint8 (two 4-bit codes per byte), got dtype {qweight.dtype}")
    if qweight.dim() != 2 or 2 * qweight.shape[1] != K:
        _fail(ValueError, f"{fn}: qweight must have shape [N, K / 2] with K = {K}, got {tuple(qweight.shape)}")
    N = qweight.shape[0]
    shape = (N, K // group_size)
    for name, t, dtype in (("scales", scales, torch.float16), ("zeros", zeros, torch.uint8)):
        if t is None:
            continue
        if t.dtype != dtype:
            _fail(TypeError, f"{fn}: {name} must be {str(dtype)[6:]}, got dtype {t.dtype}")
        if tuple(t.shape) != shape:
            _fail(ValueError, f"{fn}: {name} must have shape [N, K / group_size] = {list(shape)}, got "
                              f"{tuple(t.shape)}")  # fmt: skip
    if bias is not None:
        if bias.dtype not in _FLOAT:
            _fail(TypeError, f"{fn}: bias must be a floating tensor, got dtype {bias.dtype}")
        if tuple(bias.shape) != (N,):
            _fail(ValueError, f"{fn}: bias must have shape [N] = [{N}], got {tuple(bias.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            _fail(RuntimeError, f"{fn}: {name} must be on the same device as x ({x.device}), got {t.device}")
    return K, N


def _rne_bf16(out):
    return _INTERPRET and out.dtype == torch.bfloat16


def _in_prec(dtype):
    if dtype == torch.float32 and (_INTERPRET or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


def _split(N, K, device):
    """(slices, k per slice) of the GEMV: ~2 programs per SM from a nominal 64-column block, slices of whole
    _CHUNKs (the largest BLOCK_K), at most 32. SPLIT_K > 0 forces that many (fewer when K has fewer chunks)."""
    chunks = triton.cdiv(K, _CHUNK)
    if SPLIT_K > 0:
        split = SPLIT_K
    elif device.type == "cuda":
        sms = _tuning.num_sms(_tuning.device_index(device))
        split = triton.cdiv(2 * sms, triton.cdiv(N, 64))
    else:
        split = 1
    split = max(1, min(split, chunks, 32))
    ks = triton.cdiv(chunks, split) * _CHUNK
    return triton.cdiv(K, ks), ks


def _gemv_rows(M):
    """The GEMV's accumulator rows (one compiled variant each): 1, 4, 8 or 16 (padded rows are masked)."""
    return 1 if M == 1 else 4 if M <= 4 else 8 if M <= 8 else 16


def _zeros_args(zeros, scales):
    # never read without HAS_ZEROS
    return (zeros, *zeros.stride()) if zeros is not None else (scales, 0, 0)


def _launch_gemv(x2, qweight, scales, zeros, bias, out2, group_size, a8):
    M, K = x2.shape
    N = qweight.shape[0]
    split, ks = _split(N, K, x2.device)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=x2.device) if split > 1 else out2
    z, szn, szk = _zeros_args(zeros, scales)
    b = bias if bias is not None else out2
    _gemv_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split)](
        x2, qweight, scales, z, b, out2, ws,
        M, N, K, ks,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        szn, szk, out2.stride(0), out2.stride(1),
        BLOCK_G=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, A8=a8, SPLIT=split > 1,
        USE_RINT=_USE_RINT, RNE_BF16=_rne_bf16(out2), BLOCK_M=_gemv_rows(M),
    )  # fmt: skip
    if split > 1:
        _splitk_sum_kernel[(triton.cdiv(M * N, _SUM_BLOCK),)](
            ws, b, out2, M, N, split, out2.stride(0), out2.stride(1),
            HAS_BIAS=bias is not None, RNE_BF16=_rne_bf16(out2), BLOCK=_SUM_BLOCK, num_warps=4,
        )  # fmt: skip


def _prologue(x, qweight, scales, zeros, bias, group_size, fn):
    """Checks, the output, and the cases with nothing to multiply. Returns (out, (x2, out2) or None)."""
    K, N = _check(x, qweight, scales, zeros, bias, group_size, fn)
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    out = torch.empty((*lead, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out, None
    if K == 0:
        y = torch.zeros((M, N), dtype=torch.float32, device=x.device)
        if bias is not None:
            y = y + bias.float()[None, :]
        return y.to(x.dtype).reshape(*lead, N), None
    return out, (x.reshape(M, K), out.view(M, N))


def int4_weight_only_linear(x, qweight, scales, zeros, bias, group_size):
    """out = x @ W.T + bias, W = (u - z) * s dequantized in registers, fp32 accumulation, one rounding to x's dtype:
    the split-K GEMV for M <= GEMV_MAX_M, the tiled GEMM above."""
    fn = "int4_weight_only_linear"
    out, work = _prologue(x, qweight, scales, zeros, bias, group_size, fn)
    if work is None:
        return out
    x2, out2 = work
    M, K = x2.shape
    N = qweight.shape[0]
    bias = bias.contiguous() if bias is not None else None
    if M <= GEMV_MAX_M:
        _launch_gemv(x2, qweight, scales, zeros, bias, out2, group_size, a8=False)
        return out
    z, szn, szk = _zeros_args(zeros, scales)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _wo_mm_kernel[grid](
        x2, qweight, scales, z, bias if bias is not None else out2, out2,
        M, N, K,
        x2.stride(0), x2.stride(1), qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1),
        szn, szk, out2.stride(0), out2.stride(1),
        GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        UPCAST=_INTERPRET or x.device.type != "cuda", IN_PREC=_in_prec(x.dtype),
        RNE_BF16=_rne_bf16(out2),
    )  # fmt: skip
    return out


def _quantize_pairs(x2, group_size):
    """x2 [M, K] quantized per row and group (the contract of fastdl.ops.int4.quantize_groups, bit for bit): q int8
    [M, K] in the weight's pairing order (within group g: q[m, G g + 2 p + h] = q_x[m, G g + 32 (p // 16) + p % 16 +
    16 h]) and s_x fp32 [M, K / G]."""
    M, K = x2.shape
    n_groups = K // group_size
    q = torch.empty((M, K), dtype=torch.int8, device=x2.device)
    sx = torch.empty((M, n_groups), dtype=torch.float32, device=x2.device)
    block_ng = _QUANT_K // group_size
    _a8_quant_kernel[(triton.cdiv(M, _QUANT_BLOCK_M), triton.cdiv(n_groups, block_ng))](
        x2, q, sx, M, K, x2.stride(0), x2.stride(1),
        GROUP_SIZE=group_size, USE_RINT=_USE_RINT, BLOCK_M=_QUANT_BLOCK_M, BLOCK_NG=block_ng, num_warps=4,
    )  # fmt: skip
    return q, sx


def int4_a8_linear(x, qweight, scales, zeros, bias, group_size):
    """W4A8: x quantized per row and group of group_size features (the contract of fastdl.ops.int4.quantize_groups),
    the group sums sum_k q_x (u - z) exact, scaled by s_x * s_w into fp32, + bias, one rounding to x's dtype: the
    split-K GEMV with the quantization in registers for M <= GEMV_MAX_M, else the quantization kernel and the int8
    tl.dot GEMM."""
    fn = "int4_a8_linear"
    out, work = _prologue(x, qweight, scales, zeros, bias, group_size, fn)
    if work is None:
        return out
    x2, out2 = work
    M, K = x2.shape
    N = qweight.shape[0]
    bias = bias.contiguous() if bias is not None else None
    if M <= (4 if _OLD_TRITON else GEMV_MAX_M):  # (see _OLD_TRITON)
        _launch_gemv(x2, qweight, scales, zeros, bias, out2, group_size, a8=True)
        return out
    q, sx = _quantize_pairs(x2, group_size)
    z, szn, szk = _zeros_args(zeros, scales)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _a8_mm_kernel[grid](
        q, sx, qweight, scales, z, bias if bias is not None else out2, out2,
        M, N, K,
        qweight.stride(0), qweight.stride(1), scales.stride(0), scales.stride(1), szn, szk,
        out2.stride(0), out2.stride(1),
        BLOCK_K=group_size, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, RNE_BF16=_rne_bf16(out2),
    )  # fmt: skip
    return out
