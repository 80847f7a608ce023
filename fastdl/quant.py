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

from ._layers import find_layers, replace_layers
from ._recipe import note_conversion
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
    output head). Layers are matched as ``fastdl.convert`` matches them (exactly ``nn.Linear``: subclasses are left
    alone, see ``fastdl._layers``). Returns the converted model."""
    if mode not in MODES:
        raise ValueError(f"quantize_model: mode must be one of {MODES}, got {mode!r}")
    sites = find_layers(model, filter_fn=filter_fn, where="quantize_model")
    model = replace_layers(model, sites, lambda s: Int8Linear.from_linear(s.module, mode=mode, trainable=trainable))
    return note_conversion(model)


def freeze_model(model: nn.Module) -> nn.Module:
    """Replace every trainable ``Int8Linear`` by its inference form (``Int8Linear.freeze()``), in place."""
    sites = find_layers(model, types=(Int8Linear,), filter_fn=lambda name, m: m.trainable, where="freeze_model")
    return note_conversion(replace_layers(model, sites, lambda s: s.module.freeze()))
