"""Argument checks shared by the linear ops (``int8``, ``int4``, ``sparse24``): the activation ``x``, a vector of
``n`` values (scales, bias) and a tensor that must be on another's device, with the error conventions of
``fastdl/ops/_library.py`` (TypeError for a dtype, ValueError for a shape, RuntimeError for a device). Every message
names the op (``fn``), the argument, what it must be and what it got."""

from __future__ import annotations

import torch

from ._library import require, require_device, require_dtype

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_x(fn: str, x: torch.Tensor, dtypes: tuple, accepted: str) -> None:
    """``x [..., K]``: one of ``dtypes`` (``accepted`` says which, in words), at least 1-D."""
    require_dtype(x.dtype in dtypes, lambda: f"{fn}: x must be {accepted}, got dtype {x.dtype}")
    require(x.dim() >= 1, lambda: f"{fn}: x must have at least 1 dimension [..., K], got a 0-dim tensor")


def check_same_device(fn: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "x") -> None:
    require_device(
        t.device == ref.device,
        lambda: f"{fn}: {name} must be on the same device as {ref_name} ({ref.device}), got {t.device}",
    )


def check_vector(fn: str, name: str, t: torch.Tensor, n: int, ref: torch.Tensor, what: str = "N",
                 fp32: bool = False, ref_name: str = "x") -> None:  # fmt: skip
    """``t [n]`` (``what`` names n: ``[N] = [n]``) on ``ref``'s device: float32 when ``fp32`` (scales), else any float
    dtype (a bias)."""
    if fp32:
        require_dtype(t.dtype == torch.float32, lambda: f"{fn}: {name} must be float32, got dtype {t.dtype}")
    else:
        require_dtype(t.dtype in FLOAT_DTYPES, lambda: f"{fn}: {name} must be a floating tensor, got dtype {t.dtype}")
    require(
        t.dim() == 1 and t.shape[0] == n,
        lambda: f"{fn}: {name} must have shape [{what}] = [{n}], got {tuple(t.shape)}",
    )
    check_same_device(fn, name, t, ref, ref_name)
