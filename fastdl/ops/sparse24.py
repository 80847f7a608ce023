"""2:4 semi-structured sparsity: masks, prune+compress, decompress, and the sparse linear.

Ops (``torch.ops.fastdl.<name>``; every backend implements exactly this):

``mask_2_4(w [N, K]) -> bool [N, K]``
    Groups are 4 consecutive elements along K (the input dimension); K % 4 == 0 is required. Each group keeps its 2
    largest ``|w|``; ties go to the lower index; NaN counts as larger than any number (it is kept and shows up).
    The rule only compares values, so identical weights give identical masks on every backend and every DDP rank.
``compress_2_4(w [N, K]) -> (values [N, K/2], meta uint8 [N, ceil(K/8)])``
    Prune and compress in one pass: keeps the 2 elements ``mask_2_4(w)`` selects (for a weight that is already
    2:4 sparse, its non-zeros).  ``values`` holds the 2 kept elements of each group in increasing index order, in
    w's dtype.  ``meta`` holds 4 bits per group, the bitmask of the kept positions (exactly 2 bits set, i.e. 2 bits
    per kept element): byte j holds group 2j in its low nibble and group 2j+1 in its high nibble, an unused high
    nibble (K % 8 == 4) is 0.  So the little-endian uint32 made of bytes 4i..4i+3 is the 32-bit mask of positions
    32i..32i+31 (bit p <-> position p), usable directly as an AVX-512 ``__mmask32`` for ``vpexpandw``.
``decompress_2_4(values, meta) -> [N, K]``
    The dense weight with zeros at pruned positions: ``decompress_2_4(*compress_2_4(w)) == w * mask_2_4(w)``.
``sparse24_linear(x [..., K], values, meta, bias [N] or None) -> [..., N]``
    ``x @ W.T + bias`` with ``W = decompress_2_4(values, meta)`` rounded to x's dtype; fp32 accumulation (bias read
    as fp32), one rounding to x's dtype. x is float32/bfloat16 (float16 on CUDA; float64 on the reference path).
    Differentiable in x, values and bias (the gradient of values is the dense weight gradient at the kept
    positions).
``sparse24_linear_backward(grad_out [..., N], x, values, meta, output_mask bool[3]) -> (grad_x, grad_v, grad_b)``
    The backward of ``sparse24_linear`` in one call: ``grad_x = grad_out @ W`` in x's dtype, ``grad_values`` =
    ``grad_out^T @ x`` (fp32) at the kept positions in values' dtype, ``grad_bias`` = the fp32 sum of ``grad_out``
    over rows. An output whose ``output_mask`` entry is False is an empty tensor.

Helpers (plain functions): ``pack_mask(mask) -> meta`` and ``unpack_meta(meta, K) -> mask`` convert between a bool
mask and the meta layout (any mask, not only 2-of-4: fastdl.sparsity stores its training masks this way).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_same_device, check_vector, check_x
from ._library import (
    define,
    grad_of,
    register_autocast_rule,
    register_autograd,
    require,
    require_device,
    require_dtype,
)

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

MASK_SCHEMA = "(Tensor w) -> Tensor"
COMPRESS_SCHEMA = "(Tensor w) -> (Tensor, Tensor)"
DECOMPRESS_SCHEMA = "(Tensor values, Tensor meta) -> Tensor"
LINEAR_SCHEMA = "(Tensor x, Tensor values, Tensor meta, Tensor? bias) -> Tensor"
BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor values, Tensor meta, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"
)


# ----------------------------------------------------------------------------------------------- argument checks
def check_weight(w: torch.Tensor, op: str) -> tuple[int, int]:
    """[N, K] floating weight with K % 4 == 0; returns (N, K)."""
    require_dtype(
        w.dtype in _FLOAT,
        lambda: f"{op}: w must be a floating tensor (float32, bfloat16, float16, float64), got dtype {w.dtype}",
    )
    require(w.dim() == 2, lambda: f"{op}: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    N, K = w.shape
    require(
        K % 4 == 0,
        lambda: f"{op}: K = w.shape[1] = {K} is not a multiple of 4 (2:4 sparsity groups 4 consecutive elements "
        "along K); pad the input features or leave this layer dense",
    )
    return N, K


def check_compressed(values: torch.Tensor, meta: torch.Tensor, op: str) -> tuple[int, int]:
    """values [N, K/2] floating, meta uint8 [N, ceil(K/8)]; returns (N, K)."""
    require_dtype(
        values.dtype in _FLOAT, lambda: f"{op}: values must be a floating tensor, got dtype {values.dtype}"
    )
    require(
        values.dim() == 2, lambda: f"{op}: values must be 2-D [N, K/2], got shape {tuple(values.shape)}"
    )
    require_dtype(meta.dtype == torch.uint8, lambda: f"{op}: meta must be torch.uint8, got {meta.dtype}")
    N, half = values.shape
    K = 2 * half
    require(
        half % 2 == 0,
        lambda: f"{op}: values.shape[1] = {half} must be K/2 with K a multiple of 4 (so it must be even)",
    )
    require(
        meta.dim() == 2 and meta.shape[0] == N and meta.shape[1] == (K + 7) // 8,
        lambda: f"{op}: meta must have shape [N, ceil(K/8)] = [{N}, {(K + 7) // 8}] for values of shape "
        f"{tuple(values.shape)} (K = {K}), got {tuple(meta.shape)}",
    )
    require_device(
        meta.device == values.device,
        lambda: f"{op}: values and meta must be on the same device, got {values.device} and {meta.device}",
    )
    return N, K


def check_linear(x, values, meta, bias) -> tuple[int, int]:
    N, K = check_compressed(values, meta, "sparse24_linear")
    fn = "sparse24_linear"
    check_x(fn, x, _FLOAT, "a floating tensor (float32, bfloat16, float16)")
    require(
        x.shape[-1] == K,
        lambda: f"{fn}: x.shape[-1] = {x.shape[-1]} must equal K = 2 * values.shape[1] = {K} (mismatched K)",
    )
    check_same_device(fn, "values", values, x)
    if bias is not None:
        check_vector(fn, "bias", bias, N, x)
    return N, K


# ----------------------------------------------------------------------------------------------- meta helpers
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [N, K] (K % 4 == 0) -> uint8 [N, ceil(K/8)] in the meta layout (nibble per group, low nibble first)."""
    require_dtype(
        mask.dtype == torch.bool,
        lambda: f"pack_mask: mask must be a torch.bool tensor (e.g. w != 0), got dtype {mask.dtype}",
    )
    require(mask.dim() == 2, lambda: f"pack_mask: mask must be 2-D [N, K], got {tuple(mask.shape)}")
    N, K = mask.shape
    require(K % 4 == 0, lambda: f"pack_mask: K = mask.shape[1] = {K} is not a multiple of 4")
    G = K // 4
    bits = mask.reshape(N, G, 4).to(torch.uint8)
    nib = bits[..., 0] | (bits[..., 1] << 1) | (bits[..., 2] << 2) | (bits[..., 3] << 3)
    if G % 2:
        nib = torch.cat([nib, nib.new_zeros(N, 1)], dim=1)
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()


