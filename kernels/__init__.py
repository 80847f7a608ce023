"""Triton kernels of fastdl, installed as the sub-package ``fastdl.kernels``.

One module per capability (``fused_linear``, ...). Each exposes launchers that check their inputs, allocate the
outputs and launch; they are called by the op router in ``fastdl.ops`` and never import ``fastdl`` themselves.
Importing this package does not import triton.
"""
