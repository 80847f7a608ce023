"""The int8 formats of ``fastdl.ops.int8`` and their exact formulas in plain PyTorch (nothing here is an op).

* the per-row (per-token) quantization of the ``quantize_per_token`` contract, bit for bit;
* the VNNI packed weight layout of the C++ CPU kernels (``int8_pack_weight``) and its inverse;
* the two-level group-scaled weight (``quantize_per_group``, run once per model) and its dequantized form;
* the exact int32 accumulation and the dequant epilogue of ``int8_mm`` / ``int8_linear``.

``fastdl.ops.int8`` declares the ops and uses these as the references of its ``torch`` backend (and re-exports
the names modules use); the C++, CUDA and Triton kernels implement the same formulas.
"""

from __future__ import annotations

import math

import torch

from ..kernels.constants import WEIGHT_GROUP  # k per group scale (fixed: the kernels step through K in 16s)

PACK_N, PACK_K = 16, 4  # VNNI tile: 16 output channels x 4 consecutive k


def _roundup(v, m):
    return (v + m - 1) // m * m


def packed_shape(n, k) -> tuple:
    """Shape of ``int8_pack_weight``'s packed tensor for an ``[n, k]`` weight: ``(roundup(n, 16), roundup(k, 4))``."""
    return _roundup(n, PACK_N), _roundup(k, PACK_K)


def group_count(K: int) -> int:
    """Number of group scales per output channel of a weight with K input features."""
    return (K + WEIGHT_GROUP - 1) // WEIGHT_GROUP


def grouped_weight(w_q: torch.Tensor, w_group_scale: torch.Tensor | None) -> torch.Tensor:
    """``d = w_q * w_group_scale[:, k // 16]`` in fp32 (exact integers), or ``w_q`` in fp32 without group scales."""
    d = w_q.float()
    if w_group_scale is not None:
        d = d * w_group_scale.float().repeat_interleave(WEIGHT_GROUP, dim=1)[:, : w_q.shape[1]]
    return d


# ------------------------------------------------------------------------------------------- reference helpers
def quantize_rows_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's per-row quantization of a 2-D float tensor, written plainly in PyTorch (bit-exact)."""
    M, K = x2.shape
    if K == 0 or M == 0:
        return torch.zeros((M, K), dtype=torch.int8, device=x2.device), torch.zeros(M, device=x2.device)
    xf = x2.float()
    a = xf.abs()
    amax = torch.where(torch.isnan(a), math.inf, a).amax(dim=1)  # NaN counts as "not finite"
    finite = torch.isfinite(amax)
    ok = finite & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    c127 = torch.full_like(safe, 127.0)
    # tensor / tensor: an IEEE division. (`127.0 / t` is t.reciprocal() * 127 in PyTorch, and a Python-scalar
    # divisor is a multiply by its reciprocal on CUDA: neither is correctly rounded.)
    inv = torch.div(c127, safe)
    v = xf * inv[:, None]  # one fp32 multiply, no fma
    v = torch.where(torch.isnan(v), 0.0, v).clamp_(-127.0, 127.0).round_()  # round half to even
    q = torch.where(ok[:, None], v, 0.0).to(torch.int8).contiguous()  # x's strides would carry over
    scale = torch.where(ok, torch.div(safe, c127), torch.where(finite, 0.0, math.nan))
    return q, scale


