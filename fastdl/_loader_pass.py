"""One pass of a PrefetchLoader (part of ``fastdl.data``): its producer thread, which takes batches from the wrapped
iterator and stages them (``stage``: ring slot, device copy) or hands them on as they are (a plain CPU target), the
queue between the two threads, and the consumer's iterator (``PrefetchIter``), which owns the thread."""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import warnings
import weakref
from collections.abc import Iterator

import torch

from ._loader_batch import flatten, tensor_bytes, unflatten
from ._loader_ring import Ring, Stats, align, clock
from .ops.loader import contiguous_strides, dense, loader_fill, using_copy_backend

THREAD_NAME = "fastdl-prefetch"
# ``loader`` below is the fastdl.data.PrefetchLoader that starts the pass (not imported: data imports this module)

class End:
    pass


class ProducerError:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class Item:
    __slots__ = ("spec", "tensors", "event", "record")

    def __init__(self, spec, tensors, event=None, record=()):
        self.spec = spec
        self.tensors = tensors
        self.event = event
        self.record = record


class Shared:
    """State shared by one iteration's consumer (``PrefetchIter``) and its producer thread. The thread holds only
    this object, never the iterator, so dropping the iterator (``break``, ``del``) triggers its cleanup."""

    def __init__(self, it, cfg: dict, ring: Ring | None, stats: Stats, skip: int, depth: int):
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
        drain(sh.q)
        t = sh.thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout=1.0)


atexit.register(_stop_all)


def drain(q: queue.Queue) -> None:
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


def stage(sh: Shared, batch) -> Item:
    """Copy the tensors of ``batch`` into a ring slot (and to the device); return what the consumer needs."""
    cfg, ring, stats = sh.cfg, sh.ring, sh.stats
    cuda: bool = cfg["cuda"]
    device: torch.device = cfg["device"]
    leaves: list[torch.Tensor] = []
    spec = flatten(batch, leaves)
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
        off = align(off)
        staged.append((i, t, off, nbytes, keep, strides))
        off += nbytes
    total = off
    oversize = total > ring.max_slot_bytes
    if oversize:  # larger than the bounded ring allows: no staging for this batch
        direct += [s[0] for s in staged]
        direct.sort()
        staged, total = [], 0

    t0 = clock()
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
            dbuf = torch.empty(align(total), dtype=torch.uint8, device=device)  # on the side stream
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
            record += device_buffers(t)
    if cuda and (direct or staged):
        if event is None or direct:
            event = torch.cuda.Event()
            event.record(cfg["stream"])
        sh.poll_timing()
    with stats.lock:
        stats.copy_s += clock() - t0
        stats.bytes += nbytes
        stats.oversize += oversize
    return Item(spec, out, event, record)


def device_buffers(t: torch.Tensor) -> list[torch.Tensor]:
    """Plain tensors viewing ``t``'s device memory, for ``record_stream`` (which a nested tensor does not take; it
    protects the whole allocation through any view of it)."""
    if not t.is_nested:
        return [t]
    if t.layout == torch.jagged:
        return [b for b in (t.values(), t.offsets(), t.lengths()) if b is not None]
    parts = t.unbind()  # strided nested layout: one buffer, every component a view of it
    return [parts[0]] if parts else []


def produce(sh: Shared) -> None:
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
        stage_batches = cfg["stage"]
        t0 = clock()
        for _ in range(sh.skip):  # resume: fast-forward without staging
            if sh.stop.is_set():
                return
            try:
                next(it)
            except StopIteration:
                sh.put_or_hold(End)
                return
        with stats.lock:
            stats.produce_s += clock() - t0
        while not sh.stop.is_set():
            t0 = clock()
            try:
                batch = next(it)
            except StopIteration:
                break
            if stage_batches:
                with stats.lock:
                    stats.produce_s += clock() - t0
                with using_copy_backend(cfg["copy_backend"]):  # the pass's copy backend, for the copy ops only
                    item = stage(sh, batch)
            else:  # nothing to copy: the batch goes to the consumer as it is (unflatten returns an "o" spec's object)
                nbytes = tensor_bytes(batch)
                with stats.lock:
                    stats.produce_s += clock() - t0
                    stats.bytes += nbytes
                item = Item(("o", batch), ())
            del batch
            if not sh.put_or_hold(item):
                return
            del item
        else:
            return  # stopped before taking another batch from the wrapped iterator
        sh.put_or_hold(End)
    except BaseException as exc:  # noqa: B036  (hand everything, KeyboardInterrupt included, to the consumer)
        sh.put_or_hold(ProducerError(exc))
    finally:
        sh.it = None
        if ctx is not None:
            ctx.__exit__(None, None, None)


# ----------------------------------------------------------------------------------------------------------------
# consumer side


class PrefetchIter:
    """One pass: a producer thread, a queue and (when it stages batches) a ring of its own. ``src`` is the wrapped
    loader's iterator (made by the caller, in the caller's thread: DataLoader workers are started from there);
    ``one_shot``: ``src`` is the wrapped object itself (a generator), so what the producer took from it and the
    consumer did not get is handed back to the loader when the pass stops (``leftover``: the next pass delivers it
    first)."""

    def __init__(self, loader, src: Iterator, skip: int, one_shot: bool, leftover: list):
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
        self._sh = sh = Shared(src, loader._cfg(), ring, loader._stats, skip, loader.depth)
        if leftover:  # staged by the previous pass over this one-shot source: first in line (before the thread runs)
            sh.q.queue.extend(leftover)
        _LIVE.add(sh)
        self._stats.pass_started()
        if loader.progress:
            self._bar = make_bar(loader, skip)
        sh.thread = threading.Thread(target=produce, args=(sh,), name=THREAD_NAME, daemon=True)
        sh.thread.start()

    def __iter__(self):
        return self

    def _get(self, sh: Shared):
        t_start = clock()
        while True:
            try:
                return sh.q.get(timeout=0.05)
            except queue.Empty:
                if not sh.thread.is_alive() and sh.q.empty():
                    raise RuntimeError("fastdl PrefetchLoader: the producer thread exited unexpectedly") from None
                if self._timeout and clock() - t_start > self._timeout:
                    raise TimeoutError(
                        f"fastdl PrefetchLoader: no batch from the wrapped loader within {self._timeout} s"
                    ) from None

    def __next__(self):
        sh = self._sh
        if sh is None:
            raise StopIteration
        t0 = clock()
        try:
            item = self._get(sh)
        except BaseException:  # KeyboardInterrupt while waiting, timeout: stop the thread, then propagate
            self.close()
            raise
        self._stats.wait_s += clock() - t0
        if item is End:
            self._finish()
            raise StopIteration
        if isinstance(item, ProducerError):
            self.close()
            exc = item.exc
            del item
            raise exc  # carries the producer-side traceback (the wrapped loader's frames)
        if item.event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(item.event)
            for t in item.record:
                t.record_stream(stream)
        batch = unflatten(item.spec, iter(item.tensors))
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
        now = clock()
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
        drain(sh.q)
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


def make_bar(loader, skip: int):
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
