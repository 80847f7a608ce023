"""Fused mixed-precision linear: ``y = act(x @ weight.T + bias) + residual``, forward and backward.

Semantics (every backend implements exactly this):
  * compute dtype ``c = x.dtype`` (float32, bfloat16, float16; float64 on the reference path);
  * ``weight`` is ``[N, K]`` in ``c`` or float32 (fp32 master weights with low-precision activations, as under
    autocast): a float32 weight is rounded to ``c`` before the product, exactly as autocast would;
  * the product accumulates in fp32; bias, activation and residual are applied to the fp32 accumulator and the
    result is rounded to ``c`` once;
  * in training the op also returns the pre-activation (rounded to ``c``) so the backward can apply the
    activation derivative fused with the bias-gradient reduction, without recomputing the GEMM.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.constants import ACTIVATIONS as KERNEL_ACTIVATIONS
from ._library import (
    define,
    grad_of,
    has_cpp_kernel,
    register_autocast_rule,
    register_autograd,
    require,
    require_device,
    require_dtype,
)

# The activations of fused_linear, defined once for Python (C++ and CUDA: csrc/activation.h, in the same order: the
# position is the code the Triton kernels take). name -> (the PyTorch function, the module computing it).
_ACTIVATION_TABLE = {
    "none": (lambda x: x, None),
    "relu": (F.relu, nn.ReLU),
    "gelu": (F.gelu, nn.GELU),  # the exact erf form
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), functools.partial(nn.GELU, approximate="tanh")),
    "silu": (F.silu, nn.SiLU),
}
ACTIVATIONS = tuple(_ACTIVATION_TABLE)
assert ACTIVATIONS == KERNEL_ACTIVATIONS, "the activation table and the kernels' codes (kernels/constants.py) differ"
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

SCHEMA = (
    "(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual, bool save_preact) -> (Tensor, Tensor)"
)
BACKWARD_SCHEMA = (
    "(Tensor grad_out, Tensor x, Tensor weight, Tensor preact, str activation, bool[3] output_mask) "
    "-> (Tensor, Tensor, Tensor)"
)
ACTIVATION_SCHEMA = "(Tensor x, str activation) -> Tensor"
ACTIVATION_BACKWARD_SCHEMA = "(Tensor grad_out, Tensor x, str activation) -> Tensor"


# ----------------------------------------------------------------------------------------------- argument checks
def check_activation(activation: str, fn: str = "fused_linear") -> None:
    require(
        activation in ACTIVATIONS,
        lambda: f"{fn}: activation must be one of {', '.join(repr(a) for a in ACTIVATIONS)}, got {activation!r}",
    )


# The messages are those of the C++ kernels (csrc/cpu/fused_linear.cpp), which skip these checks: every backend reports
# a bad input with the same words and exception type (dtypes print as torch.float32 here, Float there).
def _check_optional(t, name, shape, x, fn) -> None:
    require_dtype(t.dtype in _FLOAT, lambda: f"{fn}: {name} must be a floating tensor, got dtype {t.dtype}")
    require_device(
        t.device == x.device, lambda: f"{fn}: {name} must be on device {x.device} (the device of x), got {t.device}"
    )
    require(tuple(t.shape) == tuple(shape), lambda: f"{fn}: {name} must have shape {list(shape)}, got {list(t.shape)}")


def check_args(x, weight, bias, activation, residual) -> tuple[int, int]:
    """Validate the forward arguments; returns (K, N). Shared by the fake kernel and the reference."""
    fn = "fused_linear"
    _check_x_weight(x, weight, activation, fn)
    K, N = x.shape[-1], weight.shape[0]
    if bias is not None:
        _check_optional(bias, "bias", (N,), x, fn)
    if residual is not None:
        _check_optional(residual, "residual", (*x.shape[:-1], N), x, fn)
    return K, N


def _check_x_weight(x, weight, activation, fn) -> None:
    """The checks the forward and the backward share: activation, x, weight."""
    check_activation(activation, fn)
    require(x.dim() >= 1, lambda: f"{fn}: x must have at least one dimension [..., K], got a 0-d tensor")
    require_dtype(
        x.dtype in _FLOAT,
        lambda: f"{fn}: x must be a floating tensor (float32, bfloat16, float16), got dtype {x.dtype}",
    )
    require(weight.dim() == 2, lambda: f"{fn}: weight must be 2-D [N, K], got shape {list(weight.shape)}")
    K = x.shape[-1]
    require(
        weight.shape[1] == K,
        lambda: f"{fn}: weight must have shape [N, K] with K = x.shape[-1] = {K}, got weight of shape "
        f"{list(weight.shape)} (mismatched K)",
    )
    require_dtype(
        weight.dtype == x.dtype or weight.dtype == torch.float32,
        lambda: f"{fn}: weight.dtype must be x.dtype ({x.dtype}) or float32, got {weight.dtype}",
    )
    require_device(
        weight.device == x.device,
        lambda: f"{fn}: weight must be on device {x.device} (the device of x), got {weight.device}",
    )


# -------------------------------------------------------------------------------------- activations (reference)
def activation_fn(x: torch.Tensor, activation: str) -> torch.Tensor:
    return _ACTIVATION_TABLE[activation][0](x)


def activation_module(activation: str) -> nn.Module | None:
    """The stock PyTorch module computing ``activation`` (None for 'none')."""
    module = _ACTIVATION_TABLE[activation][1]
    return None if module is None else module()


def activation_of(module: nn.Module) -> str | None:
    """The name of the activation a stock PyTorch module computes (None when it is not one of ACTIVATIONS)."""
    for name, (_, cls) in _ACTIVATION_TABLE.items():
        made = cls() if cls is not None else None
        if type(module) is type(made) and getattr(module, "approximate", None) == getattr(made, "approximate", None):
            return name
    return None


def activation_grad(p: torch.Tensor, activation: str) -> torch.Tensor:
    """d act / d p, evaluated in p's dtype (the reference uses fp32 or fp64)."""
    if activation == "relu":
        return (p > 0).to(p.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(p * (1.0 / math.sqrt(2.0))))
        return cdf + p * torch.exp(-0.5 * p * p) * (1.0 / math.sqrt(2.0 * math.pi))
    if activation == "gelu_tanh":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (p + 0.044715 * p**3))
        return 0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * p * p)
    if activation == "silu":
        s = torch.sigmoid(p)
        return s * (1.0 + p * (1.0 - s))
    return torch.ones_like(p)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(0, dtype=dtype or x.dtype, device=x.device)


