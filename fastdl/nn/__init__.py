"""Drop-in replacements for ``nn.Linear`` that call fastdl's ops."""

from .fused_linear import FusedLinear

__all__ = ["FusedLinear"]
