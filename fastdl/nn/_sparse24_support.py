"""Helpers of ``fastdl.nn.Sparse24Linear`` (fastdl/nn/sparse24.py): the compressed weight's ops on any device
(shapes only on the meta device), the meta check, and which CUDA semi-structured sparse tensor can hold the weight."""

from __future__ import annotations

import torch

from ..ops import sparse24 as sp_ops


def _compress(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``compress_2_4(w)`` of a checked floating ``[out, in]`` weight; a weight without data (meta device: how large
    models are built before their checkpoint is loaded) or without elements gets tensors of the right shapes only."""
    if w.is_meta or w.numel() == 0:
        N, K = w.shape
        return w.new_empty((N, K // 2)), w.new_empty((N, (K + 7) // 8), dtype=torch.uint8)
    return sp_ops.compress_2_4(w)


def _decompress(values: torch.Tensor, meta: torch.Tensor, K: int) -> torch.Tensor:
    """``decompress_2_4(values, meta)``: the dense ``[out, in]`` weight (shapes only on the meta device)."""
    if values.numel() == 0:
        return values.reshape(values.shape[0], K)  # differentiable, any device
    if values.is_meta:
        return values.new_empty((values.shape[0], K))
    return sp_ops.decompress_2_4(values, meta)


def _meta_is_valid(meta: torch.Tensor, K: int) -> bool:
    """Every 4-bit group of ``meta`` (uint8 ``[N, ceil(K/8)]``) keeps exactly 2 positions, and the unused high
    nibble of the last byte (K % 8 == 4) is 0: what ``compress_2_4`` writes and the kernels assume."""
    if meta.numel() == 0 or meta.is_meta:
        return True
    two_bits = torch.zeros(16, dtype=torch.bool, device=meta.device)
    two_bits[[3, 5, 6, 9, 10, 12]] = True
    m = meta.long()
    lo, hi = two_bits[m & 15], two_bits[m >> 4]
    if K % 8:
        hi[:, -1] = (meta[:, -1] >> 4) == 0
    return bool(lo.all()) and bool(hi.all())


def semi_structured_support(weight_shape, dtype: torch.dtype, device: torch.device) -> tuple[type | None, str]:
    """Which ``SparseSemiStructuredTensor`` class can hold a ``[out, in]`` weight of ``dtype`` on ``device``.

    Returns (class, "") or (None, reason). cuSPARSELt when available (fp16/bf16/int8), else CUTLASS.
    """
    if device.type != "cuda":
        return None, f"the semi-structured path is CUDA-only (device {device})"
    try:
        from torch.sparse import (
            SparseSemiStructuredTensor,
            SparseSemiStructuredTensorCUSPARSELT,
            SparseSemiStructuredTensorCUTLASS,
        )
    except ImportError as exc:  # very old torch
        return None, f"torch.sparse has no semi-structured support ({exc})"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return None, f"compute capability {major}.{minor} < 8.0 (2:4 sparse tensor cores need Ampere or newer)"
    use_cutlass = bool(getattr(SparseSemiStructuredTensor, "_FORCE_CUTLASS", False))
    if not use_cutlass:
        try:
            use_cutlass = not torch.backends.cusparselt.is_available()
        except AttributeError:
            use_cutlass = True
    cls = SparseSemiStructuredTensorCUTLASS if use_cutlass else SparseSemiStructuredTensorCUSPARSELT
    constraints = getattr(cls, "_DTYPE_SHAPE_CONSTRAINTS", {})
    if dtype not in constraints:
        return None, f"{cls.__name__} does not take {dtype} (takes {', '.join(map(str, constraints))})"
    c = constraints[dtype]
    rows, cols = weight_shape
    if rows < c.sparse_min_rows or rows % c.sparse_min_rows or cols < c.sparse_min_cols or cols % c.sparse_min_cols:
        return None, (
            f"{cls.__name__} needs out_features and in_features to be multiples of ({c.sparse_min_rows}, "
            f"{c.sparse_min_cols}) for {dtype}, got ({rows}, {cols})"
        )
    return cls, ""


def _semi_tensors(semi) -> list[torch.Tensor]:
    out = []
    for name in ("packed", "meta", "packed_t", "meta_t", "compressed_swizzled_bitmask"):
        t = getattr(semi, name, None)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out