# ------------------------------------------------------------------------------------------------ forward op
def _fake(x, weight, bias, activation, residual, save_preact):
    _, N = check_args(x, weight, bias, activation, residual)
    out = x.new_empty((*x.shape[:-1], N))
    preact = x.new_empty((*x.shape[:-1], N)) if save_preact and activation != "none" else _empty(x)
    return out, preact


def _reference(x, weight, bias, activation, residual, save_preact):
    """Pure-PyTorch reference: the contract above, written plainly (fp32 accumulation, one rounding)."""
    check_args(x, weight, bias, activation, residual)
    c, acc = x.dtype, _acc_dtype(x.dtype)
    pre = torch.matmul(x.to(acc), weight.to(c).to(acc).t())
    if bias is not None:
        pre = pre + bias.to(acc)
    out = activation_fn(pre, activation)
    if activation == "gelu" and acc != torch.float64:  # PyTorch's vectorized fp32 erf GELU gives NaN at +inf
        out = torch.where(pre == math.inf, pre, out)
    if residual is not None:
        out = out + residual.to(acc)
    preact = pre.to(c) if save_preact and activation != "none" else _empty(x)
    return out.to(c).contiguous(), preact


def _cpp_supports(backend: str, args) -> str | None:
    """Which valid inputs a backend cannot take (invalid ones reach the kernel, whose checks name the problem)."""
    x, weight = args[0], args[1]
    if backend == "triton" and x.dtype == torch.float64:
        return "the Triton kernel takes float32/bfloat16/float16, not float64"
    if backend == "triton" and x.device.type == "cpu" and torch.bfloat16 in (x.dtype, weight.dtype):
        return "bfloat16 is not supported by the Triton interpreter"
    if backend == "cpp" and x.dtype == torch.float64:
        return "float64 is served by the reference"
    return None


