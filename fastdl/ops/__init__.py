"""fastdl ops: the one place each op is defined (schema, fake kernel, autograd, reference, backend routing).

One module per capability, named like its kernels (csrc/cpu/<name>.cpp, csrc/cuda/<name>.cu, kernels/<name>.py):
fused_linear, int8, int4, sparse24, loader (the host copies of ``fastdl.data.PrefetchLoader``).
The raw ops are ``torch.ops.fastdl.<name>``; the functions here are their Python wrappers.
"""

from ._library import SCHEMAS
from .fused_linear import ACTIVATIONS, activation, fused_linear
from .int4 import (
    dequantize_int4,
    import_awq,
    import_gptq,
    int4_a8_linear,
    int4_weight_only_linear,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from .int8 import (
    int8_linear,
    int8_linear_qat,
    int8_mm,
    int8_pack_weight,
    int8_weight_only_linear,
    quantize_per_channel,
    quantize_per_group,
    quantize_per_token,
)
from .loader import loader_fill, loader_use_count
from .sparse24 import compress_2_4, decompress_2_4, mask_2_4, pack_mask, sparse24_linear, unpack_meta

__all__ = [
    "ACTIVATIONS",
    "SCHEMAS",
    "activation",
    "compress_2_4",
    "decompress_2_4",
    "dequantize_int4",
    "fused_linear",
    "import_awq",
    "import_gptq",
    "int4_a8_linear",
    "int4_weight_only_linear",
    "int8_linear",
    "int8_linear_qat",
    "int8_mm",
    "int8_pack_weight",
    "int8_weight_only_linear",
    "loader_fill",
    "loader_use_count",
    "mask_2_4",
    "pack_int4",
    "pack_mask",
    "quantize_int4",
    "quantize_per_channel",
    "quantize_per_group",
    "quantize_per_token",
    "sparse24_linear",
    "unpack_int4",
    "unpack_meta",
]
