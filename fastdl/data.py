"""Prefetching loader: ``fastdl.data.PrefetchLoader`` wraps any loader and hides the host-to-device copy.

A background thread pulls batches from the wrapped iterable and copies their tensors into a ring of host buffers
that are allocated once and reused (grown only when a batch is larger, bounded by ``max_ring_bytes``). The copy is
done by the op ``fastdl.ops.loader_fill`` (defined in fastdl/ops/loader.py like every fastdl op): its C++ kernel
(csrc/cpu/loader.cpp) runs with the GIL released, so the Python consumer keeps running while it copies; the torch
backend does the same copy with ``Tensor.copy_`` (which also releases the GIL). The backend is chosen like every other
op's (``FASTDL_BACKEND``, ``fastdl.use_backend`` in the thread that starts a pass, or ``copy_backend=``), and
``loader.copy_backend`` says which one a pass uses.

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
``"cpu"``            target is the CPU: the batch handed out consists of views into a ring slot. A slot is reused only
                     when nothing outside the ring still references it (storage use count), so a batch the consumer
                     keeps is never overwritten (its slot is replaced by a new buffer instead; ``ring_replaced``).
``"cpu-pinned"``     target is the CPU but ``pin_memory=True`` was asked for on a machine with CUDA: the ring is
                     page-locked, so the consumer can issue its own ``non_blocking`` copies from the batches.

Page-locking without a GPU driver (``mlock``) is not done: with no device DMA it buys nothing but a risk of hitting
RLIMIT_MEMLOCK, and the reuse of the ring already avoids the page faults of fresh allocations.

Import cost: this module needs only what ``import fastdl`` loads anyway (torch and the op definitions); it does not
initialise CUDA or compile anything.
"""

from __future__ import annotations

import atexit
import collections
import copy
import dataclasses
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping

import torch

from . import backends
from .ops.loader import contiguous_strides, dense, loader_fill, loader_use_count

__all__ = ["PrefetchLoader", "loader_info"]

_ALIGN = 256  # byte alignment of every tensor in a slot (GPU kernels want >= 16 B; 256 = CUDA allocator's min)
_CUDA_COPY_THREADS = 4  # helper threads of the host staging copy for GPU targets (a core copies ~10 GB/s)
DEFAULT_MAX_RING_BYTES = 4 << 30
_THREAD_NAME = "fastdl-prefetch"

# ----------------------------------------------------------------------------------------------------------------
# copy backend


def _resolve_copy_backend(copy_backend: str) -> str:
    """The backend of the loader's copy ops (fastdl/ops/loader.py) for a pass started now in this thread.

    "auto" follows ``fastdl.use_backend`` / ``FASTDL_BACKEND`` like every other op (auto: C++ when the extension is
    built, else torch); "cpp" or "torch" is this loader's own explicit choice. An explicit choice that cannot be
    honoured raises ``fastdl.BackendUnavailableError``."""
    if copy_backend not in ("auto", "cpp", "torch"):
        raise ValueError(f"copy_backend must be 'auto', 'cpp' or 'torch', got {copy_backend!r}")
    if copy_backend == "auto":
        return backends.select("loader_fill", "cpu")
    ok, why = backends.available(copy_backend, "loader_fill", "cpu")
    if not ok:
        raise backends.BackendUnavailableError(
            f"fastdl PrefetchLoader: copy_backend={copy_backend!r} was requested but cannot serve the host copies: "
            f"{why}. Use copy_backend='auto' to fall back automatically."
        )
    return copy_backend


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def loader_info() -> dict:
    """What ``PrefetchLoader()`` would use here, for ``fastdl info``: mode, copy backend (and why not C++).

    Does not initialise CUDA (``torch.cuda.is_available()`` only)."""
    try:
        backend, reason = _resolve_copy_backend("auto"), ""
    except backends.BackendUnavailableError as exc:  # FASTDL_BACKEND names a backend the copies do not have
        backend, reason = "unavailable", str(exc)
    if backend != "cpp" and not reason:
        reason = next((why for b, ok, why in backends.explain("loader_fill", "cpu") if b == "cpp" and not ok), "")
    return {
        "mode": "cuda-pinned" if torch.cuda.is_available() else "cpu",
        "copy_backend": backend,
        "copy_backend_reason": reason,
        "gil_released_during_copy": True,
    }


