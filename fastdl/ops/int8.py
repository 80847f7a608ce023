"""int8 quantized GEMM: per-token quantization, VNNI weight packing, W8A8 and weight-only int8 linear, and the
quantization-aware-training (QAT) linear.

Ops (schemas below; every backend implements exactly these semantics, bit for bit where stated):

``quantize_per_token(x) -> (q, scale)``
    Symmetric per-row int8 quantization of ``x [..., K]`` (float32/bfloat16/float16, any strides). Per row:
    ``amax = max |x|`` in fp32; a row holding NaN/Inf gets ``scale = NaN`` and ``q = 0``; a zero row ``scale = 0``
    and ``q = 0``; else ``inv = 127 / amax`` (one IEEE fp32 division), ``q = clamp(rint(x * inv), -127, 127)``
    (one fp32 multiply, round half to even) and ``scale = amax / 127`` (IEEE fp32 division). ``q`` is int8
    ``[..., K]`` contiguous, ``scale`` float32 ``x.shape[:-1]``. (Where ``127 / amax`` overflows - amax below
    ~3.7e-37 - a zero ``x`` gives ``0 * inf = NaN``, which is quantized to 0.)
``int8_pack_weight(w_q) -> (packed, comp)``
    The VNNI layout of the C++ CPU kernels: ``[Np/16][Kp/4][16][4]`` bytes (Np = roundup(N, 16),
    Kp = roundup(K, 4), zero padding) and ``comp[n] = 128 * sum_k w_q[n, k]`` (int32, the compensation of the
    unsigned-activation trick of ``vpdpbusd``). CPU-only consumers; other backends ignore packed arguments.
``int8_mm(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp)``
    ``acc = a_q @ b_q.T`` exactly in int32; ``out_dtype=torch.int32`` returns ``acc``; otherwise
    ``out = cast(((float(acc) * a_scale[m]) * b_scale[n]) + bias[n])`` in fp32, in this order, fused in the GEMM
    epilogue (no int32 ``[M, N]`` tensor for float outputs).
``int8_linear(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8)``
    Dynamic W8A8: quantize ``x`` per token, int8 GEMM, dequantize + bias; output ``[..., N]`` in ``x.dtype``.
    ``act_bits=7`` (opt-in) quantizes each row to 7-bit unsigned codes with a zero point instead, as fbgemm's
    ``reduce_range``: ``lo = min(0, min x)``, ``hi = max(0, max x)``, ``range = hi - lo`` (fp32), ``inv = 127 /
    range``, ``scale = range / 127`` (IEEE fp32 divisions), ``z = clamp(rint(-lo * inv), 0, 127)``, ``q =
    clamp(rint(x * inv) + z, 0, 127)``, and the GEMM runs on ``a = q - z`` (in [-127, 127]) exactly in int32, with
    ``scale`` as the row's scale. A row holding NaN/Inf, or whose range overflows fp32, gives NaN; a row whose range
    is 0 or below ~3.7e-37 (``inv`` not finite) quantizes to 0. The step is ``range / 127`` instead of ``amax / 127``
    (up to twice as coarse for a row of both signs, as fine for a one-signed row such as a post-ReLU one); on CPUs
    without AVX512-VNNI the GEMM then takes the codes directly (vpmaddubsw pairs of a 7-bit code cannot saturate).
``int8_weight_only_linear(x, w_q, w_scale, bias, w_group_scale=None)``
    ``out = w_scale[n] * sum_k x[m, k] * d[n, k] + bias[n]``: activations stay float, int8 weights are converted
    inside the kernel, fp32 accumulation, output in ``x.dtype``. ``d = w_q`` (per-channel scales), or with the
    optional group scales ``w_group_scale`` (uint8 ``[N, ceil(K / 16)]``) ``d[n, k] = w_q[n, k] *
    w_group_scale[n, k // 16]``: an integer with ``|d| <= 127 * 255``, exact in fp32. Kernels given a 16-bit ``x``
    may round ``d`` to ``x.dtype`` before the multiply (the CPU bf16 and the Triton kernels do: the precision of a
    bf16 GEMM on the dequantized weight); fp32 ``x`` multiplies the exact ``d`` (on CUDA in the precision
    PyTorch's fp32 matmul uses: TF32 when ``torch.backends.cuda.matmul.allow_tf32`` is set).
``quantize_per_group(w, search=True)`` (plain PyTorch, not an op: it runs once per model)
    The two-level format above: ``w_scale[n] = amax_n / (127 * 255)`` and an 8-bit code per group of 16 k (after
    the sub-block scales of llama.cpp's k-quants), so the group's step is ``code * w_scale[n]``: 8.5 bits per weight
    for the accuracy of 16-element groups with fp32 scales.
``int8_linear_qat(x, weight, bias, weight_only)``
    Quantization-aware training: the forward quantizes the float (master) ``weight`` per output channel and runs
    ``int8_linear`` (or ``int8_weight_only_linear``); the backward is the straight-through estimator in the float
    dtype (``grad_x = g @ W``, ``grad_W = g^T @ x`` accumulated in fp32 into the master weight's dtype,
    ``grad_b = sum g``), computed by ``fused_linear_backward``.

A packed weight may stand in for the plain one: when ``w_packed`` is given, ``w_q`` may be a stride-0 placeholder of
shape ``[N, K]`` (``torch.empty((), dtype=torch.int8).expand(N, K)``), so that a CPU ``Int8Linear`` holds its
weight once (packed). Kernels that use the packed weight never read ``w_q``'s data; the others unpack it.

``int8_linear`` and ``int8_weight_only_linear`` are differentiable in ``x`` and ``bias`` (straight through the
activation quantization, ``grad_x = g @ dequant(W)``), so gradients flow through frozen int8 layers (e.g. adapters
trained on top of a quantized model). Under ``torch.autocast`` they (and ``int8_linear_qat``) run in the autocast
dtype; weights and scales are never cast.
"""

