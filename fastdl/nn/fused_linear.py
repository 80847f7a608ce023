"""``FusedLinear``: ``nn.Linear`` followed by an activation (and optionally a residual add), in one kernel."""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import ops
from ..ops.fused_linear import check_activation

_ACT_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


def activation_module(activation: str) -> nn.Module | None:
    """The stock PyTorch module computing ``activation`` (None for 'none')."""
    if activation == "none":
        return None
    if activation == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    return _ACT_MODULES[activation]()


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


class FusedLinear(nn.Module):
    """Drop-in for ``nn.Linear(in_features, out_features, bias)`` followed by ``activation``.

    Same parameters (``weight [out, in]``, ``bias [out]``), the same initialisation and the same ``state_dict`` keys
    as ``nn.Linear``, so an ``nn.Linear`` checkpoint loads as is. ``forward(x, residual=None)`` computes
    ``act(x @ weight.T + bias) + residual`` with the epilogue fused into the GEMM. Under ``torch.autocast`` the
    weights stay fp32 (master weights) and the kernel rounds them on the fly.

    activation: ``"none" | "relu" | "gelu" | "gelu_tanh" | "silu"`` ("gelu" is the exact erf form).
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

    def reset_parameters(self) -> None:
        """The initialisation of ``nn.Linear`` (kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return ops.fused_linear(x, self.weight, self.bias, self.activation, residual)

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
        return mod

    def to_linear(self) -> nn.Module:
        """The plain PyTorch equivalent sharing the parameters: ``nn.Linear``, or ``nn.Sequential(Linear, act)``."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        act = activation_module(self.activation)
        return lin if act is None else nn.Sequential(lin, act)