# ----------------------------------------------------------------------------------------------------------------
# nested batches: flatten to a list of tensors and rebuild


def _flatten(obj, out: list, path: str = "batch"):
    """Append the tensors of ``obj`` to ``out``; return a spec to rebuild it. Containers without tensors and
    non-tensor leaves are kept by identity; containers with tensors are not referenced (the spec must not keep the
    source batch alive while the staged copy waits in the queue): a Mapping or list subclass is rebuilt from an
    emptied shallow copy (so a defaultdict keeps its factory, a transformers BatchEncoding its other attributes).
    A leaf that is none of these but holds tensors (a dataclass, a set, an object with tensor attributes) raises
    TypeError naming it: the loader could not move those tensors and would hand out the object unchanged."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return None
    n = len(out)
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        specs = [_flatten(obj[k], out, f"{path}[{k!r}]") for k in keys]
        if len(out) == n:
            return ("o", obj)
        if type(obj) in (dict, collections.OrderedDict) or not isinstance(obj, MutableMapping):
            return ("d", type(obj), keys, specs, path)
        return ("m", _emptied_copy(obj, path), keys, specs, path)
    if isinstance(obj, (list, tuple)):
        specs = [_flatten(x, out, f"{path}[{i}]") for i, x in enumerate(obj)]
        if len(out) == n:
            return ("o", obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return ("n", type(obj), specs, path)
        if isinstance(obj, list) and type(obj) is not list:
            return ("l", _emptied_copy(obj, path), specs, path)
        return ("s", type(obj), specs, path)
    where = _tensor_inside(obj)
    if where is not None:
        raise TypeError(
            f"fastdl PrefetchLoader: {path} is a {type(obj).__module__}.{type(obj).__qualname__} that holds tensors "
            f"({where}); the loader moves tensors that are batch leaves or inside Mappings, lists and tuples only, and "
            "would hand this object out unchanged. Return its tensors in a dict or tuple (e.g. "
            "dataclasses.asdict), or move them yourself."
        )
    return ("o", obj)


def _emptied_copy(obj, path: str):
    try:
        c = copy.copy(obj)
        c.clear()
        return c
    except Exception as exc:
        raise TypeError(
            f"fastdl PrefetchLoader: cannot rebuild {path}, a {type(obj).__qualname__} holding tensors "
            f"(copy.copy + clear() failed: {exc}); return a dict or list instead"
        ) from exc


def _tensor_inside(obj) -> str | None:
    """Where a non-container leaf holds a tensor (one level deep: its fields, attributes or set elements)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    elif isinstance(obj, (set, frozenset)):
        values = {"element": next((x for x in obj if isinstance(x, torch.Tensor)), None)}
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        values = vars(obj)
    else:
        return None
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            return f"{name}: Tensor"
        if isinstance(v, (list, tuple, Mapping)):
            inner = v.values() if isinstance(v, Mapping) else v
            if any(isinstance(x, torch.Tensor) for x in inner):
                return f"{name}: {type(v).__name__} of tensors"
    return None


def _unflatten(spec, it: Iterator):
    if spec is None:
        return next(it)
    kind = spec[0]
    if kind == "o":
        return spec[1]
    if kind in ("d", "m"):
        items = [(k, _unflatten(s, it)) for k, s in zip(spec[2], spec[3])]
        if kind == "m":
            rebuilt = spec[1]
            for k, v in items:
                rebuilt[k] = v
            return rebuilt
        return _construct(spec[1], items, spec[4])
    items = [_unflatten(s, it) for s in spec[2]]
    if kind == "n":  # namedtuple
        return spec[1](*items)
    if kind == "l":
        spec[1].extend(items)
        return spec[1]
    return _construct(spec[1], items, spec[3])