def quantize_rows_u7_reference(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 7-bit activation mode's per-row quantization (``int8_linear(..., act_bits=7)``), bit-exact: returns the
    int8 ``a = q - z`` in [-127, 127] and the fp32 scale, so that ``a * scale`` is the row's dequantized value."""
    M, K = x2.shape
    if K == 0 or M == 0:
        return torch.zeros((M, K), dtype=torch.int8, device=x2.device), torch.zeros(M, device=x2.device)
    xf = x2.float()
    nonfinite = ~torch.isfinite(xf).all(dim=1)
    clean = torch.where(nonfinite[:, None], 0.0, xf)
    lo = clean.amin(dim=1).clamp(max=0.0)
    hi = clean.amax(dim=1).clamp(min=0.0)
    rng = hi - lo  # fp32
    bad = nonfinite | ~torch.isfinite(rng)
    safe = torch.where(bad | (rng == 0), 1.0, rng)
    c127 = torch.full_like(safe, 127.0)
    inv = torch.div(c127, safe)  # IEEE division (see quantize_rows_reference)
    ok = ~bad & (rng != 0) & torch.isfinite(inv)
    z = (-lo * inv).round_().clamp_(0.0, 127.0)
    q = (clean * inv[:, None]).round_().add_(z[:, None]).clamp_(0.0, 127.0)
    a = torch.where(ok[:, None], q - z[:, None], 0.0).to(torch.int8).contiguous()
    scale = torch.where(ok, torch.div(safe, c127), torch.where(bad, math.nan, 0.0))
    return a, scale


def pack_reference(w_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """VNNI packing with reshape/permute: element (n, k) lands at flat index
    ((n // 16) * (Kp // 4) + k // 4) * 64 + (n % 16) * 4 + k % 4."""
    N, K = w_q.shape
    Np, Kp = packed_shape(N, K)
    padded = torch.zeros((Np, Kp), dtype=torch.int8, device=w_q.device)
    padded[:N, :K] = w_q
    packed = padded.view(Np // PACK_N, PACK_N, Kp // PACK_K, PACK_K).permute(0, 2, 1, 3).contiguous().view(Np, Kp)
    comp = torch.zeros(Np, dtype=torch.int32, device=w_q.device)
    comp[:N] = w_q.sum(dim=1, dtype=torch.int32) * 128
    return packed, comp


def unpack_reference(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Inverse of ``pack_reference``: the plain ``[N, K]`` int8 weight."""
    Np, Kp = packed.shape
    blocks = packed.reshape(Np // PACK_N, Kp // PACK_K, PACK_N, PACK_K).permute(0, 2, 1, 3)
    return blocks.reshape(Np, Kp)[:N, :K].contiguous()


def is_placeholder(w_q: torch.Tensor) -> bool:
    """True for the stride-0 stand-in of a weight that is held only in packed form."""
    return w_q.numel() > 1 and all(s == 0 for s in w_q.stride())


def plain_weight(w_q: torch.Tensor, w_packed: torch.Tensor | None) -> torch.Tensor:
    """The ``[N, K]`` int8 weight, unpacked from ``w_packed`` when ``w_q`` is only a placeholder."""
    if w_packed is not None and is_placeholder(w_q):
        return unpack_reference(w_packed, w_q.shape[0], w_q.shape[1])
    return w_q


_CPU_INT_MM_EXACT: list = []


def _cpu_int_mm_exact() -> bool:
    """Whether torch._int_mm is exact on this CPU, probed once per process at the extremes (+-127 x +-127 / -128).
    With VNNI oneDNN runs vpdpbusd and is exact; on an AVX2-only CPU (or with ONEDNN_MAX_CPU_ISA=AVX2) its u8 x s8
    vpmaddubsw kernel saturates the int16 pair sums (torch 2.14.1, Zen 4 capped at AVX2: 127 x 127 over K = 4096 gave
    522240 instead of 66064384)."""
    if not _CPU_INT_MM_EXACT:
        g = torch.Generator().manual_seed(0)
        ok = True
        for M, K, N in ((1, 64, 16), (32, 64, 32)):
            a = torch.where(torch.rand(M, K, generator=g, device="cpu") < 0.5, 127, -127).to(torch.int8)
            b = torch.where(torch.rand(K, N, generator=g, device="cpu") < 0.5, 127, -128).to(torch.int8)
            a[:, 0] = 127
            b[:, 0] = 127
            ref = (a.double() @ b.double()).to(torch.int64)
            ok = ok and bool((torch._int_mm(a, b).to(torch.int64) == ref).all())
        _CPU_INT_MM_EXACT.append(ok)
    return _CPU_INT_MM_EXACT[0]


def _int_mm_is_exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Where torch._int_mm is used by the reference (tested exact there): CPU with K >= 16 (on torch 2.14 it returns
    garbage for K == 1) where the probe above finds it exact, CUDA within its documented limits (M > 16, K and N
    multiples of 8)."""
    M, K = a.shape
    N = b.shape[0]
    if a.device.type == "cpu":
        return K >= 16 and _cpu_int_mm_exact()
    if a.device.type == "cuda":
        return M > 16 and K % 8 == 0 and N % 8 == 0 and K >= 16
    return False


def int32_acc_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """acc = a @ b.T exactly in int32: torch._int_mm where it is exact, else a float64 matmul (exact: every partial
    sum is an integer below 2^53) wrapped to int32 like an int32 accumulator."""
    M, K = a.shape
    N = b.shape[0]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=torch.int32, device=a.device)
    if _int_mm_is_exact(a, b):
        return torch._int_mm(a.contiguous(), b.contiguous().t())
    return torch.matmul(a.double(), b.double().t()).to(torch.int64).to(torch.int32)


def dequant_reference(acc, a_scale, b_scale, bias, out_dtype):
    """((float(acc) * a_scale[m]) * b_scale[n]) + bias[n] in fp32, then the cast (each step rounded in fp32)."""
    out = acc.float() * a_scale.float()[:, None]
    out = out * b_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(out_dtype)


# ------------------------------------------------------------------------------------------- quantize_per_group
# A group's code is searched over code0 - d for these d (code0 = the smallest code that clips nothing): the code with
# the least squared error in the group wins. A smaller code clips the group's largest weight to 127 steps, so only the
# next one or two codes ever win (measured on Gaussian [512, 4096] weights: d = 1 wins in 37 % of the groups, d = 2 in
# 1.6 %, d = 3 never; -9 % squared error). Relative error of x @ W.T on Gaussian data: per-channel 0.87 %, groups
# without search 0.491 %, with it 0.468 %.
_SEARCH_STEPS = (0, 1, 2)
_CHUNK = 1 << 22  # weights quantized at a time (bounds the temporaries to ~100 MB)


@torch.no_grad()
def _quantize_group_rows(w: torch.Tensor, search: bool):
    N, K = w.shape
    G = group_count(K)
    wp = torch.nn.functional.pad(w.float(), (0, G * WEIGHT_GROUP - K)).view(N, G, WEIGHT_GROUP)
    a = wp.abs()
    amax = torch.where(torch.isnan(a), math.inf, a).amax(dim=(1, 2)) if K > 0 else a.new_zeros(N)
    finite = torch.isfinite(amax)
    ok = finite & (amax > 0)
    safe = torch.where(ok, amax, 1.0)
    scale = torch.div(safe, torch.full_like(safe, 127.0 * 255.0))  # IEEE fp32 division
    gmax = torch.where(ok[:, None, None], a, 0.0).amax(dim=2) if K > 0 else a.new_zeros((N, G))
    code0 = torch.ceil(gmax * (255.0 / safe)[:, None]).clamp_(0, 255)  # 0 only for all-zero groups
    best_q = best_code = best_err = None
    for d in _SEARCH_STEPS if search else (0,):
        code = code0 if d == 0 else torch.where(code0 > 0, (code0 - d).clamp_(1, 255), 0.0)
        step = code * scale[:, None]  # the group's dequant step, as the kernels compute it: (q * code) * scale
        q = torch.where(step[..., None] > 0, wp / step[..., None], 0.0).round_().clamp_(-127, 127)
        if best_q is None:
            best_q, best_code = q, code
            if search:
                best_err = (q * step[..., None] - wp).square_().sum(dim=2)
            continue
        err = (q * step[..., None] - wp).square_().sum(dim=2)
        better = err < best_err
        best_q = torch.where(better[..., None], q, best_q)
        best_code = torch.where(better, code, best_code)
        best_err = torch.minimum(err, best_err)
    q = torch.where(ok[:, None, None], best_q, 0.0).view(N, G * WEIGHT_GROUP)[:, :K].to(torch.int8)
    code = torch.where(ok[:, None], best_code, 0.0).to(torch.uint8)
    scale = torch.where(ok, scale, torch.where(finite, 0.0, math.nan))
    return q.contiguous(), scale, code


def quantize_per_group(w: torch.Tensor, search: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight ``[N, K]`` for ``int8_weight_only_linear`` with group scales: returns ``(w_q int8 [N, K],
    w_scale fp32 [N], w_group_scale uint8 [N, ceil(K / 16)])`` with ``w ~= w_q * w_group_scale[:, k // 16, None] *
    w_scale[:, None]``.

    Two levels: ``w_scale[n] = amax_n / (127 * 255)`` per output channel and an 8-bit code per group of 16 input
    features, so a group's step adapts to its own range at 8.5 bits per weight (0.266x the fp32 bytes). With
    ``search`` each group's code is the one with the least squared error among the smallest code that clips nothing and
    the two below it; without it, that code. A zero row gets scale 0, a row holding NaN/Inf scale NaN (its
    outputs are NaN), and ``w_q = 0`` in both."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_group: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"quantize_per_group: w must be a floating tensor, got dtype {w.dtype}")
    w = w.detach()
    N, K = w.shape
    rows = max(1, _CHUNK // max(K, 1))
    if N <= rows:
        return _quantize_group_rows(w, search)
    parts = [_quantize_group_rows(w[i : i + rows], search) for i in range(0, N, rows)]
    return tuple(torch.cat(ts) for ts in zip(*parts))
