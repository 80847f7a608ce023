"""Prefetching loader: ``fastdl.data.PrefetchLoader`` wraps any loader and hides the host-to-device copy.

A background thread pulls batches from the wrapped iterable and copies their tensors into a ring of host buffers
that are allocated once and reused (grown only when a batch is larger, bounded by ``max_ring_bytes``). The copy is
done by the op ``fastdl.ops.loader_fill`` (defined in fastdl/ops/loader.py like every fastdl op): its C++ kernel
(csrc/cpu/loader.cpp) runs with the GIL released, so the Python consumer keeps running while it copies; the torch
backend does the same copy with ``Tensor.copy_`` (which also releases the GIL). The backend is chosen like every other
op's (``FASTDL_BACKEND``, ``fastdl.use_backend`` in the thread that starts a pass, or ``copy_backend=``), and
``loader.copy_backend`` says which one a pass uses. On a plain CPU target there is nothing to copy: the thread hands
the batches on as they are (mode "cpu" below).

Modes (``loader.mode``):

``"cuda-pinned"``    target is a CUDA device; the ring is page-locked (allocated by PyTorch's pinned host allocator).
                     Each batch is copied ring -> device with one ``non_blocking`` copy on a side CUDA stream that
                     lives as long as the loader; the consumer's current stream waits on that copy's event before the
                     batch is handed out, and ``record_stream`` keeps the caching allocator from reusing the device
                     memory before the consumer's stream is done with it. A ring slot is refilled only after its
                     previous copy finished (event). Tensors that are already pinned (e.g. from
                     ``DataLoader(pin_memory=True)``) skip the ring and are copied directly.
``"cuda-pageable"``  target is a CUDA device but the ring is not page-locked (``pin_memory=False``, or pinning
                     failed): same flow, the device copy is then synchronous with respect to the producer thread.
``"cpu"``            target is the CPU (the default without CUDA) and nothing asks for a copy: pass-through. The
                     producer thread runs the wrapped loader ``depth`` batches ahead of the consumer (so loading done
                     in this process overlaps the consumer's step) and hands each batch on as the wrapped loader made
                     it: the same objects, not copied, not detached, no ring (``ring_slots`` 0, ``copy_s`` 0). What
                     this costs over iterating the wrapped loader directly is one queue hand-off per batch. Every
                     guarantee about passes holds as in the other modes (independent passes, nothing lost on
                     ``break``, resume, timeout, errors with their traceback); the guarantees that come from the
                     copy do not apply: batches are not detached, aliasing is preserved, and a leaf the loader could
                     not move (a dataclass holding tensors) is handed out as it is, not refused (nothing is moved).
``"cpu-staged"``     target is the CPU and ``stage=True``: the batch handed out consists of views into a ring slot
                     (contiguous copies, detached, in bounded memory that is reused). A slot is reused only when
                     nothing outside the ring still references it (storage use count), so a batch the consumer keeps
                     is never overwritten (its slot is replaced by a new buffer instead; ``ring_replaced``).
``"cpu-pinned"``     target is the CPU but ``pin_memory=True`` was asked for on a machine with CUDA: staged as
                     "cpu-staged" into a page-locked ring, so the consumer can issue its own ``non_blocking`` copies
                     from the batches.

Page-locking without a GPU driver (``mlock``) is not done: with no device DMA it buys nothing but a risk of hitting
RLIMIT_MEMLOCK, and the reuse of the ring already avoids the page faults of fresh allocations.

The module is split along its seams: ``fastdl/_loader_batch.py`` (flatten and rebuild nested batches),
``fastdl/_loader_ring.py`` (the ring of host buffers, the counters, the clock), ``fastdl/_loader_pass.py`` (one pass:
the producer thread, its staging, the consumer's iterator) and this file (the public ``PrefetchLoader``). The backend
choice of the copies lives beside the ops, in fastdl/ops/loader.py.

Import cost: this module needs only what ``import fastdl`` loads anyway (torch and the op definitions); it does not
initialise CUDA or compile anything.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping

import torch

from ._loader_pass import PrefetchIter
from ._loader_ring import Ring, RingCounters, Stats, clock
from .ops.loader import copy_backend_status, select_copy_backend

__all__ = ["PrefetchLoader", "loader_info"]

_CUDA_COPY_THREADS = 4  # helper threads of the host staging copy for GPU targets (a core copies ~10 GB/s)
DEFAULT_MAX_RING_BYTES = 4 << 30


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def loader_info() -> dict:
    """What ``PrefetchLoader()`` would use here, for ``fastdl info``: mode, copy backend (and why not C++).

    Does not initialise CUDA (``torch.cuda.is_available()`` only)."""
    backend, reason = copy_backend_status()
    return {
        "mode": "cuda-pinned" if torch.cuda.is_available() else "cpu",
        "copy_backend": backend,
        "copy_backend_reason": reason,
        "gil_released_during_copy": True,
    }


class PrefetchLoader:
    """Wrap ``loader`` (any iterable of tensors or nested tuples/lists/dicts of tensors; other leaves pass
    through untouched, see below) and prefetch ``depth`` batches ahead on a background thread, staged through a
    reused host ring and, on a GPU, copied to ``device`` on a side stream. On a plain CPU target nothing needs a
    copy and the batches are handed on as the wrapped loader made them (mode "cpu"; ``stage=True`` stages them).

    Args:
        loader: the wrapped iterable, e.g. a ``torch.utils.data.DataLoader``. ``len()``, ``sampler``,
            ``dataset``, ... are passed through; ``set_epoch`` reaches its sampler (DistributedSampler).
        device: target device; default the current CUDA device if CUDA is available, else the CPU.
        depth: batches prepared ahead of the consumer (queue length; >= 1).
        pin_memory: page-lock the ring. Default: on for CUDA targets. On a CPU target with CUDA available, True
            gives mode "cpu-pinned".
        stage: copy the batches through the reused host ring. Default (None): where the target needs a copy (a
            CUDA device, or ``pin_memory`` on the CPU); a plain CPU target passes the batches through (mode "cpu").
            True on a CPU target stages them anyway (mode "cpu-staged": detached, contiguous copies in bounded,
            reused memory); False is only for a CPU target without ``pin_memory`` (ValueError otherwise).
        max_ring_bytes: bound on the ring's total size; a batch larger than one slot's share is not staged
            (copied directly, counted as ``oversize_batches``).
        copy_backend: the backend of the host copies (the ops ``fastdl.ops.loader_fill`` / ``loader_use_count``):
            "auto" follows ``fastdl.use_backend`` / ``FASTDL_BACKEND`` like every other fastdl op, read in the
            thread that starts each pass (C++ when the extension is built, else torch); "cpp" or "torch" fixes it
            for this loader.
        copy_threads: threads of one host copy (default 1 on a CPU target, 4 for a GPU target).
        progress: show a tqdm bar (True or a description string); needs tqdm.
        timeout: seconds to wait for one batch before raising TimeoutError (0: forever).
        shutdown_timeout: seconds to wait for the producer thread when an iteration is stopped early.

    Staged batches (every mode but "cpu") are copies: the batches of a staged CPU target are views into the ring
    that stay valid as long as you hold them (a slot still referenced is never reused); tensors are detached, and
    tensors that share memory in the source batch are copied separately (aliasing is not preserved). In mode
    "cpu" (pass-through) the consumer gets the wrapped loader's own batch objects, unchanged.

    Passes (``iter()``): each ``iter(loader)`` over a re-iterable source (a list, a ``DataLoader``) is an
    independent pass with its own producer thread, queue and ring (when it stages), as each ``iter()`` of a
    ``DataLoader`` is its own iterator: ``zip(loader, loader)`` and nested loops see every batch, and a loop after a
    ``break`` starts a new epoch. Two passes running at once hold two rings (up to ``max_ring_bytes`` each; a pass
    that ends leaves its ring to the next one, so sequential epochs reuse one); ``stats()`` counts the batches,
    bytes and times of all passes, ``elapsed_s`` the time during which at least one ran. Over a one-shot source (an
    iterator or generator, ``iter(source) is source``) there is one stream of data: an ``iter()`` while a pass is
    live returns that pass (``zip(loader, loader)`` pairs consecutive batches, as ``zip(gen, gen)`` does), and the
    batches a stopped pass had prefetched (``break``, ``del``, ``close()``, an interrupt) are delivered first by the
    next pass, so every element arrives exactly once and in order. Why not one error for a second ``iter()``: a
    ``DataLoader`` allows it, and code that peeks a batch (``next(iter(loader))``) or zips two loops relies on it.
    The exception: a ``DataLoader(persistent_workers=True)`` reuses one iterator for every ``iter()``, so a second
    pass while one runs raises RuntimeError (finish or ``close()`` the first).

    What a batch may hold (when it is staged; in mode "cpu" any batch is handed on unchanged): tensors (any
    shapes: a list of ragged tensors is moved tensor by tensor; sparse, nested (strided or jagged layout) and
    quantized tensors are moved with ``.to(device)`` without the ring, so a staged CPU target hands them out as they
    are, detached), nested in Mappings, lists and tuples
    (rebuilt as the same type: dict subclasses such as ``defaultdict`` or a transformers ``BatchEncoding`` keep
    their type and attributes, namedtuples their fields). Any other leaf that holds no tensor (numbers, strings,
    None, numpy arrays, arbitrary objects) is passed through untouched: the consumer gets the same object. A leaf
    that holds tensors the loader cannot reach (a dataclass, a set, an object with tensor attributes) raises
    ``TypeError`` naming the element (e.g. ``batch['meta']``) and its type, as does a container type that cannot be
    rebuilt; the error is raised by the iteration step that would have returned the batch.
    """

    def __init__(
        self,
        loader: Iterable,
        device: torch.device | str | int | None = None,
        depth: int = 2,
        *,
        pin_memory: bool | None = None,
        stage: bool | None = None,
        max_ring_bytes: int = DEFAULT_MAX_RING_BYTES,
        copy_backend: str = "auto",
        copy_threads: int | None = None,
        progress: bool | str = False,
        timeout: float = 0.0,
        shutdown_timeout: float = 5.0,
    ):
        if int(depth) < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.loader = loader
        self.depth = int(depth)
        dev = _default_device() if device is None else torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"fastdl PrefetchLoader: device {dev} requested but CUDA is not available")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
        self.device = dev
        cuda = dev.type == "cuda"
        if pin_memory is None:
            pin_memory = cuda
        if pin_memory and not torch.cuda.is_available():
            if cuda:
                raise RuntimeError("fastdl PrefetchLoader: CUDA device requested but CUDA is not available")
            warnings.warn("fastdl PrefetchLoader: pin_memory=True needs CUDA; using pageable memory",
                          RuntimeWarning, stacklevel=2)
            pin_memory = False
        self.pin_memory = bool(pin_memory)
        if stage not in (None, True, False):
            raise TypeError(f"fastdl PrefetchLoader: stage must be None, True or False, got {stage!r}")
        if stage is False and (cuda or self.pin_memory):
            raise ValueError(f"fastdl PrefetchLoader: stage=False needs a CPU target without pin_memory (nothing to "
                             f"copy), got device {dev} and pin_memory={self.pin_memory}")
        # A plain CPU target has nothing to copy: the batches are passed through. Per batch over iterating the
        # source directly (a list of {4 MiB, 16 int64} dicts, a consumer doing nothing, 2 shared cores): staged
        # 1.07-1.30 ms (0.15 ms at 64 KiB), for nothing the consumer needed; passed through 15-57 us (the hand-off).
        self._stage = bool(stage) if stage is not None else (cuda or self.pin_memory)
        self._copy_backend_arg = copy_backend
        # an explicit choice is checked here; "auto" is resolved when each pass starts (_cfg)
        self._pass_backend = None if copy_backend == "auto" else select_copy_backend(copy_backend)
        self.copy_threads = int(copy_threads) if copy_threads else (_CUDA_COPY_THREADS if cuda else 1)
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {copy_threads}")
        self.max_ring_bytes = int(max_ring_bytes)
        self.progress = progress
        self.timeout = float(timeout)
        self.shutdown_timeout = float(shutdown_timeout)
        # Slots in use at once. GPU target: a slot is free again as soon as its device copy is done, so two let the
        # staging of batch k overlap the copy of batch k-1. CPU target: the consumer's handed-out batches are views,
        # and in `for b in loader` the slots of the batch still bound to `b`, of the one being returned, of the
        # `depth` queued ones and of the one the producer holds while it waits for queue space are all referenced.
        self._nslots = (max(self.depth, 2) if cuda else self.depth + 3) if self._stage else 0
        self._ring: Ring | None = None  # the ring of the last pass that ended, for the next pass
        self._rings: weakref.WeakSet = weakref.WeakSet()  # every ring still alive (ring_bytes)
        self._ring_counters = RingCounters()
        self._stream = None
        self._stats = Stats()
        self._passes: weakref.WeakSet = weakref.WeakSet()  # live passes (PrefetchIter)
        self._current: weakref.ref | None = None  # the pass started last: its position is state_dict()'s
        self._leftover: list = []  # one-shot source: what a stopped pass had staged, for the next pass
        self._consumed = 0  # batches handed out in the current (or interrupted) pass
        self._skip = 0  # batches to skip at the start of the next pass (load_state_dict)
        self._epoch: int | None = None
        self._closed = False

    # -- mode / configuration ------------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        if self.device.type == "cuda":
            return "cuda-pinned" if self.pin_memory else "cuda-pageable"
        if self.pin_memory:
            return "cpu-pinned"
        return "cpu-staged" if self._stage else "cpu"

    @property
    def copy_backend(self) -> str:
        """The backend of the host copies, "cpp" or "torch": the current (or last) pass's; before the first pass,
        the one a pass started now in this thread would use."""
        return self._pass_backend or select_copy_backend(self._copy_backend_arg)

    def _cfg(self) -> dict:
        cuda = self.device.type == "cuda"
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # lives as long as the loader
        return {
            "cuda": cuda,
            "device": self.device,
            "stream": self._stream,
            "copy_backend": self._pass_backend,
            "stage": self._stage,
            "threads": self.copy_threads,
            "intra_op_threads": torch.get_num_threads(),  # of the thread that starts the pass
        }

    def _take_ring(self) -> Ring | None:
        """The ring for a pass starting now: the one the last pass left, else a new one (a pass running at the
        same time as another gets its own); None for a pass that does not stage (mode "cpu")."""
        if not self._stage:
            return None
        ring, self._ring = self._ring, None
        if ring is None:
            ring = Ring(
                self._nslots,
                self.pin_memory,
                max(self.max_ring_bytes // self._nslots, 1),
                self.device.type == "cpu",
                self._ring_counters,
            )
            self._rings.add(ring)
        return ring

    def _return_ring(self, ring: Ring | None) -> None:
        if self._ring is None and not self._closed:
            self._ring = ring

    # -- iteration -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator:
        """A new pass, independent of the others: its own producer thread, queue and ring. Over a re-iterable
        source (a list, a ``DataLoader``) each ``iter()`` starts a new epoch, so ``zip(loader, loader)`` and nested
        loops see every batch, as with a ``DataLoader``, and ``break`` then a new loop starts anew. Over a one-shot
        source (an iterator or generator: ``iter(source) is source``) all passes read the one iterator, as looping
        over it directly does: an ``iter()`` while a pass is live returns that pass, and the batches a stopped pass
        had prefetched (``break``, ``del``) are delivered first by the next pass, so every element arrives once,
        in order."""
        # the pass's copy backend, chosen in the thread that starts it (use_backend / FASTDL_BACKEND): before
        # anything changes, so a backend that cannot be honoured leaves the loader as it was
        backend = select_copy_backend(self._copy_backend_arg)
        src = self.loader
        live = [p for p in list(self._passes) if p._sh is not None]
        if live and getattr(src, "persistent_workers", False) and getattr(src, "_iterator", None) is not None:
            # DataLoader(persistent_workers=True).__iter__ resets and returns its one iterator, which the live
            # pass's producer is reading: calling it would mix two epochs in one iterator across two threads
            raise RuntimeError(
                "fastdl PrefetchLoader: a second iter() while a pass is running over a DataLoader with "
                "persistent_workers=True (it reuses one iterator for every pass, so passes cannot run at once); "
                "finish or close() the running pass first (e.g. `it.close()`, or `loader.close()`)"
            )
        self._pass_backend = backend
        self._closed = False
        it = iter(src)
        for p in live:
            if p._src is it:  # the source hands out one iterator (a generator): share its pass
                return p
        one_shot = it is src
        skip, self._skip = self._skip, 0
        leftover, self._leftover = (self._leftover, []) if one_shot else ([], [])
        if skip or not one_shot:  # a one-shot source's pass goes on where the last one stopped
            self._consumed = skip
        p = PrefetchIter(self, it, skip, one_shot, leftover)
        self._passes.add(p)
        self._current = weakref.ref(p)
        return p

    def close(self) -> None:
        """Stop every running pass and free the idle ring. Over a one-shot source, batches already prefetched are
        kept for the next pass (they are the source's data: nothing is dropped)."""
        self._closed = True
        for p in list(self._passes):
            p.close()
        self._current = None
        self._ring = None

    # No __del__: a live iterator owns its producer thread and keeps working if the loader is dropped (as with
    # DataLoader); the thread stops when the iterator is exhausted, closed or garbage-collected.

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        # sampler, batch_sampler, dataset, batch_size, ... of the wrapped loader
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader's ``set_epoch``, else to its sampler / batch sampler (DistributedSampler)."""
        self._epoch = int(epoch)
        inner = self.loader
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
            return
        for name in ("sampler", "batch_sampler"):
            s = getattr(inner, name, None)
            if s is not None and hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
                return
        s = getattr(getattr(inner, "batch_sampler", None), "sampler", None)
        if s is not None and hasattr(s, "set_epoch"):
            s.set_epoch(epoch)

    # -- resume ----------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Position in the current pass (the one started last): batches already handed to the consumer (prefetched
        ones do not count), and the epoch last given to ``set_epoch``. 0 after a pass completed."""
        return {"version": 1, "batches_consumed": int(self._consumed), "epoch": self._epoch}

    _STATE_KEYS = ("version", "batches_consumed", "epoch")

    def load_state_dict(self, state: Mapping) -> None:
        """The next pass skips the ``batches_consumed`` batches (read from the wrapped loader, not staged), so a
        restarted job continues with the next unseen batch; needs a deterministic sampler order. Restores the
        epoch with ``set_epoch``. ``state`` is what ``state_dict`` returned: a mapping with ``version`` 1,
        ``batches_consumed`` (an int >= 0) and optionally ``epoch`` (an int or None); anything else raises
        TypeError (a wrong type) or ValueError (a wrong or missing value) naming the key, and nothing changes."""
        where = "PrefetchLoader.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: state must be a dict from PrefetchLoader.state_dict(), got "
                            f"{type(state).__name__}: {state!r:.80}")
        unknown = [k for k in state if k not in self._STATE_KEYS]
        if unknown:
            raise ValueError(f"{where}: state has unknown keys {unknown!r:.200}; expected {list(self._STATE_KEYS)}")
        version = state.get("version")
        if type(version) is not int or version != 1:
            raise ValueError(f"{where}: unsupported PrefetchLoader state version {version!r} (expected 1)")
        if "batches_consumed" not in state:
            raise ValueError(f"{where}: state['batches_consumed'] is missing (expected an int >= 0); got keys "
                             f"{list(state)}")
        n, epoch = state["batches_consumed"], state.get("epoch")
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"{where}: state['batches_consumed'] must be an int >= 0, got {type(n).__name__}: "
                            f"{n!r:.80}")
        if n < 0:
            raise ValueError(f"{where}: state['batches_consumed'] must be >= 0, got {n}")
        if epoch is not None and (not isinstance(epoch, int) or isinstance(epoch, bool)):
            raise TypeError(f"{where}: state['epoch'] must be an int or None, got {type(epoch).__name__}: "
                            f"{epoch!r:.80}")
        if epoch is not None:
            self.set_epoch(epoch)
        self._skip = n
        self._consumed = n

    # -- telemetry ---------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since construction (or ``reset_stats``): ``wait_s`` is the time the consumer waited for data
        (exposed loading time), ``copy_s`` the producer's staging/copy time, ``h2d_s`` the device time of the
        host-to-device copies (CUDA), ``produce_s`` the time spent in the wrapped loader."""
        s = self._stats
        if self.device.type == "cuda":
            for p in list(self._passes):
                sh = p._sh
                if sh is not None:
                    sh.poll_timing()
        elapsed = s.elapsed_s + (clock() - s.iter_start if s.iter_start is not None else 0.0)
        rings = list(self._rings)
        return {
            "mode": self.mode,
            "device": str(self.device),
            "copy_backend": self._pass_backend or self._copy_backend_arg,
            "depth": self.depth,
            "batches": s.batches,
            "bytes": s.bytes,
            "epochs": s.epochs,
            "elapsed_s": elapsed,
            "batches_per_s": s.batches / elapsed if elapsed > 0 else 0.0,
            "bytes_per_s": s.bytes / elapsed if elapsed > 0 else 0.0,
            "wait_s": s.wait_s,
            "wait_frac": s.wait_s / elapsed if elapsed > 0 else 0.0,
            "produce_s": s.produce_s,
            "copy_s": s.copy_s,
            "h2d_s": s.h2d_s if self.device.type == "cuda" else None,
            "h2d_gbps": s.h2d_bytes / s.h2d_s / 1e9 if s.h2d_s > 0 else None,
            "ring_slots": self._nslots,
            "ring_bytes": sum(r.nbytes() for r in rings),
            "ring_allocs": self._ring_counters.allocs,
            "ring_replaced": self._ring_counters.replaced,
            "oversize_batches": s.oversize,
        }

    def reset_stats(self) -> None:
        with self._stats.lock:
            running = self._stats.iter_start is not None
            self._stats.reset()
            if running:
                self._stats.iter_start = clock()

    def __repr__(self) -> str:
        return (
            f"PrefetchLoader(mode={self.mode!r}, device={str(self.device)!r}, depth={self.depth}, "
            f"copy_backend={self._pass_backend or self._copy_backend_arg!r}, loader={type(self.loader).__name__})"
        )
