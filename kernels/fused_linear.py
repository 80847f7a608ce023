"""Triton kernels for the fused mixed-precision linear (forward and backward).

Public launchers (the op contract lives in fastdl/ops/fused_linear.py):

    fused_linear_fwd(x, weight, bias, activation, residual, save_preact) -> (out, preact)
    fused_linear_bwd(grad_out, x, weight, preact, activation, output_mask) -> (grad_x, grad_weight, grad_bias)

Forward: one GEMM kernel, fp32 accumulation, epilogue fused while the tile is in registers
(bias, activation, residual, optional pre-activation store).

Backward design (why it looks the way it does):

* ``dpre = g * act'(p)`` is needed by both GEMMs (grad_x = dpre_c @ W_c and grad_w = dpre_c^T @ x_c) and by
  grad_bias = colsum(dpre).  A separate elementwise pass would read g and p and write dpre_c (one more launch and
  a full HBM round trip before the GEMMs can start), so the derivative is fused into the A-operand load of a GEMM
  (``_dact_gemm_kernel``).
* Fusing it into *both* GEMMs would evaluate act' (erf/exp: ~30 CUDA-core ops per element) ``K / BLOCK_Q`` times
  in each GEMM, and both GEMMs would read g and p (two tensors).  Instead only the weight-gradient GEMM
  (reduction over rows M) evaluates act' on its load; the programs of its first output column block
  (``pid_q == 0``) together visit every element of dpre exactly once, so they
    - write dpre rounded to the compute dtype (``dpre_c``, needed by grad_x), and
    - reduce the fp32 dpre over their rows into grad_bias (each program owns whole columns of dpre: the bias
      gradient is complete, deterministic, and needs no atomics and no extra pass).
  HBM traffic equals the fully fused variant's (GEMM 1 reads g and p and writes dpre_c; GEMM 2 reads dpre_c only,
  instead of g and p), and act' is recomputed in one GEMM instead of two.
* grad_x = dpre_c @ W_c then needs no fusion at all: when W already has the compute dtype it is a plain GEMM and
  goes to ``torch.mm`` (cuBLAS is at least as fast as a Triton GEMM on a plain GEMM and accumulates in fp32,
  fp16 following PyTorch's own reduced-precision setting, like eager autograd).  A fp32 master weight with
  bf16/fp16 activations goes through the same Triton kernel with ACT="none" instead: the weight tile is rounded to
  the compute dtype after the load, which avoids materialising a rounded copy of W.
* If grad_weight is not requested, grad_x is computed by the same kernel in the other orientation (act' fused on
  the load, no write-through), and grad_bias (if requested) by a small column-reduction kernel that computes dpre
  on the fly.
* The weight-gradient GEMM reduces over M, which is often much larger than N*K allows parallelism for (small
  layers, many tokens): when the (N, K) tile grid cannot fill the GPU, the reduction is split over M (split-K
  style) into fp32 partials that are summed afterwards (deterministic, no atomics).

Interpreter mode (``TRITON_INTERPRET=1``, CPU tensors): a single small config is used instead of autotuning, and
the dot operands are upcast to fp32 after rounding to the compute dtype (bf16 ``tl.dot`` is broken in the
interpreter; the products of two 16-bit values are exact in fp32, so the result is unchanged).

This module imports triton, torch and its neighbours ``_tuning`` (launch configs) and ``constants`` (the
activation list); nothing of ``fastdl``. It imports without a GPU.
"""

import math

import torch
import triton
import triton.language as tl

from . import _tuning
from ._common import grouped_pid as _grouped_pid
from ._tuning import INTERPRET as _INTERPRET
from .constants import ACTIVATIONS as _ACTIVATION_NAMES

__all__ = ["fused_linear_fwd", "fused_linear_bwd", "ACTIVATIONS"]

# Decided once, like triton.jit decides whether it builds an InterpretedFunction.

