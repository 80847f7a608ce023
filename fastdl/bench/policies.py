"""How the model benchmarks apply a policy to a model (shared by bench/model.py and bench/decode.py)."""

from __future__ import annotations

import torch
from torch import nn


def convert_in_place(policy: str, m: nn.Module, example_inputs=None, decoder: bool = False):
    """(model, autocast?) for ``policy``, converting ``m`` itself (no copy; fp32 and bf16_autocast return it as is,
    bf16 casts its weights to bfloat16)."""
    import fastdl
    from fastdl import sparsity

    if policy in ("fp32", "bf16_autocast"):
        return m, policy == "bf16_autocast"
    if policy == "bf16":
        return m.to(torch.bfloat16), False
    if policy == "compile":
        if decoder:
            m.forward = torch.compile(m.forward)  # generate() calls self(...): compile the forward it runs
            return m, False
        return torch.compile(m), False
    if policy in ("fused", "int8", "int8_weight_only", "int4", "int4_weight_only"):
        return fastdl.convert(m, policy), False
    if policy == "sparse24":
        sparsity.prune(m, filter_fn=lambda name, mod: not name.endswith("lm_head"))
        return sparsity.sparsify(m), False
    if policy == "auto":
        return fastdl.convert(m, "auto", workload=example_inputs), False
    raise ValueError(f"unknown policy {policy!r}")