def _construct(typ, items, path: str):
    try:
        return typ(items)
    except Exception as exc:
        raise TypeError(
            f"fastdl PrefetchLoader: cannot rebuild {path}, a {typ.__qualname__} holding tensors ({typ.__qualname__}"
            f"(items) failed: {exc}); return a dict, list or tuple instead"
        ) from exc


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------------------------------------------
# ring of host buffers


class _RingCounters:
    """Allocations and replacements of a loader's ring slots, over every ring it made (not reset by reset_stats)."""

    def __init__(self):
        self.allocs = 0
        self.replaced = 0


class _Ring:
    """``nslots`` uint8 host buffers, reused round-robin. A ring belongs to one pass at a time: only that pass's
    producer thread touches it while the pass runs (the consumer reads the counters). The loader keeps the ring of
    the last pass that ended for the next one."""

    def __init__(self, nslots: int, pinned: bool, max_slot_bytes: int, handed_out: bool, counters: _RingCounters):
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
            cap = _align(nbytes + nbytes // 8, 1 << 16)
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


class _Stats:
    """Counters of a loader over all its passes. Passes may run at once (each with its own producer thread): the
    producers add under ``lock``; ``elapsed_s`` counts the wall time during which at least one pass ran."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = 0  # passes started and not yet ended
        self.reset()

    def pass_started(self) -> None:
        with self.lock:
            if self.running == 0:
                self.iter_start = time.perf_counter()
            self.running += 1

    def pass_ended(self) -> None:
        with self.lock:
            self.running -= 1
            if self.running == 0 and self.iter_start is not None:
                self.elapsed_s += time.perf_counter() - self.iter_start
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


# ----------------------------------------------------------------------------------------------------------------
# producer thread


class _End:
    pass


class _Error:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class _Item:
    __slots__ = ("spec", "tensors", "event", "record")

    def __init__(self, spec, tensors, event=None, record=()):
        self.spec = spec
        self.tensors = tensors
        self.event = event
        self.record = record


class _Shared:
    """State shared by one iteration's consumer (``_PrefetchIter``) and its producer thread. The thread holds only
    this object, never the iterator, so dropping the iterator (``break``, ``del``) triggers its cleanup."""

    def __init__(self, it, cfg: dict, ring: _Ring, stats: _Stats, skip: int, depth: int):
        self.it = it
        self.cfg = cfg
        self.ring = ring
        self.stats = stats
        self.skip = skip
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.pending: collections.deque = collections.deque()  # CUDA timing events (start, end, nbytes)
        self.lock = threading.Lock()
        self.held = None  # what the producer had ready when the pass was stopped (kept for a one-shot source)

    def put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def put_or_hold(self, item) -> bool:
        """``put``; when the pass is stopped first, keep ``item`` in ``held`` (handed to the next pass of a one-shot
        source: nothing the producer took from the wrapped iterator is lost)."""
        if self.put(item):
            return True
        self.held = item
        return False

    def poll_timing(self, wait: bool = False) -> None:
        with self.lock:
            while self.pending and (wait or self.pending[0][1].query()):
                start, end, nbytes = self.pending.popleft()
                end.synchronize()
                with self.stats.lock:
                    self.stats.h2d_s += start.elapsed_time(end) / 1e3
                    self.stats.h2d_bytes += nbytes


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _stop_all() -> None:  # atexit: stop producers cleanly before the interpreter tears down
    for sh in list(_LIVE):
        sh.stop.set()
        _drain(sh.q)
        t = sh.thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=1.0)


atexit.register(_stop_all)


def _drain(q: queue.Queue) -> None:
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


def _stage(sh: _Shared, batch) -> _Item:
    """Copy the tensors of ``batch`` into a ring slot (and to the device); return what the consumer needs."""
    cfg, ring, stats = sh.cfg, sh.ring, sh.stats
    cuda: bool = cfg["cuda"]
    device: torch.device = cfg["device"]
    leaves: list[torch.Tensor] = []
    spec = _flatten(batch, leaves)
    out: list = list(leaves)
    staged = []  # (leaf index, src, offset, nbytes, keep_strides, strides)
    direct = []  # leaf indices copied without the ring
    off = 0
    for i, t in enumerate(leaves):
        if (
            t.is_nested  # nested tensors (strided or jagged layout) have no single strided buffer to stage
            or t.device.type != "cpu"
            or t.layout != torch.strided
            or t.is_quantized
            or t.numel() == 0
            or (cuda and t.is_pinned())
        ):
            direct.append(i)
            continue
        if t.requires_grad:
            t = t.detach()
        keep = dense(t) and not t.is_conj() and not t.is_neg()
        strides = t.stride() if keep else contiguous_strides(t.shape)
        nbytes = t.numel() * t.element_size()
        off = _align(off)
        staged.append((i, t, off, nbytes, keep, strides))
        off += nbytes
    total = off
    oversize = total > ring.max_slot_bytes
    if oversize:  # larger than the bounded ring allows: no staging for this batch
        direct += [s[0] for s in staged]
        direct.sort()
        staged, total = [], 0

    t0 = time.perf_counter()
    event, record = None, []
    if staged:
        j, slot = ring.acquire(total)
        # the backend of the pass (the producer thread runs under use_backend(cfg["copy_backend"]))
        loader_fill([s[1] for s in staged], slot, [s[2] for s in staged], [int(s[4]) for s in staged], cfg["threads"])
        if not cuda:
            for i, t, o, _, _, strides in staged:
                out[i] = slot.view(t.dtype).as_strided(t.shape, strides, o // t.element_size())
        if cuda:
            stream = cfg["stream"]
            dbuf = torch.empty(_align(total), dtype=torch.uint8, device=device)  # on the side stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dbuf[:total].copy_(slot[:total], non_blocking=True)
            end.record(stream)
            ring.events[j] = end
            with sh.lock:
                sh.pending.append((start, end, total))
            for i, t, o, _, _, strides in staged:
                out[i] = dbuf.view(t.dtype).as_strided(t.shape, strides, o // t.element_size())
            record.append(dbuf)
            event = end
        del slot
    nbytes = total
    for i in direct:
        t = leaves[i]
        if t.requires_grad:
            t = t.detach()
        if t.device != device:
            plain = t.layout == torch.strided and not t.is_nested
            t = t.to(device, non_blocking=cuda and t.device.type == "cpu" and plain and t.is_pinned())
            if plain:
                nbytes += t.numel() * t.element_size()
        out[i] = t
        if cuda and t.is_cuda:
            record += _device_buffers(t)
    if cuda and (direct or staged):
        if event is None or direct:
            event = torch.cuda.Event()
            event.record(cfg["stream"])
        sh.poll_timing()
    with stats.lock:
        stats.copy_s += time.perf_counter() - t0
        stats.bytes += nbytes
        stats.oversize += oversize
    return _Item(spec, out, event, record)


def _device_buffers(t: torch.Tensor) -> list[torch.Tensor]:
    """Plain tensors viewing ``t``'s device memory, for ``record_stream`` (which a nested tensor does not take; it
    protects the whole allocation through any view of it)."""
    if not t.is_nested:
        return [t]
    if t.layout == torch.jagged:
        return [b for b in (t.values(), t.offsets(), t.lengths()) if b is not None]
    parts = t.unbind()  # strided nested layout: one buffer, every component a view of it
    return [parts[0]] if parts else []


def _produce(sh: _Shared) -> None:
    cfg = sh.cfg
    stats = sh.stats
    ctx = None
    try:
        # OpenMP/MKL thread counts are per thread: a new thread would use every core for its torch ops and
        # oversubscribe the consumer's (two threads of 192^2 matmuls on 2 cores: 1.23x -> 1.96x with this line).
        if getattr(torch._C, "has_openmp", False):
            torch.set_num_threads(cfg["intra_op_threads"])
        if cfg["cuda"]:
            torch.cuda.set_device(cfg["device"])
            ctx = torch.cuda.stream(cfg["stream"])  # the wrapped loader's own CUDA work, if any, runs here too
            ctx.__enter__()
        it = sh.it
        t0 = time.perf_counter()
        for _ in range(sh.skip):  # resume: fast-forward without staging
            if sh.stop.is_set():
                return
            try:
                next(it)
            except StopIteration:
                sh.put_or_hold(_End)
                return
        with stats.lock:
            stats.produce_s += time.perf_counter() - t0
        while not sh.stop.is_set():
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            with stats.lock:
                stats.produce_s += time.perf_counter() - t0
            with backends.use_backend(cfg["copy_backend"]):  # the pass's copy backend, for the copy ops only
                item = _stage(sh, batch)
            del batch
            if not sh.put_or_hold(item):
                return
            del item
        else:
            return  # stopped before taking another batch from the wrapped iterator
        sh.put_or_hold(_End)
    except BaseException as exc:  # noqa: B036  (hand everything, KeyboardInterrupt included, to the consumer)
        sh.put_or_hold(_Error(exc))
    finally:
        sh.it = None
        if ctx is not None:
            ctx.__exit__(None, None, None)


# ----------------------------------------------------------------------------------------------------------------
# consumer side


class _PrefetchIter:
    """One pass: a producer thread, a queue and a ring of its own. ``src`` is the wrapped loader's iterator (made by
    the caller, in the caller's thread: DataLoader workers are started from there); ``one_shot``: ``src`` is the
    wrapped object itself (a generator), so what the producer took from it and the consumer did not get is handed
    back to the loader when the pass stops (``leftover``: the next pass delivers it first)."""

    def __init__(self, loader: PrefetchLoader, src: Iterator, skip: int, one_shot: bool, leftover: list):
        self._loader_ref = weakref.ref(loader)
        self._device = loader.device
        self._cuda = loader.device.type == "cuda"
        self._stats = loader._stats
        self._timeout = loader.timeout
        self._shutdown_timeout = loader.shutdown_timeout
        self._bar = None
        self._bar_t = 0.0
        self._src = src  # identity of the wrapped iterator: a second iter() that gets the same one joins this pass
        self._one_shot = one_shot
        ring = loader._take_ring()
        self._sh = sh = _Shared(src, loader._cfg(), ring, loader._stats, skip, loader.depth)
        if leftover:  # staged by the previous pass over this one-shot source: first in line (before the thread runs)
            sh.q.queue.extend(leftover)
        _LIVE.add(sh)
        self._stats.pass_started()
        if loader.progress:
            self._bar = _make_bar(loader, skip)
        sh.thread = threading.Thread(target=_produce, args=(sh,), name=_THREAD_NAME, daemon=True)
        sh.thread.start()

    def __iter__(self):
        return self

    def _get(self, sh: _Shared):
        t_start = time.perf_counter()
        while True:
            try:
                return sh.q.get(timeout=0.05)
            except queue.Empty:
                if not sh.thread.is_alive() and sh.q.empty():
                    raise RuntimeError("fastdl PrefetchLoader: the producer thread exited unexpectedly") from None
                if self._timeout and time.perf_counter() - t_start > self._timeout:
                    raise TimeoutError(
                        f"fastdl PrefetchLoader: no batch from the wrapped loader within {self._timeout} s"
                    ) from None

    def __next__(self):
        sh = self._sh
        if sh is None:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            item = self._get(sh)
        except BaseException:  # KeyboardInterrupt while waiting, timeout: stop the thread, then propagate
            self.close()
            raise
        self._stats.wait_s += time.perf_counter() - t0
        if item is _End:
            self._finish()
            raise StopIteration
        if isinstance(item, _Error):
            self.close()
            exc = item.exc
            del item
            raise exc  # carries the producer-side traceback (the wrapped loader's frames)
        if item.event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(item.event)
            for t in item.record:
                t.record_stream(stream)
        batch = _unflatten(item.spec, iter(item.tensors))
        del item
        self._stats.batches += 1
        loader = self._loader_ref()
        if loader is not None and loader._current is not None and loader._current() is self:
            loader._consumed += 1
        if self._bar is not None:
            self._update_bar()
        return batch

    def _update_bar(self):
        self._bar.update(1)
        now = time.perf_counter()
        if now - self._bar_t > 0.5:
            self._bar_t = now
            s = self._stats
            el = max(now - (s.iter_start or now) + s.elapsed_s, 1e-9)
            self._bar.set_postfix(wait=f"{100 * s.wait_s / el:.0f}%", MBps=f"{s.bytes / el / 1e6:.0f}", refresh=False)

    def _finish(self):
        loader = self._loader_ref()
        if loader is not None and loader._current is not None and loader._current() is self:
            loader._consumed = 0
        self._stats.epochs += 1
        self.close()

    def close(self) -> None:
        """Stop the producer thread and release everything; safe to call more than once. Over a one-shot source,
        the batches the producer had staged and the consumer did not get go back to the loader (the next pass
        delivers them first)."""
        sh, self._sh = self._sh, None
        if sh is None:
            return
        sh.stop.set()
        t = sh.thread
        alive = t is not None and t.is_alive()
        if alive and t is not threading.current_thread():
            t.join(self._shutdown_timeout)
            alive = t.is_alive()
            if alive:
                warnings.warn(
                    f"fastdl PrefetchLoader: producer thread still inside the wrapped loader after "
                    f"{self._shutdown_timeout} s; leaving it (daemon) and using a new ring"
                    + (" (a batch it still returns is dropped)" if self._one_shot else ""),
                    RuntimeWarning,
                    stacklevel=2,
                )
        loader = self._loader_ref()
        if loader is not None and not alive:
            if self._one_shot:  # the thread is done: the queue and what it held are final
                left = list(sh.q.queue)
                if sh.held is not None:
                    left.append(sh.held)
                loader._leftover = left
            loader._return_ring(sh.ring)
        sh.held = None
        _drain(sh.q)
        self._src = None
        if self._cuda:
            try:
                sh.poll_timing(wait=not alive)
            except Exception:
                pass
        self._stats.pass_ended()
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        _LIVE.discard(sh)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _make_bar(loader: PrefetchLoader, skip: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        warnings.warn("fastdl PrefetchLoader: progress=True needs tqdm (pip install tqdm); no progress bar",
                      RuntimeWarning, stacklevel=4)
        loader.progress = False
        return None
    try:
        total = len(loader.loader) - skip
    except TypeError:
        total = None
    desc = loader.progress if isinstance(loader.progress, str) else "fastdl"
    return tqdm(total=total, unit="batch", desc=desc, dynamic_ncols=True)


class PrefetchLoader:
    """Wrap ``loader`` (any iterable of tensors or nested tuples/lists/dicts of tensors; other leaves pass
    through untouched, see below) and prefetch ``depth`` batches ahead on a background thread, staged through a
    reused host ring and, on a GPU, copied to ``device`` on a side stream.

    Args:
        loader: the wrapped iterable, e.g. a ``torch.utils.data.DataLoader``. ``len()``, ``sampler``,
            ``dataset``, ... are passed through; ``set_epoch`` reaches its sampler (DistributedSampler).
        device: target device; default the current CUDA device if CUDA is available, else the CPU.
        depth: batches prepared ahead of the consumer (queue length; >= 1).
        pin_memory: page-lock the ring. Default: on for CUDA targets. On a CPU target with CUDA available, True
            gives mode "cpu-pinned".
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

    The batches of a CPU target are views into the ring: they stay valid as long as you hold them (a slot still
    referenced is never reused). Tensors are detached; tensors that share memory in the source batch are copied
    separately (aliasing is not preserved).

    Passes (``iter()``): each ``iter(loader)`` over a re-iterable source (a list, a ``DataLoader``) is an
    independent pass with its own producer thread, queue and ring, as each ``iter()`` of a ``DataLoader`` is its
    own iterator: ``zip(loader, loader)`` and nested loops see every batch, and a loop after a ``break`` starts a
    new epoch. Two passes running at once hold two rings (up to ``max_ring_bytes`` each; a pass that ends leaves
    its ring to the next one, so sequential epochs reuse one); ``stats()`` counts the batches, bytes and times of
    all passes, ``elapsed_s`` the time during which at least one ran. Over a one-shot source (an iterator or
    generator, ``iter(source) is source``) there is one stream of data: an ``iter()`` while a pass is live returns
    that pass (``zip(loader, loader)`` pairs consecutive batches, as ``zip(gen, gen)`` does), and the batches a
    stopped pass had prefetched (``break``, ``del``, ``close()``, an interrupt) are delivered first by the next
    pass, so every element arrives exactly once and in order. Why not one error for a second ``iter()``: a
    ``DataLoader`` allows it, and code that peeks a batch (``next(iter(loader))``) or zips two loops relies on it.
    The exception: a ``DataLoader(persistent_workers=True)`` reuses one iterator for every ``iter()``, so a second
    pass while one runs raises RuntimeError (finish or ``close()`` the first).

    What a batch may hold: tensors (any shapes: a list of ragged tensors is moved tensor by tensor; sparse, nested
    (strided or jagged layout) and quantized tensors are moved with ``.to(device)`` without the ring, so a CPU
    target hands them out as they are, detached), nested in Mappings, lists and tuples
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
        self._copy_backend_arg = copy_backend
        # an explicit choice is checked here; "auto" is resolved when each pass starts (_cfg)
        self._pass_backend = None if copy_backend == "auto" else _resolve_copy_backend(copy_backend)
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
        self._nslots = max(self.depth, 2) if cuda else self.depth + 3
        self._ring: _Ring | None = None  # the ring of the last pass that ended, for the next pass
        self._rings: weakref.WeakSet = weakref.WeakSet()  # every ring still alive (ring_bytes)
        self._ring_counters = _RingCounters()
        self._stream = None
        self._stats = _Stats()
        self._passes: weakref.WeakSet = weakref.WeakSet()  # live passes (_PrefetchIter)
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
        return "cpu-pinned" if self.pin_memory else "cpu"

    @property
    def copy_backend(self) -> str:
        """The backend of the host copies, "cpp" or "torch": the current (or last) pass's; before the first pass,
        the one a pass started now in this thread would use."""
        return self._pass_backend or _resolve_copy_backend(self._copy_backend_arg)

    def _cfg(self) -> dict:
        cuda = self.device.type == "cuda"
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # lives as long as the loader
        return {
            "cuda": cuda,
            "device": self.device,
            "stream": self._stream,
            "copy_backend": self._pass_backend,
            "threads": self.copy_threads,
            "intra_op_threads": torch.get_num_threads(),  # of the thread that starts the pass
        }

    def _take_ring(self) -> _Ring:
        """The ring for a pass starting now: the one the last pass left, else a new one (a pass running at the
        same time as another gets its own)."""
        ring, self._ring = self._ring, None
        if ring is None:
            ring = _Ring(
                self._nslots,
                self.pin_memory,
                max(self.max_ring_bytes // self._nslots, 1),
                self.device.type == "cpu",
                self._ring_counters,
            )
            self._rings.add(ring)
        return ring

    def _return_ring(self, ring: _Ring) -> None:
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
        backend = _resolve_copy_backend(self._copy_backend_arg)
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
        p = _PrefetchIter(self, it, skip, one_shot, leftover)
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
        elapsed = s.elapsed_s + (time.perf_counter() - s.iter_start if s.iter_start is not None else 0.0)
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
                self._stats.iter_start = time.perf_counter()

    def __repr__(self) -> str:
        return (
            f"PrefetchLoader(mode={self.mode!r}, device={str(self.device)!r}, depth={self.depth}, "
            f"copy_backend={self._pass_backend or self._copy_backend_arg!r}, loader={type(self.loader).__name__})"
        )