# name -> the ACT constexpr of the kernels below: the position in fastdl's one activation list (the op definitions are
# the one part of fastdl a launcher imports; they do not import triton)
ACTIVATIONS = {name: code for code, name in enumerate(_ACTIVATION_NAMES)}
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# --------------------------------------------------------------------------------------------------------------
# autotuning configs
# --------------------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).  The large tiles are the Hopper/Ampere sweet spots for 16-bit
# operands; the 32-deep ones keep fp32 operands (and fp32 master weights) inside shared memory.  Configs that cannot
# work for a launch are pruned before autotuning (see _prune_*): they would spill registers, overflow shared memory,
# or only cost compile time.  Every config and every limit below is checked by tests/test_triton_aot.py, which
# compiles them for sm_80 and sm_90a with ptxas (0 spills, shared memory within the per-block limit).
_FWD_TILES = [
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 8, 4),  # fp32 'ieee' (FMA units): the largest tile that does not spill there
    (128, 128, 32, 4, 4),
    (64, 64, 32, 4, 4),
]
# The backward GEMM also holds the A tile (g, preact and act' in fp32) in registers: with an activation, 8-warp
# configs and 32-deep tiles keep it out of local memory. 64x128x64 with 4 warps is left out: it spills 8 bytes on
# sm_80 even without an activation (ptxas 12.9, at 168 registers).
_BWD_TILES = [t for t in _FWD_TILES if t != (64, 128, 64, 4, 4)] + [(128, 256, 32, 8, 4)]
# fp32 'ieee' (FMA units) backward on Ampere: the only tile ptxas compiles without spills there (sm_80, with and
# without an activation, dpre store and bias row sums) is 32x64x32 with 3 stages (64x64x32 spills 236-356 bytes,
# 128x128x32 with 8 warps 20-352, 32x64x32 with 4 stages 8-12). It is used for nothing else.
_BWD_SMALL = (32, 64, 32, 4, 3)
_BWD_TILES.append(_BWD_SMALL)
# The interpreter executes programs one after another in numpy: few, mid-sized tiles are fastest there.
_INTERP_TILES = [(32, 32, 32, 4, 1)]
_GROUP = 8


def _configs(tiles, names):
    return _tuning.configs(tiles, _INTERP_TILES, names, group=_GROUP)


def _prune(configs, tensor, smem_of, regs_of, reg_limit, max_k=None):
    """_tuning.prune, allowing only configs at most max_k deep (when given)."""
    return _tuning.prune(configs, tensor, smem_of, regs_of, reg_limit,
                         allow=None if max_k is None else (lambda c: _depth(c) <= max_k))  # fmt: skip


def _depth(c):
    return c.kwargs.get("BLOCK_K", c.kwargs.get("BLOCK_R", 0))


def _per_thread(c, *elems):
    return sum(elems) / (32 * c.num_warps)


# Register limits (fp32 values per thread: accumulator + what the epilogue or prologue holds next to it), from
# ptxas on sm_80 and sm_90a (tests/test_triton_aot.py prints the registers of every config):
# * forward, tensor cores: 128 accumulators per thread (128x256 / 256x128 with 8 warps, 128x128 with 4) compile
#   without spills for a bias-only epilogue, but an activation with the pre-activation store, or a residual (a
#   second [BLOCK_M, BLOCK_N] tile), spills 24-830 bytes on both targets: then 64 per thread (128x128 with 8 warps:
#   234 registers, no spill, with gelu + bias + residual + pre-activation).
#   On Ampere 64 in every case: with triton 3.6 (ptxas 12.8) 128x256 and 256x128 spill 20-32 bytes on sm_80 even
#   with a bias-only epilogue.
# * fp32 'ieee' (FMA units): at most 64 per thread and at most 32 deep; a 64-deep FMA tile spills kilobytes on sm_80.
_FWD_LIMIT, _FWD_LIMIT_HEAVY, _FMA_LIMIT, _FMA_MAX_K = 128, 64, 64, 32


def _prune_fwd(configs, named_args, **kwargs):
    xs = named_args["x_ptr"].element_size()
    ws = named_args["w_ptr"].element_size()
    fma = kwargs.get("CDT") == 0 and kwargs.get("IN_PREC") == "ieee"  # fp32 'ieee' dot runs on the FMA units
    heavy = kwargs.get("ACT", 1) != 0 or bool(kwargs.get("HAS_RES", True))

    def smem(c):
        kw = c.kwargs
        return c.num_stages * (kw["BLOCK_M"] * kw["BLOCK_K"] * xs + kw["BLOCK_K"] * kw["BLOCK_N"] * ws)

    def regs(c):
        return _per_thread(c, c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])

    x = named_args["x_ptr"]
    if fma:
        return _prune(configs, x, smem, regs, _FMA_LIMIT, max_k=_FMA_MAX_K)
    light = not heavy and x.device.type == "cuda" and _tuning.device_major(x) >= 9
    return _prune(configs, x, smem, regs, _FWD_LIMIT if light else _FWD_LIMIT_HEAVY)


