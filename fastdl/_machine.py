"""Facts about this machine that the timing of layers needs (the benchmarks use them too): the last-level cache's
size, and a way to evict it, so that a layer can be timed with its weights cold, as a model's forward pass leaves
them when its weights together exceed the cache."""

from __future__ import annotations

import os

import torch

_EVICT: dict[str, torch.Tensor] = {}


def llc_bytes() -> int | None:
    """Bytes of last-level cache of all the CPUs together (Linux sysfs: the highest cache level's size times the number
    of distinct groups of CPUs sharing one, e.g. 8 x 32 MiB on a 64-core EPYC with 8 CCDs); None when unknown."""
    base = "/sys/devices/system/cpu"
    found: dict[tuple, int] = {}  # (level, shared cpu list) -> bytes
    try:
        cpus = [d for d in os.listdir(base) if d.startswith("cpu") and d[3:].isdigit()]
    except OSError:
        return None
    for cpu in cpus:
        cache = os.path.join(base, cpu, "cache")
        try:
            entries = [e for e in os.listdir(cache) if e.startswith("index")]
        except OSError:
            continue
        for e in entries:
            try:
                with open(os.path.join(cache, e, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(cache, e, "size")) as f:
                    size = f.read().strip()
                with open(os.path.join(cache, e, "shared_cpu_list")) as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
            try:
                found[(level, shared)] = int(size.rstrip("KMGkmg")) * mult
            except ValueError:
                continue
    if not found:
        return None
    top = max(level for level, _ in found)
    return sum(b for (level, _), b in found.items() if level == top)


def evict_cpu_caches() -> None:
    """Read a buffer of twice the last-level cache (allocated once, 64 MiB when the size is unknown): what a layer
    reads next comes from DRAM, as after the other layers of a model too large for the cache."""
    buf = _EVICT.get("cpu")
    if buf is None:
        buf = _EVICT["cpu"] = torch.ones((2 * (llc_bytes() or (32 << 20))) // 4)
    buf.sum()
