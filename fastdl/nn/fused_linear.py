"""``FusedLinear``: ``nn.Linear`` followed by an activation (and optionally a residual add), in one kernel."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.fused_linear import activation_fn, activation_module, check_activation
from ..runtime_choice import RuntimeChoice
from ._base import check_dtype_arg, check_input, raise_input_error


class FusedActivation(nn.Identity):
    """What ``fastdl.convert`` leaves where an activation module was fused into the preceding ``FusedLinear``: an
    identity (no parameters: the state dict keys do not move) that records which activation it stands for."""

    def __init__(self, activation: str = "none") -> None:
        super().__init__()
        self.activation = activation

    def recipe(self) -> dict:
        return {"activation": self.activation}

    def extra_repr(self) -> str:
        return f"{self.activation!r}, fused into the preceding FusedLinear"


class FusedLinear(RuntimeChoice, nn.Module):
    """Drop-in for ``nn.Linear(in_features, out_features, bias)`` followed by ``activation``.

    Same parameters (``weight [out, in]``, ``bias [out]``), the same initialisation and the same ``state_dict`` keys
    as ``nn.Linear``, so an ``nn.Linear`` checkpoint loads as is. ``forward(x, residual=None)`` computes
    ``act(x @ weight.T + bias) + residual`` with the epilogue fused into the GEMM. Under ``torch.autocast`` the
    weights stay fp32 (master weights) and the kernel rounds them on the fly.

    activation: ``"none" | "relu" | "gelu" | "gelu_tanh" | "silu"`` ("gelu" is the exact erf form).

    Paths, chosen per bucket of input rows (``fastdl.runtime_choice``): ``"fused"`` (``fastdl.ops.fused_linear``, the
    default) or ``"aten"`` (``F.linear`` + the activation (+ residual) in PyTorch: what the original layer computed;
    offered when the weight, bias and residual have x's dtype, i.e. not for fp32 master weights with bf16 inputs).
    ``runtime_choice = False`` pins the fused path.
    """

    __constants__ = ["in_features", "out_features", "activation"]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str = "gelu",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_activation(activation)
        check_dtype_arg("FusedLinear", dtype)
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._init_choice()

    def reset_parameters(self) -> None:
        """The initialisation of ``nn.Linear`` (kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        try:
            k = self.in_features
            key = ((x.numel() // k if k else 0).bit_length(), x.dtype, residual is not None)
            path = self._choice_local.get(key) or self._choose(x, key, residual)
            if path == "fused":
                # weight and bias from _parameters: through nn.Module.__getattr__ they cost ~1.2 us each, which
                # shows at M = 1 (AMD EPYC Zen 2)
                p = self._parameters
                return ops.fused_linear(x, p["weight"], p.get("bias"), self.activation, residual)
            return self._run_path(path, x, residual)
        except Exception as exc:  # an x this layer cannot take: the layer's own error (no cost on calls that work)
            raise_input_error(self, x, exc)
            raise

    # ------------------------------------------------------------------------ run-time choice (fastdl.runtime_choice)
    def _choice_layer(self) -> tuple:
        return ("FusedLinear", self.in_features, self.out_features, self.bias is not None, self.activation)

    def _choice_key(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple:
        k = self.in_features
        return ((x.numel() // k if k else 0).bit_length(), x.dtype, residual is not None)

    def _choice_default(self, x, residual=None) -> str:
        return "fused"

    def _choice_paths(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[str, ...]:
        check_input(self, x)  # the first call at a bucket: no decision is kept for an input the layer rejects
        w, b, dt = self.weight, self.bias, x.dtype
        if (w.dtype != dt or (b is not None and b.dtype != dt) or x.is_meta
                or (residual is not None and (residual.dtype != dt
                                              or residual.shape != (*x.shape[:-1], self.out_features)))):
            return ("fused",)  # the fused op casts (or names the problem); F.linear would not do the same
        return ("fused", "aten")

    def _run_path(self, path: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if path == "fused":
            return ops.fused_linear(x, self.weight, self.bias, self.activation, residual)
        out = F.linear(x, self.weight, self.bias)
        inplace = not out.requires_grad
        if self.activation == "relu" and inplace:  # in place where autograd does not need the pre-activation
            out = torch.relu_(out)
        elif self.activation == "silu" and inplace:
            out = F.silu(out, inplace=True)
        else:
            out = activation_fn(out, self.activation)
        if residual is not None:
            out = out.add_(residual) if inplace else out + residual
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"activation={self.activation!r}"
        )

    def recipe(self) -> dict:
        """How to rebuild this layer from an ``nn.Linear`` of its shape (``fastdl.save``/``load`` use it)."""
        return {"activation": self.activation}

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "none") -> FusedLinear:
        """Wrap an existing ``nn.Linear`` (its parameters are shared, not copied) and fuse ``activation``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FusedLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        check_activation(activation)
        mod.in_features, mod.out_features, mod.activation = linear.in_features, linear.out_features, activation
        mod.weight = linear.weight
        if linear.bias is not None:
            mod.bias = linear.bias
        else:
            mod.register_parameter("bias", None)
        mod._init_choice()
        return mod

    def _apply(self, fn, recurse=True):  # .to() / .half(): decisions are per device and dtype
        self._choice_reset()
        return super()._apply(fn, recurse)

    def to_linear(self) -> nn.Module:
        """The plain PyTorch equivalent sharing the parameters: ``nn.Linear``, or ``nn.Sequential(Linear, act)``."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        act = activation_module(self.activation)
        return lin if act is None else nn.Sequential(lin, act)