# Backward GEMM, per thread: the accumulator, plus with an activation g and act'(preact) of the A tile in fp32.
# Without an activation: 128 on Hopper's tensor cores, 64 on Ampere's (triton 3.6: 128x128x64 with 4 warps spills
# 76 bytes on sm_80) and on the FMA units (at most 32 deep) like the forward. With one (ptxas, gelu
# with the dpre store and the bias row sums): Hopper 96 (128x128x32 with 8 warps: 179 registers; 128 spills 4-12
# bytes), Ampere 64 on tensor cores (64x64x32: 229 registers; 96 spills 130-180 bytes). FMA on Ampere: see
# _BWD_FMA_SM80.
_BWD_LIMIT, _BWD_LIMIT_ACT_SM90, _BWD_LIMIT_ACT_SM80 = 128, 96, 64


def _prune_bwd(configs, named_args, **kwargs):
    act = kwargs.get("ACT", 1) != 0
    gs = named_args["g_ptr"].element_size()
    zs = named_args["z_ptr"].element_size() if act else 0
    bs = named_args["b_ptr"].element_size()
    fma = kwargs.get("CDT") == 0 and kwargs.get("IN_PREC") == "ieee"

    def smem(c):
        kw = c.kwargs
        a_tile = kw["BLOCK_P"] * kw["BLOCK_R"]
        # pipelined g/preact/B buffers + one buffer for the computed A operand's layout conversion
        return c.num_stages * (a_tile * (gs + zs) + kw["BLOCK_R"] * kw["BLOCK_Q"] * bs) + a_tile * 4

    def regs(c):
        kw = c.kwargs
        return _per_thread(c, kw["BLOCK_P"] * kw["BLOCK_Q"], 2 * kw["BLOCK_P"] * kw["BLOCK_R"] if act else 0)

    g = named_args["g_ptr"]
    if g.device.type != "cuda" or len(configs) <= 1:
        return configs
    hopper = _tuning.device_major(g) >= 9
    if fma and not hopper:
        return [c for c in configs if _tile(c) == _BWD_SMALL] or configs
    configs = [c for c in configs if _tile(c) != _BWD_SMALL] or configs
    if not act:
        limit = _FMA_LIMIT if fma else (_BWD_LIMIT if hopper else _BWD_LIMIT_ACT_SM80)
    else:
        limit = _BWD_LIMIT_ACT_SM90 if hopper else _BWD_LIMIT_ACT_SM80
    return _prune(configs, g, smem, regs, limit, max_k=_FMA_MAX_K if fma else None)


def _tile(c):
    kw = c.kwargs
    return (kw["BLOCK_P"], kw["BLOCK_Q"], kw["BLOCK_R"], c.num_warps, c.num_stages)


# --------------------------------------------------------------------------------------------------------------
# elementwise helpers (all math in fp32)
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _tanh(u):
    # tanh through exp: portable (no libdevice), saturates correctly for |u| -> inf.
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:
        y = tl.where(x < 0.0, 0.0, x)  # NaN stays NaN, as torch.relu
    elif ACT == 2:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 3:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = 0.5 * x * (1.0 + t)
    elif ACT == 4:
        y = x / (1.0 + tl.exp(-x))
    else:
        y = x
    return y


@triton.jit
def _act_grad(p, ACT: tl.constexpr):
    """act'(p) for ACT != 0 (the caller skips ACT == 0)."""
    if ACT == 1:
        d = tl.where(p > 0.0, 1.0, 0.0)
    elif ACT == 2:
        # 0.5 * (1 + erf(p / sqrt2)) + p * exp(-p^2 / 2) / sqrt(2 pi)
        d = 0.5 * (1.0 + tl.erf(p * 0.7071067811865476)) + p * tl.exp(-0.5 * p * p) * 0.3989422804014327
    elif ACT == 3:
        p2 = p * p
        t = _tanh(0.7978845608028654 * (p + 0.044715 * p2 * p))
        d = 0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * p2)
    else:
        s = 1.0 / (1.0 + tl.exp(-p))
        d = s * (1.0 + p * (1.0 - s))
    return d


