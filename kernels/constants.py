"""Constants the Triton kernels share with the layers above them (no triton import: ``fastdl.ops`` imports this).

fastdl's Triton kernels (this folder, installed as ``fastdl.kernels``; one module per capability) import nothing of
``fastdl``: the op definitions in ``fastdl/ops/`` import what they share with the kernels from here.
"""

# The activations of fused_linear, in kernel-code order: the position is the code the Triton kernels take (C++ and
# CUDA: csrc/activation.h, same order). fastdl/ops/fused_linear.py maps each name to its PyTorch function.
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")

# k per group scale of int8_weight_only_linear (fixed: the kernels step through K in 16s).
WEIGHT_GROUP = 16