from __future__ import annotations

import torch

from . import _frozen_linear as _frozen
from ._frozen_linear import rows as _rows
from ._int8_checks import check_linear, check_mm, check_pack, check_qat, check_quantize, check_weight_only
from ._int8_formats import (  # the formats and their exact formulas in PyTorch
    WEIGHT_GROUP,  # noqa: F401  (re-exported: fastdl.nn.int8 reads it here)
    dequant_reference,
    group_count,  # noqa: F401  (re-exported)
    grouped_weight,
    int32_acc_reference,
    pack_reference,
    packed_shape,
    plain_weight,
    quantize_per_group,
    quantize_rows_reference,
    quantize_rows_u7_reference,
    unpack_reference,  # noqa: F401  (re-exported)
)
from ._library import (
    define,
    grad_of,
    has_cpp_kernel,
    register_autocast_rule,
    register_autograd,
)
from .fused_linear import fused_linear_backward_op

__all__ = [
    "int8_linear",
    "int8_linear_qat",
    "int8_mm",
    "int8_pack_weight",
    "int8_weight_only_linear",
    "quantize_per_channel",
    "quantize_per_group",
    "quantize_per_token",
]


QUANTIZE_SCHEMA = "(Tensor x) -> (Tensor, Tensor)"
PACK_SCHEMA = "(Tensor w_q) -> (Tensor, Tensor)"
MM_SCHEMA = (
    "(Tensor a_q, Tensor b_q, Tensor a_scale, Tensor b_scale, Tensor? bias, ScalarType out_dtype, "
    "Tensor? b_packed, Tensor? b_comp) -> Tensor"
)
LINEAR_SCHEMA = (
    "(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? w_packed, Tensor? w_comp, int act_bits=8) -> Tensor"
)
WEIGHT_ONLY_SCHEMA = "(Tensor x, Tensor w_q, Tensor w_scale, Tensor? bias, Tensor? w_group_scale=None) -> Tensor"
QAT_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias, bool weight_only=False) -> Tensor"