# cpp_autograd=True: csrc/fused_linear_autograd.cpp
fused_linear_op = define("fused_linear", SCHEMA, reference=_reference, fake=_fake,
                         check=lambda x, w, b, act, res, save: check_args(x, w, b, act, res), supports=_cpp_supports,
                         cuda=("triton", "cpp", "torch"), triton="fused_linear:fused_linear_fwd",
                         cpp_autograd=True)  # fmt: skip


def has_cpu_kernel() -> bool:
    """True when fastdl's C++ kernel serves fused_linear on the CPU. The run-time path candidates that go through
    fused_linear on the CPU (``Int8Linear``'s ``"dequant_fused"``, ``Sparse24Linear``'s ``"dense_fused"``: the
    dequantized or decompressed weight in fastdl's GEMM) are offered only then."""
    return has_cpp_kernel("fused_linear", "cpu")


# ----------------------------------------------------------------------------------------------- backward op
def _check_backward(grad_out, x, weight, preact, activation):
    fn = "fused_linear_backward"
    _check_x_weight(x, weight, activation, fn)
    out_shape = (*x.shape[:-1], weight.shape[0])
    _check_optional(grad_out, "grad_out", out_shape, x, fn)
    if activation != "none":
        require(
            tuple(preact.shape) == out_shape,
            lambda: f"{fn}: preact must have shape {list(out_shape)}, got {list(preact.shape)} (activation "
            f"{activation!r} needs it: call fused_linear with save_preact=True when gradients are needed)",
        )
        _check_optional(preact, "preact", out_shape, x, fn)


def _fake_backward(grad_out, x, weight, preact, activation, output_mask):
    _check_backward(grad_out, x, weight, preact, activation)
    gx = torch.empty_like(x, memory_format=torch.contiguous_format) if output_mask[0] else _empty(x)
    gw = weight.new_empty(weight.shape) if output_mask[1] else _empty(x, weight.dtype)
    gb = x.new_empty((weight.shape[0],), dtype=_acc_dtype(x.dtype)) if output_mask[2] else _empty(x, torch.float32)
    return gx, gw, gb


def _reference_backward(grad_out, x, weight, preact, activation, output_mask):
    _check_backward(grad_out, x, weight, preact, activation)
    c, acc = x.dtype, _acc_dtype(x.dtype)
    K, N = x.shape[-1], weight.shape[0]
    M = x.numel() // K if K else math.prod(x.shape[:-1])  # not reshape(-1, ...): N = 0 or K = 0 has no -1
    g = grad_out.reshape(M, N).to(acc)
    dpre = g if activation == "none" else g * activation_grad(preact.reshape(M, N).to(acc), activation)
    gb = dpre.sum(0) if output_mask[2] else _empty(x, acc)
    dpre_c = dpre.to(c).to(acc)
    gx = gw = None
    if output_mask[0]:
        gx = (dpre_c @ weight.to(c).to(acc)).to(c).reshape(x.shape)
    if output_mask[1]:
        gw = (dpre_c.t() @ x.reshape(M, K).to(acc)).to(weight.dtype)
    return (gx if gx is not None else _empty(x)), (gw if gw is not None else _empty(x, weight.dtype)), gb


fused_linear_backward_op = define("fused_linear_backward", BACKWARD_SCHEMA, reference=_reference_backward,
                                  fake=_fake_backward,
                                  check=lambda g, x, w, p, act, mask: _check_backward(g, x, w, p, act),
                                  supports=lambda backend, args: _cpp_supports(backend, (args[1], args[2])),
                                  cuda=("triton", "cpp", "torch"), triton="fused_linear:fused_linear_bwd")  # fmt: skip


