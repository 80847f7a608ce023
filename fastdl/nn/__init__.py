"""Drop-in replacements for ``nn.Linear`` that call fastdl's ops."""

from ._base import DENSE_COPY_FREE_BYTES, CheckpointError, decode_extra_state
from .fused_linear import FusedActivation, FusedLinear
from .int4 import Int4Linear
from .int8 import Int8Linear
from .sparse24 import Sparse24Linear

__all__ = [
    "DENSE_COPY_FREE_BYTES", "CheckpointError", "FusedActivation", "FusedLinear", "Int4Linear", "Int8Linear",
    "Sparse24Linear", "decode_extra_state",
]
