"""Run-time choice of a layer's execution path per input shape, measured, with a decision cache.

A converted layer can often compute its output in more than one way from the weights it holds: ``FusedLinear`` with
the fused op or with ``F.linear`` + the activation; ``Int8Linear`` with its int8 kernel or with ``F.linear`` on the
dequantized weight; ``Sparse24Linear`` with the sparse kernel, the decompressed dense weight or (CUDA) PyTorch's
semi-structured GEMM. Which one is fastest depends on the number of rows ``M`` (the input flattened to ``[M, K]``),
the CPU or GPU, the dtype and the layer's shape, so the layer decides per **bucket** of ``M``: the powers of two
``[2^(b-1), 2^b)`` (1, 2-3, 4-7, 8-15, ...).

How a decision is made
  The first call at a new bucket that runs without autograd (``torch.no_grad()`` / ``torch.inference_mode()``),
  outside ``torch.compile`` and outside autocast, times every path the layer's weights allow on that very input,
  calls interleaved: one warm-up call each, then rounds of one call each, at least ``MIN_REPS`` (3), until the rounds
  have taken ``BUDGET_S`` (2 ms) per path and two calls of each path agree within 3 % on its fastest time, or
  ``MAX_BUDGET_S`` (10 ms) per path, or ``MAX_REPS`` (15) rounds. A path's time is the fastest of its calls
  (interference from other processes only adds time). When a call takes ``LONG_CALL_S`` (5 ms) or more, the timing
  ends after the first timed round: each path runs twice (the warm-up, also timed, and one timed call; the faster
  counts) and the decision is final.

  The bound: a new bucket costs 2-15 ms per path for calls under 5 ms (plus up to two re-timings, below), or exactly
  two calls of each path for longer calls - the first call at a bucket of 45 ms calls with 2 paths runs 4 timed calls
  (~180 ms) before its own, and every later call runs only the chosen path, after a dictionary lookup (~0.3 us). A
  timing that stopped at ``MAX_BUDGET_S`` before two calls of each path agreed gives a *provisional* decision (source
  "provisional"): it is used, and the next no-grad calls at that bucket time the paths again, at most ``RETRIES`` (2)
  more times, keeping each path's fastest call over all the timings (on a busy machine whole 20 ms spells are lost to
  other processes: a single timing picked a path 2.5x slower). The layer keeps its default path unless another one is
  faster by more than ``MARGIN`` (2 %). Calls with autograd (training), inside ``torch.compile`` and under autocast
  never time anything: they use a decision made earlier for their bucket, or the default path. ``fastdl.convert(model,
  ..., workload=...)`` makes the decisions of the workload's buckets while it converts. Decide on a quiet machine:
  timings taken while other processes compete for the cores can pick the slower path (then save the good decisions, or
  clear them and let the layers decide again).

What a decision is keyed by
  ``(machine, device, dtype, layer, bucket)``: the machine is the CPU model, the ISA level fastdl's kernels run at
  (``fastdl.info()["cpu"]``: capped by ``FASTDL_CPU_ISA``) and the thread count (``torch.get_num_threads()``), or
  the GPU's name; the layer is its kind and shape (e.g. ``("FusedLinear", 384, 1536, True, "gelu", False)``).
  Layers of the same kind and shape share decisions, so a model's repeated blocks time each shape once.

Keeping decisions
  Per process in memory (``decisions()`` lists them). ``save_decisions(path)`` writes them as JSON and
  ``load_decisions(path)`` reads them back (entries of another machine are kept but never match here). With
  ``FASTDL_DECISIONS_DIR=<dir>`` fastdl loads ``<dir>/fastdl-decisions.json`` on the first decision and rewrites it
  after each new measurement.

Turning it off
  ``FASTDL_CHOICE=off`` (or ``set_choice_mode("off")``) gives the fixed behaviour of earlier versions: every layer
  runs its default path. ``FASTDL_CHOICE=cached`` uses saved/loaded decisions but never times anything; ``measure``
  (the default) times new buckets. Per layer: ``module.runtime_choice = False`` (``fastdl.convert(...,
  runtime_choice=False)``) pins it to its default path.

Tests and tools can replace the timer with ``set_timer(fn)``: ``fn(calls, device, info) -> {path: seconds}`` where
``calls`` maps each path to a zero-argument callable and ``info`` holds ``rows``, ``bucket``, ``layer``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "MODES",
    "RuntimeChoice",
    "bucket_label",
    "bucket_of",
    "choice_mode",
    "clear_decisions",
    "decisions",
    "load_decisions",
    "save_decisions",
    "set_choice_mode",
    "set_timer",
    "time_calls",
]

MODES = ("measure", "cached", "off")
FILE_NAME = "fastdl-decisions.json"
FORMAT = "fastdl.decisions"
FORMAT_VERSION = 1
# Timing of a new bucket (per path): one warm-up call, then >= MIN_REPS timed calls, until BUDGET_S per path is spent
# or MAX_REPS rounds have run. At M = 1, K = N = 64 a call takes ~5-10 us: 15 rounds, ~0.3 ms for all paths; at
# M = 512, K = 384, N = 1536 (~1.5 ms a call) 3 rounds; a call of more than BUDGET_S gets 1 + MIN_REPS calls.
MIN_REPS = 3
MAX_REPS = 15
BUDGET_S = 2e-3
# ... and, past BUDGET_S, until two calls of each path agree on its fastest time within SETTLED, at most MAX_BUDGET_S
# per path (or MIN_REPS calls). On the 2-core development machine under load 6 (other builds), an A/A test (one call
# timed as two paths) gave |a/b - 1| above 30 % in 10 % of the decisions at M = 1 with the fixed budget alone.
SETTLED = 0.03
MAX_BUDGET_S = 10e-3
# An unsettled timing (MAX_BUDGET_S reached first) is repeated on up to RETRIES later calls at the bucket. On the
# 2-core development machine with one core kept busy by another process, Int8Linear weight-only 384 -> 1536 at M = 128
# got 6.1 ms for its dequant path (2.4 ms in a quiet spell) in one timing and kept the 1.5x slower kernel.
RETRIES = 2
# A call of LONG_CALL_S or more (any path's first timed call) ends the timing after that round: each path has run twice
# (warm-up and one timed call; its time is the faster of the two) and the decision is final, never provisional. At
# M = 512, K = N = 4096 (45-92 ms a call) the unsettled timings and their retries made the first 3 calls of a
# Sparse24Linear cost 464 ms each instead of 92 ms. Below it a timing spends at most MAX_BUDGET_S + one round per
# path (< 15 ms plus the warm-up), three times at most (RETRIES).
LONG_CALL_S = 5e-3
# Another path replaces the default only when its median is more than 2 % faster: run-to-run noise of the medians
# on the 2-core development machine is ~1-2 %, and the default path is what earlier versions always ran.
MARGIN = 0.02


def bucket_of(rows: int) -> int:
    """The bucket of ``rows`` rows: ``b`` such that ``2^(b-1) <= rows < 2^b`` (``rows.bit_length()``; 0 for 0)."""
    return int(rows).bit_length()


def bucket_label(bucket: int) -> str:
    """'M 16-31' for bucket 5 ('M 0' for bucket 0, 'M 1' for bucket 1)."""
    if bucket <= 1:
        return f"M {bucket}"
    return f"M {1 << (bucket - 1)}-{(1 << bucket) - 1}"


@dataclass
class Decision:
    path: str
    times_ms: dict[str, float] = field(default_factory=dict)
    source: str = "measured"  # measured | provisional | loaded | convert
    tries: int = 1  # timings behind a provisional decision


class _State:
    def __init__(self) -> None:
        mode = os.environ.get("FASTDL_CHOICE", "measure").strip().lower() or "measure"
        if mode not in MODES:
            import warnings

            warnings.warn(
                f"fastdl: FASTDL_CHOICE={mode!r} is not one of {', '.join(MODES)}; using 'measure'", stacklevel=2
            )
            mode = "measure"
        self.mode = mode
        self.decisions: dict[tuple, Decision] = {}
        self.generation = 0  # bumped whenever decisions or the mode change: per-module caches compare it
        self.modules: weakref.WeakSet = weakref.WeakSet()
        self.machines: dict[str, str] = {}
        self.dir_loaded = False
        self.timer: Callable | None = None
        self.lock = threading.Lock()

    def changed(self, forget_local: bool = True) -> None:
        """Decisions or the mode changed: known misses are looked up again; with ``forget_local`` every module also
        forgets the decisions it holds (a loaded or cleared store, a new mode)."""
        self.generation += 1
        if forget_local:
            for mod in list(self.modules):
                mod._choice_local.clear()


_STATE = _State()


# ------------------------------------------------------------------------------------------------ keys
def machine_key(device: torch.device) -> str:
    """'cpu:<model>|<isa level>|<threads>t' or 'cuda:<GPU name>' (the machine part of a decision's key)."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = f"cuda{idx}"
        if key not in _STATE.machines:
            _STATE.machines[key] = "cuda:" + torch.cuda.get_device_name(idx)
        return _STATE.machines[key]
    if device.type != "cpu":
        return device.type
    if "cpu" not in _STATE.machines:
        from . import _extension

        info = _extension.cpu_info()
        _STATE.machines["cpu"] = f"cpu:{info.get('model', 'unknown')}|{info.get('level', 'unknown')}"
    return f"{_STATE.machines['cpu']}|{torch.get_num_threads()}t"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decision_key(device: torch.device, dtype: torch.dtype, layer: tuple, bucket: int) -> tuple:
    return (machine_key(device), device.type, _dtype_name(dtype), tuple(layer), int(bucket))


# ------------------------------------------------------------------------------------------------ mode
def choice_mode() -> str:
    """'measure' (default), 'cached' or 'off' (``FASTDL_CHOICE``, or ``set_choice_mode``)."""
    return _STATE.mode


def set_choice_mode(mode: str) -> str:
    """Set the mode for this process ('measure', 'cached', 'off'); returns the previous one."""
    if mode not in MODES:
        raise ValueError(f"fastdl.set_choice_mode: mode must be one of {', '.join(MODES)}, got {mode!r}")
    prev, _STATE.mode = _STATE.mode, mode
    if prev != mode:
        _STATE.changed()
    return prev


# ------------------------------------------------------------------------------------------------ the store
def _lookup(key: tuple) -> Decision | None:
    _maybe_load_dir()
    return _STATE.decisions.get(key)


def record(key: tuple, decision: Decision) -> None:
    """Store a decision (and rewrite the cache directory's file when one is set)."""
    with _STATE.lock:
        _STATE.decisions[key] = decision
    _STATE.changed(forget_local=False)
    _save_dir()


def _entries(store: dict) -> list[dict]:
    out = []
    for (machine, device, dtype, layer, bucket), d in sorted(store.items(), key=lambda kv: repr(kv[0])):
        out.append({
            "machine": machine, "device": device, "dtype": dtype, "layer": list(layer), "bucket": bucket,
            "rows": bucket_label(bucket), "path": d.path, "times_ms": dict(d.times_ms), "source": d.source,
        })
    return out


def decisions() -> list[dict]:
    """Every decision this process knows, as JSON-ready dicts (``machine, device, dtype, layer, bucket, rows,
    path, times_ms, source``)."""
    return _entries(dict(_STATE.decisions))


def clear_decisions() -> None:
    """Forget every decision of this process (files are left alone)."""
    with _STATE.lock:
        _STATE.decisions.clear()
    _STATE.changed()


def _write(path: str, store: dict) -> int:
    entries = _entries(store)
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "decisions": entries}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one
    return len(entries)