# ----------------------------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, residual, save_preact = inputs
    _, preact = output
    ctx.activation = activation
    ctx.has_preact = bool(save_preact) and activation != "none"
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.save_for_backward(x, weight, preact, bias)  # bias ([N]): only the double backward reads it
    # preact is an internal output nobody differentiates: without this autograd would fill a zero [M, N] gradient
    # for it on every backward (0.36 ms per step at 4096 x 1024 on the CPU)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, _grad_preact):
    if grad_out is None:  # the output itself took no part in the loss
        return None, None, None, None, None, None
    x, weight, preact, _ = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    need_r = ctx.needs_input_grad[4]
    if ctx.activation != "none" and not ctx.has_preact and (need_x or need_w or need_b):
        raise RuntimeError(
            "fused_linear: gradients were requested but the op ran with save_preact=False; "
            "call fastdl.ops.fused_linear (which sets it) or pass save_preact=True"
        )
    gx = gw = gb = None
    if need_x or need_w or need_b:
        gx, gw, gb = fused_linear_backward_op(
            grad_out.contiguous(), x, weight, preact, ctx.activation, [need_x, need_w, need_b]
        )
        gx = gx if need_x else None
        gw = gw if need_w else None
        gb = gb.to(ctx.bias_dtype) if need_b else None
    gr = grad_out.to(ctx.residual_dtype) if need_r else None
    return gx, gw, gb, None, gr, None


def _double_backward(ctx, grad_out, _grad_preact):
    """The backward as a differentiable graph (create_graph=True): the gradients of the reference, recomputed from
    the saved x, weight and bias (the pre-activation, an output, is not differentiable). The residual only adds to
    the output: its gradient is grad_out, and it is not saved."""
    if grad_out is None:
        return None, None, None, None, None, None
    x, weight, _, bias = ctx.saved_tensors
    need = ctx.needs_input_grad
    gx, gw, gb = grad_of(_reference, (x, weight, bias, ctx.activation, None, False), need[:3], (grad_out, None))[:3]
    gr = grad_out.to(ctx.residual_dtype) if need[4] else None
    return gx, gw, gb, None, gr, None


register_autograd(fused_linear_op, _backward, _setup_context, double_backward=_double_backward)


register_autocast_rule("fused_linear")


# ------------------------------------------------------------------------------------------------ activation
# One of ACTIVATIONS on its own, for the layers whose kernels have no activation epilogue (Sparse24Linear): out =
# round(act(x)) and grad_x = round(grad_out * act'(x)), computed in fp32 (fp64 for float64 x), rounded once to x's
# dtype - what PyTorch's activation functions compute on the same tensor. The C++ kernels (csrc/cpu/activation.cpp)
# use fused_linear's epilogue and backward pass; ATen's GELU builds a oneDNN primitive per call, which dominates the
# small calls (the reason is at the C++ file).
def _check_act(x, activation, fn="activation"):
    check_activation(activation, fn)
    require_dtype(
        isinstance(x, torch.Tensor) and x.dtype in _FLOAT,
        lambda: f"{fn}: x must be a floating tensor (float32, bfloat16, float16, float64), got "
        f"{getattr(x, 'dtype', type(x).__name__)}",
    )


def _act_reference(x, activation):
    _check_act(x, activation)
    if activation == "none":
        return x.clone(memory_format=torch.contiguous_format)
    acc = _acc_dtype(x.dtype)
    return activation_fn(x.to(acc), activation).to(x.dtype)


