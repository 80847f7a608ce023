"""Which implementation serves an op on a device.

Backends:
  cpp     the compiled extension fastdl._C (C++ CPU kernels, CUDA C++ kernels), registered as ``fastdl_cpp::<op>``
  triton  Triton kernels (``fastdl.kernels``) on CUDA; on the CPU only under TRITON_INTERPRET=1 (tests)
  torch   the pure-PyTorch reference in ``fastdl.ops`` (always available)

Choose with ``FASTDL_BACKEND=auto|cpp|triton|torch`` or ``with fastdl.use_backend("torch"): ...``. ``auto`` takes the
first available backend in the op's preference order for the device and records why the others were passed over
(``fastdl info`` prints it); an explicit choice that cannot be honoured raises ``BackendUnavailableError``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

BACKENDS = ("cpp", "triton", "torch")
_VALID = ("auto",) + BACKENDS

# Per-op registry filled by fastdl.ops: name -> {"prefer": {device_type: (backends...)}, "triton": callable or None,
# "supports": callable(args) -> str | None (reason a backend cannot take these inputs)}
_OPS: dict[str, dict] = {}


class _Local(threading.local):
    # The use_backend stack of this thread. A class default, so that reading it where no block was entered finds it
    # at once: getattr(local, "stack", None) on a threading.local without it costs ~0.8 us (a caught AttributeError),
    # on every op call.
    stack: list[str] | None = None


_local = _Local()


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this op on this device."""


def register_op(name: str, prefer: dict[str, tuple[str, ...]], triton_impl=None, supports=None) -> None:
    _OPS[name] = {"prefer": prefer, "triton": triton_impl, "supports": supports}
    _PLANS.clear()


# Environment reads on every op call: ``os.environ.get`` encodes the key and decodes the value (~0.8 us each, two per
# call); the mapping behind ``os.environ`` (updated by every ``os.environ[...] =``, ``monkeypatch.setenv``, ...) is read
# directly with the key encoded once (~0.05 us). Falls back to ``os.environ`` where that mapping is not there.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS: dict[str, object] = {}


def _getenv(name: str) -> str | None:
    if _ENV_DATA is None:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    raw = _ENV_DATA.get(key)
    return None if raw is None else os.environ.decodevalue(raw) if isinstance(raw, bytes) else raw


_PARSED: dict[object, str] = {}  # raw FASTDL_BACKEND value -> the valid name it asks for