@triton.jit
def _to_compute(x, CDT: tl.constexpr):
    """Round to the compute dtype: 0 fp32, 1 fp16, 2 bf16."""
    if CDT == 1:
        y = x.to(tl.float16)
    elif CDT == 2:
        y = x.to(tl.bfloat16)
    else:
        y = x.to(tl.float32)
    return y


# --------------------------------------------------------------------------------------------------------------
# forward: out = act(x @ w_c^T + b) + r
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_configs(_FWD_TILES, ("BLOCK_M", "BLOCK_N", "BLOCK_K")),
    key=["M", "N", "K", "ACT"],  # the epilogue's register pressure depends on ACT: tune per activation
    prune_configs_by={"early_config_prune": _prune_fwd},
)
@triton.jit
def _fwd_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, pre_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_b,
    stride_rm, stride_rn, stride_om, stride_on, stride_pm, stride_pn,
    ACT: tl.constexpr, CDT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SAVE_PRE: tl.constexpr,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
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

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # [BK, BN] = W^T tile

    # 64-bit pointer steps: a transposed operand can have a huge stride along K
    x_step = tl.full([], BLOCK_K, tl.int64) * stride_xk
    w_step = tl.full([], BLOCK_K, tl.int64) * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        mask_k = arange_k < K - kb * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        # fp32 master weight -> compute dtype at tile level, so the tensor-core dot runs in bf16/fp16
        a = _to_compute(a, CDT)
        b = _to_compute(b, CDT)
        if UPCAST:  # interpreter: exact for values already rounded to the compute dtype
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=IN_PREC)
        x_ptrs += x_step
        w_ptrs += w_step

    # epilogue, all in fp32 on the unrounded accumulator
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n * stride_b, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SAVE_PRE:
        tl.store(
            pre_ptr + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn,
            acc.to(pre_ptr.dtype.element_ty),
            mask=mask_mn,
        )
    y = _act(acc, ACT)
    if HAS_RES:
        res = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask_mn, other=0.0)
        y = y + res.to(tl.float32)
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        y.to(out_ptr.dtype.element_ty),
        mask=mask_mn,
    )


