"""Strategies, float64 references and checks for the property-based tests (tests/test_properties.py).

A tensor is drawn as a small record (``Spec``: a seed, a kind of special values, a layout) and built from it, so a
falsifying example prints in one line and replays exactly. The references are written here from the documented
contracts (fastdl/ops/*.py docstrings), in float64, independently of fastdl's own reference implementations.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW = (torch.bfloat16, torch.float16)
NOT_FLOAT = (torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool)  # invalid for every float argument

# sizes of M and N (0, 1, odd, a power of two, odd and > a SIMD width); K adds 4096 at M = 1 (large_k below)
SIZES = (0, 1, 2, 3, 7, 16, 33, 127)
K_SIZES = (0, 1, 3, 7, 16, 33, 64, 127)
K4_SIZES = (0, 4, 8, 12, 36, 68, 132)  # 2:4 sparsity: K % 4 == 0
LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "offset")
# "none" twice: plain random data is the common case; the rest are the special values of the issue
SPECIALS = ("none", "none", "zeros", "zero_rows", "huge", "tiny", "nan", "inf", "ninf")
# magnitudes far from 1 that keep every fp32 partial sum finite (|x| * |w| * K < 1e34) and every product normal
HUGE = {torch.float16: 1e2}
TINY = {torch.float16: 1e-2}
HUGE_DEFAULT, TINY_DEFAULT = 1e15, 1e-15


class Spec(NamedTuple):
    """How to build one tensor: values from ``seed`` with ``special`` values, stored in ``layout``."""

    seed: int
    special: str
    layout: str


def specs(specials=SPECIALS, layouts=LAYOUTS):
    return st.builds(Spec, st.integers(0, 2**31 - 1), st.sampled_from(specials), st.sampled_from(layouts))


def _garbage(dtype: torch.dtype):
    """What fills the bytes around a strided / offset tensor: NaN for floats (a kernel reading them shows it)."""
    if dtype.is_floating_point:
        return math.nan
    return True if dtype == torch.bool else 77


def values(shape, dtype: torch.dtype, spec: Spec, scale: float = 1.0) -> torch.Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` with the values ``spec`` describes (layout not applied)."""
    g = torch.Generator().manual_seed(spec.seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not dtype.is_floating_point:
        lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256) if dtype == torch.uint8 else (-100, 100)
        return torch.randint(lo, hi, shape, generator=g, dtype=dtype)
    v = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    n = v.numel()
    kind = spec.special
    if kind == "zeros":
        v.zero_()
    elif kind == "zero_rows" and v.dim() >= 1 and n:
        rows = torch.rand(shape[:-1] if v.dim() > 1 else shape, generator=g) < 0.5
        v[rows] = 0.0
    elif kind == "huge":
        v *= HUGE.get(dtype, HUGE_DEFAULT)
    elif kind == "tiny":
        v *= TINY.get(dtype, TINY_DEFAULT)
    elif kind == "ties":  # small integers: many equal magnitudes and zeros
        v = torch.round(v.clamp(-2.0, 2.0))
    elif kind in ("nan", "inf", "ninf") and n:
        special = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf}[kind]
        flat = v.view(-1)
        picks = torch.randint(0, n, (max(1, n // 20),), generator=g)
        flat[picks] = special
    return v.to(dtype)


def with_layout(v: torch.Tensor, layout: str) -> torch.Tensor:
    """``v``'s values (or, for "expanded", its first slice repeated) stored with the given layout."""
    shape = tuple(v.shape)
    fill = _garbage(v.dtype)
    if layout == "transposed" and v.dim() >= 2:
        return v.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided" and v.dim() >= 1:
        big = torch.full((*shape[:-1], 2 * shape[-1]), fill, dtype=v.dtype)
        out = big[..., ::2]
        out.copy_(v)
        return out
    if layout == "expanded" and v.dim() >= 1 and shape[0] > 1:  # stride 0 along the first dimension
        return v[:1].expand(shape)
    if layout == "offset":
        flat = torch.full((v.numel() + 3,), fill, dtype=v.dtype)
        out = flat[3:].view(shape)
        out.copy_(v)
        return out
    return v.contiguous()


def build(shape, dtype: torch.dtype, spec: Spec, scale: float = 1.0) -> torch.Tensor:
    return with_layout(values(shape, dtype, spec, scale), spec.layout)


@st.composite
def linear_shapes(draw, k_sizes=K_SIZES, large_k=4096):
    """(lead, M, K, N): x is ``[*lead, M, K]``. One case in eight is M = 1 with a large K, one in eight has many rows
    with an empty K or N (the kernels' multi-row paths on empty products); the rest mixes the sizes above."""
    kind = draw(st.integers(0, 7))
    if large_k and kind == 0:
        return (), 1, large_k, draw(st.sampled_from((1, 7, 33)))
    if kind == 1:
        M = draw(st.sampled_from((64, 127, 130)))
        return (), M, draw(st.sampled_from((0, k_sizes[-1]))), draw(st.sampled_from((0, 3, 17)))
    lead = draw(st.sampled_from(((), (), (2,), (1, 3))))
    return lead, draw(st.sampled_from(SIZES)), draw(st.sampled_from(k_sizes)), draw(st.sampled_from(SIZES))


# pre-activations where the activations' approximations saturate, underflow or overflow
EXTREMES = (-math.inf, -1e30, -1e4, -100.0, -88.7, -87.0, -20.0, -10.5, -9.5, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.5,
            1.0, 9.5, 20.0, 88.7, 1e4, 1e30, math.inf, math.nan)


# ------------------------------------------------------------------------------------------------- checks
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (the absolute norm when ``ref`` is zero), as tests/conftest.py."""
    ref = ref.double()
    denom = ref.norm().item()
    diff = (out.double() - ref).norm().item()
    return diff / denom if denom > 0 else diff


def _clear_masks(ref: torch.Tensor, dtype: torch.dtype):
    """Entries of a float64 reference whose rounding to ``dtype`` is clearly finite / clearly overflows (the ones
    within a factor 2 of the dtype's largest value may round either way and are compared by neither rule)."""
    big = torch.finfo(dtype).max
    a = ref.abs()
    return a <= 0.5 * big, torch.isinf(ref) | (a >= 2 * big)


def _pattern_bad(o: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fin, inf = _clear_masks(ref, dtype)
    bad = (torch.isnan(ref) & ~torch.isnan(o)) | (fin & ~torch.isfinite(o))
    return bad | (inf & ~(torch.isinf(o) & (torch.sign(o) == torch.sign(ref))))


def assert_close_to_reference(out, ref, dtype, tol, *, eager=None, alt=None, atol=0.0, what=""):
    """``out`` (in ``dtype``) against the float64 reference ``ref``: the same NaN / +-Inf pattern, and on the entries
    that are clearly finite ``rel_err <= tol`` against ``ref`` rounded to ``dtype`` (for 16-bit dtypes ``tol`` is
    added to twice PyTorch's own error at ``dtype``, ``eager()`` - the bar tests/test_fused_linear.py uses).
    ``alt``: a second reference whose pattern is accepted too (an activation at -inf: PyTorch gives NaN, the limit
    is -0). ``atol``: an absolute floor of the compared norms (for references that are all nearly zero)."""
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    o = out.double()
    bad = _pattern_bad(o, ref, dtype)
    if alt is not None:
        bad &= _pattern_bad(o, alt, dtype)
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        got = [o[tuple(i)].item() for i in idx]
        want = [ref[tuple(i)].item() for i in idx]
        raise AssertionError(f"{what}: NaN/Inf pattern differs from the float64 reference at {idx}: got {got}, "
                             f"expected {want} ({int(bad.sum())} of {bad.numel()} entries)")
    fin, _ = _clear_masks(ref, dtype)
    # against the reference rounded to the output dtype once (the contract's last step): values below the dtype's
    # range (a tiny result in float16) are 0 or subnormal there, whatever the kernel
    err = rel_err(o[fin], ref.to(dtype).double()[fin])
    if atol and (o[fin] - ref.to(dtype).double()[fin]).norm().item() <= atol * max(1, int(fin.sum())) ** 0.5:
        err = 0.0
    bound = tol
    if dtype in LOW and eager is not None:
        bound = tol + 2 * rel_err(eager().double()[fin], ref[fin])
    assert err <= bound or math.isnan(bound), f"{what}: rel_err {err:.3e} > {bound:.3e} (dtype {dtype})"


def assert_raises_naming(call, exc: type[Exception], arg: str, op):
    """``call()`` raises ``exc`` (exactly that kind: TypeError for a dtype, ValueError for a shape or value,
    RuntimeError for a device) with a message naming the argument and the op (``op``: a name or a tuple of names,
    e.g. a module's class and its op)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the type is the property
        msg = str(e)
        assert isinstance(e, exc), f"{op}: expected {exc.__name__} naming {arg!r}, got {type(e).__name__}: {msg}"
        if exc is RuntimeError:
            assert not isinstance(e, (TypeError, ValueError, NotImplementedError)), (type(e).__name__, msg)
        assert re.search(rf"\b{re.escape(arg)}\b", msg), f"{op}: the message does not name {arg!r}: {msg}"
        names = (op,) if isinstance(op, str) else tuple(op)
        assert any(n in msg for n in names), f"the message does not name the op or class {op!r}: {msg}"
        return
    raise AssertionError(f"{op}: expected {exc.__name__} naming {arg!r}, but the call succeeded")


# ----------------------------------------------------------------------------------------------- references
ACT64 = {
    "none": lambda p: p,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda p: F.gelu(p, approximate="tanh"),
    "silu": F.silu,
}


def fused_linear_64(x, w, b, act, r):
    """(pre, act(pre) + r) with pre = x @ w.T + b in float64, the weight rounded to x's dtype first (the contract)."""
    pre = rows(x).double() @ w.to(x.dtype).double().t()
    if b is not None:
        pre = pre + b.double()
    out = ACT64[act](pre)
    shape = (*x.shape[:-1], w.shape[0])
    if r is not None:
        out = out + r.double().reshape(out.shape)
    return pre.reshape(shape), out.reshape(shape)


def quantize_rows_np(x2: torch.Tensor):
    """The documented per-token quantization in numpy float32 (IEEE division, one multiply, round half to even)."""
    import numpy as np

    M, K = x2.shape
    if M == 0 or K == 0:
        return torch.zeros((M, K), dtype=torch.int8), torch.zeros(M)
    xf = x2.float().numpy()
    a = np.abs(xf)
    amax = np.where(np.isnan(a), np.float32(np.inf), a).max(axis=1).astype(np.float32)
    finite = np.isfinite(amax)
    ok = finite & (amax > 0)
    safe = np.where(ok, amax, np.float32(1)).astype(np.float32)
    with np.errstate(all="ignore"):
        inv = (np.float32(127) / safe).astype(np.float32)
        v = (xf * inv[:, None]).astype(np.float32)
    v = np.rint(np.clip(np.where(np.isnan(v), np.float32(0), v), -127, 127))
    q = np.where(ok[:, None], v, 0).astype(np.int8)
    scale = np.where(ok, (safe / np.float32(127)).astype(np.float32), np.where(finite, 0, np.nan)).astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(scale)


def rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def int_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T of int8 matrices, exactly (float64 holds every partial sum: |sum| <= 128 * 128 * K < 2^53)."""
    return (a.double() @ b.double().t()).to(torch.int64)


def dequant_64(acc, a_scale, b_scale, bias):
    out = acc.double() * a_scale.double()[:, None] * b_scale.double()[None, :]
    return out + bias.double()[None, :] if bias is not None else out


def grouped_weight_64(w_q, w_group):
    d = w_q.double()
    if w_group is not None:
        d = d * w_group.double().repeat_interleave(16, dim=1)[:, : w_q.shape[1]]
    return d


def weight_only_64(x, w_q, w_scale, bias, w_group):
    out = (rows(x).double() @ grouped_weight_64(w_q, w_group).t()) * w_scale.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], w_q.shape[0])


def mask_2_4_ref(w: torch.Tensor) -> torch.Tensor:
    """Top 2 of each group of 4 along K by |w| (NaN above +inf), ties to the lower index: two stable sorts."""
    N, K = w.shape
    g = w.double().reshape(N, K // 4, 4)
    mag = torch.where(torch.isnan(g), 0.0, g.abs())
    cls = torch.isnan(g).to(torch.int8)  # NaN first, then by magnitude
    o1 = torch.sort(mag, dim=-1, descending=True, stable=True).indices
    o2 = torch.sort(torch.gather(cls, -1, o1), dim=-1, descending=True, stable=True).indices
    order = torch.gather(o1, -1, o2)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(-1, order[..., :2], True)
    return keep.reshape(N, K)


def pack_meta_ref(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, K] -> uint8 [N, ceil(K/8)]: bit p of the little-endian byte string is position p."""
    N, K = mask.shape
    nbytes = (K + 7) // 8
    bits = torch.zeros((N, nbytes * 8), dtype=torch.int64)
    bits[:, :K] = mask.long()
    weights = 2 ** torch.arange(8)
    return (bits.reshape(N, nbytes, 8) * weights).sum(-1).to(torch.uint8)


def unpack_meta_ref(meta: torch.Tensor, K: int) -> torch.Tensor:
    N = meta.shape[0]
    bits = (meta.long().unsqueeze(-1) >> torch.arange(8)) & 1
    return bits.reshape(N, 8 * meta.shape[1])[:, :K].bool()


def decompress_ref(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor | None:
    """The dense [N, K] weight, or None when ``meta`` does not keep exactly 2 of every 4 (invalid meta)."""
    N, K = values.shape[0], 2 * values.shape[1]
    mask = unpack_meta_ref(meta, K)
    if K and not bool((mask.reshape(N, K // 4, 4).sum(-1) == 2).all()):
        return None
    out = torch.zeros((N, K), dtype=values.dtype)
    out[mask] = values.contiguous().reshape(-1)
    return out
