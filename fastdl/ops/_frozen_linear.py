"""Autograd of the inference linear ops (``int8_linear``, ``int8_weight_only_linear``, the int4 ops): the weight is
frozen, so the backward gives ``grad_x = g @ W`` (straight through any activation quantization) and
``grad_bias = sum g``, and nothing for the weight. Each op supplies how to multiply ``g`` by its weight; the
bookkeeping (shapes, dtypes, which inputs want a gradient) is here, once."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t [..., K]`` as ``[M, K]`` (``reshape(-1, K)`` is ambiguous when K == 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def save_context(ctx, x: torch.Tensor, bias: torch.Tensor | None, saved: tuple, **attrs) -> None:
    """Record x's shape and dtype, bias's dtype and ``attrs`` on ``ctx``; save the weight tensors ``saved``."""
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None
    for name, value in attrs.items():
        setattr(ctx, name, value)
    ctx.save_for_backward(*saved)


def grads(ctx, grad_out: torch.Tensor, bias_index: int, times_weight: Callable) -> tuple:
    """The gradients of all inputs: ``times_weight(g, compute_dtype)`` (``g [M, N]`` times the weight, ``[M, K]``)
    for x at index 0, ``sum g`` for the bias at ``bias_index``, None elsewhere. Computed in fp32 (fp64 for float64
    x), rounded to x's / bias's dtype."""
    g = rows(grad_out)
    out = [None] * len(ctx.needs_input_grad)
    ct = torch.float64 if ctx.x_dtype == torch.float64 else torch.float32
    if ctx.needs_input_grad[0]:
        out[0] = times_weight(g, ct).to(ctx.x_dtype).reshape(ctx.x_shape)
    if ctx.needs_input_grad[bias_index]:
        out[bias_index] = g.to(ct).sum(0).to(ctx.bias_dtype)
    return tuple(out)