# --------------------------------------------------------------------------------------------------------------
# backward GEMM with the activation derivative fused on the A-operand load
#   C[p, q] = sum_r D[p, r] * B[r, q],   D = round_c(g * act'(z)), z = preact, seen through (p, r) strides
# grad_weight: p = n, r = m, q = k, B = x   (g, z read transposed through strides)
# grad_x:      p = m, r = n, q = k, B = W
# --------------------------------------------------------------------------------------------------------------
@triton.autotune(
    configs=_configs(_BWD_TILES, ("BLOCK_P", "BLOCK_Q", "BLOCK_R")),
    key=["P", "Q", "R", "R_CHUNK", "ACT"],
    prune_configs_by={"early_config_prune": _prune_bwd},
)
@triton.jit
def _dact_gemm_kernel(
    g_ptr, z_ptr, b_ptr, c_ptr, d_ptr, s_ptr,
    P, Q, R, R_CHUNK,
    stride_gp, stride_gr, stride_zp, stride_zr, stride_br, stride_bq,
    stride_cs, stride_cp, stride_cq, stride_dp, stride_dr,
    ACT: tl.constexpr, CDT: tl.constexpr, STORE_D: tl.constexpr, ROW_SUM: tl.constexpr,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1).to(tl.int64)  # split of the reduction dimension
    pid_p, pid_q = _grouped_pid(pid, tl.cdiv(P, BLOCK_P), tl.cdiv(Q, BLOCK_Q), GROUP)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    r_lo = pid_s * R_CHUNK
    r_len = tl.minimum(R - r_lo, R_CHUNK).to(tl.int32)  # <= R_CHUNK: 32-bit loop counter and masks
    offs_r = r_lo + tl.arange(0, BLOCK_R)  # int64
    arange_r = tl.arange(0, BLOCK_R)
    mask_p = offs_p < P
    mask_q = offs_q < Q
    # The programs of the first column block visit every element of this split's D exactly once.
    is_first = pid_q == 0

    g_ptrs = g_ptr + offs_p[:, None] * stride_gp + offs_r[None, :] * stride_gr
    z_ptrs = z_ptr + offs_p[:, None] * stride_zp + offs_r[None, :] * stride_zr
    d_ptrs = d_ptr + offs_p[:, None] * stride_dp + offs_r[None, :] * stride_dr
    b_ptrs = b_ptr + offs_r[:, None] * stride_br + offs_q[None, :] * stride_bq

    step = tl.full([], BLOCK_R, tl.int64)
    g_step = step * stride_gr
    z_step = step * stride_zr
    d_step = step * stride_dr
    b_step = step * stride_br

    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for rb in range(0, tl.cdiv(r_len, BLOCK_R)):
        mask_r = arange_r < r_len - rb * BLOCK_R
        mask_pr = mask_p[:, None] & mask_r[None, :]
        d = tl.load(g_ptrs, mask=mask_pr, other=0.0).to(tl.float32)
        if ACT != 0:
            z = tl.load(z_ptrs, mask=mask_pr, other=0.0).to(tl.float32)
            d = d * _act_grad(z, ACT)  # masked lanes: g = 0 -> d = 0
        if ROW_SUM:
            row_sum += tl.sum(d, axis=1)  # fp32 dpre, before rounding
        a = _to_compute(d, CDT)
        if STORE_D:
            # tl.where, not mask_pr & is_first: triton 3.9's interpreter gives a block & scalar of bools an int32
            # handle and then rejects it as a mask ("mask has unsupported dtype"); the GPU code is the same.
            tl.store(d_ptrs, a, mask=tl.where(is_first, mask_pr, False))
        b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_q[None, :], other=0.0)
        b = _to_compute(b, CDT)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=IN_PREC)
        g_ptrs += g_step
        z_ptrs += z_step
        d_ptrs += d_step
        b_ptrs += b_step

    c_ptrs = c_ptr + pid_s * stride_cs + offs_p[:, None] * stride_cp + offs_q[None, :] * stride_cq
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_p[:, None] & mask_q[None, :])
    if ROW_SUM:
        tl.store(s_ptr + pid_s * P + offs_p, row_sum, mask=tl.where(is_first, mask_p, False))


# --------------------------------------------------------------------------------------------------------------
# grad_bias alone (grad_weight not requested): column sums of dpre computed on the fly, split over row chunks
# --------------------------------------------------------------------------------------------------------------
@triton.jit
def _dbias_kernel(
    g_ptr, p_ptr, out_ptr, M, N, M_CHUNK,
    stride_gm, stride_gn, stride_pm, stride_pn,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    m_lo = pid_c * M_CHUNK
    m_len = tl.minimum(M - m_lo, M_CHUNK).to(tl.int32)
    arange_m = tl.arange(0, BLOCK_M)
    offs_m = m_lo + arange_m
    g_ptrs = g_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn
    p_ptrs = p_ptr + offs_m[:, None] * stride_pm + offs_n[None, :] * stride_pn
    g_step = tl.full([], BLOCK_M, tl.int64) * stride_gm
    p_step = tl.full([], BLOCK_M, tl.int64) * stride_pm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for mb in range(0, tl.cdiv(m_len, BLOCK_M)):
        mask = (arange_m < m_len - mb * BLOCK_M)[:, None] & mask_n[None, :]
        d = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        if ACT != 0:
            p = tl.load(p_ptrs, mask=mask, other=0.0).to(tl.float32)
            d = d * _act_grad(p, ACT)
        acc += d
        g_ptrs += g_step
        p_ptrs += p_step
    tl.store(out_ptr + pid_c * N + offs_n, tl.sum(acc, axis=0), mask=mask_n)


# --------------------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------------------
def _launchable(kernel):
    """Launch through torch.library.wrap_triton when possible so the launchers trace under torch.compile
    (inside a torch.library.triton_op); outside tracing it is the kernel itself."""
    if _INTERPRET:
        return kernel
    wrap = getattr(torch.library, "wrap_triton", None)
    if wrap is None:
        return kernel
    try:
        return wrap(kernel)
    except Exception:
        return kernel


def _in_prec(c):
    # fp32 operands: follow PyTorch's own matmul setting (IEEE by default; TF32 only if the user allowed it for
    # cuBLAS too), so the accuracy matches eager. 16-bit operands ignore it ("tf32" is triton's default there).
    if c == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _check_activation(activation, fn):
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    return ACTIVATIONS[activation]


def _check_float(t, name, fn, device):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{fn}: {name} must have a floating dtype, got {t.dtype}")
    if t.device != device:
        raise RuntimeError(f"{fn}: {name} must be on the same device as x ({device}), got {t.device}")


def _check_x(x, fn):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPE_CODE:
        raise TypeError(f"{fn}: x must be float32, bfloat16 or float16 (the compute dtype), got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fn}: x must have shape [..., K] (at least 1 dim), got a 0-dim tensor")
    if x.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"{fn}: x must be a CUDA tensor for the Triton backend (or run with TRITON_INTERPRET=1), got {x.device}"
        )