# ------------------------------------------------------------------------------------------- quantize_per_token
def _quantize_fake(x):
    check_quantize(x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _quantize_reference(x):
    q, s = quantize_rows_reference(_rows(x))
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


quantize_per_token_op = define("quantize_per_token", QUANTIZE_SCHEMA, reference=_quantize_reference,
                               fake=_quantize_fake, check=check_quantize, cuda=("cpp", "triton", "torch"),
                               triton="int8:quantize_per_token")  # fmt: skip


# --------------------------------------------------------------------------------------------- int8_pack_weight
def _pack_fake(w_q):
    check_pack(w_q)
    Np, Kp = packed_shape(w_q.shape[0], w_q.shape[1])
    return w_q.new_empty((Np, Kp), dtype=torch.int8), w_q.new_empty((Np,), dtype=torch.int32)


def _pack_reference(w_q):
    return pack_reference(w_q)


int8_pack_weight_op = define("int8_pack_weight", PACK_SCHEMA, reference=_pack_reference, fake=_pack_fake,
                             check=check_pack)  # fmt: skip


# ---------------------------------------------------------------------------------------------------- int8_mm
def _mm_fake(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp):
    M, _, N = check_mm(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp)
    return a_q.new_empty((M, N), dtype=out_dtype)


def _mm_reference(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp):
    acc = int32_acc_reference(a_q, plain_weight(b_q, b_packed))
    if out_dtype == torch.int32:
        return acc
    return dequant_reference(acc, a_scale, b_scale, bias, out_dtype)


int8_mm_op = define("int8_mm", MM_SCHEMA, reference=_mm_reference, fake=_mm_fake, check=check_mm,
                    cuda=("triton", "cpp", "torch"), triton="int8:int8_mm")  # fmt: skip


# ------------------------------------------------------------------------------------------------ int8_linear
def _linear_fake(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8):
    _, N = check_linear(x, w_q, w_scale, bias, w_packed, w_comp, act_bits)
    return x.new_empty((*x.shape[:-1], N))


def _linear_reference(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8):
    N = w_q.shape[0]
    q, s = (quantize_rows_u7_reference if act_bits == 7 else quantize_rows_reference)(_rows(x))
    acc = int32_acc_reference(q, plain_weight(w_q, w_packed))
    return dequant_reference(acc, s, w_scale, bias, x.dtype).reshape(*x.shape[:-1], N)


def _linear_supports(backend, args):
    if backend == "triton" and len(args) > 6 and args[6] == 7:
        return "the 7-bit activation mode (act_bits=7) has no Triton kernel (GPUs multiply int8 exactly)"
    return None


int8_linear_op = define("int8_linear", LINEAR_SCHEMA, reference=_linear_reference, fake=_linear_fake,
                        check=check_linear, supports=_linear_supports, cuda=("triton", "cpp", "torch"),
                        triton="int8:int8_linear")  # fmt: skip


def has_cpu_kernel() -> bool:
    """True when fastdl's C++ kernel serves int8_linear on the CPU: only then is a VNNI-packed weight
    (``int8_pack_weight``) worth holding, since no other backend reads it."""
    return has_cpp_kernel("int8_linear", "cpu")


# ------------------------------------------------------------------------------------ int8_weight_only_linear
def _weight_only_fake(x, w_q, w_scale, bias, w_group_scale=None):
    _, N = check_weight_only(x, w_q, w_scale, bias, w_group_scale)
    return x.new_empty((*x.shape[:-1], N))


def _weight_only_reference(x, w_q, w_scale, bias, w_group_scale=None):
    N = w_q.shape[0]
    acc = torch.matmul(_rows(x).float(), grouped_weight(w_q, w_group_scale).t())  # fp32 accumulation
    out = acc * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


int8_weight_only_linear_op = define("int8_weight_only_linear", WEIGHT_ONLY_SCHEMA, reference=_weight_only_reference,
                                    fake=_weight_only_fake, check=check_weight_only, cuda=("triton", "cpp", "torch"),
                                    triton="int8:int8_weight_only_linear")  # fmt: skip


# --------------------------------------------------------------- autograd of the inference ops (x and bias only)
def _frozen_setup_context(ctx, inputs, output, grouped=False):
    x, w_q, w_scale, bias = inputs[:4]
    extra = inputs[4] if len(inputs) > 4 else None  # int8_linear: w_packed; weight-only: w_group_scale
    # (int8_linear's act_bits changes only the quantization of x, through which the gradient passes straight)
    _frozen.save_context(ctx, x, bias, (w_q, w_scale, extra), grouped=grouped)


def _frozen_backward(ctx, grad_out):
    """Straight through the activation quantization: grad_x = g @ dequant(W) in x's dtype, grad_bias = sum g."""
    w_q, w_scale, extra = ctx.saved_tensors

    def times_weight(g, ct):
        c = ctx.x_dtype
        w = grouped_weight(w_q, extra) if ctx.grouped else plain_weight(w_q, extra)
        return torch.matmul((g.to(ct) * w_scale.float()[None, :]).to(c), w.to(c))

    return _frozen.grads(ctx, grad_out, 3, times_weight)


def _straight_through(value: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """``value`` (computed without gradient) carrying the derivative of ``surrogate`` (same shape and dtype): the
    straight-through estimator as differentiable torch ops. ``surrogate - surrogate.detach()`` is exactly 0, so the
    value is ``value``'s (a -0 becomes +0)."""
    return value.detach() + (surrogate - surrogate.detach())


def _frozen_surrogate(x, w_q, w_scale, bias, extra, grouped):
    """``(x @ d.T) * w_scale + bias`` in fp32, rounded to x's dtype (d: the int8 weight, with its group scales): the
    function whose derivative ``_frozen_backward`` computes (in x and bias; the weight side is detached)."""
    N = w_q.shape[0]
    w = grouped_weight(w_q, extra) if grouped else plain_weight(w_q, extra).float()
    out = torch.matmul(_rows(x).float(), w.t()) * w_scale.detach().float()[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], N)


def _linear_differentiable(x, w_q, w_scale, bias, w_packed, w_comp, act_bits=8):
    """int8_linear under torch.func transforms and forward AD: the reference's value (the activations quantized)
    with the documented straight-through derivative in x and bias."""
    detached_bias = None if bias is None else bias.detach()
    value = _linear_reference(x.detach(), w_q, w_scale, detached_bias, w_packed, w_comp, act_bits)
    return _straight_through(value, _frozen_surrogate(x, w_q, w_scale, bias, w_packed, grouped=False))


def _weight_only_differentiable(x, w_q, w_scale, bias, w_group_scale=None):
    """int8_weight_only_linear under transforms: the reference is differentiable (x is not quantized); w_scale is
    detached, as the op gives it no gradient."""
    return _weight_only_reference(x, w_q, w_scale.detach(), bias, w_group_scale)


# The backward is made of differentiable torch ops, linear in grad_out and independent of x: it is its own double
# backward (the second derivative in x is 0 under the straight-through estimator).
register_autograd(
    int8_linear_op,
    _frozen_backward,
    _frozen_setup_context,
    double_backward=_frozen_backward,
    differentiable=_linear_differentiable,
)
register_autograd(
    int8_weight_only_linear_op,
    _frozen_backward,
    lambda ctx, inputs, output: _frozen_setup_context(ctx, inputs, output, grouped=True),
    double_backward=_frozen_backward,
    differentiable=_weight_only_differentiable,
)


# ------------------------------------------------------------------------------------------------ QAT linear
# Routed like the others: the C++ CPU kernel quantizes the master weight and runs int8_linear in one call (W8A8 only);
# the reference composes the routed ops above (so every backend serves it: Triton on CUDA). Its backward is
# fused_linear_backward (routed as well).
def _qat_fake(x, weight, bias, weight_only=False):
    _, N = check_qat(x, weight, bias)
    return x.new_empty((*x.shape[:-1], N))


def _qat_reference(x, weight, bias, weight_only=False):
    if weight_only:  # the group-wise format of Int8Linear(mode="weight_only"), without the search (every step)
        w_q, w_scale, w_group = quantize_per_group(weight, search=False)
        return int8_weight_only_linear_op(x, w_q, w_scale, bias, w_group)
    w_q, w_scale = quantize_per_token_op(weight)  # per output channel, from the master weight
    return int8_linear_op(x, w_q, w_scale, bias, None, None)


def _qat_supports(backend, args):
    if backend == "cpp" and len(args) > 3 and args[3]:
        return "the weight-only QAT forward (group scales) is the composite of the routed ops"
    return None


# cpp_autograd=True: csrc/int8_autograd.cpp
int8_linear_qat_op = define("int8_linear_qat", QAT_SCHEMA, reference=_qat_reference, fake=_qat_fake,
                            check=lambda x, weight, bias, weight_only=False: check_qat(x, weight, bias),
                            supports=_qat_supports, cpp_autograd=True)  # fmt: skip


def _qat_setup_context(ctx, inputs, output):
    x, weight, bias = inputs[:3]
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.save_for_backward(x, weight, bias)  # bias ([N]): only the double backward reads it


def _qat_backward(ctx, grad_out):
    """Straight-through estimator in the float dtype: the quantizers are treated as the identity."""
    x, weight, _ = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    gx = gw = gb = None
    if need_x or need_w or need_b:
        empty = torch.empty(0, dtype=x.dtype, device=x.device)
        gx, gw, gb = fused_linear_backward_op(grad_out.contiguous(), x, weight, empty, "none", [need_x, need_w, need_b])
        gx = gx if need_x else None
        gw = gw if need_w else None
        gb = gb.to(ctx.bias_dtype) if need_b else None
    return gx, gw, gb, None


def _qat_surrogate(x, weight, bias, weight_only=False):
    """The float linear whose derivative is the straight-through estimator of ``_qat_backward``: ``x @ W.T + bias``
    with W rounded to x's dtype, fp32 accumulation, rounded to x's dtype (fused_linear_backward's formulas)."""
    c = x.dtype
    out = torch.matmul(_rows(x).float(), weight.to(c).float().t())
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(c).reshape(*x.shape[:-1], weight.shape[0])


def _qat_differentiable(x, weight, bias, weight_only=False):
    """int8_linear_qat under torch.func transforms and forward AD: the quantized forward's value with the
    straight-through derivative in x, weight and bias."""
    value = _qat_reference(x.detach(), weight.detach(), None if bias is None else bias.detach(), weight_only)
    return _straight_through(value, _qat_surrogate(x, weight, bias))


def _qat_double_backward(ctx, grad_out):
    """The straight-through gradients as a differentiable graph (create_graph=True), from the saved inputs."""
    x, weight, bias = ctx.saved_tensors
    gx, gw, gb, _ = grad_of(_qat_surrogate, (x, weight, bias, False), ctx.needs_input_grad[:3], (grad_out,))
    return gx, gw, gb, None


register_autograd(
    int8_linear_qat_op,
    _qat_backward,
    _qat_setup_context,
    double_backward=_qat_double_backward,
    differentiable=_qat_differentiable,
)


# --------------------------------------------------------------------------------------------------- autocast
for _name in ("int8_linear", "int8_weight_only_linear", "int8_linear_qat"):
    register_autocast_rule(_name)


# ------------------------------------------------------------------------------------------------- public API
def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of ``x [..., K]``: returns ``(q int8 [..., K], scale fp32 [...])``
    with ``x ~= q * scale[..., None]``. Round half to even, clamp to [-127, 127]; a zero row has scale 0, a row with
    NaN/Inf has scale NaN (and q = 0)."""
    return quantize_per_token_op(x)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel int8 quantization of a weight ``[N, K]`` (float32/bfloat16/float16): ``(w_q, w_scale)``
    with ``w ~= w_q * w_scale[:, None]``; the same formula as ``quantize_per_token`` applied to each row."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_channel: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    return quantize_per_token_op(w)


def int8_pack_weight(w_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack an int8 weight ``[N, K]`` into the VNNI layout of the C++ CPU kernels: ``(packed [Np, Kp] int8,
    comp [Np] int32)``. Do it once (at model load), then pass both to ``int8_mm`` / ``int8_linear`` on the CPU."""
    return int8_pack_weight_op(w_q)


def int8_mm(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    b_packed: torch.Tensor | None = None,
    b_comp: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a_q @ b_q.T) * a_scale[:, None] * b_scale[None, :] + bias`` with exact int32 accumulation and the dequant
    fused in the epilogue. a_q ``[M, K]`` int8, b_q ``[N, K]`` int8, scales fp32; ``out_dtype=torch.int32`` returns
    the raw accumulator. ``b_packed, b_comp = int8_pack_weight(b_q)`` speed up the CPU kernel."""
    return int8_mm_op(a_q, b_q, a_scale, b_scale, bias, out_dtype, b_packed, b_comp)


def int8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    w_packed: torch.Tensor | None = None,
    w_comp: torch.Tensor | None = None,
    act_bits: int = 8,
) -> torch.Tensor:
    """Dynamic W8A8 linear: ``x [..., K]`` is quantized per token on the fly, multiplied with the int8 weight
    ``w_q [N, K]`` (per-channel scales ``w_scale [N]``) in int32, dequantized (+ bias) in the epilogue; returns
    ``[..., N]`` in x's dtype. A NaN/Inf in a row of x gives NaN in that output row only. ``act_bits=7``: 7-bit
    unsigned activations with a zero point per row (fbgemm's ``reduce_range``; the module docstring has the
    formula), faster on CPUs without AVX512-VNNI, the int32 products still exact."""
    return int8_linear_op(x, w_q, w_scale, bias, w_packed, w_comp, act_bits)


def int8_weight_only_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    w_group_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only int8 linear: ``x @ (w_q * w_scale[:, None]).T + bias`` with the weight converted inside the kernel
    (fp32 accumulation); returns ``[..., N]`` in x's dtype. With ``w_group_scale`` (from ``quantize_per_group``) the
    weight is ``w_q * w_group_scale[:, k // 16] * w_scale[:, None]``."""
    return int8_weight_only_linear_op(x, w_q, w_scale, bias, w_group_scale)


def int8_linear_qat(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, weight_only: bool = False
) -> torch.Tensor:
    """Quantization-aware linear for training: the forward is ``int8_linear`` (``int8_weight_only_linear`` when
    ``weight_only``) on the per-channel quantized ``weight``; the backward is straight-through in the float dtype to
    the (fp32 master) weight. Differentiable in x, weight and bias."""
    return int8_linear_qat_op(x, weight, bias, weight_only)
