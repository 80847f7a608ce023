"""Helpers of ``fastdl.nn.Int8Linear`` (fastdl/nn/int8.py): its modes and group sizes, the argument checks, and the
weight's quantization / dequantization."""

from __future__ import annotations

import torch

from ..ops import int8 as int8_ops

MODES = ("dynamic", "weight_only")
FORMAT = "fastdl.Int8Linear"
FORMAT_VERSION = 3  # 3: the extra state is a JSON uint8 tensor (2: a dict; 1: no group scales)
GROUP_SIZES = (int8_ops.WEIGHT_GROUP, None)
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the int8 ops take (and the layer's forward)
_QUANT_DOC = {
    None: "symmetric per-channel int8, scale = amax / 127",
    int8_ops.WEIGHT_GROUP: "symmetric int8, per-channel fp32 scale amax / (127 * 255) times a uint8 code per group "
    "of 16 input features",
}


# The Int8Linear of each int8 conversion policy (fastdl.convert and the Hugging Face quantizer build from it).
POLICY_ARGS = {
    "int8": {"mode": "dynamic"},
    "int8_weight_only": {"mode": "weight_only"},
    "int8_act7": {"mode": "dynamic", "act_bits": 7},
}


def policy_of(mode: str, act_bits: int) -> str:
    """The conversion policy an Int8Linear of this mode and act_bits is made by (the inverse of POLICY_ARGS)."""
    return "int8_weight_only" if mode == "weight_only" else "int8_act7" if act_bits == 7 else "int8"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"Int8Linear: mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")


def _check_act_bits(act_bits, mode: str, trainable: bool) -> int:
    """8 (exact 8-bit activations), or 7 (the opt-in 7-bit mode of ``int8_linear``) for dynamic inference layers."""
    if type(act_bits) is not int or act_bits not in (7, 8):
        raise ValueError(f"Int8Linear: act_bits must be 8 or 7, got {act_bits!r}")
    if act_bits == 7 and (mode != "dynamic" or trainable):
        raise ValueError(
            "Int8Linear: act_bits=7 quantizes the activations of mode='dynamic' inference layers; this layer is "
            f"mode={mode!r}, trainable={trainable} (QAT trains with 8-bit activations; freeze() first)"
        )
    return act_bits


def _resolve_group_size(mode: str, group_size, trainable: bool):
    """``"auto"``: 16 for weight-only layers, per-channel (None) for W8A8, whose int32 GEMM needs one scale per
    output channel."""
    if group_size == "auto":
        return int8_ops.WEIGHT_GROUP if mode == "weight_only" else None
    if group_size not in GROUP_SIZES:
        raise ValueError(f"Int8Linear: group_size must be 16, None (per-channel scales) or 'auto', got {group_size!r}")
    if group_size is not None and mode != "weight_only":
        raise ValueError(
            "Int8Linear: group_size=16 needs mode='weight_only' (W8A8's int32 GEMM uses one scale per output "
            "channel); use group_size=None or 'auto'"
        )
    if group_size is None and mode == "weight_only" and trainable:
        raise ValueError(
            "Int8Linear: a trainable weight-only layer trains with group scales (int8_linear_qat); use group_size=16 "
            "or 'auto'"
        )
    return group_size


def _quantize_weight(w: torch.Tensor, group_size=None, search: bool = True):
    """(w_q, w_scale, w_group_scale or None) of a float weight [out, in]. Trainable layers quantize without the
    search (``search=False``), exactly as their training forward does."""
    w = w.detach()
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        w = w.float()
    with torch.no_grad():
        if group_size is not None:
            return int8_ops.quantize_per_group(w, search=search)
        q, s = int8_ops.quantize_per_token_op(w)  # per output channel
        return q, s, None


def _dequantize(q, s, g) -> torch.Tensor:
    return int8_ops.grouped_weight(q, g) * s.float()[:, None]


def _cpu_packing_available() -> bool:
    """The packed weight is worth holding only when a kernel that reads it serves int8_linear on the CPU."""
    return int8_ops.has_cpu_kernel()