def _check_weight(weight, x, fn):
    _check_float(weight, "weight", fn, x.device)
    if weight.dim() != 2:
        raise ValueError(f"{fn}: weight must have shape [N, K], got {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{fn}: weight.shape[1] must equal x.shape[-1] (K={x.shape[-1]}), got weight shape {tuple(weight.shape)}"
        )
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{fn}: weight.dtype must be x.dtype ({x.dtype}) or torch.float32, got {weight.dtype}")


def fused_linear_fwd(x, weight, bias, activation: str, residual, save_preact: bool):
    """out = act(x @ round_c(weight)^T + bias) + residual, computed in one kernel.

    Returns (out, preact): out has shape [..., N] and dtype x.dtype (contiguous); preact = round_c(x @ w^T + b)
    when save_preact and activation != "none", else torch.empty(0, dtype=x.dtype, device=x.device)."""
    fn = "fused_linear_fwd"
    act = _check_activation(activation, fn)
    _check_x(x, fn)
    _check_weight(weight, x, fn)
    c = x.dtype
    K = x.shape[-1]
    N = weight.shape[0]
    lead = tuple(x.shape[:-1])
    out_shape = (*lead, N)
    M = math.prod(lead)
    if bias is not None:
        _check_float(bias, "bias", fn, x.device)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"{fn}: bias must have shape [N] = [{N}], got {tuple(bias.shape)}")
    if residual is not None:
        _check_float(residual, "residual", fn, x.device)
        if tuple(residual.shape) != out_shape:
            raise ValueError(f"{fn}: residual must have the output shape {list(out_shape)}, got {list(residual.shape)}")

    out = torch.empty(out_shape, dtype=c, device=x.device)
    save = bool(save_preact) and act != 0
    pre = torch.empty(out_shape, dtype=c, device=x.device) if save else torch.empty(0, dtype=c, device=x.device)
    if M == 0 or N == 0:
        return out, pre

    out2 = out.view(M, N)
    pre2 = pre.view(M, N) if save else out2
    if K == 0:  # acc = 0; never dereference the (possibly null) empty operands
        x2, w2 = out2, out2
        sx, sw = (0, 0), (0, 0)
    else:
        x2 = x.reshape(M, K)  # a view whenever the leading dims collapse; strides are passed explicitly
        w2 = weight
        sx, sw = x2.stride(), weight.stride()
    b = bias if bias is not None else out2
    r2 = residual.reshape(M, N) if residual is not None else out2

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _launchable(_fwd_kernel)[grid](
        x2, w2, b, r2, out2, pre2,
        M, N, K,
        sx[0], sx[1], sw[0], sw[1], b.stride(0) if bias is not None else 0,
        r2.stride(0), r2.stride(1), out2.stride(0), out2.stride(1), pre2.stride(0), pre2.stride(1),
        ACT=act, CDT=_DTYPE_CODE[c], HAS_BIAS=bias is not None, HAS_RES=residual is not None, SAVE_PRE=save,
        UPCAST=_INTERPRET or x.device.type != "cuda", IN_PREC=_in_prec(c),
    )  # fmt: skip
    return out, pre