def requested() -> str:
    """The backend asked for: the innermost ``use_backend`` block, else FASTDL_BACKEND, else 'auto'."""
    stack = _local.stack
    if stack:
        return stack[-1]
    raw = _getenv("FASTDL_BACKEND")
    env = _PARSED.get(raw)
    if env is None:
        env = (raw or "auto").strip().lower() or "auto"
        if env not in _VALID:
            raise ValueError(f"FASTDL_BACKEND={env!r} is not one of {', '.join(_VALID)}")
        _PARSED[raw] = env
    return env


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops inside the block with backend ``name`` ('auto', 'cpp', 'triton' or 'torch'); per thread."""
    name = name.strip().lower()
    if name not in _VALID:
        raise ValueError(f"unknown fastdl backend {name!r}; expected one of {', '.join(_VALID)}")
    stack = _local.stack
    if stack is None:
        stack = _local.stack = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


# The oldest triton the Triton kernels are tested with (CI's second job: torch 2.11 + triton 3.6). Older versions
# miss language features they use (e.g. tl.dot's out_dtype handling, libdevice under triton.language.extra).
MIN_TRITON = (3, 6)


@functools.cache
def _triton_importable() -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    try:
        from importlib.metadata import version as _dist_version

        version = _dist_version("triton")
        have = tuple(int(v) for v in version.split("+")[0].split(".")[:2])
    except Exception:  # an unusual install (source build without metadata): do not block it
        return True, ""
    if have < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        why = f"triton {version} is older than {need}, the oldest version fastdl's Triton kernels are tested with"
        return False, f"{why} (pip install 'triton>={need}')"
    return True, ""


def _interpreting() -> bool:
    return _getenv("TRITON_INTERPRET") == "1"


@functools.cache
def _cuda_usable() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, ""


_AVAILABLE: dict[tuple, tuple[bool, str]] = {}


_EXT: list = []


def _extension_state() -> dict:
    if not _EXT:
        from . import _extension

        _EXT.append(_extension._state)
    return _EXT[0]


def available(backend: str, op: str, device_type: str) -> tuple[bool, str]:
    """Can ``backend`` serve ``op`` on ``device_type``? Returns (ok, reason-if-not).

    Answers are cached per (backend, op, device, extension loaded, interpreter mode): this runs on every op call."""
    from . import _extension

    key = (backend, op, device_type, _extension._state["module"] is not None, _interpreting())
    hit = _AVAILABLE.get(key)
    if hit is None:
        hit = _AVAILABLE[key] = _available_uncached(backend, op, device_type)
        if backend == "cpp" and not hit[0] and not _extension._state["attempted"]:
            del _AVAILABLE[key]  # the extension was not even tried yet: do not remember the miss
    return hit


def _available_uncached(backend: str, op: str, device_type: str) -> tuple[bool, str]:
    import torch

    if backend == "torch":
        return True, ""
    if backend == "cpp":
        from . import _extension

        if not _extension.ensure_loaded():
            return False, "compiled extension fastdl._C is not loaded"
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
        if key is None:
            return False, f"no C++ kernels for device type {device_type!r}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastdl_cpp::{op}", key):
            if key == "CUDA" and not _extension.extension_info()["with_cuda"]:
                return False, "fastdl._C was built without CUDA sources"
            return False, f"fastdl._C has no {key} kernel for {op}"
        return True, ""
    if backend == "triton":
        info = _OPS.get(op)
        if info is None or info["triton"] is None:
            return False, f"no Triton kernel for {op}"
        ok, why = _triton_importable()
        if not ok:
            return False, why
        if device_type == "cpu":
            if not _interpreting():
                return False, "Triton runs on the CPU only in interpreter mode (TRITON_INTERPRET=1)"
            return True, ""
        if device_type != "cuda":
            return False, f"no Triton kernels for device type {device_type!r}"
        return _cuda_usable()
    raise ValueError(f"unknown fastdl backend {backend!r}")


def preference(op: str, device_type: str) -> tuple[str, ...]:
    info = _OPS.get(op)
    prefer = info["prefer"] if info else {}
    return prefer.get(device_type, ("torch",))


# select(): the available backends of (op, device, request, interpreter mode, extension loaded), in preference order,
# cached once the extension was tried (the per-call part is then one lookup and the op's ``supports`` on the inputs:
# 5.6 -> 1.3-1.9 us per call, thread CPU time on the loaded 2-core Zen 4).
_PLANS: dict[tuple, tuple] = {}


def select(op: str, device_type: str, args: tuple = ()) -> str:
    """The backend that serves ``op`` for these inputs on ``device_type`` right now."""
    want = requested()
    if want == "auto":
        ext = _extension_state()
        key = (op, device_type, _interpreting(), ext["module"] is not None)
        plan = _PLANS.get(key)
        if plan is None:
            plan = tuple(b for b in preference(op, device_type) if available(b, op, device_type)[0])
            if ext["attempted"]:
                _PLANS[key] = plan
        supports = _OPS[op]["supports"] if op in _OPS else None
        for backend in plan:
            if supports is None or not args or supports(backend, args) is None:
                return backend
        return "torch"
    supports = (_OPS.get(op) or {}).get("supports")
    ok, why = available(want, op, device_type)
    if ok and supports is not None and args:
        reason = supports(want, args)
        ok, why = reason is None, reason
    if not ok:
        raise BackendUnavailableError(
            f"fastdl: backend {want!r} was requested for {op} on {device_type} but cannot serve it: {why}. "
            f"Use FASTDL_BACKEND=auto (or fastdl.use_backend('auto')) to fall back automatically."
        )
    return want


def explain(op: str, device_type: str) -> list[tuple[str, bool, str]]:
    """For ``fastdl info``: each backend in preference order, whether it is available, and why not."""
    rows = []
    for backend in preference(op, device_type):
        ok, why = available(backend, op, device_type)
        rows.append((backend, ok, why))
    return rows


def registered_ops() -> list[str]:
    return sorted(_OPS)
