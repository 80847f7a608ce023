"""The loader's host copies: the ops ``fastdl.data.PrefetchLoader`` stages batches with.

Ops (``torch.ops.fastdl.<name>``; every backend implements exactly this):

``loader_fill(src: Tensor[], dst uint8 [n], offsets: int[], keep_strides: int[], num_threads) -> ()``
    Copy ``src[i]`` into the bytes ``dst[offsets[i] : offsets[i] + nbytes_i]`` (``nbytes_i = numel * itemsize``).
    ``keep_strides[i] = 1``: ``src[i]`` is non-overlapping and dense and its memory span is copied verbatim (its
    strides stay valid there, e.g. channels_last); ``0``: copied as a C-contiguous tensor (conj/neg views resolved).
    ``num_threads > 1`` lets the C++ kernel split large copies across helper threads. Every ``src[i]`` and ``dst``
    are CPU tensors; ``offsets[i]`` is a multiple of ``src[i]``'s item size. The C++ kernel (csrc/cpu/loader.cpp) runs
    with the GIL released, so the Python consumer keeps running while the producer thread copies.
``loader_use_count(t) -> int``
    References to ``t``'s storage (tensors and views sharing it): the loader reuses a CPU ring slot only when nothing
    but the ring holds it.

Backends: ``cpp`` (csrc/cpu/loader.cpp) and ``torch`` (``Tensor.copy_``, which releases the GIL as well), chosen
like every other op's (``FASTDL_BACKEND``, ``fastdl.use_backend``); the loader picks one when a pass starts
(``select_copy_backend``) and its producer thread runs the whole pass with it (``using_copy_backend``).
``copy_backend_status`` says which one ``fastdl info`` reports, and why not C++.
"""

from __future__ import annotations

import torch

from .. import backends
from ._library import define, require, require_device, require_dtype

FILL_SCHEMA = "(Tensor[] src, Tensor(a!) dst, int[] offsets, int[] keep_strides, int num_threads) -> ()"
USE_COUNT_SCHEMA = "(Tensor t) -> int"


# ----------------------------------------------------------------------------------------------- argument checks
def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (the same rule as c10): its elements fill exactly numel * itemsize bytes."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def check_fill(src, dst, offsets, keep_strides, num_threads) -> None:
    fn = "loader_fill"
    require_dtype(isinstance(dst, torch.Tensor), lambda: f"{fn}: dst must be a Tensor, got {type(dst).__name__}")
    require_device(dst.device.type == "cpu", lambda: f"{fn}: dst must be a CPU tensor, got device {dst.device}")
    require_dtype(dst.dtype == torch.uint8, lambda: f"{fn}: dst must be torch.uint8, got dtype {dst.dtype}")
    require(dst.is_contiguous(), lambda: f"{fn}: dst must be contiguous, got strides {dst.stride()}")
    n = len(src)
    require(
        len(offsets) == n,
        lambda: f"{fn}: offsets must have one entry per src tensor ({n}), got {len(offsets)}",
    )
    require(
        len(keep_strides) == n,
        lambda: f"{fn}: keep_strides must have one entry per src tensor ({n}), got {len(keep_strides)}",
    )
    require(num_threads >= 1, lambda: f"{fn}: num_threads must be >= 1, got {num_threads}")
    for i, s in enumerate(src):
        _check_src(fn, i, s, offsets[i], keep_strides[i], dst.numel())


def _check_src(fn, i, s, off, keep, capacity) -> None:
    require_dtype(isinstance(s, torch.Tensor), lambda: f"{fn}: src[{i}] must be a Tensor, got {type(s).__name__}")
    require_device(s.device.type == "cpu", lambda: f"{fn}: src[{i}] must be a CPU tensor, got device {s.device}")
    require_dtype(
        s.layout == torch.strided and not s.is_nested and not s.is_quantized,
        lambda: f"{fn}: src[{i}] must be a strided, non-quantized tensor, got layout {s.layout}"
        f"{' (a nested tensor)' if s.is_nested else ''}, dtype {s.dtype}",
    )
    # Python ints do not overflow: an offset near 2**63 or a size of an expanded tensor past 2**63 bytes is
    # rejected here exactly (the C++ kernel checks the same with overflow-checked arithmetic)
    nbytes = s.numel() * s.element_size()
    require(
        off >= 0 and off % s.element_size() == 0 and off + nbytes <= capacity,
        lambda: f"{fn}: offsets[{i}] = {off} with {nbytes} bytes must be a multiple of the item size "
        f"({s.element_size()}) and lie inside dst ({capacity} bytes)",
    )
    if keep and nbytes:
        require(
            dense(s) and not s.is_conj() and not s.is_neg(),
            lambda: f"{fn}: keep_strides[{i}] = 1 requires a non-overlapping and dense src tensor without "
            f"conj/neg bit, got sizes {tuple(s.shape)}, strides {s.stride()}",
        )


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