def _dact_gemm(g, p, act, b, c, out_dtype, orient_w, store_d, row_sum, split=None):
    """Launch _dact_gemm_kernel.

    orient_w=True:  C[N, K] = D^T @ x   (g, p: [M, N]; b = x [M, K]); returns (C, d or None, rowsum or None)
    orient_w=False: C[M, K] = D @ W     (g, p: [M, N]; b = W [N, K]); returns (C, None, None)
    """
    M, N = g.shape
    K = b.shape[1]
    dev = g.device
    if orient_w:
        P, R = N, M
        sgp, sgr = g.stride(1), g.stride(0)
        szp, szr = p.stride(1), p.stride(0)
    else:
        P, R = M, N
        sgp, sgr = g.stride(0), g.stride(1)
        szp, szr = p.stride(0), p.stride(1)
    Q = K

    if split is None:
        split = 1
        if orient_w and dev.type == "cuda":
            # Split the M reduction when the (N, K) tile grid cannot fill the GPU (nominal 128x128 tiles).
            tiles = triton.cdiv(P, 128) * triton.cdiv(Q, 128)
            sms = _tuning.num_sms(_tuning.device_index(dev))
            if tiles < sms:
                split = max(1, min(triton.cdiv(2 * sms, tiles), R // 2048, 64))
    split = max(1, min(int(split), R))
    r_chunk = triton.cdiv(triton.cdiv(R, split), 256) * 256 if split > 1 else R
    split = triton.cdiv(R, r_chunk) if R > 0 else 1

    if split == 1:
        cbuf = torch.empty((P, Q), dtype=out_dtype, device=dev)
        scs = 0
    else:
        cbuf = torch.empty((split, P, Q), dtype=torch.float32, device=dev)
        scs = cbuf.stride(0)
    d = torch.empty((M, N), dtype=c, device=dev) if store_d else None
    sums = torch.empty((split, P), dtype=torch.float32, device=dev) if row_sum else None
    d_arg = d if d is not None else cbuf
    s_arg = sums if sums is not None else cbuf
    if orient_w:
        sdp, sdr = (d.stride(1), d.stride(0)) if d is not None else (0, 0)
    else:
        sdp, sdr = (d.stride(0), d.stride(1)) if d is not None else (0, 0)

    def grid(meta):
        return (triton.cdiv(P, meta["BLOCK_P"]) * triton.cdiv(Q, meta["BLOCK_Q"]), split)

    _launchable(_dact_gemm_kernel)[grid](
        g, p, b, cbuf, d_arg, s_arg,
        P, Q, R, r_chunk,
        sgp, sgr, szp, szr, b.stride(0), b.stride(1),
        scs, cbuf.stride(-2), cbuf.stride(-1), sdp, sdr,
        ACT=act, CDT=_DTYPE_CODE[c], STORE_D=store_d, ROW_SUM=row_sum,
        UPCAST=_INTERPRET or dev.type != "cuda", IN_PREC=_in_prec(c),
    )  # fmt: skip
    if split > 1:
        cbuf = cbuf.sum(0).to(out_dtype)
    if sums is not None:
        sums = sums.sum(0) if split > 1 else sums[0]
    return cbuf, d, sums


def _dbias(g, p, act):
    M, N = g.shape
    dev = g.device
    block_m, block_n = 32, 128
    n_blocks = triton.cdiv(N, block_n)
    if dev.type == "cuda":
        target = 4 * _tuning.num_sms(_tuning.device_index(dev))
        chunks = max(1, min(triton.cdiv(M, 1024), triton.cdiv(target, n_blocks)))
    else:
        chunks = 1
    m_chunk = triton.cdiv(triton.cdiv(M, chunks), block_m) * block_m
    chunks = triton.cdiv(M, m_chunk)
    part = torch.empty((chunks, N), dtype=torch.float32, device=dev)
    _launchable(_dbias_kernel)[(n_blocks, chunks)](
        g, p, part, M, N, m_chunk,
        g.stride(0), g.stride(1), p.stride(0), p.stride(1),
        ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8,  # 4 warps: a 4-byte spill on sm_90a with silu
    )  # fmt: skip
    return part.sum(0) if chunks > 1 else part[0]


def fused_linear_bwd(grad_out, x, weight, preact, activation: str, output_mask):
    """Gradients of fused_linear_fwd with respect to (x, weight, bias).

    dpre = grad_out * act'(preact) (fp32), grad_bias = sum_rows(dpre) (fp32, [N]), dpre_c = round_c(dpre),
    grad_x = dpre_c @ w_c (shape and dtype of x), grad_weight = dpre_c^T @ x (fp32 accumulation, weight.dtype).
    output_mask selects (grad_x, grad_weight, grad_bias); unneeded ones are empty tensors."""
    return _fused_linear_bwd(grad_out, x, weight, preact, activation, output_mask)


def _fused_linear_bwd(grad_out, x, weight, preact, activation, output_mask, split=None):
    fn = "fused_linear_bwd"
    act = _check_activation(activation, fn)
    _check_x(x, fn)
    _check_weight(weight, x, fn)
    try:
        mask = [bool(v) for v in output_mask]
    except TypeError:
        mask = []
    if len(mask) != 3:
        raise ValueError(f"{fn}: output_mask must be 3 booleans (grad_x, grad_weight, grad_bias), got {output_mask!r}")
    need_x, need_w, need_b = mask
    c = x.dtype
    dev = x.device
    K = x.shape[-1]
    N = weight.shape[0]
    lead = tuple(x.shape[:-1])
    M = math.prod(lead)
    _check_float(grad_out, "grad_out", fn, dev)
    if tuple(grad_out.shape) != (*lead, N):
        raise ValueError(
            f"{fn}: grad_out must have shape {[*lead, N]} (x.shape[:-1] + [N]), got {list(grad_out.shape)}"
        )
    if act != 0:
        _check_float(preact, "preact", fn, dev)
        if tuple(preact.shape) != (*lead, N):
            raise ValueError(
                f"{fn}: preact must have the shape of grad_out {[*lead, N]} for activation {activation!r}, "
                f"got {list(preact.shape)}"
            )

    gx = torch.empty(0, dtype=c, device=dev)
    gw = torch.empty(0, dtype=weight.dtype, device=dev)
    gb = torch.empty(0, dtype=torch.float32, device=dev)
    if M == 0 or N == 0 or K == 0:
        # degenerate products: sums over empty ranges are zero
        if need_x:
            gx = torch.zeros(x.shape, dtype=c, device=dev)
        if need_w:
            gw = torch.zeros((N, K), dtype=weight.dtype, device=dev)
        if need_b:
            if M == 0 or N == 0:
                gb = torch.zeros((N,), dtype=torch.float32, device=dev)
            else:
                g2 = grad_out.reshape(M, N)
                gb = _dbias(g2, preact.reshape(M, N) if act != 0 else g2, act)
        return gx, gw, gb

    g2 = grad_out.reshape(M, N)
    p2 = preact.reshape(M, N) if act != 0 else g2
    d_is_g = act == 0 and grad_out.dtype == c  # then dpre_c == grad_out exactly

    if need_w:
        store_d = need_x and not d_is_g
        x2 = x.reshape(M, K)  # a view whenever the leading dims collapse
        gw, d, gb_w = _dact_gemm(g2, p2, act, x2, c, weight.dtype, True, store_d, need_b, split)
        if need_b:
            gb = gb_w
        if need_x:
            dc = d if d is not None else g2
            if weight.dtype == c:
                # plain GEMM, nothing left to fuse: cuBLAS (fp32 accumulation; fp16 follows torch's own setting)
                gx = torch.mm(dc, weight).view(x.shape)
            else:
                # fp32 master weight: round the W tile in-kernel instead of materialising weight.to(c)
                gx, _, _ = _dact_gemm(dc, dc, 0, weight, c, c, False, False, False)
                gx = gx.view(x.shape)
    elif need_x:
        gx, _, _ = _dact_gemm(g2, p2, act, weight, c, c, False, False, False)
        gx = gx.view(x.shape)
    if need_b and not need_w:
        gb = _dbias(g2, p2, act)
    return gx, gw, gb