def save_decisions(path: str | os.PathLike) -> int:
    """Write every decision of this process to ``path`` (JSON); returns how many."""
    return _write(os.fspath(path), dict(_STATE.decisions))


def _read(path: str) -> dict:
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"fastdl.load_decisions: {path} is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"fastdl.load_decisions: {path} is not a fastdl decisions file (no format {FORMAT!r})")
    if not isinstance(doc.get("version"), int) or doc["version"] > FORMAT_VERSION:
        raise ValueError(
            f"fastdl.load_decisions: {path} has format version {doc.get('version')!r}; this fastdl reads up to "
            f"{FORMAT_VERSION}"
        )
    loaded = {}
    for e in doc.get("decisions", []):
        try:
            key = (str(e["machine"]), str(e["device"]), str(e["dtype"]), _as_tuple(e["layer"]), int(e["bucket"]))
            loaded[key] = Decision(str(e["path"]), {str(k): float(v) for k, v in e.get("times_ms", {}).items()},
                                   "provisional" if e.get("source") == "provisional" else "loaded",
                                   RETRIES + 1)  # a loaded provisional decision is not re-timed
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fastdl.load_decisions: {path}: bad entry {e!r:.200} ({exc})") from exc
    return loaded


def load_decisions(path: str | os.PathLike, *, replace: bool = False) -> int:
    """Read decisions written by ``save_decisions`` (merged into this process's: a loaded entry replaces one with the
    same key; ``replace=True`` forgets the others first). Returns how many entries were read. A file that is not a
    decisions file raises ValueError naming it."""
    loaded = _read(os.fspath(path))
    with _STATE.lock:
        if replace:
            _STATE.decisions.clear()
        _STATE.decisions.update(loaded)
    _STATE.changed()
    return len(loaded)