def unpack_meta(meta: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [N, ceil(K/8)] -> bool [N, K] (the inverse of ``pack_mask``)."""
    require_dtype(
        isinstance(meta, torch.Tensor) and meta.dtype == torch.uint8,
        lambda: f"unpack_meta: meta must be a torch.uint8 tensor, got {getattr(meta, 'dtype', type(meta).__name__)}",
    )
    require(meta.dim() == 2, lambda: f"unpack_meta: meta must be 2-D [N, ceil(K/8)], got shape {tuple(meta.shape)}")
    require(
        isinstance(K, int) and K >= 0 and K % 4 == 0,
        lambda: f"unpack_meta: K must be a non-negative multiple of 4, got {K!r}",
    )
    N = meta.shape[0]
    require(
        meta.shape[1] == (K + 7) // 8,
        lambda: f"unpack_meta: meta must have shape [N, ceil(K/8)] = [{N}, {(K + 7) // 8}] for K = {K}, "
        f"got {tuple(meta.shape)}",
    )
    G = K // 4
    nib = torch.stack([meta & 15, meta >> 4], dim=-1).reshape(N, 2 * meta.shape[1])[:, :G]
    shifts = torch.arange(4, device=meta.device, dtype=torch.uint8)
    return ((nib.unsqueeze(-1) >> shifts) & 1).reshape(N, K).bool()


def _magnitude_key(w: torch.Tensor) -> torch.Tensor:
    """An integer key whose order is the order of |w| with every NaN equal to each other and above +inf.

    |w| of an IEEE float, read as an integer, orders like the float (sign bit cleared). Any 16-bit float widens to
    float32 exactly, float64 keeps its own width. NaNs (whatever their payload) map to the smallest NaN pattern.
    """
    if w.dtype == torch.float64:
        bits = w.abs().view(torch.int64)
        return torch.where(torch.isnan(w), torch.full_like(bits, 0x7FF0000000000001), bits)
    bits = w.float().abs().view(torch.int32)
    return torch.where(torch.isnan(w), torch.full_like(bits, 0x7F800001), bits)


def _keep(key: torch.Tensor) -> torch.Tensor:
    """key [N, G, 4] -> bool [N, G, 4]: rank < 2, where element j beats i if key_j > key_i, or equal and j < i."""
    k = key.unbind(-1)
    beaten = [torch.zeros_like(k[0], dtype=torch.uint8) for _ in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            i_wins = k[i] >= k[j]  # i < j: i wins ties
            beaten[j] += i_wins
            beaten[i] += ~i_wins
    return torch.stack([b < 2 for b in beaten], dim=-1)


# ------------------------------------------------------------------------------------------------ mask_2_4
def _mask_fake(w):
    N, K = check_weight(w, "mask_2_4")
    return w.new_empty((N, K), dtype=torch.bool)


def _mask_reference(w):
    N, K = check_weight(w, "mask_2_4")
    return _keep(_magnitude_key(w).reshape(N, K // 4, 4)).reshape(N, K)


def _cpp_weight_supports(backend: str, args) -> str | None:
    w = args[0]
    if not w.is_floating_point():
        return None  # not a backend question: every backend rejects it with the same message
    if backend == "cpp" and w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the C++ kernels take float32/bfloat16/float16 weights, not {w.dtype}"
    if backend == "triton" and w.dtype == torch.float64:
        return "the Triton kernel takes float32/bfloat16/float16 weights, not float64"
    if backend == "triton" and w.device.type == "cpu" and w.dtype == torch.bfloat16:
        return "bfloat16 is not supported by the Triton interpreter"
    return None


mask_2_4_op = define("mask_2_4", MASK_SCHEMA, reference=_mask_reference, fake=_mask_fake,
                     check=lambda w: check_weight(w, "mask_2_4"), supports=_cpp_weight_supports)  # fmt: skip


# ------------------------------------------------------------------------------------------------ compress_2_4
def _compress_fake(w):
    N, K = check_weight(w, "compress_2_4")
    return w.new_empty((N, K // 2)), w.new_empty((N, (K + 7) // 8), dtype=torch.uint8)


def _compress_reference(w):
    N, K = check_weight(w, "compress_2_4")
    mask = _mask_reference(w)
    values = w[mask].reshape(N, K // 2)  # row-major boolean indexing keeps the increasing index order
    return values, pack_mask(mask)


compress_2_4_op = define("compress_2_4", COMPRESS_SCHEMA, reference=_compress_reference, fake=_compress_fake,
                         check=lambda w: check_weight(w, "compress_2_4"), supports=_cpp_weight_supports,
                         cuda=("triton", "torch"), triton="sparse24:compress_2_4")  # fmt: skip


# ------------------------------------------------------------------------------------------------ decompress_2_4
def _decompress_fake(values, meta):
    N, K = check_compressed(values, meta, "decompress_2_4")
    return values.new_empty((N, K))


_NIBBLE_BITS = (0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4)


def check_meta(meta: torch.Tensor, K: int, op: str) -> None:
    """ValueError naming the first invalid group of meta (uint8 [N, ceil(K/8)]): every 4-bit group must have exactly
    2 bits set and the unused high nibble of a row's last byte (K % 8 == 4) must be 0. The same rule and message as
    the C++ kernels' check (csrc/cpu/sparse24.cpp, check_meta). Reads meta's data (not for fake tensors)."""
    N, G = meta.shape[0], K // 4
    if N == 0 or K == 0:
        return
    nib = torch.stack([meta & 15, meta >> 4], dim=-1).reshape(N, 2 * meta.shape[1])
    bits = torch.tensor(_NIBBLE_BITS, dtype=torch.uint8, device=meta.device)[nib.long()]
    bad = torch.cat([bits[:, :G] != 2, nib[:, G:] != 0], dim=1)
    if not bool(bad.any()):
        return
    r, g = (int(i) for i in bad.nonzero()[0])
    j, byte, value = g // 2, int(meta[r, g // 2]), int(nib[r, g])
    where = f"group {g}" if g < G else "unused nibble"
    raise ValueError(
        f"{op}: meta must have exactly 2 bits set in every 4-bit group (the kept positions of 4 weights; nibble 0x3, "
        "0x5, 0x6, 0x9, 0xA or 0xC) and 0 in the unused high nibble of a row's last byte when K % 8 == 4 (use meta "
        f"from compress_2_4); got meta[{r}, {j}] = {byte} ({where} of row {r}: {value})"
    )


def _decompress_reference(values, meta, op="decompress_2_4"):
    N, K = check_compressed(values, meta, op)
    check_meta(meta, K, op)
    mask = unpack_meta(meta, K)
    out = values.new_zeros((N, K))
    out[mask] = values.reshape(-1)
    return out


def _decompress_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])
    ctx.half = inputs[0].shape[1]


def _decompress_backward(ctx, grad):
    (meta,) = ctx.saved_tensors
    N, K = grad.shape
    keep = unpack_meta(meta, K)  # the gradient of each kept value is the dense gradient at its position
    return grad[keep].reshape(N, ctx.half), None


def _cpp_compressed_supports(backend: str, args) -> str | None:
    values = args[0]
    if not values.is_floating_point():
        return None
    if backend == "cpp" and values.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"the C++ kernels take float32/bfloat16/float16 values, not {values.dtype}"
    return None


decompress_2_4_op = define("decompress_2_4", DECOMPRESS_SCHEMA, reference=_decompress_reference, fake=_decompress_fake,
                           check=lambda values, meta: check_compressed(values, meta, "decompress_2_4"),
                           supports=_cpp_compressed_supports)  # fmt: skip


# the backward (a gather, linear in grad) is made of differentiable torch ops: it is its own double backward
register_autograd(
    decompress_2_4_op, _decompress_backward, _decompress_setup_context, double_backward=_decompress_backward
)


# ------------------------------------------------------------------------------------------------ sparse24_linear
def _linear_fake(x, values, meta, bias):
    N, _ = check_linear(x, values, meta, bias)
    return x.new_empty((*x.shape[:-1], N))


def _linear_reference(x, values, meta, bias):
    N, K = check_linear(x, values, meta, bias)
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        # cuBLAS accumulates 16-bit GEMMs in fp32 already; an fp32 copy of x and W would only cost time
        w = _decompress_reference(values, meta, "sparse24_linear").to(x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype)).contiguous()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = _decompress_reference(values, meta, "sparse24_linear").to(x.dtype).to(acc)
    out = torch.matmul(x.to(acc), w.t())
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype).contiguous()


def _linear_supports(backend: str, args) -> str | None:
    x, values = args[0], args[1]
    if not (x.is_floating_point() and values.is_floating_point()):
        return None
    if backend == "cpp" and x.is_cpu:
        if x.dtype not in (torch.float32, torch.bfloat16):
            return f"the C++ CPU kernel takes float32/bfloat16 x, not {x.dtype}"
        if values.dtype not in (torch.float32, torch.bfloat16):
            return f"the C++ CPU kernel takes float32/bfloat16 values, not {values.dtype}"
    return None


# cpp_autograd=True: csrc/sparse24_autograd.cpp
sparse24_linear_op = define("sparse24_linear", LINEAR_SCHEMA, reference=_linear_reference, fake=_linear_fake,
                            check=check_linear, supports=_linear_supports, cpp_autograd=True)  # fmt: skip


def _linear_setup_context(ctx, inputs, output):
    x, values, meta, bias = inputs
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, values, meta)


def _check_backward(grad_out, x, values, meta):
    N, _ = check_linear(x, values, meta, None)
    fn = "sparse24_linear_backward"
    require_dtype(grad_out.dtype in _FLOAT, lambda: f"{fn}: grad_out must be a floating tensor, got {grad_out.dtype}")
    out_shape = (*x.shape[:-1], N)
    require(
        tuple(grad_out.shape) == out_shape,
        lambda: f"{fn}: grad_out must have shape {list(out_shape)}, got {list(grad_out.shape)}",
    )
    require_device(
        grad_out.device == x.device, lambda: f"{fn}: grad_out must be on x's device {x.device}, got {grad_out.device}"
    )


def _backward_fake(grad_out, x, values, meta, output_mask):
    _check_backward(grad_out, x, values, meta)
    gx = x.new_empty(x.shape) if output_mask[0] else x.new_empty(0)
    gv = values.new_empty(values.shape) if output_mask[1] else values.new_empty(0)
    gb = x.new_empty((values.shape[0],), dtype=torch.float32) if output_mask[2] else x.new_empty(0, dtype=torch.float32)
    return gx, gv, gb


def _backward_reference(grad_out, x, values, meta, output_mask):
    _check_backward(grad_out, x, values, meta)
    N, K = values.shape[0], 2 * values.shape[1]
    check_meta(meta, K, "sparse24_linear_backward")
    M = math.prod(x.shape[:-1])  # reshape(-1, ...) cannot infer it when N or K is 0
    g = grad_out.reshape(M, N)
    gx, gv, gb = x.new_empty(0), values.new_empty(0), x.new_empty(0, dtype=torch.float32)
    if output_mask[0]:
        w = decompress_2_4_op(values, meta).to(x.dtype)
        gx = torch.matmul(g.to(x.dtype), w).reshape(x.shape)
    if output_mask[1]:
        dense = torch.matmul(g.t().float(), x.reshape(M, K).float())
        keep = decompress_2_4_op(torch.ones_like(values), meta) != 0
        gv = dense[keep].reshape(N, K // 2).to(values.dtype)
    if output_mask[2]:
        gb = g.float().sum(0)
    return gx, gv, gb


sparse24_linear_backward_op = define("sparse24_linear_backward", BACKWARD_SCHEMA, reference=_backward_reference,
                                     fake=_backward_fake,
                                     check=lambda g, x, values, meta, mask: _check_backward(g, x, values, meta),
                                     supports=lambda backend, args: _linear_supports(backend, args[1:]))  # fmt: skip


def _linear_backward(ctx, grad_out):
    x, values, meta = ctx.saved_tensors
    need_x, need_v, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]
    if not (need_x or need_v or need_b):
        return None, None, None, None
    gx, gv, gb = sparse24_linear_backward_op(grad_out, x, values, meta, [need_x, need_v, need_b])
    if need_b and gb.dtype != ctx.bias_dtype:
        gb = gb.to(ctx.bias_dtype)
    return (gx if need_x else None), (gv if need_v else None), None, (gb if need_b else None)


def _linear_double_backward(ctx, grad_out):
    """The backward as a differentiable graph (create_graph=True): the gradients of the reference recomputed from the
    saved x, values and meta; the bias only adds (its gradient, the row sum of grad_out, is linear)."""
    x, values, meta = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx, gv, _, _ = grad_of(_linear_reference, (x, values, meta, None), (need[0], need[1]), (grad_out,))
    acc = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
    gb = grad_out.reshape(-1, values.shape[0]).sum(0, dtype=acc).to(ctx.bias_dtype) if need[3] else None
    return gx, gv, None, gb


register_autograd(sparse24_linear_op, _linear_backward, _linear_setup_context, double_backward=_linear_double_backward)


register_autocast_rule("sparse24_linear")


# ------------------------------------------------------------------------------------------------ public API
def mask_2_4(w: torch.Tensor) -> torch.Tensor:
    """The 2:4 magnitude mask of ``w [N, K]`` (bool, exactly 2 True in every group of 4 along K)."""
    return mask_2_4_op(w)


def compress_2_4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune ``w [N, K]`` to 2:4 by magnitude and compress it: ``(values [N, K/2], meta uint8 [N, ceil(K/8)])``."""
    return compress_2_4_op(w)


def decompress_2_4(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The dense ``[N, K]`` weight (zeros at the pruned positions) from ``compress_2_4``'s output."""
    return decompress_2_4_op(values, meta)


def sparse24_linear(
    x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ decompress_2_4(values, meta).T + bias`` reading only the kept half of the weight (fp32 accumulation)."""
    return sparse24_linear_op(x, values, meta, bias)


__all__ = [
    "compress_2_4",
    "decompress_2_4",
    "mask_2_4",
    "pack_mask",
    "sparse24_linear",
    "unpack_meta",
]
