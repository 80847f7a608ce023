"""Argument checks of the int8 ops (``fastdl.ops.int8``): one per op, run by its fake kernel and before every
backend but C++ (which checks for itself), with the error conventions of ``fastdl/ops/_library.py``."""

from __future__ import annotations

import torch

from ._checks import check_same_device, check_vector, check_x
from ._int8_formats import WEIGHT_GROUP, group_count, packed_shape
from ._library import require, require_dtype

_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)


def _check_x(fn, x):
    check_x(fn, x, _X_DTYPES, "float32, bfloat16 or float16")


def _check_int8_2d(fn, name, t, shape_doc):
    require_dtype(t.dtype == torch.int8, lambda: f"{fn}: {name} must be int8, got dtype {t.dtype}")
    require(t.dim() == 2, lambda: f"{fn}: {name} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")


def _check_packed(fn, packed, comp, N, K, ref, names=("w_packed", "w_comp")):
    pn, cn = names
    require(
        (packed is None) == (comp is None),
        lambda: f"{fn}: {pn} and {cn} must be given together (both from int8_pack_weight) or both be None",
    )
    if packed is None:
        return
    Np, Kp = packed_shape(N, K)
    require_dtype(packed.dtype == torch.int8, lambda: f"{fn}: {pn} must be int8, got dtype {packed.dtype}")
    require(
        packed.dim() == 2 and packed.shape[0] == Np and packed.shape[1] == Kp,
        lambda: f"{fn}: {pn} must have shape [roundup(N, 16), roundup(K, 4)] = [{Np}, {Kp}] "
        f"(from int8_pack_weight), got {tuple(packed.shape)}",
    )
    require_dtype(comp.dtype == torch.int32, lambda: f"{fn}: {cn} must be int32, got dtype {comp.dtype}")
    require(
        comp.dim() == 1 and comp.shape[0] == Np,
        lambda: f"{fn}: {cn} must have shape [roundup(N, 16)] = [{Np}], got {tuple(comp.shape)}",
    )
    check_same_device(fn, pn, packed, ref, "the weight")
    check_same_device(fn, cn, comp, ref, "the weight")


def _check_weight(fn, x, w_q, w_scale, bias, name="w_q", scale_name="w_scale"):
    """Checks shared by int8_linear and int8_weight_only_linear; returns (K, N)."""
    _check_x(fn, x)
    _check_int8_2d(fn, name, w_q, "[N, K]")
    K, N = x.shape[-1], w_q.shape[0]
    require(
        w_q.shape[1] == K,
        lambda: f"{fn}: {name} must have shape [N, K] with K = x.shape[-1] = {K}, got {tuple(w_q.shape)} "
        "(mismatched K)",
    )
    check_same_device(fn, name, w_q, x, "x")
    check_vector(fn, scale_name, w_scale, N, x, fp32=True)
    if bias is not None:
        check_vector(fn, "bias", bias, N, x)
    return K, N


def check_quantize(x):
    _check_x("quantize_per_token", x)


def check_pack(w_q):
    _check_int8_2d("int8_pack_weight", "w_q", w_q, "[N, K]")


def check_mm(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp):
    fn = "int8_mm"
    _check_int8_2d(fn, "a_q", a_q, "[M, K]")
    _check_int8_2d(fn, "b_q", b_q, "[N, K]")
    M, K, N = a_q.shape[0], a_q.shape[1], b_q.shape[0]
    require(
        b_q.shape[1] == K,
        lambda: f"{fn}: b_q must have shape [N, K] with K = a_q.shape[1] = {K}, got {tuple(b_q.shape)} (mismatched K)",
    )
    check_same_device(fn, "b_q", b_q, a_q, "a_q")
    require_dtype(
        out_dtype in _OUT_DTYPES,
        lambda: f"{fn}: out_dtype must be one of float32, bfloat16, float16, int32, got {out_dtype}",
    )
    check_vector(fn, "a_scale", a_scale, M, a_q, "M", fp32=True, ref_name="a_q")
    check_vector(fn, "b_scale", b_scale, N, a_q, fp32=True, ref_name="a_q")
    if bias is not None:
        check_vector(fn, "bias", bias, N, a_q, ref_name="a_q")
    _check_packed(fn, b_packed, b_comp, N, K, b_q, names=("b_packed", "b_comp"))
    return M, K, N


def check_linear(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8):
    K, N = _check_weight("int8_linear", x, w_q, w_scale, bias)
    _check_packed("int8_linear", w_packed, w_comp, N, K, w_q)
    require(
        type(act_bits) is int and act_bits in (7, 8),
        lambda: f"int8_linear: act_bits must be 8 or 7, got {act_bits!r}",
    )
    return K, N


def check_weight_only(x, w_q, w_scale, bias, w_group_scale=None):
    fn = "int8_weight_only_linear"
    K, N = _check_weight(fn, x, w_q, w_scale, bias)
    if w_group_scale is not None:
        G = group_count(K)
        require_dtype(
            w_group_scale.dtype == torch.uint8,
            lambda: f"{fn}: w_group_scale must be uint8 (from quantize_per_group), got dtype {w_group_scale.dtype}",
        )
        require(
            w_group_scale.dim() == 2 and w_group_scale.shape[0] == N and w_group_scale.shape[1] == G,
            lambda: f"{fn}: w_group_scale must have shape [N, ceil(K / {WEIGHT_GROUP})] = [{N}, {G}], "
            f"got {tuple(w_group_scale.shape)}",
        )
        check_same_device(fn, "w_group_scale", w_group_scale, x, "x")
    return K, N


def check_qat(x, weight, bias):
    fn = "int8_linear_qat"
    _check_x(fn, x)
    require(
        weight.dim() == 2, lambda: f"{fn}: weight must be 2-D [N, K], got shape {tuple(weight.shape)}"
    )
    require_dtype(
        weight.dtype == x.dtype or weight.dtype == torch.float32,
        lambda: f"{fn}: weight (the float master weight) must have x's dtype ({x.dtype}) or float32, "
        f"got {weight.dtype}",
    )
    K, N = x.shape[-1], weight.shape[0]
    require(
        weight.shape[1] == K,
        lambda: f"{fn}: weight must have shape [N, K] with K = x.shape[-1] = {K}, got {tuple(weight.shape)} "
        "(mismatched K)",
    )
    check_same_device(fn, "weight", weight, x, "x")
    if bias is not None:
        check_vector(fn, "bias", bias, N, x)
    return K, N