def _as_tuple(v):
    return tuple(_as_tuple(x) for x in v) if isinstance(v, list) else v


def _cache_file() -> str | None:
    d = os.environ.get("FASTDL_DECISIONS_DIR")
    return os.path.join(d, FILE_NAME) if d else None


def _maybe_load_dir() -> None:
    if _STATE.dir_loaded:
        return
    _STATE.dir_loaded = True
    f = _cache_file()
    if f and os.path.isfile(f):
        try:
            load_decisions(f)
        except (OSError, ValueError) as exc:
            import warnings

            warnings.warn(f"fastdl: could not read the decisions cache {f}: {exc}", stacklevel=3)


def _save_dir() -> None:
    """Rewrite the cache directory's file: its entries (other processes may have added some) updated with ours."""
    f = _cache_file()
    if not f:
        return
    try:
        os.makedirs(os.path.dirname(f) or ".", exist_ok=True)
        store = {}
        if os.path.isfile(f):
            try:
                store = _read(f)
            except ValueError:
                store = {}
        store.update(_STATE.decisions)
        _write(f, store)
    except OSError as exc:
        import warnings

        warnings.warn(f"fastdl: could not write the decisions cache {f}: {exc}", stacklevel=3)


# ------------------------------------------------------------------------------------------------ timing
def set_timer(fn: Callable | None) -> Callable | None:
    """Replace the timer (``fn(calls, device, info) -> {name: seconds}``; None restores the real one). Returns the
    previous replacement (None for the real timer). For tests: make choices deterministic."""
    prev, _STATE.timer = _STATE.timer, fn
    return prev


