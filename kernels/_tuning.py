"""What fastdl's Triton kernel modules share to choose their launch configurations: the device's limits (cached
per device), the config lists (the interpreter's own small list when TRITON_INTERPRET=1) and the pruning rule
(fit in shared memory, keep a per-thread register estimate under the limit above which ptxas spills, prefer the
tiles of the caller's band). Each kernel module keeps its own tile lists, register estimates and limits, with the
ptxas figures behind them."""

from __future__ import annotations

import functools
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def max_smem(device_index: int) -> int:
    try:
        props = torch.cuda.get_device_properties(device_index)
        return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)
    except Exception:  # no CUDA (interpreter, the AOT test's fake tensors) or an old torch: do not prune
        return 1 << 30


@functools.cache
def capability_major(device_index: int) -> int:
    try:
        return int(torch.cuda.get_device_capability(device_index)[0])
    except Exception:
        return 0


@functools.cache
def num_sms(device_index: int) -> int:
    try:
        return int(torch.cuda.get_device_properties(device_index).multi_processor_count)
    except Exception:
        return 1


def device_index(where: torch.Tensor | torch.device) -> int:
    """The CUDA device index of a tensor or a device (the current device for a bare ``cuda``)."""
    device = where.device if isinstance(where, torch.Tensor) else where
    return device.index if device.index is not None else torch.cuda.current_device()


def device_major(t: torch.Tensor) -> int:
    """The compute capability's major number of t's CUDA device (0 off CUDA)."""
    return capability_major(device_index(t)) if t.device.type == "cuda" else 0


def configs(tiles, interp_tiles, names: tuple[str, ...], group: int | None = None) -> list:
    """``triton.Config`` per tile ``(*values of names, num_warps, num_stages)``, with ``GROUP`` when given; the
    interpreter's tiles under TRITON_INTERPRET=1 (it runs programs one after another: few, mid-sized tiles)."""
    extra = {} if group is None else {"GROUP": group}
    return [
        triton.Config({**dict(zip(names, t[:-2])), **extra}, num_warps=t[-2], num_stages=t[-1])
        for t in (interp_tiles if INTERPRET else tiles)
    ]


def tile(c) -> tuple:
    """A GEMM config as its tile tuple ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``."""
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)


def prune(configs, t: torch.Tensor, smem_of, regs_of, reg_limit, prefer=None, allow=None) -> list:
    """Keep the configs whose pipelined operand buffers (``smem_of``, bytes) fit in t's device's shared memory,
    whose per-thread register estimate (``regs_of``) stays at most ``reg_limit`` and that ``allow`` accepts (when
    given: a kernel's own limit, e.g. fused_linear's FMA K depth); of those, the ones ``prefer``
    accepts if any (e.g. the tiles that suit M; fewer candidates also means less autotuning). Off CUDA only
    ``prefer`` applies. Always keeps at least one config (the lightest); pruning is an optimisation only and never
    breaks a launch."""
    if len(configs) <= 1:
        return configs

    def preferred(cs):
        return ([c for c in cs if prefer(c)] or cs) if prefer is not None else cs

    if t.device.type != "cuda":
        return preferred(configs)
    try:
        limit = max_smem(device_index(t))
        fitting = [c for c in configs if smem_of(c) <= limit]
        if not fitting:
            return [min(configs, key=smem_of)]
        light = [c for c in fitting if regs_of(c) <= reg_limit and (allow is None or allow(c))]
        return preferred(light) if light else [min(fitting, key=regs_of)]
    except Exception:
        return configs