def _act_fake(x, activation):
    _check_act(x, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_act_backward(grad_out, x, activation):
    fn = "activation_backward"
    _check_act(x, activation, fn)
    _check_optional(grad_out, "grad_out", tuple(x.shape), x, fn)


def _act_backward_reference(grad_out, x, activation):
    _check_act_backward(grad_out, x, activation)
    acc = _acc_dtype(x.dtype)
    g = grad_out.to(acc)
    return (g if activation == "none" else g * activation_grad(x.to(acc), activation)).to(x.dtype)


def _act_backward_fake(grad_out, x, activation):
    _check_act_backward(grad_out, x, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _act_cpp_supports(backend, x):
    if backend == "cpp" and x.dtype == torch.float64:
        return "float64 is served by the reference"
    return None


# cpp_autograd=True: csrc/activation_autograd.cpp. On CUDA the reference (PyTorch's activation functions).
activation_op = define("activation", ACTIVATION_SCHEMA, reference=_act_reference, fake=_act_fake, check=_check_act,
                       supports=lambda backend, args: _act_cpp_supports(backend, args[0]),
                       cpp_autograd=True)  # fmt: skip
activation_backward_op = define("activation_backward", ACTIVATION_BACKWARD_SCHEMA, reference=_act_backward_reference,
                                fake=_act_backward_fake, check=_check_act_backward,
                                supports=lambda backend, args: _act_cpp_supports(backend, args[1]))  # fmt: skip


def _act_setup_context(ctx, inputs, output):
    x, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(x)


def _act_backward(ctx, grad_out):
    if grad_out is None or not ctx.needs_input_grad[0]:
        return None, None
    (x,) = ctx.saved_tensors
    return activation_backward_op(grad_out.contiguous(), x, ctx.activation), None


def _act_double_backward(ctx, grad_out):
    if grad_out is None or not ctx.needs_input_grad[0]:
        return None, None
    (x,) = ctx.saved_tensors
    return grad_of(_act_reference, (x, ctx.activation), (True, False), (grad_out,))[0], None


register_autograd(activation_op, _act_backward, _act_setup_context, double_backward=_act_double_backward)
# Under autocast the op runs in x's dtype, as PyTorch's activation functions do (none is on autocast's CPU lists);
# the rule (casting nothing) keeps eager calls off the dispatcher's Python path.
register_autocast_rule("activation", cast=lambda args, dtype: args)


@functools.cache
def _act_on_cpu() -> bool:
    return has_cpp_kernel("activation", "cpu")


def apply_activation(out: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(out)`` as a layer applies it after a GEMM with no activation epilogue (Sparse24Linear): the activation
    op where its C++ kernel serves out's device (eager; fp32 / bf16 / fp16), else PyTorch's function, computing in
    fp32 for 16-bit dtypes (no no-op casts: ~4 us each at M = 1). The same values either way, up to PyTorch's and
    fastdl's fp32 rounding of the function itself. ``out`` for "none"."""
    if activation == "none":
        return out
    if out.device.type == "cpu" and out.dtype != torch.float64 and not torch.compiler.is_compiling() and _act_on_cpu():
        return activation_op(out, activation)
    if out.dtype in (torch.float32, torch.float64):
        return activation_fn(out, activation)
    return activation_fn(out.float(), activation).to(out.dtype)


def activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x)`` for one of ``ACTIVATIONS``, computed in fp32 and rounded once to x's dtype, differentiable in x:
    what ``torch.nn.functional`` computes, with fastdl's kernels on the CPU (fused_linear's epilogue) and PyTorch's on
    other devices. Returns a new contiguous tensor (also for "none")."""
    return activation_op(x, activation)


# ------------------------------------------------------------------------------------------------ public API
def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias) + residual`` in one kernel (fp32 accumulation, epilogue fused).

    x: ``[..., K]`` float32/bfloat16 (float16 on CUDA); weight: ``[N, K]`` in x's dtype or float32 (master weights);
    bias: ``[N]`` or None; activation: one of ``ACTIVATIONS`` ("gelu" is the erf form);
    residual: ``[..., N]`` or None (added after the activation). Returns ``[..., N]`` in x's dtype (under autocast,
    the autocast dtype). Differentiable in x, weight, bias and residual.
    """
    need_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    out, _ = fused_linear_op(x, weight, bias, activation, residual, bool(need_grad and activation != "none"))
    # The kernels compute [M, N] and return it reshaped to [..., N]: a view of a tensor nothing else holds. When it
    # takes part in autograd, hand out the same storage as a tensor that is not a view (no copy; ~2 us, so not for
    # inference calls), so that an in-place op on it is an ordinary one (FSDP2 warns about module outputs that are
    # views: an in-place op on one drops its pre-backward hook). Safe: the op does not save its output for backward.
    if out.requires_grad and not torch.compiler.is_compiling() and out._base is not None:
        out = torch.ops.aten._unsafe_view.default(out, out.shape)
    return out