def time_calls(calls: dict[str, Callable[[], object]], device: torch.device, info: dict | None = None, *,
               budget_s: float = BUDGET_S, max_budget_s: float = MAX_BUDGET_S, max_reps: int = MAX_REPS,
               long_call_s: float = math.inf, cold: bool = False) -> dict:
    """Seconds per call of each callable (the fastest of its timed calls), calls interleaved (a slow spell of the
    machine hits all of them), bounded as the module docstring says (``fastdl.convert`` passes larger bounds: it runs
    once, when asked). With ``long_call_s`` (the run-time choice uses LONG_CALL_S), a first timed round in which a
    call took that long ends the timing. ``cold`` (CPU): the caches are evicted before each timed call (outside the
    timing and the budget), so each call reads its weights from memory, as in a model whose weights together exceed
    the last-level cache. Uses the replacement timer when one is set (``info["cold"]`` tells it)."""
    return _time_calls(calls, device, info, budget_s, max_budget_s, max_reps, long_call_s, cold)[0]


def _time_calls(calls, device, info, budget_s=BUDGET_S, max_budget_s=MAX_BUDGET_S, max_reps=MAX_REPS,
                long_call_s=LONG_CALL_S, cold=False):
    """(seconds per call of each callable, settled?): ``time_calls``, and whether two calls of each path agreed on
    its fastest time (always True for a replacement timer, and for long calls: see LONG_CALL_S)."""
    cold = cold and device.type == "cpu"
    if _STATE.timer is not None:
        return dict(_STATE.timer(calls, device, {**(info or {}), "cold": cold})), True
    evict = None
    if cold:
        from ._machine import evict_cpu_caches as evict
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    warm: dict[str, float] = {}
    with torch.no_grad():
        for n in names:  # warm-up (and builds lazily made caches)
            t0 = time.perf_counter()
            calls[n]()
            if sync:
                sync()
            warm[n] = time.perf_counter() - t0
        start, evicting = time.perf_counter(), 0.0
        for rep in range(max_reps):
            for n in names:
                if evict is not None:
                    t0 = time.perf_counter()
                    evict()
                    evicting += time.perf_counter() - t0
                t0 = time.perf_counter()
                calls[n]()
                if sync:
                    sync()
                times[n].append(time.perf_counter() - t0)
            if rep == 0 and max(v[0] for v in times.values()) >= long_call_s:
                # long calls: two calls of each path in all, and the decision is final. The warm-up counts as a
                # timing too: like interference, building a cache only ever adds time, so the faster of the two
                # calls is the path's time and one call hit by interference does not decide
                return {n: min(v[0], warm[n]) for n, v in times.items()}, True
            if rep + 1 < MIN_REPS:
                continue
            spent = time.perf_counter() - start - evicting
            if spent >= max_budget_s * len(names) or (spent >= budget_s * len(names) and _settled(times)):
                break
    # The minimum, not the median: interference from other processes only ever adds time, and on a busy 2-core
    # machine (load 6-8) a third of the calls of a 10 us layer took 15-30 ms - enough to flip a median of 3-5.
    return {n: min(v) for n, v in times.items()}, _settled(times)


