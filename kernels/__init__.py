"""Triton kernels of fastdl, installed as the sub-package ``fastdl.kernels``.

One module per capability (``fused_linear``, ...). Each exposes launchers that check their inputs, allocate the
outputs and launch; they are called by the op router in ``fastdl.ops`` and import nothing of ``fastdl`` but its op
definitions (``fastdl.ops``: e.g. the one activation list).
Importing this package does not import triton.
"""
