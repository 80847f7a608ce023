"""The DRAM read bandwidth of the machine a benchmark runs on, as PyTorch sees it (``dram_read_bandwidth``): the
ceiling against which ``fastdl bench int4`` and ``fastdl bench model --decoder`` judge a memory-bound call (the
last-level cache's size, ``llc_bytes``, is in ``fastdl._machine``)."""

from __future__ import annotations

import statistics
import time

import torch

from .._machine import llc_bytes


def dram_read_bandwidth(nbytes: int | None = None, passes: int = 7, max_s: float = 1.5) -> float:
    """The memory's read bandwidth in GB/s (1e9 bytes/s) as PyTorch's own code sees it: ``torch.sum`` of an fp32
    buffer far larger than the last-level cache, run with all the threads PyTorch uses (``torch.get_num_threads()``),
    reads each byte once from DRAM (a vectorised reduction: on an AVX2 Zen 3 one core alone sums at ~27 GB/s, so the
    memory, not the arithmetic, bounds it). The buffer is written once first (an untouched page would be read as
    the kernel's shared zero page, from the cache) and summed once untimed (page tables, thread start); then the
    median of ``passes`` timed sums (fewer when one takes longer than ``max_s`` / ``passes``).

    ``nbytes``: the buffer's size (default: 8x the last-level cache of all CPUs, at least 512 MiB and at most
    1 GiB; a small buffer measures the caches instead). It is the ceiling against which a decode step that streams
    every weight once is judged (``fastdl bench model --decoder tinyllama``); on a busy machine, with threads
    waiting for the scheduler, it is lower than the hardware's. Takes ~0.2-0.5 s with 512 MiB at 20-40 GB/s."""
    if nbytes is None:
        llc = llc_bytes() or (32 << 20)
        nbytes = min(max(8 * llc, 512 << 20), 1 << 30)
    if not isinstance(nbytes, int) or nbytes < 4:
        raise ValueError(f"dram_read_bandwidth: nbytes must be an int >= 4, got {nbytes!r}")
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"dram_read_bandwidth: passes must be an int >= 1, got {passes!r}")
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    t0 = time.perf_counter()
    buf.sum()
    first = time.perf_counter() - t0
    passes = max(1, min(passes, int(max_s / max(first, 1e-9))))
    times = []
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / max(statistics.median(times), 1e-9) / 1e9