# ------------------------------------------------------------------------------------------------ loader_fill
def _fill_fake(src, dst, offsets, keep_strides, num_threads):
    check_fill(src, dst, offsets, keep_strides, num_threads)


def _fill_reference(src, dst, offsets, keep_strides, num_threads):
    check_fill(src, dst, offsets, keep_strides, num_threads)
    for s, off, keep in zip(src, offsets, keep_strides):
        nbytes = s.numel() * s.element_size()
        if nbytes == 0:
            continue
        span = dst[off : off + nbytes].view(s.dtype)  # contiguous uint8 bytes read as s's dtype
        strides = s.stride() if keep else contiguous_strides(s.shape)
        span.as_strided(s.shape, strides, span.storage_offset()).copy_(s)


loader_fill_op = define("loader_fill", FILL_SCHEMA, reference=_fill_reference, fake=_fill_fake, check=check_fill)


# ------------------------------------------------------------------------------------------------ loader_use_count
def check_use_count(t) -> None:
    """A strided tensor with a storage (what the loader's ring slots are); sparse, nested and other layouts have no
    single storage to count: TypeError on every backend."""
    fn = "loader_use_count"
    require_dtype(isinstance(t, torch.Tensor), lambda: f"{fn}: t must be a Tensor, got {type(t).__name__}")
    require_dtype(
        t.layout == torch.strided and not t.is_nested,
        lambda: f"{fn}: t must be a strided tensor with a storage, got layout {t.layout}"
        f"{' (a nested tensor)' if t.is_nested else ''}",
    )


def _use_count_fake(t):
    check_use_count(t)
    return 1  # a fake tensor has no storage to share: as if only the caller held it


def _use_count_reference(t):  # t checked by check_use_count (define's check)
    # by the StorageImpl's address: t.untyped_storage() would create a Python storage object, which the storage then
    # keeps (PyObject preservation) and which would count as one more reference from then on
    return torch._C._storage_Use_Count(torch._C._storage_address(t))


loader_use_count_op = define("loader_use_count", USE_COUNT_SCHEMA, reference=_use_count_reference, fake=_use_count_fake,
                             check=check_use_count)  # fmt: skip


# ------------------------------------------------------------------------------------------- the copies' backend
COPY_BACKENDS = ("auto", "cpp", "torch")


def select_copy_backend(copy_backend: str = "auto") -> str:
    """The backend of the copy ops for a pass started now in this thread.

    "auto" follows ``fastdl.use_backend`` / ``FASTDL_BACKEND`` like every other op (auto: C++ when the extension is
    built, else torch); "cpp" or "torch" is the loader's own explicit choice. An explicit choice that cannot be
    honoured raises ``fastdl.BackendUnavailableError``."""
    if copy_backend not in COPY_BACKENDS:
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


def copy_backend_status() -> tuple[str, str]:
    """What "auto" gives here, for ``fastdl info``: ``(backend, why not C++)``, or ``("unavailable", why)`` when
    ``FASTDL_BACKEND`` names a backend the copies do not have."""
    try:
        backend = select_copy_backend("auto")
    except backends.BackendUnavailableError as exc:
        return "unavailable", str(exc)
    if backend == "cpp":
        return backend, ""
    return backend, next((why for b, ok, why in backends.explain("loader_fill", "cpu") if b == "cpp" and not ok), "")


def using_copy_backend(name: str):
    """A block whose copy ops run on backend ``name`` (the loader's producer thread runs a whole pass in one)."""
    return backends.use_backend(name)


# ------------------------------------------------------------------------------------------------ public API
def loader_fill(
    src: list[torch.Tensor], dst: torch.Tensor, offsets: list[int], keep_strides: list[int], num_threads: int = 1
) -> None:
    """Copy each ``src[i]`` into ``dst`` (uint8) at byte offset ``offsets[i]`` (see the module docstring)."""
    if type(dst) is not torch.Tensor or any(type(s) is not torch.Tensor for s in src):
        # a tensor subclass (a jagged nested tensor, ...) would be dispatched to its own handler, which does not
        # know this op: check first, so it gets this op's TypeError
        check_fill(src, dst, offsets, keep_strides, num_threads)
    loader_fill_op(src, dst, offsets, keep_strides, num_threads)


def loader_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (1 when only ``t`` holds it). ``t`` must be a strided tensor (TypeError)."""
    if type(t) is not torch.Tensor:  # a subclass (a jagged nested tensor): this op's TypeError, not its handler's
        check_use_count(t)
    return loader_use_count_op(t)


__all__ = ["loader_fill", "loader_use_count"]