def _settled(times: dict[str, list[float]]) -> bool:
    """Every path's fastest call is matched within SETTLED by another of its calls (two calls agree on it)."""
    for v in times.values():
        a, b = sorted(v)[:2]
        if b > a * (1.0 + SETTLED):
            return False
    return True


def pick(times: dict[str, float], default: str) -> str:
    """The fastest path, unless it is within MARGIN of the default path (then the default)."""
    best = min(times, key=times.get)
    if default in times and times[best] >= times[default] * (1.0 - MARGIN):
        return default
    return best


# ------------------------------------------------------------------------------------------------ the mixin
class RuntimeChoice:
    """Mixin of the modules that choose an execution path per input bucket.

    A subclass implements ``_choice_layer()`` (the layer part of the key), ``_choice_paths(x, *extra)`` (the paths
    its weights allow for this input, default first; one path means no choice) and ``_run_path(path, x, *extra)``;
    it may override ``_choice_released(kept)`` to drop caches that no chosen path needs. It calls
    ``self._init_choice()`` when built and ``self._choose(x, key, *extra)`` in forward, with
    ``key = (bucket_of(rows), x.dtype, ...)``.
    """

    _choice_local: dict
    _choice_miss: dict
    _runtime_choice: bool

    def _init_choice(self) -> None:
        self.__dict__["_choice_local"] = {}  # local key -> path: decisions this module uses (a plain dict lookup)
        self.__dict__["_choice_miss"] = {}  # local key -> generation at which the global store had nothing
        self.__dict__["_runtime_choice"] = True
        _STATE.modules.add(self)

    @property
    def runtime_choice(self) -> bool:
        """Whether this layer chooses its path per input bucket (True) or always runs its default path."""
        return self._runtime_choice

    @runtime_choice.setter
    def runtime_choice(self, value: bool) -> None:
        self.__dict__["_runtime_choice"] = bool(value)
        self._choice_local.clear()

    def _choice_layer(self) -> tuple:
        raise NotImplementedError

    def _choice_paths(self, x: torch.Tensor, *extra) -> tuple[str, ...]:
        raise NotImplementedError

    def _run_path(self, path: str, x: torch.Tensor, *extra) -> torch.Tensor:
        raise NotImplementedError

    def _choice_released(self, kept: set) -> None:
        """Called after a decision with the set of (path, dtype) the module's decisions now use."""

    def _choice_device(self) -> torch.device:
        for t in self.parameters(recurse=False):
            return t.device
        for t in self.buffers(recurse=False):
            return t.device
        return torch.device("cpu")

    def _choice_key(self, x: torch.Tensor, *extra) -> tuple:
        """The local key of x: (bucket of its rows, dtype)."""
        k = x.shape[-1] if x.dim() else 0
        return ((x.numel() // k if k else 0).bit_length(), x.dtype)

    def _choice_default(self, x: torch.Tensor, *extra) -> str:
        """The default path for ``x`` (what earlier versions always ran)."""
        return self._choice_paths(x, *extra)[0]

    def _choose(self, x: torch.Tensor, key: tuple, *extra) -> str:
        """The path for ``x`` (the slow part: the caller found no ``key`` in ``_choice_local``)."""
        if torch.compiler.is_compiling():
            return self._choice_default(x, *extra)  # no timing in a graph; a decision made before tracing was found
        if not self._runtime_choice or _STATE.mode == "off" or x.numel() == 0:
            path = self._choice_local[key] = self._choice_default(x, *extra)
            return path
        gen = _STATE.generation
        if self._choice_miss.get(key) == gen and (
            _STATE.mode != "measure" or torch.is_grad_enabled() or torch._C._is_any_autocast_enabled()
        ):
            return self._choice_default(x, *extra)  # known miss, and this call may not time: no lookup again
        paths = self._choice_paths(x, *extra)
        if len(paths) == 1:
            self._choice_local[key] = paths[0]
            return paths[0]
        d = _lookup(decision_key(x.device, x.dtype, self._choice_layer() + key[2:], key[0]))
        may_time = not (_STATE.mode != "measure" or torch.is_grad_enabled() or torch._C._is_any_autocast_enabled()
                        or torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled())
        if d is not None and d.path in paths:
            if d.source == "provisional" and d.tries <= RETRIES:
                # used, not kept in _choice_local: a later call that may time measures the bucket again
                return self._measure(x, key, paths, extra, d) if may_time else d.path
            self._choice_local[key] = d.path
            self._choice_released(self._kept_paths())
            return d.path
        self._choice_miss[key] = gen
        if not may_time:
            return paths[0]
        return self._measure(x, key, paths, extra)

    def _measure(self, x, key, paths, extra, earlier: Decision | None = None) -> str:
        """Time the paths on x and record the decision (with ``earlier``, a provisional decision: keep each path's
        fastest time over both timings)."""
        rows = x.numel() // max(x.shape[-1], 1)
        calls = {p: (lambda p=p: self._run_path(p, x, *extra)) for p in paths}
        info = {"rows": rows, "bucket": key[0], "layer": self._choice_layer() + key[2:], "purpose": "runtime"}
        times, settled = _time_calls(calls, x.device, info)
        tries = 1
        if earlier is not None:
            tries = earlier.tries + 1
            times = {p: min(t, earlier.times_ms.get(p, math.inf) / 1e3) for p, t in times.items()}
        path = pick({p: times[p] for p in paths if p in times}, paths[0])
        if settled or tries > RETRIES:
            self.record_choice(x, key, path, times)
        else:
            gkey = decision_key(x.device, x.dtype, self._choice_layer() + key[2:], key[0])
            record(gkey, Decision(path, {p: t * 1e3 for p, t in times.items()}, "provisional", tries))
        return path

    def known_path(self, x: torch.Tensor, *extra) -> str | None:
        """The decision for x's bucket if one was made (by this module or any layer of its kind and shape, or loaded),
        else None. Times nothing."""
        key = self._choice_key(x, *extra)
        path = self._choice_local.get(key)
        if path is not None or _STATE.mode == "off" or not self._runtime_choice or x.numel() == 0:
            return path
        d = _lookup(decision_key(x.device, x.dtype, self._choice_layer() + key[2:], key[0]))
        return d.path if d is not None and d.path in self._choice_paths(x, *extra) else None

    def record_choice(self, x: torch.Tensor, key: tuple, path: str, times: dict, source: str = "measured") -> None:
        """Store the decision ``path`` for ``x``'s bucket (process-wide, and in this module)."""
        gkey = decision_key(x.device, x.dtype, self._choice_layer() + key[2:], key[0])
        record(gkey, Decision(path, {p: t * 1e3 for p, t in times.items()}, source))
        self._choice_local[key] = path
        self._choice_released(self._kept_paths())

    def __setstate__(self, state):  # copy.deepcopy / pickle: a copy is a module of its own
        super().__setstate__(state)
        self.__dict__["_choice_local"] = dict(state.get("_choice_local", {}))
        self.__dict__["_choice_miss"] = {}
        self.__dict__.setdefault("_runtime_choice", True)
        _STATE.modules.add(self)

    def _kept_paths(self) -> set:
        return {(p, k[1]) for k, p in self._choice_local.items()}

    def _choice_reset(self) -> None:
        """Forget this module's local decisions (device or dtype moves)."""
        self._choice_local.clear()
        self._choice_miss.clear()

    def runtime_decisions(self) -> list[dict]:
        """The decisions this module has used so far: ``bucket, rows, dtype, path, times_ms`` (times when known)."""
        out = []
        dev = self._choice_device()
        for key, path in sorted(self._choice_local.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            times = {}
            if dev.type in ("cpu", "cuda"):
                d = _STATE.decisions.get(decision_key(dev, key[1], self._choice_layer() + key[2:], key[0]))
                times = dict(d.times_ms) if d is not None else {}
            out.append({"bucket": key[0], "rows": bucket_label(key[0]), "dtype": _dtype_name(key[1]),
                        "extra": key[2:], "path": path, "times_ms": times})
        return out
