"""PrefetchLoader's host buffers and counters (part of ``fastdl.data``): the ring of reused host buffers a pass
stages its batches in, and the loader's telemetry, timed with the loader's one clock (``clock``, which reads this
module's ``time``: tests swap it for conftest's virtual clock, so that no test depends on how long anything took)."""

from __future__ import annotations

import threading
import time

import torch

from .ops.loader import loader_use_count

ALIGN = 256  # byte alignment of every tensor in a slot (GPU kernels want >= 16 B; 256 = CUDA allocator's min)


def clock() -> float:
    """Seconds, for every time the loader measures (wait, produce, copy, elapsed, timeout)."""
    return time.perf_counter()


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------------------------
# ring of host buffers


class RingCounters:
    """Allocations and replacements of a loader's ring slots, over every ring it made (not reset by reset_stats)."""

    def __init__(self):
        self.allocs = 0
        self.replaced = 0


class Ring:
    """``nslots`` uint8 host buffers, reused round-robin. A ring belongs to one pass at a time: only that pass's
    producer thread touches it while the pass runs (the consumer reads the counters). The loader keeps the ring of
    the last pass that ended for the next one."""

    def __init__(self, nslots: int, pinned: bool, max_slot_bytes: int, handed_out: bool, counters: RingCounters):
        self.slots: list[torch.Tensor | None] = [None] * nslots
        self.baseline = [0] * nslots
        self.events: list = [None] * nslots  # CUDA: event of the last device copy out of the slot
        self.pinned = pinned
        self.handed_out = handed_out  # CPU target: the consumer gets views of the slots
        self.max_slot_bytes = max_slot_bytes
        self.next = 0
        self.counters = counters  # the loader's totals over all its rings (ring_allocs, ring_replaced)

    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slots if s is not None)

    def _capacity(self, nbytes: int) -> int:
        if self.pinned:  # PyTorch's pinned allocator rounds to a power of two anyway
            cap = 1 << max(nbytes - 1, 1).bit_length()
        else:  # 1/8 headroom for batches of varying size, 64 KiB granularity
            cap = align(nbytes + nbytes // 8, 1 << 16)
        return max(nbytes, min(cap, self.max_slot_bytes))

    def acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        j = self.next
        self.next = (j + 1) % len(self.slots)
        ev = self.events[j]
        if ev is not None:  # the previous device copy out of this slot must be done before we overwrite it
            ev.synchronize()
            self.events[j] = None
        slot = self.slots[j]
        if slot is not None and self.handed_out:
            # CPU target: batches handed out are views of the slot; if the consumer still holds one, leave that
            # memory to it and allocate a new slot.
            if loader_use_count(slot) > self.baseline[j]:
                slot = None
                self.slots[j] = None
                self.counters.replaced += 1
        if slot is None or slot.numel() < nbytes:
            cap = self._capacity(max(nbytes, 0 if slot is None else slot.numel()))
            slot = self.slots[j] = None  # free the old buffer before allocating the new one
            slot = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pinned)
            self.counters.allocs += 1
            self.slots[j] = slot
            self.baseline[j] = loader_use_count(slot)
        return j, slot


# ----------------------------------------------------------------------------------------------------------------
# telemetry


class Stats:
    """Counters of a loader over all its passes. Passes may run at once (each with its own producer thread): the
    producers add under ``lock``; ``elapsed_s`` counts the wall time during which at least one pass ran."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0  # passes started and not yet ended
        self.reset()

    def pass_started(self) -> None:
        with self.lock:
            if self.running == 0:
                self.iter_start = clock()
            self.running += 1

    def pass_ended(self) -> None:
        with self.lock:
            self.running -= 1
            if self.running == 0 and self.iter_start is not None:
                self.elapsed_s += clock() - self.iter_start
                self.iter_start = None

    def reset(self):
        self.batches = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.copy_s = 0.0
        self.produce_s = 0.0
        self.h2d_s = 0.0
        self.h2d_bytes = 0
        self.elapsed_s = 0.0
        self.iter_start: float | None = None
        self.epochs = 0
        self.oversize = 0
