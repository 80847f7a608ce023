"""User-facing int8 quantization helpers.

    q, scale = fastdl.quant.quantize_per_channel(linear.weight)      # int8 [N, K], fp32 [N]
    w = fastdl.quant.dequantize(q, scale)                             # fp32 [N, K]
    model = fastdl.quant.quantize_model(model, mode="dynamic")        # nn.Linear -> Int8Linear, in place
    model = fastdl.quant.quantize_model(model, trainable=True)        # QAT: prepare (fp32 master weights)
    ...train (DDP works unchanged)...
    model.eval()                                                      # serves int8 inference as is
    model = fastdl.quant.freeze_model(model)                          # optional: drop the master weights
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .nn.int8 import MODES, Int8Linear
from .ops.int8 import quantize_per_channel, quantize_per_group, quantize_per_token

__all__ = [
    "dequantize",
    "freeze_model",
    "quantize_model",
    "quantize_per_channel",
    "quantize_per_group",
    "quantize_per_token",
]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[..., None]`` in ``dtype``: the inverse of ``quantize_per_token``/``quantize_per_channel`` up to the
    rounding error (at most half a quantization step, ``scale / 2``, per element)."""
    if q.dtype != torch.int8:
        raise ValueError(f"dequantize: q must be int8, got {q.dtype}")
    if tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"dequantize: scale must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got "
                         f"{tuple(scale.shape)}")  # fmt: skip
    return (q.float() * scale.float()[..., None]).to(dtype)


def quantize_model(
    model: nn.Module,
    mode: str = "dynamic",
    trainable: bool = False,
    filter_fn: Callable[[str, nn.Linear], bool] | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place; also ``model`` itself) by ``Int8Linear.from_linear``.

    mode: ``"dynamic"`` (W8A8) or ``"weight_only"``; trainable: keep fp32 master weights for quantization-aware
    training; filter_fn(qualified_name, linear) -> bool: convert only the layers it accepts (e.g. skip the
    output head). Returns the converted model."""
    if mode not in MODES:
        raise ValueError(f"quantize_model: mode must be one of {MODES}, got {mode!r}")
    if type(model) is nn.Linear:
        if filter_fn is None or filter_fn("", model):
            return Int8Linear.from_linear(model, mode=mode, trainable=trainable)
        return model
    for name, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            qual = f"{name}.{cname}" if name else cname
            if type(sub) is nn.Linear and (filter_fn is None or filter_fn(qual, sub)):
                setattr(child, cname, Int8Linear.from_linear(sub, mode=mode, trainable=trainable))
    return model


def freeze_model(model: nn.Module) -> nn.Module:
    """Replace every trainable ``Int8Linear`` by its inference form (``Int8Linear.freeze()``), in place."""
    if isinstance(model, Int8Linear):
        return model.freeze()
    for _, child in list(model.named_modules()):
        for cname, sub in list(child.named_children()):
            if isinstance(sub, Int8Linear) and sub.trainable:
                setattr(child, cname, sub.freeze())
    return model
