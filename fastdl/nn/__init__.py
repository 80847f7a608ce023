"""Drop-in replacements for ``nn.Linear`` that call fastdl's ops."""

from .fused_linear import FusedLinear
from .int8 import Int8Linear
from .sparse24 import Sparse24Linear

__all__ = ["FusedLinear", "Int8Linear", "Sparse24Linear"]
