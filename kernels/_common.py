"""The ``@triton.jit`` helpers more than one of fastdl's Triton modules calls (fused_linear, int8, int4): the program
order of a tiled GEMM, the round half to even and the per-row / per-group quantization parameters of the int8
activations' contract, and the output cast. Kernels call them as ordinary functions (Triton inlines them).

Round half to even: ``libdevice.rint`` (cvt.rni) on the GPU; the interpreter has no libdevice, so there the
``USE_RINT`` constexpr selects the 1.5 * 2**23 trick, exact for |v| <= 2**22. ``USE_RINT`` is what the launchers pass.

This module imports triton, nothing of ``fastdl``; it imports without a GPU.
"""

import triton
import triton.language as tl

from ._tuning import INTERPRET

try:  # triton >= 3.0
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    libdevice = None

USE_RINT = (not INTERPRET) and libdevice is not None


@triton.jit
def grouped_pid(pid, num_m, num_n, GROUP: tl.constexpr):
    """Linear program id -> (pid_m, pid_n), walking GROUP row tiles per column tile so that the tiles of the other
    operand are reused from L2."""
    per_group = GROUP * num_n
    group_id = pid // per_group
    first_m = group_id * GROUP
    group_rows = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def rint(v, USE_RINT: tl.constexpr):
    """Round half to even, for |v| <= 127."""
    if USE_RINT:
        r = libdevice.rint(v)
    else:
        r = (v + 12582912.0) - 12582912.0  # 1.5 * 2**23: the sum lands where the fp32 spacing is 1
    return r


@triton.jit
def abs_nan_inf(x):
    """|x| with NaN counted as +inf (its row or group is then 'not finite')."""
    return tl.where(x != x, float("inf"), tl.abs(x))


@triton.jit
def quant_params(amax):
    """(ok, inv, scale) of the int8 activations' contract for a row's or group's amax: inv = 127 / amax, scale =
    amax / 127 (IEEE divisions); scale = 0 when all values are zero and NaN when one is not finite (ok = False: q =
    0)."""
    finite = amax < float("inf")
    ok = finite & (amax > 0.0)
    safe = tl.where(ok, amax, 1.0)
    c127 = tl.full(safe.shape, 127.0, tl.float32)
    inv = tl.math.div_rn(c127, safe)
    scale = tl.where(ok, tl.math.div_rn(safe, c127), tl.where(finite, 0.0, float("nan")))
    return ok, inv, scale


@triton.jit
def cast_out(y, out_ptr, RNE_BF16: tl.constexpr):
    """Cast an fp32 result to the output's dtype. The interpreter's fp32 -> bf16 cast truncates; there the round to
    nearest even is done by hand on the bits (the GPU cast is already RNE)."""
    if RNE_BF16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
        y = tl.where(y != y, y, bits.to(tl.float32, bitcast=True))
    return y.to(out_ptr.dtype.element_ty)
