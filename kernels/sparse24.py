"""Triton kernel for 2:4 sparsity: fused prune + compress, one pass over the dense weight.

Public launcher (the op contract lives in fastdl/ops/sparse24.py):

    compress_2_4(w [N, K]) -> (values [N, K/2] in w's dtype, meta uint8 [N, ceil(K/8)])

Each program takes a tile of BLOCK_N rows x BLOCK_B meta bytes (8 positions = 2 groups of 4 each), loads the 8
columns of the tile as 8 strided [BLOCK_N, BLOCK_B] blocks, and for each group of 4 keeps the 2 largest |w|: the
key is |w| read as an integer (orders like |w|; every NaN mapped to the smallest NaN pattern, so NaN > inf and all
NaNs tie), element i beats j (i < j) when key_i >= key_j (ties go to the lower index), and an element is kept when
at most one other beats it. It writes the 2 kept values of each group (lower index first) and one meta byte per
2 groups (low nibble = even group), so the weight is read once and the outputs written once.

Interpreter mode (``TRITON_INTERPRET=1``, CPU tensors): fp32 and fp16 (bf16 is not supported by the interpreter).
This module imports triton and torch only (never ``fastdl``), and imports without a GPU.
"""

import torch
import triton
import triton.language as tl

__all__ = ["compress_2_4"]

# dtype -> (code, |w| bit mask, smallest NaN pattern)
_DTYPES = {
    torch.float32: (0, 0x7FFFFFFF, 0x7F800001),
    torch.float16: (1, 0x7FFF, 0x7C01),
    torch.bfloat16: (2, 0x7FFF, 0x7F81),
}


@triton.jit
def _key(w, IS32: tl.constexpr, ABS: tl.constexpr, NAN: tl.constexpr):
    if IS32:
        k = w.to(tl.int32, bitcast=True) & ABS
    else:
        k = w.to(tl.int16, bitcast=True).to(tl.int32) & ABS
    return tl.minimum(k, NAN)


@triton.jit
def _group(w0, w1, w2, w3, IS32: tl.constexpr, ABS: tl.constexpr, NAN: tl.constexpr):
    """Nibble of kept positions and the two kept values (lower index first) of groups (w0, w1, w2, w3)."""
    k0 = _key(w0, IS32, ABS, NAN)
    k1 = _key(w1, IS32, ABS, NAN)
    k2 = _key(w2, IS32, ABS, NAN)
    k3 = _key(w3, IS32, ABS, NAN)
    c01 = (k0 >= k1).to(tl.int32)
    c02 = (k0 >= k2).to(tl.int32)
    c03 = (k0 >= k3).to(tl.int32)
    c12 = (k1 >= k2).to(tl.int32)
    c13 = (k1 >= k3).to(tl.int32)
    c23 = (k2 >= k3).to(tl.int32)
    keep0 = (3 - c01 - c02 - c03) < 2
    keep1 = (c01 + 2 - c12 - c13) < 2
    keep2 = (c02 + c12 + 1 - c23) < 2
    keep3 = (c03 + c13 + c23) < 2
    nib = keep0.to(tl.int32) | (keep1.to(tl.int32) << 1) | (keep2.to(tl.int32) << 2) | (keep3.to(tl.int32) << 3)
    first = tl.where(keep0, w0, tl.where(keep1, w1, w2))
    second = tl.where(keep3, w3, tl.where(keep2, w2, w1))
    return nib, first, second


@triton.jit
def _compress_kernel(
    w_ptr, v_ptr, m_ptr,
    N, K, NB,
    stride_wn, stride_vn, stride_mn,
    IS32: tl.constexpr, ABS: tl.constexpr, NAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_b = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    bytes_ = pid_b * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    row_ok = rows[:, None] < N
    # even group 2j: positions 8j + 0..3; odd group 2j + 1: positions 8j + 4..7 (absent when 8j + 4 >= K)
    ev_ok = row_ok & (bytes_[None, :] * 8 < K)
    od_ok = row_ok & (bytes_[None, :] * 8 + 4 < K)
    base = w_ptr + rows[:, None] * stride_wn + bytes_[None, :] * 8
    e0 = tl.load(base + 0, mask=ev_ok, other=0.0)
    e1 = tl.load(base + 1, mask=ev_ok, other=0.0)
    e2 = tl.load(base + 2, mask=ev_ok, other=0.0)
    e3 = tl.load(base + 3, mask=ev_ok, other=0.0)
    o0 = tl.load(base + 4, mask=od_ok, other=0.0)
    o1 = tl.load(base + 5, mask=od_ok, other=0.0)
    o2 = tl.load(base + 6, mask=od_ok, other=0.0)
    o3 = tl.load(base + 7, mask=od_ok, other=0.0)
    ne, ea, eb = _group(e0, e1, e2, e3, IS32, ABS, NAN)
    no, oa, ob = _group(o0, o1, o2, o3, IS32, ABS, NAN)
    no = tl.where(od_ok, no, 0)
    vbase = v_ptr + rows[:, None] * stride_vn + bytes_[None, :] * 4
    tl.store(vbase + 0, ea, mask=ev_ok)
    tl.store(vbase + 1, eb, mask=ev_ok)
    tl.store(vbase + 2, oa, mask=od_ok)
    tl.store(vbase + 3, ob, mask=od_ok)
    meta = (ne | (no << 4)).to(tl.uint8)
    tl.store(m_ptr + rows[:, None] * stride_mn + bytes_[None, :], meta, mask=row_ok & (bytes_[None, :] < NB))


def compress_2_4(w: torch.Tensor):
    """Prune ``w [N, K]`` (K % 4 == 0) to 2:4 by magnitude and compress it in one pass (see the module docstring)."""
    if w.dim() != 2:
        raise ValueError(f"compress_2_4: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if w.dtype not in _DTYPES:
        raise TypeError(f"compress_2_4: the Triton kernel takes float32/float16/bfloat16 w, got {w.dtype}")
    N, K = w.shape
    if K % 4:
        raise ValueError(f"compress_2_4: K = w.shape[1] = {K} is not a multiple of 4")
    w = w.contiguous()
    NB = (K + 7) // 8
    values = torch.empty((N, K // 2), dtype=w.dtype, device=w.device)
    meta = torch.empty((N, NB), dtype=torch.uint8, device=w.device)
    if N == 0 or K == 0:
        return values, meta
    code, absm, nan = _DTYPES[w.dtype]
    BLOCK_N, BLOCK_B = 16, 64
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(NB, BLOCK_B))
    _compress_kernel[grid](
        w, values, meta,
        N, K, NB,
        w.stride(0), values.stride(0), meta.stride(0),
        IS32=code == 0, ABS=absm, NAN=nan,
        BLOCK_N=BLOCK_N, BLOCK_B=BLOCK_B,
        num_warps=4,
    )
    return values, meta
